"""The goodput account (RUN_DIR/goodput.jsonl, `ckpt.py goodput`): each start's seconds by cause, the steps a
kill cost taken again, the downtime between starts; the parts sum to the wall time. Checked on records worked
out by hand, and on a tiny run killed (SIGKILL) and preempted (SIGTERM) several times, then finished, against
the wall time the test measures and the steps its kills lost."""

import json
import re
import signal
import time

import pytest
from commands import STEPS, ckpt_py, rows, run

import ckpt

CAUSES = ("start", "restore", "compile", "data_wait", "evaluation", "checkpoint")


def record(id, began, at, restored, dropped, last_step, steps, steps_s, *seconds):
    """A start's line of goodput.jsonl, its TIMED seconds in order."""
    line = dict(
        id=id, began=began, at=at, restored=restored, dropped=dropped, last_step=last_step, steps=steps
    )
    return line | dict(steps_s=steps_s) | {f"{c}_s": s for c, s in zip(CAUSES, seconds, strict=True)}


def test_an_account_worked_out_by_hand(tmp_path):
    """Three starts. A trains steps 1-5 at 1 s a step, its last record at step 4, and is killed; B finds rows
    1-5 but resumes from checkpoint 2 (the newer ones lost), dropping 3 rows: A's steps 3-5 are taken again,
    steps 3 and 4 from A's record (2 s), step 5 after it, out of B's 3 s of downtime (1 s). B trains 3-8 and
    is preempted; C resumes from 8 and finishes at 10."""
    a0 = record("a", 0.0, 6.0, 0, 0, 1, 1, 3.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0)  # an earlier store of A
    a = record("a", 0.0, 10.0, 0, 0, 4, 4, 4.0, 1.0, 1.0, 2.0, 0.5, 0.0, 0.5)  # other: 1 s
    b = record("b", 13.0, 30.0, 2, 3, 8, 6, 12.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0)
    c = record("c", 31.0, 40.0, 8, 0, 10, 2, 4.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0)
    lines = [a0, b, a, c]  # a start's last line counts; the order the starts began in
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    out = ckpt_py("goodput", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    account = json.loads(out.stdout)
    assert account["wall_s"] == 40.0 and account["kept_s"] == 2.0 + 12.0 + 4.0
    assert account["goodput"] == pytest.approx(18 / 40)
    want = dict(start=3, restore=3, compile=4, data_wait=0.5, evaluation=2, checkpoint=2.5, retaken=3, down=3)
    assert account["badput_s"] == pytest.approx(want | dict(other=1.0))
    assert account["steps_kept"] == 10 and account["steps_retaken"] == 3
    first, second, third = account["starts"]
    assert [s["id"] for s in account["starts"]] == ["a", "b", "c"]
    assert (first["kept_s"], first["retaken_s"], first["steps_kept"], first["steps_retaken"]) == (2, 2, 2, 3)
    assert (second["down_s"], second["retaken_s"], second["wall_s"]) == (2, 1, 20)
    assert (third["down_s"], third["kept_s"], third["compile_s"], third["wall_s"]) == (1, 4, 1, 10)
    for s in account["starts"]:  # each start's parts sum to its span
        assert sum(s[f"{c}_s"] for c in ("kept", *ckpt.BADPUT)) == pytest.approx(s["wall_s"])

    out = ckpt_py("goodput", tmp_path)
    assert out.returncode == 0, out.stderr
    table = out.stdout.splitlines()
    assert table[0].split()[:4] == ["start", "began", "wall", "kept"] and len(table) == 1 + 3 + 1 + 2
    assert table[4].split()[:3] == ["all", "40.0", "18.0"] and table[4].split()[-1] == "10/3"
    assert table[5].startswith("goodput 45.0%: 18.0 s of steps kept in 40.0 s of wall time")
    assert (tmp_path / "goodput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    out = ckpt_py("goodput", tmp_path / "none")
    assert out.returncode == 1 and out.stderr.startswith(
        f"error: {tmp_path / 'none' / 'goodput.jsonl'} does not"
    )


def wait_for_row(run_dir, step, proc, timeout=300):
    """Until metrics.jsonl holds step `step`'s train row, the process still running."""
    deadline = time.time() + timeout
    while not (run_dir / "metrics.jsonl").exists() or step not in [r["step"] for r in rows(run_dir, "loss")]:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)


def resumed_from(stdout: str) -> int:
    """The step a start resumed from, as it said (0: none, a first start)."""
    said = re.search(r"resuming from \S+ \(step (\d+)\)", stdout)
    return int(said[1]) if said else 0


# 12 steps, a checkpoint every 4: a kill loses up to 3 steps' numbers read.
LONGER = ["--ckpt_every", "4"]


@pytest.mark.slow
def test_a_run_killed_and_preempted_accounts_for_its_wall_time_and_the_steps_its_kill_lost(
    tiny_data, tmp_path
):
    """Killed as step 8 is dispatched (steps 1-6 read: 7's numbers are read as 8 runs), preempted once step
    8 is read (SIGTERM: it saves the step it is at and exits 0), then finished. The steps the kill lost are
    those it read past the checkpoint the next start resumed from, which that start says (checkpoint 4,
    written in the background, may not have committed before the kill). The first two starts are processes
    of their own, each timed from its launch; the last runs in this process, and ends no process (whose
    teardown, after its last record, no account sees). tests/test_resume.py kills a run three ways."""
    began = time.time()
    go = tmp_path.parent / f"{tmp_path.name}.go"  # the preempted start holds after step 10 until this exists
    out = run(tmp_path, tiny_data, *LONGER, fault="mid_step:8")
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert max(r["step"] for r in rows(tmp_path, "loss")) == 6
    proc = run(tmp_path, tiny_data, *LONGER, fault="hold:10", env={"FAULT_GO": str(go)}, wait=False)
    wait_for_row(tmp_path, 8, proc)
    proc.send_signal(signal.SIGTERM)
    go.touch()
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "exiting for the preemption" in stdout, stderr[-3000:]
    lost = 6 - resumed_from(stdout)
    out = run(tmp_path, tiny_data, *LONGER)  # in this process, which it does not end
    assert out.returncode == 0, out.stderr[-3000:]
    wall = time.time() - began

    out = ckpt_py("goodput", tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    account = json.loads(out.stdout)
    assert account["wall_s"] == pytest.approx(wall, rel=0.05), (account["wall_s"], wall)
    assert sum(account["badput_s"].values()) + account["kept_s"] == pytest.approx(account["wall_s"])
    assert account["steps_retaken"] == lost and account["steps_kept"] == STEPS
    killed, preempted, last = account["starts"]
    assert [s["steps_retaken"] for s in account["starts"]] == [lost, 0, 0]
    assert (account["badput_s"]["retaken"] > 0) == (lost > 0)
    assert killed["compile_s"] > 0 and killed["restore_s"] > 0 and killed["checkpoint_s"] > 0
    assert preempted["down_s"] > 0  # the killed process's end, the test's turn, a launch
    assert last["evaluation_s"] > 0 and last["last_step"] == STEPS and killed["evaluation_s"] == 0
