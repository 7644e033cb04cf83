"""Reproduce OLMo-core: step by step from the same weights and batches, then the two trained models.

    python bench/reference.py --steps 50    # ~8 min on 2 idle CPU cores; table, loss plot, JSON in --out
    python bench/reference.py --tokenizer tiny --steps 600 --batch 16 --lr 2e-3 --warmup 60 --lr_final 0 \
        --skip_window 128 --horizon 40 --eval_tokens 32768 --noise 4 --check_weights \
        --out runs/learned    # a model that learns, 5 runs a side: 68 min (--noise 1: 28); bench/RESULTS.md
    python bench/reference.py --bf16 --eval_tokens 0    # both in bf16, judged against what bf16 costs
    python bench/reference.py --steps 6 --batch 2 --seq_len 64 --window 16 --warmup 2 --skip_window 4 \
        --eval_tokens 512 --eval_len 256 --noise 1 --check_weights   # the size tests/test_reference.py runs

OLMo-core (ai2-olmo-core, PyTorch, fp32 on the CPU) trains `TransformerConfig.olmo3_14M` at dolma2's
vocabulary (or the tiny preset's, --tokenizer tiny) through its own Trainer: NumpyFSLDataLoader over the
token files written here, TransformerTrainModule (loss, z-loss, clipping), SkipStepAdamW and CosWithWarmup,
configured as the official stage-1 script, scaled down. One thing is swapped in: the grad norm it clips with, which torch computes
inexactly on a CPU (see olmo_core_run; --torch_cpu_norm keeps torch's). Its initial weights reach us through
its own HF exporter and ckpt.load_hf; we train with train.train_step on data.TokenLoader batches.

Compared per step: the hash of the batch each side trained on, LR, loss (CE + z-loss), grad norm and skip,
judged through --horizon (all steps by default): rounding differences grow with training, and once the two
runs have parted (as each trainer parts from itself started one ulp away: `parted`) the trained models are
judged instead. At the end, with `compare.compare` on held-out text (`held_out_sets`: training instances no run
reached, and the held-out plays at the training context and at a long one): OLMo-core's trained model
against ours in fp32 and in bf16 (loss, top-1 agreement, distinct predictions, KL, each token's loss);
--noise N: each trainer N more times from initial weights a few ulps away (NUDGES), each trainer's own
spread, against which the difference of the two trainers' mean held-out losses is read (Welch's t-test at
5%; on the unseen training instances also within 0.01 nats);
--check_weights: our trained weights through transformers' Olmo3 against our model in fp32 and bf16. Exit 1
if a figure leaves its tolerance. `--ours FIELD=VALUE` sets a TrainConfig field on our side only: a
deliberate mismatch, which the test uses to check that one is caught.
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# compare.py beside this file, also when a test imports this one; then the project's modules.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import compare  # bench/compare.py, beside this file
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import scipy.stats
import torch
from olmo_core.config import DType
from olmo_core.data import InstanceFilterConfig, NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
from olmo_core.nn.hf.checkpoint import save_hf_model
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import CosWithWarmup, OptimGroupOverride, SkipStepAdamWConfig
from olmo_core.train import Duration, TrainerConfig
from olmo_core.train.callbacks import Callback
from olmo_core.train.train_module import TransformerTrainModuleConfig

import ckpt
import data
import olmo3
import shard
import train

# Relative per step and for the held-out loss; a fraction for top-1; nats for any one held-out token's loss.
TOLERANCE = {
    "loss": 1e-5,
    "grad_norm": 1e-4,
    "held_out_loss": 1e-5,
    "top1_fp32": 0.999,
    "token_loss_fp32": 1e-3,
    "learned_loss_nats": 0.01,  # held-out loss of the two trained models (the public reproduction's bar)
}
PUBLIC_TOP1 = 0.9875  # the public JAX reproduction's top-1 agreement with AI2's model at 8192 tokens
LEARNED_DISTINCT = 100  # distinct top-1 predictions on held-out text: a model that has learned
# --bf16: OLMo-core computes under torch.autocast(bfloat16) (its train module's autocast_precision: matmuls in
# bf16, reductions and norms in fp32; on GPUs its FSDP keeps bf16 parameters), we with --dtype bfloat16 (bf16
# logits too, as its LM head makes them); parameters and Adam's moments stay fp32 on both sides. The two bf16
# trainers round differently (autocast casts only the matmuls' inputs and keeps the residual stream in fp32;
# our bf16 policy, like OLMo-core's FSDP with bf16 parameters, keeps weights and activations in bf16, the
# norms' and softmax's sums in fp32), so a step's figures may differ by this many times what bf16 cost either
# side (its bf16 run against its own fp32 run) through that step.
BF16_BOUND = 2.0
NUDGES = (1, -1, 2, -2, 3, -3)  # --noise N: each trainer's extra runs start this many ulps away, in turn
PUBLIC_LEN = 8192  # the public reproduction's context for its top-1 figure: the long context, where it fits


def write_corpus(folder: Path, tok: data.Tokenizer, repeats_in: int = 0) -> dict[str, list[str]]:
    """The tiny corpus (38 plays, 3 held out) tokenized with `tok`: one OLMo token file per play.
    `repeats_in` (a sequence length): each training play also holds, per 8 instances of that length, a run of
    a few tokens repeated 40 times, short enough to fit one instance, which the repeat filter drops."""
    rng, dtype = np.random.default_rng(0), data.dtype_for_vocab(tok.vocab_size)
    files = {}
    for split, plays in data.tiny_plays().items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        files[split] = [str(folder / split / f"{k:03d}.npy") for k in range(len(plays))]
        for path, ids in zip(files[split], tok.encode_batch(plays)):
            ids = np.asarray([*ids, tok.eos_id], dtype)  # a document ends with EOS, as OLMo's do
            for _ in range(len(ids) // (8 * repeats_in) if repeats_in and split == "train" else 0):
                period = int(rng.integers(1, max(2, min(14, repeats_in // 40))))
                run = np.tile(rng.integers(0, tok.vocab_size, period), 40).astype(dtype)
                at = int(rng.integers(0, len(ids) - len(run)))
                ids[at : at + len(run)] = run
            ids.tofile(path)
    return files


def get_tokenizer(name: str, out: Path) -> data.Tokenizer:
    """dolma2 (OLMo 3's), or the tiny preset's 8192-id BPE trained on the training plays: a 12x smaller LM head,
    so a long run learns real structure within the bench's time."""
    return data.get_tokenizer(
        name, data.prepare_tiny(str(out / "tiny"))["tokenizer"] if name == "tiny" else None
    )


def exact_total_norm(tensors, norm_type=2.0, error_if_nonfinite=False, foreach=None):
    """torch.nn.utils.get_total_norm as a GPU computes it: exact to fp32 rounding (summed here in fp64)."""
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float64) for t in tensors])
    return torch.linalg.vector_norm(norms).float()


class Recorder(Callback):
    """Per step, the batch OLMo-core's trainer trained on and the figures it logged."""

    def __init__(self):
        self.rows = {}

    def pre_step(self, batch):
        self.rows[self.step] = {
            "hash": data.batch_hash(batch["input_ids"].numpy()),
            "rows": len(batch["input_ids"]),
        }

    def log_metrics(self, step, metrics):
        if step == 0 or "train/CE loss" not in metrics:  # the dry-run batch; a checkpoint save's timings
            return
        self.rows[step].update(
            loss=metrics["train/CE loss"] + metrics["train/Z loss"],
            lr=[metrics["optim/LR (group 0)"], metrics["optim/LR (group 1)"]],
            grad_norm=metrics["optim/total grad norm"],
            skipped=bool(metrics["optim/step skipped"]),
            filtered=round(metrics.get("train/masked instances (%)", 0.0) * self.rows[step]["rows"]),
        )
        progress("OLMo-core", step, self.trainer.max_steps, self.rows[step]["loss"])


def progress(side: str, step: int, steps: int, loss: float):
    if step % 10 == 0 or step == steps:
        print(f"{side}: step {step}/{steps}, loss {loss:.4f}", flush=True)


def olmo_core_tokenizer(tok: data.Tokenizer) -> TokenizerConfig:
    return (
        TokenizerConfig.dolma2()
        if tok.name == "dolma2"  # the tiny BPE has no padding id: OLMo-core then pads with EOS, as for GPT-2
        else TokenizerConfig(vocab_size=tok.vocab_size, eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    )


def olmo_core_module(args, tokenizer: TokenizerConfig, scheduler=None):
    """OLMo-core's model and train module (optimizer, schedule, loss) as the recipe configures them, scaled
    down; building it initialises the weights (init_seed 0). `scheduler`: another than stage 1's cosine."""
    window = SlidingWindowAttentionConfig(
        pattern=[args.window] * 3 + [-1],
        force_full_attention_on_first_layer=False,
        force_full_attention_on_last_layer=True,
    )
    model = TransformerConfig.olmo3_14M(
        vocab_size=tokenizer.padded_vocab_size(),
        n_layers=args.layers,
        n_kv_heads=args.kv_heads,
        sliding_window=window,
        attn_backend=AttentionBackendName.torch,
    ).build(init_device="cpu")
    tokens = args.batch * args.seq_len  # OLMo-core sizes batches in tokens; the batch is one microbatch
    no_decay = OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})
    optim = SkipStepAdamWConfig(
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        sigma_factor=6,
        rolling_interval_length=args.skip_window,
        group_overrides=[no_decay],
    )
    return TransformerTrainModuleConfig(
        rank_microbatch_size=tokens,
        max_sequence_length=args.seq_len,
        optim=optim,
        z_loss_multiplier=1e-5,
        max_grad_norm=1.0,
        autocast_precision=DType.bfloat16 if getattr(args, "bf16", False) else None,
        scheduler=scheduler or CosWithWarmup(warmup=args.warmup, alpha_f=args.lr_final, t_max=args.steps),
    ).build(model, device=torch.device("cpu"))


def olmo_core_run(args, files, out: Path, tok: data.Tokenizer, nudge: int = 0):
    """OLMo-core's stage-1 recipe (OLMo-3-1025-7B-pretrain-1.py, scaled down): its trained model and records.
    `nudge` ±k: every initial weight moved k ulps up or down, a draw of the reference's own noise."""
    tokenizer = olmo_core_tokenizer(tok)
    module, tokens = olmo_core_module(args, tokenizer), args.batch * args.seq_len
    if nudge:
        with torch.no_grad():
            for p in module.model.parameters():
                for _ in range(abs(nudge)):
                    p.copy_(torch.nextafter(p, torch.full_like(p, math.copysign(math.inf, nudge))))
        out = out / f"nudged{nudge:+d}"
    else:
        save_hf_model(out / "init-hf", module.model.state_dict(), module.model, save_overwrite=True)

    work = str(out / "olmo-core-work")
    dataset = NumpyFSLDatasetConfig(
        paths=files["train"],
        sequence_length=args.seq_len,
        tokenizer=tokenizer,
        work_dir=work,
        instance_filter_config=InstanceFilterConfig(13, 1, args.repeat_filter)
        if args.repeat_filter
        else None,
    ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=tokens, seed=args.seed, work_dir=work).build(dataset)
    recorder = Recorder()
    trainer = TrainerConfig(
        save_folder=str(out / "olmo-core-run"),
        max_duration=Duration.steps(args.steps),
        metrics_collect_interval=1,
        no_checkpoints=True,
        save_overwrite=True,
        callbacks={"recorder": recorder},
    ).build(module, loader)
    # torch's CPU kernel for an fp32 vector norm accumulates without cascade summation (pytorch/pytorch#169237)
    # and misses the norm of the 12.8M-entry LM head gradient by up to 7e-4. OLMo-core clips with that norm,
    # so on a CPU its early updates are scaled by a wrong factor: by step 44 the run differs from itself with
    # an exact norm by 3e-4 in grad norm (and from ours by as much), where the exact one agrees with ours to
    # 4e-7. On a GPU the reduction is exact to fp32 rounding, and so is the norm patched in here.
    cpu_norm = (
        contextlib.nullcontext()
        if args.torch_cpu_norm
        else mock.patch.object(torch.nn.utils, "get_total_norm", exact_total_norm)
    )
    with cpu_norm:
        trainer.fit()
    return module.model.eval(), [recorder.rows[s] for s in range(1, args.steps + 1)]


def nudged(x, nudge: int):
    """Every float of `x` k ulps up (nudge +k) or down (-k)."""
    if not eqx.is_inexact_array(x):
        return x
    for _ in range(abs(nudge)):
        x = jnp.nextafter(x, jnp.full_like(x, math.copysign(math.inf, nudge)))
    return x


def training_order(files, out: Path, vocab: int, seq_len: int, batch: int, seed: int) -> data.TokenLoader:
    """Our loader over the training files, in the order OLMo-core's loader also follows at the same sizes
    and seed (the batch hashes show it): every run of ours, nudged or not, trains on it, and its batches
    after the last step are the unseen instances the trained models are read on."""
    return data.TokenLoader(
        files["train"],
        seq_len,
        batch,
        seed=seed,
        dtype=data.dtype_for_vocab(vocab),
        vocab_size=vocab,
        work_dir=str(out / "ours-work"),
    )


def our_run(args, files, out: Path, nudge: int = 0):
    """train.py's step on data.py's batches from OLMo-core's initial weights: our trained model and records.
    `nudge` ±k: every initial weight k ulps up or down, a draw of our own noise."""
    # The official recipe's defaults (betas, eps, weight decay, clipping, z-loss, skip sigma), where OLMo-core's
    # side spells them out: a wrong default here would show. Scaled down: the sizes and the schedule.
    cfg = dataclasses.replace(
        train.PRESETS["7b"],
        seq_len=args.seq_len,
        global_batch=args.batch,
        seed=args.seed,
        lr=args.lr,
        warmup_steps=args.warmup,
        lr_horizon=args.steps,
        lr_final=args.lr_final,
        steps=args.steps,
        skip_window=args.skip_window,
        repeat_filter=args.repeat_filter,
        # The maths' definition; --ours attention=local runs the CPU's default kernel.
        compute=olmo3.Compute(dtype="bfloat16" if args.bf16 else "float32", attention="reference"),
    )
    for override in args.ours:
        name, value = override.split("=", 1)
        cfg = train.with_flag(cfg, name, train.flags()[name][0].type(value))
    model = ckpt.load_hf(out / "init-hf", compute=cfg.compute)  # the model computes as its compute says
    model = jax.tree.map(lambda x: nudged(x, nudge), model) if nudge else model
    # An --ours override of the sizes or seed changes our order alone: the batch hashes then differ.
    loader = training_order(files, out, model.cfg.vocab_size, cfg.seq_len, cfg.global_batch, cfg.seed)
    opt = train.init_opt(model, cfg)
    rows = []
    for step in range(1, args.steps + 1):  # step s trains on batch s - 1, as OLMo-core's step s does
        batch = loader.global_batch(step - 1)
        lr = train.lr_at(step, cfg)
        keep = ~data.repeated(batch, cfg.repeat_filter) if cfg.repeat_filter else None
        model, opt, m = train.train_step(
            model, opt, jnp.asarray(batch, jnp.int32), jnp.float32(lr), cfg=cfg, n_micro=1, keep=keep
        )
        rows.append(
            {
                "hash": data.batch_hash(batch),
                "lr": lr,
                "loss": float(m["loss"]),
                "grad_norm": float(m["grad_norm"]),
                "skipped": bool(m["skipped"]),
                "filtered": 0 if keep is None else int((~keep).sum()),
            }
        )
        progress(f"ours{f' {nudge:+d} ulp' if nudge else ''}", step, args.steps, rows[-1]["loss"])
    return model, rows


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b) if b else abs(a)  # an annealed schedule ends at lr 0


def parting(a: list[dict], b: list[dict]) -> int | None:
    """The first step at which two runs' losses differ by more than the per-step tolerance (None: never)."""
    return next(
        (s for s, (x, y) in enumerate(zip(a, b), 1) if rel(x["loss"], y["loss"]) > TOLERANCE["loss"]), None
    )


def compare_steps(ours: list[dict], theirs: list[dict], fp32: tuple | None = None) -> list[dict]:
    """Each step's figures side by side, and which left their tolerance. `fp32`: both sides ran in bf16, and
    these are (ours, OLMo-core's) runs in fp32; a step's loss and grad norm may then differ by up to
    BF16_BOUND times what bf16 cost either side (its bf16 run against its fp32 run) through that step."""
    table, cost = [], {"loss": 0.0, "grad_norm": 0.0}
    for step, (o, t) in enumerate(zip(ours, theirs), 1):
        if fp32:
            o32, t32 = fp32[0][step - 1], fp32[1][step - 1]
            cost = {k: max(cost[k], rel(o[k], o32[k]), rel(t[k], t32[k])) for k in cost}
        bound = {k: max(TOLERANCE[k], BF16_BOUND * cost[k] if fp32 else 0.0) for k in cost}
        r = {
            "step": step,
            "ours": o,
            "olmo_core": t,
            "hash_equal": o["hash"] == t["hash"],
            "lr_equal": all(rel(o["lr"], lr) <= 1e-12 for lr in t["lr"]),  # the same float64, to rounding
            "loss_rel": rel(o["loss"], t["loss"]),
            "grad_norm_rel": rel(o["grad_norm"], t["grad_norm"]),
            "skipped_equal": o["skipped"] == t["skipped"],
            "filtered_equal": o["filtered"] == t["filtered"],
            "bf16_cost": cost if fp32 else None,
        }
        checks = {
            "batch": r["hash_equal"],
            "lr": r["lr_equal"],
            "loss": r["loss_rel"] <= bound["loss"],
            "grad_norm": r["grad_norm_rel"] <= bound["grad_norm"],
            "skipped": r["skipped_equal"],
            "filtered": r["filtered_equal"],
        }
        r["failed"] = [name for name, ok in checks.items() if not ok]
        table.append(r)
    return table


def olmo_core_side(model):
    """OLMo-core's model, through its own forward in fp32, as one side of `compare.compare`."""

    @torch.no_grad()
    def logits(tokens: np.ndarray, chunk: int):
        whole = model(torch.as_tensor(tokens.astype(np.int64))[None])[0]
        for start in range(0, len(tokens), chunk):
            yield whole[start : start + chunk].float().numpy()

    return model.vocab_size, logits


def cached(side):
    """`side` with each sequence's logits computed once: a reference is read against several candidates."""
    vocab, logits, memo = *side, {}

    def again(tokens: np.ndarray, chunk: int):
        key = (tokens.tobytes(), chunk)
        if key not in memo:
            memo[key] = list(logits(tokens, chunk))
        return iter(memo[key])

    return vocab, again


def held_out_sets(args, files, out: Path, vocab: int) -> list[dict]:
    """The text the trained models are read on. At the training context: instances of the training data that
    no run reached (the batches after the last step, in the order both loaders share: the distribution the
    models learned, as a pretraining validation set is), and the held-out plays (other plays, other
    characters: text the models must generalise to). At the long context: one held-out play's sequence.
    `bar`: the two trained models' held-out losses must agree within 0.01 nats there, the public
    reproduction's tolerance on its validation loss; elsewhere, within the trainers' own spread."""
    loader = training_order(files, out, vocab, args.seq_len, args.batch, args.seed)
    batches = range(args.steps, args.steps + math.ceil(args.eval_tokens / (args.batch * args.seq_len)))
    if batches.stop > loader.num_batches:
        raise SystemExit(
            f"--steps {args.steps}: the training files hold {loader.num_batches} batches; the held-out "
            f"instances need {len(batches)} more after the last step (fewer --steps or --eval_tokens)"
        )
    unseen = out / "unseen-instances" / "000.npy"
    unseen.parent.mkdir(parents=True, exist_ok=True)
    rows = np.concatenate([loader.global_batch(i) for i in batches])  # the loader gives uint32
    rows.astype(data.dtype_for_vocab(vocab)).tofile(unseen)  # the dtype `compare.compare` reads these ids as
    plays = dict(text="held-out plays", files=files["val"], bar=False)
    long = long_context(args, files["val"], vocab)
    return [
        dict(
            text="unseen instances",
            files=[str(unseen)],
            length=args.seq_len,
            tokens=args.eval_tokens,
            bar=True,
        ),
        plays | dict(length=args.seq_len, tokens=args.eval_tokens),
        plays | dict(length=long, tokens=long),
    ]


def long_context(args, val_files: list[str], vocab: int) -> int:
    """--eval_len, or by default PUBLIC_LEN tokens if a held-out scene holds that many (the tiny BPE's longest
    holds 8721), else the longest scene's whole sliding windows (dolma2's: 7569 tokens, so 7552): a sequence
    lies within one token file, and in whole windows our "local" kernel reads the sliding layers blockwise."""
    if args.eval_len:
        return args.eval_len
    itemsize = np.dtype(data.dtype_for_vocab(vocab)).itemsize
    longest = max(os.path.getsize(f) // itemsize for f in val_files)
    return min(PUBLIC_LEN, longest // args.window * args.window)


def read_on(s: dict, ref, cand) -> dict:
    return compare.compare(ref, cand, s["files"], s["length"], s["tokens"])


# Trained models are read with the kernel train.py runs on a CPU: "local" computes the sliding layers in
# window-sized blocks, the reference attention's maths (tests/test_model.py), 3.5x faster at 8192 tokens here,
# where the reference materialises each layer's 8192 x 8192 scores (37 s a read, against transformers' 4 s).
READ_KERNEL = "local"
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def our_side(model, dtype: str = "float32"):
    """Our model as one side of `compare.compare`, computing in `dtype` with READ_KERNEL."""
    return compare.model_side(model.using(olmo3.Compute(dtype, READ_KERNEL)), shard.make_mesh("tensor=1"))


def held_out(ours, reference, s: dict) -> dict:
    """The two trained models on held-out set `s`: OLMo-core's (`reference`) against ours in fp32 and bf16."""
    return {"text": s["text"], "length": s["length"], "bar": s["bar"]} | {
        name: read_on(s, reference, our_side(ours, dtype)) for name, dtype in DTYPES.items()
    }


def noise_floor(reference, nudges, nudged_theirs: list, nudged_ours: list, s: dict) -> dict:
    """Each trainer again from initial weights `nudges` ulps away, each run's held-out figures against
    OLMo-core's first run: the spread of each trainer's result, which a difference between the two is read
    against."""
    return {
        "text": s["text"],
        "length": s["length"],
        "nudges": list(nudges),
        "olmo_core": [read_on(s, reference, olmo_core_side(m)) for m in nudged_theirs],
        "ours": [read_on(s, reference, our_side(m)) for m in nudged_ours],
    }


def runs_apart(e: dict, n: dict | None) -> dict:
    """The two trainers' held-out losses over their runs: means, standard deviations, the difference of the
    means, its standard error and Welch's t-test's p (each trainer's own spread; no test with one run each).
    A small p says the trainers differ by more than their runs do."""
    theirs = [e["fp32"]["ref_loss"]] + [r["cand_loss"] for r in (n["olmo_core"] if n else [])]
    ours = [e["fp32"]["cand_loss"]] + [r["cand_loss"] for r in (n["ours"] if n else [])]
    sd = lambda xs: float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0
    se = float(np.hypot(sd(theirs) / np.sqrt(len(theirs)), sd(ours) / np.sqrt(len(ours))))
    diff = float(np.mean(ours) - np.mean(theirs))
    p = (
        float(scipy.stats.ttest_ind(ours, theirs, equal_var=False).pvalue)
        if min(map(len, (ours, theirs))) > 1
        else None
    )
    return dict(olmo_core=theirs, ours=ours, sd_olmo_core=sd(theirs), sd_ours=sd(ours), diff=diff, se=se, p=p)


def same_weights(hf: Path, sets: list[dict]) -> list[dict]:
    """Our trained weights, exported to `hf`, through transformers (fp32, the reference) and through our model
    in fp32 and in bf16, on each held-out set: the checker, `bench/compare.py`, on a model that has learned."""
    ref = cached(compare.side(f"transformers:{hf}"))
    cands = {"fp32": compare.side(str(hf), READ_KERNEL), "bf16": compare.side(f"{hf}:bf16", READ_KERNEL)}
    return [
        {"text": s["text"], "length": s["length"]}
        | {name: read_on(s, ref, cand) for name, cand in cands.items()}
        for s in sets
    ]


def comparison(name: str, c: dict) -> str:
    return (
        f"{name}, {c['sequences']} x {c['length']}: loss {c['ref_loss']:.6f} vs {c['cand_loss']:.6f} "
        f"(|diff| {abs(c['ref_loss'] - c['cand_loss']):.1e}), top-1 {c['top1']:.4%} over "
        f"{c['distinct_top1']} distinct, KL mean {c['mean_kl']:.1e} max {c['max_kl']:.1e}, "
        f"max token |diff| {c['max_token_loss_diff']:.1e} nats"
    )


def report(
    table: list[dict], evals: list[dict], horizon: int, noise: list[dict], checks: list[dict], parted: dict
) -> list[str]:
    """Print the comparison; return what left its tolerance. Steps past `horizon` are shown, not judged:
    rounding differences grow through training (Adam divides by sqrt(v), spikes amplify), so two
    trainers that agree to 1e-7 on every early step part ways later, as each does from itself started one ulp
    away (`parted`); then the held-out figures judge."""
    failures = report_steps(table, horizon, parted)
    failures += report_held_out(evals, noise, learned=horizon < len(table))
    return failures + report_same_weights(checks)


def report_steps(table: list[dict], horizon: int, parted: dict) -> list[str]:
    """Each step side by side; the steps through `horizon` that left their tolerance."""
    print(
        f"{'step':>4} {'batch hash':>17} {'lr ours':>10} {'lr OC':>10} {'loss ours':>11} {'loss OC':>11} "
        f"{'rel':>8} {'|g| ours':>10} {'|g| OC':>10} {'rel':>8} {'skip':>5} {'filtered':>8}"
    )
    for r in table:
        o, t = r["ours"], r["olmo_core"]
        print(
            f"{r['step']:>4} {data.format_hash(t['hash'])}{'=' if r['hash_equal'] else '!'} "
            f"{o['lr']:10.4e} {t['lr'][0]:10.4e} {o['loss']:11.7f} {t['loss']:11.7f} {r['loss_rel']:8.1e} "
            f"{o['grad_norm']:10.6f} {t['grad_norm']:10.6f} {r['grad_norm_rel']:8.1e} "
            f"{'yes' if o['skipped'] else 'no':>4}{'' if r['skipped_equal'] else '!'} "
            f"{o['filtered']:>8}{'' if r['filtered_equal'] else '!'}"
            + (f"  <- {', '.join(r['failed'])}" if r["failed"] else "")
        )
    judged = table[:horizon]
    first_out = next((r["step"] for r in table if r["failed"]), None)
    if cost := judged[-1]["bf16_cost"]:
        print(
            f"bf16: each side in bf16 against itself in fp32 differed by up to {cost['loss']:.1e} in loss and "
            f"{cost['grad_norm']:.1e} in grad norm through step {len(judged)}; the two bf16 trainers may differ "
            f"by {BF16_BOUND:g} times what bf16 had cost either through each step"
        )
    print(
        f"steps 1-{len(judged)}: max relative difference loss {max(r['loss_rel'] for r in judged):.1e} "
        f"(tolerance {TOLERANCE['loss']:.0e}), grad norm {max(r['grad_norm_rel'] for r in judged):.1e} "
        f"(tolerance {TOLERANCE['grad_norm']:.0e}); first step out of tolerance: {first_out or 'none'}; "
        f"batches {'all' if all(r['hash_equal'] for r in table) else 'NOT all'} equal"
    )
    print(
        f"first step whose loss differs by more than {TOLERANCE['loss']:.0e}: "
        + "; ".join(f"{pair} {step or 'none'}" for pair, step in parted.items())
    )
    return [f"step {r['step']}: {', '.join(r['failed'])}" for r in judged if r["failed"]]


def report_held_out(evals: list[dict], noise: list[dict], learned: bool) -> list[str]:
    """The held-out figures; what left its bar. Once the two runs have parted (`learned`), the trained
    models are judged by each trainer's mean held-out loss over its runs, not token by token."""
    failures = []
    for e, n in itertools.zip_longest(evals, noise):
        fp32, where = e["fp32"], f"{e['text']} at {e['length']}"
        print(comparison(f"{e['text']}, OLMo-core vs ours fp32", fp32))
        print(comparison(f"{e['text']}, OLMo-core vs ours bf16", e["bf16"]))
        for who in ("olmo_core", "ours") if n else ():
            for d, r in zip(n["nudges"], n[who]):
                print(comparison(f"  noise, OLMo-core vs {who.replace('_', '-')} from weights {d:+d} ulp", r))
        if learned:
            apart = e["runs_apart"]
            print(
                f"held-out loss, {where} over {len(apart['olmo_core'])} + {len(apart['ours'])} runs: "
                f"OLMo-core {np.mean(apart['olmo_core']):.6f} (sd {apart['sd_olmo_core']:.1e}), ours "
                f"{np.mean(apart['ours']):.6f} (sd {apart['sd_ours']:.1e}); ours - OLMo-core "
                f"{apart['diff']:+.1e} nats, standard error {apart['se']:.1e}"
                + (f", Welch's t-test p = {apart['p']:.2f}" if apart["p"] is not None else "")
            )
            if e["bar"] and abs(apart["diff"]) > TOLERANCE["learned_loss_nats"]:
                failures.append(f"held-out loss, {where}: {apart['diff']:+.1e} nats")
            if apart["p"] is not None and apart["p"] < 0.05:
                failures.append(
                    f"held-out loss, {where}: {apart['diff']:+.1e} nats, beyond the runs' own spread "
                    f"(Welch's p = {apart['p']:.3f})"
                )
            continue
        if (loss_rel := rel(fp32["cand_loss"], fp32["ref_loss"])) > TOLERANCE["held_out_loss"]:
            failures.append(f"held-out loss, {where}: rel {loss_rel:.1e}")
        top1, token_loss = bars_within_noise(n)
        if (decided := compare.agreement_beyond(fp32, token_loss)) < top1:
            failures.append(
                f"fp32 top-1 agreement, {where}: {fp32['top1']:.4%}, {decided:.4%} near-ties within "
                f"{2 * token_loss:.1e} nats aside (bar {top1:.4%})"
            )
        if fp32["max_token_loss_diff"] > token_loss:
            failures.append(f"a held-out token's loss, {where}: {fp32['max_token_loss_diff']:.1e} nats")
    return failures


def report_same_weights(checks: list[dict]) -> list[str]:
    """Our trained weights through transformers against ours; what left its bar."""
    failures = []
    for c in checks:
        print(comparison(f"{c['text']}, same weights, transformers vs ours fp32", c["fp32"]))
        print(comparison(f"{c['text']}, same weights, transformers vs ours bf16", c["bf16"]))
        if (
            compare.agreement_beyond(c["fp32"], TOLERANCE["token_loss_fp32"]) < TOLERANCE["top1_fp32"]
            or c["fp32"]["max_token_loss_diff"] > TOLERANCE["token_loss_fp32"]
        ):
            failures.append(
                f"same weights, {c['text']} at {c['length']}: top-1 {c['fp32']['top1']:.4%}, "
                f"{c['fp32']['max_token_loss_diff']:.1e} nats"
            )
    # The public figure: bf16 against fp32, at the long context, on a model that has learned (one that predicts
    # a handful of tokens has near-ties everywhere, and bf16 rounding tips them).
    learned_model = checks and checks[-1]["fp32"]["distinct_top1"] >= LEARNED_DISTINCT
    if learned_model and checks[-1]["bf16"]["top1"] < PUBLIC_TOP1:
        failures.append(
            f"same weights, bf16 top-1 at {checks[-1]['length']}: {checks[-1]['bf16']['top1']:.4%}"
        )
    if checks:
        print(
            f"(the public JAX reproduction: top-1 {PUBLIC_TOP1:.2%} at 8192 tokens, its bf16 against PyTorch)"
        )
    return failures


def bars_within_noise(noise: dict | None) -> tuple[float, float]:
    """The bars for two trainings that have not parted: fp32 top-1 agreement and any one token's loss
    difference, each the fixed tolerance or, if OLMo-core from nudged weights (--noise) agrees with itself
    less closely, that. On a model that has learned little, a few predictions are near-ties, and which way one
    falls turns on the last bit, in OLMo-core's own runs as in ours (and differs between CPUs and XLA's code
    generators): the top-1 bar counts only the disagreements the token-loss bar cannot explain
    (compare.agreement_beyond)."""
    own = noise["olmo_core"] if noise else []
    top1 = min([TOLERANCE["top1_fp32"], *(r["top1"] for r in own)])
    return top1, max([TOLERANCE["token_loss_fp32"], *(r["max_token_loss_diff"] for r in own)])


def plot(table: list[dict], nudged_rows, path: Path):
    """Both runs' train loss, and per step their relative difference beside that of OLMo-core against itself
    from weights a few ulps apart (grey, when --noise ran): where ours parts from the reference, so does it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in table]
    marker = "o-" if len(table) <= 100 else "-"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    top.plot(steps, [r["olmo_core"]["loss"] for r in table], marker, ms=3, lw=1, label="OLMo-core (PyTorch)")
    top.plot(steps, [r["ours"]["loss"] for r in table], "--", lw=1, label="olmo3-jax")
    top.set(ylabel="train loss (CE + z-loss)", title="the same weights, batches and recipe (fp32, CPU)")
    top.legend()
    for k, rows in enumerate(nudged_rows):
        noise = [max(rel(n["loss"], r["olmo_core"]["loss"]), 1e-8) for n, r in zip(rows, table)]
        bottom.semilogy(
            steps, noise, "-", color="0.6", lw=0.6, label="loss, OLMo-core vs itself" if not k else None
        )
    for key, style in [("loss", ":"), ("grad_norm", "-.")]:
        (line,) = bottom.semilogy(
            steps,
            [max(r[f"{key}_rel"], 1e-8) for r in table],
            ".-" if len(table) <= 100 else "-",
            lw=0.6,
            label=key.replace("_", " "),
        )
        bottom.axhline(TOLERANCE[key], color=line.get_color(), ls=style, lw=0.8)  # its tolerance
    bottom.set(xlabel="step", ylabel="relative difference\n(0 drawn at 1e-8)")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--out", default="runs/reference", help="token files, both runs' files, JSON and plot")
    p.add_argument("--seq_len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="instances per step (the global batch)")
    p.add_argument("--window", type=int, default=64, help="keys a sliding layer sees; shorter than seq_len")
    p.add_argument("--layers", type=int, default=8, help="two [S,S,S,F] groups, so our layer scan loops")
    p.add_argument("--kv_heads", type=int, default=4, help="for olmo3_14M's 8 query heads: grouped-query")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument(
        "--warmup", type=int, default=10, help="linear warmup steps; then cosine to lr/10 at --steps"
    )
    p.add_argument(
        "--lr_final",
        type=float,
        default=0.1,
        help="the cosine ends at lr * this (0.1 in stage 1; 0 anneals, as OLMo 3's later stages do)",
    )
    p.add_argument(
        "--skip_window",
        type=int,
        default=16,
        help="steps of SkipStep history (128 in the recipe), so the spike rule is on from step 8",
    )
    p.add_argument("--seed", type=int, default=train.TrainConfig.seed, help="the data order")
    p.add_argument(
        "--tokenizer",
        choices=["dolma2", "tiny"],
        default="dolma2",
        help="the corpus's ids and the model's vocabulary: OLMo 3's, or the tiny preset's 8192 (faster to learn)",
    )
    p.add_argument(
        "--repeat_filter",
        type=int,
        default=0,
        help="the 32B's instance filter on both sides (32), over a corpus with planted repeats; 0: off",
    )
    return judging_flags(p)


def judging_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags for what is read after training and how the two sides are judged."""
    p.add_argument(
        "--eval_tokens", type=int, default=8192, help="held-out tokens at the training context (0: no eval)"
    )
    p.add_argument(
        "--eval_len",
        type=int,
        default=0,
        help="the long context, one sequence; 0: the public figure's 8192 where the held-out text allows",
    )
    p.add_argument(
        "--ours",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="set a TrainConfig field on our side only, e.g. z_loss=2e-5 (a deliberate mismatch)",
    )
    p.add_argument(
        "--horizon", type=int, default=0, help="judge each step's figures through this step (0: all)"
    )
    p.add_argument(
        "--noise",
        type=int,
        default=0,
        choices=range(len(NUDGES) + 1),
        metavar="N",
        help=f"train each side N more times, from initial weights nudged {NUDGES[:2]}... ulps: its own noise",
    )
    p.add_argument("--check_weights", action="store_true", help="also our weights through transformers")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="both trainers compute in bf16 (see BF16); each step judged against what bf16 costs OLMo-core",
    )
    p.add_argument(
        "--torch_cpu_norm",
        action="store_true",
        help="let OLMo-core clip with torch's inexact CPU grad norm (see olmo_core_run)",
    )
    return p


def noise_runs(args, files, out: Path, tok: data.Tokenizer, reference, sets, our_rows, their_rows, parted):
    """Each trainer again from initial weights a few ulps away: draws of its own noise. Returns the held-out
    noise per set and both sides' per-step rows; `parted` gains when each run parted from its own."""
    nudges = NUDGES[: args.noise]
    nudged_theirs, nudged_rows = zip(*(olmo_core_run(args, files, out, tok, nudge=d) for d in nudges))
    nudged_ours, nudged_our_rows = zip(*(our_run(args, files, out, nudge=d) for d in nudges))
    for d, t_rows, o_rows in zip(nudges, nudged_rows, nudged_our_rows):
        parted[f"OLMo-core {d:+d} ulp vs OLMo-core"] = parting(t_rows, their_rows)
        parted[f"ours {d:+d} ulp vs ours"] = parting(o_rows, our_rows)
    noise = [noise_floor(reference, nudges, nudged_theirs, nudged_ours, s) for s in sets]
    return noise, nudged_rows, nudged_our_rows


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds, start = {}, time.perf_counter()

    def lap(name):
        nonlocal start
        seconds[name], start = time.perf_counter() - start, time.perf_counter()

    repeats_in = args.seq_len if args.repeat_filter else 0
    tok = get_tokenizer(args.tokenizer, out)
    corpus = out / (f"{tok.name}-repeats{args.seq_len}" if repeats_in else tok.name)
    files = write_corpus(corpus, tok, repeats_in)
    theirs, their_rows = olmo_core_run(args, files, out, tok)
    in_fp32 = argparse.Namespace(**vars(args) | {"bf16": False})  # --bf16: each side again in fp32
    their_fp32 = olmo_core_run(in_fp32, files, out / "fp32", tok)[1] if args.bf16 else None
    lap("olmo_core")
    ours, our_rows = our_run(args, files, out)
    our_fp32 = our_run(in_fp32, files, out)[1] if args.bf16 else None
    lap("ours")
    table = compare_steps(our_rows, their_rows, (our_fp32, their_fp32) if args.bf16 else None)
    sets = held_out_sets(args, files, out, ours.cfg.vocab_size) if args.eval_tokens else []
    reference = cached(olmo_core_side(theirs))  # OLMo-core's trained model, read against every candidate
    evals = [held_out(ours, reference, s) for s in sets]
    lap("held_out")
    noise, nudged_rows, nudged_our_rows = [], [], []
    parted = {"ours vs OLMo-core": parting(our_rows, their_rows)}
    if args.noise:
        noise, nudged_rows, nudged_our_rows = noise_runs(
            args, files, out, tok, reference, sets, our_rows, their_rows, parted
        )
        lap("noise")
    for e, n in itertools.zip_longest(evals, noise):  # each trainer's mean over its runs, and the gap
        e["runs_apart"] = runs_apart(e, n)
    checks = []
    if args.check_weights:
        shutil.rmtree(out / "ours-hf", ignore_errors=True)
        ckpt.save_hf(ours, out / "ours-hf")
        checks = same_weights(out / "ours-hf", sets)
        lap("same_weights")

    failures = report(table, evals, args.horizon or args.steps, noise, checks, parted)
    plot(table, nudged_rows, out / "reference_loss.png")
    versions = {k: metadata.version(k) for k in ("jax", "equinox", "torch", "ai2-olmo-core")}
    noise_steps = {"olmo_core": nudged_rows, "ours": nudged_our_rows}
    result = dict(args=vars(args), tolerance=TOLERANCE, steps=table, held_out=evals, noise=noise)
    result |= dict(parted=parted, noise_steps=noise_steps, same_weights=checks, failures=failures)
    result |= dict(seconds=seconds, versions=versions)
    (out / "reference.json").write_text(json.dumps(result, indent=1))
    print(
        "seconds: "
        + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
        + f"; wrote {out / 'reference.json'} and {out / 'reference_loss.png'}"
    )
    print("FAILED: " + "; ".join(failures) if failures else "all figures within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    shard.quiet_libtpu()  # the test extra installs libtpu; with no TPU here it would fill the log
    sys.exit(main())
