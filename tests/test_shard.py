"""shard.py: the mesh, the logical-axis rules, the multi-host start, and the proof that sharding never
changes the numbers: every layout is checked against the single-device run, because XLA can silently
compute wrong results for some FSDP + tensor-parallel specs on the 8-device CPU mesh (jax 0.8-0.10: the MLP
pattern in test_the_rules_mlp_layout_is_exact_in_the_pattern_xla_miscompiles, off by ~5 on outputs of ~5).
"""

import dataclasses
import functools
import json
import math
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from commands import with_cpu_devices
from jax.sharding import AbstractMesh, AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float
from servers import free_port
from tolerance import FP32, attention_terms, chain, grad_terms, loss_terms, sum_tol, token_terms

import data
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent


# ---- the mesh


def test_parse_mesh_fills_the_rest_and_names_the_flag_in_errors():
    assert shard.parse_mesh("data=2,fsdp=-1", 8) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert shard.parse_mesh("tensor=2, fsdp=-1", 8) == {"data": 1, "fsdp": 4, "context": 1, "tensor": 2}
    assert shard.parse_mesh("", 8) == {"data": 1, "fsdp": 1, "context": 1, "tensor": 1}
    with pytest.raises(ValueError, match=r"--mesh 'data=3,fsdp=-1': 8 devices do not divide by the other"):
        shard.parse_mesh("data=3,fsdp=-1", 8)
    with pytest.raises(ValueError, match=r"--mesh 'data=-1,fsdp=-1': at most one axis may be -1"):
        shard.parse_mesh("data=-1,fsdp=-1", 8)
    with pytest.raises(ValueError, match=r"--mesh 'fsdp=4,tensor=4' needs 16 devices but there are 8"):
        shard.parse_mesh("fsdp=4,tensor=4", 8)
    for bad in ["model=2", "data=0", "data=two", "data=2,data=4", "fsdp=-2"]:
        with pytest.raises(ValueError, match=f"--mesh '{bad}': expected entries like data=2,fsdp=-1"):
            shard.parse_mesh(bad, 8)


def test_make_mesh_spans_all_devices_or_the_first_few():
    mesh = shard.make_mesh("data=2,fsdp=-1,tensor=2")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert list(shard.make_mesh("data=1").devices.flat) == jax.devices()[:1]  # the tiny preset's default


class FakeDevice:
    """Just what the mesh utilities read from a device."""

    def __init__(self, id, slice_index=None, platform="cpu"):
        self.id, self.platform, self.device_kind = id, platform, "fake"
        if slice_index is not None:
            self.slice_index = slice_index

    def __repr__(self):
        return f"d{self.id}"


def test_device_grid_puts_the_slow_network_on_the_outer_axis():
    where = lambda grid, f: np.vectorize(f)(grid)
    # Two TPU slices of 4 chips: the slice boundary goes on data, else fsdp; never on tensor.
    slices = [FakeDevice(i, slice_index=i // 4) for i in range(8)]
    grid = shard.device_grid({"data": 2, "fsdp": 4, "context": 1, "tensor": 1}, slices)
    assert grid.shape == (2, 4, 1, 1)
    assert (where(grid, lambda d: d.slice_index) == [[[[0]]] * 4, [[[1]]] * 4]).all()
    grid = shard.device_grid({"data": 1, "fsdp": 4, "context": 1, "tensor": 2}, slices)
    assert (where(grid, lambda d: d.slice_index)[0, :, 0] == [[0, 0], [0, 0], [1, 1], [1, 1]]).all()
    with pytest.raises(ValueError, match="the 2 slices must divide the data or the fsdp axis"):
        shard.device_grid({"data": 1, "fsdp": 1, "context": 1, "tensor": 8}, slices)
    # Two GPU hosts of 4 (one process per GPU, as srun starts them): by id, so tensor stays within a host.
    gpus = [FakeDevice(i, platform="gpu") for i in reversed(range(8))]
    grid = shard.device_grid({"data": 1, "fsdp": 2, "context": 1, "tensor": 4}, gpus)
    assert (where(grid, lambda d: d.id // 4)[:, :, 0] == [[[0] * 4, [1] * 4]]).all()


# ---- the rules


@pytest.mark.parametrize("preset", list(olmo3.MODELS))
def test_rules_cover_every_parameter_and_the_optimizer_state(preset):
    """Abstract shapes only (eval_shape): the 32B model costs nothing here."""
    model = olmo3.abstract(olmo3.MODELS[preset])
    opt = eqx.filter_eval_shape(train.init_opt, model, train.PRESETS["7b"])
    # The 8 test devices, and a pod-sized mesh that needs no devices to check.
    for mesh in [shard.make_mesh("data=2,fsdp=2,tensor=2"), AbstractMesh((2, 64, 1, 4), shard.MESH_AXES)]:
        for tree in (model, opt):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nothing over 1 MB left replicated
                assert shard.check_rules(tree, mesh) == []
    axes = shard.logical_axes(model)
    assert axes.embed_tokens == ("vocab", "embed")
    assert axes.layers.self_attn.q_proj == ("layers", "embed", "heads", "head_dim")
    assert axes.layers.mlp.down_proj == ("layers", "mlp", "embed")
    assert shard.logical_axes(opt).mu.layers.post_attention_layernorm == ("layers", "embed")


def test_specs_on_a_pod_mesh():
    model = olmo3.abstract(olmo3.MODELS["7b"])
    specs = jax.tree.map(
        lambda s: s.spec, shard.shardings(model, AbstractMesh((1, 32, 1, 8), shard.MESH_AXES))
    )
    assert specs.embed_tokens == P("tensor", "fsdp")
    assert specs.layers.self_attn.q_proj == P(None, "fsdp", "tensor", None)
    assert specs.layers.self_attn.o_proj == P(None, "tensor", None, "fsdp")
    assert specs.layers.mlp.gate_proj == P(None, "fsdp", "tensor")  # column-parallel in ...
    assert specs.layers.mlp.down_proj == P(None, "tensor", "fsdp")  # ... row-parallel out
    assert specs.lm_head == P("fsdp", "tensor")
    # A dimension the axis does not divide stays whole: 32 heads over 64-way tensor parallelism.
    q = shard.spec(
        ("embed", "heads", "head_dim"), (4096, 32, 128), AbstractMesh((1, 4, 1, 64), shard.MESH_AXES)
    )
    assert q == P("fsdp", None, None)


class Odd(eqx.Module):
    w: Float[Array, "embed mlp"]
    v: Float[Array, "embed widgets"]


def test_check_rules_names_what_is_wrong(monkeypatch):
    mesh = shard.make_mesh("fsdp=4,tensor=2")
    odd = Odd(jax.ShapeDtypeStruct((8,), jnp.float32), jax.ShapeDtypeStruct((8, 4), jnp.float32))
    with pytest.raises(ValueError, match=r"\.w: 2 logical axes \('embed', 'mlp'\) for a rank-1 array") as e:
        shard.check_rules(odd, mesh)
    assert "['widgets'] have no rule in shard.RULES" in str(e.value)
    model = olmo3.abstract(olmo3.MODELS["tiny"])
    monkeypatch.setitem(shard.RULES, "heads", ("fsdp",))  # q_proj would split fsdp twice
    with pytest.raises(ValueError, match=r"layers\.self_attn\.q_proj: mesh axes \['fsdp'\] appear twice"):
        shard.check_rules(model, mesh)


def test_check_rules_warns_of_big_replicated_parameters():
    model = olmo3.abstract(olmo3.MODELS["7b"])
    with pytest.warns(UserWarning, match=r"over 1 MB left fully replicated on mesh .*'data': 8.*embed"):
        replicated = shard.check_rules(model, shard.make_mesh("data=8"))  # pure data parallelism
    assert ".lm_head" in replicated and ".norm" not in replicated  # the final norm is 16 KB


def test_the_rules_mlp_layout_is_exact_in_the_pattern_xla_miscompiles():
    """x -> ((2x) @ up) @ down, the documented miscompile, with the layout RULES gives the MLP. (The
    miscompiled one, dim 0 over fsdp and dim 1 over tensor for both matrices, cannot be written as rules.)"""
    mesh = shard.make_mesh("data=2,fsdp=2,tensor=2")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 16, 64), np.float32)
    up, down = (rng.standard_normal(s, np.float32) * 0.1 for s in [(64, 128), (128, 64)])
    put = lambda a, axes: jax.device_put(a, NamedSharding(mesh, shard.spec(axes, a.shape, mesh)))
    args = put(x, ("batch", "seq", None)), put(up, ("embed", "mlp")), put(down, ("mlp", "embed"))
    assert args[1].sharding.spec == P("fsdp", "tensor") and args[2].sharding.spec == P("tensor", "fsdp")
    got = jax.jit(lambda x, u, d: ((2 * x) @ u) @ d)(*args)
    want = ((2 * x) @ up) @ down
    # fp32 rounding of the two matmuls' sums (64, then 128 terms) in other orders; a miscompile is O(1) off
    np.testing.assert_allclose(got, want, rtol=0, atol=sum_tol(chain(64, 128), np.abs(want).max()))


@pytest.mark.parametrize("spec", ["data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "fsdp=2,tensor=4", "data=8"])
def test_splash_runs_per_shard_on_every_layout(spec):
    """Splash is a Pallas kernel XLA cannot partition, so on a mesh it runs on each device's rows and heads
    (shard_map): against the reference attention on one device, forward and backward, grouped kv heads and
    the window. (Interpreted here, as the mesh's CPU devices need; tests/test_compile.py compiles it for a
    TPU.)"""
    mesh = shard.make_mesh(spec)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((4, 256, n, 16)).astype(np.float32) for n in (8, 4, 4))
    put = lambda x, heads: jax.device_put(
        x, NamedSharding(mesh, shard.spec(("batch", "seq", heads, "head_dim"), x.shape, mesh))
    )
    loss = lambda impl, layout: lambda q, k, v: (olmo3.attention(q, k, v, 64, impl, layout) ** 2).sum()
    sharded = jax.value_and_grad(loss("splash", shard.Layout(mesh)), argnums=(0, 1, 2))
    assert "shard_map" in str(jax.make_jaxpr(sharded)(q, k, v))
    got, got_grads = jax.jit(sharded)(put(q, "heads"), put(k, "kv_heads"), put(v, "kv_heads"))
    want, want_grads = jax.value_and_grad(loss("reference", None), argnums=(0, 1, 2))(q, k, v)
    # fp32 rounding: each output's attention over its window of 64 keys (squared: twice), the sum over the
    # outputs (one sign); the gradients, back through the same sums
    np.testing.assert_allclose(got, want, rtol=sum_tol(chain(2 * attention_terms(16, 64), np.sqrt(q.size))))
    tol = sum_tol(chain(attention_terms(16, 64), attention_terms(16, 64)))
    for a, b in zip(got_grads, want_grads):
        np.testing.assert_allclose(a, b, rtol=0, atol=tol * np.abs(b).max())


# ---- sharding never changes the numbers

# The tiny preset (fp32), with seq_len 128: past its sliding window of 64, so both kinds of layer run.
TINY = dataclasses.replace(train.PRESETS["tiny"], seq_len=128)
STEPS = 3


@functools.cache
def abstract_state(cfg):
    mcfg = train.model_config(cfg)
    abstract = olmo3.abstract(mcfg)
    return mcfg, abstract, eqx.filter_eval_shape(train.init_opt, abstract, cfg)


def setup(cfg, spec):
    """What train.main builds for a mesh: its shardings and the born-sharded init."""
    mesh = shard.make_mesh(spec)
    mcfg, abstract, abstract_opt = abstract_state(cfg)
    model_sh, opt_sh = shard.shardings(abstract, mesh), shard.shardings(abstract_opt, mesh)
    init = eqx.filter_jit(lambda key: eqx.filter_shard(olmo3.Olmo3(mcfg, key=key), model_sh))
    return mesh, model_sh, opt_sh, init


def arrays(tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(tree, eqx.is_array))
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in leaves}


@pytest.fixture(scope="module")
def tiny_runs(tiny_data):
    """(run, the single-device run, the initial parameters): run(spec) takes STEPS tiny-preset train steps
    on real Shakespeare batches, as train.main does, from the same initial parameters."""
    cfg = TINY
    loader = data.TokenLoader(
        data.prepare_tiny(str(tiny_data))["train"],
        cfg.seq_len,
        cfg.global_batch,
        seed=cfg.seed,
        dtype=np.uint16,
    )
    batches = [loader.global_batch(i) for i in range(STEPS)]
    mcfg = train.model_config(cfg)
    compute = train.compute_policy(cfg, shard.make_mesh("data=1"))  # the kernel a CPU run uses: "local"
    model0 = eqx.filter_jit(lambda key: olmo3.Olmo3(mcfg, key=key, compute=compute))(
        jax.random.key(cfg.init_seed)
    )
    init = arrays(model0)

    def run(spec):
        # A fresh copy of the initial parameters (train_step donates its inputs).
        model = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model0)
        opt = train.init_opt(eqx.filter(model, eqx.is_array), cfg)
        if spec == "single":  # one device, no mesh
            mesh, put = None, lambda rows: jnp.asarray(rows, jnp.int32)
        else:
            mesh, model_sh, opt_sh, _ = setup(cfg, spec)
            model, opt = eqx.filter_shard(model, model_sh), eqx.filter_shard(opt, opt_sh)
            put = lambda rows: shard.put_batch(rows, mesh, cfg.global_batch)
        kw = dict(cfg=cfg, n_micro=train.microbatches(cfg, mesh or shard.make_mesh("data=1")), mesh=mesh)
        with warnings.catch_warnings():  # the int batch is donated in vain, as train.main knows
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = train.train_step.lower(model, opt, put(batches[0]), jnp.float32(0), **kw).compile()
        metrics = []
        for k, rows in enumerate(batches, start=1):  # these calls reuse the compiled step
            model, opt, m = train.train_step(model, opt, put(rows), jnp.float32(train.lr_at(k, cfg)), **kw)
            metrics.append({name: float(v) for name, v in m.items()})
        return dict(
            metrics=metrics,
            params=arrays(model),
            opt=arrays(opt),
            devices=mesh.size if mesh else 1,
            flops=compiled.compiled.cost_analysis()["flops"],
        )

    return run, run("single"), init


@pytest.mark.slow
@pytest.mark.parametrize(
    "spec", ["data=8", "fsdp=8", "data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2", "fsdp=2,tensor=4"]
)
def test_sharded_train_steps_equal_the_single_device_run(tiny_runs, spec):
    run, single, _ = tiny_runs
    got = run(spec)
    # fp32 rounding of the model's sums in other orders (split over devices), over global_batch x seq_len tokens
    mcfg, tokens = train.model_config(TINY), TINY.global_batch * TINY.seq_len
    grad = sum_tol(grad_terms(mcfg, TINY.seq_len, tokens))
    rel = {"loss": sum_tol(loss_terms(mcfg, TINY.seq_len, tokens)), "grad_norm": grad}
    for k, (a, b) in enumerate(zip(got["metrics"], single["metrics"]), start=1):
        for name in ("loss", "grad_norm"):
            assert abs(a[name] - b[name]) <= rel[name] * abs(b[name]), (k, name, a[name], b[name])
    # The gradients, through Adam's moments (the second holds squares: twice their rounding), as tensors and
    # entry by entry against the array's largest (fp32 sums split over devices land ~3e-6 norm-wise, with
    # single entries up to ~1e-5 of the largest on any mesh, pure data parallelism included; a miscompiled
    # layout is ~1e-2 off).
    for name, b in single["opt"].items():
        a = got["opt"][name]
        assert np.linalg.norm(a - b) <= 2 * grad * np.linalg.norm(b), (
            name,
            np.linalg.norm(a - b) / np.linalg.norm(b),
        )
        assert np.abs(a - b).max() <= 2 * grad * np.abs(b).max(), (
            name,
            np.abs(a - b).max() / np.abs(b).max(),
        )
    # The parameters, as tensors: each step rounds a parameter's sum with its update (an ulp of it) and the
    # update, lr times Adam's ratio (about 1 an entry), off by the gradient's rounding. (Elementwise, Adam's
    # first steps are nearly sign(g), which magnifies rounding wherever |g| is near eps: such entries differ by
    # a few percent of one update, as they do when the single-device batch is regrouped into 2 microbatches.)
    lrs = sum(train.lr_at(k, TINY) for k in range(1, STEPS + 1))
    for name, b in single["params"].items():
        diff = np.linalg.norm(got["params"][name] - b)
        tol = STEPS * FP32 * np.linalg.norm(b) + grad * lrs * np.sqrt(b.size)
        assert diff <= tol, (name, diff / tol)
    # Each device computes its own share and no more: XLA's FLOPs per device x devices ~ the single run's.
    # Without shard.gather's explicit all-gathers XLA gathers the batch instead of the weights in parts of
    # the step, and every device computes those parts for the whole batch (1.35x on the fsdp=8 mesh).
    ratio = got["flops"] * got["devices"] / single["flops"]
    assert ratio <= 1.1, ratio


def test_parameters_are_born_sharded_and_equal_the_single_device_init(tiny_runs):
    _, _, single_init = tiny_runs
    whole = sum(x.nbytes for x in single_init.values())
    for spec in ["data=2,fsdp=2,tensor=2", "fsdp=4,tensor=2"]:
        _, model_sh, _, init = setup(TINY, spec)
        key = jax.random.key(TINY.init_seed)
        # The jitted init writes each device's shards, and its temporaries (the random bits) are those of
        # the device's own shards: no device, and no host, ever holds the whole model.
        mem = init.lower(key).compile().compiled.memory_analysis()
        shards = sum(
            math.prod(s.shard_shape(x.shape)) * x.itemsize
            for s, x in zip(jax.tree.leaves(model_sh), single_init.values())
        )
        assert shards < whole / 3  # (the norm weights are replicated)
        assert mem.output_size_in_bytes == pytest.approx(shards, rel=1e-3)  # (+ a table of the buffers)
        assert mem.temp_size_in_bytes < 1.5 * shards, (mem.temp_size_in_bytes, shards)
        model = eqx.filter(init(key), eqx.is_array)
        for (name, x), leaf, s in zip(single_init.items(), jax.tree.leaves(model), jax.tree.leaves(model_sh)):
            assert leaf.sharding.is_equivalent_to(s, leaf.ndim), (name, leaf.sharding, s)
            # The RNG is partitionable: the shards hold what the single-device init draws, bit for bit.
            assert np.array_equal(np.asarray(leaf), x), name


@pytest.mark.slow
def test_bf16_gradients_are_each_device_s_bf16_gradient_summed_in_fp32():
    """The bf16 step's gradients on fsdp=8 (--reduce_dtype float32, OLMo-core's): each device's bf16 gradient
    of its own rows, cast up and summed in fp32. The reference takes each device's rows alone on one device,
    differentiates the loss with respect to the bf16 weights, and sums those in NumPy: equal within fp32
    rounding of that sum. A bf16 sum of the same gradients is further off than that, so the test tells the two
    apart. Both compiled without XLA's excess precision: XLA:CPU keeps fused bf16 intermediates in fp32, and
    fuses the sharded and the single-device programs differently; so each bf16 op rounds in both."""
    cfg = dataclasses.replace(TINY, compute=olmo3.Compute("bfloat16", "local"), reduce_dtype="float32")
    model = olmo3.Olmo3(train.model_config(cfg), key=jax.random.key(0), compute=cfg.compute)
    tokens = np.asarray(jax.random.randint(jax.random.key(1), (8, cfg.seq_len), 0, 8192))
    keep, rows = np.ones(8, bool), np.asarray(train.row_weights(jnp.ones(8, bool), jnp.full(8, 127), 128, 1))
    mesh = shard.make_mesh("fsdp=8")
    _, model_sh, _, _ = setup(cfg, "fsdp=8")
    sharded = [jax.device_put(a, shard.batch_sharding(mesh, a.ndim)) for a in (tokens, keep, rows)]
    got = exact_grads(cfg, eqx.filter_shard(model, model_sh), *sharded, layout=shard.Layout(mesh, "float32"))
    used = model.as_used()  # the bf16 weights, whole on one device
    each = [exact_grads(cfg, used, tokens[d : d + 1], keep[d : d + 1], rows[d : d + 1]) for d in range(8)]
    for name, g in got.items():
        parts = np.stack([e[name].astype(np.float32) for e in each])  # bf16, exactly
        tol = 8 * FP32 * np.abs(parts).sum(0)  # 8 terms summed in fp32, in any order
        assert np.all(np.abs(g - parts.sum(0)) <= tol), (name, np.max(np.abs(g - parts.sum(0)) - tol))
        in_bf16 = functools.reduce(lambda a, b: (a + b).astype(ml_dtypes.bfloat16).astype(np.float32), parts)
        assert np.any(np.abs(in_bf16 - parts.sum(0)) > tol), name


def exact_grads(cfg, model, tokens, keep, rows, layout=None) -> dict[str, np.ndarray]:
    """The loss's gradients with respect to `model`'s arrays, as train_step makes them, compiled without
    excess precision: each bf16 op rounds."""
    dynamic, static = eqx.partition(model, eqx.is_array)
    loss = lambda m, *batch: train.loss_fn(eqx.combine(m, static), *batch, cfg, layout)[0]
    args = (dynamic, *map(jnp.asarray, (tokens, keep, rows)))
    return arrays(jax.jit(jax.grad(loss)).lower(*args).compile({"xla_allow_excess_precision": False})(*args))


# ---- the multi-host start


def test_initialize_starts_jax_distributed_only_where_there_are_several_hosts(monkeypatch):
    calls = []
    monkeypatch.setattr(
        jax.distributed, "initialize", lambda *args, **kw: calls.append(args + tuple(kw.values()))
    )
    monkeypatch.setattr(jax._src.cloud_tpu_init, "running_in_cloud_tpu_vm", False)
    for var in [
        "SLURM_STEP_NODELIST",
        "SLURM_NTASKS",
        "OMPI_MCA_orte_hnp_uri",
        "KUBERNETES_SERVICE_HOST",
        "JOB_COMPLETION_INDEX",
        "JAX_COORDINATOR_ADDRESS",
    ]:
        monkeypatch.delenv(var, raising=False)
    cfg = train.PRESETS["7b"]
    shard.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)  # a laptop: nothing to start
    assert calls == [] and shard.cluster() is None
    shard.initialize("10.0.0.1:1234", 2, 1)  # the flags, on every host
    assert calls == [("10.0.0.1:1234", 2, 1, 100)]
    with pytest.raises(ValueError, match=r"got --coordinator '10.0.0.1:1234' --num_processes 2 --process_id"):
        shard.initialize("10.0.0.1:1234", 2)
    with pytest.raises(ValueError, match=r"--process_id 2"):
        shard.initialize("10.0.0.1:1234", 2, 2)
    monkeypatch.setenv("SLURM_STEP_NODELIST", "node[1-2]")  # srun with one task: one process
    monkeypatch.setenv("SLURM_NTASKS", "1")
    assert shard.cluster() is None
    for env, name in [
        ({"SLURM_NTASKS": "16"}, "SLURM"),
        ({"OMPI_MCA_orte_hnp_uri": "1234.0;tcp://10.0.0.1:5678"}, "Open MPI"),
        ({"KUBERNETES_SERVICE_HOST": "10.0.0.1", "JOB_COMPLETION_INDEX": "3"}, "Kubernetes"),
    ]:
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert shard.cluster() == name
    monkeypatch.setattr(jax._src.cloud_tpu_init, "running_in_cloud_tpu_vm", True)
    assert shard.cluster() == "Cloud TPU VM"
    calls.clear()
    shard.initialize()  # JAX finds the coordinator, the process count and this process's id itself
    assert calls == [(100,)]


# ---- several processes, as on a pod: JAX's own multi-host runtime, over localhost


def launch(run_dir, steps, tiny_data, *, processes, faults=None, flags=(), env=None):
    """`train.py --preset tiny` (and `flags`, which override the flags here) as `processes` processes that share
    8 CPU devices; `faults`, one per process, runs it through tests/faults.py (e.g. ["none:0", "during_save:4"]);
    `env`: variables added."""
    args = [
        "--preset",
        "tiny",
        "--seq_len",
        "128",
        "--steps",
        str(steps),
        "--mesh",
        "fsdp=-1",
        "--run_dir",
        str(run_dir),
        "--ckpt_every",
        "2",
        "--samples",
        "0",
        "--heartbeat_timeout",
        "10",
        "--data",
        "tiny",  # the corpus's training files and tokenizer (the downstream tasks need it), its held-out set
        "--data_root",
        str(tiny_data),
        *flags,
    ]
    env = with_cpu_devices(8 // processes, JAX_PLATFORMS="cpu", PYTHONFAULTHANDLER="1", **(env or {}))
    if processes > 1:
        args += [
            "--coordinator",
            f"localhost:{free_port()}",
            "--num_processes",
            str(processes),
            "--process_id",
        ]
    starts = [["tests/faults.py", fault] for fault in faults] if faults else [["train.py"]] * processes
    return [
        subprocess.Popen(
            [sys.executable, *start, *args, *([str(i)] if processes > 1 else [])],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i, start in enumerate(starts)
    ]


def ended(procs, timeout: float = 300) -> list[str]:
    """Each process's output once all have exited. One still running after `timeout` seconds is stopped with
    SIGABRT, so that Python's faulthandler (on in launch) prints where every thread of it waited, and the
    test fails."""
    deadline, outs = time.time() + timeout, []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.send_signal(signal.SIGABRT)
            tails = [f"process {i}:\n{q.communicate()[0][-6000:]}" for i, q in enumerate(procs)]
            raise AssertionError(f"still running after {timeout} s\n" + "\n".join(tails)) from None
    return outs


def finish(procs, timeout: float = 300) -> list[str]:
    """Each process's output, once all have exited 0 (ended)."""
    outs = ended(procs, timeout)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def victim_output(victim, other, timeout: float = 300) -> str:
    """The output of a process meant to kill itself; if it is still running after `timeout` seconds, both
    are stopped with SIGABRT (faulthandler prints where each thread waited) and the test fails with that."""
    try:
        return victim.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        for p in (victim, other):
            p.send_signal(signal.SIGABRT)
        tails = [
            f"{name}:\n{p.communicate()[0][-8000:]}" for name, p in (("victim", victim), ("other", other))
        ]
        raise AssertionError(f"the victim still ran after {timeout} s\n" + "\n".join(tails)) from None


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in data.read_text(data.join(run_dir, "metrics.jsonl")).splitlines()]


@pytest.mark.slow
def test_two_processes_on_a_bucket_survive_losing_one_mid_save_and_a_30_s_outage(
    tmp_path, tiny_data, gcs_emulator, gcs_proxy
):
    """A pod's hosts rehearsed on one machine: 2 processes x 4 CPU devices through jax.distributed train one
    gs:// run directory (each writes its shards of every checkpoint there) behind the tests' FaultProxy. One is
    killed while checkpoint 4 is written: the other stops (it does not hang), and the two restarted resume from
    checkpoint 2 and take steps 3 and 4 again bit for bit; after step 5 the bucket is out for 30 s, and they
    ride it out. The finished run, a downstream task evaluated at its end, against 1 process x 8 devices on a
    local disk, same mesh."""
    bucket = gcs_emulator.create_bucket(f"pod-{time.time_ns()}")
    two, one, go = f"gs://{bucket.name}/two", tmp_path / "one", tmp_path / "go"
    task = ["--tasks", "copycolors_10way_fast"]  # each process scores its rows of each batch of requests
    survivor, victim = launch(two, 6, tiny_data, processes=2, faults=["none:0", "during_save:4"], flags=task)
    single = launch(one, 6, tiny_data, processes=1, flags=task)
    killed_out = victim_output(victim, survivor)
    t0 = time.time()
    out = survivor.communicate(timeout=120)[0]  # JAX's heartbeats stop it (--heartbeat_timeout 10)
    assert victim.returncode == -signal.SIGKILL, killed_out[-3000:]
    assert survivor.returncode not in (0, None), out[-3000:]
    assert "another task died" in out and time.time() - t0 < 90
    # Steps 1-4 as the uninterrupted start took them (Orbax's save starts with a barrier of every process,
    # so process 0 had logged step 4 before the other was killed in it).
    steps = lambda rows: [
        (r["step"], r["loss"], r["grad_norm"], r["batch_hash"]) for r in rows if "loss" in r
    ]
    first = steps(metrics(two))
    assert [s[0] for s in first] == [1, 2, 3, 4], first
    pair = launch(
        two, 6, tiny_data, processes=2, faults=["hold:5"] * 2, flags=task, env={"FAULT_GO": str(go)}
    )
    deadline = time.time() + 300
    while not bucket.blob("two/checkpoints/4/commit_success.txt").exists():  # retaken, and saved again
        assert all(p.poll() is None for p in pair) and time.time() < deadline, finish(pair)
        time.sleep(0.2)
    with gcs_proxy.outage():  # both hold after step 5 until `go`; then step 6, its save and the evaluation
        go.touch()
        time.sleep(30)
    lead, other = finish(pair)
    assert sum(status == 503 for *_, status in gcs_proxy.log) > 0  # the outage met the pair's requests
    assert "resuming from" in lead and "(step 2)" in lead
    assert "mesh {'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1} over 8 devices in 2 processes" in lead
    assert "config:" not in other  # only process 0 prints
    # Every process writes its shards of every checkpoint; process 0 alone the metrics.
    written = {name.split("/")[0] for name in data.listing(f"{two}/checkpoints/6/model")}
    assert sorted(w for w in written if w.startswith("ocdbt.process_")) == [
        "ocdbt.process_0",
        "ocdbt.process_1",
    ]
    assert steps(metrics(two))[:4] == first  # steps 3 and 4 again from checkpoint 2, bitwise; each once
    finish(single)
    (*got, got_eval), (*want, want_eval) = metrics(two), metrics(one)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    assert got_eval.keys() == want_eval.keys() and len(got_eval) > 10  # the held-out set's, ICLMetric's
    # fp32 rounding of the tiny model's sums in other orders: a token's loss (its log-probability; PPL, its
    # exponential, is off by the loss's error times the loss), a batch's mean loss, a gradient
    mcfg, seq = olmo3.MODELS["tiny"], 128
    token, tokens = sum_tol(token_terms(mcfg, seq)), 8 * seq  # the tiny preset's global batch of 8 rows
    for name, value in want_eval.items():
        rel = token * (max(1.0, np.log(value)) if "ppl" in name.lower() else 1)
        assert got_eval[name] == pytest.approx(value, rel=rel), name
    rel = {
        "loss": sum_tol(loss_terms(mcfg, seq, tokens)),
        "grad_norm": sum_tol(grad_terms(mcfg, seq, tokens)),
    }
    for a, b in zip(got, want):
        # The global batch holds the processes' rows one process after the other: the same rows in
        # another order, so the sums round differently, and the batch hashes (sums over rows) agree.
        assert a["batch_hash"] == b["batch_hash"]
        for name in ("loss", "grad_norm"):
            assert abs(a[name] - b[name]) <= rel[name] * b[name], (a, b)


@pytest.mark.slow
def test_one_process_failing_stops_the_others(tmp_path, tiny_data):
    """A bug in one process while the other waits in step 3's collectives: the failing one prints its
    traceback and exits 1 at once (JAX's orderly shutdown would wait for the other forever, and the other for
    it), and the other stops within --heartbeat_timeout (10 s here), saying another task died; or at once,
    where the failing one left while its step's collectives were in flight (the loop does not wait for a step
    before dispatching the next): on CPUs, Gloo's connection to it is reset or closed."""
    waiting, failing = launch(tmp_path / "run", 4, tiny_data, processes=2, faults=["none:0", "raise:3"])
    try:
        out = failing.communicate(timeout=240)[0]
        t0 = time.time()
        other = waiting.communicate(timeout=120)[0]
    finally:
        for p in (waiting, failing):
            p.kill()
    assert failing.returncode == 1 and "RuntimeError: injected" in out, out[-3000:]
    stopped = "another task died" in other or re.search(r"Connection (reset|closed) by peer", other)
    assert waiting.returncode not in (0, None) and stopped, other[-3000:]
    assert time.time() - t0 < 90


@pytest.mark.slow
def test_a_sharded_start_reads_each_process_s_shards_only(tmp_path, tiny_data):
    """`--init_from HF_DIR` on an FSDP mesh over two processes: each process reads only the parts of each
    tensor its devices hold, half the model (the norms, which every device holds whole, aside), as the
    number it prints says; and the run is the one-process run's."""
    import ckpt

    ckpt.save_hf(olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(3)), tmp_path / "hf")
    flags = ["--init_from", str(tmp_path / "hf"), "--eval_batches", "1"]
    pair = launch(tmp_path / "two", 2, tiny_data, processes=2, flags=flags)
    single = launch(tmp_path / "one", 2, tiny_data, processes=1, flags=flags)
    outs, (one,) = finish(pair), finish(single)
    assert "mesh {'data': 1, 'fsdp': 8, 'context': 1, 'tensor': 1} over 8 devices in 2 processes" in outs[0]
    said = re.compile(
        rf"starting from {tmp_path / 'hf'} \(hf: weights only: Adam from zero\); this process read "
        r"([\d,.]+) MiB of the ([\d,.]+) MiB of it"
    )
    mib = lambda out: [float(x.replace(",", "")) for x in said.search(out).groups()]
    (read_0, whole), (read_1, whole_1), (read_one, whole_one) = map(mib, [*outs, one])
    model_mib = olmo3.count_params(olmo3.abstract(olmo3.MODELS["tiny"])) * 4 / 2**20
    assert whole == whole_1 == whole_one == pytest.approx(model_mib, abs=0.1)
    assert read_one == whole_one  # one process holds all 8 devices: it reads every part
    assert read_0 <= 0.51 * whole and read_1 <= 0.51 * whole, (read_0, read_1, whole)
    two, single_rows = metrics(tmp_path / "two"), metrics(tmp_path / "one")
    got, want = [r for r in two if "loss" in r], [r for r in single_rows if "loss" in r]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2]
    for a, b in zip(got, want):
        assert a["batch_hash"] == b["batch_hash"] and a["loss"] == pytest.approx(b["loss"], rel=1e-5), (a, b)
