"""Two implementations (or precisions) of the same weights, read on the same held-out tokens: each side's
loss, and between them top-1 agreement, KL and the largest difference in one token's loss.

    python bench/compare.py REF CANDIDATE --data held-out/*.npy --seq_len 2048,8192

Each side is `[transformers:]PATH[:bf16]`: PATH a run directory (its newest valid checkpoint) or a Hugging Face
directory; `transformers:` reads it with transformers' Olmo3ForCausalLM (PyTorch, on the CPU) instead of our
model; `:bf16` computes in bfloat16. The limits (--min_top1, --max_kl, ...) make it a check: exit 1 past one.
bench/reference.py reads OLMo-core's trained model against ours with `compare`.
"""

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ckpt  # noqa: E402
import data  # noqa: E402
import olmo3  # noqa: E402
import shard  # noqa: E402
from olmo3 import Compute, Olmo3  # noqa: E402


def side(spec: str, attention: str = "reference"):
    """One side of a comparison, `[transformers:]PATH[:bf16]` with PATH a run directory (its newest valid
    checkpoint) or a Hugging Face directory: (vocab size, logits(tokens, chunk) -> each chunk's fp32
    logits). The features are computed once and the LM head a chunk of positions at a time, so a long
    context never holds its whole (positions x vocab) logits. Ours runs on every local device (a mesh whose
    tensor axis spans them); transformers' on the CPU."""
    engine, _, rest = spec.partition(":") if spec.startswith("transformers:") else ("ours", "", spec)
    path, _, dtype = rest.rpartition(":") if rest.endswith(":bf16") else (rest, "", "")
    if engine == "transformers":
        return transformers_side(path, dtype == "bf16")
    mesh = shard.make_mesh(f"tensor={len(jax.devices())}")
    compute = Compute(dtype="bfloat16" if dtype else "float32", attention=attention)
    return model_side(load(path, compute, mesh), mesh)  # local or gs://


def model_side(model: Olmo3, mesh):
    """A model in memory, its weights on `mesh`, as one side of a comparison (see side())."""

    def logits(tokens: np.ndarray, chunk: int):
        x = features(model, jnp.asarray(tokens, jnp.int32), mesh)
        for start in range(0, len(tokens), chunk):
            yield np.asarray(head(x[start : start + chunk], model.lm_head))[:, : model.cfg.vocab_size]

    return model.cfg.vocab_size, logits


# Jitted once for every side: a model of the same shapes and compute policy (another run's, another
# checkpoint's) reads a sequence of the same length with the program already built.
@eqx.filter_jit
def features(model: Olmo3, tokens, mesh):
    return model.features(tokens, shard.Layout(mesh))


@jax.jit
def head(x, w):
    return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32)


def load(path, compute: Compute, mesh) -> Olmo3:
    """The weights of a Hugging Face directory, or of a run's newest valid checkpoint (local or gs://),
    straight onto the mesh."""
    place = lambda model: shard.abstract(model, shard.shardings(model, mesh))
    if ckpt.format_of(path) != "run":  # a Hugging Face directory
        cfg = ckpt.read_hf_config(path)
        return ckpt.load_hf(path, shardings=shard.shardings(olmo3.abstract(cfg), mesh), compute=compute)
    ckpts = ckpt.Checkpoints(path, read_only=True)
    try:
        found = ckpts.newest_valid(lambda step: ckpts.read_model(step, place))
    finally:
        ckpts.close()
    if found is None:
        raise FileNotFoundError(f"{path}: no valid checkpoint, and not a Hugging Face directory")
    return found[1].using(compute)


def transformers_side(path: str, bf16: bool):
    """A Hugging Face directory (local or gs://) read by transformers' Olmo3ForCausalLM, as one side (see
    side()); transformers reads local files, so one in a bucket is copied to a temporary folder first."""
    import torch
    import transformers
    from transformers import Olmo3ForCausalLM

    if not data.exists(data.join(path, "config.json")):
        raise FileNotFoundError(
            f"{path}: transformers reads Hugging Face directories; export a run with "
            f"`python ckpt.py to-hf {path} OUT` first"
        )
    transformers.utils.logging.disable_progress_bar()
    dtype = torch.bfloat16 if bf16 else torch.float32
    with tempfile.TemporaryDirectory() as local:
        if data.is_url(path):
            data.copy_tree(path, local)
        folder = local if data.is_url(path) else path
        hf = Olmo3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="sdpa").eval()

    @torch.no_grad()
    def logits(tokens: np.ndarray, chunk: int):
        hidden = hf.model(input_ids=torch.as_tensor(tokens.astype(np.int64))[None]).last_hidden_state[0]
        for start in range(0, len(tokens), chunk):
            yield hf.lm_head(hidden[start : start + chunk]).float().numpy()

    return hf.config.vocab_size, logits


# Positions compared at a time. Each takes 8 bytes a vocabulary entry in each of a few float64 arrays: 32 of
# dolma2's 100,278 keep each array under 32 MiB, so malloc reuses its heap instead of mapping (and the kernel
# zeroing) fresh pages for every one. Measured on 2 cores, 512 positions of two sides' logits: 10.5 s in chunks
# of 256 (9.7 s of it in the kernel), 0.5 s in chunks of 32.
CHUNK = 32


def compare(ref, cand, files: list[str], length: int, n_tokens: int, chunk: int = CHUNK) -> dict:
    """Two sides' (see side()) next-token predictions over held-out sequences of `length` tokens, read in
    order: each side's mean loss, and between them top-1 agreement, how many distinct tokens the reference
    predicts, KL(ref || cand) per position (mean, max) and the largest difference in one token's loss; and where
    the two predict different tokens, by how much the reference prefers its own (`disagreement_gaps`, nats:
    near-ties, see agreement_beyond)."""
    (vocab, ref_logits), (cand_vocab, cand_logits) = ref, cand
    if vocab != cand_vocab:
        raise ValueError(f"the two sides' vocabularies differ ({vocab}, {cand_vocab}): not the same model")
    loader = data.TokenLoader(files, length, 1, dtype=data.dtype_for_vocab(vocab), vocab_size=vocab)
    totals = dict(ref_loss=0.0, cand_loss=0.0, agree=0, kl=0.0, max_kl=0.0, max_loss_diff=0.0, n=0)
    predicted, gaps = set(), []
    for j in range(min(loader.num_instances, max(1, n_tokens // length))):
        tokens = loader.instance(j)
        for start, (a, b) in zip(
            range(0, length, chunk), zip(ref_logits(tokens, chunk), cand_logits(tokens, chunk))
        ):
            a, b, targets = (
                a[: length - 1 - start],
                b[: length - 1 - start],
                tokens[start + 1 : start + chunk + 1],
            )
            (la, pa), (lb, _) = log_softmax(a), log_softmax(b)
            ce_a, ce_b = (
                -np.take_along_axis(x, targets[:, None].astype(np.int64), 1)[:, 0] for x in (la, lb)
            )
            kl = (pa * (la - lb)).sum(-1)
            totals["ref_loss"] += ce_a.sum()
            totals["cand_loss"] += ce_b.sum()
            top_a, top_b = a.argmax(-1), b.argmax(-1)
            totals["agree"] += int((top_a == top_b).sum())
            rows = np.flatnonzero(top_a != top_b)
            gaps += (la[rows, top_a[rows]] - la[rows, top_b[rows]]).tolist()
            totals["kl"] += kl.sum()
            totals["max_kl"] = max(totals["max_kl"], float(kl.max()))
            totals["max_loss_diff"] = max(totals["max_loss_diff"], float(np.abs(ce_a - ce_b).max()))
            totals["n"] += len(targets)
            predicted |= set(top_a.tolist())
    n = totals["n"]
    return dict(
        length=length,
        sequences=j + 1,
        targets=n,
        ref_loss=totals["ref_loss"] / n,
        cand_loss=totals["cand_loss"] / n,
        top1=totals["agree"] / n,
        disagreement_gaps=gaps,
        distinct_top1=len(predicted),
        mean_kl=totals["kl"] / n,
        max_kl=totals["max_kl"],
        max_token_loss_diff=totals["max_loss_diff"],
    )


def agreement_beyond(c: dict, token_loss: float) -> float:
    """Top-1 agreement of a compare() result, near-ties aside: where each token's log-probability may differ
    between the two sides by `token_loss` nats (the bar for any one token's loss), two tokens the reference
    ranks within 2 x token_loss of each other may swap places on the other side within that bar, so such a
    disagreement is rounding, not a difference. Only those the reference decides by more count against."""
    decided = sum(gap > 2 * token_loss for gap in c["disagreement_gaps"])
    return 1 - decided / c["targets"]


def log_softmax(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities and probabilities of logits `x` over the last axis, in float64 (a KL of 1e-10
    between two near-equal predictions needs it): one exp of the whole array, in place."""
    x = x.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    p = np.exp(x)
    total = p.sum(-1, keepdims=True)
    x -= np.log(total)
    p /= total
    return x, p


def positive(text: str) -> int:
    """A whole number of at least 1 (argparse names the flag when this refuses)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number of at least 1")
    return value


def lengths(text: str) -> list[int]:
    """--seq_len: context lengths, comma-separated, each at least 2 (one token to predict from, one to predict)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 2:
        raise argparse.ArgumentTypeError(f"{text!r}: expected context lengths of at least 2, e.g. 2048,8192")
    return values


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench/compare.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("ref", help="[transformers:]PATH[:bf16], PATH a run directory or an HF directory")
    parser.add_argument("candidate", help="the same form as ref")
    parser.add_argument("--data", required=True, help="held-out token files (comma-separated, globs allowed)")
    parser.add_argument("--seq_len", type=lengths, default="2048", help="context lengths, e.g. 2048,8192")
    parser.add_argument("--tokens", type=positive, default=16384, help="held-out tokens per length")
    parser.add_argument("--chunk", type=positive, default=CHUNK, help="positions per chunk of logits")
    parser.add_argument(
        "--attention", default="reference", help="our side's kernel (olmo3.ATTENTION_KERNELS)"
    )
    parser.add_argument("--min_top1", type=float, default=0.0, help="fail below this top-1 agreement")
    parser.add_argument(
        "--max_kl", type=float, default=float("inf"), help="fail past this KL at any position"
    )
    parser.add_argument(
        "--max_token_loss_diff", type=float, default=float("inf"), help="fail past this (nats)"
    )
    parser.add_argument(
        "--max_loss_diff", type=float, default=float("inf"), help="fail past this mean-loss gap"
    )
    return parser.parse_args(argv)


def past_limits(r: dict, length: int, args) -> list[str]:
    """The figures of one length's comparison `r` past the limits the command line set, each in words."""
    loss_diff = abs(r["ref_loss"] - r["cand_loss"])
    return [
        f"{name} at {length}: {value:.3g} (limit {limit:.3g})"
        for name, value, limit, bad in [
            ("top-1 agreement", r["top1"], args.min_top1, r["top1"] < args.min_top1),
            ("max KL", r["max_kl"], args.max_kl, r["max_kl"] > args.max_kl),
            (
                "max token loss difference",
                r["max_token_loss_diff"],
                args.max_token_loss_diff,
                r["max_token_loss_diff"] > args.max_token_loss_diff,
            ),
            ("mean loss difference", loss_diff, args.max_loss_diff, loss_diff > args.max_loss_diff),
        ]
        if bad
    ]


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    shard.quiet_libtpu()
    try:
        files, _, _ = data.resolve(args.data)
        print(f"ref {args.ref} vs candidate {args.candidate}, over held-out tokens of {args.data}")
        print(
            f"{'length':>7} {'seqs':>5} {'loss ref':>9} {'loss cand':>9} {'top-1':>8} {'distinct':>8} "
            f"{'mean KL':>9} {'max KL':>9} {'max |dloss|':>11}"
        )
        failed, sides = [], [side(args.ref, args.attention), side(args.candidate, args.attention)]
        for length in args.seq_len:
            r = compare(*sides, files, length, args.tokens, args.chunk)
            print(
                f"{length:>7} {r['sequences']:>5} {r['ref_loss']:9.5f} {r['cand_loss']:9.5f} {r['top1']:8.4%} "
                f"{r['distinct_top1']:>8} {r['mean_kl']:9.2e} {r['max_kl']:9.2e} {r['max_token_loss_diff']:11.2e}"
            )
            failed += past_limits(r, length, args)
    except (OSError, ValueError, ckpt.CorruptCheckpoint) as e:  # the message names the path and the fix
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(f"FAILED: {f}" for f in failed) or "within tolerances")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
