"""What a restart costs: the seconds from a train.py process's start to its first step's numbers, when it
resumes a run, with the compilation cache (--compile_cache) and without it.

    python bench/restart.py                        # tiny and 190m, each restart measured twice, the lower kept
    python bench/restart.py --presets tiny --repeats 1   # smallest: a check (about 3 minutes on 2 cores)

For each preset, a first start trains --steps 1 and saves it, with an empty cache: every program it compiles
is written there. Then restarts train step 2 (--steps 2 --allow_config_change), each stopped once its first
step's numbers are read (train.log_step's first call: nothing more is saved, so each restart resumes from the
same step 1). Each is timed from before its process starts (Python's imports, the devices, the data's plan,
the restore, the step's compile and its first run) to that moment; the last column is train.py's own line
for the step's compile (train.compiled_step: its seconds, and whether the cache held it). Restarts with:
  cache          the cache the first start filled: JAX keeps the programs that took 1 s or more to compile
                 (train.py keeps JAX's threshold);
  every program  a cache that keeps every program (JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0), filled by
                 a first start of its own, in a run directory of its own;
  no cache       --compile_cache ''.
The 190m preset runs at a CPU's size: 2 rows of 256 tokens, fp32, on the tiny corpus (its ids as uint32, its
EOS made dolma2's): the 190m's program, compiled for a batch this machine steps through in seconds. A CPU is
shared with whatever else runs, so each restart is measured --repeats times and the lowest kept; each try's
seconds are printed on stderr.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PRESETS = {
    "tiny": ["--preset", "tiny", "--samples", "0"],
    "190m": ["--preset", "190m", "--global_batch", "2", "--seq_len", "256", "--dtype", "float32"]
    + ["--tasks", "", "--eval_batches", "1"],  # its data: corpus_for_190m
}

CACHES = ("cache", "every program", "no cache")


def arguments():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--presets", default="tiny,190m")
    parser.add_argument("--repeats", type=int, default=2)
    return parser.parse_args()


class FirstStep(BaseException):
    """Raised from the first step's log_step: the restart has shown what it costs."""


def child(argv: list[str]) -> None:
    """train.py with `argv`, ended by FirstStep at its first step's numbers: then it prints the clock, and the
    programs compiled so far (JAX's events: each compile, whether the cache answered it, and their seconds)."""
    import jax

    import train

    compiled = dict(programs=0, hits=0, seconds=0.0)

    def count_compile(event: str, seconds: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # XLA's compile, or the cache's answer
            compiled["programs"] += 1
            compiled["seconds"] += seconds

    def count_hit(event: str, **_) -> None:
        compiled["hits"] += event == "/jax/compilation_cache/cache_hits"

    jax.monitoring.register_event_duration_secs_listener(count_compile)
    jax.monitoring.register_event_listener(count_hit)
    real_log_step = train.log_step

    def log_step(*args):
        real_log_step(*args)
        print(f"FIRST_STEP_AT {time.time()} {compiled['programs']} {compiled['hits']} {compiled['seconds']}")
        raise FirstStep

    train.log_step = log_step
    try:
        sys.exit(train.cli(argv))
    except FirstStep:
        sys.exit(0)


def timed(argv: list[str], env: dict | None = None) -> tuple[float, str, str]:
    """(seconds from before the process starts to its first step, the programs it compiled, the compile line's
    account of the step)."""
    start = time.time()
    cmd = [sys.executable, __file__, "--child", *argv]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    first = re.search(r"FIRST_STEP_AT ([\d.]+) (\d+) (\d+) ([\d.]+)", out.stdout)
    if out.returncode or not first:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    programs = f"{first[2]} ({first[3]}), {float(first[4]):.1f} s"
    step = re.search(r"compiled the step in ([\d.]+) s \((.*)\)", out.stdout)
    where = re.sub(r" (in )?/\S+", "", step[2])  # the cache's folder: a temporary one
    return float(first[1]) - start, programs, f"{step[1]} s, {where}"


def tiny_corpus(tmp: str) -> list[str]:
    """The tiny preset's corpus, prepared before any start is timed (a first start would prepare it)."""
    import data

    data.prepare_tiny(f"{tmp}/data")
    return ["--data_root", f"{tmp}/data"]


def corpus_for_190m(tmp: str) -> list[str]:
    """The tiny corpus as flags of the 190m preset: its ids as uint32, the tiny tokenizer's EOS made dolma2's
    (held-out documents end at the model's EOS), the held-out plays its --eval_data."""
    import numpy as np

    import data
    import olmo3

    prepared, eos = data.prepare_tiny(f"{tmp}/data"), olmo3.MODELS["tiny"].eos_token_id
    for split in ("train", "val"):
        ids = np.concatenate([np.fromfile(f, np.uint16) for f in prepared[split]]).astype(np.uint32)
        ids[ids == eos] = olmo3.MODELS["190m"].eos_token_id
        ids.tofile(f"{tmp}/190m-{split}.npy")
    return ["--data", f"{tmp}/190m-train.npy", "--eval_data", f"{tmp}/190m-val.npy"]


def measure(preset: str, repeats: int, tmp: str) -> list[tuple]:
    """The rows of one preset: the first start, then each kind of restart (CACHES), the lowest of `repeats`."""
    corpus = corpus_for_190m(tmp) if preset == "190m" else tiny_corpus(tmp)
    base = [*PRESETS[preset], *corpus, "--eval_every", "1000", "--ckpt_every", "1000"]
    caches = {"cache": f"{tmp}/{preset}-cache", "every program": f"{tmp}/{preset}-cache-all", "no cache": ""}
    runs = {"cache": f"{tmp}/{preset}-run", "every program": f"{tmp}/{preset}-run-all"}
    runs["no cache"] = runs["cache"]
    every_program = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    rows = []
    for kind in CACHES[:2]:  # the first starts, each filling its cache
        env = every_program if kind == "every program" else None
        argv = [*base, "--steps", "1", "--run_dir", runs[kind], "--compile_cache", caches[kind]]
        measured = timed(argv, env)
        if kind == "cache":
            rows.append((preset, "first start (empty cache)", *measured))
    for kind in CACHES:
        env = every_program if kind == "every program" else None
        argv = [*base, "--steps", "2", "--allow_config_change", "--run_dir", runs[kind]]
        tries = [timed([*argv, "--compile_cache", caches[kind]], env) for _ in range(repeats)]
        rows.append((preset, f"restart, {kind}", *min(tries)))
        print(f"{preset} restart, {kind}: {', '.join(f'{t[0]:.1f} s' for t in tries)}", file=sys.stderr)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["--child"]:  # one timed train.py, its flags after
        return child(sys.argv[2:])
    args = arguments()
    env = [k for k in os.environ if k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))]
    if env:
        sys.exit(f"unset {', '.join(env)}: this bench sets each train.py's compilation cache itself")
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for preset in args.presets.split(",") for row in measure(preset, args.repeats, tmp)]
    import jax

    print(f"jax {jax.__version__}, {os.cpu_count()} CPUs; lowest of {args.repeats} per restart")
    print(
        "| preset | start | to the first step | programs compiled (from the cache), their seconds | the step |"
    )
    print("|---|---|---:|---|---|")
    for preset, start, seconds, programs, step in rows:
        print(f"| {preset} | {start} | {seconds:.1f} s | {programs} | {step} |")


if __name__ == "__main__":
    main()
