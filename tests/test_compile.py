"""Compiling without running: `train.py --dry_run` on this CPU's devices, and for hardware this machine does not
have: TPU slices through libtpu's own compiler (the [tpu] extra, which the tests install), with the real Mosaic
Splash kernel, from a CPU-only machine."""

import collections
import dataclasses
import functools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent


def memory_rows(table: str) -> dict[str, float]:
    """The dry run's memory table: GiB per row name."""
    return {
        line[:28].strip(): float(line[28:].split()[0]) for line in table.splitlines() if line.endswith("GiB")
    }


@pytest.mark.parametrize(
    "name,topology,devices,kind",
    [
        ("v5p-512", "v5p:4x8x8", 256, "TPU v5"),  # gcloud counts v5p's TensorCores: 256 chips
        ("v6e-256", "v6e:16x16", 256, "TPU v6 lite"),
        ("v5litepod-256", "v5e:16x16", 256, "TPU v5 lite"),
        ("v4-128", "v4:4x4x4", 64, "TPU v4"),
        ("tpu7x-128", "tpu7x:4x4x4", 128, "TPU7x"),  # Ironwood: 64 chips, two devices each
        ("v5p:8x8x4", "v5p:8x8x4", 256, "TPU v5"),
        ("TPU7x:2x2x1", "tpu7x:2x2x1", 8, "TPU7x"),
    ],
)
def test_slices_by_the_names_gcloud_takes(name, topology, devices, kind):
    target = shard.compile_target(name)
    assert (target.topology, len(target.devices)) == (topology, devices)
    assert {d.device_kind for d in target.devices} == {kind} and {d.platform for d in target.devices} == {
        "tpu"
    }
    two = shard.compile_target(name, num_slices=2)
    assert len(two.devices) == 2 * devices and {d.slice_index for d in two.devices} == {0, 1}


def test_slice_names_that_are_not_slices_are_refused():
    for bad, hint in [
        ("v5p-100", "not a power-of-two slice of v5p"),
        ("v9-8", "expected an accelerator type"),
        ("v5p:4xfour", "expected a topology such as"),
    ]:
        with pytest.raises(ValueError, match=f"--topology '{bad}': .*{hint}"):
            shard.compile_target(bad)


@pytest.mark.parametrize("family", list(shard.TPU_FAMILIES))
def test_hbm_table_is_what_the_tpu_compiler_allows(family):
    """Each family's HBM per device, as the TPU compiler states it when a program does not fit."""
    target = shard.compile_target(f"{family}-8")
    mesh = Mesh(target.devices[:1], ("x",))
    big = jax.ShapeDtypeStruct((2**36,), jnp.float32, sharding=NamedSharding(mesh, P()))  # 256 GiB
    with pytest.raises(Exception, match="RESOURCE_EXHAUSTED") as e:
        jax.jit(lambda x: jnp.sin(x) + jnp.cos(x)).lower(big).compile()
    available = float(re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e.value)).group(1))
    assert target.hbm_per_device == int(available * 2**30)


def test_document_masked_splash_compiles_for_a_tpu_forward_and_backward():
    """Packed documents on the TPU path: Splash with segment ids (each position's document) and the sliding
    window, on each device's rows and heads, compiled by the TPU compiler into Mosaic kernels, its gradient too."""
    target = shard.compile_target("v5e:2x2")
    mesh = shard.make_mesh("fsdp=2,tensor=2", list(target.devices))
    layout = shard.Layout(mesh)
    spec = lambda *axes: NamedSharding(mesh, P(*axes))
    q = jax.ShapeDtypeStruct((4, 1024, 8, 128), jnp.bfloat16, sharding=spec("fsdp", None, "tensor"))
    kv = jax.ShapeDtypeStruct((4, 1024, 2, 128), jnp.bfloat16, sharding=spec("fsdp", None, "tensor"))
    documents = jax.ShapeDtypeStruct((4, 1024), jnp.int32, sharding=spec("fsdp"))
    loss = lambda q, k, v, d: olmo3.attention(q, k, v, 512, "splash", layout, d).astype(jnp.float32).sum()
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, documents).compile().as_text()
    calls = re.findall(r'custom_call_target="tpu_custom_call".*?op_name="([^"]*)"', hlo, re.DOTALL)
    assert sorted(re.search(r"(splash_mha_[a-z_]+?)/pallas_call", c).group(1) for c in calls) == [
        "splash_mha_dkv_segmented_no_residuals",  # the segmented kernels: the documents are in them
        "splash_mha_fwd_segmented_residuals",
    ], calls


@pytest.mark.slow
def test_train_step_compiles_for_a_tpu_with_the_mosaic_kernel_under_fsdp_and_tensor_parallelism():
    """A small OLMo 3 (sliding and full layers, grouped kv heads) for a v5e:2x2 with fsdp and tensor axes:
    every attention call is a Mosaic custom call (an interpreted kernel would be plain HLO), and the TPU
    compiler's memory figures add up."""
    target = shard.compile_target("v5e:2x2")
    mesh = shard.make_mesh("fsdp=2,tensor=2", list(target.devices))
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=512, compute=olmo3.Compute("bfloat16", "auto"))
    model_cfg = train.model_config(cfg, dataclasses.replace(olmo3.MODELS["tiny"], n_kv_heads=2))
    compute = train.compute_policy(cfg, mesh)
    assert compute.attention == "splash"  # chosen for the devices compiled for, not for this CPU
    compiled, inputs = train.compile_step(cfg, mesh, model_cfg, compute, n_micro=1)
    params, opt, batch = inputs.values()
    hlo = compiled.as_text()
    calls = re.findall(r'custom_call_target="tpu_custom_call".*?op_name="([^"]*)"', hlo, re.DOTALL)
    kernels = [
        re.search(r"attention/shard_map/.*/(splash_mha_[a-z_]+?)/pallas_call", c).group(1) for c in calls
    ]
    # The scan runs one group of 4 layers: 4 forward kernels, and 4 fused backward ones (dq, dk, dv in one).
    assert sorted(kernels) == ["splash_mha_dkv_no_residuals"] * 4 + ["splash_mha_fwd_residuals"] * 4, kernels
    mem = compiled.memory_analysis()
    per_device = lambda tree: sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
    assert mem.argument_size_in_bytes == pytest.approx(per_device((params, opt, batch)), rel=0.01)
    assert mem.alias_size_in_bytes >= per_device((params, opt)) * 0.99  # donated: updated in place
    assert 0 < mem.temp_size_in_bytes < target.hbm_per_device


@pytest.mark.slow
def test_without_microbatch_the_most_rows_that_fit_are_taken_at_once(capsys):
    """--microbatch unset, on devices that state their memory: the most rows per device at a time whose
    compiled step the TPU compiler says fits (a preset fits the chips it is given). The memory is set here
    between what 2 and 4 rows at once need, then below what one row needs. (The search is what is tested, so
    the tiny model is made smaller still: half as wide, a third of its MLP, an eighth of its vocabulary; rows of 64:
    its three TPU compiles take 16 s of CPU, not 41.)"""
    target = shard.compile_target("v5e:2x2")
    mesh = shard.make_mesh("fsdp=4", list(target.devices))
    cfg = dataclasses.replace(
        train.PRESETS["tiny"], global_batch=16, seq_len=64, compute=olmo3.Compute("float32", "reference")
    )
    fields = dict(d_model=128, n_heads=2, n_kv_heads=2, mlp_hidden=256, vocab_size=1024)
    model_cfg = train.model_config(cfg, dataclasses.replace(olmo3.MODELS["tiny"], **fields))
    compute = train.compute_policy(cfg, mesh)
    compile_for = functools.cache(lambda n_micro: train.compile_step(cfg, mesh, model_cfg, compute, n_micro))
    need = {rows: shard.memory_use(lambda: compile_for(4 // rows))[1] for rows in (1, 2, 4)}  # 4 per device
    assert need[1] < need[2] < need[4] < target.hbm_per_device
    choose = lambda hbm: train.fitting_microbatches(cfg, mesh, hbm, compile_for)
    assert choose(target.hbm_per_device) == 1  # the whole share fits
    assert choose((need[2] + need[4]) // 2) == 2
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("microbatch: 2 row(s) per device at a time (2 microbatches), the most that fit:")
    assert choose(need[1] // 2) == 4 and "and even that does not fit" in capsys.readouterr().out
    given = dataclasses.replace(cfg, microbatch=1)  # --microbatch given: taken as it is, nothing compiled
    assert train.fitting_microbatches(given, mesh, target.hbm_per_device, None) == 4
    assert capsys.readouterr().out == ""


def test_dry_run_prints_the_memory_table_per_device(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    args = ["--preset", "tiny", "--dry_run", "--mesh", "fsdp=-1", "--run_dir", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = out.stdout[out.stdout.index("dry run:") :]
    assert (
        "tiny on 8 devices, mesh {'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1}, 1 microbatch(es) of 1 rows x 256 per"
        in table
    )
    rows = memory_rows(table)
    assert list(rows) == [
        "parameters (fp32)",
        "optimizer state (fp32)",
        "batch",
        "activations + temporaries",
        "generated code",
        "total",
    ]  # (a CPU device states no memory limit)
    n_params = 7_606_528  # the tiny preset; each device holds an eighth (and the norm weights whole)
    assert rows["parameters (fp32)"] == pytest.approx(n_params * 4 / 8 / 2**30, abs=1e-3)
    assert rows["optimizer state (fp32)"] == pytest.approx(2 * rows["parameters (fp32)"], abs=2e-3)
    assert rows["activations + temporaries"] > 0
    assert rows["total"] >= sum(rows.values()) - rows["total"] - 1e-3
    flops = train.model_config(train.PRESETS["tiny"]).flops_per_token(256) * 8 * 256
    assert f"FLOPs per step: {flops:.3e}, {flops / 8:.3e} per device" in table
    assert not (tmp_path / "checkpoints").exists()  # it only compiles


@pytest.mark.slow
def test_dry_run_for_a_tpu_slice_prints_the_table_and_a_verdict_without_libtpu_noise(tmp_path):
    env = dict(
        os.environ, JAX_PLATFORMS=""
    )  # as a user runs it: train.py itself keeps the backend on the CPU
    args = [
        "--preset",
        "tiny",
        "--dry_run",
        "--topology",
        "v5litepod-4",
        "--mesh",
        "fsdp=2,tensor=2",
        "--dtype",
        "bfloat16",
        "--run_dir",
        str(tmp_path / "run"),
    ]
    out = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.strip() == "", out.stderr[-3000:]  # no TPU_ACCELERATOR_TYPE / worker-hostname warnings
    table = out.stdout[out.stdout.index("dry run:") :]
    assert (
        "v5litepod-4 (v5e:2x2), 4 devices of TPU v5 lite, mesh {'data': 1, 'fsdp': 2, 'context': 1, 'tensor': 2}"
        in table
    )
    assert "attention 'splash'" in table
    rows = memory_rows(table)
    assert list(rows) == [
        "parameters (fp32)",
        "optimizer state (fp32)",
        "batch",
        "activations + temporaries",
        "generated code",
        "total",
        "HBM",
    ]
    assert rows["HBM"] == 15.75
    spare = rows["HBM"] - rows["total"]
    assert f"fits, with {spare:.1f} GiB to spare" in table
    # What runs the matmuls: the 7 linears x 3 matmuls of the scanned group of 4 layers and the LM head's 3 (the
    # attention is Splash's kernel), all bf16 on the MXU.
    assert "\nmatmuls in the compiled step (the layer scan's body once): 87 bf16 (convolution)\n" in table
    # The evaluation steps, compiled too: the parameters and a forward pass's temporaries, no optimizer state.
    evals = dict(
        re.findall(r"^  (held-out \(LM\)|downstream tasks) +([\d.]+) GiB a device \(fits\)$", table, re.M)
    )
    assert evals.keys() == {"held-out (LM)", "downstream tasks"}, table
    for need in map(float, evals.values()):
        assert rows["parameters (fp32)"] < need < rows["total"] - rows["optimizer state (fp32)"]
    assert not (tmp_path / "run").exists()  # it only compiles
    # bench/dry_run.py's table row of this report: what it read is what was printed.
    sys.path.insert(0, str(ROOT / "bench"))
    import dry_run

    found = dry_run.report(out.stdout)
    row = dry_run.table_row(
        {"row": "tiny v5litepod-4 --mesh=fsdp=2,tensor=2 --dtype bfloat16", "seconds": 9, **found}
    )
    state = rows["parameters (fp32)"] + rows["optimizer state (fp32)"]
    want = ["| tiny", "v5litepod-4", "--mesh=fsdp=2,tensor=2 --dtype bfloat16", f"{state:.1f}"]
    want += [f"{rows[k]:.1f}" for k in ("activations + temporaries", "total", "HBM")]
    # The traffic table's rows and totals, as its JSON holds them and its row shows them (GiB).
    traffic = table[table.index("traffic per device per step") :].splitlines()[2:]
    *lines, total = traffic[: next(i for i, line in enumerate(traffic) if line.startswith("  total")) + 1]
    for line in lines:
        kind, dtype, n, size, floor, overlapped = line.replace(",", "").split()[:6]
        said = found["traffic"][f"{kind} {dtype}"]
        assert said == {
            "arrays": int(n),
            "MiB": float(size),
            "floor MiB": None if floor == "-" else float(floor),
            "overlapped": int(overlapped),
        }
    gib = [f"{float(x) / 1024:.1f}" for x in total.replace(",", "").split()[1:]]
    assert row.split(" | ") == [*want, f"fits, with {spare:.1f} GiB to spare", *gib, "9 |"], row


# ---- What a step sends between devices (the dry run's traffic table)

HLO_BYTES = {"f32": 4, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "s32": 4, "u32": 4, "pred": 1}


def hlo_traffic(hlo: str, devices: int) -> dict[tuple[str, str], list[int]]:
    """(collective, element type) -> [arrays, bytes], read line by line from a program without loops (each
    instruction runs once): the arrays of each collective's result (a tuple: each of them), gathered or summed
    whole: a reduce-scatter's result arrays are the shards of `devices` devices, an all-gather-start's and a
    reduce-scatter-start's results hold (their operands, their results)."""
    assert " while(" not in hlo
    found = collections.defaultdict(lambda: [0, 0])
    kinds = "all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute"
    for line in hlo.splitlines():
        if not (m := re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) ({kinds})(-start)?\(", line)):
            continue
        arrays = re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", m[1])
        if m[3] and m[2] in ("all-gather", "reduce-scatter"):
            arrays = arrays[len(arrays) // 2 :]
        for dtype, dims in arrays:
            size = math.prod(int(d) for d in dims.split(",") if d) * HLO_BYTES[dtype]
            found[m[2], dtype][0] += 1
            found[m[2], dtype][1] += size * (devices if m[2] == "reduce-scatter" else 1)
    return dict(found)


def gradient_sums(hlo: str) -> list[tuple[str, str]]:
    """(collective, result type) of the collectives that sum: reduce-scatters and all-reduces that add (not fp8's scales'
    maximum), but not XLA's gathers of small arrays (an all-reduce of zero-padded shards: each operand a
    dynamic-update-slice)."""
    defined = {m[1]: line for line in hlo.splitlines() if (m := re.match(r"\s*(?:ROOT )?%(\S+) = ", line))}
    roots = {m[1]: m[2] for m in re.finditer(r"^%([\w.\-]+) .*?^  ROOT (.*?)$", hlo, re.M | re.S)}
    sums = []
    for line in hlo.splitlines():
        if m := re.search(r" (reduce-scatter|all-reduce)(?:-start)?\(([^)]*)\)", line):
            combine = roots[re.search(r"to_apply=%([\w.\-]+)", line)[1]]
            operands = re.findall(r"%([\w.\-]+)", m[2])
            gathers = m[1] == "all-reduce" and all(" dynamic-update-slice(" in defined[n] for n in operands)
            if " add(" in combine and not gathers:
                sums.append((m[1], line[line.index(" = ") + 3 : m.start()]))
    return sums


@pytest.mark.parametrize("topology", ["tpu7x-8", "h200x8"])
def test_every_gradient_is_summed_in_fp32_and_the_traffic_table_is_the_hlo_s(topology, capsys):
    """The tiny bf16 step for 8 devices split by fsdp, --reduce_dtype float32 (the default): every collective
    that sums holds fp32 only (before: each weight's gradient reduce-scattered in bf16, as the bf16 gradient
    autodiff makes). And the dry run's traffic table is the compiled program's, read here line by line."""
    if topology.startswith("h200"):
        pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    target = shard.compile_target(topology)
    mesh = shard.make_mesh("fsdp=8", list(target.devices))
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=128, compute=olmo3.Compute("bfloat16", "auto"))
    model_cfg, compute = train.model_config(cfg), train.compute_policy(cfg, mesh)
    hlo = train.compile_step(cfg, mesh, model_cfg, compute, n_micro=1)[0].as_text()
    sums = gradient_sums(hlo)
    assert "reduce-scatter" in dict(sums)  # FSDP's: the weights' gradients, and no other here
    for kind, types in sums:
        assert set(re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[", types)) == {"f32"}, (kind, types)

    want = hlo_traffic(hlo, devices=8)
    assert {k: v[:2] for k, v in shard.traffic(shard.collectives(hlo)).items()} == want
    train.report_traffic(hlo, train.traffic_floor(cfg, mesh, model_cfg, compute, 1))
    printed = capsys.readouterr().out
    for (kind, dtype), (arrays, size) in want.items():
        assert re.search(rf"^  {kind} +{dtype} +{arrays} +{size / 2**20:,.1f} ", printed, re.M), (kind, dtype)


# ---- NVIDIA GPUs: the CUDA plugin's compile-only devices. The plugin is 2.5 GB, so CI does not install it;
# rerun these with: pip install -e ".[gpu,test]" && pytest tests/test_compile.py -k gpu


def gpu_compile(topology: str, mesh_spec: str, head_layout: str = "", kv_heads: int = 0, **packing):
    """The tiny step compiled for GPUs: how many cuDNN attention calls forward and backward, and (packed rows)
    the documents a row each call was compiled for."""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    target = shard.compile_target(topology)
    mesh = shard.make_mesh(mesh_spec, list(target.devices))
    compute = olmo3.Compute("bfloat16", "auto", max_documents=packing.pop("max_documents", 0))
    cfg = dataclasses.replace(
        train.PRESETS["tiny"], seq_len=512, head_layout=head_layout, compute=compute, **packing
    )
    compute = train.compute_policy(cfg, mesh)
    assert compute.attention == "cudnn"  # chosen for the devices compiled for, not for this CPU
    model_cfg = train.model_config(cfg)
    model_cfg = dataclasses.replace(model_cfg, n_kv_heads=kv_heads) if kv_heads else model_cfg
    compiled, _ = train.compile_step(cfg, mesh, model_cfg, compute, n_micro=1)
    hlo = compiled.as_text()
    calls = {
        k: hlo.count(f'custom_call_target="__cudnn${k}"') for k in ("fmhaSoftmax", "fmhaSoftmaxBackward")
    }
    return calls, set(map(int, re.findall(r'max_seg_per_batch\\?":\s*(\d+)', hlo)))


@pytest.mark.parametrize("topology,mesh_spec", [("h200x1", "fsdp=1"), ("h200x8", "fsdp=4,tensor=2")])
def test_gpu_train_step_compiles_with_cudnn_sliding_window_attention(topology, mesh_spec):
    # One group of 4 layers in the scan: 4 cuDNN attention calls forward and 4 backward.
    assert gpu_compile(topology, mesh_spec) == ({"fmhaSoftmax": 4, "fmhaSoftmaxBackward": 4}, {1})


@pytest.mark.parametrize("topology,mesh_spec", [("h200x1", "fsdp=1"), ("h200x8", "fsdp=4,tensor=2")])
@pytest.mark.parametrize("kv_heads", [0, 2])  # the preset's heads; grouped-query attention (2 kv heads of 4)
def test_gpu_packed_rows_compile_to_cudnn_s_packed_layout(topology, mesh_spec, kv_heads):
    """Packed rows (stage 3) on cuDNN: every attention call, sliding and full, forward and backward, in the
    packed layout compiled for the bound on a row's documents. What cuDNN computes of it only a GPU shows; the
    segments it is given are checked against the document mask in tests/test_long_context.py."""
    got = gpu_compile(topology, mesh_spec, kv_heads=kv_heads, pack_files=2, max_documents=5)
    assert got == ({"fmhaSoftmax": 4, "fmhaSoftmaxBackward": 4}, {5})


def test_gpu_head_dim_256_is_allowed_as_on_hopper():
    """JAX asks the default backend (this CPU) whether the GPU is a Hopper; the target answers instead."""
    assert gpu_compile("h100x1", "fsdp=1", head_layout="1x256")[0] == {
        "fmhaSoftmax": 4,
        "fmhaSoftmaxBackward": 4,
    }


# ---- FP8 (--fp8 tensorwise, the 7b-long-context preset): what the dry run says runs the matmuls


def fp8_linear_hlo(devices, fp8: bool) -> str:
    """A linear's forward and backward (d 512 -> 1024, bf16 activations, the fp32 master weight), fp8_linear's
    or the bf16 one's, compiled for `devices[0]`, as text."""
    mesh = Mesh(np.array(devices[:1]), ("d",))
    whole = NamedSharding(mesh, P())
    linear = olmo3.fp8_linear if fp8 else lambda x, w: olmo3.linear(x, w.astype(x.dtype))
    step = lambda x, w, g: jax.vjp(linear, x, w)[1](g)
    x, g = (jax.ShapeDtypeStruct((4, 256, n), jnp.bfloat16, sharding=whole) for n in (512, 1024))
    w = jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=whole)
    return jax.jit(lambda x, w, g: (linear(x, w), *step(x, w, g))).lower(x, w, g).compile().as_text()


def test_the_dry_run_s_matmul_count_tells_fp8_from_bf16_as_compiled():
    """train.matmul_kinds (the dry run's "matmuls" line) on what libtpu compiles for Ironwood: fp8_linear's three
    matmuls are convolutions on fp8 operands (the MXU's fp8), the bf16 linear's on bf16 ones; on this CPU the
    fp8 ones are f32 dots (XLA:CPU converts f8 operands first: fp8's numbers, not its speed)."""
    ironwood = shard.compile_target("tpu7x:2x2x1").devices
    assert train.matmul_kinds(fp8_linear_hlo(ironwood, fp8=True)) == {"fp8 (convolution)": 3}
    assert train.matmul_kinds(fp8_linear_hlo(ironwood, fp8=False)) == {"bf16 (convolution)": 3}
    assert train.matmul_kinds(fp8_linear_hlo(jax.devices(), fp8=True)) == {"f32 (dot)": 3}


def fp8_dry_run(run_dir, topology: str, mesh: str, seq_len: int = 512) -> tuple[str, dict]:
    """The tiny preset's dry run, stage 3's compute policy (bf16, --fp8 tensorwise), compiled for `topology`:
    its matmul line, and its traffic table's (collective, element type) -> (arrays, MiB as printed)."""
    env = dict(os.environ, JAX_PLATFORMS="")  # as a user runs it: train.py keeps the backend on the CPU
    args = ["--preset", "tiny", "--dry_run", "--topology", topology, "--mesh", mesh, "--dtype", "bfloat16"]
    args += ["--fp8", "tensorwise", "--seq_len", str(seq_len), "--run_dir", str(run_dir)]
    out = subprocess.run(
        [sys.executable, "train.py", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "bfloat16, fp8 tensorwise (the block linears)" in out.stdout
    matmuls = re.search(
        r"^matmuls in the compiled step \(the layer scan's body once\): (.*)$", out.stdout, re.M
    )
    rows = re.findall(r"^  ([a-z-]+) +(\w+) +(\d+) +([\d,.]+) ", out.stdout, re.M)
    return matmuls[1], {(kind, dtype): (int(n), size) for kind, dtype, n, size in rows}


# The tiny model's block linears as an fp8 all-gather sends them to a device of a tensor axis of 2: 4 layers of
# q, k, v, o (256 x 256) and gate, up, down (256 x 768), each halved by the tensor axis, one byte an element.
FP8_GATHERED = (4 * 7, f"{4 * (4 * 256 * 256 + 3 * 256 * 768) / 2 / 2**20:,.1f}")


@pytest.mark.slow
def test_the_dry_run_for_ironwood_with_fp8_shows_every_block_matmul_on_fp8_operands(tmp_path):
    """7 linears x 3 matmuls (forward, the two gradients) in each of the scanned group's 4 layers on fp8
    operands; the LM head's 3 in bf16. Every block linear's weight is all-gathered as e4m3 bits, as torchao's
    fp8 all-gather sends it (before: its fp32 master, 4x the bytes). (Rows of 128 tokens: the matmuls are the
    same, and the TPU compiler takes 30 s, not 38.)"""
    matmuls, traffic = fp8_dry_run(tmp_path, "tpu7x-8", "fsdp=4,tensor=2", seq_len=128)
    assert matmuls == "84 fp8 (convolution), 3 bf16 (convolution)"
    assert traffic["all-gather", "f8e4m3fn"] == FP8_GATHERED
    assert ("all-gather", "f32") not in traffic, traffic


def test_fp8_over_a_context_axis_gathers_the_fp8_weights_and_no_activation():
    """Stage 3's layout (rows over fsdp, each row's positions over context) with --fp8 tensorwise, for
    Ironwood: the step gathers the block linears' weights as e4m3, twice (--remat full recomputes the layer),
    and nothing else in fp8 or fp32: no fp8 activation, no e5m2 gradient, no fp32 master (before, flattening
    rows and positions into one axis made XLA gather every fp8 activation, and e5m2 and fp32 ones too)."""
    target = shard.compile_target("tpu7x-8")
    mesh = shard.make_mesh("fsdp=2,context=4", list(target.devices))
    compute = olmo3.Compute("bfloat16", "local", remat="full", fp8="tensorwise")
    # Rows of 256 tokens, 64 a device (the window): the old flattening gathers here as at 1024 (f32, e5m2 and
    # 80 e4m3 arrays), and the TPU compiler takes 25 s, not 37.
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=256, global_batch=4, compute=compute)
    hlo = train.compile_step(cfg, mesh, train.model_config(cfg), compute, n_micro=1)[0].as_text()
    gathered = {dtype: v for (kind, dtype), v in hlo_traffic(hlo, devices=8).items() if kind == "all-gather"}
    weights = 4 * (4 * 256 * 256 + 3 * 256 * 768)  # 4 layers' q, k, v, o and gate, up, down, a byte each
    assert gathered["f8e4m3fn"] == [2 * 4 * 7, 2 * weights], gathered
    assert gathered.keys() <= {"f8e4m3fn", "bf16"}, gathered


# Rerun with the [gpu] extra: pip install -e ".[gpu,test]" && pytest tests/test_compile.py -k gpu
def test_gpu_dry_run_with_fp8_shows_every_block_matmul_as_a_cublaslt_fp8_gemm(tmp_path):
    """For 8 H200s (fsdp and tensor axes): every block matmul a cuBLASLt fp8 GEMM, the LM head's 3 bf16 cuBLASLt
    GEMMs (a dry run starts no backend before it names the target, so shard.gpu_target's Triton flag holds);
    every block linear's weight all-gathered as e4m3 bits, and nothing gathered in fp32."""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    matmuls, traffic = fp8_dry_run(tmp_path, "h200x8", "fsdp=4,tensor=2")  # cuDNN attention: the GPU's choice
    assert matmuls == "84 fp8 (__cublas$lt$matmul$f8), 3 bf16 (__cublas$lt$matmul)"
    assert traffic["all-gather", "f8e4m3fn"] == FP8_GATHERED
    assert ("all-gather", "f32") not in traffic, traffic
