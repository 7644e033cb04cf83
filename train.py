"""Stages 1, 2 and 3 of the OLMo 3 pretraining recipe, in one file. The recipe comes first: config and presets,
the LR schedule, the optimizer, the loss, the train step, the loop and main; below a heading that says nothing
there changes what a step computes, the rest: setup and restore, batches and logging, the hardware fit, the
dry run, the evaluation loops and the command line. Every TrainConfig field is a flag; rerun the same command
with the same --run_dir and it resumes from the newest valid checkpoint, bit for bit. The recipe is OLMo-core's
official OLMo 3 scripts' (src/scripts/official/OLMo3/): the fields marked `recipe(...)` are theirs.

    python train.py --preset tiny                      # Shakespeare on a laptop CPU, about 5 minutes
    python train.py --help                             # every flag, its default and what it does
"""

import collections
import dataclasses
import difflib
import functools
import importlib.util
import inspect
import json
import math
import operator
import re
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int, Shaped

import ckpt
import data
import olmo3
import shard

# ---------------------------------------------------------------------------------------------------------
# Config


class FlagError(ValueError):
    """Bad usage: train.py prints it as one line and exits with code 2."""


def flag(default, in_recipe=False, low=None, above=None, high=None, choices=None):
    """A TrainConfig field and the values it accepts: at least `low`, more than `above`, at most `high`, one
    of `choices`. A recipe field (in_recipe) changes the numbers a run computes, so a resume must match it (or be given
    --allow_config_change); the others (mesh, microbatch, intervals) may change freely."""
    bounds = [(op, b) for op, b in ((">=", low), (">", above), ("<=", high)) if b is not None]
    return dataclasses.field(default=default, metadata=dict(recipe=in_recipe, bounds=bounds, choices=choices))


def recipe(default, **accepts):
    return flag(default, in_recipe=True, **accepts)


# --tasks' default: the 7B script's 26 downstream tasks (data.OLMO3_TASKS); here, as the class body's field
# `data` hides the module.
DEFAULT_TASKS = ",".join(data.OLMO3_TASKS)


@dataclass(frozen=True)
class TrainConfig:
    """The run: every field is a flag, and its comment (with the comment lines right below it) its --help."""

    preset: str = recipe("7b")  # the recipe below, and its model shape (olmo3.MODELS) unless --model
    model: str = ""  # the model (olmo3.MODELS) if not the preset's own; a stage-2 preset names stage 1's
    head_layout: str = recipe("")  # e.g. 16x256: heads x head_dim of the same width; a new model
    yarn: float = recipe(0.0, low=0)  # YaRN on the full-attention layers only, by this factor (stage 3: 8,
    # from the model's 8,192 tokens; beta_fast 32, beta_slow 1); the sliding layers keep plain RoPE. 0: none

    # data (data_dtype first: below, the field `data` hides the module in this class body)
    data_dtype: str = flag("", choices=("", *data.DATA_DTYPES))  # token files' dtype; default: from the vocab
    data: str = ""  # token files (comma-separated, globs allowed), an OLMo-core mix .txt, or "tiny"
    data_root: str = ""  # folder of relative --data/--eval_data/mix paths; with --data tiny, made if missing
    eval_data: str = ""  # held-out sets: LABEL=FILES,LABEL=FILES (a part without LABEL= adds files to the set
    # before it; globs allowed), an OLMo-core mix .txt of `label,path` lines (v3-small-ppl-validation.txt), or
    # unlabelled files (the set "held-out"); with --data tiny, default: its held-out plays ("tiny-val").
    # Each set scored as OLMo-core's LMEvaluator (one instance per document): eval/lm/LABEL/CE loss and PPL
    tokenizer: str = flag("dolma2", choices=("dolma2", "tiny"))  # for samples, id checks and the HF export
    seq_len: int = recipe(8192, low=2)
    global_batch: int = recipe(512, low=1)  # instances per optimizer step: 512 x 8192 = 4,194,304 tokens
    seed: int = recipe(34521)  # data order: OLMo-core's PCG64(seed + epoch) permutation
    init_seed: int = recipe(0)  # model init (torch's init cannot be reproduced bit for bit: --init_from)
    pack_files: int = recipe(0, low=0)  # 0: instances cut from each file's tokens (stages 1 and 2); N:
    # documents (to each EOS, a longer one cut) packed best-fit into instances within groups of N files, the
    # padding out of the loss, attention kept within each document (stage 3: OLMo-core's
    # NumpyPackedFSLDataset with generate_doc_lengths, groups of 8)
    file_seed: int = recipe(-1, low=-1)  # with --pack_files: the files first shuffled by Python's
    # random.Random(file_seed) (OLMo-core's source_permutation_seed: 123 in stage 3); -1: in their order
    positions: str = recipe("row", choices=("row", "document"))  # RoPE positions of packed rows: 0 ...
    # seq - 1 across the row (the code AI2's long-context models trained with), or from 0 at each document
    # (OLMo-core since May 2026, its PR #663)

    # optimizer: OLMo-core's SkipStepAdamW
    lr: float = recipe(3e-4, above=0)  # peak learning rate
    warmup_steps: int = recipe(2000, low=0)  # linear from 0
    schedule: str = recipe("cosine", choices=("cosine", "linear"))  # after warmup: OLMo-core's CosWithWarmup
    # (stage 1) or LinearWithWarmup (stages 2 and 3), from lr to lr * lr_final at lr_horizon
    lr_horizon: int = recipe(1_192_093, low=0)  # schedule length in steps: ceil(5e12 tokens / 4,194,304); 0:
    # one epoch of --data (OLMo-core's Duration.epochs(1): the instances over the batch), reported at the start
    lr_final: float = recipe(0.1, low=0, high=1)  # the schedule ends at lr * lr_final (OLMo-core's alpha_f)
    steps: int = recipe(597_046, low=0)  # part 1 of stage 1 stops here (mid-cosine), as the official run did;
    # 0: one epoch of --data
    beta1: float = recipe(0.9, low=0, high=1)
    beta2: float = recipe(0.95, low=0, high=1)
    eps: float = recipe(1e-8, above=0)
    weight_decay: float = recipe(0.1, low=0)  # decoupled, scaled by the current lr; embeddings exempt
    clip: float = recipe(1.0, above=0)  # global grad-norm clipping
    skip_sigma: float = recipe(6.0, above=0)  # skip the update if loss or grad norm is this many std above
    skip_window: int = recipe(128, low=2)  # ... the mean of this many previous steps, once half are known
    z_loss: float = recipe(1e-5, low=0)
    repeat_filter: int = recipe(0, low=0)  # drop instances repeating 1-13 tokens this often in a row; 0: off
    dp_ranks: int = recipe(1, low=1)  # weigh the loss as OLMo-core does on this many data-parallel ranks,
    # whatever our mesh: rank r's rows (r, r + dp_ranks, ...) over its own count, the ranks averaged
    loss: str = flag("fused", choices=("fused", "reference"))  # the fused LM head + loss, or plain autodiff

    # compute: the compute policy (olmo3.Compute), its fields flags of their own (--dtype, --attention, ...)
    compute: olmo3.Compute = olmo3.Compute(dtype="bfloat16", attention="auto", remat="auto")
    reduce_dtype: str = recipe("float32", choices=("float32", "bfloat16"))  # gradients summed over devices in
    # it: OLMo-core's reduce_dtype (its scripts' float32); bfloat16: in the compute dtype, as before the flag
    microbatch: int = flag(0, low=0)  # instances per device per forward/backward; 0 = the device's share
    loss_chunk: int = flag(0, low=0)  # positions per chunk of the fused loss; 0 = the whole sequence
    deterministic: bool = True  # GPUs: bitwise-repeatable steps, which exact resumption needs (cost: bench/)
    mesh: str = "fsdp=-1"  # e.g. data=2,fsdp=4,context=1,tensor=1; one axis may be -1 ("the rest"); context
    # splits each row's positions (stage 3's long rows), balanced for causal work

    # run
    run_dir: str = "runs/7b"  # a folder, or gs://BUCKET/PATH: everything the run writes, checkpoints included
    storage_patience: float = flag(600.0, above=0)  # seconds a storage request retries 429s, 5xx, resets
    compile_cache: str = shard.COMPILE_CACHE  # compiled programs kept for restarts (JAX's persistent
    # compilation cache), a folder or gs://BUCKET/PATH (on a pod: one all hosts read); '' = off
    ckpt_every: int = flag(1000, low=1)
    keep_last: int = flag(2, low=2)  # recent checkpoints kept (at least 2: the newest may be mid-write)
    keep_every: int = flag(0, low=0)  # also keep every step divisible by this, forever; 0 = none
    eval_every: int = flag(1000, low=1)
    eval_batches: int = flag(0, low=0)  # instances scored per held-out set: the first this many batches'
    # worth (x --global_batch); 0 = the whole set, as OLMo-core
    tasks: str = DEFAULT_TASKS  # downstream tasks (olmo_eval's names, comma-separated; '' = none),
    # scored at each evaluation as OLMo-core's DownstreamEvaluator: eval/downstream/TASK (METRIC). Needs the
    # eval extra. Default: the 26 of the official 7B script
    init_from: str = ""  # where a run with no checkpoint yet starts: one of our run directories (its newest
    # valid checkpoint, or RUN_DIR@STEP), an OLMo-core step directory (both with Adam's moments and count) or a
    # Hugging Face directory (weights only); '' = random init. Read once: a rerun resumes from --run_dir
    init_weights_only: bool = False  # with --init_from: its weights alone, Adam from zero (AI2's stage 3 of
    # the 32B starts so from the midtraining soup)
    eval_only: bool = False  # evaluate the latest checkpoint (or --init_from) and exit
    dry_run: bool = False  # compile one step for the mesh, print memory per device and FLOPs, exit
    topology: str = ""  # with --dry_run: compile for a TPU slice (v5p-512, v6e:16x16) or GPU host (h200x8)
    num_slices: int = flag(1, low=1)  # with --topology: that many slices (or GPU hosts), joined by DCN
    allow_config_change: bool = False  # resume although the recipe changed (e.g. more steps, a new schedule)
    start_over: bool = False  # train from step 0 if every checkpoint is corrupt (else the run stops)
    tensorboard: bool = False  # also write TensorBoard event files (needs the tensorboard extra)
    wandb: str = ""  # W&B project: log every metrics row there under OLMo-core's names (the wandb extra;
    # entity and credentials from wandb's environment: WANDB_ENTITY, WANDB_API_KEY, WANDB_MODE=offline)
    wandb_run: str = ""  # with --wandb: the W&B run's name (default: W&B's); a resume continues the same run
    samples: int = flag(0, low=0)  # lines of text to sample at the end
    profile: str = ""  # START:STEPS: trace those steps into RUN_DIR/profile (XProf, Perfetto); '' = none
    coordinator: str = ""  # multi-host outside TPU VMs / known clusters: host:port of process 0
    num_processes: int = flag(0, low=0)
    process_id: int = flag(-1, low=-1)
    heartbeat_timeout: int = flag(100, low=1)  # seconds a process may go silent before the others stop
    step_timeout: int = flag(ckpt.STEP_TIMEOUT_S, low=0)  # seconds with no step done: hung, exit 124; 0: off

    @property
    def model_preset(self) -> str:
        """The olmo3.MODELS name of the model this recipe trains."""
        return self.model or self.preset


# The official stage-1 recipe is the default above; the smaller presets scale it down. Each stage's preset is
# its OLMo-core script's recipe, one line of provenance here; the README's tables give their numbers.
PRESETS = {
    "tiny": TrainConfig(
        preset="tiny",
        data="tiny",
        tokenizer="tiny",
        seq_len=256,
        global_batch=8,
        lr=2e-3,
        warmup_steps=20,
        lr_horizon=240,
        steps=240,
        compute=olmo3.Compute(dtype="float32", attention="auto"),
        mesh="data=1",
        run_dir="runs/tiny",
        ckpt_every=120,
        eval_every=60,
        eval_batches=8,
        tasks="",  # the quick start needs no eval extra; --tasks adds some (README)
        samples=3,
    ),
    "190m": TrainConfig(
        "190m", lr=4e-4, lr_horizon=40_000, steps=40_000, global_batch=256, seq_len=4096, run_dir="runs/190m"
    ),
    "1b": TrainConfig("1b", lr=4e-4, lr_horizon=100_000, steps=100_000, seq_len=4096, run_dir="runs/1b"),
    "7b": TrainConfig(),
    # OLMo-core's OLMo-3-1025-32B-pretrain.py: one epoch of the 0925 mix, InstanceFilterConfig(13, 1, 32).
    "32b": TrainConfig(
        "32b",
        data="OLMo-mix-0925-official.txt",
        lr=6e-4,
        global_batch=1024,
        lr_horizon=0,
        steps=0,
        repeat_filter=32,
        dp_ranks=1024,  # AI2's 32B ran one instance per rank
        run_dir="runs/32b",
    ),
    # Stage 2: OLMo-core's OLMo-3-1025-7B-midtrain.py, 100B tokens (ceil(1e11 / 2**21) steps), from stage 1.
    "7b-midtrain": TrainConfig(
        "7b-midtrain",
        model="7b",
        data="OLMo-midtraining-mix-0625-100B.txt",
        global_batch=256,
        seed=1337,
        lr=2.0712352850360292e-4,
        schedule="linear",
        warmup_steps=0,
        lr_final=0.0,
        lr_horizon=47_684,
        steps=47_684,
        run_dir="runs/7b-midtrain",
    ),
    # OLMo-core's OLMo-3-1025-32B-midtrain-ingredient-1.py (-2.py below), averaged by AI2; no rank count given.
    "32b-midtrain-1": TrainConfig(
        "32b-midtrain-1",
        model="32b",
        data="OLMo-midtraining-mix-0925-ingredient1-100B.txt",
        global_batch=512,
        seed=42069,
        lr=0.0002071235285,
        schedule="linear",
        warmup_steps=0,
        lr_final=0.0,
        lr_horizon=23_842,
        steps=23_842,
        repeat_filter=32,
        run_dir="runs/32b-midtrain-1",
    ),
}

PRESETS["32b-midtrain-2"] = dataclasses.replace(
    PRESETS["32b-midtrain-1"],
    preset="32b-midtrain-2",
    data="OLMo-midtraining-mix-0925-ingredient2-100B.txt",
    run_dir="runs/32b-midtrain-2",
)

# Stage 3: OLMo-core's OLMo-3-1025-7B-long-context.py, AI2's 50B tokens (not the script's 5T), in FP8.
PRESETS["7b-long-context"] = dataclasses.replace(
    PRESETS["7b-midtrain"],
    preset="7b-long-context",
    compute=dataclasses.replace(PRESETS["7b-midtrain"].compute, fp8="tensorwise"),
    yarn=8.0,
    data="OLMo-longmino-mix-0625.txt",
    seq_len=65_536,
    global_batch=64,
    seed=34521,
    pack_files=8,
    file_seed=123,
    warmup_steps=200,
    lr_horizon=11_921,
    steps=11_921,
    run_dir="runs/7b-long-context",
)

# OLMo-core's OLMo-3-1025-32B-long-context.py: 1e11 tokens of the 0925 longmino mix, filtered, in bf16.
PRESETS["32b-long-context"] = dataclasses.replace(
    PRESETS["7b-long-context"],
    preset="32b-long-context",
    model="32b",
    compute=dataclasses.replace(PRESETS["7b-long-context"].compute, fp8=""),
    data="OLMo-longmino-mix-0925.txt",
    global_batch=128,
    lr=0.0002071235285,
    repeat_filter=32,
    run_dir="runs/32b-long-context",
)

RECIPE_FIELDS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("recipe"))


# ---------------------------------------------------------------------------------------------------------
# The learning-rate schedule: linear warmup from 0, then cosine (OLMo-core's CosWithWarmup) or linear
# (LinearWithWarmup) to lr * lr_final at lr_horizon, and there it stays.


def lr_at(step: int, cfg: TrainConfig) -> float:
    """LR of optimizer step `step`, counted from 1 as OLMo-core counts (the first step is step 1); a new stage
    counts from 1 again. So a linear decay to 0 over all the steps spends its last step at LR 0, as OLMo-core's."""
    if step < cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    low = cfg.lr * cfg.lr_final
    if step >= cfg.lr_horizon:
        return low
    progress = (step - cfg.warmup_steps) / (cfg.lr_horizon - cfg.warmup_steps)
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - low) * progress
    return low + (cfg.lr - low) * (1 + math.cos(math.pi * progress)) / 2


def with_one_epoch(cfg: TrainConfig, epoch: int) -> TrainConfig:
    """--lr_horizon 0 and --steps 0 as one epoch of the data, `epoch` batches, as OLMo-core's trainer turns
    Duration.epochs(1) into its max_steps; the run records the number, so a resume on other data is refused."""
    return dataclasses.replace(cfg, lr_horizon=cfg.lr_horizon or epoch, steps=cfg.steps or epoch)


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
    zeros = lambda: jax.tree.map(jnp.zeros_like, eqx.filter(params, olmo3.is_array))
    window = lambda: jnp.zeros(cfg.skip_window, jnp.float32)
    return OptState(
        jnp.zeros((), jnp.float32), zeros(), zeros(), window(), window(), jnp.zeros((), jnp.int32)
    )


def adam_of(opt: OptState) -> tuple:
    """What a next stage carries over of the optimizer: Adam's (first moments, second moments, step count)."""
    return opt.mu, opt.nu, opt.count


def carried_over(opt: OptState, adam, mesh) -> OptState:
    """A fresh optimizer state with Adam's moments and count (adam_of, or read from an OLMo-core checkpoint)
    carried over from the previous stage; the skip-step history starts empty, as OLMo-core's does after a
    load (it does not save it)."""
    if adam is None:
        return opt
    mu, nu, count = adam
    count = jax.device_put(jnp.asarray(count, jnp.float32), shard.replicated(mesh))
    moments = (with_statics(mu, opt.mu), with_statics(nu, opt.nu))
    return eqx.tree_at(lambda o: (o.count, o.mu, o.nu), opt, (count, *moments))


def skip_window_of(saved_opt: dict) -> int:
    """The skip-step window of an optimizer state as a checkpoint holds it (the nested dict Orbax stores)."""
    return saved_opt["losses"].shape[0]


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
    window = dict(
        losses=opt.losses.at[slot].set(ce_loss),
        grad_norms=opt.grad_norms.at[slot].set(grad_norm),
        seen=opt.seen + 1,
    )

    # Clip by global norm as torch's clip_grads_with_norm_ does.
    grads = jax.tree.map(lambda g: g * jnp.minimum(cfg.clip / (grad_norm + 1e-6), 1.0), grads)
    count = opt.count + 1
    step_size = lr / (1 - cfg.beta1**count)
    bias2 = jnp.sqrt(1 - cfg.beta2**count)
    mu = jax.tree.map(lambda m, g: cfg.beta1 * m + (1 - cfg.beta1) * g, opt.mu, grads)
    nu = jax.tree.map(lambda v, g: cfg.beta2 * v + (1 - cfg.beta2) * g * g, opt.nu, grads)
    decay = eqx.tree_at(lambda p: p.embed_tokens, jax.tree.map(lambda _: cfg.weight_decay, params), 0.0)
    adamw = lambda p, m, v, wd: p * (1 - lr * wd) - step_size * m / (jnp.sqrt(v) / bias2 + cfg.eps)
    new = jax.tree.map(adamw, params, mu, nu, decay)

    # A skipped step keeps the old values exactly (a select, not a multiply by 0, so a NaN cannot leak in).
    keep = lambda old, upd: jax.tree.map(lambda o, u: jnp.where(skip, o, u), old, upd)
    opt = OptState(keep(opt.count, count), keep(opt.mu, mu), keep(opt.nu, nu), **window)
    return keep(params, new), opt, skip


# ---------------------------------------------------------------------------------------------------------
# The loss: cross-entropy in fp32 over the padded vocab, the last position of each instance untargeted, plus
# z-loss = z_loss * mean(logsumexp^2), both averaged over the targeted positions as OLMo-core averages them
# (row_weights). The logits are in the compute dtype, upcast by the loss, as OLMo-core's under its policy.
# `loss_sums` defines it, in one place; two paths compute it with the LM head, the same maths:
# - reference: logits for the whole batch, differentiated by autodiff.
# - fused (the default): olmo3.fused_lm_head, a chunk of positions at a time, each chunk's logits reduced by
#   `loss_sums` and differentiated by autodiff of `loss_sums` alone, in one pass: the fp32 logits (3.3 GB per
#   instance on the 7B) exist one chunk at a time. A change to `loss_sums` changes both; test them equal.


def cross_entropy(logits: Float[Array, "*n vocab"], targets: Int[Array, "*n"]):
    """Per-position CE and logsumexp, in fp32."""
    logits = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0], lse


def loss_sums(logits: Float[Array, "*n vocab"], targets: Int[Array, "*n"], weight: Shaped[Array, "*#n"]):
    """The loss, in one place: CE and logsumexp^2 summed over the positions, each times its weight (0 or
    False: not targeted; True: 1)."""
    ce, lse = cross_entropy(logits, targets)
    counted = lambda v: jnp.where(weight != 0, v * weight, 0).sum()
    return counted(ce), counted(lse * lse)


def instances_kept(rows: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """Which instances of a batch the loss counts: all, or with --repeat_filter those OLMo-core's instance
    filter keeps (data.repeated: no token sequence of period 1-13 repeated that often in a row)."""
    return ~data.repeated(rows, cfg.repeat_filter) if cfg.repeat_filter else np.ones(len(rows), bool)


def targeted(keep: Bool[Array, " batch"], label_mask: Bool[Array, "batch seq"]) -> Bool[Array, "batch seq"]:
    """The positions the loss counts, as OLMo-core's get_labels: those whose next token is in the label mask
    (all but each instance's last, and in packed rows not the padding), in the instances the repeat filter
    keeps."""
    return keep[:, None] & jnp.pad(label_mask[:, 1:], ((0, 0), (0, 1)))


def row_weights(
    keep: Bool[Array, " batch"], labels: Int[Array, " batch"], seq: int, ranks: int
) -> Float[Array, " batch"]:
    """Each row's weight in the loss, as OLMo-core's train module weighs it on `ranks` data-parallel ranks:
    rank r holds rows r, r + ranks, ... (its loader's stride) and divides their loss by its own count, each
    row's `labels` (its targeted positions) plus every token of a dropped instance (counted as zero-loss
    tokens, so each rank weighs the same); the ranks' gradients are averaged. With one rank: one count."""
    by_rank = jnp.where(keep, labels, seq).reshape(-1, ranks)  # [i, r]: row i * ranks + r
    count = by_rank.sum(axis=0)  # ranks
    return jnp.tile(1 / (ranks * count.astype(jnp.float32)), by_rank.shape[0])


def loss_fn(
    model, tokens, keep, row_weight, cfg, layout=None, label_mask=None, documents=None, grad_sum=None
):
    """The loss over the batch's targeted positions, each row's weighted by `row_weight` (row_weights); aux:
    its CE and z-loss parts. Packed rows: `documents` numbers each position's document (attention stays
    within it), and RoPE's positions run across the row or restart at each document (--positions).
    `grad_sum`: the layer stack's gradients so far, added to by the backward pass (olmo3.Olmo3.layer_stack)."""
    positions = None if documents is None or cfg.positions == "row" else olmo3.document_positions(documents)
    x = model.features(tokens, layout, documents, positions, grad_sum)
    w, targets = model.as_used(layout).lm_head, jnp.roll(tokens, -1, axis=-1)
    label_mask = jnp.ones(tokens.shape, bool) if label_mask is None else label_mask
    weight = jnp.where(targeted(keep, label_mask), row_weight[:, None], 0)  # batch seq
    copies = layout.copies(model.compute.dtype) if layout is not None else None  # olmo3.per_device
    with jax.named_scope("loss"):
        if cfg.loss == "reference":
            ce, zz = loss_sums(olmo3.per_device(olmo3.linear, copies)(x, w, 1, x.dtype), targets, weight)
            loss = ce + cfg.z_loss * zz
        else:
            weights = (jnp.float32(1), jnp.float32(cfg.z_loss))  # of the two sums, in the loss
            fused = lambda w, x, t, m: olmo3.fused_lm_head(x, w, loss_sums, t, m, weights, cfg.loss_chunk)
            loss, (ce, zz) = olmo3.per_device_sums(fused, copies)(w, x, targets, weight)
            ce, zz = jax.lax.stop_gradient((ce, zz))
    return loss, (ce, cfg.z_loss * zz)


# ---------------------------------------------------------------------------------------------------------
# The train step: gradient accumulation over microbatches, then the optimizer. Jitted once; the model and
# optimizer state are donated, so their buffers are updated in place. The backward pass adds the layer stack's
# gradients into their fp32 sum as it makes them (olmo3.Olmo3.layer_stack): the 7B on one H200, 117.1 GiB.


@eqx.filter_jit(donate="all")
def train_step(model, opt, batch, lr, *, cfg, n_micro, mesh=None, keep=None, label_mask=None, documents=None):
    """One optimizer step on `batch` (rows x seq tokens); `keep` says which rows the repeat filter keeps
    (None: all). Packed rows (--pack_files) come with their label mask (False: padding) and each position's
    document number. On a mesh (shard.py), the model and optimizer state keep their shardings, and each
    weight is all-gathered where a layer uses it (shard.Layout)."""
    rows, seq = batch.shape
    layout = None if mesh is None else shard.Layout(mesh, cfg.reduce_dtype)
    params = eqx.filter(model, olmo3.is_array)
    others = eqx.tree_at(lambda p: p.layers, params, None)  # the weights outside the layer stack
    keep = jnp.ones(rows, bool) if keep is None else keep
    label_mask = jnp.ones((rows, seq), bool) if label_mask is None else label_mask
    row_weight = row_weights(keep, label_mask[:, 1:].sum(-1), seq, cfg.dp_ranks)

    # Differentiated: the other weights, and the layer stack's sum (back with this microbatch's gradients in).
    def micro_loss(differentiated, tokens, keep, row_weight, label_mask, documents):
        others, layers_sum = differentiated
        args = (tokens, keep, row_weight, cfg, layout, label_mask, documents, layers_sum)
        return loss_fn(eqx.combine(others, model), *args)

    def accumulate(acc, micro):
        (others_sum, layers_sum), ce, z = acc
        grad_fn = eqx.filter_value_and_grad(micro_loss, has_aux=True)
        (_, (ce_m, z_m)), (grads, layers_sum) = grad_fn((others, layers_sum), *micro)
        return ((jax.tree.map(jnp.add, others_sum, grads), layers_sum), ce + ce_m, z + z_m), None

    # Microbatch j takes every n_micro-th row, so each device keeps working on its own rows.
    split = lambda a: a.reshape(rows // n_micro, n_micro, *a.shape[1:]).swapaxes(0, 1)
    zero = (jax.tree.map(jnp.zeros_like, (others, params.layers)), jnp.zeros(()), jnp.zeros(()))
    micro = jax.tree.map(split, (batch, keep, row_weight, label_mask, documents))  # documents may be None
    ((others_sum, layers_sum), ce, z), _ = jax.lax.scan(accumulate, zero, micro)
    grads = eqx.tree_at(lambda g: g.layers, others_sum, layers_sum, is_leaf=lambda x: x is None)

    with jax.named_scope("optimizer"):
        grad_norm = optax.tree.norm(grads)
        new_params, opt, skipped = optimizer_step(params, grads, opt, lr, ce, grad_norm, cfg)
    model = eqx.combine(new_params, model)
    if mesh is not None:
        model = eqx.filter_shard(model, shard.shardings(model, mesh))
        opt = eqx.filter_shard(opt, shard.shardings(opt, mesh))
    return model, opt, dict(loss=ce + z, ce_loss=ce, z_loss=z, grad_norm=grad_norm, skipped=skipped)


# ---------------------------------------------------------------------------------------------------------
# Recipe decisions that depend on the hardware: the attention kernel, the model and its context.


def attention_kernel(cfg: TrainConfig, platform: str) -> str:
    """Which attention runs on `platform` (the mesh's devices: "tpu", "gpu", "cpu"). All compute the maths
    of olmo3.attention's reference. The MXU-friendly fused kernels: cuDNN flash attention on GPUs and Splash
    (Pallas) on TPUs, both honouring the sliding window (a kernel that cannot refuses, never drops it).
    Elsewhere (CPUs, fp32 on a GPU) "local" computes the sliding layers in window-sized blocks and the full
    layers as the reference: 7% faster than the reference on the tiny preset (bench/RESULTS.md)."""
    if cfg.compute.attention != "auto":
        return cfg.compute.attention
    if platform == "gpu" and cfg.compute.dtype == "bfloat16":
        return "cudnn"
    if platform == "tpu":
        return "splash"
    return "local"


def model_config(cfg: TrainConfig, base: olmo3.Olmo3Config | None = None) -> olmo3.Olmo3Config:
    """The preset's model (or `base`) in this run's head layout, RoPE and sequence length."""
    m = base or olmo3.MODELS[cfg.model_preset]
    if cfg.head_layout:
        m = m.with_heads(*map(int, cfg.head_layout.split("x")))
    return extended_context(cfg, m)


def extended_context(cfg: TrainConfig, m: olmo3.Olmo3Config) -> olmo3.Olmo3Config:
    """Model `m` (a preset's, or a checkpoint's) as this run uses it: with YaRN on its full layers (--yarn,
    once: a model that has it keeps it) and a max_seq_len of at least --seq_len. The weights stay as they are."""
    if cfg.yarn and m.rope_full.yarn is None:  # extending the context the model has (its max_seq_len)
        yarn = olmo3.Yarn(factor=cfg.yarn, original_max_position=m.max_seq_len)
        m = dataclasses.replace(m, rope_full=dataclasses.replace(m.rope_full, yarn=yarn))
    return dataclasses.replace(m, max_seq_len=max(m.max_seq_len, cfg.seq_len))


# ---------------------------------------------------------------------------------------------------------
# The loop and main(). The loop calls four seams, which tests replace to act at a given step (tests/faults.py):
# take_step, here, and save, evaluate and log_step, which change no step, below.


def take_step(run: "Run", step: int, model, opt, batch: "Batch"):
    """Dispatch optimizer step `step` (1, 2, ...) on `batch` (read_batches); returns at once."""
    lr = jnp.float32(lr_at(step, run.cfg))
    run.profile.dispatching(step)  # --profile
    step_fn = run.compiled_step or train_step  # set_up's compile: filter_jit's call waits for the step's end
    return step_fn(
        model, opt, batch.tokens, lr, cfg=run.cfg, n_micro=run.n_micro, mesh=run.mesh, **batch.extras
    )


def train_loop(run: "Run", preemption: ckpt.Preemption, start: int, model, opt, key):
    """Steps start + 1 ... --steps, saving and evaluating on the way: (the model, whether a preemption
    stopped it early). Step k + 1 is dispatched before step k's numbers are read, so the host never keeps
    the devices waiting."""
    cfg, step = run.cfg, start  # step: the one under way
    prefetch = read_batches(run, start)
    batches = (dataclasses.replace(batch, wait=wait) for _, batch, wait in prefetch)
    meter, pending, stop = step_meter(run, start), None, False  # the progress bar, tokens/s, the watchdog
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")  # the int batch
    try:
        for step in range(start + 1, cfg.steps + 1):
            batch = next(batches)
            model, opt, metrics = take_step(run, step, model, opt, batch)
            if pending:  # read the previous step's numbers while this one runs
                log_step(run, *pending, meter)
            run.checkpoints.check()  # a failed background save stops the run here
            pending = (step, metrics, batch)
            stop = preemption.requested()
            do_eval = evaluates_at(run, step)
            do_save = step % cfg.ckpt_every == 0 or step == cfg.steps or stop
            # Never evaluate or checkpoint a state whose loss was not checked; and the first step compiles,
            # so its numbers are read at once: its time is its own, not the next step's too.
            if do_eval or do_save or step == start + 1:
                log_step(run, *pending, meter)
                pending = None
                meter.pause()  # saving and evaluating are not training: no step's tokens/s counts them
                try:  # evaluated first: a run killed mid-save retakes the step, its evaluation too
                    if do_eval:
                        evaluate(run, step, model)
                except BaseException:  # the step is good, its evaluation is not: keep the step, then stop
                    save(run, step, model, opt, key)
                    raise
                if do_save:
                    save(run, step, model, opt, key)
                meter.resume()
            if stop:
                say(f"saved step {step}; exiting for the preemption")
                break
    except BaseException as e:  # a preemption midway (in a wait, an evaluation) keeps the newest step
        if not (stop := kept_for_preemption(run, e, step, pending, meter, (model, opt, key))):
            raise  # an error: close_failing ran
    finally:
        prefetch.close()
        meter.close()
    return model, stop


def main(cfg: TrainConfig) -> int:
    data.set_patience(cfg.storage_patience)  # every request to storage from here on, check_flags' too
    check_flags(cfg)
    mesh, target = start_devices(cfg)
    model_cfg, compute = model_config(cfg), compute_policy(cfg, mesh)
    announce(cfg, mesh, model_cfg, compute)
    if cfg.dry_run:
        return dry_run(cfg, mesh, model_cfg, compute, target)
    check_start(cfg, model_cfg)  # here, not in check_flags: reading a source starts JAX's backend
    plan = plan_run(cfg, mesh, model_cfg, compute)  # the data: refusals before anything is written
    cfg, stopped = plan.cfg, None  # --steps and --lr_horizon 0 now the epoch's length
    with ckpt.Preemption() as preemption, ckpt.none_left_if_stopped(cfg.run_dir), ckpt.RunLock(cfg.run_dir):
        run, (start, model, opt, key) = set_up(plan, target)  # restored (or the stage's start), fitted
        if cfg.eval_only:
            evaluate(run, start, model)
        elif start >= cfg.steps:
            say(f"run already complete: step {start}")
        else:
            ckpt.write_run_files(cfg.run_dir, dataclasses.asdict(cfg), cfg.tokenizer, run.tokenizer_path)
            run.log.open()
            model, stopped = train_loop(run, preemption, start, model, opt, key)
        run.checkpoints.close()
        run.log.close()
    if stopped is False:  # trained to the end
        plot_and_sample(run, model)
    return 0


# =========================================================================================================
# Nothing below changes what a train step computes: the loop's other seams, the run's setup and restore,
# batches and logging, the hardware fit, the dry run, the evaluation loops and the command line.
# =========================================================================================================


# ---------------------------------------------------------------------------------------------------------
# The loop's other seams (tests/faults.py replaces them): save, evaluate and log_step.


def save(run: "Run", step: int, model, opt, key) -> None:
    """Start writing checkpoint `step` in the background; a failure surfaces at the next step boundary."""
    # One global array: Orbax cannot save an array that lives on one process only.
    key_data = jax.device_put(np.asarray(jax.random.key_data(key)), shard.replicated(run.mesh))
    run.checkpoints.save(step, model, {"opt": opt, "key": key_data}, run.meta)
    run.goodput.store()  # the start's account as of each checkpoint


def evaluate(run: "Run", step: int, model) -> dict:
    """The held-out sets (lm_row) and the downstream tasks (downstream_row), logged as step `step`'s eval
    row and printed as tables."""
    with run.goodput.timed("evaluation"):
        row = dict(step=step)
        row |= lm_row(run, model) if run.eval_sets else {}
        row |= downstream_row(run, model) if run.tasks else {}
        print_eval_tables(run, step, row)  # first: a row that cannot be recorded is still seen
        record_eval_row(run, row)
    return row


def evaluates_at(run: "Run", step: int) -> bool:
    """Whether the run evaluates step `step`: every --eval_every steps and the last, where it has held-out sets
    or tasks."""
    return bool(run.eval_sets or run.tasks) and (step % run.cfg.eval_every == 0 or step == run.cfg.steps)


def log_step(run: "Run", step: int, metrics: dict, batch: "Batch", meter: ckpt.Progress):
    """Read step `step`'s numbers (the device has finished it), stop on a NaN, write its metrics row."""
    metrics = {k: v.item() for k, v in jax.device_get(metrics).items()}
    stop_on_nan(run, step, metrics)
    run.goodput.stepped(step, meter.clock(), batch.wait)
    run.log.write(metrics_row(run, step, metrics, batch, meter))
    run.profile.finished(step)


def step_meter(run: "Run", start: int) -> ckpt.Progress:
    """The loop's progress bar and tokens/s, and with --step_timeout its watchdog on the same clock: each
    step's numbers beat it; saves and evaluations stop it, and it starts at the first step's numbers (the
    first step compiles)."""
    cfg = run.cfg
    watchdog = ckpt.StepWatchdog(cfg.step_timeout, cfg.run_dir) if cfg.step_timeout else None
    return ckpt.Progress(start, cfg.steps, cfg.global_batch * cfg.seq_len, watchdog)


def close_failing(run: "Run", meter: ckpt.Progress) -> None:
    """The loop stopped on an error: the watchdog stops first (waiting for a save is no step, and the error is
    the run's story, not a hang), then an in-flight save of a good step still commits."""
    meter.close()
    run.checkpoints.close(failing=True)


def kept_for_preemption(
    run: "Run", e: BaseException, step: int, pending, meter: ckpt.Progress, state
) -> bool:
    """The loop stopped midway through step `step` on `e`. A preemption (ckpt.Preempted) keeps the newest step
    done, then returns True (the loop's exit 0): in an evaluation, the step itself, which the loop has saved
    (its evaluation runs first at the next start: set_up); in a wait for data, the step before, its numbers
    read first (no state whose loss was not checked is kept); before the first step, none (the step restored is
    the newest). Anything else is an error: close_failing, and False."""
    if not isinstance(e, ckpt.Preempted):
        close_failing(run, meter)
        return False
    if pending:
        log_step(run, *pending, meter)
    meter.close()  # waiting for a save is no step: the watchdog stops
    done = step if step == run.checkpoints.saving or step in run.checkpoints.steps() else step - 1
    if done > 0:  # (0: a stage's start or an init, which no preemption saves)
        save(run, done, *state)  # nothing where it is saved already: the step restored, or one just saved
    cut = ", its evaluation cut short (it runs first at the next start)" if done == step else ""
    say(f"saved step {done}{cut}; exiting for the preemption" if done else "exiting for the preemption")
    return True


# ---------------------------------------------------------------------------------------------------------
# The run's setup and restore: start the devices, set up (data, run directory), then restore the newest
# checkpoint, or start the stage from --init_from, or initialise.


def say(*args) -> None:
    """Print on process 0 only (every process runs this file)."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def start_devices(cfg: TrainConfig):
    """The mesh (and, with --topology, the slice compiled for), after making GPU kernels sum in a fixed
    order, which exact resumption needs, unless --deterministic=false, and pointing JAX's compilation cache at
    --compile_cache (not for a dry run, which leaves JAX's cache as JAX's variables set it)."""
    if cfg.deterministic:
        shard.deterministic_gpu_ops()
    if not cfg.dry_run:
        shard.use_compilation_cache(cfg.compile_cache)
    hosts = (cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.heartbeat_timeout)
    try:
        return shard.start(cfg.mesh, cfg.topology, cfg.num_slices, *hosts)
    except (ValueError, RuntimeError) as e:  # RuntimeError: a run's devices failed, or --topology's extra
        if isinstance(e, RuntimeError) and not cfg.topology:
            raise
        raise FlagError(str(e)) from None


def announce(cfg: TrainConfig, mesh, model_cfg: olmo3.Olmo3Config, compute: olmo3.Compute) -> None:
    """Say the config, the model and how it computes on the devices found; first refuse a model those
    devices cannot train (check_devices_suffice)."""
    device, peak = mesh.devices.flat[0], shard.peak_flops(mesh.devices.flat[0])
    n_params = olmo3.count_params(olmo3.abstract(model_cfg))
    check_devices_suffice(cfg, mesh, n_params)
    say(f"config: {json.dumps(dataclasses.asdict(cfg))}")
    say(
        f"model: {cfg.model_preset}{' ' + cfg.head_layout if cfg.head_layout else ''}, {n_params:,} parameters, "
        f"{model_cfg.flops_per_token(cfg.seq_len) / 1e9:.2f} GFLOPs per token to train (exact causal/sliding count)"
    )
    # MFU's peak is the dense bf16 one with --fp8 too, as OLMo-core's speed monitor's (it has no other): the
    # same model at the same speed reads the same MFU in either, and fp8 only speeds up the block linears.
    fp8 = f", fp8 {compute.fp8} (the block linears)" if compute.fp8 else ""
    mfu = f"no MFU on {device.device_kind}"
    if peak:
        mfu = f"peak {peak / 1e12:.0f} TFLOP/s per device, dense bf16"
        mfu += " (MFU's, fp8 or not)" if fp8 else ""
    remat = compute.remat + (" (the lightest that fits, chosen below)" if compute.remat == "auto" else "")
    say(
        f"compute: attention kernel {compute.attention!r} on {device.platform}, {compute.dtype}{fp8}, remat "
        f"{remat}; mesh {dict(mesh.shape)} over {mesh.size} devices in {jax.process_count()} processes; "
        + mfu
    )
    yarn = model_cfg.rope_full.yarn
    if yarn and cfg.seq_len > (extended := int(yarn.original_max_position * yarn.factor)):
        say(
            f"note: --seq_len {cfg.seq_len} is beyond the {extended:,} tokens YaRN x{yarn.factor:g} extends "
            f"{yarn.original_max_position:,} to; positions past it are untrained ground"
        )


# The most parameters a run trains on CPU devices: the 1b preset's 1.5B (24 GB of fp32 weights, Adam's two
# moments and the gradient sum, 16 bytes a parameter) still fits a workstation. The 7B's state alone is 117 GB
# and one step of its recipe 1.95e17 FLOPs, two days at a CPU's teraFLOP/s: a 7B or 32B that finds CPUs found
# them where TPUs or GPUs were meant to be (libtpu or the CUDA plugin did not load), and is better told so
# at once than left to build the model.
CPU_MAX_PARAMS = 2_000_000_000


def check_devices_suffice(cfg: TrainConfig, mesh, n_params: int) -> None:
    """Refuse, before anything is allocated, a model of more than CPU_MAX_PARAMS on CPU devices (a dry run
    allocates nothing and compiles for any devices)."""
    if cfg.dry_run or mesh.devices.flat[0].platform != "cpu" or n_params <= CPU_MAX_PARAMS:
        return
    named = f"--model {cfg.model}" if cfg.model else f"--preset {cfg.preset}"
    raise FlagError(
        f"{named}: {n_params:,} parameters, too many for the devices found: {mesh.size} CPU devices in "
        f"{jax.process_count()} process(es) (at most {CPU_MAX_PARAMS:,} on CPUs; where TPUs or GPUs were "
        "meant, libtpu or the CUDA plugin did not load: pip install -e '.[tpu]' or '.[gpu]'); to see what it "
        "needs on the chips it is meant for, from any machine: --dry_run --topology v5p-512"
    )


@dataclass(frozen=True)
class Plan:
    """A run as planned before anything is written: the config (one epoch's --steps filled in), the devices, the
    model and its compute policy, the data and what is evaluated, what every checkpoint records. Plain fields,
    no behaviour (the loop above is the trainer)."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    model_cfg: olmo3.Olmo3Config
    compute: olmo3.Compute
    loader: data.TokenLoader | data.PackedLoader | None  # None: --eval_only without --data
    eval_sets: list[data.PaddedEvalSet]  # these two empty: nothing to evaluate
    tasks: list[data.DownstreamTask]
    tokenizer_path: str | None
    meta: dict  # what every checkpoint records: the config, the model, the data's fingerprint
    n_micro: int  # microbatches a step: as --microbatch asks, until set_up finds the rows that fit


@dataclass(frozen=True)
class Run(Plan):
    """A run under way, built whole by set_up (open_run): its plan, the run directory opened (its checkpoints
    and metrics log), the profiler, this start's goodput account, the train step as set_up compiled it.
    The loop's seams take it."""

    checkpoints: ckpt.Checkpoints
    log: ckpt.MetricsLog
    profile: ckpt.Profile
    goodput: ckpt.Goodput  # where this start's seconds go (RUN_DIR/goodput.jsonl)
    compiled_step: Callable | None = None  # the train step as set_up compiled it (compiled_step), or none


@dataclass(frozen=True)
class Batch:
    """One step's batch as read_batches hands it to the loop: its rows on the devices, what else train_step
    takes of them (the rows the instance filter keeps; packed rows' label mask and documents), its hash
    (metrics.jsonl's batch_hash), the instances filtered out, and the seconds the step waited for it."""

    tokens: jax.Array
    extras: dict
    hash: int
    filtered: int
    wait: float = 0.0


def plan_run(cfg: TrainConfig, mesh, model_cfg: olmo3.Olmo3Config, compute: olmo3.Compute) -> Plan:
    """The data, refusing --steps beyond it (or, with --eval_only, a run with nothing to evaluate); nothing is
    written yet, so a refused run leaves no run directory.
    Batch i of the loader is a pure function of (seed, i); step s trains on batch s - 1. With --eval_only and
    no --data (released weights scored), there is no loader."""
    if cfg.eval_only and not cfg.data:
        held_out = data.eval_sets(cfg.eval_data, cfg.data_root) if cfg.eval_data else {}
        tiny = cfg.tokenizer == "tiny"  # its tokenizer.json in --data_root, as --data tiny reads it
        files, tokenizer_path = None, data.tiny_tokenizer_file(cfg.data_root or None) if tiny else None
    else:
        files, held_out, tokenizer_path = data.resolve(cfg.data, cfg.data_root, cfg.eval_data)
    vocab = model_cfg.vocab_size  # the permutation's cache is built at the first batch, under the lock
    dtype = cfg.data_dtype or data.dtype_for_vocab(vocab)
    kw = dict(seed=cfg.seed, dtype=dtype, vocab_size=vocab, work_dir=f"{cfg.run_dir}/data")
    # Process 0 of the hosts writes the order's cache; a first start's scan of stage 3 is divided among them.
    kw["share"] = (jax.process_index(), jax.process_count())
    loader = None if files is None else make_loader(cfg, model_cfg, files, kw)
    if loader is not None:
        cfg = one_epoch_where_asked(cfg, loader.num_batches)
        compute = documents_bound(cfg, compute, loader)
    eval_sets = padded_eval_sets(held_out, model_cfg, cfg.seq_len, dtype)
    if cfg.eval_only:
        check_eval_only(cfg, eval_sets)
    elif cfg.steps > loader.num_batches:
        raise FlagError(
            f"--steps {cfg.steps}: the data holds {loader.num_batches} batches of "
            f"{cfg.global_batch} x {cfg.seq_len} tokens (one epoch); expected at most that"
        )
    fingerprint = loader.fingerprint if loader else None
    meta = dict(config=dataclasses.asdict(cfg), model=ckpt.config_to_hf(model_cfg), data=fingerprint)
    tasks = downstream_tasks(cfg, model_cfg, tokenizer_path)
    n_micro = microbatches(cfg, mesh)  # a batch that does not split over the devices: refused here
    return Plan(cfg, mesh, model_cfg, compute, loader, eval_sets, tasks, tokenizer_path, meta, n_micro)


def one_epoch_where_asked(cfg: TrainConfig, epoch: int) -> TrainConfig:
    """--lr_horizon 0 and --steps 0 as one epoch of the data (with_one_epoch), said in a line."""
    if cfg.lr_horizon and cfg.steps:
        return cfg
    zeros = " and ".join(f"--{k} 0" for k in ("lr_horizon", "steps") if not getattr(cfg, k))
    say(f"one epoch of --data: {epoch:,} steps of {cfg.global_batch} x {cfg.seq_len} tokens ({zeros})")
    return with_one_epoch(cfg, epoch)


def set_up(plan: Plan, target) -> tuple[Run, tuple]:
    """The run under way, once it holds its lock: the run directory opened, the newest valid checkpoint
    restored (or the stage's start, or a fresh init) as (step, model, optimizer state, key), the rows past it
    dropped from metrics.jsonl (steps to retake; --eval_only only adds a row), and where the model runs, the
    microbatch whose rows fit and the remat policy (fitted), the model computing with it; where it trains, its
    step compiled (compiled_step). An evaluation of the step restored that a preemption cut short runs here,
    first (evaluation_owed)."""
    cfg, mesh = plan.cfg, plan.mesh
    run = open_run(plan)
    state = restore_or_init(run)
    if not cfg.eval_only:  # the restore is done: what follows until the first record is compiling
        run.goodput.restored(state[0], run.log.rewind(state[0]))
    trains = not cfg.eval_only and state[0] < cfg.steps
    owed = not cfg.eval_only and evaluation_owed(run, state[0])
    if cfg.eval_only or trains or owed:  # the model runs: a microbatch's rows at a time that fit
        n_micro, remat = fitted(run, target)
        compute = dataclasses.replace(plan.compute, remat=remat)
        run = dataclasses.replace(run, n_micro=n_micro, compute=compute)
        state = (state[0], state[1].using(run.compute), *state[2:])
    if cfg.deterministic and trains:  # GPUs: tuned deterministic GEMMs
        tune = lambda options: compile_step(cfg, mesh, plan.model_cfg, run.compute, run.n_micro, options)
        ckpt.autotuned_gemms(cfg.run_dir, mesh.devices.flat[0], tune, say)
    if trains:
        run = dataclasses.replace(run, compiled_step=compiled_step(run, *state[1:3]))
        run.goodput.store()  # the start's first record: its start, restore and compiles
    if owed:  # on the model restored, which is that step's: the row an uninterrupted run has
        evaluate(run, state[0], state[1])
    return run, state


def evaluation_owed(run: Run, step: int) -> bool:
    """Whether step `step`, restored, is one the run evaluates whose evaluation row metrics.jsonl lacks: a
    preemption stopped that evaluation midway and the loop saved the step (or the evaluation failed after the
    step was kept). Process 0 reads the file, and every process takes its answer: all evaluate, or none."""
    owed = step > 0 and evaluates_at(run, step) and not run.log.evaluated(step)
    if jax.process_count() == 1:
        return owed
    from jax.experimental import multihost_utils

    return bool(multihost_utils.broadcast_one_to_all(np.int32(owed)))


def make_loader(cfg: TrainConfig, model_cfg: olmo3.Olmo3Config, files: list[str], kw: dict):
    """Fixed-length instances of the files (stages 1 and 2), or their documents packed (--pack_files, stage 3;
    padded with the model's pad id, or EOS where it has none: padding is never a label)."""
    if not cfg.pack_files:
        return data.TokenLoader(files, cfg.seq_len, cfg.global_batch, **kw)
    eos = model_cfg.eos_token_id
    pad = eos if model_cfg.pad_token_id is None else model_cfg.pad_token_id
    file_seed = None if cfg.file_seed < 0 else cfg.file_seed
    say(f"packing the documents of {len(files)} files into instances of {cfg.seq_len} tokens ...")
    packing = dict(eos_id=eos, pad_id=pad, group_size=cfg.pack_files, file_seed=file_seed)
    return data.PackedLoader(files, cfg.seq_len, cfg.global_batch, **packing, **kw)


def downstream_tasks(
    cfg: TrainConfig, model_cfg: olmo3.Olmo3Config, tokenizer_path
) -> list[data.DownstreamTask]:
    """--tasks' requests for the run's tokenizer and context, as OLMo-core's DownstreamEvaluator builds them
    (olmo_eval's build_task; seconds a task, once per run)."""
    names = [name for name in cfg.tasks.split(",") if name]
    if not names:
        return []
    pad = model_cfg.eos_token_id if model_cfg.pad_token_id is None else model_cfg.pad_token_id
    tokenizer = data.olmo_eval_tokenizer(cfg.tokenizer, tokenizer_path, pad, model_cfg.eos_token_id)
    return data.downstream_tasks(names, tokenizer, cfg.seq_len, say)


def padded_eval_sets(
    held_out: dict, model_cfg: olmo3.Olmo3Config, seq_len: int, dtype
) -> list[data.PaddedEvalSet]:
    """Each labelled held-out set's instances (data.PaddedEvalSet), documents split at the model's EOS and
    padded with its pad id (or EOS: padding is never scored); held-out files are small, so every id is
    checked here, before step 1."""
    eos = model_cfg.eos_token_id
    pad = eos if model_cfg.pad_token_id is None else model_cfg.pad_token_id
    for files in held_out.values():
        data.check_tokens(files, model_cfg.vocab_size, dtype)
    return [data.PaddedEvalSet(label, files, seq_len, eos, pad, dtype) for label, files in held_out.items()]


def check_eval_only(cfg: TrainConfig, eval_sets: list[data.PaddedEvalSet]) -> None:
    """--eval_only needs held-out data, and weights: a checkpoint in --run_dir, or --init_from (random
    weights would print a loss that means nothing, for a run directory mistyped)."""
    if not eval_sets and not cfg.tasks:
        raise FlagError("--eval_only needs held-out data or tasks: set --eval_data or --tasks")
    has_checkpoint = ckpt.has_checkpoints(cfg.run_dir)
    if not cfg.init_from and not has_checkpoint:
        raise FlagError(
            f"--eval_only: --run_dir {cfg.run_dir} holds no checkpoint to evaluate; expected the directory of "
            "a run that saved one (or --init_from)"
        )
    if has_checkpoint and not cfg.data:  # a checkpoint is checked against the data it was trained on
        raise FlagError(
            f"--eval_only: --run_dir {cfg.run_dir} holds checkpoints; give the --data they trained on"
        )


def open_run(plan: Plan) -> Run:
    """The run directory's checkpoints and metrics log opened (once the run holds its lock: this makes the
    directory, if it is new), and the run they make of `plan`. Its goodput account starts here: process 0 of a
    run that may train keeps it."""
    cfg, lead = plan.cfg, jax.process_index() == 0
    checkpoints = ckpt.Checkpoints(cfg.run_dir, cfg.keep_last, cfg.keep_every)
    goodput = ckpt.Goodput(cfg.run_dir, lead and not cfg.eval_only, checkpoints)
    wandb = None
    if cfg.wandb:  # OLMo-core's throughput is per device, its masked instances per batch
        wandb = ckpt.WandbRun(
            cfg.wandb, cfg.wandb_run or None, dataclasses.asdict(cfg), plan.mesh.size, cfg.global_batch
        )
    log = ckpt.MetricsLog(cfg.run_dir, lead, cfg.tensorboard, wandb, goodput)
    # Each checkpoint's rows are stored before it (on gs:// they are held a while): none is lost to a kill.
    checkpoints.before_save = log.flush
    planned = {f.name: getattr(plan, f.name) for f in dataclasses.fields(Plan)}
    return Run(
        **planned,
        checkpoints=checkpoints,
        log=log,
        profile=ckpt.Profile(cfg.profile, cfg.run_dir),
        goodput=goodput,
    )


def abstract_state(cfg: TrainConfig, mesh, model_cfg: olmo3.Olmo3Config, compute: olmo3.Compute):
    """The model and optimizer state as abstract arrays with their shardings, nothing allocated: what a
    restore reads into and a dry run compiles for."""
    model = olmo3.abstract(model_cfg, compute)
    sharded = lambda tree: shard.abstract(tree, shard.shardings(tree, mesh))
    return sharded(model), sharded(eqx.filter_eval_shape(init_opt, model, cfg))


def restore_or_init(run: Run):
    """(step, model, optimizer state, key): the newest valid checkpoint of the run directory, else the stage's
    start (--init_from), else a fresh init. Parameters and optimizer state are born sharded."""
    cfg, mesh = run.cfg, run.mesh
    model_like, opt_like = abstract_state(cfg, mesh, run.model_cfg, run.compute)
    model_sh, opt_sh = shard.shardings(model_like, mesh), shard.shardings(opt_like, mesh)
    shard.check_rules(model_like, mesh)
    make_opt = eqx.filter_jit(lambda m: eqx.filter_shard(init_opt(m, cfg), opt_sh))
    refuse_mismatch = lambda meta: ckpt.check_resume(
        with_recipe_defaults(meta), run.meta, RECIPE_FIELDS, cfg.allow_config_change, cfg.run_dir
    )
    window = saved_window(run.checkpoints) if cfg.allow_config_change else cfg.skip_window
    if window not in (None, cfg.skip_window):  # read as saved; its history then starts afresh (below)
        opt_like = abstract_state(
            dataclasses.replace(cfg, skip_window=window), mesh, run.model_cfg, run.compute
        )[1]
    like = {"opt": opt_like, "key": key_like(mesh)}
    restored = run.checkpoints.restore_latest(
        model_like, like, check=refuse_mismatch, start_over=cfg.start_over
    )
    key = jax.random.key(cfg.init_seed)
    if restored:
        step, model, state, _ = restored
        say(f"resuming from {data.join(run.checkpoints.dir, str(step))} (step {step})")
        if state is None:  # written by `ckpt.py from-hf` or `average`: weights only
            return step, model, make_opt(model), key
        opt = state["opt"]
        if window not in (None, cfg.skip_window):
            say(
                f"--skip_window {window} -> {cfg.skip_window}: the skip-step history starts empty, as OLMo-core's after a load"
            )
            opt = carried_over(make_opt(model), adam_of(opt), mesh)
        return step, model, opt, jax.random.wrap_key_data(state["key"])
    if cfg.init_from:
        model, adam = read_start(run, model_like)
        return 0, model, carried_over(make_opt(model), adam, mesh), key
    init = lambda k: eqx.filter_shard(olmo3.Olmo3(run.model_cfg, key=k, compute=run.compute), model_sh)
    model = eqx.filter_jit(init)(key)
    return 0, model, make_opt(model), key


def saved_window(checkpoints: ckpt.Checkpoints) -> int | None:
    """The skip-step window of the newest checkpoint's optimizer state; None where there is none."""
    steps = checkpoints.steps()
    saved = checkpoints.saved_train_state(steps[-1]) if steps else None
    return None if saved is None else skip_window_of(saved["opt"])


def key_like(mesh):
    """The RNG key's data as a checkpoint holds it: replicated."""
    return jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=shard.replicated(mesh))


def with_recipe_defaults(meta: dict) -> dict:
    """A checkpoint's metadata with each recipe field it predates (e.g. --schedule) at its default, which is
    what that run trained with."""
    if "config" not in meta:
        return meta
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.name in RECIPE_FIELDS}
    # Before --reduce_dtype, gradients were summed in the compute dtype.
    defaults["reduce_dtype"] = meta["config"].get("compute", {}).get("dtype", "float32")
    return meta | {"config": defaults | meta["config"]}


def init_source(cfg: TrainConfig) -> tuple[str, str, int | None]:
    """--init_from as (path, its format: ckpt.format_of, step): RUN_DIR@STEP names a checkpoint of a run."""
    at = re.fullmatch(r"(.+)@(\d+)", cfg.init_from)
    path, step = (at[1], int(at[2])) if at else (cfg.init_from, None)
    kind = ckpt.format_of(path)
    if step is not None and kind != "run":
        what = {"hf": "a Hugging Face directory", "olmo-core": "an OLMo-core step directory"}[kind]
        raise ValueError(
            f"@{step} names a checkpoint of one of our run directories; {path} is {what}, one state"
        )
    return path, kind, step


# The stages that go on from another's state, as OLMo-core's stage scripts name a load_path: without
# --init_from they are refused, unless --run_dir already holds the stage (a rerun resumes it).
STARTS_FROM = {
    "7b-midtrain": "stage 1 of the 7B (our runs/7b, or OLMo-core's stage1 step directory)",
    "32b-midtrain-1": "stage 1 of the 32B at step 656,000",
    "32b-midtrain-2": "stage 1 of the 32B at step 656,000",
    "7b-long-context": "stage 2 of the 7B (our runs/7b-midtrain, or OLMo-core's stage2 step directory)",
    "32b-long-context": "stage 1 of the 32B at step 656,000, or the average of its midtraining runs",
}


def check_start(cfg: TrainConfig, model_cfg: olmo3.Olmo3Config) -> None:
    """Where the run starts, refused in one line before anything is written: a stage preset needs --init_from
    unless --run_dir already holds the stage; --init_from must hold this run's model (once the stage has
    extended its context) with Adam's state unless --init_weights_only, its files whole."""
    if ckpt.has_checkpoints(cfg.run_dir):  # a resume: --init_from was read when the run started
        if cfg.init_from and cfg.eval_only:
            raise FlagError(
                f"--eval_only --init_from {cfg.init_from}: --run_dir {cfg.run_dir} holds checkpoints too, so "
                "which weights to score is ambiguous; drop --init_from, or give a --run_dir without checkpoints"
            )
        return
    if not cfg.init_from:
        if cfg.preset in STARTS_FROM and not cfg.eval_only:
            raise FlagError(
                f"--preset {cfg.preset} goes on from {STARTS_FROM[cfg.preset]}: name it with --init_from (a "
                "run directory or RUN_DIR@STEP, an OLMo-core step directory, or a Hugging Face directory)"
            )
        return
    as_run = functools.partial(extended_context, cfg)
    try:
        path, kind, step = init_source(cfg)
        if kind == "run":
            ckpt.check_run_start(path, step, model_cfg, as_run, cfg.init_weights_only)
        elif kind == "olmo-core":
            ckpt.check_olmo_core(path, model_cfg, cfg.init_weights_only)
        else:
            ckpt.check_hf(path, model_cfg, as_run)
    except (OSError, ValueError, ckpt.CorruptCheckpoint) as e:
        raise FlagError(f"--init_from {cfg.init_from}: {e}") from None


def read_start(run: Run, model_like):
    """--init_from (checked by check_start) as (model, (first moments, second moments, Adam's count) or None):
    weights only from a Hugging Face directory or with --init_weights_only. Each process reads only the
    shards its devices hold, straight onto them."""
    cfg = run.cfg
    path, kind, step = init_source(cfg)
    tally, adam = ckpt.Tally(), None
    model_sh = shard.shardings(model_like, run.mesh)
    try:
        if kind == "run":
            step, (model, adam) = read_run_start(run, path, step, model_like)
            path = f"{path}@{step}"
        elif kind == "olmo-core":
            model, adam = ckpt.load_olmo_core(path, run.model_cfg, cfg.init_weights_only, model_sh, tally)
        else:
            model = ckpt.load_hf(path, shardings=model_sh, tally=tally)
    except (OSError, ValueError, ckpt.CorruptCheckpoint) as e:  # bytes check_start did not read: a stop
        raise ckpt.CheckpointError(f"--init_from {cfg.init_from}: {e}") from None
    adam = None if cfg.init_weights_only else adam
    carried = "weights only: Adam from zero" if adam is None else "weights, Adam's moments and count"
    if tally.whole:  # every process says what it read: its own shards
        print(f"starting from {path} ({kind}: {carried}); this process {tally} of it", flush=True)
    else:
        say(f"starting from {path} ({kind}: {carried})")
    return with_statics(model, model_like), adam


def read_run_start(run: Run, path: str, step: int | None, model_like):
    """A checkpoint of one of our runs (the newest that reads back intact, or `step`) as (step, (model,
    (mu, nu, count) or None)), its optimizer state shaped by that run's own skip window."""
    ckpts = ckpt.Checkpoints(path, read_only=True)

    def read(s):
        saved = ckpts.saved_train_state(s)
        if saved is None:  # weights only (check_start has made sure --init_weights_only asks for that)
            return ckpts.read(s, model_like)[0], None
        window = dataclasses.replace(run.cfg, skip_window=skip_window_of(saved["opt"]))
        opt = eqx.filter_eval_shape(init_opt, model_like, window)
        opt_like = shard.abstract(opt, shard.shardings(opt, run.mesh))
        model, state, _ = ckpts.read(s, model_like, {"opt": opt_like, "key": key_like(run.mesh)})
        return model, adam_of(state["opt"])

    try:
        return ckpts.chosen(read, step)
    finally:
        ckpts.close()


def with_statics(tree, like):
    """`tree`'s arrays in `like`'s structure: the run's own config and compute policy for weights read
    elsewhere (a stage may extend the context, e.g. YaRN; check_start has compared the shapes)."""
    return eqx.combine(eqx.filter(tree, olmo3.is_array), eqx.filter(like, olmo3.is_array, inverse=True))


# ---------------------------------------------------------------------------------------------------------
# Batches and logging.


def read_batches(run: Run, start: int) -> data.Prefetcher:
    """Batches start, start + 1, ..., each read (ids checked), filtered for repeats (instances_kept), hashed
    and put on the devices on a thread, as a Batch."""
    cfg, rank, world = run.cfg, jax.process_index(), jax.process_count()
    row_ids = run.loader.row_ids(rank, world)
    put = lambda a: shard.put_batch(a, run.mesh, cfg.global_batch)

    def to_devices(rows):
        rows, label_mask, documents = rows if cfg.pack_files else (rows, None, None)
        kept = instances_kept(rows, cfg)
        extras = dict(keep=kept) if cfg.repeat_filter else {}
        extras |= dict(label_mask=label_mask, documents=documents) if cfg.pack_files else {}
        extras = {name: put(a) for name, a in extras.items()}
        return Batch(put(rows), extras, data.batch_hash(rows, row_ids), int((~kept).sum()))

    fetch = lambda i: run.loader.local_batch(i, rank, world)
    return data.Prefetcher(fetch, start, cfg.steps, to_devices, waiting=ckpt.waiting_for_data)


def stop_on_nan(run: Run, step: int, metrics: dict) -> None:
    """A NaN loss or grad norm stops the run, naming the last checkpoint to go back to."""
    if not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])):
        saved = [data.join(run.checkpoints.dir, str(s)) for s in run.checkpoints.steps()]
        last = f"the last checkpoint is {saved[-1]}" if saved else "no checkpoint yet"
        raise FloatingPointError(
            f"step {step}: loss {metrics['loss']}, grad norm {metrics['grad_norm']}; stopping ({last})"
        )


def metrics_row(run: Run, step: int, metrics: dict, batch: Batch, meter: ckpt.Progress) -> dict:
    """Step `step`'s row of metrics.jsonl: the step's numbers, its LR, speed and MFU (against the dense bf16
    peak, with --fp8 too: announce), the data's hash."""
    tokens_per_s, peak = meter.tick(metrics["loss"]), shard.peak_flops(run.mesh.devices.flat[0])
    flops_per_s = tokens_per_s * run.model_cfg.flops_per_token(run.cfg.seq_len)
    batch_hash, filtered = shard.sum_over_processes([batch.hash, batch.filtered])  # each process: its rows
    row = dict(step=step, **metrics, lr=lr_at(step, run.cfg), filtered=filtered, tokens_per_s=tokens_per_s)
    row["mfu"] = flops_per_s / (peak * run.mesh.size) if peak else None
    return row | dict(
        tokens=step * meter.tokens_per_step, data_wait_s=batch.wait, batch_hash=data.format_hash(batch_hash)
    )


def record_eval_row(run: Run, row: dict) -> None:
    """An evaluation's row into metrics.jsonl. An --eval_only row is added, never written over one the run
    wrote: marked, its sets and tasks named, and without eval_loss/eval_ppl, which keep the meaning training
    gave them (the recipe's first held-out set). Where it cannot be written (read-only storage), one line
    says so: the table printed above is the result."""
    if not run.cfg.eval_only:
        run.log.write(row)
        return
    row = {k: v for k, v in row.items() if k not in ("eval_loss", "eval_ppl")}
    sets, tasks = ",".join(h.label for h in run.eval_sets), ",".join(t.name for t in run.tasks)
    try:
        run.log.write(row | dict(eval_only=True, eval_sets=sets, tasks=tasks))
        run.log.flush()  # now, so that a failure is said here (on gs:// rows are otherwise held a while)
    except (OSError, ckpt.RunDirError) as e:
        say(
            f"--eval_only: could not add this evaluation to {run.log.path} ({e}); the table above is its result"
        )


def print_eval_tables(run: Run, step: int, row: dict) -> None:
    """An evaluation row as tables: each held-out set's CE loss and PPL, each task's own metric."""
    if run.eval_sets:
        width = max(len(held.label) for held in run.eval_sets)
        say(f"step {step}: held-out evaluation\n  {'set':<{width}}  CE loss        PPL")
        for held in run.eval_sets:
            ce, ppl = row[f"eval/lm/{held.label}/CE loss"], row[f"eval/lm/{held.label}/PPL"]
            say(f"  {held.label:<{width}}  {ce:7.4f} {ppl:10.2f}")
    if run.tasks:
        width = max(len(task.name) for task in run.tasks)
        say(f"step {step}: downstream evaluation (every metric in the row)\n  {'task':<{width}}  metric")
    for task in run.tasks:
        name = f"eval/downstream/{task.name} ("
        first = next(k for k in row if k.startswith(name))  # ICLMetric's first: the task's own metric
        cut = f" ({task.truncated} requests cut on the left to --seq_len)" if task.truncated else ""
        say(f"  {task.name:<{width}}  {first[len(name) : -1]} {row[first]:.4f}{cut}")


# ---------------------------------------------------------------------------------------------------------
# The hardware fit: the documents a packed row may hold, the context a kernel takes, the microbatches.


def documents_bound(cfg: TrainConfig, compute: olmo3.Compute, loader) -> olmo3.Compute:
    """`compute` with cuDNN's bound on a packed row's documents (Compute.max_documents): --max_documents,
    refused below the data's most, or (0) the data's most, counted before anything compiles."""
    if not cfg.pack_files or loader is None or compute.attention != "cudnn":
        return compute
    most, given = loader.packed.most_documents(), compute.max_documents
    if given and most > given:
        raise FlagError(
            f"--max_documents {given}: the packed data has a row of {most} documents (the padding "
            f"one of them); expected at least {most}, or 0 (the data's most)"
        )
    bound = given or most
    say(f"cuDNN packed attention: compiled for up to {bound} documents a row ({most} in the data)")
    return dataclasses.replace(compute, max_documents=bound)


def compute_policy(cfg: TrainConfig, mesh) -> olmo3.Compute:
    """The compute policy with the attention kernel decided for the mesh's devices; refused (FlagError) where
    the kernel cannot run what the recipe asks."""
    kernel = attention_kernel(cfg, mesh.devices.flat[0].platform)
    check_kernel(cfg, mesh, kernel)
    return dataclasses.replace(cfg.compute, attention=kernel)


def check_kernel(cfg: TrainConfig, mesh, kernel: str) -> None:
    """The attention kernel must run what the recipe asks: a context axis it can split (check_context); with
    packed rows on cuDNN in a dry run, a number of documents a row to compile for; Splash, its blocks."""
    if mesh.shape["context"] > 1:
        check_context(cfg, mesh.shape["context"], kernel)
    if kernel == "splash":
        check_splash(cfg, mesh.shape["context"])
    if cfg.pack_files and kernel == "cudnn" and cfg.dry_run and not cfg.compute.max_documents:
        raise FlagError(
            "--max_documents 0: cuDNN's packed attention compiles for a most documents a row, which a run "
            "counts in its data and a dry run has none of; expected --max_documents N (the padding one of them)"
        )


def check_context(cfg: TrainConfig, n: int, kernel: str) -> None:
    """A context axis of n devices splits each row into 2n chunks (olmo3.balanced_order): --seq_len must
    divide into them, and on the blocked and Splash kernels each chunk into whole sliding windows, so that a
    sliding layer needs only the window before each chunk (a neighbour's) and not the whole row."""
    where = f"--mesh {cfg.mesh} (context={n})"
    if kernel == "cudnn":
        raise FlagError(
            f"{where}: attention 'cudnn' does not run with a context axis yet; expected --attention local "
            "(or reference), or a mesh without context (fsdp and tensor axes)"
        )
    if cfg.seq_len % (2 * n):
        raise FlagError(f"{where}: --seq_len {cfg.seq_len} does not split into {2 * n} equal chunks")
    window, chunk = model_config(cfg).sliding_window, cfg.seq_len // (2 * n)
    if kernel != "reference" and window < cfg.seq_len and chunk % window:
        raise FlagError(
            f"{where}: each device's chunks of {chunk} positions are not whole sliding windows of {window}; "
            f"expected context=N with --seq_len / 2N a multiple of {window}, or --attention reference"
        )


def check_splash(cfg: TrainConfig, n: int) -> None:
    """Splash (the TPU's kernel) takes queries and keys in blocks of a multiple of 128 positions (a lane's
    width): each call's are a row, or over a context axis of n a chunk of it (check_context) and, on a
    sliding layer, the window before the chunk with it."""
    window, chunk = model_config(cfg).sliding_window, cfg.seq_len // (2 * n) if n > 1 else cfg.seq_len
    keys = window + chunk if n > 1 and window < cfg.seq_len else chunk
    if chunk % 128 or keys % 128:
        where = f" over --mesh {cfg.mesh}: chunks of {chunk}, {keys} keys with the window" if n > 1 else ""
        raise FlagError(
            f"--seq_len {cfg.seq_len}{where}: attention 'splash' takes blocks of a multiple of 128 positions; "
            "expected --seq_len (and over a context axis each chunk and the sliding window) a multiple of 128, "
            "or --attention local"
        )


def microbatches(cfg: TrainConfig, mesh, microbatch: int = 0) -> int:
    """Gradient-accumulation steps: the batch's rows split over (data, fsdp), each device's share into
    microbatches of `microbatch` rows (default --microbatch; 0: the whole share at once)."""
    n_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    per_device = cfg.global_batch // n_shards
    microbatch = microbatch or cfg.microbatch or per_device
    if cfg.global_batch % n_shards or microbatch == 0:
        raise FlagError(
            f"--global_batch {cfg.global_batch}: expected a multiple of the {n_shards} data x fsdp devices "
            f"of --mesh {cfg.mesh} (each device takes whole rows)"
        )
    if per_device % microbatch:
        raise FlagError(
            f"--microbatch {microbatch}: expected a divisor of the {per_device} rows each device takes "
            f"(--global_batch {cfg.global_batch} over the {n_shards} data x fsdp devices of --mesh {cfg.mesh})"
        )
    return per_device // microbatch


# The remat policies --remat auto tries, from the one that recomputes least to the one that recomputes most,
# which is also from the most memory to the least. The dry run's recompute factor, the tiny model's step at
# rows of 512 compiled for a v5e (Splash) and an H200 (cuDNN) alike: none 1.0065 (the kernels' backward
# recomputes the scores), save_matmuls 1.0195 (and the attention forward), save_attention 1.2178, full 1.2178
# (and every linear). save_attention recomputes as much as full wherever attention is a fused kernel: its
# backward needs the forward's softmax statistics, which only rerunning the kernel gives. So it holds more than
# full for no FLOP saved, and the search skips it.
REMAT_BY_RECOMPUTE = ("none", "save_matmuls", "full")
# What the fit search leaves free of each device's memory: a compile without the device misses what only the
# device adds (on a GPU cuDNN's workspace, autotuned kernels' own, the allocator's fragmentation: the 7B's step
# compiled on an H200 needed 143.7 GiB where the dry run's compile said 141.9, 1.3% more), and a step that
# fills HBM to the byte is one XLA change from not fitting. 5% of a v5p's 95.7 GiB is 4.8 GiB.
FIT_MARGIN = 0.05


def fitting_microbatches(cfg: TrainConfig, mesh, hbm: int | None, compile_for) -> tuple[int, str]:
    """(microbatches, remat policy) a step takes: what --microbatch and --remat say; where the devices state
    their memory (`hbm` bytes each: TPUs, GPUs, a --topology), what they leave open is what fits in all but
    FIT_MARGIN of it, as the target's compiler says (`compile_for(n_micro, remat)` compiles the step:
    compile_step; each try is one compile, minutes for the 7B):
    - --remat auto: the policy that recomputes least whose step fits one row per device at a time (or
      --microbatch's rows): lightest_remat;
    - --microbatch 0: the most rows per device at a time that fit with that policy, by bisection over the
      divisors of each device's rows (memory grows with the rows taken at once), so that a preset fits the
      chips it is given. If even one row at a time does not fit, one row it is, and the dry run's table says
      what would.
    On devices that state no memory (a CPU), --remat auto is full, the policy of least memory, and the
    microbatch --microbatch's (0: each device's whole share)."""
    n_micro, remat = microbatches(cfg, mesh), cfg.compute.remat
    if not hbm and remat == "auto":
        say("remat: full (--remat auto, on devices that state no memory to fit a lighter policy in)")
    if not hbm:
        return n_micro, "full" if remat == "auto" else remat
    per_device = cfg.global_batch // (mesh.shape["data"] * mesh.shape["fsdp"])
    room, need = hbm * (1 - FIT_MARGIN), {}  # need: (rows at once, policy) -> bytes per device, as compiled
    gib = lambda b: f"{b / 2**30:.1f} GiB"

    def fits(rows: int, policy: str) -> bool:
        if (rows, policy) not in need:
            say(f"fit: compiling {rows} row(s) per device at a time, remat {policy}, to see if it fits ...")
            need[rows, policy] = shard.memory_use(lambda: compile_for(per_device // rows, policy))[1]
        return need[rows, policy] <= room

    within = f"within {gib(room)} ({1 - FIT_MARGIN:.0%} of {gib(hbm)} per device)"
    if remat == "auto":
        rows = cfg.microbatch or 1
        remat = lightest_remat(rows, fits, need, within)
        if not fits(rows, remat):  # more rows would not fit either
            return per_device // rows, remat
    if cfg.microbatch:
        return n_micro, remat
    sizes = [rows for rows in range(1, per_device + 1) if per_device % rows == 0]
    if fits(sizes[-1], remat):
        return n_micro, remat
    fit, too_big = 0 if (1, remat) in need else -1, len(sizes) - 1  # in sizes: most known to fit, least not
    while too_big - fit > 1:
        mid = (fit + too_big) // 2
        fit, too_big = (mid, too_big) if fits(sizes[mid], remat) else (fit, mid)
    rows = sizes[max(fit, 0)]
    verdict = f"the most that fit: {gib(need[rows, remat])}" if fit >= 0 else "and even that does not fit"
    say(
        f"microbatch: {rows} row(s) per device at a time ({per_device // rows} microbatches), {verdict} {within} "
        f"({per_device} rows at once: {gib(need[per_device, remat])}); --microbatch sets it"
    )
    return per_device // rows, remat


def lightest_remat(rows: int, fits, need: dict, within: str) -> str:
    """--remat auto's choice: the policy that recomputes least (REMAT_BY_RECOMPUTE) whose step fits `rows` per
    device at a time (`fits(rows, policy)` compiles it; `need` holds what each compile needed), lightest
    first; full if none does. Says which, and what each policy tried needed."""
    remat = next((policy for policy in REMAT_BY_RECOMPUTE if fits(rows, policy)), "full")
    why = "the policy that recomputes least of those that fit" if fits(rows, remat) else "no policy fits"
    tried = ", ".join(f"{policy} {need[r, policy] / 2**30:.1f} GiB" for r, policy in need if r == rows)
    say(f"remat: {remat} (--remat auto): {why} {rows} row(s) per device at a time {within} (need: {tried})")
    return remat


# The flags whose change may change the fit search's choice: they shape the compiled step and what it holds
# (the model, the compute policy, the mesh and the devices are recorded whole beside them: fit_made_for). The
# others (the schedule, the data's files, the intervals) change no array the step holds.
FIT_FLAGS = (
    "global_batch",
    "seq_len",
    "microbatch",
    "pack_files",
    "repeat_filter",
    "loss",
    "loss_chunk",
    "reduce_dtype",
    "dp_ranks",
    "positions",
    "skip_window",
    "deterministic",
)


def fitted(run: Run, target) -> tuple[int, str]:
    """fitting_microbatches' (microbatches, remat policy) for the run's devices. Where they state their memory,
    its search compiles the step several times (minutes each for the 7B), so its choice is kept in
    RUN_DIR/fit.json with what it was made for (fit_made_for), and a restart that finds the same takes it
    from there (ckpt.recorded_fit); devices that state none (a CPU) have nothing to search, and --eval_only
    (which may read a directory it cannot write) searches without the record."""
    cfg, mesh, hbm = run.cfg, run.mesh, shard.memory_limit(run.mesh, target)
    with_remat = lambda remat: dataclasses.replace(run.compute, remat=remat)
    compile_for = lambda n, remat: compile_step(cfg, mesh, run.model_cfg, with_remat(remat), n)
    search = lambda: fitting_microbatches(cfg, mesh, hbm, compile_for)
    if not hbm or cfg.eval_only:
        return search()
    return ckpt.recorded_fit(cfg.run_dir, fit_made_for(run, hbm), search, say)


def fit_made_for(run: Run, hbm: int) -> dict:
    """What the fit search's choice depends on: the devices (their kind, how many, in how many processes, the
    memory each states), the compiler (shard.compiler), the mesh, the model, the compute policy (--remat as
    given) and the flags that shape the step (FIT_FLAGS)."""
    device = run.mesh.devices.flat[0]
    devices = dict(kind=device.device_kind, count=run.mesh.size, processes=jax.process_count(), memory=hbm)
    return dict(
        devices=devices,
        compiler=shard.compiler(device),
        mesh=dict(run.mesh.shape),
        model=dataclasses.asdict(run.model_cfg),
        compute=dataclasses.asdict(run.compute),
        flags={name: getattr(run.cfg, name) for name in FIT_FLAGS},
    )


def compile_step(
    cfg: TrainConfig, mesh, model_cfg: olmo3.Olmo3Config, compute: olmo3.Compute, n_micro: int, options=None
):
    """The train step compiled for the mesh from abstract inputs, nothing allocated (with XLA's `options`:
    shard.compile_abstract); returns it and those inputs by name."""
    model, opt = abstract_state(cfg, mesh, model_cfg, compute)
    rows = lambda dtype: jax.ShapeDtypeStruct(
        (cfg.global_batch, cfg.seq_len), dtype, sharding=shard.batch_sharding(mesh)
    )
    batch = rows(jnp.int32)
    packed = dict(label_mask=rows(jnp.bool_), documents=rows(jnp.int32)) if cfg.pack_files else {}
    step = functools.partial(train_step, cfg=cfg, n_micro=n_micro, mesh=mesh)
    compiled = shard.compile_abstract(
        lambda model, opt, batch, lr, packed: step(model, opt, batch, lr, **packed),
        model,
        opt,
        batch,
        jax.ShapeDtypeStruct((), jnp.float32),
        packed,
        donate=2,
        options=options,
    )
    params = eqx.filter(model, olmo3.is_array)
    return compiled, {"parameters (fp32)": params, "optimizer state (fp32)": opt, "batch": (batch, packed)}


def compiled_step(run: Run, model, opt):
    """The loop's train step compiled before step 1, for the arguments take_step passes it (zeros in the
    batch's place: nothing runs); say how long that took and whether --compile_cache held it
    (shard.compile_watched). The loop calls it as compiled, not through filter_jit, whose every call waits for
    the step to end (equinox 0.13 does, to raise the step's runtime errors): so step k + 1 is dispatched while
    the host reads step k's numbers, and the devices never wait for the host."""
    cfg, mesh = run.cfg, run.mesh
    rows = lambda dtype, *row: jnp.zeros(
        (cfg.global_batch, *row), dtype, device=shard.batch_sharding(mesh, 1 + len(row))
    )
    extras = dict(keep=rows(jnp.bool_)) if cfg.repeat_filter else {}
    if cfg.pack_files:
        extras |= dict(label_mask=rows(jnp.bool_, cfg.seq_len), documents=rows(jnp.int32, cfg.seq_len))
    args = (model, opt, rows(jnp.int32, cfg.seq_len), jnp.float32(0))
    lowered = lambda: train_step.lower(*args, cfg=cfg, n_micro=run.n_micro, mesh=mesh, **extras)
    with warnings.catch_warnings():  # as in the loop: the int batch's buffer cannot take a float's place
        warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
        compiled, seconds, did = shard.compile_watched(lambda: lowered().compile())
    where = "compiled afresh"
    if not did["compiles"]:
        where = "compiled before in this process"
    elif did["hits"]:
        where = f"from the compilation cache {cfg.compile_cache}"
    elif did["writes"]:
        where += f"; cached in {cfg.compile_cache}"
    elif not cfg.compile_cache:
        where += "; --compile_cache is off"
    say(f"compiled the step in {seconds:.1f} s ({where})")
    return compiled


# ---------------------------------------------------------------------------------------------------------
# The dry run: compile the step (and the evaluation steps) for the mesh, report memory and FLOPs.


def compile_eval_steps(cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, n_micro: int) -> dict:
    """The held-out and downstream evaluation steps, each as a function that compiles it for the mesh from
    abstract inputs (as compile_step), on a train microbatch's rows at --seq_len: the batches evaluate() runs."""
    rows, seq, chunk = cfg.global_batch // n_micro, cfg.seq_len, math.gcd(cfg.seq_len, cfg.loss_chunk)
    model = abstract_state(cfg, mesh, model_cfg, compute)[0]
    params = {"parameters (fp32)": eqx.filter(model, olmo3.is_array)}
    batch = lambda *shape, dtype=jnp.int32: jax.ShapeDtypeStruct(
        (rows, *shape), dtype, sharding=shard.batch_sharding(mesh, 1 + len(shape))
    )
    held_out = functools.partial(eval_step, chunk=chunk, mesh=mesh)
    downstream = functools.partial(downstream_step, chunk=chunk, mesh=mesh)
    choices = 10  # the widest fast multiple choice of the OLMo 3 tasks (copycolors_10way_fast)
    return {
        "held-out (LM)": lambda: (
            shard.compile_abstract(held_out, model, batch(seq), batch(seq, dtype=jnp.bool_)),
            params,
        ),
        "downstream tasks": lambda: (
            shard.compile_abstract(
                downstream,
                model,
                batch(),
                batch(seq),
                batch(seq),
                batch(seq, dtype=jnp.bool_),
                batch(),
                batch(choices),
            ),
            params,
        ),
    }


def report_eval_steps(
    cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, n_micro: int, target
) -> None:
    """What each evaluation step holds on a device (the dry run's lines below the train step's table)."""
    hbm = shard.memory_limit(mesh, target)
    say("evaluation steps (forward only), as many rows at once, per device:")
    for name, compile_eval in compile_eval_steps(cfg, mesh, model_cfg, compute, n_micro).items():
        rows, total = shard.memory_use(compile_eval)
        need = f"{total / 2**30:.3f} GiB " + ("a device" if rows else "of temporaries alone")
        verdict = "no HBM stated" if not hbm else "fits" if rows and total <= hbm else "does not fit"
        say(f"  {name:<24}  {need} ({verdict})")


def dry_run(cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, target) -> int:
    """Compile one train step (in the microbatches and remat policy that fit, unless --microbatch and --remat
    say) and report what each device holds, against its HBM, and what it computes; 1 if it does not fit."""
    with_remat = lambda remat: dataclasses.replace(compute, remat=remat)
    compile_for = functools.cache(lambda n, remat: compile_step(cfg, mesh, model_cfg, with_remat(remat), n))
    n_micro, remat = fitting_microbatches(cfg, mesh, shard.memory_limit(mesh, target), compile_for)
    compute = with_remat(remat)
    rows = cfg.global_batch // n_micro // (mesh.shape["data"] * mesh.shape["fsdp"])
    split = (
        f" (each row's positions over {mesh.shape['context']} devices)" if mesh.shape["context"] > 1 else ""
    )
    chosen = " (--remat auto: the least recomputation that fits)" if cfg.compute.remat == "auto" else ""
    say(
        f"dry run: {cfg.preset} on {shard.describe(mesh, target)}, {n_micro} microbatch(es) of {rows} rows x "
        f"{cfg.seq_len} per device{split}, attention {compute.attention!r}, remat {remat}{chosen}; compiling ..."
    )
    tips = [f"--microbatch {rows // 2} (fewer rows at a time)"] if rows > 1 else []
    tips += ["--remat full (recompute each layer in the backward pass)"] if remat != "full" else []
    tips = ", ".join([*tips, "more chips, or a tensor or context axis in --mesh"])
    fits = shard.fit_report(lambda: compile_for(n_micro, remat), mesh, target, tips, say)
    if fits:  # what runs the matmuls (fp8 under --fp8?), as the target's compiler emitted them
        hlo = compile_for(n_micro, remat)[0].as_text()
        kinds = matmul_kinds(hlo).most_common()
        said = ", ".join(f"{n} {kind}" for kind, n in kinds)
        say(f"matmuls in the compiled step (the layer scan's body once): {said}")
        say(
            f"recompute: {recompute_factor(hlo, cfg, mesh, model_cfg):.2f}× the model's FLOPs (the compiled "
            f"step's matmuls, each as often as it runs, over the model's; remat {remat})"
        )
        report_traffic(hlo, traffic_floor(cfg, mesh, model_cfg, compute, n_micro))
    report_eval_steps(cfg, mesh, model_cfg, compute, n_micro, target)
    if compute.attention == "reference":
        say("  (the reference attention materialises seq x seq scores; Splash and cuDNN need far less)")
    step_flops = model_cfg.flops_per_token(cfg.seq_len) * cfg.global_batch * cfg.seq_len
    say(f"FLOPs per step: {step_flops:.3e}, {step_flops / mesh.size:.3e} per device")
    return 0 if fits else 1


def recompute_factor(hlo: str, cfg: TrainConfig, mesh, model_cfg: olmo3.Olmo3Config) -> float:
    """The FLOPs a compiled step executes, its matmuls on every device (shard.matmul_flops), over the model's
    (Olmo3Config.flops_per_token, which MFU counts): 1 where nothing is computed twice; --remat full's
    recomputed forward pass adds about a third. An attention kernel's score matrices count the (query, key)
    pairs the model's masks keep, as flops_per_token counts them: its shapes do not say whether a sliding or a
    full layer called it, and every layer's kernels run equally often, so each call counts the layers' mean
    (a call on a chunk of a row, over a context axis: all its pairs)."""
    matmuls, kernels = shard.matmul_flops(hlo)
    types = model_cfg.layer_types
    pairs = lambda q, k: sum(model_cfg.attention_pairs(q, t) for t in types) / len(types) if q == k else q * k
    per_pair = lambda c: 2 * c.matmuls * c.matrices * c.head_dim * c.runs  # 2 FLOPs a multiply-add
    attention = sum(per_pair(c) * pairs(c.queries, c.keys) for c in kernels)
    step = model_cfg.flops_per_token(cfg.seq_len) * cfg.global_batch * cfg.seq_len
    return (matmuls + attention) * mesh.size / step


def report_traffic(hlo: str, floor: dict) -> None:
    """The dry run's traffic table: per kind of collective and element type, how many arrays a step moves
    and their bytes per device, beside the floor (traffic_floor), and how many of them run asynchronously
    with compute scheduled between their start and end (the others stall the device while they run)."""
    rows = shard.traffic(shard.collectives(hlo))
    say(
        "traffic per device per step, each array whole (gathered, or before its sum), every layer and "
        "microbatch counted; floor: what this mesh and recipe need (train.traffic_floor)"
    )
    say(
        f"  {'collective':<18} {'type':<9} {'arrays':>7} {'MiB':>11} {'floor MiB':>11}  overlapped with compute"
    )
    mib = lambda b: f"{b / 2**20:,.1f}"
    order = lambda key: (shard.COLLECTIVES.index(key[0]), key[1])
    for kind, dtype in sorted(rows.keys() | floor.keys(), key=order):
        n, size, overlapped = rows.get((kind, dtype), (0, 0, 0))
        least = mib(floor[kind, dtype]) if (kind, dtype) in floor else "-"
        say(f"  {kind:<18} {dtype:<9} {n:>7} {mib(size):>11} {least:>11}  {overlapped} of {n}")
    total = sum(size for _, size, _ in rows.values())
    say(f"  {'total':<18} {'':<9} {'':>7} {mib(total):>11} {mib(sum(floor.values())):>11}")


HLO_TYPES = {"float32": ("f32", 4), "bfloat16": ("bf16", 2)}  # a dtype's name in HLO text, its bytes
E4M3 = ("f8e4m3fn", 1)


def traffic_floor(cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, n_micro: int) -> dict:
    """(collective, element type) -> the bytes per device a step must move at least, counted as the dry
    run counts them (each array whole): the weights' (weight_traffic_floor) and the activations'
    (activation_traffic_floor)."""
    weights = weight_traffic_floor(cfg, mesh, model_cfg, compute, n_micro)
    return dict(weights + activation_traffic_floor(cfg, mesh, model_cfg, compute, n_micro))


def weight_traffic_floor(cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, n_micro: int):
    """FSDP all-gathers each layer's weights split over fsdp once a microbatch (twice where --remat
    recomputes the layers) and the others once a step, in the dtype the layers take them in (the fp8 block
    linears: e4m3), and reduce-scatters each gradient once a microbatch; the devices that hold the same shard
    but other tokens (data, context; for a weight not split over fsdp, all) sum it once a step, as
    OLMo-core's HSDP does. Gradients in --reduce_dtype where the layers compute narrower (the fp8 block
    linears': fp32 either way)."""
    model = olmo3.abstract(model_cfg, compute)
    fits = lambda w, n_in: compute.fp8 and olmo3.fp8_fits(w.shape[1:], n_in)  # stacked: a layer's shape
    fp8 = {id(w) for w, n in zip(olmo3.block_linears(model), olmo3.BLOCK_LINEAR_INPUTS) if fits(w, n)}
    copies = shard.Layout(mesh, cfg.reduce_dtype).copies(compute.dtype)
    sums = HLO_TYPES[cfg.reduce_dtype if copies else compute.dtype]
    remat, out = 2 if compute.remat != "none" else 1, collections.Counter()
    for w, ax in shard.with_axes(model):
        (wire, wire_bytes), (grad, grad_bytes) = (
            (E4M3, HLO_TYPES["float32"]) if id(w) in fp8 else (HLO_TYPES[compute.dtype], sums)
        )
        whole, part = (shard.elements_held(ax, w.shape, mesh, gathered) for gathered in (True, False))
        if whole > part:  # split over fsdp
            out["all-gather", wire] += whole * wire_bytes * (n_micro * remat if ax[0] == "layers" else 1)
            out["reduce-scatter", grad] += whole * grad_bytes * n_micro
        if mesh.shape["data"] * mesh.shape["context"] * (1 if whole > part else mesh.shape["fsdp"]) > 1:
            out["all-reduce", grad] += part * grad_bytes
    return out


def activation_traffic_floor(cfg: TrainConfig, mesh, model_cfg, compute: olmo3.Compute, n_micro: int):
    """Tensor parallelism (Megatron's): each layer all-reduces its two row-parallel outputs (attention's,
    the MLP's; again where --remat recomputes the layer) and, backward, the input gradients of its two
    column-parallel projections; the vocab-split embedding its lookups, the LM head its input gradient.
    A context axis: a full layer all-gathers the row's keys and values (the reference attention: every
    layer) and reduce-scatters their gradients; a sliding one takes the window before each of its two
    chunks from its neighbours (collective permutes), and sends their gradients back. Per-token statistics
    (QK-norm over split heads, the softmax over a split vocab) are left out: a few bytes a token."""
    s, out = mesh.shape, collections.Counter()
    rows = cfg.global_batch // n_micro // (s["data"] * s["fsdp"])  # a device's rows in a microbatch
    tokens, (dtype, size) = rows * cfg.seq_len // s["context"], HLO_TYPES[compute.dtype]
    forward = 2 if compute.remat != "none" else 1  # times a layer's forward runs
    if s["tensor"] > 1:
        per_layer = (2 * forward + 2) * tokens * model_cfg.d_model * size
        out["all-reduce", dtype] += n_micro * (
            model_cfg.n_layers * per_layer + 2 * tokens * model_cfg.d_model * size
        )
    if s["context"] > 1:
        kv_heads = model_cfg.n_kv_heads // (s["tensor"] if model_cfg.n_kv_heads % s["tensor"] == 0 else 1)
        kv = 2 * rows * model_cfg.head_dim * kv_heads * size  # keys and values, a position's
        for t in model_cfg.layer_types:
            if model_cfg.window(t) is None or compute.attention == "reference":
                out["all-gather", dtype] += n_micro * forward * kv * cfg.seq_len
                out["reduce-scatter", dtype] += n_micro * kv * cfg.seq_len
            else:
                out["collective-permute", dtype] += n_micro * (forward + 1) * kv * 2 * model_cfg.window(t)
    return out


MATMUL = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? (dot|convolution|custom-call)\(([^)]*)\)(.*)$", re.MULTILINE)


def matmul_kinds(hlo: str) -> collections.Counter:
    """The matrix multiplications of a compiled program (its optimized HLO text), each instruction once (a
    scan's body once), by the element types of their two operands ("fp8": both f8) and what runs them: a dot
    or convolution of XLA's own (CPU, TPU), or a cuBLAS call (GPU; `__cublas$lt$matmul$f8`: cuBLASLt's fp8
    GEMM). On a CPU the fp8 matmuls are f32 dots of fp8-rounded operands."""
    types = dict(re.findall(r"%([\w.\-]+) = \(?(\w+)\[", hlo))
    kinds = collections.Counter()
    for op, operands, rest in MATMUL.findall(hlo):
        if op == "custom-call":  # a library call: cuBLAS's GEMMs count, cuDNN's attention and others not
            if not (target := re.search(r'custom_call_target="(__cublas[^"]*)"', rest)):
                continue
            op = target[1]
        a, b = (types.get(name.strip().lstrip("%"), "?") for name in operands.split(",")[:2])
        kind = "fp8" if a.startswith("f8") and b.startswith("f8") else a if a == b else f"{a} x {b}"
        kinds[f"{kind} ({op})"] += 1
    return kinds


# ---------------------------------------------------------------------------------------------------------
# The evaluation loops: the jitted evaluation steps, the held-out sets and the downstream tasks.


@eqx.filter_jit
def eval_step(model, batch, label_mask, chunk: int, mesh=None):
    """(summed CE, positions counted) of padded held-out instances, as OLMo-core scores them: get_labels gives
    position t the label token t + 1 if that one is label-masked (a document's last position has none), and
    LMEvaluator averages over every label-masked position, one without a label counting 0."""
    layout = None if mesh is None else shard.Layout(mesh)
    scored = label_mask & jnp.pad(label_mask[:, 1:], ((0, 0), (0, 1)))  # masked, with a masked next token
    w, targets = model.as_used(layout).lm_head, jnp.roll(batch, -1, axis=-1)
    (ce, _), _, _ = olmo3.lm_head_sums(model.features(batch, layout), w, loss_sums, targets, scored, chunk)
    return ce, label_mask.sum()


def logprob_sums(logits: Float[Array, "batch seq vocab"], targets: Int[Array, "batch seq"], mask):
    """Per instance, the summed log-probability of its scored targets (lm_head_sums' per-instance sums)."""
    ce, _ = cross_entropy(logits, targets)
    return (jnp.where(mask, -ce, 0.0).sum(-1),)


@eqx.filter_jit
def downstream_step(model, request_ids, tokens, targets, scored, at, choices, chunk: int, mesh=None):
    """What ICLMetric needs of a batch of requests, and no more (never a batch's logits): per request its
    continuation's log-probability (the scored positions' targets), and each choice token's log-probability
    at position `at`; with the request ids, as every process gets them (with several processes a global
    array's rows are not in the batch's order: shard.put_batch)."""
    layout = None if mesh is None else shard.Layout(mesh)
    x, w = model.features(tokens, layout), model.as_used(layout).lm_head
    (continuation,), _, _ = olmo3.lm_head_sums(x, w, logprob_sums, targets, scored, chunk)
    x_at = x[jnp.arange(x.shape[0]), at]  # batch embed
    # The logits in x's dtype, as the LM head makes them (bf16 under a bf16 policy), then upcast as the loss.
    log_probs = jax.nn.log_softmax(olmo3.linear(x_at, w, out_dtype=x.dtype).astype(jnp.float32))
    picked = jnp.take_along_axis(log_probs, jnp.maximum(choices, 0), axis=-1)
    out = (request_ids, continuation, picked)
    return out if mesh is None else jax.lax.with_sharding_constraint(out, shard.replicated(mesh))


def eval_set_loss(run: Run, model, held: data.PaddedEvalSet) -> float:
    """One held-out set's CE per token, as OLMo-core's LMEvaluator: the mean over the label-masked positions
    of the whole set (or its first --eval_batches batches' worth), in batches of a train microbatch's rows
    (what fits the devices; the last filled with empty rows: one compiled program for every set)."""
    cfg, rank, world = run.cfg, jax.process_index(), jax.process_count()
    n = min(len(held), cfg.eval_batches * cfg.global_batch) if cfg.eval_batches else len(held)
    size = cfg.global_batch // run.n_micro
    local = np.arange(rank, size, world)  # this process's rows of each batch, as in training
    put = lambda rows: shard.put_batch(rows, run.mesh, size)
    total = count = 0
    for first in range(0, n, size):
        ckpt.between_batches()  # a preemption stops the evaluation here
        tokens, mask = held.rows(first + local, stop=n)
        ce, counted = eval_step(model, put(tokens), put(mask), cfg.loss_chunk, run.mesh)
        total, count = total + ce, count + counted
    return float(total) / int(count)


def lm_row(run: Run, model) -> dict:
    """Every held-out set's CE loss and PPL under OLMo-core's names (eval/lm/LABEL/CE loss, eval/lm/LABEL/PPL;
    eval_loss and eval_ppl: the first set's). PPL is exp(CE), capped at exp(50) so a diverged model's row
    stays finite JSON."""
    row = {}
    for held in run.eval_sets:
        ce = eval_set_loss(run, model, held)
        row[f"eval/lm/{held.label}/CE loss"], row[f"eval/lm/{held.label}/PPL"] = ce, math.exp(min(ce, 50))
    first = run.eval_sets[0].label
    return row | dict(eval_loss=row[f"eval/lm/{first}/CE loss"], eval_ppl=row[f"eval/lm/{first}/PPL"])


def task_scores(run: Run, model, task: data.DownstreamTask, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Every request's continuation log-probability and its choices' (downstream_step), in batches of as
    many tokens as the train step's microbatch (OLMo-core sizes its evaluation batches so too)."""
    cfg, rank, world = run.cfg, jax.process_index(), jax.process_count()
    continuation, picked = np.zeros(len(task.queries)), np.zeros((len(task.queries), width))
    for batch in data.downstream_batches(task, cfg.global_batch // run.n_micro, cfg.seq_len, width):
        ckpt.between_batches()  # a preemption stops the evaluation here
        local = np.arange(rank, len(batch[0]), world)  # this process's rows, as in training
        put = lambda a: shard.put_batch(a[local], run.mesh, len(a))
        chunk = math.gcd(batch[1].shape[1], cfg.loss_chunk)  # a divisor of this batch's length
        ids, cont, lp = (np.asarray(a) for a in downstream_step(model, *map(put, batch), chunk, run.mesh))
        continuation[ids[ids >= 0]], picked[ids[ids >= 0]] = cont[ids >= 0], lp[ids >= 0]
    return continuation, picked


def downstream_row(run: Run, model) -> dict:
    """Every task's ICLMetric metrics, named as OLMo-core records them (eval/downstream/TASK (LABEL)); and,
    where olmo_eval cut requests on the left to fit the context, how many (eval/downstream/TASK (requests
    truncated))."""
    width = max([1, *(task.choices.shape[1] for task in run.tasks)])  # one program shape for every task
    row = {}
    for task in run.tasks:
        row |= data.task_metrics(task, *task_scores(run, model, task, width))
        if task.truncated:
            row[f"eval/downstream/{task.name} (requests truncated)"] = task.truncated
    return row


def plot_and_sample(run: Run, model) -> None:
    """A finished run's plots (loss.png, downstream.png) and, with --samples, text sampled from the model;
    then the start's last goodput record, their seconds in it."""
    if jax.process_index() == 0:
        ckpt.plot_losses(run.cfg.run_dir)
        ckpt.plot_downstream(run.cfg.run_dir)
    if run.cfg.samples:  # the model spans every process, so all of them sample; process 0 prints
        print_samples(model, run.cfg, run.tokenizer_path)
    run.goodput.refresh()


def print_samples(model, cfg: TrainConfig, tokenizer_path) -> None:
    tok, length = data.get_tokenizer(cfg.tokenizer, tokenizer_path), min(model.cfg.max_seq_len, cfg.seq_len)
    say("samples:")
    prompt = jnp.asarray([tok.eos_id], jnp.int32)  # a fresh document starts after an EOS
    draw = lambda key: olmo3.sample(model, prompt, length - 1, key=key, temperature=0.8, top_k=50)
    # All in one loop: 11 s for the tiny preset's 3 samples on a 2-core CPU, not 14 one after another.
    outs = jax.vmap(draw)(jax.vmap(jax.random.key)(jnp.arange(cfg.samples)))
    for i, out in enumerate(np.asarray(outs)):
        text = tok.decode([int(t) for t in out[1:] if int(t) < tok.vocab_size])
        say(f"--- sample {i + 1} ---\n{text.split(tok.decode([tok.eos_id]))[0].strip()[:600]}")


# ---------------------------------------------------------------------------------------------------------
# The command line: every field of TrainConfig (and of olmo3.Compute) is a flag, its comment its --help.


def field_comments(cls) -> dict[str, str]:
    """Each field's comment in the source of `cls`: the one on its line, continued by the comment lines right
    below it (a blank line or code ends it, so a heading for the next fields has a blank line above it)."""
    comments, name = {}, None
    for line in inspect.getsource(cls).splitlines():
        if field := re.match(r"\s+(\w+): [^=]+=.*?  # (.*)$", line):
            name, comments[field[1]] = field[1], field[2]
        elif name and (more := re.match(r"\s+# (.*)$", line)):
            comments[name] += " " + more[1]
        else:
            name = None
    return comments


@functools.cache  # read from this file's source once (ast.parse: see ckpt.format_traceback)
def flags() -> dict[str, tuple[dataclasses.Field, str]]:
    """Every flag: its field and that field's comment. Compute's fields are flags of their own."""
    out = {}
    for cls in (TrainConfig, olmo3.Compute):
        comments = field_comments(cls)
        out |= {f.name: (f, comments.get(f.name, "")) for f in dataclasses.fields(cls) if f.name != "compute"}
    return out


def with_flag(cfg: TrainConfig, name: str, value) -> TrainConfig:
    """`cfg` with one field (of TrainConfig or olmo3.Compute) set, checked (check_fields, or Compute's own)."""
    if name in olmo3.Compute.__dataclass_fields__:
        return dataclasses.replace(cfg, compute=dataclasses.replace(cfg.compute, **{name: value}))
    changed = dataclasses.replace(cfg, **{name: value})
    check_fields(changed)
    return changed


BOOLS = {"true": True, "1": True, "false": False, "0": False}  # how a flag's text reads as a boolean

# Flags of earlier versions, with what says the same now.
RETIRED_FLAGS = {"init_from_hf": "--init_from HF_DIR (it takes our run directories and OLMo-core's too)"}


def flag_pairs(argv: list[str], known: dict) -> list[tuple[str, str]]:
    """(name, text) for each flag of the command line: `--name value`, `--name=value`, or a bare `--name`
    for a boolean's true."""
    pairs, args = [], list(argv)
    while args:
        arg = args.pop(0)
        name, eq, value = arg.removeprefix("--").partition("=")
        if name in RETIRED_FLAGS:
            raise FlagError(f"--{name} is retired; use {RETIRED_FLAGS[name]}")
        if not arg.startswith("--") or name not in known:
            close = ", ".join("--" + c for c in difflib.get_close_matches(name, known, n=3))
            raise FlagError(f"unknown flag {arg}; " + (f"did you mean {close}?" if close else "see --help"))
        if not eq and args and not args[0].startswith("--"):
            value, eq = args.pop(0), "="
        elif not eq and known[name][0].type is not bool:
            raise FlagError(f"--{name} needs a value")
        pairs.append((name, value if eq else "true"))
    return pairs


def print_help(known: dict, preset: str) -> None:
    base = PRESETS[preset]
    values = dataclasses.asdict(base) | dataclasses.asdict(base.compute)
    print(
        f"usage: python train.py [--preset {'|'.join(PRESETS)}] [--FLAG VALUE ...]; each flag sets one "
        f"field of the preset. Flags and the {preset} preset's values:",
        *(f"  --{k:<20} {values[k]!r:<14} {doc}" for k, (_, doc) in known.items()),
        sep="\n",
    )


def parse_args(argv: list[str]) -> TrainConfig:
    """`--preset NAME` picks the base; every other flag then sets one field. A bad value is refused as its
    field is set (with_flag: check_fields, and olmo3.Compute's own), here named by its flag; check_flags
    refuses what spans fields. `--help` (or -h) lists the flags with the chosen preset's values."""
    known, helping = flags(), bool({"-h", "--help"} & set(argv))
    pairs = flag_pairs([a for a in argv if a not in ("-h", "--help")], known)
    if (cfg := PRESETS.get(preset := dict(pairs).get("preset", "7b"))) is None:
        raise FlagError(f"--preset {preset!r}: expected one of {', '.join(PRESETS)}")
    if helping:
        print_help(known, preset)
        raise SystemExit(0)
    for name, value in pairs:
        kind = known[name][0].type
        try:
            if kind is bool and value.lower() not in BOOLS:
                raise ValueError(value)
            cfg = with_flag(cfg, name, BOOLS[value.lower()] if kind is bool else kind(value))
        except ValueError as e:  # a value of the wrong type, or one the config refuses, naming its field
            said = str(e).removeprefix("--").removeprefix("Compute.")  # olmo3.Compute names its field
            expected = "true or false" if kind is bool else kind.__name__
            raise FlagError(
                f"--{said}" if said.startswith(f"{name} ") else f"--{name} {value!r}: expected {expected}"
            ) from None
    return cfg


COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def check_fields(cfg: TrainConfig) -> None:
    """Each field of `cfg` within what it accepts (flag's bounds and choices; olmo3.Compute checks its own):
    FlagError naming the flag and what it accepts. Run as each flag is set (with_flag) and by check_flags."""
    for f in dataclasses.fields(cfg):
        value, bounds = getattr(cfg, f.name), f.metadata.get("bounds", [])
        if not all(COMPARE[op](value, bound) for op, bound in bounds):
            kind = "an integer" if f.type is int else "a number"
            accepted = " and ".join(f"{op} {b}" for op, b in bounds)
            raise FlagError(f"--{f.name} {value}: expected {kind} {accepted}")
        if (choices := f.metadata.get("choices")) and value not in choices:
            accepted = ", ".join(c or "'' (the default)" for c in choices)
            raise FlagError(f"--{f.name} {value!r}: expected one of {accepted}")
    if cfg.head_layout and not re.fullmatch(r"[1-9]\d*x[1-9]\d*", cfg.head_layout):
        raise FlagError(f"--head_layout {cfg.head_layout!r}: expected HEADSxHEAD_DIM, e.g. 16x256")
    shard.parse_mesh(cfg.mesh, None)  # ValueError naming --mesh


def check_flags(cfg: TrainConfig) -> None:
    """Refuse what no single field can, before anything is compiled or written: FlagError names the flags,
    the values and what would be accepted. (What needs the devices or the data is refused where they are
    first known: start_devices, microbatches, plan_run.)"""
    check_fields(cfg)  # each field within what it accepts, however the config was made
    check_recipe_flags(cfg)
    check_extras(cfg)  # before check_data_flags, which reads olmo_eval's task names
    check_data_flags(cfg)
    check_run_flags(cfg)
    check_places(cfg)  # last: it may ask a bucket, once every flag that asks nothing is judged


# The flags that name places, read or written: (flag, field, whether a comma-separated list of files and globs).
PLACES = (
    ("--run_dir", "run_dir", False),
    ("--data", "data", True),
    ("--data_root", "data_root", False),
    ("--eval_data", "eval_data", True),
    ("--init_from", "init_from", False),
)


def check_places(cfg: TrainConfig) -> None:
    """Every URL a flag names, judged before anything is read or written: one the storage layer cannot use
    faithfully is bad usage (data.check_url), and a bucket that does not exist stops the run in one line naming
    the flag (data.check_bucket; not asked by a --dry_run, which reads nothing). Asks with the storage's
    patience, which main sets first."""
    places = [(flag, getattr(cfg, name), many) for flag, name, many in PLACES]
    try:
        for flag, value, many in places:
            data.check_url(value, flag, pattern=many)
    except data.BadURL as e:
        raise FlagError(str(e)) from None
    for flag, value, many in places if not cfg.dry_run else ():
        data.check_bucket(value, flag, pattern=many)


def check_recipe_flags(cfg: TrainConfig) -> None:
    """The model and the loss: the flags that must fit one another."""
    if cfg.model_preset not in olmo3.MODELS:
        raise FlagError(f"--model {cfg.model_preset!r}: expected one of {', '.join(olmo3.MODELS)}")
    try:  # the head layout must fit the preset's width
        model_config(cfg)
    except ValueError as e:
        raise FlagError(f"--head_layout {cfg.head_layout}: {e}") from None
    if 0 < cfg.yarn <= 1:
        raise FlagError(
            f"--yarn {cfg.yarn}: expected a factor above 1 (the context grows by it), or 0 (none)"
        )
    if cfg.loss_chunk and cfg.seq_len % cfg.loss_chunk:
        raise FlagError(
            f"--loss_chunk {cfg.loss_chunk}: expected a divisor of --seq_len {cfg.seq_len} (or 0)"
        )
    if cfg.global_batch % cfg.dp_ranks:
        raise FlagError(f"--dp_ranks {cfg.dp_ranks}: expected a divisor of --global_batch {cfg.global_batch}")
    if jnp.dtype(cfg.reduce_dtype).itemsize < jnp.dtype(cfg.compute.dtype).itemsize:
        raise FlagError(
            f"--reduce_dtype {cfg.reduce_dtype}: gradients summed narrower than --dtype {cfg.compute.dtype} "
            f"makes them; expected {cfg.compute.dtype}"
        )


def check_data_flags(cfg: TrainConfig) -> None:
    """What is read: packing's flags without --pack_files, the downstream tasks, where a run starts."""
    values = dataclasses.asdict(cfg) | dataclasses.asdict(cfg.compute)
    for name, unset in [("positions", "row"), ("file_seed", -1), ("max_documents", 0)]:
        if not cfg.pack_files and values[name] != unset:
            raise FlagError(f"--{name} {values[name]}: goes with --pack_files N (documents packed into rows)")
    if cfg.tasks and not cfg.dry_run:
        check_tasks(cfg.tasks)
    if cfg.init_weights_only and not cfg.init_from:
        raise FlagError("--init_weights_only: goes with --init_from SOURCE")


def check_run_flags(cfg: TrainConfig) -> None:
    """Where and how the run goes: its directory, the dry run's slice, the logs and the profile."""
    try:
        ckpt.check_run_place(cfg.run_dir, "--run_dir")
    except data.StorageRefused as e:
        raise FlagError(str(e)) from None
    if cfg.topology and not cfg.dry_run:
        raise FlagError(f"--topology {cfg.topology}: devices that exist only for the compiler; add --dry_run")
    if cfg.num_slices > 1 and not cfg.topology:
        raise FlagError(f"--num_slices {cfg.num_slices}: goes with --topology (a real run finds its slices)")
    if cfg.dry_run and cfg.eval_only:
        raise FlagError("--dry_run and --eval_only: choose one")
    if cfg.wandb and not cfg.dry_run:
        check_wandb(cfg.wandb)
    if cfg.wandb_run and not cfg.wandb:
        raise FlagError(f"--wandb_run {cfg.wandb_run}: goes with --wandb PROJECT")
    if cfg.profile and not re.fullmatch(r"[1-9]\d*:[1-9]\d*", cfg.profile):
        raise FlagError(f"--profile {cfg.profile!r}: expected START:STEPS, e.g. 10:3 (steps 10, 11 and 12)")
    if cfg.profile and cfg.steps and (last := sum(map(int, cfg.profile.split(":"))) - 1) > cfg.steps:
        raise FlagError(f"--profile {cfg.profile}: traces up to step {last}, past --steps {cfg.steps}")


def check_wandb(project: str) -> None:
    """--wandb: wandb (installed: check_extras) importable, before anything is written."""
    try:
        import wandb  # noqa: F401
    except Exception as e:  # a broken install: its own error, in one line
        raise FlagError(
            f"--wandb {project}: wandb is installed but fails to import ({type(e).__name__}: {e})"
        ) from None


def check_tasks(tasks: str) -> None:
    """--tasks: every name one of olmo_eval's tasks (installed: check_extras)."""
    from olmo_eval import list_tasks

    known = list_tasks()
    for name in tasks.split(","):
        if name and name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
            hint = (
                f"did you mean {', '.join(close)}?" if close else f"expected one of olmo_eval's {len(known)}"
            )
            raise FlagError(f"--tasks: unknown task {name!r}; {hint}")


# The extras of pyproject.toml a run may need, by the module whose absence check_extras refuses. The [gpu]
# extra has none here: shard.gpu_target asks JAX for the CUDA compiler and refuses with JAX's own reason.
EXTRA_MODULES = {
    "eval": "olmo_eval",
    "tpu": "libtpu",
    "gcs": "gcsfs",  # which brings google-cloud-storage
    "s3": "boto3",
    "wandb": "wandb",
    "tensorboard": "tensorboardX",
}

# URLs by scheme: the extra that reads and writes them in data.py's storage layer, and what it brings.
URL_EXTRAS = {"gs": ("gcs", "gcsfs and google-cloud-storage"), "s3": ("s3", "boto3")}


def extras_needed(cfg: TrainConfig) -> dict[str, str]:
    """The extras beyond the core install (the README's quick start) that `cfg` needs, each with the line
    refusing it where it is missing (check_extras). A dry run reads no data or tasks and writes nothing: it
    needs only its --topology's compiler. tests/test_docs.py checks every command the pages show by this."""
    topology = f"--topology {cfg.topology}: compiling for a"
    if cfg.dry_run and cfg.topology.lower().partition("x")[0] in shard.GPUS:  # h200x8: shard.compile_target
        return {"gpu": f"{topology} GPU needs the CUDA plugin: pip install -e '.[gpu]'"}
    if cfg.dry_run:
        return {"tpu": f"{topology} TPU needs libtpu: pip install -e '.[tpu]'"} if cfg.topology else {}
    needs = {}
    if cfg.tasks:
        named = cfg.tasks if len(cfg.tasks) < 60 else f"({cfg.tasks.count(',') + 1} tasks)"
        needs["eval"] = f"--tasks {named}: downstream tasks need olmo_eval: {data.EVAL_EXTRA}, or --tasks ''"
    if cfg.wandb:
        needs["wandb"] = f"--wandb {cfg.wandb}: needs wandb: pip install -e '.[wandb]'"
    if cfg.tensorboard:
        needs["tensorboard"] = "--tensorboard needs tensorboardX: pip install -e '.[tensorboard]'"
    for f in dataclasses.fields(cfg):  # every flag that takes a path (--run_dir, --data_root, ...)
        value = getattr(cfg, f.name)
        for scheme, (extra, brings) in URL_EXTRAS.items():
            if isinstance(value, str) and re.search(rf"\b{scheme}://", value):
                line = f"--{f.name} {value}: {scheme}:// needs {brings}: pip install -e '.[{extra}]'"
                needs.setdefault(extra, line)
    return needs


def check_extras(cfg: TrainConfig) -> None:
    """Every extra `cfg` needs installed (extras_needed), before anything starts: the first one missing
    refused in one line naming its flag and its install."""
    for extra, refusal in extras_needed(cfg).items():
        if extra in EXTRA_MODULES and importlib.util.find_spec(EXTRA_MODULES[extra]) is None:
            raise FlagError(refusal)


# Bad usage (exit 2): a flag's value, or flags that do not fit the run directory's checkpoints. What stops a
# run (exit 1): a failed save, no readable checkpoint, bad data, a NaN, a run directory busy or unwritable.
# Either is one line naming the cause. A hang (no step in --step_timeout) exits ckpt.HUNG_EXIT, 124, from the
# watchdog's thread (ckpt.StepWatchdog); docs/scaling.md lists which exits a supervisor should restart.
USAGE = (FlagError, ckpt.ResumeRefused)

STOPS = (
    ckpt.CheckpointError,
    ckpt.RunDirError,
    data.DataError,
    data.StorageError,
    data.StorageUnavailable,
    FloatingPointError,
    FileNotFoundError,
)


def cli(argv: list[str]) -> int:
    """main() from the command line: bad usage exits 2 and a run stopped by what it found exits 1, each with
    one line naming the cause; anything else is a bug and keeps its traceback."""
    try:
        cfg = parse_args(argv)
        with ckpt.errors_logged(cfg.run_dir, unless=USAGE):  # the full story in RUN_DIR/log.txt
            return main(cfg)
    except (*USAGE, *STOPS) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2 if isinstance(e, USAGE) else 1
        shard.exit_alone(code)  # with other processes, which may be waiting for this one: now
        return code
    except ckpt.Preempted:  # before the first step, or in an --eval_only or owed evaluation: nothing to save
        return 0
    except BaseException:
        if jax.distributed.is_initialized():  # a bug: its traceback, then the same exit as above
            traceback.print_exc()
            shard.exit_alone(1)
        raise


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
