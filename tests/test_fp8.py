"""FP8 linears (olmo3.fp8_linear, Compute.fp8) against torchao's Float8Linear, which AI2 trained OLMo 3 7B's
stage 3 with: the tensorwise recipe, scales of activations and gradients rounded down to powers of two, and
FSDP's fp8 all-gather of the weights. torchao's FP8 runs on torch's CPU build (torch._scaled_mm), so the
reference here is the real one. Then the model with fp8 on, what XLA makes of the fp8 matmuls for TPU
Ironwood (libtpu) and for an H200 (the CUDA plugin, where installed), and fp8 through the recipe: the presets,
a scaled-down stage 3 trained beside bf16 and fp32, resumed bit for bit, exported as plain weights."""

import collections
import dataclasses
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from commands import train_py, with_cpu_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torchao.float8 import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear, matmul_with_hp_or_float8_args
from torchao.float8.float8_utils import amax_to_scale, to_fp8_saturated

import ckpt
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent
BF16 = ml_dtypes.bfloat16
# 448 / 2^14: a weight of this amax gets the scale 2^14 whether or not its scale is rounded to a power of two.
POWER_OF_TWO_AMAX = 448 * 2.0**-14


def torchao_linear(x: np.ndarray, w: np.ndarray, g: np.ndarray, all_gather: bool):
    """torchao's Float8Linear as AI2 configured it, on x (bf16, [..., in]) and the fp32 master weight w (our
    [in, out] layout; torch's is its transpose), backpropagating g: (y, grad x, grad w) in fp32, and the fp8
    weight's bits and scale where `all_gather`.

    all_gather: the weight as FSDP2's fp8 all-gather hands it to the module. FSDP2 calls the weight's
    fsdp_pre_all_gather on each rank's shard (a scale from the fp32 master's amax, all-reduced over the ranks,
    and not rounded to a power of two: that path ignores round_scales_to_power_of_2), gathers the fp8 bits,
    and fsdp_post_all_gather makes the Float8TrainingTensor the module computes with. On one process the shard
    is the whole weight, so calling the two hooks is the all-gather; the module's forward then runs torchao's
    own matmul on it, as Float8Linear.forward does. Its gradient is that of FSDP's bf16 unsharded weight.
    Otherwise: the module as it is (force_recompute_fp8_weight_in_bwd is a no-op in torchao 0.15, left out)."""
    config = Float8LinearConfig(round_scales_to_power_of_2=True, enable_fsdp_float8_all_gather=all_gather)
    module = torch.nn.Linear(w.shape[0], w.shape[1], bias=False)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(np.ascontiguousarray(w.T)))
    module = Float8Linear.from_float(module, config=config)
    tx = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).requires_grad_()
    tg = torch.from_numpy(g.astype(np.float32)).to(torch.bfloat16)
    fp32 = lambda t: t.detach().float().numpy()
    if not all_gather:
        y = module(tx)
        y.backward(tg)
        return fp32(y), fp32(tx.grad), fp32(module.weight.grad).T, None, None
    (bits,), (scale,) = module.weight.fsdp_pre_all_gather(None)
    w8, _ = module.weight.fsdp_post_all_gather((bits,), (scale,), torch.bfloat16)
    w8 = w8.detach().requires_grad_()  # FSDP's unsharded parameter, whose gradient it reduces
    y = matmul_with_hp_or_float8_args.apply(tx, w8.t(), module.linear_mm_config, module.config)
    y.backward(tg)
    return fp32(y), fp32(tx.grad), fp32(w8.grad).T, bits.view(torch.uint8).numpy().T, scale.item()


def ours(x, w, g, n_in=1):
    """olmo3.fp8_linear under jit: (y, grad x, grad w) in fp32, in torch's shapes (x's leading axes, one
    `in` axis)."""
    xs, ws = x.shape, w.shape
    x = x.reshape(*xs[: x.ndim - 1], *ws[:n_in]) if n_in > 1 else x

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: olmo3.fp8_linear(x, w, n_in), x, w)
        return y, *vjp(g)

    y, dx, dw = run(jnp.asarray(x), jnp.asarray(w), jnp.asarray(g))
    return tuple(np.asarray(a, np.float32) for a in (y, dx.reshape(xs), dw.reshape(ws)))


def bf16_ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many bf16 values lie between a and b (bf16 values held in fp32), across zero too."""

    def ordered(v):
        bits = v.astype(BF16).view(np.uint16).astype(np.int32)
        return np.where(bits & 0x8000, -(bits & 0x7FFF), bits)

    return np.abs(ordered(a) - ordered(b))


def inputs(x_shape, w_shape, seed=0, power_of_two=True):
    """bf16 activations, an fp32 weight and bf16 output gradients whose scales are powers of two (the weight's
    too, where `power_of_two`; else its amax is 0.06). Each nonzero value is at least 1/6.9 of its tensor's
    amax (a quarter are zero), so that every fp8 operand is a multiple of e4m3's step at 64 (8) or e5m2's at
    8192 (2048), every product of two a multiple of 64 or 16384 up to 3136 or 1568 such units, and every fp32
    sum of fewer than 2^24 / 3136 = 5349 of them exact: whatever order torch's CPU matmul and XLA's sum in
    (they differ), the sums agree to the bit. (On Gaussian data a few outputs in a million round one bf16 ulp
    apart.) The rounding to fp8 is still exercised: bf16 and fp32 hold more bits than e4m3 and e5m2."""
    rng = np.random.default_rng(seed)

    def values(shape, amax):
        v = rng.uniform(amax / 6.9, amax, shape) * rng.choice([-1, 0, 1], shape, p=[3 / 8, 1 / 4, 3 / 8])
        v.flat[0] = amax
        return v

    x = values(x_shape, 448 * 2.0**-5).astype(BF16)
    w = values(w_shape, POWER_OF_TWO_AMAX if power_of_two else 0.06).astype(np.float32)
    g = values((*x_shape[:-1], w_shape[-1]), 57344 * 2.0**-26).astype(BF16)
    return x, w, g


SHAPES = [((32, 64), (64, 48)), ((2, 24, 64), (64, 96)), ((3, 2, 8, 128), (128, 32))]  # batch axes or none


@pytest.mark.parametrize("x_shape,w_shape", SHAPES)
@pytest.mark.parametrize("all_gather", [False, True])
def test_fp8_linear_is_torchao_s_bit_for_bit_when_every_scale_is_a_power_of_two(x_shape, w_shape, all_gather):
    x, w, g = inputs(x_shape, w_shape)
    theirs = torchao_linear(x, w, g, all_gather)[:3]
    for name, a, b in zip(("output", "input gradient", "weight gradient"), ours(x, w, g), theirs):
        assert np.array_equal(a, b), f"{name}: {(a != b).sum()} of {a.size} differ"


@pytest.mark.parametrize("devices", [(1, 2, 2), (2, 1, 1)])
def test_from_gathered_fp8_bits_with_each_device_s_weight_gradient_summed_in_fp32_it_is_torchao_s(devices):
    """A mesh's path: the weight handed over as FSDP's fp8 all-gather hands it (fp8_weight: e4m3 bits and the
    whole weight's scale), each device's weight gradient of its own rows and positions (`devices`: data, fsdp,
    context) rounded to bf16 and summed in fp32, as FSDP with reduce_dtype fp32 sums it. The reference: torchao
    on the whole batch for the output and the input gradient; for the weight's, torchao on each device's
    tokens alone (its own activation scale: on these inputs, whose fp8 values are exact at any power-of-two
    scale, the same fp8 values), summed in float64. Every sum here is exact, so all three are bit for bit; a
    device's gradient counted twice, left out or rounded as the whole batch's is not."""
    x, w, g = inputs((2, 24, 64), (64, 96), seed=3)
    theirs = list(torchao_linear(x, w, g, all_gather=True)[:3])
    data, fsdp, context = devices
    rows, positions = x.shape[0] // (data * fsdp), x.shape[1] // context
    each = [
        (
            x[r * rows : (r + 1) * rows, c * positions : (c + 1) * positions],
            g[r * rows : (r + 1) * rows, c * positions : (c + 1) * positions],
        )
        for r in range(data * fsdp)
        for c in range(context)
    ]
    theirs[2] = sum(torchao_linear(xd, w, gd, all_gather=True)[2].astype(np.float64) for xd, gd in each)

    @jax.jit
    def run(x, w, g):
        y, vjp = jax.vjp(lambda x, w: olmo3.fp8_linear(x, w, 1, olmo3.fp8_weight(w), devices), x, w)
        return y, *vjp(g)

    for name, a, b in zip(("output", "input gradient", "weight gradient"), run(x, w, g), theirs):
        a = np.asarray(a, np.float32)
        assert np.array_equal(a, b), f"{name}: {(a != b).sum()} of {a.size} differ"


def test_a_linear_over_two_axes_is_torchao_s_over_their_product():
    """o_proj contracts heads and head_dim: the same numbers as torchao's linear over heads * head_dim."""
    x, w, g = inputs((2, 16, 64), (64, 48), seed=1)
    theirs = torchao_linear(x, w, g, all_gather=False)[:3]
    for a, b in zip(ours(x, w.reshape(4, 16, 48), g, n_in=2), theirs):
        assert np.array_equal(a.reshape(b.shape), b)


def test_on_ai2_s_all_gather_path_the_fp8_weight_is_torchao_s_and_outputs_are_within_its_rounding():
    """The weight's scale is 448 / amax, not rounded: the fp8 weight bits are torchao's, and so is the weight
    gradient (which does not read the weight). The output and the input gradient unscale the exact fp32 sum
    by s_x * s_w once, as cuBLASLt does on a GPU; torch's CPU _scaled_mm instead multiplies each fp8 operand by
    its scale's reciprocal before an fp32 matmul, so each weight term carries an fp32 rounding and the sum
    rounds in its own order. Bound: one bf16 ulp of the result, plus the standard bound on that fp32 sum's
    error, (n + 1) 2^-24 sum_i |x_i w_i| over the n terms (a sum that cancels can make it many ulps of the
    result). Most outputs are the same bits."""
    x, w, g = inputs((4, 64, 256), (256, 192), seed=2, power_of_two=False)
    y, dx, dw, bits, scale = torchao_linear(x, w, g, all_gather=True)
    assert np.frexp(scale)[0] != 0.5  # not a power of two: the unrounded path
    s = olmo3.fp8_scale(jnp.asarray(w), olmo3.E4M3, power_of_2=False)
    assert float(s) == scale
    qw = olmo3.fp8_quantize(jnp.asarray(w), s, olmo3.E4M3)
    assert np.array_equal(np.asarray(qw).view(np.uint8), bits)
    y8, dx8, dw8 = ours(x, w, g)
    assert np.array_equal(dw8, dw)
    # |x| and |g| as their fp8 values stand for them (their scales are powers of two), |w| as its fp8 weight's
    unscale = lambda t, dtype, pow2: (
        np.abs(np.asarray(olmo3.fp8_quantize(t, olmo3.fp8_scale(t, dtype, pow2), dtype), np.float64))
        / float(olmo3.fp8_scale(t, dtype, pow2))
    )
    ax, ag = unscale(jnp.asarray(x), olmo3.E4M3, True), unscale(jnp.asarray(g), olmo3.E5M2, True)
    aw = np.abs(np.asarray(qw, np.float64)) / float(s)
    for ours_, theirs, terms, n in [(y8, y, ax @ aw, w.shape[0]), (dx8, dx, ag @ aw.T, w.shape[1])]:
        ulp = np.spacing(np.maximum(np.abs(ours_), np.abs(theirs)).astype(BF16)).astype(np.float64)
        assert np.all(np.abs(ours_.astype(np.float64) - theirs) <= ulp + (n + 1) * 2.0**-24 * terms)
        assert np.mean(ours_ == theirs) > 0.99


def _edge(case: str):
    x, w, g = inputs((32, 64), (64, 48), seed=3)
    poke = {"nan": np.nan, "inf": np.inf}
    match case.split():
        case ["zero", "x"]:
            x[:] = 0
        case ["zero", "gradient"]:
            g[:] = 0
        case ["zero", "w"]:
            w[:] = 0
        case [
            "x",
            "at",
            "e4m3's",
            "largest",
        ]:  # x * scale: 448, and 432 (a tie: to 448, even) and 424 (to 416)
            top = 448 * 2.0**-5
            x[0, :4] = np.array([top, -top, 432 * 2.0**-5, 424 * 2.0**-5], np.float32).astype(BF16)
            x[1:] = np.clip(x[1:].astype(np.float32), -top, top).astype(BF16)
        case [value, "in", "x"]:
            x[3, 5] = poke[value]
        case [value, "in", "gradient"]:
            g[2, 7] = poke[value]
        case [value, "in", "w"]:
            w[1, 1] = poke[value]
    return x, w, g


EDGES = ["zero x", "zero gradient", "zero w", "x at e4m3's largest"]
EDGES += [f"{v} in {t}" for v in ("nan", "inf") for t in ("x", "gradient", "w")]


@pytest.mark.parametrize("case", EDGES)
@pytest.mark.parametrize("all_gather", [False, True])
def test_zeros_saturation_infinities_and_nans_come_out_as_torchao_s(case, all_gather):
    """torchao refuses nothing. A zero tensor takes the scale of max|t| = 1e-12 and contributes zeros. A NaN
    anywhere makes that tensor's scale NaN, an infinity makes it 0 (and inf * 0 NaN): then every output that
    tensor enters is NaN (a NaN or inf in x: the output and the weight gradient; in the gradient: both
    gradients; in w: the output and the input gradient), the others untouched. fp8_linear does the same."""
    x, w, g = _edge(case)
    theirs = torchao_linear(x, w, g, all_gather)[:3]
    for name, a, b in zip(("output", "input gradient", "weight gradient"), ours(x, w, g), theirs):
        assert np.array_equal(a, b, equal_nan=True), f"{name}: {(a != b).sum()} of {a.size} differ"


@pytest.mark.parametrize("dtype,fmax", [(olmo3.E4M3, 448.0), (olmo3.E5M2, 57344.0)])
def test_quantizing_saturates_and_rounds_to_nearest_even_as_torchao_does(dtype, fmax):
    """XLA converts to e4m3fn without saturating (an overflow becomes NaN); torchao clamps to the largest
    value first. Around the largest value, ties and beyond, at a power-of-two scale and at another."""
    torch_dtype = {olmo3.E4M3: torch.float8_e4m3fn, olmo3.E5M2: torch.float8_e5m2}[dtype]
    top = np.array([1, 1 - 2.0**-6, 1 - 2.0**-5, 1 + 2.0**-5, 1 + 2.0**-4, 1.1, 1.5, 2, 1e30, np.inf])
    t = (fmax * np.concatenate([top, -top, [0.0, np.nan]])).astype(np.float32)
    for scale in (np.float32(1.0), np.float32(0.7)):
        want = to_fp8_saturated(torch.from_numpy(t) * torch.tensor(scale), torch_dtype)
        got = olmo3.fp8_quantize(jnp.asarray(t), jnp.float32(scale), dtype)
        number = ~np.isnan(t)  # NaN stays NaN; its payload differs (e5m2: XLA's 0x7e, torch's 0x7f)
        assert np.array_equal(np.asarray(got).view(np.uint8)[number], want.view(torch.uint8).numpy()[number])
        assert np.isnan(np.asarray(got, np.float32)[~number]).all()


@pytest.mark.parametrize("dtype", [olmo3.E4M3, olmo3.E5M2])
def test_scales_are_torchao_s_and_round_down_to_powers_of_two_exactly(dtype):
    """The scale fmax / amax is torchao's (which divides in fp64) for every amax tried. Rounded: 2^k for an amax
    of fmax / 2^k and for one just below it, 2^(k-1) for one just above, for every k down to the floor of
    1e-12 (zero included). On XLA:CPU exp2(floor(log2(s))) misses most powers of two (jax 0.10.2: 116 of
    2^-100 ... 2^48), so fp8_scale clears the mantissa instead. torchao computes exp2(floor(log2(s))) in fp32:
    exact at powers of two, but fp32's log2 of a scale a few fp32 steps below 2^k rounds up to k (for k <= -2
    or k >= 3 here), and torchao then takes 2^k (saturating the amax) where rounding down takes 2^(k-1); an
    amax lands there about once in a million tensors. Those (`above`) are compared with the exact answer
    only."""
    fmax = float(jnp.finfo(dtype).max)
    torch_dtype = {olmo3.E4M3: torch.float8_e4m3fn, olmo3.E5M2: torch.float8_e5m2}[dtype]
    k = np.arange(-100, 49)
    exact = (fmax * np.ldexp(1.0, -k)).astype(np.float32)
    below, above = np.nextafter(exact, np.float32(0)), np.nextafter(exact, np.float32(np.inf))
    amax = np.concatenate([exact, below, [0, 1e-13], above]).astype(np.float32)
    floor = 2.0**48 if dtype == olmo3.E4M3 else 2.0**55  # fmax / 1e-12 rounded down
    want = np.concatenate([np.ldexp(1.0, k)] * 2 + [[floor, floor], np.ldexp(1.0, k - 1)]).astype(np.float32)

    scales = jax.jit(
        jax.vmap(lambda a, pow2: olmo3.fp8_scale(jnp.stack([a, -a / 3]), dtype, pow2), in_axes=(0, None)),
        static_argnums=1,
    )
    theirs = lambda pow2: np.array(
        [amax_to_scale(torch.tensor(a), torch_dtype, round_scales_to_power_of_2=pow2).item() for a in amax],
        np.float32,
    )
    assert np.array_equal(np.asarray(scales(amax, False)), theirs(False))
    rounded = np.asarray(scales(amax, True))
    assert np.array_equal(rounded, want)
    torchao_s_window = np.arange(amax.size) >= 2 * k.size + 2  # `above`
    assert np.array_equal(rounded[~torchao_s_window], theirs(True)[~torchao_s_window])


def test_under_jit_with_sharded_inputs_fp8_linear_computes_what_it_does_on_one_device():
    """Rows split over devices and the weight split as FSDP splits it: each scale is the whole tensor's
    (XLA all-reduces the amax), so the numbers are the single device's. (torchao under FSDP scales each
    rank's activations by that rank's own amax; here a scale does not depend on the layout.)"""
    x, w, g = inputs((8, 32, 64), (64, 48), seed=4, power_of_two=False)
    mesh = Mesh(np.array(jax.devices()[:4]), ("fsdp",))
    rows = NamedSharding(mesh, P("fsdp"))
    sharded = [jax.device_put(jnp.asarray(a), rows) for a in (x, w, g)]

    @jax.jit
    def run(x, w, g):
        gathered = lambda w: jax.lax.with_sharding_constraint(w, NamedSharding(mesh, P()))
        y, vjp = jax.vjp(lambda x, w: olmo3.fp8_linear(x, gathered(w)), x, w)
        return y, *vjp(g)

    for a, b in zip(run(*sharded), ours(x, w, g)):
        assert np.array_equal(np.asarray(a, np.float32), b)


# ---- the model


def test_the_model_with_fp8_runs_every_block_linear_in_fp8_and_nothing_else():
    """Compute.fp8 "tensorwise": as_used leaves the block linears' fp32 masters to fp8_linear and casts the rest
    (LM head, embedding, norms) to bf16; the jitted forward and backward hold the block linears' 3 matmuls each
    in fp8 (7 linears x 4 layers of the scanned group), and no other; the loss stays near the bf16 model's."""
    with pytest.raises(ValueError, match="^Compute.fp8 'rowwise': expected one of '', tensorwise$"):
        olmo3.Compute(fp8="rowwise")
    cfg = olmo3.MODELS["tiny"]
    bf16 = olmo3.Olmo3(cfg, key=jax.random.key(0), compute=olmo3.Compute("bfloat16"))
    fp8 = bf16.using(olmo3.Compute("bfloat16", fp8="tensorwise"))
    used = fp8.as_used()
    assert {w.dtype for w in olmo3.block_linears(used)} == {jnp.dtype(jnp.float32)}
    rest = eqx.tree_at(olmo3.block_linears, used, replace_fn=lambda w: None)
    assert {w.dtype for w in jax.tree.leaves(eqx.filter(rest, eqx.is_array))} == {jnp.dtype(jnp.bfloat16)}

    tokens = jax.random.randint(jax.random.key(1), (2, 128), 0, cfg.vocab_size)

    def loss(model, tokens):
        logits = model(tokens)[..., :-1, :]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., 1:, None], -1))

    step = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    dots = [
        line for line in step.lower(fp8, tokens).as_text().splitlines() if "stablehlo.dot_general" in line
    ]
    kinds = collections.Counter(tuple(re.findall(r"x(f8E4M3FN|f8E5M2)>", line)) for line in dots)
    n = 7 * cfg.period
    e4, e5 = "f8E4M3FN", "f8E5M2"
    assert kinds == {(e4, e4): n, (e5, e4): n, (e4, e5): n, (): len(dots) - 3 * n}, kinds
    (loss8, grads), (loss16, _) = step(fp8, tokens), step(bf16, tokens)
    assert all(bool(jnp.isfinite(w).all()) for w in jax.tree.leaves(eqx.filter(grads, eqx.is_array)))
    # e4m3 keeps 3 mantissa bits: each operand is off by up to 2^-4 of itself. The loss (the untrained model's,
    # near ln 8192) moves by far less; it must move (fp8 is on) and stay within that relative bound.
    assert loss8 != loss16 and abs(loss8 - loss16) <= 2**-4 * loss16


@pytest.mark.parametrize("attention", ["local", "splash"])
def test_fp8_runs_with_the_other_attention_paths(attention):
    """fp8 touches only the linears, so it runs with any attention path (cuDNN: the GPU compile below). The
    paths differ by fp32 rounding, which can flip an fp8 rounding or a power-of-two scale downstream: then the
    logits move, but by less than fp8 itself moves them from the fp32 model's."""
    cfg = olmo3.MODELS["tiny"]
    model = olmo3.Olmo3(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (1, 256), 0, cfg.vocab_size)
    logits = lambda impl, fp8: eqx.filter_jit(lambda m, t: m(t))(
        model.using(olmo3.Compute("float32", impl, fp8=fp8)), tokens
    )
    reference = logits("reference", "tensorwise")
    fp8_error = float(jnp.max(jnp.abs(reference - logits("reference", ""))))
    assert float(jnp.max(jnp.abs(logits(attention, "tensorwise") - reference))) < fp8_error


# ---- what XLA compiles for accelerators


def _fp8_step_hlo(devices, compiler_options=None) -> str:
    """fp8_linear's forward and backward (a batch of rows, d 512 -> 1024) compiled for `devices[0]`, as text."""
    mesh = Mesh(np.array(devices[:1]), ("d",))
    whole = NamedSharding(mesh, P())

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: olmo3.fp8_linear(x, w), x, w)
        return y, *vjp(g)

    args = [
        jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16, sharding=whole),
        jax.ShapeDtypeStruct((512, 1024), jnp.float32, sharding=whole),
        jax.ShapeDtypeStruct((4, 256, 1024), jnp.bfloat16, sharding=whole),
    ]
    return jax.jit(step).lower(*args).compile(compiler_options).as_text()


def _operand_types(hlo: str, line: str) -> list[str]:
    """The element types of an HLO instruction's operands, looked up by name in the module."""
    names = re.search(r"(?:convolution|dot|custom-call)\(([^)]*)\)", line).group(1)
    defined = lambda name: re.search(rf"%{re.escape(name)} = \(?(\w+)\[", hlo).group(1)
    return [defined(n.strip().lstrip("%")) for n in names.split(",")]


def test_for_tpu_ironwood_the_fp8_matmuls_compile_on_fp8_operands():
    """libtpu (the [tpu] extra) compiles for tpu7x, whose MXU takes fp8 at twice bf16's rate: the three
    matmuls keep their e4m3/e5m2 operands (none upcast to bf16 first)."""
    hlo = _fp8_step_hlo(shard.compile_target("tpu7x:2x2x1").devices)
    matmuls = [line for line in hlo.splitlines() if re.search(r"= \S+ (convolution|dot)\(", line)]
    types = sorted(tuple(_operand_types(hlo, line)) for line in matmuls)
    assert types == [("f8e4m3fn", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2"), ("f8e5m2", "f8e4m3fn")], types


# Rerun with the [gpu] extra: pip install -e ".[gpu,test]" && pytest tests/test_fp8.py -k gpu
def test_gpu_fp8_matmuls_compile_to_cublaslt_fp8_gemms_with_torchao_s_accumulation():
    """For an H200: three cuBLASLt fp8 GEMMs, the forward with fast accumulation (DEFAULT precision) as torchao's
    forward, the two backward ones without (HIGHEST), on fp8 operands; no other GEMM. shard.gpu_target states
    the CUDA runtime (without it XLA makes fp16 GEMMs of these and drops the weight's fp8 rounding) and turns
    Triton GEMMs off, but XLA reads that flag only when its first backend starts: given here per compile."""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    target = shard.compile_target("h200x1")
    hlo = _fp8_step_hlo(target.devices, {"xla_gpu_enable_triton_gemm": False})
    gemms = [line for line in hlo.splitlines() if 'custom_call_target="__cublas' in line]
    assert all('custom_call_target="__cublas$lt$matmul$f8"' in line for line in gemms), gemms
    found = sorted(
        (
            "backward" if "transpose(jvp())" in line else "forward",
            re.search(r'"operand_precision":\["(\w+)","(\w+)"\]', line).groups(),
            tuple(_operand_types(hlo, line)[:2]),
        )
        for line in gemms
    )
    assert found == [
        ("backward", ("HIGHEST", "HIGHEST"), ("f8e4m3fn", "f8e5m2")),
        ("backward", ("HIGHEST", "HIGHEST"), ("f8e5m2", "f8e4m3fn")),
        ("forward", ("DEFAULT", "DEFAULT"), ("f8e4m3fn", "f8e4m3fn")),
    ], found


def test_gpu_the_model_with_fp8_and_cudnn_attention_compiles_every_block_linear_to_an_fp8_gemm():
    """The tiny model's loss and gradients for an H200 with cuDNN attention and fp8: every GEMM an fp8 one but
    the LM head's three (forward, and its two gradients) in bf16; cuDNN's attention forward and backward. (XLA
    merges GEMMs that share an operand: q, k and v read the same fp8 x, as gate and up do, and so do their
    weight gradients; 60 fp8 GEMMs for the 4 x 7 linears' 84 matmuls, with jax 0.10.2.)"""
    pytest.importorskip("jax_cuda13_plugin", reason="compiling for a GPU needs the [gpu] extra")
    target = shard.compile_target("h200x1")
    mesh = shard.make_mesh("fsdp=1", list(target.devices))
    cfg = olmo3.MODELS["tiny"]
    model = olmo3.abstract(cfg, olmo3.Compute("bfloat16", "cudnn", fp8="tensorwise"))
    model = shard.abstract(model, shard.shardings(model, mesh))
    weights, static = eqx.partition(model, olmo3.is_array)
    tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32, sharding=shard.batch_sharding(mesh))

    def grads(weights, tokens):
        def loss(weights):
            logits = eqx.combine(weights, static)(tokens)[..., :-1, :]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens[..., 1:, None], -1))

        return jax.grad(loss)(weights)

    options = {"xla_gpu_enable_triton_gemm": False}  # as shard.gpu_target asks (see the test above)
    hlo = jax.jit(grads).lower(weights, tokens).compile(options).as_text()
    calls = collections.Counter(re.findall(r'custom_call_target="(__cu\w+\$[\w$]+)"', hlo))
    assert calls.pop("__cublas$lt$matmul$f8") >= 4 * cfg.period, calls  # at least 4 a layer, forward alone
    assert calls == {"__cublas$lt$matmul": 3, "__cudnn$fmhaSoftmax": 4, "__cudnn$fmhaSoftmaxBackward": 4}
    assert not re.search(r"= \S+ dot\(", hlo)  # no matmul left to XLA's own emitters


# ---- through the recipe: the presets, the startup line, a scaled-down stage 3 trained in fp8


def test_only_the_7b_stage3_preset_trains_in_fp8_as_ai2_s_scripts(capsys):
    """OLMo-core's official scripts: Float8Config(enabled=True) in OLMo-3-1025-7B-long-context.py alone (on bf16
    compute); OLMo-3-1025-32B-long-context.py and every other stage's script leave it off. --help says so."""
    assert {name for name, cfg in train.PRESETS.items() if cfg.compute.fp8} == {"7b-long-context"}
    assert train.PRESETS["7b-long-context"].compute == olmo3.Compute(
        "bfloat16", "auto", "auto", fp8="tensorwise"
    )
    for preset, said in [("7b-long-context", "'tensorwise'"), ("32b-long-context", "''")]:
        with pytest.raises(SystemExit):
            train.parse_args(["--preset", preset, "--help"])
        assert re.search(rf"^  --fp8 +{said} ", capsys.readouterr().out, re.M)


def test_the_startup_line_says_fp8_and_which_peak_mfu_is_against(capsys):
    """MFU's denominator with fp8 on is the dense bf16 peak, as OLMo-core's speed monitor's (Ironwood: 2,307
    TFLOP/s a chip, each of its two devices half)."""
    mesh = shard.make_mesh("fsdp=1", list(shard.compile_target("tpu7x:2x2x1").devices)[:1])
    cfg = train.PRESETS["7b-long-context"]
    train.announce(cfg, mesh, train.model_config(cfg), dataclasses.replace(cfg.compute, attention="splash"))
    said = capsys.readouterr().out
    assert (
        "bfloat16, fp8 tensorwise (the block linears), remat auto (the lightest that fits, chosen below);"
        in said
    )
    assert "peak 1154 TFLOP/s per device, dense bf16 (MFU's, fp8 or not)" in said


def test_a_resume_that_turns_fp8_on_or_off_is_refused_unless_allowed():
    """fp8 changes the numbers a step computes, as the dtype does: a resume that flips it is another recipe
    (--allow_config_change takes it); a checkpoint from before the flag trained without fp8."""
    cfg = train.PRESETS["tiny"]
    model = ckpt.config_to_hf(train.model_config(cfg))

    def meta(fp8):
        config = dataclasses.asdict(dataclasses.replace(cfg, compute=olmo3.Compute("bfloat16", fp8=fp8)))
        return dict(config=config, model=model, data={})

    check = lambda saved, now, allow=False: ckpt.check_resume(saved, now, train.RECIPE_FIELDS, allow, "run")
    check(meta("tensorwise"), meta("tensorwise"))
    with pytest.raises(ckpt.ResumeRefused, match="trained with another recipe: fp8: 'tensorwise' -> ''"):
        check(meta("tensorwise"), meta(""))
    check(meta("tensorwise"), meta(""), allow=True)
    before = meta("")
    del before["config"]["compute"]["fp8"]
    check(before, meta(""))
    with pytest.raises(ckpt.ResumeRefused, match="fp8: '' -> 'tensorwise'"):
        check(before, meta("tensorwise"))


def stage3_data(tiny_data, out) -> str:
    """Stage 3's data scaled down, as bench/fp8.py makes it: the tiny corpus's plays cut into documents of 20 to
    400 tokens, each ending in EOS, in 4 files; their glob."""
    sys.path.insert(0, str(ROOT / "bench"))
    import fp8

    out.mkdir(exist_ok=True)
    return fp8.documents(str(tiny_data / "train" / "part-00000.npy"), out)


# Stage 3 scaled down to the tiny model: documents packed into rows of twice its context (groups of 2 files,
# shuffled with seed 123), YaRN x2 on the full layers, the LR linear to 0 after a short warmup; in bf16 with
# the 7b-long-context preset's fp8.
STAGE3 = dataclasses.replace(
    train.PRESETS["tiny"],
    seq_len=512,
    global_batch=4,
    yarn=2.0,
    pack_files=2,
    file_seed=123,
    schedule="linear",
    lr_final=0.0,
    warmup_steps=3,
    steps=20,
    lr_horizon=20,
    compute=olmo3.Compute("bfloat16", fp8="tensorwise"),
    eval_every=10**6,
    samples=0,
)


@pytest.mark.slow
def test_a_scaled_down_stage3_trains_in_fp8_a_few_thousandths_from_the_bf16_run(tiny_data, tmp_path):
    """bench/fp8.py at 20 steps of 2 x 512: the same stage-3 run from the same init in fp32, bf16 and bf16 +
    fp8. fp8 trains as bf16 does; its loss strays from bf16's further than bf16's from fp32's (measured: 3.0e-3
    a step on average against 8.2e-4; e4m3 keeps 3 mantissa bits to bf16's 7, each operand rounded 16x
    coarser), and by less than 0.03 a step. Its table: the three policies, the bf16 run against itself. (Rows
    of 512 tokens, for YaRN; 2 of them, not 4: the same verdicts, 116 -> 81 s of CPU.)"""
    args = ["--steps", "20", "--seq_len", "512", "--global_batch", "2", "--lr", "2e-3", "--held_out", "512"]
    args += ["--json", "out.json"]
    # One CPU device, as a laptop runs it (the suite's 8 only add the step's exchanges between them: the same
    # numbers, 77 -> 66 s of CPU).
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fp8.py"), *args, "--data_root", str(tiny_data)],
        cwd=tmp_path,
        env=with_cpu_devices(1),
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    table = [line.split(" | ") for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [row[0] for row in table[1:]] == ["| fp32", "| bf16", "| bf16 + fp8"], out.stdout
    assert (table[2][2], table[2][4]) == ("0.0000", "100.00%"), out.stdout
    runs = json.loads((tmp_path / "out.json").read_text())
    fp32, bf16, fp8 = (np.array(runs[name]["loss"]) for name in ("fp32", "bf16", "bf16 + fp8"))
    assert (
        len(fp8) == 20 and fp8[-5:].mean() < 0.75 * fp8[0] and abs(fp8[-5:].mean() - bf16[-5:].mean()) < 0.05
    )
    bf16_cost, fp8_cost = np.abs(bf16 - fp32).mean(), np.abs(fp8 - bf16).mean()
    assert 0 < bf16_cost < fp8_cost < 0.03, (bf16_cost, fp8_cost)
    # In the final weights' predictions too.
    assert runs["bf16 + fp8"]["mean_kl"] > runs["fp32"]["mean_kl"] > 0


def test_a_stage3_run_in_fp8_exports_its_fp32_masters_as_plain_hugging_face_weights(
    tiny_data, tmp_path, monkeypatch
):
    """A stage-3 run in fp8 checkpoints and exports the fp32 master weights, nothing in fp8: `ckpt.py to-hf`
    writes every tensor in fp32, bit for bit the checkpoint's, and transformers' Olmo3ForCausalLM computes from
    them what our model computes without fp8 (a reader needs no fp8 kernel, as with AI2's released stage 3)."""
    from hf_models import hf_logits
    from safetensors.numpy import load_file
    from transformers import Olmo3ForCausalLM

    monkeypatch.chdir(tmp_path)  # no data/tiny here: the run keeps no tokenizer, so the export asks for one
    run, files = tmp_path / "run", stage3_data(tiny_data, tmp_path / "data")
    cfg = dataclasses.replace(STAGE3, data=files, run_dir=str(run), steps=2, lr_horizon=2, warmup_steps=1)
    assert train.main(cfg) == 0
    with pytest.raises(FileNotFoundError, match="pass --tokenizer PATH/tokenizer.json"):
        ckpt.export_hf(run, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    assert ckpt.export_hf(run, tmp_path / "hf", tokenizer=str(tiny_data / "tokenizer.json")) == 2
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float32)}
    (_, saved), exported = ckpt.newest_model(run), ckpt.load_hf(tmp_path / "hf")
    assert saved.cfg.rope_full.yarn.factor == 2.0 and exported.cfg == saved.cfg
    for a, b in zip(
        jax.tree.leaves(eqx.filter(saved, eqx.is_array)),
        jax.tree.leaves(eqx.filter(exported, eqx.is_array)),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = np.fromfile(tiny_data / "val" / "part-00000.npy", np.uint16)[None, :512].astype(np.int64)
    ours = np.asarray(eqx.filter_jit(lambda m, t: m(t))(exported, jnp.asarray(tokens)))[
        ..., : saved.cfg.vocab_size
    ]
    hf = Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    assert np.abs(hf_logits(hf, tokens) - ours).max() < 1e-4 * np.abs(ours).max()


@pytest.mark.slow
def test_a_stage3_run_in_fp8_killed_mid_step_resumes_bitwise(tiny_data, tmp_path):
    """Stage 3 in fp8 through train.py (tests/faults.py): killed mid-step and restarted, it logs every step once,
    bit for bit as the uninterrupted run: fp8's scales are recomputed from the tensors at every call, so a step
    is a function of the checkpoint and the batch alone, as in bf16."""
    flags = "--preset tiny --seq_len 256 --global_batch 4 --yarn 2 --pack_files 2 --file_seed 123 --schedule linear"
    flags += " --lr_final 0 --steps 6 --lr_horizon 6 --warmup_steps 2 --dtype bfloat16 --fp8 tensorwise"
    flags += " --ckpt_every 3 --eval_every 1000 --samples 0 --mesh data=1"
    files = stage3_data(tiny_data, tmp_path / "data")

    def run(run_dir, fault="none:0"):
        return train_py([*flags.split(), "--data", files, "--run_dir", run_dir], fault)

    def rows(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    assert run(tmp_path / "whole").returncode == 0
    assert run(tmp_path / "killed", "mid_step:5").returncode == -signal.SIGKILL
    resumed = run(tmp_path / "killed")
    assert resumed.returncode == 0 and "(step 3)" in resumed.stdout, resumed.stderr[-2000:]
    want, got = rows(tmp_path / "whole"), rows(tmp_path / "killed")
    assert [r["step"] for r in got] == list(range(1, 7))
    for a, b in zip(got, want, strict=True):
        assert all(a[key] == b[key] for key in ("loss", "grad_norm", "batch_hash", "lr")), (a, b)
