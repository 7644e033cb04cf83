"""Run train.py with a fault injected at a chosen moment, for the resumption tests.

    python tests/faults.py MOMENT:STEP [train.py flags...]

mid_step:S      SIGKILL right after step S is dispatched, before its results are read
raise:S         an exception (a bug) in step S
during_save:S   SIGKILL while checkpoint S is being written in the background
after_commit:S  SIGKILL right after checkpoint S is committed
hold:S          after step S, wait until the file named by $FAULT_GO exists (another process's turn, for sure)
in_eval:S       SIGKILL in the evaluation of step S, its scores computed and printed, its row not yet written
none:0          no fault
"""

import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import train  # noqa: E402

moment, at = sys.argv[1].split(":")
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
sys.exit(train.cli(sys.argv[2:]))
