"""Run train.py with a fault injected at a chosen moment, for the resumption tests.

    python tests/faults.py MOMENT:STEP [train.py flags...]

mid_step:S      SIGKILL right after step S is dispatched, before its results are read
raise:S         an exception (a bug) in step S
during_save:S   SIGKILL while checkpoint S is being written in the background
after_commit:S  SIGKILL right after checkpoint S is committed
hold:S          after step S, wait until the file named by $FAULT_GO exists (another process's turn, for sure)
in_eval:S       SIGKILL in the evaluation of step S, its scores computed and printed, its row not yet written
none:0          no fault

From a test, `train_py` runs the command: in the test's own process where nothing needs a process of its
own (no fault, waited for), which spares the run Python's and JAX's start (imports, backend, the step's
trace: about 5 of a warm tiny run's 9 seconds on 2 cores); else as the command above.
"""

import contextlib
import io
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402


def inject(fault: str) -> None:
    """Replace train.py's seams (take_step, save, record_eval_row) with ones that fail at `fault`."""
    moment, at = fault.split(":")
    at = int(at)
    real_take_step, real_save, real_record = train.take_step, train.save, train.record_eval_row

    def kill():
        os.kill(os.getpid(), signal.SIGKILL)

    def take_step(run, step, *args, **kwargs):
        out = real_take_step(run, step, *args, **kwargs)
        if moment == "mid_step" and step == at:
            kill()
        if moment == "raise" and step == at:
            raise RuntimeError("injected")
        while moment == "hold" and step == at and not Path(os.environ["FAULT_GO"]).exists():
            time.sleep(0.05)
        return out

    def save(run, step, *args):
        real_save(run, step, *args)
        if moment == "during_save" and step == at:
            kill()
        if moment == "after_commit" and step == at:
            run.checkpoints.wait()
            kill()

    def record_eval_row(run, row):
        if moment == "in_eval" and row["step"] == at:
            kill()
        real_record(run, row)

    train.take_step, train.save, train.record_eval_row = take_step, save, record_eval_row


def train_py(argv, fault="none:0", *, env=None, wait=True, script="faults.py", timeout=600):
    """`python tests/<script> FAULT ARGV` with `env` (default: this process's), from the repository's root: a
    CompletedProcess, or with wait=False the Popen. Without a fault, a different script or environment, and
    waited for, train.cli runs here instead, with the same outputs and exit status."""
    argv = [str(a) for a in argv]
    if fault == "none:0" and wait and script == "faults.py" and env in (None, os.environ):
        return in_process(argv)
    cmd = [sys.executable, str(ROOT / "tests" / script), fault, *argv]
    if not wait:
        pipe = subprocess.PIPE
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=pipe, stderr=pipe, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def in_process(argv: list[str]) -> subprocess.CompletedProcess:
    """train.cli(argv) in this process, as `python train.py ARGV` from the root: stdout and stderr captured,
    an uncaught exception's traceback on stderr and exit status 1, sys.exit's status kept."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = train.cli(argv)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
            if not isinstance(e.code, int | None):
                print(e.code, file=sys.stderr)
        except Exception:
            traceback.print_exc()
            code = 1
    return subprocess.CompletedProcess(["train.py", *argv], code or 0, out.getvalue(), err.getvalue())


if __name__ == "__main__":
    inject(sys.argv[1])
    sys.exit(train.cli(sys.argv[2:]))
