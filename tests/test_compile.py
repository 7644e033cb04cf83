"""Compiling without running: `train.py --dry_run` on this CPU's devices, and for hardware this machine does not
have: TPU slices through libtpu's own compiler (the [tpu] extra, which the tests install), with the real Mosaic
Splash kernel, from a CPU-only machine."""

import collections
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import ckpt
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
    compiled step the TPU compiler says fits, FIT_MARGIN of the memory kept free (a preset fits the chips it is
    given). The memory is set here so that what the search may fill lies between what 2 and 4 rows at once
    need, then below what one row needs. (The search is what is tested, so the tiny model is made smaller
    still: half as wide, a third of its MLP, an eighth of its vocabulary; rows of 64: its three TPU compiles
    take 16 s of CPU, not 41.)"""
    target = shard.compile_target("v5e:2x2")
    mesh = shard.make_mesh("fsdp=4", list(target.devices))
    cfg = dataclasses.replace(
        train.PRESETS["tiny"], global_batch=16, seq_len=64, compute=olmo3.Compute("float32", "reference")
    )
    fields = dict(d_model=128, n_heads=2, n_kv_heads=2, mlp_hidden=256, vocab_size=1024)
    model_cfg = train.model_config(cfg, dataclasses.replace(olmo3.MODELS["tiny"], **fields))
    compute = train.compute_policy(cfg, mesh)
    assert compute.remat == "none"  # the tiny preset's own: taken as given, no policy searched
    compile_for = functools.cache(lambda n, _: train.compile_step(cfg, mesh, model_cfg, compute, n))
    need = {rows: shard.memory_use(lambda: compile_for(4 // rows, "none"))[1] for rows in (1, 2, 4)}  # of 4
    assert need[1] < need[2] < need[4] < target.hbm_per_device
    hbm = lambda room: int(room / (1 - train.FIT_MARGIN))  # the memory whose search may fill `room`
    choose = lambda room: train.fitting_microbatches(cfg, mesh, hbm(room), compile_for)
    assert choose(target.hbm_per_device) == (1, "none")  # the whole share fits
    assert choose((need[2] + need[4]) // 2) == (2, "none")
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith("microbatch: 2 row(s) per device at a time (2 microbatches), the most that fit:")
    assert choose(need[1] // 2) == (4, "none") and "and even that does not fit" in capsys.readouterr().out
    given = dataclasses.replace(cfg, microbatch=1)  # --microbatch given: taken as it is, nothing compiled
    assert train.fitting_microbatches(given, mesh, target.hbm_per_device, None) == (4, "none")
    assert capsys.readouterr().out == ""


@functools.cache
def deep_steps(topology: str):
    """The tiny model made deep and narrow (16 layers, width 128, vocabulary 1,024), so that its layers'
    activations are most of a step's memory and remat has 4 layer groups to save between; 4 rows of 1,024
    tokens, bf16, compiled for `topology` (fsdp over its devices, its own attention kernel): the config, mesh,
    model and a compile_for(n_micro, remat) that compiles each step once."""
    target = shard.compile_target(topology)
    mesh = shard.make_mesh(f"fsdp={min(4, len(target.devices))}", list(target.devices)[:4])
    compute = olmo3.Compute("bfloat16", "auto", remat="auto")
    cfg = dataclasses.replace(train.PRESETS["tiny"], global_batch=4, seq_len=1024, compute=compute)
    tiny = olmo3.MODELS["tiny"]
    fields = dict(n_layers=16, layer_types=tiny.layer_types * 4, d_model=128, n_heads=2, n_kv_heads=2)
    model_cfg = train.model_config(cfg, dataclasses.replace(tiny, **fields, mlp_hidden=256, vocab_size=1024))
    with_remat = lambda remat: dataclasses.replace(train.compute_policy(cfg, mesh), remat=remat)
    compile_for = functools.cache(
        lambda n, remat: train.compile_step(cfg, mesh, model_cfg, with_remat(remat), n)
    )
    return cfg, mesh, model_cfg, compile_for


@pytest.mark.slow
def test_remat_auto_takes_the_policy_that_recomputes_least_of_those_that_fit(capsys):
    """--remat auto on a TPU: each policy compiled at one row per device, lightest first; the first whose
    step fits in all but FIT_MARGIN of the memory is taken: none where memory allows, save_matmuls where only
    it and full fit, full where only full fits or nothing does. An explicit --remat is taken as given, and
    devices that state no memory get full. (Three TPU compiles of a small model, about 20 s each here.)"""
    cfg, mesh, _, compile_for = deep_steps("v5e:2x2")  # one row per device
    need = {
        remat: shard.memory_use(lambda: compile_for(1, remat))[1]
        for remat in ("none", "save_matmuls", "full")
    }
    assert need["none"] > need["save_matmuls"] > need["full"], need  # less kept, less memory
    hbm = lambda room: int(room / (1 - train.FIT_MARGIN))  # the memory whose search may fill `room`
    choose = lambda room: train.fitting_microbatches(cfg, mesh, hbm(room), compile_for)
    assert choose(2 * need["none"]) == (1, "none")
    assert choose((need["none"] + need["save_matmuls"]) // 2) == (1, "save_matmuls")
    said = capsys.readouterr().out.splitlines()[-1]
    assert said.startswith(
        "remat: save_matmuls (--remat auto): the policy that recomputes least of those that fit 1 row(s) per "
        "device at a time within"
    ), said
    assert choose((need["save_matmuls"] + need["full"]) // 2) == (1, "full")
    assert choose(need["full"] // 2) == (1, "full") and "no policy fits" in capsys.readouterr().out
    given = dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, remat="save_matmuls"))
    assert train.fitting_microbatches(given, mesh, hbm(need["full"]), compile_for) == (1, "save_matmuls")
    assert train.fitting_microbatches(cfg, mesh, None, None) == (1, "full")  # a CPU's devices
    assert "remat: full (--remat auto, on devices that state no memory" in capsys.readouterr().out


def expected_recompute(cfg, model_cfg, remat: str) -> float:
    """What a step computes over what the model counts (flops_per_token), from the model's shapes alone: the
    fused attention kernels' backward recomputes the scores (one matmul over the kept pairs, beyond the model's
    six); save_matmuls recomputes the attention forward too (two); full every layer's forward (and the two)."""
    m, seq, rows = model_cfg, cfg.seq_len, cfg.global_batch
    model = m.flops_per_token(seq) * rows * seq
    pairs = rows * sum(m.attention_pairs(seq, t) for t in m.layer_types)
    scores = 2 * m.n_heads * m.head_dim * pairs  # one matmul over every kept (query, key) pair
    linears = (
        2
        * rows
        * seq
        * m.n_layers
        * m.d_model
        * ((2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim + 3 * m.mlp_hidden)
    )
    again = {"none": scores, "save_matmuls": 3 * scores, "full": 3 * scores + linears}[remat]
    return (model + again) / model


@pytest.mark.slow
@pytest.mark.parametrize(
    "topology,policies", [("v5e:2x2", ("none", "save_matmuls", "full")), ("h200x1", ("none", "full"))]
)
def test_the_recompute_factor_counts_what_the_compiled_step_runs(topology, policies):
    """train.recompute_factor (the dry run's "recompute" line) on Splash (TPU) and cuDNN (GPU) steps, against
    expected_recompute: none ~1.00, full ~1 + the forward's share (here 1.2: the LM head, which no policy
    recomputes, is a large part of this small model)."""
    if topology.startswith("h200"):
        pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    cfg, mesh, model_cfg, compile_for = deep_steps(topology)
    for remat in policies:
        hlo = compile_for(1, remat)[0].as_text()
        factor = train.recompute_factor(hlo, cfg, mesh, model_cfg)
        assert factor == pytest.approx(expected_recompute(cfg, model_cfg, remat), rel=1e-3), remat


def test_matmul_flops_are_the_multiply_adds_of_each_matmul_as_often_as_it_runs():
    """shard.matmul_flops on a hand-made program: a dot with two contracted and a batch dimension, a
    windowed convolution and a cuBLAS GEMM in a loop run 3 times. Each matmul's multiply-adds counted
    one by one: the sum of its output computed on operands of ones (every term a 1)."""
    hlo = """HloModule hand_made

%cond (c: (s32[], f32[3,4,5,6])) -> pred[] {
  %c = (s32[], f32[3,4,5,6]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[3,4,5,6])) -> (s32[], f32[3,4,5,6]) {
  %p = (s32[], f32[3,4,5,6]{3,2,1,0}) parameter(0)
  %a = f32[3,4,5,6]{3,2,1,0} get-tuple-element(%p), index=1
  %b = f32[3,6,5,7]{3,2,1,0} constant({...})
  %dot = f32[3,4,7]{2,1,0} dot(%a, %b), lhs_batch_dims={0}, lhs_contracting_dims={2,3}, rhs_batch_dims={0}, rhs_contracting_dims={2,1}
  %x = f32[2,9,4]{2,1,0} constant({...})
  %k = f32[3,4,5]{2,1,0} constant({...})
  %conv = f32[2,7,5]{2,1,0} convolution(%x, %k), window={size=3}, dim_labels=b0f_0io->b0f
  %l = bf16[8,32]{1,0} constant({...})
  %r = bf16[32,16]{1,0} constant({...})
  %gemm = (bf16[8,16]{1,0}, s8[4194304]{0}) custom-call(%l, %r), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %j = s32[] get-tuple-element(%p), index=0
  %one = s32[] constant(1)
  %next = s32[] add(%j, %one)
  ROOT %t = (s32[], f32[3,4,5,6]{3,2,1,0}) tuple(%next, %a)
}

ENTRY %main (x: f32[3,4,5,6]) -> (s32[], f32[3,4,5,6]) {
  %x0 = f32[3,4,5,6]{3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[3,4,5,6]{3,2,1,0}) tuple(%zero, %x0)
  ROOT %w = (s32[], f32[3,4,5,6]{3,2,1,0}) while(%init), condition=%cond, body=%body
}
"""
    ones = lambda *shape: jnp.ones(shape, jnp.float32)
    dot = jnp.einsum("bikl,blkj->bij", ones(3, 4, 5, 6), ones(3, 6, 5, 7))
    conv = jax.lax.conv_general_dilated(
        ones(2, 9, 4), ones(3, 4, 5), (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC")
    )
    assert conv.shape == (2, 7, 5)
    gemm = ones(8, 32) @ ones(32, 16)
    multiply_adds = sum(int(out.sum()) for out in (dot, conv, gemm))
    assert shard.matmul_flops(hlo) == (3 * 2 * multiply_adds, [])


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
    # The tiny preset's remat none: nothing computed twice but Splash's backward's scores (0.3% here).
    assert "\nrecompute: 1.00× the model's FLOPs (the compiled step's matmuls," in table
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
    assert found["recompute"] == 1.0
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
    hlo = gpu_step_hlo(topology, mesh_spec, head_layout, kv_heads, **packing)
    calls = {
        k: hlo.count(f'custom_call_target="__cudnn${k}"') for k in ("fmhaSoftmax", "fmhaSoftmaxBackward")
    }
    return calls, set(map(int, re.findall(r'max_seg_per_batch\\?":\s*(\d+)', hlo)))


def gpu_step_hlo(topology: str, mesh_spec: str, head_layout: str = "", kv_heads: int = 0, **packing) -> str:
    """The tiny step compiled for GPUs (bf16, the attention the devices take: cuDNN), as XLA's text."""
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
    return compiled.as_text()


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


def cudnn_backward_configs(hlo: str) -> list[dict]:
    """The cuDNN attention parameters of each backward call of a compiled program, as XLA holds them."""
    calls = re.findall(r'custom_call_target="__cudnn\$fmhaSoftmaxBackward".*?backend_config=(\{.*)', hlo)
    return [json.JSONDecoder().raw_decode(text)[0]["cudnn_fmha_backend_config"] for text in calls]


@pytest.mark.parametrize(
    "deterministic,packing",
    [(True, {}), (True, dict(pack_files=2, max_documents=5)), (False, {})],
    ids=["deterministic", "deterministic-packed", "nondeterministic"],
)
def test_gpu_every_cudnn_backward_call_is_marked_deterministic_under_deterministic_ops(
    deterministic, packing, monkeypatch
):
    """Under deterministic ops (train.py's default) every cuDNN attention backward call of the step carries
    force_deterministic: XLA marks only the first of several identical ones, and the others then fail at
    their first run (shard.deterministic_cudnn_backward). The tiny group (sliding x3, full) has four calls,
    three identical, as OLMo 3's; packed rows reach cuDNN through JAX's cuDNN module, the others through
    jax.nn.dot_product_attention. With --deterministic=false none is marked.

    Without a GPU, XLA's cuDNN pass does not run (the calls' workspaces stay u8[0]), so XLA's own marking of
    the first call is not seen here: unmarked calls are what the step compiles to without the workaround."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    name = "create_dot_product_attention_backend_config"
    jax_own = getattr(cudnn, name)
    monkeypatch.setattr(cudnn, name, getattr(jax_own, "__wrapped__", jax_own))  # as if no run started here
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    if deterministic:
        shard.deterministic_gpu_ops()  # as train.start_devices; XLA's flags were read already: compile-only,
        # where the cuDNN pass does not run, the step compiles the same without them
    configs = cudnn_backward_configs(gpu_step_hlo("h200x1", "fsdp=1", **packing))
    assert [c.get("force_deterministic", False) for c in configs] == [deterministic] * 4
    windows = collections.Counter(json.dumps(c, sort_keys=True) for c in configs)
    assert sorted(windows.values()) == [1, 3]


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "nondeterministic"])
def test_every_cudnn_backward_call_is_marked_as_jax_lowers_the_step_for_a_gpu(deterministic, monkeypatch):
    """The test above without the [gpu] extra, as CI runs: the tiny step's loss gradient lowered for a GPU by
    JAX's own cuDNN lowering, where the workaround acts (nothing compiled). JAX asks the GPU for its cuDNN
    version and compute capability; they are answered for an H200 with cuDNN 9.28."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    name = "create_dot_product_attention_backend_config"
    jax_own = getattr(cudnn, name)
    monkeypatch.setattr(cudnn, name, getattr(jax_own, "__wrapped__", jax_own))  # as if no run started here
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 92800)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: float(capability) <= 9.0)
    monkeypatch.setattr(cudnn, "is_cuda_compute_capability_equal", lambda capability: capability == "9.0")
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    if deterministic:
        shard.deterministic_gpu_ops()
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=256)
    model = olmo3.abstract(train.model_config(cfg), olmo3.Compute("bfloat16", "cudnn"))
    rows = jax.ShapeDtypeStruct((2, cfg.seq_len), jnp.int32)
    loss = lambda m, t: train.loss_fn(m, t, jnp.ones(2, bool), jnp.full(2, 0.5), cfg)[0]
    dynamic, static = eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    grad = jax.jit(jax.grad(lambda dynamic, t: loss(eqx.combine(dynamic, static), t)))
    text = grad.trace(dynamic, rows).lower(lowering_platforms=("cuda",)).as_text()
    found = re.findall(r'fmhaSoftmaxBackward\(.*?backend_config = "(.*?)"', text)  # MLIR writes " as \22
    configs = [json.loads(c.replace("\\22", '"'))["cudnn_fmha_backend_config"] for c in found]
    assert [c.get("force_deterministic", False) for c in configs] == [deterministic] * 4


def gemm_for(device, options: dict) -> None:
    """A bf16 GEMM compiled for `device` with XLA's `options`."""
    like = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16, sharding=jax.sharding.SingleDeviceSharding(device))
    jax.jit(lambda a: a @ a).lower(like).compile(options)


def test_gpu_a_run_s_first_start_tunes_its_gemms_once_and_keeps_xla_s_choices_in_the_run_directory(tmp_path):
    """Under deterministic ops XLA's autotuner takes the first GEMM configuration that compiles unless its
    cache holds a choice: a run's first start on a GPU compiles the step once more, tuned as without them,
    XLA writing its choices to a file the run keeps, one per GPU kind and jaxlib. Compile-only nothing is
    tuned and XLA writes no file (written here in its place): that a GPU's compile writes it, and that a
    deterministic compile then takes its choices, only a GPU shows."""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    device = shard.compile_target("h200x1").devices[0]
    given = []

    def compile_step(options):
        gemm_for(device, options)  # the GPU compiler takes them
        given.append(options)
        Path(options["xla_gpu_dump_autotune_results_to"]).write_text("XLA's choices")

    ckpt.autotuned_gemms(str(tmp_path), device, compile_step, say=lambda *_: None)
    assert given == [{"xla_gpu_deterministic_ops": False, "xla_gpu_dump_autotune_results_to": mock.ANY}]
    kept = tmp_path / "autotune" / f"NVIDIA_H200_141GB_HBM3e-jaxlib{jaxlib.__version__}.textproto"
    assert kept.read_text() == "XLA's choices"


def test_gpu_a_later_start_has_xla_load_the_kept_choices_and_one_it_cannot_load_stops_the_run(tmp_path):
    """A later start tunes nothing: XLA loads the kept file (once per process: this is the suite's only
    load). One it cannot parse stops the run in a line naming it."""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    device = shard.compile_target("h200x1").devices[0]
    kept = tmp_path / "autotune" / shard.autotune_name(device)
    kept.parent.mkdir()
    kept.write_text("not XLA's choices")
    with pytest.raises(
        ckpt.RunDirError, match=f"^{re.escape(str(kept))}: XLA cannot load these GEMM choices"
    ):
        ckpt.autotuned_gemms(str(tmp_path), device, compile_step=None, say=lambda *_: None)


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
