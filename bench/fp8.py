"""What FP8 training costs: stage 3 scaled down to the tiny model, run three ways from one start, in fp32, in bf16
and in bf16 with `--fp8 tensorwise` (the 7b-long-context preset's policy: every block linear as torchao's
Float8Linear computes it). Each run: its train loss over its last steps, how far its loss strays step by step
from the bf16 run's, its speed, and its final weights read in fp32 on the tiny corpus's held-out plays against
the bf16 run's weights (bench/compare.py: held-out loss, top-1 agreement, KL).

    python train.py --preset tiny --run_dir runs/tiny    # a stage 1 to go on from (optional: else a fresh init)
    python bench/fp8.py --init_from runs/tiny            # three runs of 60 steps of 4 x 1,024 tokens
    python bench/fp8.py --steps 20 --seq_len 512 --global_batch 2 --lr 2e-3 --held_out 512   # tests/test_fp8.py

Stage 3 scaled down: the tiny corpus's plays cut into documents of 20 to 400 tokens in 4 files, packed best-fit
into rows within groups of 2 files shuffled with seed 123 (`--pack_files 2 --file_seed 123`), YaRN on the full
layers by seq_len / 256 (the tiny model's context), the LR linear to 0 after a warmup of a tenth of the steps.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import compare  # noqa: E402

import data  # noqa: E402
import shard  # noqa: E402

POLICIES = {  # name: the compute policy's flags
    "fp32": ["--dtype", "float32"],
    "bf16": ["--dtype", "bfloat16"],
    "bf16 + fp8": ["--dtype", "bfloat16", "--fp8", "tensorwise"],
}


def documents(train_file: str, out: Path, seed: int = 0) -> str:
    """The plays of `train_file` cut into documents of 20 to 400 tokens, each ending in EOS (id 0), in 4 files
    of a quarter of them each under `out`; returns their glob."""
    tokens, rng = np.fromfile(train_file, np.uint16), np.random.default_rng(seed)
    cuts = np.cumsum(rng.integers(20, 400, len(tokens) // 20))
    docs = [np.append(d[:-1], 0) for d in np.split(tokens, cuts[cuts < len(tokens)]) if len(d) > 1]
    for k, part in enumerate(np.array_split(np.arange(len(docs)), 4)):
        np.concatenate([docs[i] for i in part]).astype(np.uint16).tofile(out / f"{k}.npy")
    return str(out / "*.npy")


def train(args, files: str, run_dir: Path, policy: list[str]) -> list[dict]:
    """One stage-3 run through train.py; its metrics rows."""
    recipe = ["--preset", "tiny", "--data", files, "--seq_len", str(args.seq_len)]
    recipe += [
        "--global_batch",
        str(args.global_batch),
        "--steps",
        str(args.steps),
        "--lr_horizon",
        str(args.steps),
    ]
    recipe += ["--warmup_steps", str(max(1, args.steps // 10)), "--schedule", "linear", "--lr_final", "0"]
    recipe += ["--lr", str(args.lr), "--pack_files", "2", "--file_seed", "123"]
    recipe += ["--yarn", str(args.seq_len / 256)] if args.seq_len > 256 else []
    recipe += ["--init_from", args.init_from] if args.init_from else []
    run = ["--ckpt_every", str(args.steps), "--eval_every", str(10**9), "--samples", "0", "--mesh", "data=1"]
    # One CPU device; the caller's other XLA flags kept (the last of a repeated flag is the one XLA takes).
    one_device = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    env = dict(os.environ, XLA_FLAGS=one_device, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    cmd = [sys.executable, "train.py", *recipe, *policy, *run, "--run_dir", str(run_dir)]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [row for row in map(json.loads, lines) if "loss" in row]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--seq_len", type=int, default=1024)
    parser.add_argument("--global_batch", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--init_from", default="", help="where the three runs start (train.py --init_from)")
    parser.add_argument("--held_out", type=int, default=16384, help="held-out tokens read per run")
    parser.add_argument("--data_root", default=data.TINY_DIR, help="the tiny corpus (prepared if missing)")
    parser.add_argument("--json", default="", help="also write each policy's losses and reading here")
    args = parser.parse_args(argv)
    shard.quiet_libtpu()  # this process reads the runs on its CPU
    tiny = data.prepare_tiny(args.data_root)
    with tempfile.TemporaryDirectory() as work:
        files = documents(tiny["train"][0], Path(work))
        rows = {
            name: train(args, files, Path(work) / f"run-{k}", flags)
            for k, (name, flags) in enumerate(POLICIES.items())
        }
        sides = {name: compare.side(str(Path(work) / f"run-{k}")) for k, name in enumerate(POLICIES)}
        read = {
            name: compare.compare(sides["bf16"], side, tiny["val"], args.seq_len, args.held_out)
            for name, side in sides.items()
        }
    last = max(1, args.steps // 6)
    loss = {name: np.array([r["loss"] for r in rs]) for name, rs in rows.items()}
    print(
        f"stage 3 scaled down: tiny model, {args.steps} steps of {args.global_batch} x {args.seq_len} packed tokens"
        f"{', from ' + args.init_from if args.init_from else ''}; held-out: {read['bf16']['targets']} tokens\n"
        f"| policy | train loss, last {last} steps | mean abs Δ loss per step vs bf16 | held-out loss (read in fp32) "
        f"| top-1 agreement vs bf16 | mean KL vs bf16 | tokens/s |\n|---|---|---|---|---|---|---|"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({name: {"loss": loss[name].tolist(), **read[name]} for name in POLICIES})
        )
    for name in POLICIES:
        r = read[name]
        print(
            f"| {name} | {loss[name][-last:].mean():.4f} | {np.abs(loss[name] - loss['bf16']).mean():.4f} | "
            f"{r['cand_loss']:.4f} | {r['top1']:.2%} | {r['mean_kl']:.2e} | {rows[name][-1]['tokens_per_s']:,.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
