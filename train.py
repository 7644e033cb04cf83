"""Stage 1 of the OLMo 3 pretraining recipe, in one file: config, LR schedule, loss, the train step, the loop.

    python train.py --preset tiny                      # Shakespeare on a laptop CPU, about 5 minutes
    python train.py --preset 7b --data mix.txt --data_root /mnt/olmo-data --run_dir runs/7b
    python train.py --preset 7b --mesh fsdp=-1 --dry_run   # compile only: memory per device, FLOPs
    python train.py --preset 7b --init_from_hf Olmo-3-1025-7B-stage1-step0 ...

Every TrainConfig field is a flag (`--field value` or `--field=value`). Rerunning the same command with the
same --run_dir resumes from the newest valid checkpoint, bit for bit: the data order is a pure function of
(seed, step), and everything else that shapes step k+1 is in the checkpoint.
The recipe: OLMo-core's `src/scripts/official/OLMo3/OLMo-3-1025-7B-pretrain-1.py`, summarised in
shared/docs/olmo3-spec.md section 3.
"""

import collections
import dataclasses
import difflib
import functools
import glob
import json
import math
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

import ckpt
import data
import olmo3
import shard

# ---------------------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "7b"  # model shape from olmo3.PRESETS
    head_layout: str = ""  # e.g. "16x256": other heads x head_dim, same width. A different model (from scratch)
    # data
    data: str = ""  # token files (comma-separated, globs allowed), an OLMo-core mix .txt, or "tiny"
    data_root: str = ""  # prefix for relative paths in a mix file (a gcsfuse-mounted bucket is a local path)
    eval_data: str = ""  # held-out token files, read in order
    tokenizer: str = "dolma2"  # for samples and for checking token ids against the vocabulary
    seq_len: int = 8192
    global_batch: int = 512  # instances per optimizer step: 512 x 8192 = 4,194,304 tokens
    seed: int = 34521  # data order: OLMo-core's PCG64(seed + epoch) permutation
    init_seed: int = 0  # model init (bit-exact torch init cannot be reproduced: use --init_from_hf step0)
    # optimizer: OLMo-core's SkipStepAdamW
    lr: float = 3e-4
    warmup_steps: int = 2000
    lr_horizon: int = 1_192_093  # cosine length in steps: ceil(5e12 tokens / 4,194,304)
    lr_final: float = 0.1  # the cosine ends at lr * lr_final
    steps: int = 597_046  # part 1 of stage 1 stops here (mid-cosine), as the official run did
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # decoupled, scaled by the current lr; embeddings exempt
    clip: float = 1.0  # global grad-norm clipping
    skip_sigma: float = 6.0  # skip the update if loss or grad norm is this many std above the recent mean
    skip_window: int = 128  # ... over this many previous steps, once half as many are known
    z_loss: float = 1e-5
    # compute
    compute_dtype: str = "bfloat16"  # parameters and Adam moments stay fp32
    attention: str = "auto"  # auto | reference | cudnn | splash (see attention_kernel below)
    remat: str = "full"  # none | full | save_matmuls | save_attention
    microbatch: int = 0  # instances per device per forward/backward; 0 = the device's whole share
    loss_chunk: int = 0  # positions of each instance per chunk of the fused LM-head loss; 0 = the whole sequence
    scan_unroll: int = 1
    deterministic: bool = True  # GPUs: bitwise-repeatable steps, which exact resumption needs (cost: bench/)
    mesh: str = "fsdp=-1"  # e.g. data=2,fsdp=4,tensor=1; one axis may be -1 ("the rest")
    # run
    run_dir: str = "runs/7b"
    ckpt_every: int = 1000
    keep_last: int = 2  # recent checkpoints kept (at least 2: the newest may be mid-write)
    keep_every: int = 0  # also keep every step divisible by this, forever; 0 = none
    eval_every: int = 1000
    eval_batches: int = 16
    init_from_hf: str = ""  # start from released weights (e.g. AI2's stage1-step0) instead of random init
    eval_only: bool = False  # evaluate the latest checkpoint (or --init_from_hf) and exit
    dry_run: bool = False  # compile one step for the mesh, print memory and FLOPs, exit
    allow_config_change: bool = False  # resume although the recipe changed (e.g. more steps, a new schedule)
    tensorboard: bool = False  # also write TensorBoard event files (needs the tensorboard extra)
    samples: int = 0  # lines of text to sample at the end
    coordinator: str = ""  # multi-host outside TPU VMs / known clusters: host:port of process 0
    num_processes: int = 0
    process_id: int = -1


# The official stage-1 recipe is the default above; the smaller presets scale it down.
PRESETS = {
    "tiny": TrainConfig(
        preset="tiny", data="tiny", tokenizer="tiny", seq_len=256, global_batch=8, lr=2e-3, warmup_steps=20,
        lr_horizon=240, steps=240, compute_dtype="float32", remat="none", mesh="data=1", run_dir="runs/tiny",
        ckpt_every=120, eval_every=60, eval_batches=8, samples=3),
    "190m": TrainConfig(preset="190m", lr=4e-4, warmup_steps=2000, lr_horizon=40_000, steps=40_000,
                        global_batch=256, seq_len=4096, run_dir="runs/190m"),
    "1b": TrainConfig(preset="1b", lr=4e-4, lr_horizon=100_000, steps=100_000, global_batch=512,
                      seq_len=4096, run_dir="runs/1b"),
    "7b": TrainConfig(),
    "32b": TrainConfig(preset="32b", lr=6e-4, global_batch=1024, run_dir="runs/32b"),
}

# Fields that change the numbers a run computes; resuming with any of them changed needs
# --allow_config_change. The rest (mesh, microbatch, remat, intervals, ...) may change freely.
# The data itself is compared through its fingerprint (files and sizes), so it may move to another mount.
RECIPE_FIELDS = ("preset", "head_layout", "seq_len", "global_batch", "seed", "init_seed", "lr", "warmup_steps",
                 "lr_horizon", "lr_final", "steps", "beta1", "beta2", "eps", "weight_decay", "clip", "skip_sigma",
                 "skip_window", "z_loss", "compute_dtype")


def parse_args(argv: list[str]) -> TrainConfig:
    """`--preset NAME` picks the base; every other TrainConfig field can then be set by `--field value`."""
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise SystemExit(f"error: unexpected argument {arg!r}; flags look like --field value")
        name, eq, value = arg[2:].partition("=")
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3)
            raise SystemExit(f"error: unknown flag --{name}" + (f"; did you mean {', '.join('--' + c for c in close)}?" if close else ""))
        if not eq:
            is_bool = fields[name].type is bool
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                value, i = argv[i + 1], i + 1
            elif is_bool:
                value = "true"
            else:
                raise SystemExit(f"error: --{name} needs a value")
        pairs.append((name, value))
        i += 1
    preset = dict(pairs).get("preset", "7b")
    if preset not in PRESETS:
        raise SystemExit(f"error: --preset {preset!r} is not one of {list(PRESETS)}")
    cfg = PRESETS[preset]
    for name, value in pairs:
        kind = fields[name].type
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                typed = value.lower() in ("true", "1")
            else:
                typed = kind(value)
        except ValueError:
            raise SystemExit(f"error: --{name} expects {kind.__name__}, got {value!r}") from None
        cfg = dataclasses.replace(cfg, **{name: typed})
    return cfg


# ---------------------------------------------------------------------------------------------------------
# The learning-rate schedule: linear warmup from 0, then cosine to lr * lr_final (OLMo-core CosWithWarmup).


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR of optimizer step `step`, counted from 1 as OLMo-core counts (the first step is step 1)."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if step >= cfg.lr_horizon:
        return cfg.lr * cfg.lr_final
    progress = (step - cfg.warmup_steps) / (cfg.lr_horizon - cfg.warmup_steps)
    low = cfg.lr * cfg.lr_final
    return low + (cfg.lr - low) * (1 + math.cos(math.pi * progress)) / 2


# ---------------------------------------------------------------------------------------------------------
# The optimizer: AdamW that skips spikes, as OLMo-core's SkipStepAdamW. optax has AdamW but not the skip, and
# the skip must leave parameters, moments and the step count untouched, so the update is written out here.


class OptState(eqx.Module):
    count: Float[Array, ""]  # Adam steps taken; skipped steps do not count (fp32, as OLMo-core)
    mu: olmo3.Olmo3  # first moments, shaped like the model (fp32)
    nu: olmo3.Olmo3  # second moments
    losses: Float[Array, " window"]  # ring buffer of the previous CE losses, for the skip rule
    grad_norms: Float[Array, " window"]  # ... and of the pre-clip grad norms
    seen: Int[Array, ""]  # steps that entered the ring; it lives here so a resume keeps it


def init_opt(params: olmo3.Olmo3, cfg: TrainConfig) -> OptState:
    zeros = lambda: jax.tree.map(jnp.zeros_like, eqx.filter(params, eqx.is_array))
    window = lambda: jnp.zeros(cfg.skip_window, jnp.float32)
    return OptState(jnp.zeros((), jnp.float32), zeros(), zeros(), window(), window(), jnp.zeros((), jnp.int32))


def is_spike(history, seen, x, cfg: TrainConfig):
    """OLMo-core's rule: x is a spike if it is not within skip_sigma (unbiased) std of the recent mean."""
    n = jnp.minimum(seen, cfg.skip_window)
    valid = jnp.arange(cfg.skip_window) < n
    mean = jnp.where(valid, history, 0).sum() / n
    std = jnp.sqrt(jnp.where(valid, (history - mean) ** 2, 0).sum() / (n - 1))
    known = n + 1 >= max(2, cfg.skip_window // 2)  # OLMo-core counts this step too
    return known & ~(x - mean <= cfg.skip_sigma * std)  # written so that a NaN is a spike


def optimizer_step(params, grads, opt: OptState, lr, ce_loss, grad_norm, cfg: TrainConfig):
    skip = is_spike(opt.losses, opt.seen, ce_loss, cfg) | is_spike(opt.grad_norms, opt.seen, grad_norm, cfg)
    slot = opt.seen % cfg.skip_window
    window = dict(losses=opt.losses.at[slot].set(ce_loss), grad_norms=opt.grad_norms.at[slot].set(grad_norm),
                  seen=opt.seen + 1)

    # Clip by global norm as torch's clip_grads_with_norm_ does.
    grads = jax.tree.map(lambda g: g * jnp.minimum(cfg.clip / (grad_norm + 1e-6), 1.0), grads)
    count = opt.count + 1
    step_size = lr / (1 - cfg.beta1**count)
    bias2 = jnp.sqrt(1 - cfg.beta2**count)
    mu = jax.tree.map(lambda m, g: cfg.beta1 * m + (1 - cfg.beta1) * g, opt.mu, grads)
    nu = jax.tree.map(lambda v, g: cfg.beta2 * v + (1 - cfg.beta2) * g * g, opt.nu, grads)
    decay = eqx.tree_at(lambda p: p.embed_tokens, jax.tree.map(lambda _: cfg.weight_decay, params), 0.0)
    new = jax.tree.map(lambda p, m, v, wd: p * (1 - lr * wd) - step_size * m / (jnp.sqrt(v) / bias2 + cfg.eps),
                       params, mu, nu, decay)

    # A skipped step keeps the old values exactly (a select, not a multiply by 0, so a NaN cannot leak in).
    keep = lambda old, upd: jax.tree.map(lambda o, u: jnp.where(skip, o, u), old, upd)
    opt = OptState(keep(opt.count, count), keep(opt.mu, mu), keep(opt.nu, nu), **window)
    return keep(params, new), opt, skip


# ---------------------------------------------------------------------------------------------------------
# The loss: cross-entropy in fp32 over the padded vocab, the last position of each instance untargeted,
# plus z-loss = z_loss * mean(logsumexp^2), both averaged over the targeted positions (OLMo-core).
#
# The LM head and the loss run fused, a chunk of positions at a time: each chunk computes its fp32 logits,
# its losses and, in the same pass, their gradients with respect to the features and the LM head, so the
# logits (8192 x 100352 x 4 bytes = 3.3 GB per instance on the 7B) exist one chunk at a time and are read
# once. Left to autodiff they would be kept whole for the backward pass, or recomputed chunk by chunk.


def cross_entropy(logits: Float[Array, "*n vocab"], targets: Int[Array, "*n"]):
    """Per-position CE and logsumexp, in fp32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], lse


def lm_head_chunks(x: Float[Array, "batch seq embed"], w: Float[Array, "embed vocab"], targets: Int[Array, "batch seq"],
                   chunk: int, z_loss: float | None = None, scale: float = 1.0):
    """Summed CE and logsumexp^2 over the targeted positions (all but each instance's last, which has no next
    token), `chunk` positions of every instance at a time. Given z_loss, also the gradients of
    scale * (CE + z_loss * logsumexp^2) with respect to x and w."""
    batch, seq, d = x.shape
    chunk = chunk or seq
    if seq % chunk:
        raise ValueError(f"--loss_chunk {chunk} must divide --seq_len {seq}")
    position = jnp.arange(seq).reshape(-1, chunk)  # the chunks scan over the sequence, so the batch stays sharded
    by_chunk = lambda a: jnp.moveaxis(a.reshape(batch, seq // chunk, chunk, *a.shape[2:]), 1, 0)

    def one(dw, inputs):
        xc, tc, pc = inputs
        logits = olmo3.linear(xc, w, out_dtype=jnp.float32)
        ce, lse = cross_entropy(logits, tc)
        targeted = (pc < seq - 1)[None]
        sums = jnp.where(targeted, ce, 0).sum(), jnp.where(targeted, lse * lse, 0).sum()
        if z_loss is None:
            return dw, (sums, None)
        # The two terms' gradients with respect to the logits, scaled and summed as autodiff (and torch) would:
        # CE gives softmax - onehot(target), z-loss 2 z lse softmax; untargeted positions give nothing.
        probs = jnp.exp(logits - lse[..., None])
        onehot = jax.nn.one_hot(tc, logits.shape[-1], dtype=jnp.float32)
        g = (probs - onehot) * scale + probs * (2 * z_loss * scale * lse[..., None])
        g = jnp.where(targeted[..., None], g, 0).astype(xc.dtype)
        dx = olmo3.linear(g, w.T)
        dw = dw + jnp.matmul(xc.reshape(-1, d).T, g.reshape(-1, g.shape[-1]), preferred_element_type=jnp.float32)
        return dw, (sums, dx)

    dw = jnp.zeros(w.shape, jnp.float32)
    dw, ((ce, zz), dx) = jax.lax.scan(one, dw, (by_chunk(x), by_chunk(targets), position))
    if z_loss is None:
        return ce.sum(), zz.sum()
    return ce.sum(), zz.sum(), jnp.moveaxis(dx, 0, 1).reshape(x.shape), dw.astype(w.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def lm_head_loss(x, w, targets, chunk: int, z_loss: float, scale: float):
    """scale * (CE + z_loss * logsumexp^2), summed over the targeted positions, and (CE sum, logsumexp^2 sum).
    Only the first output carries a gradient; callers stop the gradient of the second (loss_fn does)."""
    ce, zz = lm_head_chunks(x, w, targets, chunk)
    return scale * (ce + z_loss * zz), (ce, zz)


def _lm_head_loss_fwd(x, w, targets, chunk, z_loss, scale):
    ce, zz, dx, dw = lm_head_chunks(x, w, targets, chunk, z_loss, scale)
    return (scale * (ce + z_loss * zz), (ce, zz)), (dx, dw)


def _lm_head_loss_bwd(chunk, z_loss, scale, grads, cotangents):
    dx, dw = grads
    g = cotangents[0]  # the loss is linear in the sums: its gradients are the forward's times g (1 for a loss)
    return (g * dx).astype(dx.dtype), (g * dw).astype(dw.dtype), None


lm_head_loss.defvjp(_lm_head_loss_fwd, _lm_head_loss_bwd)


def loss_fn(model, tokens, n_targets: int, cfg: TrainConfig, gather=None):
    x = model.features(tokens, gather)
    loss, stats = lm_head_loss(x, model.as_used(gather).lm_head, jnp.roll(tokens, -1, axis=-1), cfg.loss_chunk,
                               cfg.z_loss, 1 / n_targets)
    ce, zz = jax.lax.stop_gradient(stats)
    return loss, (ce / n_targets, cfg.z_loss * zz / n_targets)


# ---------------------------------------------------------------------------------------------------------
# The train step: gradient accumulation over microbatches, then the optimizer. Jitted once; the model and
# optimizer state are donated, so their buffers are updated in place.


@eqx.filter_jit(donate="all")
def train_step(model, opt: OptState, batch, lr, *, cfg: TrainConfig, n_micro: int, mesh=None):
    """On a mesh (shard.py), the model and optimizer state keep their shardings, and each weight is
    all-gathered where a layer uses it (shard.gather)."""
    rows, seq = batch.shape
    gather = None if mesh is None else lambda tree: shard.gather(tree, mesh)
    n_targets = rows * (seq - 1)
    params = eqx.filter(model, eqx.is_array)
    grad_fn = eqx.filter_value_and_grad(loss_fn, has_aux=True)

    def accumulate(acc, tokens):
        (_, (ce, z)), grads = grad_fn(model, tokens, n_targets, cfg, gather)
        return jax.tree.map(jnp.add, acc, (grads, ce, z)), None

    # Microbatch j takes every n_micro-th row, so each device keeps working on its own rows.
    micro = batch.reshape(rows // n_micro, n_micro, seq).swapaxes(0, 1)
    zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()))
    (grads, ce, z), _ = jax.lax.scan(accumulate, zero, micro)

    grad_norm = optax.tree.norm(grads)
    new_params, opt, skipped = optimizer_step(params, grads, opt, lr, ce, grad_norm, cfg)
    model = eqx.combine(new_params, model)
    if mesh is not None:
        model = eqx.filter_shard(model, shard.shardings(model, mesh))
        opt = eqx.filter_shard(opt, shard.shardings(opt, mesh))
    return model, opt, dict(loss=ce + z, ce_loss=ce, z_loss=z, grad_norm=grad_norm, skipped=skipped)


@eqx.filter_jit
def eval_step(model, batch, chunk: int, mesh=None):
    """Summed CE over the batch's targeted positions (no z-loss)."""
    gather = None if mesh is None else lambda tree: shard.gather(tree, mesh)
    x = model.features(batch, gather)
    return lm_head_chunks(x, model.as_used(gather).lm_head, jnp.roll(batch, -1, axis=-1), chunk)[0]


# ---------------------------------------------------------------------------------------------------------
# FLOPs and MFU. Convention: a matmul of (m, k) x (k, n) is 2mkn FLOPs; training is 3x the forward (the
# backward costs twice the forward); attention counts only the (query, key) pairs the causal mask keeps, so a
# query at position p sees p + 1 keys, or min(W, p + 1) on a sliding layer of window W.


def attention_pairs(seq: int, window: int | None) -> int:
    """(query, key) pairs a causal (optionally sliding) layer computes over one instance."""
    if window is None or window >= seq:
        return seq * (seq + 1) // 2
    return window * (window + 1) // 2 + (seq - window) * window


def flops_per_token(m: olmo3.Olmo3Config, seq: int) -> float:
    matmul_params = m.n_layers * (m.d_model * (2 * m.n_heads + 2 * m.n_kv_heads) * m.head_dim
                                  + 3 * m.d_model * m.mlp_hidden) + m.d_model * m.padded_vocab
    pairs = sum(attention_pairs(seq, m.window(t)) for t in m.layer_types)
    return 6 * matmul_params + 12 * m.n_heads * m.head_dim * pairs / seq


def olmo_core_flops_per_token(m: olmo3.Olmo3Config, seq: int, n_params: int) -> float:
    """OLMo-core's SpeedMonitor formula (6 x every non-embedding parameter, norms included, + attention)."""
    non_embedding = n_params - m.padded_vocab * m.d_model
    return 6 * non_embedding + sum(12 * m.n_heads * m.head_dim * attention_pairs(seq, m.window(t)) // seq
                                   for t in m.layer_types)


# Dense bf16 peak FLOP/s per chip (datasheets; TPU v7 is Ironwood).
PEAK_FLOPS = {"TPU v4": 275e12, "TPU v5 lite": 197e12, "TPU v5e": 197e12, "TPU v5p": 459e12, "TPU v5": 459e12,
              "TPU v6 lite": 918e12, "TPU v6e": 918e12, "TPU7x": 2307e12, "TPU v7": 2307e12,
              "A100": 312e12, "H100": 989e12, "H200": 989e12, "B200": 2250e12}


def peak_flops(device) -> float | None:
    """The chip's peak, or None where there is no meaningful MFU (CPU, unknown chips)."""
    kind = device.device_kind
    return next((v for k, v in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in kind), None)


# ---------------------------------------------------------------------------------------------------------
# Recipe decisions that depend on the hardware.


def attention_kernel(cfg: TrainConfig) -> str:
    """Which attention runs. All compute the same maths (olmo3.attention): the MXU-friendly fused kernels
    are cuDNN flash attention on GPU and Splash (Pallas) on TPU, both honouring the sliding window (a kernel
    that cannot refuses with an error, never drops the window). Elsewhere (CPUs, fp32 on a GPU) "local"
    computes the sliding layers in window-sized blocks and the full layers as the reference: on the tiny
    preset that is 7% faster than the reference everywhere (bench/RESULTS.md)."""
    if cfg.attention != "auto":
        return cfg.attention
    backend = jax.default_backend()
    if backend == "gpu" and cfg.compute_dtype == "bfloat16":
        return "cudnn"
    if backend == "tpu":
        return "splash"
    return "local"


def model_config(cfg: TrainConfig, base: olmo3.Olmo3Config | None = None) -> olmo3.Olmo3Config:
    """The preset's model (or `base`) with this run's head layout, compute dtype, kernel and remat."""
    m = base or olmo3.PRESETS[cfg.preset]
    if cfg.head_layout:
        # e.g. 16 x 256 instead of 32 x 128: the same width and parameter count, but one softmax over 256
        # dimensions and other RoPE frequencies, so a different model: for training from scratch only; the
        # released 32 x 128 weights do not load into it.
        heads, head_dim = map(int, cfg.head_layout.split("x"))
        if heads * head_dim != m.n_heads * m.head_dim or heads % (m.n_heads // m.n_kv_heads):
            raise ValueError(f"--head_layout {cfg.head_layout}: heads x head_dim must equal "
                             f"{m.n_heads * m.head_dim} and heads divide into the kv groups")
        m = dataclasses.replace(m, n_heads=heads, head_dim=head_dim,
                                n_kv_heads=heads // (m.n_heads // m.n_kv_heads))
    return dataclasses.replace(m, compute_dtype=cfg.compute_dtype, attention=attention_kernel(cfg),
                               remat=cfg.remat, scan_unroll=cfg.scan_unroll, max_seq_len=max(m.max_seq_len, cfg.seq_len))


# ---------------------------------------------------------------------------------------------------------
# The run


def main(cfg: TrainConfig) -> int:
    # XLA reads its flags when the first backend starts, so they are set before anything touches a device.
    # By default GPU kernels (autotuned GEMMs, cuDNN attention's backward) may sum in a varying order, and
    # two runs of the same step drift apart; CPU steps are bitwise repeatable as they are (bench/RESULTS.md).
    if cfg.deterministic and "xla_gpu_deterministic_ops" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true".strip()
    shard.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    lead = jax.process_index() == 0  # only process 0 prints, logs and plots; all take part in checkpoints
    say = print if lead else (lambda *a, **k: None)

    # Preemption, handled from the start: restoring and compiling take minutes at scale. One process:
    # SIGTERM/SIGINT ask for a save at the next step boundary; a second signal exits at once (Orbax commits
    # by rename, so the last committed checkpoint is never harmed). Several processes: JAX's preemption
    # service tells all of them the same step (a Python handler here would silently disable it).
    stop = {"signals": 0}
    if jax.process_count() == 1:
        def on_signal(signum, frame):
            stop["signals"] += 1
            if stop["signals"] > 1:
                os._exit(128 + signum)
            say(f"\nsignal {signum}: saving at the next step boundary, then exiting")
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    mesh = shard.make_mesh(cfg.mesh)
    mcfg = model_config(cfg)
    if lead:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    say(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    say(f"model: {cfg.preset}{' ' + cfg.head_layout if cfg.head_layout else ''}, attention kernel "
        f"{mcfg.attention!r} on {jax.default_backend()}, compute {mcfg.compute_dtype}, remat {mcfg.remat}; "
        f"mesh {dict(mesh.shape)} over {jax.device_count()} devices in {jax.process_count()} processes")

    n_micro = microbatches(cfg, mesh)

    # Parameters and optimizer state are born sharded: a jitted init whose outputs land on their devices.
    abstract = eqx.filter_eval_shape(olmo3.Olmo3, mcfg, key=jax.random.key(0))
    shard.check_rules(abstract, mesh)
    model_sh = shard.shardings(abstract, mesh)
    opt_sh = shard.shardings(eqx.filter_eval_shape(init_opt, abstract, cfg), mesh)
    init = eqx.filter_jit(lambda key: eqx.filter_shard(olmo3.Olmo3(mcfg, key=key), model_sh))
    make_opt = eqx.filter_jit(lambda m: eqx.filter_shard(init_opt(m, cfg), opt_sh))
    step_fn = lambda m, o, b, lr: train_step(m, o, b, lr, cfg=cfg, n_micro=n_micro, mesh=mesh)
    n_params = olmo3.count_params(abstract)
    flops = flops_per_token(mcfg, cfg.seq_len)
    peak = peak_flops(jax.devices()[0])
    say(f"parameters: {n_params:,}; training FLOPs per token: {flops / 1e9:.2f} G (exact causal/sliding count), "
        f"OLMo-core's formula {olmo_core_flops_per_token(mcfg, cfg.seq_len, n_params) / 1e9:.2f} G; "
        + (f"peak {peak / 1e12:.0f} TFLOP/s per chip" if peak else f"no MFU on {jax.devices()[0].device_kind}"))

    if cfg.dry_run:
        return dry_run(cfg, mesh, abstract, model_sh, opt_sh, flops)

    # Data: batch i is a pure function of (seed, i); step s trains on batch s - 1.
    train_files, eval_files, tokenizer_path = resolve_data(cfg)
    dtype = data.dtype_for_vocab(mcfg.vocab_size)
    loader = data.TokenLoader(train_files, cfg.seq_len, cfg.global_batch, seed=cfg.seed, dtype=dtype,
                              vocab_size=mcfg.vocab_size, work_dir=run_dir / "data")
    if cfg.steps > loader.num_batches:
        raise ValueError(f"--steps {cfg.steps} needs {cfg.steps} batches but the data holds {loader.num_batches} "
                         f"of {cfg.global_batch} x {cfg.seq_len} tokens (one epoch)")
    rank, world = jax.process_index(), jax.process_count()
    row_ids = loader.row_ids(rank, world)

    # Start: the newest valid checkpoint in the run directory, else released weights, else a fresh init.
    checkpoints = ckpt.Checkpoints(run_dir, cfg.keep_last, cfg.keep_every)
    expected_meta = dict(config=dataclasses.asdict(cfg), model=ckpt.config_to_hf(mcfg), data=loader.fingerprint)
    abstract_opt = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                eqx.filter_eval_shape(init_opt, abstract, cfg), opt_sh)
    key_like = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=shard.replicated(mesh))
    train_like = {"opt": abstract_opt, "key": key_like}
    restored = checkpoints.restore_latest(with_shardings(abstract, model_sh), train_like,
                                          check=lambda meta: check_resume(meta, expected_meta, cfg))
    if restored:
        start, model, train_state, _ = restored
        opt = train_state["opt"] if train_state else make_opt(model)
        key = jax.random.wrap_key_data(train_state["key"]) if train_state else jax.random.key(cfg.init_seed)
        say(f"resuming from {checkpoints.dir / str(start)} (step {start})")
    else:
        start, key = 0, jax.random.key(cfg.init_seed)
        if cfg.init_from_hf:
            check_hf_model(cfg.init_from_hf, mcfg, cfg.preset)
            model = ckpt.load_hf(cfg.init_from_hf, shardings=model_sh, compute_dtype=mcfg.compute_dtype,
                                 attention=mcfg.attention, remat=mcfg.remat, scan_unroll=mcfg.scan_unroll)
            say(f"starting from the weights in {cfg.init_from_hf}")
        else:
            model = init(jax.random.key(cfg.init_seed))
        opt = make_opt(model)

    eval_loader = None
    if eval_files:
        eval_loader = data.TokenLoader(eval_files, cfg.seq_len, cfg.global_batch, seed=cfg.seed, dtype=dtype,
                                       vocab_size=mcfg.vocab_size, work_dir=run_dir / "data")

    def evaluate(step):
        n = min(cfg.eval_batches, eval_loader.num_batches)
        put = lambda i: shard.put_batch(eval_loader.local_batch(i, rank, world), mesh, cfg.global_batch)
        total = sum(eval_step(model, put(i), cfg.loss_chunk, mesh) for i in range(n))
        loss = float(total) / (n * cfg.global_batch * (cfg.seq_len - 1))
        log.write(dict(step=step, eval_loss=loss, eval_ppl=math.exp(min(loss, 50))))
        say(f"step {step}: held-out loss {loss:.4f}, perplexity {math.exp(min(loss, 50)):.2f}")
        return loss

    log = MetricsLog(run_dir, lead, cfg.tensorboard)
    if cfg.eval_only:
        if eval_loader is None:
            raise ValueError("--eval_only needs held-out data: set --eval_data")
        evaluate(start)
        checkpoints.close()
        return 0
    if start >= cfg.steps:
        say(f"run already complete: step {start} of {cfg.steps}; nothing to train")
        checkpoints.close()
        return 0

    def put(rows):  # runs on the prefetch thread: hash the rows, move them to the devices
        return shard.put_batch(rows, mesh, cfg.global_batch), data.batch_hash(rows, row_ids)

    prefetch = data.Prefetcher(lambda i: loader.local_batch(i, rank, world), start, cfg.steps, put)
    batches = iter(prefetch)
    tokens_per_step = cfg.global_batch * cfg.seq_len
    progress = tqdm_bar(lead, start, cfg.steps)
    # tokens/s over the last 20 steps, measured where each step's numbers arrive. Evals and saves pause
    # training, so the window restarts after them; until it has two points, the previous rate stands.
    pending, stamps, rate = None, collections.deque(maxlen=21), None
    loop_start = time.perf_counter()
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # the int batch

    def record(step, metrics, wait, batch_hash):
        nonlocal rate
        metrics = jax.device_get(metrics)
        stamps.append(time.perf_counter())
        if not all(math.isfinite(float(metrics[k])) for k in ("loss", "grad_norm")):
            raise FloatingPointError(f"step {step}: loss {float(metrics['loss'])}, grad norm "
                                     f"{float(metrics['grad_norm'])}; stopping. The last good checkpoint is "
                                     f"{checkpoints.dir / str(max(checkpoints.steps(), default=0))}")
        if len(stamps) > 1:
            rate = tokens_per_step * (len(stamps) - 1) / (stamps[-1] - stamps[0])
        tps = rate or tokens_per_step / (stamps[-1] - loop_start)  # the first step: compilation included
        if world > 1:  # the processes' hashes add up; sent as two uint32 words (jax has no uint64 by default)
            words = jax.experimental.multihost_utils.process_allgather(
                np.array([batch_hash % 2**32, batch_hash >> 32], np.uint32))
            batch_hash = sum(int(lo) + (int(hi) << 32) for lo, hi in np.asarray(words).reshape(-1, 2)) % 2**64
        row = dict(step=step, loss=float(metrics["loss"]), ce_loss=float(metrics["ce_loss"]),
                   z_loss=float(metrics["z_loss"]), lr=lr_at(step, cfg), grad_norm=float(metrics["grad_norm"]),
                   skipped=bool(metrics["skipped"]), tokens=step * tokens_per_step, tokens_per_s=tps,
                   mfu=tps * flops / (peak * jax.device_count()) if peak else None, data_wait_s=wait,
                   batch_hash=data.format_hash(batch_hash))
        log.write(row)
        progress.update(1)
        progress.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{tps:,.0f}")

    def save(step):
        meta = dict(expected_meta, rng_seed=cfg.init_seed)
        # One global array: Orbax cannot save an array that lives on one process only.
        key_data = jax.device_put(np.asarray(jax.random.key_data(key)), shard.replicated(mesh))
        checkpoints.save(step, model, {"opt": opt, "key": key_data}, meta)

    try:
        for step in range(start + 1, cfg.steps + 1):
            i, (batch, batch_hash), wait = next(batches)
            model, opt, metrics = step_fn(model, opt, batch, jnp.float32(lr_at(step, cfg)))
            if pending:  # read the previous step's numbers while this one runs
                record(*pending)
            checkpoints.check()  # a failed background save stops the run now, not at the next save
            pending = (step, metrics, wait, batch_hash)
            preempted = stop["signals"] > 0 or (world > 1 and checkpoints.manager.reached_preemption(step))
            if step % cfg.ckpt_every == 0 or step == cfg.steps or preempted:
                record(*pending)  # never checkpoint a state whose loss was not checked
                pending = None
                save(step)
                stamps.clear()
            if preempted:
                checkpoints.close()
                say(f"saved step {step}; exiting for the preemption")
                return 0
            if eval_loader is not None and (step % cfg.eval_every == 0 or step == cfg.steps):
                evaluate(step)
                stamps.clear()
    except BaseException:
        checkpoints.close()  # let an in-flight save of a good step commit; its own error would chain to this one
        raise
    finally:
        prefetch.close()
        progress.close()
    checkpoints.close()
    log.close()
    if lead:
        plot_losses(run_dir)
    if cfg.samples:  # the model spans every process, so all of them sample; process 0 prints
        print_samples(model, cfg, tokenizer_path, say)
    return 0


def microbatches(cfg: TrainConfig, mesh) -> int:
    """Gradient-accumulation steps: the batch's rows split over (data, fsdp), each device's share into
    microbatches of --microbatch rows."""
    n_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    per_device = cfg.global_batch // n_shards
    microbatch = cfg.microbatch or per_device
    if cfg.global_batch % n_shards or microbatch == 0 or per_device % microbatch:
        raise ValueError(f"--global_batch {cfg.global_batch} must split evenly over the {n_shards} data/fsdp devices "
                         f"of --mesh {cfg.mesh}, and each device's {per_device} rows into --microbatch {microbatch}")
    return per_device // microbatch


def with_shardings(tree, shardings):
    """Abstract arrays that carry the shardings a restore should place them with."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if shard.is_array(x) else x,
                        tree, shardings, is_leaf=lambda x: x is None)


def check_resume(meta: dict, expected: dict, cfg: TrainConfig) -> None:
    """Refuse a checkpoint written for another model, data order or recipe, naming what changed."""
    if meta.get("model") != expected["model"]:
        saved, now = meta.get("model", {}), expected["model"]
        diff = {k: (saved.get(k), now.get(k)) for k in set(saved) | set(now) if saved.get(k) != now.get(k)}
        raise ValueError(f"checkpoint holds another model shape ({diff}, as (saved, now)); use another --run_dir")
    if "config" not in meta:  # written by `ckpt.py from-hf`: weights only, any recipe may start from them
        return
    changes = [f"{k}: {meta['config'].get(k)!r} -> {expected['config'][k]!r}" for k in RECIPE_FIELDS
               if meta["config"].get(k) != expected["config"][k]]
    try:
        data.check_fingerprint(meta["data"], expected["data"])
    except ValueError as e:
        changes.append(str(e))
    if changes and not cfg.allow_config_change:
        raise ValueError(f"--run_dir {cfg.run_dir} was trained with another recipe: " + "; ".join(changes)
                         + ". Pass --allow_config_change to resume anyway (e.g. to extend --steps), or use a new --run_dir")


def check_hf_model(hf_dir: str, mcfg: olmo3.Olmo3Config, preset: str) -> None:
    """Released weights must be the preset's model (token ids and max length may differ), before loading."""
    hf = ckpt.config_from_hf(json.loads((Path(hf_dir) / "config.json").read_text()), f"{hf_dir}/config.json")
    fields = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
              "layer_types", "sliding_window", "rope_sliding", "rope_full", "norm_eps")
    if diff := {f: (getattr(hf, f), getattr(mcfg, f)) for f in fields if getattr(hf, f) != getattr(mcfg, f)}:
        raise ValueError(f"--init_from_hf {hf_dir} holds another model than --preset {preset}: "
                         + "; ".join(f"{f} {a} (checkpoint) vs {b} (preset)" for f, (a, b) in diff.items()))


def resolve_data(cfg: TrainConfig):
    """(train files, held-out files, tokenizer path) from --data / --data_root / --eval_data."""
    if cfg.data == "tiny":
        prepared = data.prepare_tiny(cfg.data_root or "data/tiny")
        return prepared["train"], prepared["val"], prepared["tokenizer"]
    if not cfg.data:
        raise ValueError("--data is empty: give token files (comma-separated, globs allowed), a mix .txt file, or 'tiny'")
    def files(spec):
        if spec.endswith(".txt"):
            return data.read_mix(spec, cfg.data_root)
        found = []
        for part in filter(None, spec.split(",")):
            path = os.path.join(cfg.data_root, part) if cfg.data_root else part
            matches = sorted(glob.glob(path)) if any(c in path for c in "*?[") else [path]
            if not matches:
                raise FileNotFoundError(f"--data {spec!r}: {path!r} matches no file")
            found += matches
        return found
    return files(cfg.data), files(cfg.eval_data) if cfg.eval_data else [], None


class MetricsLog:
    """RUN_DIR/metrics.jsonl (one JSON object per train step; eval rows carry eval_loss), optionally
    TensorBoard. Only process 0 writes."""

    def __init__(self, run_dir: Path, lead: bool, tensorboard: bool):
        self.file = open(run_dir / "metrics.jsonl", "a") if lead else None
        self.tb = None
        if lead and tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))

    def write(self, row: dict) -> None:
        if self.file is None:
            return
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb:
            self.tb.close()


def tqdm_bar(lead: bool, start: int, steps: int):
    from tqdm import tqdm

    return tqdm(total=steps, initial=start, disable=not lead, unit="step", dynamic_ncols=True)


def dry_run(cfg, mesh, abstract, model_sh, opt_sh, flops) -> int:
    """Compile one train step for the mesh from abstract inputs (nothing is allocated, so a 7B model on a
    pod's worth of devices compiles on a laptop's fake ones) and report what each device holds."""
    params, static = eqx.partition(with_shardings(abstract, model_sh), shard.is_array)
    opt = with_shardings(eqx.filter_eval_shape(init_opt, abstract, cfg), opt_sh)
    batch = jax.ShapeDtypeStruct((cfg.global_batch, cfg.seq_len), jnp.int32, sharding=shard.batch_sharding(mesh))
    n_micro = microbatches(cfg, mesh)

    # eqx.filter_jit would take the abstract arrays for static values: lower through jax.jit, donating the
    # parameters and optimizer state as train_step does.
    def step(params, opt, batch, lr):
        model = eqx.combine(params, static)
        model, opt, metrics = train_step(model, opt, batch, lr, cfg=cfg, n_micro=n_micro, mesh=mesh)
        return eqx.filter(model, eqx.is_array), opt, metrics

    t0 = time.perf_counter()
    lr = jax.ShapeDtypeStruct((), jnp.float32)
    mem = jax.jit(step, donate_argnums=(0, 1)).lower(params, opt, batch, lr).compile().memory_analysis()
    seconds = time.perf_counter() - t0

    def per_device(tree):
        return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree))

    rows = cfg.global_batch // n_micro // (mesh.shape["data"] * mesh.shape["fsdp"])
    print(f"dry run: {cfg.preset} on mesh {dict(mesh.shape)} ({mesh.size} devices), {n_micro} microbatch(es) "
          f"of {rows} rows x {cfg.seq_len} per device, compiled in {seconds:.0f} s. Per device:")
    total = mem.argument_size_in_bytes + mem.temp_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    for name, size in [("parameters (fp32)", per_device(params)), ("optimizer state (fp32)", per_device(opt)),
                       ("batch", per_device(batch)), ("activations + temporaries", mem.temp_size_in_bytes),
                       ("total", total)]:
        print(f"  {name:<26} {size / 2**30:9.3f} GiB")
    if limit := (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit"):
        print(f"  {'this device has':<26} {limit / 2**30:9.3f} GiB")
    if model_config(cfg).attention == "reference":
        print("  (the reference attention materialises seq x seq scores; the splash and cuDNN kernels of "
              "TPUs and GPUs need far less)")
    # The model's count: XLA's cost analysis counts the body of the layer scan once.
    step_flops = flops * cfg.global_batch * cfg.seq_len
    print(f"FLOPs per step: {step_flops:.3e}, {step_flops / mesh.size:.3e} per device")
    return 0


def plot_losses(run_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    held = [(r["step"], r["eval_loss"]) for r in rows if "eval_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train), label="train loss", lw=0.8)
    if held:
        ax.plot(*zip(*held), "o-", label="held-out loss")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"{run_dir.name}")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=120)
    plt.close(fig)


def print_samples(model, cfg: TrainConfig, tokenizer_path, say=print) -> None:
    tok = data.get_tokenizer(cfg.tokenizer, tokenizer_path)
    length = min(model.cfg.max_seq_len, cfg.seq_len)
    say("samples:")
    for i in range(cfg.samples):
        prompt = jnp.asarray([tok.eos_id], jnp.int32)  # a fresh document starts after an EOS
        out = olmo3.sample(model, prompt, length - 1, key=jax.random.key(i), temperature=0.8, top_k=50)
        text = tok.decode([int(t) for t in out[1:] if int(t) < tok.vocab_size]).split(tok.decode([tok.eos_id]))[0]
        say(f"--- sample {i + 1} ---\n{text.strip()[:600]}")


if __name__ == "__main__":
    sys.exit(main(parse_args(sys.argv[1:])))
