"""Run train.py with a fault injected at a chosen moment, for the resumption tests.

    python tests/faults.py MOMENT:STEP [train.py flags...]

mid_step:S      SIGKILL right after step S is dispatched (the checkpoint before it committed), before its results are read
raise:S         an exception (a bug) in step S
during_save:S   SIGKILL while checkpoint S is being written in the background
after_commit:S  SIGKILL right after checkpoint S is committed
hold:S          after step S, print "fault: holding after step S" and wait until the file named by $FAULT_GO
                exists (another process's turn, for sure)
in_eval:S       SIGKILL in the evaluation of step S, its scores computed and printed, its row not yet written
hang:S          step S never finishes: once it is dispatched, this process waits forever (a wedged thread; the
                other processes wait for it in their next collective)
term_in_restore:0  SIGTERM as the restore reads the newest checkpoint
term_in_compile:S  as step S (a start's first) compiles, a call that runs no Python for a minute, as XLA's
                compile of a large model does (hashlib's PBKDF2), and SIGTERM 0.5 s into it
term_in_wait:S  SIGTERM while the loop waits for step S's batch, whose read never ends (storage that does not
                answer)
term_in_save:S  SIGTERM as checkpoint S's save begins
term_in_eval:S  SIGTERM in the first batch of the evaluation of step S
none:0          no fault

Each term_ moment prints "fault: SIGTERM at T" (T: time.time()) as it sends the signal.
"""

import hashlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import ckpt  # noqa: E402
import data  # noqa: E402
import train  # noqa: E402

moment, at = sys.argv[1].split(":")
at = int(at)
real_take_step, real_save, real_record = train.take_step, train.save, train.record_eval_row
real_read, real_read_batches = ckpt.Checkpoints.read, train.read_batches
real_evaluate, real_eval_step = train.evaluate, train.eval_step
evaluating, termed = None, False  # the step whose evaluation runs; whether term() has sent its signal


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def term():
    """SIGTERM to this process, once (a moment may come round again: a preemption's save of step S). It is
    sent to the calling thread: the kernel may hand a process's signal to any of its threads, and one other
    than the main thread (term_in_compile's timer, term_in_wait's reader) is the case to survive."""
    global termed
    if not termed:
        termed = True
        print(f"fault: SIGTERM at {time.time()}", flush=True)
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)


def take_step(run, step, *args, **kwargs):
    if moment == "term_in_compile" and step == at:
        threading.Timer(0.5, term).start()
        hashlib.pbkdf2_hmac("sha256", b"", b"", 10**8)  # about a minute in C, the GIL released
    out = real_take_step(run, step, *args, **kwargs)
    if moment == "mid_step" and step == at:
        run.checkpoints.wait()  # the checkpoint before it committed: the step's dispatch does not wait
        kill()
    if moment == "raise" and step == at:
        raise RuntimeError("injected")
    if moment == "hold" and step == at:
        print(f"fault: holding after step {step}", flush=True)
    while moment == "hold" and step == at and not Path(os.environ["FAULT_GO"]).exists():
        time.sleep(0.05)
    if moment == "hang" and step == at:
        threading.Event().wait()
    return out


def save(run, step, *args):
    if moment == "term_in_save" and step == at:
        term()
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


def read(checkpoints, step, *args, **kwargs):
    if moment == "term_in_restore":
        term()
    return real_read(checkpoints, step, *args, **kwargs)


def read_batches(run, start):
    if moment == "term_in_wait":
        fetch = run.loader.local_batch

        def local_batch(i, *args):
            if i == at - 1:  # step `at`'s batch
                main_thread_waits_for_a_batch()
                term()
                time.sleep(600)
            return fetch(i, *args)

        run.loader.local_batch = local_batch
    return real_read_batches(run, start)


def main_thread_waits_for_a_batch():
    """Until the main thread is blocked in data.Prefetcher's wait for a batch."""
    while True:
        frame, codes = sys._current_frames()[threading.main_thread().ident], []
        while frame is not None:
            codes.append(frame.f_code)
            frame = frame.f_back
        if codes[0].co_name == "wait" and data.Prefetcher.__iter__.__code__ in codes:
            return
        time.sleep(0.01)


def evaluate(run, step, model):
    global evaluating
    evaluating = step
    return real_evaluate(run, step, model)


def eval_step(*args, **kwargs):
    out = real_eval_step(*args, **kwargs)
    if moment == "term_in_eval" and evaluating == at:
        term()
    return out


train.take_step, train.save, train.record_eval_row = take_step, save, record_eval_row
train.read_batches, train.evaluate, train.eval_step, ckpt.Checkpoints.read = (
    read_batches,
    evaluate,
    eval_step,
    read,
)
sys.exit(train.cli(sys.argv[2:]))
