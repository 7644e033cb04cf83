"""The project's commands as the tests run them: `python train.py ...` (through tests/faults.py, which can
inject a fault) and `python ckpt.py ...`, each in the test's own process where nothing needs a process of
its own (no fault, waited for, no environment of its own). That spares a command Python's and JAX's start
(imports, backend, for train.py the step's trace): about 5 of a warm tiny run's 9 seconds on 2 cores."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import ckpt
import data
import train

ROOT = Path(__file__).resolve().parent.parent


def train_py(argv, fault="none:0", *, env=None, wait=True, script="faults.py", timeout=600):
    """`python tests/<script> FAULT ARGV` (tests/faults.py: train.py with FAULT injected) in `env` (default:
    this process's), from the repository's root: a CompletedProcess, or with wait=False the Popen. Without a
    fault, script or environment of its own, and waited for: train.cli in this process, to the same effect."""
    argv = [str(a) for a in argv]
    if fault == "none:0" and wait and script == "faults.py" and env is None:
        return in_process(train.cli, argv)
    cmd = [sys.executable, str(ROOT / "tests" / script), fault, *argv]
    if not wait:
        pipe = subprocess.PIPE
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def ckpt_py(*args) -> subprocess.CompletedProcess:
    """`python ckpt.py ARGS`, in this process."""
    return in_process(ckpt.main, [str(a) for a in args])


def in_process(main, argv: list[str]) -> subprocess.CompletedProcess:
    """main(argv) as its script's command line, from the repository's root: stdout and stderr captured, the
    exit status returned or given to sys.exit (argparse's), an uncaught exception's traceback on stderr with
    status 1, as Python prints and exits."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except Exception as e:
            print(ckpt.format_traceback(e), file=sys.stderr, end="")
            code = 1
    return subprocess.CompletedProcess([main.__module__, *argv], code or 0, out.getvalue(), err.getvalue())


def with_cpu_devices(n: int, **env) -> dict[str, str]:
    """This process's environment (and `env`) for a process with `n` CPU devices: the suite's XLA flags, then
    the device count (of a repeated flag, XLA takes the last)."""
    flags = f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={n}"
    return dict(os.environ, XLA_FLAGS=flags, **env)


# The tiny preset shrunk for the tests that kill, resume and compare runs: 12 steps of 4 x 64 tokens, a
# checkpoint every 3, an evaluation at the last step alone, no samples.
STEPS = 12
FLAGS = ["--preset", "tiny", "--seq_len", "64", "--global_batch", "4", "--steps", str(STEPS)]
FLAGS += ["--lr_horizon", str(STEPS), "--warmup_steps", "3", "--ckpt_every", "3", "--eval_every", "1000"]
FLAGS += ["--samples", "0"]
COMPARED = (
    "loss",
    "grad_norm",
    "batch_hash",
    "lr",
    "ce_loss",
    "z_loss",
    "skipped",
)  # a train row, bit for bit


def run(run_dir, data_root, *extra, fault="none:0", wait=True, env=None, script="faults.py"):
    """train.py with FLAGS (and `extra`) on the tiny data under `data_root`, through train_py; `env`: variables
    added to this process's."""
    argv = [*FLAGS, "--run_dir", run_dir, "--data_root", data_root, *extra]
    return train_py(argv, fault, wait=wait, script=script, env=env and dict(os.environ, **env))


def rows(run_dir, kind: str | None = None) -> list[dict]:
    """metrics.jsonl's rows (a local or gs:// run directory); with `kind` ("loss": the train rows,
    "eval_loss": the evaluations), those that hold it."""
    text = data.read_text(data.join(str(run_dir), "metrics.jsonl"))
    return [row for row in map(json.loads, text.splitlines()) if kind is None or kind in row]
