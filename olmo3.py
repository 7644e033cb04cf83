"""OLMo 3 in Equinox: the model that defines the maths.

OLMo 3 (AI2; OLMo-core `TransformerConfig.olmo3_*`, transformers `Olmo3ForCausalLM`) is a decoder-only
transformer whose departures from Llama are:
- reordered norm: `h = x + RMSNorm(attn(x))`, `out = h + RMSNorm(mlp(h))`; no norm on the block input
- QK-norm: one RMSNorm over the whole q (and k) projection, all heads together, before RoPE
- RMSNorm in fp32, eps 1e-6, the weight multiplied in fp32 *before* the cast back
- RoPE rotate-half (not interleaved) in fp32, theta 5e5, set per layer type; stage-3 and final
  checkpoints add YaRN on the full-attention layers only
- sliding-window attention: 3 layers that see 4096 keys (the current one included), then 1 full layer
- grouped-query attention (the 32B has 40 query heads on 8 kv heads), SwiGLU MLP, no biases anywhere,
  untied LM head after a final RMSNorm, vocab 100278 padded to 100352 (a multiple of 128)
- init: normal(0, 0.02) truncated at +-3 sigma, not renormalised; norm weights 1

The model maps a batch of sequences, or one (`*batch` may be empty). Shapes are written one way, in
annotations and comments alike: jaxtyping's space-separated dimension names ("batch seq embed"). The
names are the logical axes shard.py maps onto the mesh: batch, seq, embed, heads, kv_heads, head_dim, mlp,
vocab, and layers for the stacked blocks; inside a computation also group (query heads per kv head), keys
(the positions a query attends over), blocks and window (local attention), chunk (the chunked LM head).
Einsum strings take one letter per name: s/t seq as query/key position, k kv_heads, g group, h head_dim,
i blocks.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, Shaped

SLIDING, FULL = "sliding_attention", "full_attention"  # the layer-type names of HF's config.json
MAX_PERIOD = 8  # the longest group of layer types the scan body unrolls


# What the layer scan saves for the backward pass; anything not saved is recomputed.
REMAT_POLICIES = {
    "none": None,  # save everything
    "full": jax.checkpoint_policies.nothing_saveable,  # keep only each layer group's input
    # The linears' matmuls: each device's own copy of a weight (per_device) gives them batch axes, so named too.
    "save_matmuls": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("linear"),
    ),
    "save_attention": jax.checkpoint_policies.save_only_these_names("attention_out"),
}
# The attention paths; all compute the maths of `attention`'s reference path (see attention()).
ATTENTION_KERNELS = ("reference", "local", "cudnn", "splash")
QUERY_BLOCK = 2048  # the "local" path takes a longer row's full layers this many queries at a time
DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("", "tensorwise")  # Compute.fp8: off, or torchao's tensorwise recipe (fp8_linear)


@dataclass(frozen=True)
class Compute:
    """How the model computes: the compute policy, declared once and passed whole. None of it changes the
    weights; only the dtype changes the numbers by more than rounding."""

    dtype: str = "float32"  # "bfloat16" on accelerators; parameters (and Adam moments) stay fp32
    attention: str = "reference"  # one of ATTENTION_KERNELS, or "auto": train.py picks by hardware
    remat: str = "none"  # what the layer scan keeps for the backward pass: a key of REMAT_POLICIES, or
    # "auto": train.py takes the one that recomputes least (none, save_matmuls, full) whose step fits in 95%
    # of each device's memory, then the most rows at a time that fit; a CPU: full
    scan_unroll: int = 1  # layer groups per scan iteration
    max_documents: int = 0  # packed rows (--pack_files) on cuDNN: the most documents a row holds (the
    # padding one), a static bound cuDNN's packed attention compiles for; 0: train.py counts the data's most
    fp8: str = ""  # "tensorwise": the block linears in FP8 as AI2's stage 3 (fp8_linear); "": off

    def __post_init__(self):
        for name, allowed in [
            ("dtype", DTYPES),
            ("attention", ("auto",) + ATTENTION_KERNELS),
            ("remat", ("auto",) + tuple(REMAT_POLICIES)),
            ("fp8", FP8_RECIPES),
        ]:
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"Compute.{name} {getattr(self, name)!r}: expected one of "
                    + ", ".join(a or "''" for a in allowed)
                )
        if self.scan_unroll < 1:
            raise ValueError(f"Compute.scan_unroll {self.scan_unroll}: expected an integer >= 1")
        if self.max_documents < 0:
            raise ValueError(f"Compute.max_documents {self.max_documents}: expected an integer >= 0")


@dataclass(frozen=True)
class Yarn:
    """YaRN context extension (arXiv 2309.00071), as transformers computes it."""

    factor: float = 8.0
    original_max_position: int = 8192
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None  # None: 0.1 ln(factor) + 1
    truncate: bool = True  # round the correction range outwards to whole dimensions


@dataclass(frozen=True)
class Rope:
    theta: float = 500_000.0
    yarn: Yarn | None = None  # None in stages 1 and 2


@dataclass(frozen=True)
class Olmo3Config:
    """The architecture: what an HF config.json holds."""

    vocab_size: int = 100_278  # the tokenizer's (dolma2); the embedding is padded past it
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32  # fewer than n_heads: grouped-query attention
    head_dim: int = 128
    mlp_hidden: int = 11008
    layer_types: tuple[str, ...] = (SLIDING, SLIDING, SLIDING, FULL) * 8
    sliding_window: int = 4096  # keys a sliding layer sees, the current one included
    rope_sliding: Rope = Rope()
    rope_full: Rope = Rope()
    norm_eps: float = 1e-6
    max_seq_len: int = 8192
    init_std: float = 0.02
    eos_token_id: int = 100_257  # dolma2's; kept so an exported config.json is complete
    pad_token_id: int | None = 100_277

    def __post_init__(self):
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but n_layers={self.n_layers}")
        if bad := set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types may hold only {SLIDING!r} and {FULL!r}, found {sorted(bad)}")
        if self.period > MAX_PERIOD:
            raise ValueError(
                f"layer_types {list(self.layer_types)} is not a repeating pattern of at most {MAX_PERIOD} "
                "layers; the stack runs as a scan over one repeating group (so compile time does not grow "
                "with depth), e.g. [sliding, sliding, sliding, full] x k, [sliding, full] x k or all full"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // 128) * 128

    @property
    def period(self) -> int:
        """Length of the shortest group of layer types that repeats to make the whole stack."""
        n = self.n_layers
        return next(
            p for p in range(1, n + 1) if n % p == 0 and self.layer_types == self.layer_types[:p] * (n // p)
        )

    def attention_pairs(self, seq: int, layer_type: str) -> int:
        """(query, key) pairs a layer of this type computes over one instance of `seq` tokens: a query at
        position p sees p + 1 keys, or min(W, p + 1) on a sliding layer of window W."""
        w = self.window(layer_type)
        if w is None or w >= seq:
            return seq * (seq + 1) // 2
        return w * (w + 1) // 2 + (seq - w) * w

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token: a (m, k) x (k, n) matmul is 2mkn, training 3x the forward (the
        backward costs twice the forward), attention counts only the pairs the causal mask keeps."""
        matmul_params = (
            self.n_layers
            * (
                self.d_model * (2 * self.n_heads + 2 * self.n_kv_heads) * self.head_dim
                + 3 * self.d_model * self.mlp_hidden
            )
            + self.d_model * self.padded_vocab
        )
        pairs = sum(self.attention_pairs(seq, t) for t in self.layer_types)
        return 6 * matmul_params + 12 * self.n_heads * self.head_dim * pairs / seq

    def with_heads(self, heads: int, head_dim: int) -> "Olmo3Config":
        """The same width in another head layout, e.g. 16 x 256 for 32 x 128: the same parameters and group
        size, but one softmax over 256 dimensions and other RoPE frequencies, so another model (to train
        from scratch; the released 32 x 128 weights do not load into it)."""
        group = self.n_heads // self.n_kv_heads
        if heads * head_dim != self.n_heads * self.head_dim or heads % group:
            raise ValueError(
                f"{heads} heads x head_dim {head_dim}: expected heads x head_dim = "
                f"{self.n_heads * self.head_dim} (n_heads x head_dim), heads a multiple of {group} "
                "(n_heads / n_kv_heads)"
            )
        return dataclasses.replace(self, n_heads=heads, head_dim=head_dim, n_kv_heads=heads // group)

    def window(self, layer_type: str) -> int | None:
        return self.sliding_window if layer_type == SLIDING else None

    def rope(self, layer_type: str) -> Rope:
        return self.rope_sliding if layer_type == SLIDING else self.rope_full


def _olmo3(*, n_layers: int, **fields) -> Olmo3Config:
    """An Olmo3Config whose layers repeat OLMo 3's pattern: three sliding, then one full."""
    return Olmo3Config(
        n_layers=n_layers, layer_types=(SLIDING, SLIDING, SLIDING, FULL) * (n_layers // 4), **fields
    )


# OLMo-core's shapes (`TransformerConfig.olmo3_190M/1B/7B/32B`, tests/test_model.py compares them); `tiny` is
# ours, sized for a 2-core CPU and the 8192-token Shakespeare tokenizer.
MODELS = {
    "tiny": _olmo3(
        n_layers=4,
        d_model=256,
        n_heads=4,
        n_kv_heads=4,
        head_dim=64,
        mlp_hidden=768,
        vocab_size=8192,
        sliding_window=64,
        max_seq_len=256,
        eos_token_id=0,
        pad_token_id=None,
    ),
    "190m": _olmo3(n_layers=12, d_model=768, n_heads=12, n_kv_heads=12, head_dim=64, mlp_hidden=3072),
    "1b": _olmo3(n_layers=16, d_model=2048, n_heads=16, n_kv_heads=16, head_dim=128, mlp_hidden=8192),
    "7b": _olmo3(n_layers=32, d_model=4096, n_heads=32, n_kv_heads=32, head_dim=128, mlp_hidden=11008),
    "32b": _olmo3(n_layers=64, d_model=5120, n_heads=40, n_kv_heads=8, head_dim=128, mlp_hidden=27648),
}


# ---------------------------------------------------------------------------------------------------------
# The pieces


def trunc_normal(key: PRNGKeyArray, shape: tuple[int, ...], std: float) -> Float[Array, "..."]:
    # OLMo-core's init: N(0, std) cut at +-3 std and not rescaled. (jax.nn.initializers.truncated_normal
    # cuts at 2 std and rescales, which is another distribution.)
    return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, jnp.float32)


def rms_norm(x: Float[Array, "*rest"], weight: Float[Array, "*normed"], eps: float) -> Float[Array, "*rest"]:
    """RMSNorm over the trailing axes that `weight` spans, in fp32."""
    axes = tuple(range(-weight.ndim, 0))
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=axes, keepdims=True) + eps)
    # The weight multiplies in fp32 before the cast back, as OLMo-core and HF do (Llama casts first).
    w = weight.astype(jnp.float32).reshape((1,) * (x.ndim - weight.ndim) + weight.shape)
    return (w * y).astype(x.dtype)


def linear(
    x: Float[Array, "*lead in"], w: Float[Array, "..."], n_in: int = 1, out_dtype=None
) -> Float[Array, "..."]:
    """x's trailing n_in axes contracted with w's leading n_in, as one 2-D matmul. Flattening batch and
    sequence into one axis keeps the weight gradient a plain matmul: given a 3-D activation, XLA's CPU
    backend transposes the gradient into a copy and falls back to a slow dot (bench/RESULTS.md)."""
    k = math.prod(w.shape[:n_in])
    y = jnp.matmul(x.reshape(-1, k), w.reshape(k, -1), preferred_element_type=out_dtype)
    return y.reshape(*x.shape[: x.ndim - n_in], *w.shape[n_in:])


# ---------------------------------------------------------------------------------------------------------
# Each device with its own copy of the weights (shard.Layout.weights, where gradients are summed in a wider dtype
# than the layers compute in): a layer runs on each device's tokens with that device's copy, so that each
# device's gradient of a weight exists on its own, to be cast up before it is summed.


# How many devices split the tokens: each row whole over data, then over fsdp; a row's positions over context.
Devices = tuple[int, int, int]


def to_devices(x: Shaped[Array, "batch seq *rest"], devices: Devices) -> Shaped[Array, "..."]:
    """`x`'s tokens by the device that holds them, "data fsdp context batch seq ...": its rows split over
    devices[0] x devices[1] devices, each row's positions over devices[2] (the row in its balanced order)."""
    data, fsdp, context = devices
    b, s = x.shape[:2]
    return jnp.moveaxis(x.reshape(data, fsdp, b // (data * fsdp), context, s // context, *x.shape[2:]), 3, 2)


def from_devices(x: Shaped[Array, "data fsdp context batch seq *rest"]) -> Shaped[Array, "..."]:
    data, fsdp, context, b, s = x.shape[:5]
    return jnp.moveaxis(x, 2, 3).reshape(data * fsdp * b, context * s, *x.shape[5:])


def on_each_device(fn: Callable) -> Callable:
    return jax.vmap(jax.vmap(jax.vmap(fn)))


def per_device(fn: Callable, devices: Devices | None) -> Callable:
    """`fn(x, w, *rest)`, a layer that treats each token on its own (a linear, a norm, a lookup; x "batch seq
    ..."), run on each device's tokens with that device's copy of the weights `w` (leading "data fsdp
    context" axes: shard.Layout.weights). The same numbers as `fn(x, w_whole, *rest)`; autodiff then leaves
    each device's gradient of `w` apart, for the copies' backward pass to sum. No `devices`: `fn` itself."""
    if devices is None:
        return fn

    def run(x, w, *rest):
        each = on_each_device(lambda x, w: fn(x, w, *rest))
        return from_devices(each(to_devices(x, devices), w))

    return run


def per_device_sums(fn: Callable, devices: Devices | None) -> Callable:
    """`fn(w, *tokens)`, sums over the tokens (a pytree of them: the LM head's loss), run as per_device runs a
    layer, then added up over the devices in fp32. `tokens`: arrays "batch seq ..." (activations, targets).
    No `devices`: `fn` itself."""
    if devices is None:
        return fn

    def run(w, *tokens):
        each = on_each_device(fn)(w, *(to_devices(t, devices) for t in tokens))
        return jax.tree.map(lambda s: s.sum((0, 1, 2)), each)

    return run


def lookup(
    tokens: Int[Array, "*batch seq"], table: Float[Array, "vocab embed"]
) -> Float[Array, "*batch seq embed"]:
    return table[tokens]


# ---------------------------------------------------------------------------------------------------------
# FP8 linears: AI2 trained OLMo 3 7B's stage 3 with torchao's Float8Linear on every block linear, the "tensorwise"
# recipe (one scale per tensor, recomputed from the tensor at every call) with scales rounded down to powers of
# two and the weights cast to fp8 before FSDP's all-gather. fp8_linear computes what that computes.

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2  # forward operands; gradients (wider range, less precision)
AMAX_FLOOR = 1e-12  # torchao's: an all-zero tensor gets the scale of max|t| = 1e-12, not a division by zero


def fp8_scale(t: Float[Array, "..."], dtype, power_of_2: bool) -> Float[Array, ""]:
    """torchao's tensorwise scale of `t` for `dtype`: the format's largest value over max|t|, in fp32 (t * scale
    fills the format's range); `power_of_2`: rounded down to a power of two, so that scaling is exact."""
    fmax = float(jnp.finfo(dtype).max)  # 448 (e4m3fn), 57344 (e5m2)
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    # torchao divides in fp64 and rounds to fp32: the same as fp32's correctly rounded division. The floor is
    # a constant here because fp32 cannot hold 1e-12 itself (np.float32(1e-12) < 1e-12). A NaN amax (a NaN
    # in t) fails the test and makes a NaN scale, as in torchao.
    scale = jnp.where(amax <= AMAX_FLOOR, np.float32(fmax / AMAX_FLOOR), fmax / amax)
    if not power_of_2:
        return scale
    # 2^floor(log2(scale)) by clearing the mantissa bits: XLA:CPU's exp2 and log2 are not exact on powers of
    # two. (torchao's fp32 log2 rounds a scale a few fp32 steps below 2^k up to k, so it takes 2^k there: about
    # once in a million tensors.) A NaN scale (a NaN in t) stays NaN, as torchao's exp2(floor(log2(nan))), not
    # the infinity the mask would make of it; an infinite t gives scale 0, as there.
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & np.uint32(0xFF800000)
    return jnp.where(jnp.isnan(scale), scale, jax.lax.bitcast_convert_type(bits, jnp.float32))


def fp8_quantize(t: Float[Array, "..."], scale: Float[Array, ""], dtype) -> Shaped[Array, "..."]:
    """t * scale in `dtype`, rounded to nearest even and saturated at the format's largest value as torchao
    does: XLA's conversion to e4m3fn does not saturate (it makes NaN of what overflows)."""
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(t.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def _fp8_dot(
    a, b, contract: tuple[tuple[int, ...], tuple[int, ...]], scale, precision, dtype, batch=((), ())
):
    # An fp8 x fp8 matmul summed in fp32, then unscaled once: what cuBLAS's scaled fp8 GEMM does.
    y = jax.lax.dot_general(a, b, (contract, batch), precision=precision, preferred_element_type=jnp.float32)
    return (y / scale).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 4))
def fp8_linear(
    x: Float[Array, "*lead in"],
    w: Float[Array, "..."],
    n_in: int = 1,
    gathered: tuple | None = None,
    devices: Devices = (1, 1, 1),
) -> Float[Array, "..."]:
    """`linear(x, w, n_in)` as torchao's Float8Linear computes it under AI2's stage-3 settings (tensorwise,
    scales of activations and gradients rounded to powers of two, fp8 all-gather of FSDP weights). `w` is the
    fp32 master weight: under fp8 all-gather torchao casts it to e4m3 straight from fp32, with a scale from its
    amax that is not rounded. x in e4m3 (its scale a power of two); y = x8 @ w8 summed in fp32 and divided by
    both scales, in x's dtype. Backward: the output gradient g in e5m2 (one scale per call), then
    grad x = g8 @ w8^T and grad w = x8^T @ g8, summed in fp32, each in x's dtype (FSDP reduces bf16 gradients;
    the master's gradient is that, in fp32). The forward matmul uses cuBLAS's fast accumulation as torchao's
    does (DEFAULT precision), the backward ones not (HIGHEST).

    On a mesh `gathered` is (w8, its scale) as FSDP's fp8 all-gather hands them over (fp8_gathered: the same
    bits, the cast being elementwise), which both passes use; `w`, the sharded master, then only takes the
    gradient. `devices`: the tokens' devices (Layout.copies) where gradients are summed in fp32: each device's
    grad w in x's dtype, summed in fp32 (FSDP's reduce_dtype), as per_device does for the other layers."""
    return _fp8_fwd(x, w, n_in, gathered, devices)[0]


def _fp8_fwd(x, w, n_in, gathered, devices):
    if gathered is None and w.dtype != jnp.float32:
        raise ValueError(f"fp8_linear takes the fp32 master weight, got {w.dtype}")
    qw, sw = fp8_weight(w) if gathered is None else gathered
    sx = fp8_scale(x, E4M3, power_of_2=True)
    qx = fp8_quantize(x, sx, E4M3)
    # x's leading axes kept apart, not flattened into one as linear does: rows split over fsdp and positions
    # over context do not make one split axis, so XLA would gather x to flatten it.
    ins = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
    y = _fp8_dot(qx, qw, ins, sx * sw, jax.lax.Precision.DEFAULT, x.dtype)
    # Keeps x and w in fp8 for the backward pass (torchao keeps x in bf16 and casts it again, to the same
    # bits): a quarter of the fp32 weight's bytes, half of a bf16 activation's.
    return y, (qx, sx, qw, sw)


def _fp8_bwd(n_in, devices, saved, g):
    qx, sx, qw, sw = saved
    lead = tuple(range(qx.ndim - n_in))
    sg = fp8_scale(g, E5M2, power_of_2=True)
    qg = fp8_quantize(g, sg, E5M2)  # one cast, used by both matmuls
    highest = jax.lax.Precision.HIGHEST
    outs = (tuple(range(len(lead), g.ndim)), tuple(range(n_in, qw.ndim)))
    dx = _fp8_dot(qg, qw, outs, sg * sw, highest, g.dtype)
    # Rounded to g's precision (bf16) but kept in fp32: a cast down and back up would be one XLA may drop (it
    # allows excess precision), as it does on GPUs, where the unscaling joins the GEMM.
    bits = jnp.finfo(g.dtype)
    rounded = lambda dw: jax.lax.reduce_precision(dw, exponent_bits=bits.nexp, mantissa_bits=bits.nmant)
    if devices == (1, 1, 1):
        dw = rounded(_fp8_dot(qx, qg, (lead, lead), sx * sg, highest, jnp.float32))
    else:  # each device's own ("data fsdp context in out"), rounded, then summed in fp32 as Layout.weights sums
        mine = lambda t: to_devices(t, devices)  # "data fsdp context batch seq ..."
        each = _fp8_dot(mine(qx), mine(qg), ((3, 4), (3, 4)), sx * sg, highest, jnp.float32, ((0, 1, 2),) * 2)
        dw = rounded(each).sum(1).sum((0, 1))  # within each fsdp group, then across them
    return dx, dw, None


fp8_linear.defvjp(_fp8_fwd, _fp8_bwd)


def fp8_weight(w: Float[Array, "..."]) -> tuple[Shaped[Array, "..."], Float[Array, ""]]:
    """The fp32 master weight `w` in e4m3 and its scale, as torchao's fp8 all-gather casts it: the scale from
    the whole weight's amax (on a mesh, an all-reduce of each shard's), not rounded to a power of two."""
    scale = fp8_scale(w, E4M3, power_of_2=False)
    return fp8_quantize(w, scale, E4M3), scale


class Fp8Weight(eqx.Module):
    """A block linear's weight as FSDP's fp8 all-gather hands it to the layer (fp8_gathered)."""

    master: Float[Array, "..."]  # the fp32 master, as sharded: its gradient goes here
    bits: Shaped[Array, "..."]  # e4m3, all-gathered
    scale: Float[Array, ""]


def fp8_fits(shape: tuple[int, ...], n_in: int) -> bool:
    """Whether fp8 GEMMs take a linear's weight of this shape: the contracted and the output size multiples
    of 16 (torchao's rule, which leaves other linears alone)."""
    k, n = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    return k % 16 == 0 and n % 16 == 0


def block_linear(
    x: Float[Array, "*lead in"],
    w,
    n_in: int = 1,
    fp8: str = "",
    devices: Devices | None = None,
):
    """A block's linear: under Compute.fp8 in FP8 where fp8 GEMMs take the sizes (fp8_fits), else in x's dtype
    (Olmo3.as_used leaves the fp8 linears' weights in fp32). `w`: a weight, or on a mesh an Fp8Weight
    (fp8_gathered), or with `devices` each device's copy (per_device)."""
    if isinstance(w, Fp8Weight):
        return fp8_linear(x, w.master, n_in, (w.bits, w.scale), devices or (1, 1, 1))
    if fp8 == "tensorwise" and devices is None and fp8_fits(w.shape, n_in):
        return fp8_linear(x, w, n_in)
    if devices is None:
        return linear(x, w.astype(x.dtype), n_in)
    # Named, so that --remat save_matmuls saves it: per device the matmul has batch axes (REMAT_POLICIES).
    return checkpoint_name(per_device(linear, devices)(x, w, n_in), "linear")


def rope_frequencies(rope: Rope, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies (fp32) and the factor that scales cos and sin, as transformers computes them."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv_freq = (1.0 / np.float32(rope.theta) ** exponents).astype(np.float32)
    y = rope.yarn
    if y is None:
        return inv_freq, 1.0

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in the context
        return (
            head_dim
            * math.log(y.original_max_position / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    keep = 1 - ramp  # 1: extrapolate (high frequencies kept), 0: interpolate (divided by the factor)
    inv_freq = ((inv_freq / np.float32(y.factor)) * (1 - keep) + inv_freq * keep).astype(np.float32)
    scale = y.attention_factor if y.attention_factor is not None else 0.1 * math.log(y.factor) + 1.0
    return inv_freq, scale


def rope_cos_sin(
    rope: Rope, head_dim: int, seq_len: int, positions: Int[Array, "*batch seq"] | None = None
) -> tuple[Float[Array, "*#batch seq head_dim"], ...]:
    """RoPE's cos and sin at positions 0 ... seq_len - 1, or at `positions` (each row its own)."""
    inv_freq, scale = rope_frequencies(rope, head_dim)
    positions = jnp.arange(seq_len) if positions is None else positions
    angles = positions.astype(jnp.float32)[..., None] * inv_freq.reshape((1,) * positions.ndim + (-1,))
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def document_positions(documents: Int[Array, "*batch seq"]) -> Int[Array, "*batch seq"]:
    """Each position's offset in its document (packed rows: the documents' numbers, as `attention` takes)."""
    index = jnp.broadcast_to(jnp.arange(documents.shape[-1]), documents.shape)
    first = jnp.concatenate(
        [jnp.ones_like(documents[..., :1], bool), documents[..., 1:] != documents[..., :-1]], -1
    )
    return index - jax.lax.cummax(jnp.where(first, index, 0), axis=documents.ndim - 1)


def apply_rope(
    x: Float[Array, "*batch seq heads head_dim"],
    cos: Float[Array, "*#batch seq head_dim"],
    sin: Float[Array, "*#batch seq head_dim"],
) -> Float[Array, "*batch seq heads head_dim"]:
    x32 = x.astype(jnp.float32)  # rotate in fp32, cast back after
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    per_head = (1,) * (x.ndim - 1 - cos.ndim) + cos.shape[:-1] + (1, cos.shape[-1])  # every head alike
    return (x32 * cos.reshape(per_head) + rotated * sin.reshape(per_head)).astype(x.dtype)


def balanced_order(seq: int, context: int) -> np.ndarray:
    """The row's positions in the order a context axis of `context` devices holds them, an equal run each: the
    row cut into 2 x context chunks, device i holding chunk i and chunk 2 context - 1 - i. Under a causal mask
    a query's work grows with its position, so each device gets one early and one late chunk, the same work
    (Llama 3's split, OLMo-core's llama3 context parallelism). With one device: 0 ... seq - 1."""
    if context == 1:
        return np.arange(seq)
    chunks = np.arange(seq).reshape(2 * context, seq // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[-1 - i]]) for i in range(context)])


def causal_mask(seq_len: int, window: int | None, context: int = 1) -> Bool[Array, "seq seq"]:
    """True where query s may see key t: t <= s, and s - t < window on sliding layers; s and t are the
    positions held in the balanced order of `context` devices (balanced_order)."""
    position = balanced_order(seq_len, context)
    s, t = position[:, None], position[None, :]
    return jnp.asarray((t <= s) & (s - t < window) if window else t <= s)


def masked_softmax(
    scores: Float[Array, "*rest keys"], mask: Bool[Array, "*#rest keys"]
) -> Float[Array, "*rest keys"]:
    """Softmax over the keys in fp32; a masked key gets exactly zero weight."""
    return jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)


def attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    window: int | None,
    impl: str = "reference",
    layout=None,
    documents: Int[Array, "*batch seq"] | None = None,
    context: int = 1,
    max_documents: int = 0,
) -> Float[Array, "*batch seq heads head_dim"]:
    """Causal (optionally sliding-window) softmax attention with grouped kv heads. `layout` (shard.Layout)
    runs the Splash kernel on each device's shard; the other paths XLA partitions by itself. `documents`
    (packed rows: each position's document number) keeps each query to the keys of its own document, as
    OLMo-core's document masking does (its doc_lens). `context` > 1: q, k and v hold the row's positions in
    the balanced order of a context axis of that many devices (balanced_order), and the mask follows them.
    `max_documents`: cuDNN's static bound on a packed row's documents (Compute.max_documents)."""
    *batch, seq, n_heads, head_dim = q.shape
    if impl == "cudnn":
        if context > 1:
            raise ValueError(
                "Compute.attention 'cudnn' does not run with a context axis yet; expected splash, local or "
                "reference"
            )
        return _cudnn_attention(q, k, v, window, documents, max_documents)
    chunk = seq if context == 1 else seq // (2 * context)  # the runs of consecutive positions
    if impl == "local" and window and seq > window and chunk % window == 0:
        return _local_attention(q, k, v, window, documents, context)
    full = not window or window >= seq
    if impl == "local" and full and context == 1 and seq > QUERY_BLOCK and seq % QUERY_BLOCK == 0:
        return _query_blocks_attention(q, k, v, documents, QUERY_BLOCK)  # a full layer of a long row
    if impl == "splash":
        return _splash_attention(q, k, v, window, layout, documents, context)
    if context > 1:  # each device's queries against every key of the row (what a full layer needs)
        k, v = (layout.constrain(x, ("batch", None, "kv_heads", "head_dim")) for x in (k, v))
    mask = causal_mask(seq, window, context).reshape((1,) * len(batch) + (seq, seq))
    if documents is not None:
        mask = mask & (documents[..., :, None] == documents[..., None, :])
    return _softmax_attention(q, k, v, mask)


def _softmax_attention(
    q: Float[Array, "*batch queries heads head_dim"],
    k: Float[Array, "*batch keys kv_heads head_dim"],
    v: Float[Array, "*batch keys kv_heads head_dim"],
    mask: Bool[Array, "*#batch queries keys"],
) -> Float[Array, "*batch queries heads head_dim"]:
    """Softmax attention of the queries to the keys `mask` allows, scores and softmax in fp32; query head h
    reads kv head h // (heads / kv_heads)."""
    *batch, n_queries, n_heads, head_dim = q.shape
    n_kv = k.shape[-2]
    qg = q.reshape(*batch, n_queries, n_kv, n_heads // n_kv, head_dim)
    scores = jnp.einsum("...skgh,...tkh->...kgst", qg, k, preferred_element_type=jnp.float32) * head_dim**-0.5
    probs = masked_softmax(scores, jnp.expand_dims(mask, (-3, -4))).astype(v.dtype)  # kv_heads, group
    return jnp.einsum("...kgst,...tkh->...skgh", probs, v).reshape(q.shape)


def _query_blocks_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    documents: Int[Array, "*batch seq"] | None,
    block: int,
) -> Float[Array, "*batch seq heads head_dim"]:
    # A full layer `block` queries at a time, each block against every key of the row under the causal (and
    # document) mask: the reference's softmax with "block seq" scores instead of "seq seq", each block's
    # recomputed in the backward pass rather than kept. What lets a CPU take a 65,536-token row (the "seq seq"
    # scores of 4 heads alone would be 64 GiB), for the reference's work (it too computes the masked half).
    *batch, seq, n_heads, head_dim = q.shape
    blocks = jnp.moveaxis(q.reshape(*batch, seq // block, block, n_heads, head_dim), -4, 0)

    @jax.checkpoint
    def one_block(args):
        i, q_block = args
        mask = jnp.arange(seq)[None, :] <= i * block + jnp.arange(block)[:, None]
        mask = mask.reshape((1,) * len(batch) + (block, seq))
        if documents is not None:
            mine = jax.lax.dynamic_slice_in_dim(documents, i * block, block, axis=-1)
            mask = mask & (mine[..., :, None] == documents[..., None, :])
        return _softmax_attention(q_block, k, v, mask)

    out = jax.lax.map(one_block, (jnp.arange(seq // block), blocks))
    return jnp.moveaxis(out, 0, -4).reshape(q.shape)


def _cudnn_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    window: int | None,
    documents: Int[Array, "*batch seq"] | None,
    max_documents: int,
) -> Float[Array, "*batch seq heads head_dim"]:
    # cuDNN's flash attention (GPUs). Packed rows take its packed layout: each document of a row is a segment
    # (its start and length, document_segments) that cuDNN attends causally, and within the window, from the
    # segment's own start: the document mask without a "seq seq" mask array. JAX exposes that layout only in
    # its cuDNN module (jax.nn.dot_product_attention takes one length a row), and compiles it for a static
    # most segments a row (max_documents), which sizes cuDNN's softmax statistics.
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise ValueError(
            f"Compute.attention 'cudnn' needs bf16 or fp16 compute, got {q.dtype}: expected "
            "Compute.dtype bfloat16, or another Compute.attention"
        )
    if documents is None:
        local = (window - 1, 0) if window else None
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, implementation="cudnn", local_window_size=local
        )
    if max_documents < 1:
        raise ValueError(
            "Compute.attention 'cudnn' with packed documents compiles for a most documents a row: expected "
            "Compute.max_documents >= 1 (train.py counts them in the data)"
        )
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    if k.shape[-2] < q.shape[-2]:
        # JAX 0.10.2 scales the key offsets by the query's heads (fixed by jax-ml/jax#39521): give the keys
        # and values as many heads as the queries, query head h reading kv head h // group as elsewhere.
        k, v = (jnp.repeat(x, q.shape[-2] // k.shape[-2], axis=-2) for x in (k, v))
    offsets, lengths = document_segments(documents, max_documents)
    return cudnn.dot_product_attention(
        q,
        k,
        v,
        q_seqlen=lengths,
        kv_seqlen=lengths,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=q.shape[-1] ** -0.5,
        mask_type=cudnn.MaskType.PADDING_CAUSAL,
        sliding_window_length=window,  # keys (s - window, s], as the reference's s - t < window
    )


def document_segments(
    documents: Int[Array, "batch seq"], most: int
) -> tuple[Int[Array, "batch most_plus_one"], Int[Array, "batch most"]]:
    """Packed rows' documents (each a run of equal numbers; the padding one of them) as cuDNN's packed layout
    takes them: each document's first position, then -1 to `most` + 1 entries; each document's length, then
    -1 to `most`. A row of more than `most` documents is not caught here (train.py checks the data)."""
    seq = documents.shape[-1]
    starts = jnp.concatenate(
        [jnp.ones_like(documents[:, :1], bool), documents[:, 1:] != documents[:, :-1]], -1
    )
    offsets = jax.vmap(lambda row: jnp.nonzero(row, size=most + 1, fill_value=-1)[0])(starts)
    ends = jnp.where(offsets[:, 1:] >= 0, offsets[:, 1:], seq)
    lengths = jnp.where(offsets[:, :-1] >= 0, ends - offsets[:, :-1], -1)
    return offsets.astype(jnp.int32), lengths.astype(jnp.int32)


def _local_attention(
    q: Float[Array, "*batch seq heads head_dim"],
    k: Float[Array, "*batch seq kv_heads head_dim"],
    v: Float[Array, "*batch seq kv_heads head_dim"],
    window: int,
    documents: Int[Array, "*batch seq"] | None = None,
    context: int = 1,
) -> Float[Array, "*batch seq heads head_dim"]:
    # Sliding-window attention in blocks of `window` queries, each against its own block of keys and the
    # one before it in the row: exactly the keys the window can reach, so the same softmax as the reference
    # without the "seq seq" scores, of which all but ~2 * window per query are masked to an exact zero anyway.
    # Split over a context axis (balanced order), a device needs one block from each neighbour
    # (_blocks_before), never the whole row.
    # Shapes after `*batch`: q_blocks "blocks window heads head_dim", k_reach and v_reach "blocks keys kv_heads
    # head_dim" (2 * window keys: the block before, then this one), mask "blocks window keys".
    *batch, seq, n_heads, head_dim = q.shape
    n_blocks = seq // window
    position = balanced_order(seq, context).reshape(n_blocks, window)
    blocks = lambda x: x.reshape(*batch, n_blocks, window, *x.shape[len(batch) + 1 :])
    reach = lambda x, axis: jnp.concatenate([_blocks_before(x, axis, context, jnp), x], axis=axis + 1)
    k_reach, v_reach = reach(blocks(k), -4), reach(blocks(v), -4)
    s = position[:, :, None]  # the queries' and the reach's keys' positions in the row
    t = np.concatenate([_blocks_before(position, 0, context, np), position], axis=1)[:, None, :]
    first = (position[:, :1, None] == 0) & (np.arange(2 * window) < window)  # the row's first block has none
    mask = (t <= s) & (s - t < window) & ~first
    mask = jnp.asarray(mask.reshape((1,) * len(batch) + (n_blocks, window, 2 * window)))
    if documents is not None:  # each block's queries' documents against its reach's keys'
        d_blocks = blocks(documents)
        mask = mask & (d_blocks[..., :, None] == reach(d_blocks, -2)[..., None, :])
    return _softmax_attention(blocks(q), k_reach, v_reach, mask).reshape(q.shape)


def _blocks_before(x, axis: int, context: int, xp):
    """Each block of `x` (blocks along `axis`, in the balanced order of `context` devices) replaced by the
    block before it in the row; the row's first block by another (the caller masks it). numpy (xp=np) or
    jax.numpy alike. The blocks come as each device's two chunks: inside a chunk the block before is the
    chunk's own previous one; chunk i's first block needs chunk i - 1's last (device i - 1's first chunk's),
    chunk 2n - 1 - i's needs chunk 2n - 2 - i's last (device i + 1's second chunk's; on the last device its
    own first chunk's). So each device takes one block from each neighbour: shifts along the devices' axis,
    which XLA sends as collective permutes."""
    x = xp.moveaxis(x, axis, 0)
    if context == 1:  # the row in its order: the block before is the previous one
        return xp.moveaxis(xp.concatenate([x[:1], x[:-1]]), 0, axis)
    y = x.reshape(context, 2, -1, *x.shape[1:])  # device, its two chunks, their blocks
    last = y[:, :, -1]  # each chunk's last block
    first_chunks = xp.concatenate([last[:1, 0], last[:-1, 0]])  # device 0's: the row's first block
    second_chunks = xp.concatenate([last[1:, 1], last[-1:, 0]])
    edges = xp.stack([first_chunks, second_chunks], axis=1)[:, :, None]
    return xp.moveaxis(xp.concatenate([edges, y[:, :, :-1]], axis=2).reshape(x.shape), 0, axis)


def _splash_attention(q, k, v, window, layout, documents=None, context=1):
    # TPU Pallas (Mosaic) kernel; the window is a LocalMask, so it is honoured, never dropped. XLA cannot
    # partition a Mosaic kernel, so on a mesh it runs inside shard_map on each device's rows and heads:
    # q is regrouped as "kv_heads group" so that q, k and v split their heads alike.
    *batch, seq, n_heads, head_dim = q.shape
    n_kv = k.shape[-2]
    qg = q.reshape(*batch, seq, n_kv, n_heads // n_kv, head_dim)
    # Off a TPU the kernel runs in Pallas' interpreter (slow; it lets CPU tests check the kernel's maths).
    # What counts is where the step is compiled: the mesh's devices, which may be a TPU slice described
    # on a CPU machine (train.py --dry_run --topology); without a mesh, jit compiles for the default device.
    platform = layout.platform if layout is not None else jax.devices()[0].platform
    interpret = platform != "tpu"
    if context > 1:
        kernel, args, seq_axes = _splash_chunks_inputs(qg, k, v, window, documents, context, interpret)
    else:
        kernel = functools.partial(_splash_kernel, window=window, interpret=interpret)
        args = [qg, k, v] + ([] if documents is None else [documents.astype(jnp.int32)])
        seq_axes = [None] * len(args)  # whole rows on each device (the kernel masks by position in the row)
    for _ in batch:
        kernel = jax.vmap(kernel)
    if layout is not None:
        lead = ("batch",) + (None,) * (len(batch) - 1) if batch else ()
        rest = {
            4: ("kv_heads", None, "head_dim"),
            3: ("kv_heads", "head_dim"),
            1: (),
        }  # q; k and v; documents
        axes = [lead + (seq,) + rest[x.ndim - len(batch)] for seq, x in zip(seq_axes, args, strict=True)]
        kernel = layout.per_shard(kernel, axes)
    return kernel(*args).reshape(q.shape)


def _splash_chunks_inputs(qg, k, v, window, documents, context, interpret):
    """Splash over a context axis: the per-device kernel (_splash_chunks), its arguments, and which of them
    are split along the sequence ("seq": over the context axis) or whole (None). A sliding layer's device
    gets, beside its chunks, the window of keys before each chunk (_blocks_before: from its neighbours); a
    full layer's gets the whole row's keys, in the row's order."""
    *batch, seq, _, _, _ = qg.shape
    lead = len(batch)
    docs = jnp.zeros(qg.shape[: lead + 1], jnp.int32) if documents is None else documents.astype(jnp.int32)
    sliding, c = window is not None and window < seq, seq // (2 * context)
    if sliding and c % window:
        raise ValueError(
            f"a context axis of {context} cuts {seq} positions into chunks of {c}, not whole windows"
        )
    kernel = functools.partial(
        _splash_chunks, window=window if sliding else None, context=context, interpret=interpret
    )
    if sliding:  # the window before each chunk: every (c / window)-th block's block before, 2 a device
        windows = lambda x: x.reshape(*batch, seq // window, window, *x.shape[lead + 1 :])
        chunk_starts = (slice(None),) * lead + (slice(None, None, c // window),)
        before = lambda x: _blocks_before(windows(x), lead, context, jnp)[chunk_starts].reshape(
            *batch, 2 * context * window, *x.shape[lead + 1 :]
        )
        return kernel, [qg, k, v, docs, docs, before(k), before(v), before(docs)], ["seq"] * 8
    row = lambda x: _row_order(x, context, lead)
    return kernel, [qg, row(k), row(v), docs, row(docs)], ["seq", None, None, "seq", None]


def _splash_chunks(
    q, k, v, q_docs, kv_docs, k_before=None, v_before=None, docs_before=None, *, window, context, interpret
):
    """One device's share of a row split over a context axis: its two chunks of c consecutive positions
    (chunk i and chunk 2n - 1 - i, n = context), one Splash call each. Sliding layers: a chunk against the
    window before it (k_before: the two chunks' windows) and itself, a LocalMask the same on every device; the row's first chunk has no window
    before it, which segment ids mask (-1 matches no document). Full layers: a chunk j against the whole row
    under a causal mask offset by j * c; the mask is static, so each possible j is its own kernel and
    lax.switch runs the device's."""
    c = q.shape[0] // 2
    i = jax.lax.axis_index("context")
    halves = lambda x: (x[:c], x[c:])
    if window is not None:
        mask = _splash_mask_local((c, window + c), window)
        outs = []
        for h, row_start in ((0, i == 0), (1, False)):
            with_before = lambda x, b: jnp.concatenate([b[h * window : (h + 1) * window], halves(x)[h]])
            before_docs = jnp.where(row_start, -1, docs_before[h * window : (h + 1) * window])
            kv_docs_h = jnp.concatenate([before_docs, halves(kv_docs)[h]])
            args = (
                halves(q)[h],
                with_before(k, k_before),
                with_before(v, v_before),
                halves(q_docs)[h],
                kv_docs_h,
            )
            outs.append(_splash_call(*args, mask, interpret))
        return jnp.concatenate(outs)
    seq = k.shape[0]
    causal = lambda j: functools.partial(
        _splash_call, mask=_splash_mask_causal((c, seq), j * c), interpret=interpret
    )
    first = jax.lax.switch(
        i, [causal(j) for j in range(context)], halves(q)[0], k, v, halves(q_docs)[0], kv_docs
    )
    last = [causal(2 * context - 1 - j) for j in range(context)]
    second = jax.lax.switch(i, last, halves(q)[1], k, v, halves(q_docs)[1], kv_docs)
    return jnp.concatenate([first, second])


def _splash_mask_local(shape, window):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.LocalMask(shape, (window - 1, 0), offset=shape[1] - shape[0])


def _splash_mask_causal(shape, offset):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    return sa.CausalMask(shape, offset=offset)


def _splash_kernel(
    q: Float[Array, "seq kv_heads group head_dim"],
    k: Float[Array, "seq kv_heads head_dim"],
    v: Float[Array, "seq kv_heads head_dim"],
    documents: Int[Array, " seq"] | None = None,
    *,
    window: int | None,
    interpret: bool,
) -> Float[Array, "seq kv_heads group head_dim"]:
    seq = q.shape[0]
    mask = _splash_mask_local((seq, seq), window) if window else _splash_mask_causal((seq, seq), 0)
    return _splash_call(q, k, v, documents, documents, mask, interpret)


def _splash_call(
    q: Float[Array, "q_seq kv_heads group head_dim"],
    k: Float[Array, "kv_seq kv_heads head_dim"],
    v: Float[Array, "kv_seq kv_heads head_dim"],
    q_documents: Int[Array, " q_seq"] | None,
    kv_documents: Int[Array, " kv_seq"] | None,
    mask,
    interpret: bool,
) -> Float[Array, "q_seq kv_heads group head_dim"]:
    """One Splash kernel over every head: `mask` (a Splash mask of (q_seq, kv_seq)) for each, and where given
    the documents as segment ids (a key of another document is masked)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    q_seq, n_kv, group, head_dim = q.shape
    # Tiles of 512 keep the MXU busy; the kernel takes multiples of 128 (a lane's width), queries and keys.
    tile = lambda n: next((b for b in (512, 256, 128) if n % b == 0), None)
    block_q, block_kv = tile(q_seq), tile(k.shape[0])
    if block_q is None or block_kv is None:
        raise ValueError(
            f"Compute.attention 'splash' needs the sequence length ({q_seq}; keys {k.shape[0]}) to be a "
            "multiple of 128"
        )
    sizes = sa.BlockSizes(
        block_q=block_q,
        block_kv=block_kv,
        block_kv_compute=block_kv,
        block_q_dkv=block_q,
        block_kv_dkv=block_kv,
        block_kv_dkv_compute=block_kv,
        use_fused_bwd_kernel=True,
    )
    kernel = sa.make_splash_mha(
        sa.MultiHeadMask([mask] * (n_kv * group)),
        block_sizes=sizes,
        head_shards=1,
        q_seq_shards=1,
        interpret=interpret,
    )
    heads_first = lambda x: jnp.moveaxis(x.reshape(x.shape[0], -1, head_dim), 0, 1)  # heads seq head_dim
    segments = None if q_documents is None else sa.SegmentIds(q=q_documents, kv=kv_documents)
    q = q * head_dim**-0.5  # splash does not scale
    out = kernel(heads_first(q), heads_first(k), heads_first(v), segment_ids=segments)
    return jnp.moveaxis(out, 0, 1).reshape(q.shape)


# ---------------------------------------------------------------------------------------------------------
# Modules. Field names follow the HF checkpoint, so ckpt.py's key map reads like a table.


class Attention(eqx.Module):
    q_proj: Float[Array, "embed heads head_dim"]
    k_proj: Float[Array, "embed kv_heads head_dim"]
    v_proj: Float[Array, "embed kv_heads head_dim"]
    o_proj: Float[Array, "heads head_dim embed"]
    q_norm: Float[Array, "heads head_dim"]
    k_norm: Float[Array, "kv_heads head_dim"]

    def __init__(self, cfg: Olmo3Config, *, key: PRNGKeyArray):
        kq, kk, kv, ko = jax.random.split(key, 4)
        d, n, nk, h = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.q_proj = trunc_normal(kq, (d, n, h), cfg.init_std)
        self.k_proj = trunc_normal(kk, (d, nk, h), cfg.init_std)
        self.v_proj = trunc_normal(kv, (d, nk, h), cfg.init_std)
        self.o_proj = trunc_normal(ko, (n, h, d), cfg.init_std)
        self.q_norm = jnp.ones((n, h))
        self.k_norm = jnp.ones((nk, h))

    def __call__(
        self,
        x: Float[Array, "*batch seq embed"],
        cos: Float[Array, "*#batch seq head_dim"],
        sin: Float[Array, "*#batch seq head_dim"],
        window: int | None,
        cfg: Olmo3Config,
        attend=attention,
        dense=linear,  # the projections' matmul: linear, or block_linear (Compute.fp8, a mesh's copies)
        norm=rms_norm,  # or per_device(rms_norm) for a mesh's per-device copies
    ) -> Float[Array, "*batch seq embed"]:
        q = norm(dense(x, self.q_proj), self.q_norm, cfg.norm_eps)
        k = norm(dense(x, self.k_proj), self.k_norm, cfg.norm_eps)
        v = dense(x, self.v_proj)
        with jax.named_scope("attention"):
            out = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, window)
        out = checkpoint_name(out, "attention_out")
        return dense(out, self.o_proj, n_in=2)


class MLP(eqx.Module):
    gate_proj: Float[Array, "embed mlp"]
    up_proj: Float[Array, "embed mlp"]
    down_proj: Float[Array, "mlp embed"]

    def __init__(self, cfg: Olmo3Config, *, key: PRNGKeyArray):
        kg, ku, kd = jax.random.split(key, 3)
        self.gate_proj = trunc_normal(kg, (cfg.d_model, cfg.mlp_hidden), cfg.init_std)
        self.up_proj = trunc_normal(ku, (cfg.d_model, cfg.mlp_hidden), cfg.init_std)
        self.down_proj = trunc_normal(kd, (cfg.mlp_hidden, cfg.d_model), cfg.init_std)

    def __call__(self, x: Float[Array, "*batch seq embed"], dense=linear) -> Float[Array, "*batch seq embed"]:
        return dense(jax.nn.silu(dense(x, self.gate_proj)) * dense(x, self.up_proj), self.down_proj)


class Block(eqx.Module):
    self_attn: Attention
    mlp: MLP
    post_attention_layernorm: Float[Array, " embed"]
    post_feedforward_layernorm: Float[Array, " embed"]

    def __init__(self, cfg: Olmo3Config, *, key: PRNGKeyArray):
        ka, km = jax.random.split(key)
        self.self_attn = Attention(cfg, key=ka)
        self.mlp = MLP(cfg, key=km)
        self.post_attention_layernorm = jnp.ones(cfg.d_model)
        self.post_feedforward_layernorm = jnp.ones(cfg.d_model)

    def __call__(
        self,
        x: Float[Array, "*batch seq embed"],
        cos: Float[Array, "*#batch seq head_dim"],
        sin: Float[Array, "*#batch seq head_dim"],
        window: int | None,
        cfg: Olmo3Config,
        attend=attention,
        dense=linear,
        norm=rms_norm,
    ) -> Float[Array, "*batch seq embed"]:
        # Reordered norm: normalise each sublayer's output, then add it to the residual stream.
        h = x + norm(
            self.self_attn(x, cos, sin, window, cfg, attend, dense, norm),
            self.post_attention_layernorm,
            cfg.norm_eps,
        )
        with jax.named_scope("mlp"):
            return h + norm(self.mlp(h, dense), self.post_feedforward_layernorm, cfg.norm_eps)


class Olmo3(eqx.Module):
    embed_tokens: Float[Array, "vocab embed"]
    layers: Block  # every array carries a leading "layers" axis: n_layers blocks stacked for the scan
    norm: Float[Array, " embed"]
    lm_head: Float[Array, "embed vocab"]
    cfg: Olmo3Config  # not arrays: eqx.filter_jit treats them as static
    compute: Compute

    def __init__(self, cfg: Olmo3Config, *, key: PRNGKeyArray, compute: Compute = Compute()):
        ke, kl, kh = jax.random.split(key, 3)
        self.embed_tokens = trunc_normal(ke, (cfg.padded_vocab, cfg.d_model), cfg.init_std)
        self.layers = eqx.filter_vmap(lambda k: Block(cfg, key=k))(jax.random.split(kl, cfg.n_layers))
        self.norm = jnp.ones(cfg.d_model)
        self.lm_head = trunc_normal(kh, (cfg.d_model, cfg.padded_vocab), cfg.init_std)
        self.cfg, self.compute = cfg, compute

    def using(self, compute: Compute) -> "Olmo3":
        """The same weights, computed another way (another dtype, kernel, remat)."""
        return eqx.tree_at(lambda m: m.compute, self, compute)

    def __call__(self, tokens: Int[Array, "*batch seq"]) -> Float[Array, "*batch seq vocab"]:
        """Next-token logits in fp32 over the padded vocab (rows past cfg.vocab_size are padding)."""
        return linear(self.features(tokens), self.as_used().lm_head, out_dtype=jnp.float32)

    def as_used(self, layout=None) -> "Olmo3":
        """The weights as the layers use them. The dtype policy, in one place: fp32 master weights, cast
        to the compute dtype here (RMSNorm, RoPE, softmax and the logits still compute in fp32 inside).
        Under Compute.fp8 the block linears stay fp32: fp8_linear casts the master weight to fp8 itself, as
        torchao does. On a mesh `layout` (shard.Layout) casts and places them (Layout.weights: all-gathered
        over fsdp, or each device's own copy), except the layer stack, which the scan places one layer at a
        time (placed_block; its fp8 linears gathered as fp8 bits)."""
        return in_compute_dtype(self) if layout is None else layout.weights(self, self.compute.dtype)

    def features(
        self,
        tokens: Int[Array, "*batch seq"],
        layout=None,
        documents: Int[Array, "*batch seq"] | None = None,
        positions: Int[Array, "*batch seq"] | None = None,
        grad_sum: "Block | None" = None,
    ) -> Float[Array, "*batch seq embed"]:
        """The final-normed hidden states that the LM head reads. `documents` (packed rows: each position's
        document) masks attention between documents. RoPE's `positions` default to 0 ... seq - 1 across the
        row, as in the code AI2's released long-context model trained with; document_positions(documents)
        restarts them at each document, as OLMo-core does since May 2026. `grad_sum`: see layer_stack."""
        cfg, compute = self.cfg, self.compute
        if compute.attention == "auto":
            raise ValueError(
                "Compute.attention 'auto' is decided per run (train.attention_kernel picks by hardware): "
                f"expected one of {', '.join(ATTENTION_KERNELS)}"
            )
        if compute.remat == "auto":
            raise ValueError(
                "Compute.remat 'auto' is decided per run (train.fitting_microbatches picks the lightest that "
                f"fits): expected one of {', '.join(REMAT_POLICIES)}"
            )
        model = self.as_used(layout)
        seq = tokens.shape[-1]
        # A context axis (shard.py) splits each row's positions over devices in a balanced order: the row is
        # put in that order here, every layer works on it (attention masks by the positions the order says),
        # and the hidden states go back to the row's order at the end.
        context = layout.context(seq) if layout is not None else 1
        if context > 1:
            order = balanced_order(seq, context)
            positions = jnp.broadcast_to(jnp.arange(seq), tokens.shape) if positions is None else positions
            tokens, documents, positions = (
                a if a is None else a[..., order] for a in (tokens, documents, positions)
            )
        copies = layout.copies(compute.dtype) if layout is not None else None
        x = per_device(lookup, copies)(tokens, model.embed_tokens)
        if context > 1:
            x = layout.constrain(x, ("batch", "seq", None))
        attend = functools.partial(
            attention,
            impl=compute.attention,
            layout=layout,
            documents=documents,
            context=context,
            max_documents=compute.max_documents,
        )
        x = self.layer_stack(x, layout, attend, positions, grad_sum)
        x = per_device(rms_norm, copies)(x, model.norm, cfg.norm_eps)
        return x if context == 1 else _row_order(x, context, x.ndim - 2)

    def layer_stack(self, x, layout, attend, positions, grad_sum=None) -> Float[Array, "*batch seq embed"]:
        """The blocks, in order, on hidden states `x`. They run as a scan over groups of `period` layers (4 for
        OLMo 3: S, S, S, F), so the compiled program holds one group whatever the depth, and each layer's
        window is static. Each layer's fp32 masters are cast (and on a mesh placed) as its group runs.

        `grad_sum` (the layers' fp32 gradients summed so far, shaped as `self.layers`): gradient accumulation
        in the backward pass, as PyTorch adds each gradient into `.grad`. The backward pass adds each group's
        weight gradient into its slice of the sum as it makes it (sum_into), and autodiff hands the new sum
        back as the cotangent of `grad_sum`; the layers themselves get none. So a microbatch's gradient of
        the stack never exists whole beside the sum: on the 7B, 24 GiB of fp32 a device saved."""
        cfg, compute, seq = self.cfg, self.compute, x.shape[-2]
        copies = layout.copies(compute.dtype) if layout is not None else None
        dense = functools.partial(block_linear, fp8=compute.fp8, devices=copies)
        norm = per_device(rms_norm, copies)
        types = cfg.layer_types[: cfg.period]
        # In the order the types come (not a set's, which varies with Python's string hashing from process to
        # process): the traced program must be the same in every process for JAX's compilation cache.
        ropes = {t: rope_cos_sin(cfg.rope(t), cfg.head_dim, seq, positions) for t in dict.fromkeys(types)}
        by_group = lambda tree: jax.tree.map(lambda w: w.reshape(-1, cfg.period, *w.shape[1:]), tree)
        weights = self.layers if grad_sum is None else jax.lax.stop_gradient(self.layers)
        groups = by_group(weights)
        total = None if grad_sum is None else by_group(grad_sum)

        def group(carry, xs):
            x, total = carry
            blocks, g = xs
            if total is not None:
                blocks, total = sum_into(blocks, total, g)
            for i, t in enumerate(types):
                block = used_block(jax.tree.map(lambda w: w[i], blocks), compute, layout)
                x = block(x, *ropes[t], cfg.window(t), cfg, attend, dense, norm)
            return (x, total), None

        if compute.remat != "none":
            group = jax.checkpoint(group, policy=REMAT_POLICIES[compute.remat])
        xs = (groups, jnp.arange(cfg.n_layers // cfg.period))
        x, total = jax.lax.scan(group, (x, total), xs, unroll=compute.scan_unroll)[0]
        return x if total is None else with_sum(x, total)


# Gradient accumulation inside the backward pass (Olmo3.layer_stack's grad_sum). Two custom VJPs, both
# identities forward. sum_into stands where group g's weights enter the layer scan, the running sum threaded
# through the scan beside the hidden states; backward, it adds the group's weight gradient into the sum's slice
# g (in place: the scan carries the sum) and passes no gradient to the weights. with_sum ends the stack:
# backward, it hands the stack the sum so far as the cotangent of the carried sum, whatever came from the
# loss (nothing: the forward pass never reads the sum). So the reverse scan starts from the sum, adds group
# after group into it, and the cotangent autodiff returns for `grad_sum` is the sum with this microbatch's
# gradient added: acc + g, the same additions, in the same dtype, as summing whole gradient trees.


@jax.custom_vjp
def sum_into(blocks, total, g):
    return blocks, total


def _sum_into_fwd(blocks, total, g):
    return (blocks, total), g


def _sum_into_bwd(g, cotangents):
    grads, total = cotangents
    add = lambda t, d: jax.lax.dynamic_update_index_in_dim(
        t, jax.lax.dynamic_index_in_dim(t, g, keepdims=False) + d.astype(t.dtype), g, 0
    )
    return None, jax.tree.map(add, total, grads), None


sum_into.defvjp(_sum_into_fwd, _sum_into_bwd)


@jax.custom_vjp
def with_sum(x, total):
    return x


def _with_sum_fwd(x, total):
    return x, total


def _with_sum_bwd(total, dx):
    return dx, total


with_sum.defvjp(_with_sum_fwd, _with_sum_bwd)


def used_block(block: "Block", compute: Compute, layout) -> "Block":
    """One layer's fp32 masters as its layers compute with them (Olmo3.as_used for one layer): cast to the
    compute dtype, or on a mesh cast and placed (placed_block)."""
    return in_compute_dtype(block, compute) if layout is None else placed_block(block, compute, layout)


def in_compute_dtype(tree: "Olmo3 | Block", compute: Compute | None = None) -> "Olmo3 | Block":
    """A model's (or one block's) fp32 masters cast to the compute dtype, except under Compute.fp8 the block
    linears, which stay fp32: fp8_linear casts the master weight to fp8 itself, as torchao does."""
    compute = compute or tree.compute
    used = jax.tree.map(lambda w: w.astype(compute.dtype) if eqx.is_inexact_array(w) else w, tree)
    return eqx.tree_at(block_linears, used, block_linears(tree)) if compute.fp8 else used


def block_linears(model: "Olmo3 | Block") -> list:
    """The weights of the blocks' linears (the FP8 ones under Compute.fp8), of a model or one block; not the
    LM head or the embedding, which stay in the compute dtype, as in AI2's recipe."""
    block = model.layers if isinstance(model, Olmo3) else model
    a, m = block.self_attn, block.mlp
    return [a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj]


BLOCK_LINEAR_INPUTS = (1, 1, 1, 2, 1, 1, 1)  # each one's input axes (o_proj: heads x head_dim), n_in


def placed_block(block: Block, compute: Compute, layout) -> Block:
    """One layer's fp32 masters as its layers compute with them on a mesh: cast and placed by `layout`
    (shard.Layout.weights); under Compute.fp8 its fp8 linears as FSDP's fp8 all-gather hands them over."""
    if not compute.fp8:
        return layout.weights(block, compute.dtype)
    fp8 = fp8_gathered(block, layout)
    rest = eqx.tree_at(
        block_linears, block, [w if f is None else None for w, f in zip(block_linears(block), fp8)]
    )
    used = layout.weights(rest, compute.dtype)
    linears = [w if f is None else f for w, f in zip(block_linears(used), fp8)]
    return eqx.tree_at(block_linears, used, linears, is_leaf=lambda x: x is None)


def fp8_gathered(block: Block, layout) -> list:
    """The block's fp8 linears as torchao's fp8 all-gather hands them over (AI2's enable_fsdp_float8_all_gather):
    each fp32 master cast to e4m3 with the scale of its whole amax (fp8_weight: an all-reduce of each shard's),
    then the e4m3 bits all-gathered, one byte an element on the wire; None for a linear fp8 GEMMs do not take
    (fp8_fits), which stays in the compute dtype."""
    masters = block_linears(block)
    fits = [fp8_fits(w.shape, n_in) for w, n_in in zip(masters, BLOCK_LINEAR_INPUTS, strict=True)]
    cast = [fp8_weight(jax.lax.stop_gradient(w)) if ok else None for w, ok in zip(masters, fits)]
    bits = block_linears(
        layout.gather(eqx.tree_at(block_linears, block, [c[0] if c else w for c, w in zip(cast, masters)]))
    )
    return [Fp8Weight(w, b, c[1]) if c else None for w, b, c in zip(masters, bits, cast)]


def _row_order(x: Shaped[Array, "..."], context: int, axis: int) -> Shaped[Array, "..."]:
    """`x`, whose axis `axis` holds a row's positions in balanced_order(seq, context), in the row's order: the
    devices' first chunks in turn, then their second chunks in reverse (slices and a reversal XLA sends as
    collective permutes, where an index gather would all-reduce the whole row)."""
    y = jnp.moveaxis(x, axis, 0)
    y = y.reshape(context, 2, -1, *y.shape[1:])
    y = jnp.concatenate([y[:, 0], y[::-1, 1]]).reshape(x.shape[axis], *y.shape[3:])
    return jnp.moveaxis(y, 0, axis)


def abstract(cfg: Olmo3Config, compute: Compute = Compute()) -> Olmo3:
    """The model's shapes and dtypes as jax.ShapeDtypeStruct leaves, nothing allocated: what a restore
    reads into, a dry run compiles for and a parameter count reads."""
    return eqx.filter_eval_shape(Olmo3, cfg, key=jax.random.key(0), compute=compute)


def is_array(x) -> bool:
    """An array or an abstract one (from eval_shape): what a model or optimizer state holds."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def count_params(model: Olmo3) -> int:
    """Number of parameters; works on an abstract model from eqx.filter_eval_shape too."""
    return sum(math.prod(w.shape) for w in jax.tree.leaves(model) if is_array(w))


# ---------------------------------------------------------------------------------------------------------
# The LM head a chunk of positions at a time, for a loss that never holds a batch's logits whole: in fp32 they
# are 8192 x 100352 x 4 bytes = 3.3 GB per instance on the 7B. Each chunk's logits are made, reduced by the
# loss (`sums`) and differentiated by autodiff of `sums` alone in one pass, so they are read once.

Sums = Callable[
    [Float[Array, "batch chunk vocab"], Int[Array, "batch chunk"], Shaped[Array, "batch chunk"]], tuple
]


def lm_head_sums(
    x: Float[Array, "batch seq embed"],
    w: Float[Array, "embed vocab"],
    sums: Sums,
    targets: Int[Array, "batch seq"],
    mask: Shaped[Array, "batch seq"],
    chunk: int,
    weights: tuple | None = None,
):
    """`sums(logits, targets, mask)` (mask: which positions count, or each one's weight), a tuple of scalars
    (or, without `weights`, of per-instance arrays), added up over `chunk` positions of every instance at a
    time (0: the whole sequence); given `weights`, one per sum, also the gradients of the weighted total with
    respect to x and w (else None, None)."""
    batch, seq, embed = x.shape
    chunk = math.gcd(seq, chunk) if chunk else seq  # a divisor (per_device_sums: a device's positions)
    by_chunk = lambda a: jnp.moveaxis(a.reshape(batch, seq // chunk, chunk, *a.shape[2:]), 1, 0)

    def one(dw_so_far, inputs):  # the chunks scan over the sequence, so the batch stays split over devices
        x_chunk, targets_chunk, mask_chunk = inputs  # batch chunk embed, batch chunk, batch chunk
        # In x's dtype, as OLMo-core's LM head makes them: bf16 under its bf16 policy (`sums` upcasts them).
        chunk_logits = linear(x_chunk, w, out_dtype=x.dtype)  # batch chunk vocab
        chunk_sums, vjp = jax.vjp(lambda logits: sums(logits, targets_chunk, mask_chunk), chunk_logits)
        if weights is None:
            return dw_so_far, (chunk_sums, None)
        # The weights (the loss's scale) enter before the matmuls, as autodiff through the whole model orders
        # it: g is the weighted total's gradient with respect to the logits (batch chunk vocab).
        g = vjp(weights)[0].astype(x.dtype)
        dx_chunk = linear(g, w.T)  # batch chunk embed
        dw_so_far += jnp.matmul(  # embed vocab
            x_chunk.reshape(-1, embed).T, g.reshape(-1, w.shape[1]), preferred_element_type=jnp.float32
        )
        return dw_so_far, (chunk_sums, dx_chunk)

    inputs = (by_chunk(x), by_chunk(targets), by_chunk(mask))
    dw, (per_chunk, dx) = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32), inputs)
    totals = tuple(s.sum(0) for s in per_chunk)  # over the chunks
    if weights is None:
        return totals, None, None
    return totals, jnp.moveaxis(dx, 0, 1).reshape(x.shape), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 6))
def fused_lm_head(x, w, sums: Sums, targets, mask, weights: tuple, chunk: int):
    """(the weighted total of `sums` over the batch, the sums), as lm_head_sums. The total's gradient with
    respect to x and w is made in the forward pass, so the backward keeps no logits; the sums carry none."""
    totals, _, _ = lm_head_sums(x, w, sums, targets, mask, chunk)
    return _weighted(weights, totals), totals


def _weighted(weights, totals):
    return functools.reduce(jnp.add, (wt * t for wt, t in zip(weights, totals, strict=True)))


def _fused_fwd(x, w, sums, targets, mask, weights, chunk):
    totals, dx, dw = lm_head_sums(x, w, sums, targets, mask, chunk, weights)
    return (_weighted(weights, totals), totals), (dx, dw, weights)


def _fused_bwd(sums, chunk, saved, cotangents):
    dx, dw, weights = saved
    g = cotangents[0]  # the total is linear in the sums: its gradients are the forward's times g
    zeros = jax.tree.map(jnp.zeros_like, weights)
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None, None, zeros


fused_lm_head.defvjp(_fused_fwd, _fused_bwd)


# ---------------------------------------------------------------------------------------------------------
# Sampling


def sample(
    model: Olmo3,
    prompt: Int[Array, " prompt"],
    max_new_tokens: int,
    *,
    key: PRNGKeyArray,
    temperature: float = 1.0,
    top_k: int | None = None,
) -> Int[Array, " total"]:
    """Extend `prompt` token by token: greedy at temperature 0, else softmax sampling, optionally top-k."""
    total = prompt.shape[0] + max_new_tokens
    if total > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({prompt.shape[0]}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len={model.cfg.max_seq_len}"
        )
    buf = jnp.zeros(total, jnp.int32).at[: prompt.shape[0]].set(prompt)
    return _sample(model, buf, prompt.shape[0], key, temperature, top_k)


@eqx.filter_jit
def _sample(model, buf, start, key, temperature, top_k):
    # No KV cache: each step reruns the whole fixed-length buffer, which causality makes exact (positions
    # after i cannot change the logits at i). Quadratic, and plenty for the tiny preset.
    def step(i, state):
        buf, key = state
        logits = model(buf)[i - 1, : model.cfg.vocab_size]
        key, sub = jax.random.split(key)
        if temperature == 0:
            return buf.at[i].set(jnp.argmax(logits)), key
        logits = logits / temperature
        if top_k is not None:
            logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][-1], -jnp.inf, logits)
        return buf.at[i].set(jax.random.categorical(sub, logits)), key

    return jax.lax.fori_loop(start, buf.shape[0], step, (buf, key))[0]
