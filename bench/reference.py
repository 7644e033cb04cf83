"""Reproduce OLMo-core step by step: the same initial weights, the same batches, the same losses.

    python bench/reference.py --steps 50    # ~8 min on 2 idle CPU cores; table, loss plot, JSON in --out
    python bench/reference.py --steps 6 --batch 2 --seq_len 64 --window 16 --warmup 2 --skip_window 4 \
        --eval_tokens 512 --eval_len 256    # the size tests/test_reference.py runs, ~45 s

OLMo-core (ai2-olmo-core, PyTorch, fp32 on the CPU) trains `TransformerConfig.olmo3_14M` at dolma2's
vocabulary through its own Trainer: NumpyFSLDataLoader over the token files written here,
TransformerTrainModule (loss, z-loss, clipping), SkipStepAdamW and CosWithWarmup, configured as the official
stage-1 script, scaled down. One thing is swapped in: the grad norm it clips with, which torch computes
inexactly on a CPU (see olmo_core_run; --torch_cpu_norm keeps torch's). Its initial weights reach us through
its own HF exporter and ckpt.load_hf; we train with train.train_step on data.TokenLoader batches.

Compared per step: the hash of the batch each side trained on, LR, loss (CE + z-loss), grad norm and skip. At
the end, on held-out text, at the training context and at a long one: the loss, each token's loss, and top-1
next-token agreement of the two trained models, ours computing in fp32 and in bf16. Exit 1 if a figure leaves
its tolerance. `--ours FIELD=VALUE` sets a TrainConfig field on our side only: a deliberate mismatch, which the
test uses to check that one is caught.
"""

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import torch
from olmo_core.data import InstanceFilterConfig, NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.data.utils import get_labels
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


def write_corpus(folder: Path, repeats_in: int = 0) -> dict[str, list[str]]:
    """The tiny corpus (38 plays, 3 held out) tokenized with dolma2: one uint32 OLMo token file per play.
    `repeats_in` (a sequence length): each training play also holds, per 8 instances of that length, a run of
    a few tokens repeated 40 times, short enough to fit one instance, which the repeat filter drops."""
    tok, rng = data.get_tokenizer("dolma2"), np.random.default_rng(0)
    files = {}
    for split, plays in data.tiny_plays().items():
        (folder / split).mkdir(parents=True, exist_ok=True)
        files[split] = [str(folder / split / f"{k:03d}.npy") for k in range(len(plays))]
        for path, ids in zip(files[split], tok.encode_batch(plays)):
            ids = np.asarray([*ids, tok.eos_id], np.uint32)  # a document ends with EOS, as OLMo's do
            for _ in range(len(ids) // (8 * repeats_in) if repeats_in and split == "train" else 0):
                period = int(rng.integers(1, max(2, min(14, repeats_in // 40))))
                run = np.tile(rng.integers(0, tok.vocab_size, period), 40).astype(np.uint32)
                at = int(rng.integers(0, len(ids) - len(run)))
                ids[at : at + len(run)] = run
            ids.tofile(path)
    return files


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
        if step == 0:  # the trainer's dry-run batch, which trains nothing
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


def olmo_core_run(args, files, out: Path, nudge: bool = False):
    """OLMo-core's stage-1 recipe (OLMo-3-1025-7B-pretrain-1.py, scaled down): its trained model and records.
    `nudge`: every initial weight moved by one ulp, the reference's own run-to-run noise."""
    tokenizer = TokenizerConfig.dolma2()
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
    module = TransformerTrainModuleConfig(
        rank_microbatch_size=tokens,
        max_sequence_length=args.seq_len,
        optim=optim,
        z_loss_multiplier=1e-5,
        max_grad_norm=1.0,
        scheduler=CosWithWarmup(warmup=args.warmup, alpha_f=0.1, t_max=args.steps),
    ).build(model, device=torch.device("cpu"))  # this initialises the weights (init_seed 0)
    if nudge:
        with torch.no_grad():
            for p in module.model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
        out = out / "nudged"
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


def our_run(args, files, out: Path):
    """train.py's step on data.py's batches from OLMo-core's initial weights: our trained model and records."""
    model = ckpt.load_hf(out / "init-hf", compute=olmo3.Compute(dtype="float32", attention="reference"))
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
        steps=args.steps,
        skip_window=args.skip_window,
        repeat_filter=args.repeat_filter,
    )
    for override in args.ours:
        name, value = override.split("=", 1)
        cfg = train.with_flag(cfg, name, train.flags()[name][0].type(value))
    loader = data.TokenLoader(
        files["train"],
        cfg.seq_len,
        cfg.global_batch,
        seed=cfg.seed,
        dtype=np.uint32,
        vocab_size=model.cfg.vocab_size,
        work_dir=str(out / "ours-work"),
    )
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
        progress("ours", step, args.steps, rows[-1]["loss"])
    return model, rows


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def compare_steps(ours: list[dict], theirs: list[dict]) -> list[dict]:
    table = []
    for step, (o, t) in enumerate(zip(ours, theirs), 1):
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
        }
        checks = {
            "batch": r["hash_equal"],
            "lr": r["lr_equal"],
            "loss": r["loss_rel"] <= TOLERANCE["loss"],
            "grad_norm": r["grad_norm_rel"] <= TOLERANCE["grad_norm"],
            "skipped": r["skipped_equal"],
            "filtered": r["filtered_equal"],
        }
        r["failed"] = [name for name, ok in checks.items() if not ok]
        table.append(r)
    return table


@eqx.filter_jit
def our_predictions(model, tokens, vocab: int):
    """Top-1 next token among the tokenizer's ids, and the CE of each position that has a next token."""
    logits = model(tokens)
    ce, _ = train.cross_entropy(logits, jnp.roll(tokens, -1))
    return jnp.argmax(logits[:, :vocab], axis=-1), ce[:-1]


@torch.no_grad()
def olmo_core_predictions(model, tokens: np.ndarray, vocab: int):
    ids = torch.as_tensor(tokens.astype(np.int64))[None]
    out = model(ids, labels=get_labels({"input_ids": ids}), loss_reduction="none", return_logits=True)
    return out.logits[0, :, :vocab].argmax(-1).numpy(), out.ce_loss.reshape(-1)[:-1].numpy()


def held_out(ours, theirs, files, length: int, n_tokens: int) -> dict:
    """Held-out loss and top-1 agreement on sequences of `length`, with ours computing in fp32 and in bf16."""
    loader = data.TokenLoader(files["val"], length, 1, dtype=np.uint32)
    sequences = [loader.instance(j) for j in range(min(max(1, n_tokens // length), loader.num_instances))]
    vocab = data.get_tokenizer("dolma2").vocab_size  # no text ever continues with one of the 74 padding ids
    bf16 = ours.using(dataclasses.replace(ours.compute, dtype="bfloat16"))
    top1, ce = map(np.concatenate, zip(*(olmo_core_predictions(theirs, s, vocab) for s in sequences)))
    result = {
        "length": length,
        "sequences": len(sequences),
        "olmo_core_loss": float(ce.mean(dtype=np.float64)),
        "distinct_top1": len(np.unique(top1)),
    }  # how varied the predictions compared are
    for name, model in {"fp32": ours, "bf16": bf16}.items():
        our_top1, our_ce = map(
            np.concatenate,
            zip(
                *(jax.device_get(our_predictions(model, jnp.asarray(s, jnp.int32), vocab)) for s in sequences)
            ),
        )
        result[f"{name}_loss"] = float(our_ce.mean(dtype=np.float64))
        # Per position, the two models' -log p(next token): agreement of whole distributions, which stays
        # informative when a barely trained model predicts the same token everywhere.
        result[f"{name}_token_loss_diff"] = float(np.abs(our_ce - ce).max())
        result[f"{name}_top1"] = float(np.mean(our_top1 == top1))
    return result


def noise_floor(theirs, nudged, files, length: int, n_tokens: int) -> dict:
    """OLMo-core against itself from initial weights one ulp apart: the spread any reimplementation's
    difference is to be read against."""
    loader = data.TokenLoader(files["val"], length, 1, dtype=np.uint32)
    sequences = [loader.instance(j) for j in range(min(max(1, n_tokens // length), loader.num_instances))]
    vocab = data.get_tokenizer("dolma2").vocab_size
    (a_top1, a_ce), (b_top1, b_ce) = (
        map(np.concatenate, zip(*(olmo_core_predictions(m, s, vocab) for s in sequences)))
        for m in (theirs, nudged)
    )
    return {
        "length": length,
        "loss": float(a_ce.mean(dtype=np.float64)),
        "nudged_loss": float(b_ce.mean(dtype=np.float64)),
        "top1": float(np.mean(a_top1 == b_top1)),
        "token_loss_diff": float(np.abs(a_ce - b_ce).max()),
    }


def same_weights(ours, files, out: Path, lengths, n_tokens: int) -> list[dict]:
    """Our trained weights through our model and through transformers (the checker, `ckpt.py compare`)."""
    shutil.rmtree(out / "ours-hf", ignore_errors=True)
    ckpt.save_hf(ours, out / "ours-hf")
    sides = [ckpt.side(str(out / "ours-hf")), ckpt.side(f"transformers:{out / 'ours-hf'}")]
    return [ckpt.compare(*sides, files["val"], n, n_tokens) for n in lengths]


def report(
    table: list[dict], evals: list[dict], horizon: int, noise: list[dict], checks: list[dict]
) -> list[str]:
    """Print the comparison; return what left its tolerance. Steps past `horizon` are shown, not judged:
    rounding differences grow through training (Adam divides by sqrt(v), spikes amplify), so two
    trainers that agree to 1e-7 on every early step part ways later; then the held-out figures judge."""
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
    print(
        f"steps 1-{len(judged)}: max relative difference loss {max(r['loss_rel'] for r in judged):.1e} "
        f"(tolerance {TOLERANCE['loss']:.0e}), grad norm {max(r['grad_norm_rel'] for r in judged):.1e} "
        f"(tolerance {TOLERANCE['grad_norm']:.0e}); first step out of tolerance: {first_out or 'none'}; "
        f"batches {'all' if all(r['hash_equal'] for r in table) else 'NOT all'} equal"
    )
    failures = [f"step {r['step']}: {', '.join(r['failed'])}" for r in judged if r["failed"]]
    learned = horizon < len(table)  # the two runs have parted: judge the trained models, not each step
    for e, n in itertools.zip_longest(evals, noise):
        loss_rel = rel(e["fp32_loss"], e["olmo_core_loss"])
        print(
            f"held out, {e['sequences']} x {e['length']} tokens: loss OLMo-core {e['olmo_core_loss']:.6f}, "
            f"ours fp32 {e['fp32_loss']:.6f} (rel {loss_rel:.1e}), bf16 {e['bf16_loss']:.6f}; per-token loss "
            f"max |diff| fp32 {e['fp32_token_loss_diff']:.1e}, bf16 {e['bf16_token_loss_diff']:.1e} nats; "
            f"top-1 agreement fp32 {e['fp32_top1']:.4%}, bf16 {e['bf16_top1']:.4%} over "
            f"{e['distinct_top1']} distinct predicted tokens (public JAX reproduction: {PUBLIC_TOP1:.2%} at 8192)"
        )
        if n:
            print(
                f"  noise: OLMo-core vs itself from weights one ulp apart: loss {n['loss']:.6f} vs "
                f"{n['nudged_loss']:.6f} (|diff| {abs(n['loss'] - n['nudged_loss']):.1e}; ours vs OLMo-core "
                f"{abs(e['fp32_loss'] - e['olmo_core_loss']):.1e}), top-1 {n['top1']:.4%}, max token |diff| "
                f"{n['token_loss_diff']:.1e}"
            )
        if learned:
            if abs(e["fp32_loss"] - e["olmo_core_loss"]) > TOLERANCE["learned_loss_nats"]:
                failures.append(
                    f"held-out loss at {e['length']}: {abs(e['fp32_loss'] - e['olmo_core_loss']):.1e} nats"
                )
            continue
        if loss_rel > TOLERANCE["held_out_loss"]:
            failures.append(f"held-out loss at {e['length']} tokens: rel {loss_rel:.1e}")
        if e["fp32_top1"] < TOLERANCE["top1_fp32"]:
            failures.append(f"fp32 top-1 agreement at {e['length']} tokens: {e['fp32_top1']:.4%}")
        if e["fp32_token_loss_diff"] > TOLERANCE["token_loss_fp32"]:
            failures.append(
                f"a held-out token's loss at {e['length']} tokens: {e['fp32_token_loss_diff']:.1e} nats"
            )
    if learned and evals and evals[-1]["bf16_top1"] < PUBLIC_TOP1:
        failures.append(
            f"bf16 top-1 at {evals[-1]['length']}: {evals[-1]['bf16_top1']:.4%} < {PUBLIC_TOP1:.2%}"
        )
    for c in checks:
        print(
            f"same weights, ours vs transformers (fp32), {c['sequences']} x {c['length']}: top-1 {c['top1']:.4%}, "
            f"max token |diff| {c['max_token_loss_diff']:.1e} nats, mean KL {c['mean_kl']:.1e}"
        )
        if c["top1"] < TOLERANCE["top1_fp32"] or c["max_token_loss_diff"] > TOLERANCE["token_loss_fp32"]:
            failures.append(
                f"same weights at {c['length']}: top-1 {c['top1']:.4%}, {c['max_token_loss_diff']:.1e} nats"
            )
    return failures


def plot(table: list[dict], path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in table]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=[2, 1])
    top.plot(steps, [r["olmo_core"]["loss"] for r in table], "o-", ms=3, label="OLMo-core (PyTorch)")
    top.plot(steps, [r["ours"]["loss"] for r in table], "--", label="olmo3-jax")
    top.set(ylabel="train loss (CE + z-loss)", title="the same weights, batches and recipe (fp32, CPU)")
    top.legend()
    for key, style in [("loss", ":"), ("grad_norm", "-.")]:
        (line,) = bottom.semilogy(
            steps, [max(r[f"{key}_rel"], 1e-8) for r in table], ".-", lw=0.6, label=key.replace("_", " ")
        )
        bottom.axhline(TOLERANCE[key], color=line.get_color(), ls=style, lw=0.8)  # its tolerance
    bottom.set(xlabel="step", ylabel="relative difference\n(0 drawn at 1e-8)")
    bottom.legend()
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
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
        "--skip_window",
        type=int,
        default=16,
        help="steps of SkipStep history (128 in the recipe), so the spike rule is on from step 8",
    )
    p.add_argument("--seed", type=int, default=data.DEFAULT_SEED, help="the data order")
    p.add_argument(
        "--repeat_filter",
        type=int,
        default=0,
        help="the 32B's instance filter on both sides (32), over a corpus with planted repeats; 0: off",
    )
    p.add_argument("--eval_tokens", type=int, default=8192, help="held-out tokens per context (0: no eval)")
    p.add_argument("--eval_len", type=int, default=8192, help="the long context (the public figure's)")
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
        "--noise", action="store_true", help="also OLMo-core from weights one ulp apart: its noise"
    )
    p.add_argument("--check_weights", action="store_true", help="also our weights through transformers")
    p.add_argument(
        "--torch_cpu_norm",
        action="store_true",
        help="let OLMo-core clip with torch's inexact CPU grad norm (see olmo_core_run)",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seconds, start = {}, time.perf_counter()

    def lap(name):
        nonlocal start
        seconds[name], start = time.perf_counter() - start, time.perf_counter()

    repeats_in = args.seq_len if args.repeat_filter else 0
    files = write_corpus(out / (f"dolma2-repeats{args.seq_len}" if repeats_in else "dolma2"), repeats_in)
    theirs, their_rows = olmo_core_run(args, files, out)
    lap("olmo_core")
    ours, our_rows = our_run(args, files, out)
    lap("ours")
    table = compare_steps(our_rows, their_rows)
    lengths = list(dict.fromkeys([args.seq_len, args.eval_len])) if args.eval_tokens else []
    evals = [held_out(ours, theirs, files, n, args.eval_tokens) for n in lengths]
    lap("held_out")
    noise = []
    if args.noise:
        nudged, _ = olmo_core_run(args, files, out, nudge=True)
        noise = [noise_floor(theirs, nudged, files, n, args.eval_tokens) for n in lengths]
        lap("noise")
    checks = same_weights(ours, files, out, lengths, args.eval_tokens) if args.check_weights else []
    lap("same_weights")

    failures = report(table, evals, args.horizon or args.steps, noise, checks)
    plot(table, out / "reference_loss.png")
    versions = {k: metadata.version(k) for k in ("jax", "equinox", "torch", "ai2-olmo-core")}
    result = {
        "args": vars(args),
        "tolerance": TOLERANCE,
        "steps": table,
        "held_out": evals,
        "noise": noise,
        "same_weights": checks,
        "failures": failures,
        "seconds": seconds,
        "versions": versions,
    }
    (out / "reference.json").write_text(json.dumps(result, indent=1))
    print(
        "seconds: "
        + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items())
        + f"; wrote {out / 'reference.json'} and {out / 'reference_loss.png'}"
    )
    print("FAILED: " + "; ".join(failures) if failures else "all figures within tolerance")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
