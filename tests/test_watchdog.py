"""A hang that ends (--step_timeout, ckpt.StepWatchdog): a run whose step never finishes (tests/faults.py's
hang:S) writes every thread's stack to RUN_DIR/log.txt, releases its lock and exits ckpt.HUNG_EXIT, on one
process and on two (one hung, the other waiting for it in the step's collectives); the rerun resumes bit for
bit."""

import re
import threading
import time

import pytest
from commands import COMPARED, rows, run
from test_resume import assert_same_as_reference
from test_shard import ended, finish, launch

import ckpt

TIMEOUT_S = 5  # --step_timeout of one process, whose tiny steps take a fraction of a second
TWO_S = 20  # of two processes, whose steps took 3 to 5 s on 2 busy cores (their collectives through Gloo)


def hung_in(log: str, script: str, function: str) -> bool:
    """Whether a stack in `log` has a frame of `function` in `script` (traceback's `File ".../script",
    line N, in function`)."""
    return re.search(rf'{re.escape(script)}", line \d+, in {function}\n', log) is not None


def reports(log: str) -> dict[int, str]:
    """log.txt's hang reports (StepWatchdog's), each from its first line on, by process index."""
    parts = re.split(r"^\S+ \S+ (?=process (\d+) of \d+ \()", log, flags=re.MULTILINE)
    return {int(i): text for i, text in zip(parts[1::2], parts[2::2], strict=True)}


def test_the_watchdog_times_steps_only(monkeypatch, tmp_path):
    """Its clock starts at the first beat (the first step compiles), stands still while paused (saves and
    evaluations) and restarts at each beat: only a gap between beats, or after a resume, longer than the
    timeout fires it."""
    fired = threading.Event()
    monkeypatch.setattr(ckpt.StepWatchdog, "_end_the_run", lambda self: (fired.set(), self.pause()))
    watchdog = ckpt.StepWatchdog(0.5, str(tmp_path))
    try:
        time.sleep(1.0)  # no beat yet
        watchdog.beat()
        watchdog.pause()
        time.sleep(1.0)  # paused
        watchdog.resume()
        for _ in range(30):  # steps of 0.05 s for 1.5 s
            time.sleep(0.05)
            watchdog.beat()
        assert not fired.is_set()
        assert fired.wait(5)  # then no step for longer than the timeout
    finally:
        watchdog.close()
    assert not watchdog.thread.is_alive()


@pytest.mark.slow
def test_a_step_that_never_finishes_ends_the_run_and_the_rerun_resumes_bitwise(
    tiny_data, uninterrupted, tmp_path
):
    """Step 5 never finishes: --step_timeout after the last step's numbers (step 3's, then its checkpoint),
    the run writes its threads' stacks to log.txt (the hung one's frame in faults.py's take_step), releases
    its lock and exits 124. The rerun resumes from checkpoint 3 and equals an uninterrupted run bit for bit."""
    out = run(tmp_path, tiny_data, "--step_timeout", TIMEOUT_S, fault="hang:5")
    waited = time.time() - (tmp_path / "metrics.jsonl").stat().st_mtime  # since step 3's row was written
    assert out.returncode == ckpt.HUNG_EXIT, out.stderr[-3000:]
    assert TIMEOUT_S <= waited < TIMEOUT_S + 10, waited
    (report,) = reports((tmp_path / "log.txt").read_text()).values()
    assert report.startswith("process 0 of 1 (") and "no step finished in 5 s (--step_timeout)" in report
    assert hung_in(report, "faults.py", "take_step") and "thread 'step watchdog'" in report, report
    assert hung_in(out.stderr, "faults.py", "take_step") and "exiting 124" in out.stderr  # and on stderr
    assert not (tmp_path / "lock").exists()
    assert [r["step"] for r in rows(tmp_path, "loss")] == [1, 2, 3]  # step 4's numbers were never read
    out = run(tmp_path, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in out.stdout and "(step 3)" in out.stdout
    assert_same_as_reference(tmp_path, (uninterrupted, {r["step"]: r for r in rows(uninterrupted, "loss")}))


@pytest.mark.slow
def test_a_step_hung_in_one_of_two_processes_ends_both_and_the_rerun_resumes_bitwise(tmp_path, tiny_data):
    """Two processes, a checkpoint every 3 steps: the second never finishes step 6 (it waits forever once it
    has dispatched it, step 4's numbers read); the first waits for it as it reads step 5's numbers (their
    batch hash is summed over the processes, a collective). Each process's watchdog fires, and they exit
    together once both have reported: both exit 124, each with its stacks in log.txt (the second's in
    faults.py's take_step, the first's in log_step), and the lock is released. The rerun resumes from
    checkpoint 3 and takes step 4 again bit for bit."""
    run_dir, flags = (
        tmp_path / "run",
        ["--step_timeout", str(TWO_S), "--ckpt_every", "3", "--eval_batches", "1"],
    )
    procs = launch(run_dir, 6, tiny_data, processes=2, faults=["none:0", "hang:6"], flags=flags)
    for p, out in zip(procs, ended(procs)):
        assert p.returncode == ckpt.HUNG_EXIT, out[-4000:]
    log = (run_dir / "log.txt").read_text()
    by_process = reports(log)
    assert sorted(by_process) == [0, 1], log[-6000:]
    hang = "threading.Event().wait()"  # faults.py's, in its take_step
    assert hung_in(by_process[1], "faults.py", "take_step") and hang in by_process[1], by_process[1]
    assert hung_in(by_process[0], "train.py", "log_step") and hang not in by_process[0], by_process[0]
    assert not (run_dir / "lock").exists()
    train_rows = lambda: [[r["step"], *(r[k] for k in COMPARED)] for r in rows(run_dir, "loss")]
    kept = train_rows()
    assert [r[0] for r in kept] == [1, 2, 3, 4]
    out, _ = finish(launch(run_dir, 6, tiny_data, processes=2, flags=flags))
    assert "resuming from" in out and "(step 3)" in out
    again = train_rows()
    assert again[:4] == kept, (again, kept)  # step 4 taken again from checkpoint 3, bitwise
    assert [r[0] for r in again] == [1, 2, 3, 4, 5, 6]  # each step once
