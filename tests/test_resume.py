"""Kill and resume, end to end through train.py: a run killed anywhere and restarted logs every step once,
bitwise equal to an uninterrupted run; SIGTERM saves and exits 0; corrupt checkpoints are set aside, and a
run with none readable stops rather than start over; bad configs are refused; a second writer is refused; a
failed save stops the run; a read-only run directory is read, never written. ckpt.py's own tests are
tests/test_ckpt.py's."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from commands import FLAGS, STEPS, ckpt_py, rows, run
from damage import delete_item, flip_byte, truncate

import ckpt

ROOT = Path(__file__).resolve().parent.parent


def final_model(run_dir, step=STEPS):
    model, _, _ = ckpt.Checkpoints(run_dir).read(step)
    return model


@pytest.fixture(scope="module")
def reference(uninterrupted):
    """The uninterrupted run (conftest.py), and its train rows by step."""
    logged = {r["step"]: r for r in rows(uninterrupted, "loss")}
    assert sorted(logged) == list(range(1, STEPS + 1))
    return uninterrupted, logged


def assert_same_as_reference(run_dir, reference, evaluated=(STEPS,)):
    ref_dir, ref_rows = reference
    logged = rows(run_dir, "loss")
    # One row per step, as of the checkpoint each attempt resumed from: none missing, none repeated.
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    # The evaluated steps' rows (FLAGS' --eval_every 1000: the last step's alone).
    assert [r["step"] for r in rows(run_dir, "eval_loss")] == list(evaluated)
    for r in logged:  # bit for bit
        want = ref_rows[r["step"]]
        for key in ("loss", "grad_norm", "batch_hash", "lr", "ce_loss", "z_loss", "skipped"):
            assert r[key] == want[key], f"step {r['step']} {key}: {r[key]!r} != {want[key]!r}"
    ours, theirs = final_model(run_dir), final_model(ref_dir)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_same_run_twice_is_bitwise_identical(tiny_data, reference, tmp_path):
    # The premise of everything below (CPU XLA with several threads could break it: jax-ml/jax#39741).
    out = run(tmp_path, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_as_reference(tmp_path, reference)


@pytest.mark.slow
def test_killed_three_times_in_a_row_resumes_bitwise(tiny_data, reference, tmp_path):
    said = []
    for fault in ["mid_step:5", "during_save:6", "after_commit:9"]:
        out = run(tmp_path, tiny_data, fault=fault)
        assert out.returncode == -signal.SIGKILL, (fault, out.stderr[-3000:])
        assert (tmp_path / "lock").exists()  # left by the killed process ...
        said.append(out.stdout)
    out = run(tmp_path, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]  # ... and taken over: its process is gone
    assert "resuming from" in out.stdout and "(step 9)" in out.stdout
    assert not (tmp_path / "lock").exists()
    assert_same_as_reference(tmp_path, reference)
    # The goodput account's steps trained again: those each kill had read (mid_step:5 steps 1-3, step 4's
    # numbers read only as step 5 runs; the others through their checkpoint) past the step the next resumed from.
    resumed = [re.search(r"resuming from \S+ \(step (\d+)\)", s) for s in [*said[1:], out.stdout]]
    lost = sum(read - (int(r[1]) if r else 0) for read, r in zip([3, 6, 9], resumed, strict=True))
    assert json.loads(ckpt_py("goodput", tmp_path, "--json").stdout)["steps_retaken"] == lost


@pytest.mark.slow
def test_kill_before_the_first_checkpoint_starts_over(tiny_data, reference, tmp_path):
    assert run(tmp_path, tiny_data, fault="mid_step:2").returncode == -signal.SIGKILL
    out = run(tmp_path, tiny_data)
    assert out.returncode == 0 and "resuming from" not in out.stdout
    assert_same_as_reference(tmp_path, reference)


def wait_for_steps(run_dir, n, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (Path(run_dir) / "metrics.jsonl").exists() and len(rows(run_dir, "loss")) >= n:
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise TimeoutError(f"fewer than {n} steps logged in {timeout} s")


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_0(tiny_data, reference, tmp_path):
    proc = run(tmp_path, tiny_data, wait=False)
    wait_for_steps(tmp_path, 4, proc)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0, stderr[-3000:]
    assert "exiting for the preemption" in stdout
    saved = ckpt.Checkpoints(tmp_path).steps()
    assert saved and saved[-1] >= 4 and saved[-1] < STEPS
    out = run(tmp_path, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"(step {saved[-1]})" in out.stdout
    assert_same_as_reference(tmp_path, reference)


def read_until(proc, text, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        assert line or proc.poll() is None, f"exited before printing {text!r}"
        if text in line:
            return
    raise TimeoutError(text)


@pytest.mark.slow
def test_second_signal_exits_at_once_and_harms_nothing(tiny_data, reference, tmp_path):
    # A finished run extended by two steps, held in its second (hold: its first, which compiles, is part of
    # the start, which a signal ends at once): the first signal waits for the step boundary, which the hold
    # keeps from coming, and the second exits at once.
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    extend = ["--steps", str(STEPS + 2), "--allow_config_change"]
    never = {"FAULT_GO": str(tmp_path / "never")}
    proc = run(run_dir, tiny_data, *extend, fault=f"hold:{STEPS + 2}", env=never, wait=False)
    read_until(proc, "fault: holding")
    proc.send_signal(signal.SIGINT)
    read_until(proc, "saving at the next step boundary")
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGINT
    assert ckpt.Checkpoints(run_dir).steps() == [9, STEPS]
    out = run(run_dir, tiny_data, *extend)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"(step {STEPS})" in out.stdout and max(r["step"] for r in rows(run_dir, "loss")) == STEPS + 2


# A SIGTERM at each moment a run meets one, in the order it meets them, in one run directory (each start resumes
# what the one before kept), with an evaluation at step 9: (fault, the most seconds from the signal to the exit
# as docs/scaling.md's "Preemption" bounds them, the checkpoints after it). Measured on 2 busy cores: 3.0 (the
# backstop's 3 s), 2.6, 1.5, 2.8 and 1.9 s.
PREEMPTIONS = [
    ("term_in_compile:1", 10, []),  # in the first step's compile: nothing to keep
    ("term_in_wait:5", 15, [3, 4]),  # waiting for step 5's batch: step 4 kept
    ("term_in_restore:0", 10, [3, 4]),  # in the restore: the run directory as it was
    ("term_in_save:6", 15, [4, 6]),  # in step 6's save: the save completes
    ("term_in_eval:9", 15, [6, 9]),  # in step 9's evaluation: step 9 kept, its evaluation owed
]


def files(run_dir: Path) -> dict:
    return {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_sigterm_at_any_moment_exits_0_in_seconds_and_the_rerun_is_uninterrupted(
    tiny_data, reference, tmp_path
):
    every_9 = ["--eval_every", "9"]  # not in the recipe: the train rows are the reference's
    for fault, bound, kept in PREEMPTIONS:
        before = files(tmp_path)
        out = run(tmp_path, tiny_data, *every_9, fault=fault)
        exited = time.time()
        assert out.returncode == 0, (fault, out.stderr[-3000:])
        sent = float(re.search(r"fault: SIGTERM at ([\d.]+)", out.stdout)[1])
        assert exited - sent < bound, (fault, exited - sent)
        assert not (tmp_path / "lock").exists()
        assert (ckpt.Checkpoints(tmp_path).steps() if kept else list(tmp_path.rglob("checkpoints/*"))) == kept
        assert [r["step"] for r in rows(tmp_path, "loss")] == list(range(1, max(kept, default=0) + 1))
        assert not rows(tmp_path, "eval_loss")
        if fault.startswith("term_in_restore"):
            assert files(tmp_path) == before
    out = run(tmp_path, tiny_data, *every_9)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_as_reference(tmp_path, reference, evaluated=(9, STEPS))
    # The evaluation the preemption cut short ran first, before step 10: no row is missing, none out of place.
    assert [(r["step"], "loss" in r) for r in rows(tmp_path)][8:11] == [(9, True), (9, False), (10, True)]
    # Each on its step's model: as the uninterrupted run's own evaluation of step 12, and an --eval_only of its
    # step 9, bit for bit.
    ours = {r["step"]: r["eval/lm/tiny-val/CE loss"] for r in rows(tmp_path, "eval_loss")}
    assert ours[STEPS] == rows(reference[0], "eval_loss")[0]["eval/lm/tiny-val/CE loss"]
    out = run(tmp_path / "step-9", tiny_data, "--eval_only", "--init_from", f"{reference[0]}@9")
    assert out.returncode == 0, out.stderr[-3000:]
    assert ours[9] == rows(tmp_path / "step-9")[0]["eval/lm/tiny-val/CE loss"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", [truncate, flip_byte, delete_item])
def test_corrupt_checkpoint_is_set_aside_and_the_previous_used(tiny_data, reference, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    damage(run_dir / "checkpoints" / str(STEPS))
    out = run(run_dir, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "is corrupt" in out.stderr and "(step 9)" in out.stdout
    assert [p.name.split("-")[0] for p in (run_dir / "quarantined").iterdir()] == [str(STEPS)]
    assert_same_as_reference(run_dir, reference)


@pytest.mark.slow
def test_a_run_whose_every_checkpoint_is_unreadable_stops_unless_told_to_start_over(
    tiny_data, reference, tmp_path
):
    """A flaky mount must not erase a run: with no checkpoint readable the run stops, naming what it set
    aside, and again at the next start (they are in quarantined/ now); --start_over trains from step 0."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    for step in (9, STEPS):
        truncate(run_dir / "checkpoints" / str(step))
    before = (run_dir / "metrics.jsonl").read_text()
    for _ in range(2):
        out = run(run_dir, tiny_data)
        assert out.returncode == 1, out.stderr[-3000:]
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: no checkpoint of {run_dir} reads back intact: "), out.stderr[-3000:]
        assert all(p.name in last for p in (run_dir / "quarantined").iterdir()) and "--start_over" in last
        assert (run_dir / "metrics.jsonl").read_text() == before
    assert "NoValidCheckpoint" in (run_dir / "log.txt").read_text()  # the full story, traceback and all
    assert sorted(p.name.split("-")[0] for p in (run_dir / "quarantined").iterdir()) == [str(STEPS), "9"]
    out = run(run_dir, tiny_data, "--start_over")
    assert out.returncode == 0 and "resuming from" not in out.stdout, out.stderr[-3000:]
    assert_same_as_reference(run_dir, reference)


@pytest.mark.slow
def test_finished_run_exits_0_and_trains_nothing(tiny_data, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = (run_dir / "metrics.jsonl").read_text()
    out = run(run_dir, tiny_data)
    assert out.returncode == 0 and "already complete" in out.stdout
    assert (run_dir / "metrics.jsonl").read_text() == before
    assert ckpt.Checkpoints(run_dir).steps() == [9, STEPS]


@pytest.mark.slow
def test_changed_recipe_is_refused_unless_allowed(tiny_data, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    out = run(run_dir, tiny_data, "--seed", "7")
    assert out.returncode == 2 and "seed: 34521 -> 7" in out.stderr
    out = run(run_dir, tiny_data, "--global_batch", "8")
    assert out.returncode == 2 and "global_batch: 4 -> 8" in out.stderr
    out = run(run_dir, tiny_data, "--head_layout", "2x128", "--allow_config_change")
    assert out.returncode == 2 and "holds another model: num_attention_heads 4 vs 2" in out.stderr
    out = run(run_dir, tiny_data, "--steps", "14")
    assert out.returncode == 2 and "steps: 12 -> 14" in out.stderr and "--allow_config_change" in out.stderr
    out = run(run_dir, tiny_data, "--steps", "14", "--allow_config_change")
    assert out.returncode == 0, out.stderr[-3000:]
    assert [r["step"] for r in rows(run_dir, "loss")][-2:] == [13, 14]


@pytest.mark.slow
def test_a_real_full_disk_stops_the_run_and_the_rerun_resumes(tiny_data, reference, tmp_path):
    """The run directory on a 100 MB tmpfs of its own (a mount namespace): checkpoint 3 (67 MB) fits, 6 does
    not, and the write fails with ENOSPC as on a full disk. The run stops in one line naming the save, keeps
    checkpoint 3 and no half of 6. The run directory is copied out before the mount goes away, then resumed
    where there is room. (A simulated full disk, a file size limit, ran the same again: 18 s of the suite.)"""
    disk, saved = tmp_path / "disk", tmp_path / "saved"
    disk.mkdir()
    cmd = " ".join(
        [
            sys.executable,
            str(ROOT / "tests" / "faults.py"),
            "none:0",
            *FLAGS,
            "--run_dir",
            f"{disk}/run",
            "--data_root",
            str(tiny_data),
        ]
    )
    script = (
        f"mount -t tmpfs -o size=100m tmpfs {disk} && {{ {cmd}; echo exit=$?; cp -r {disk}/run {saved}; }}"
    )
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if "exit=" not in out.stdout:
        pytest.skip(f"no private tmpfs here (unshare -rm): {out.stderr[-300:]}")
    assert "exit=1" in out.stdout, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: saving checkpoint 6 to {disk}/run/checkpoints/6 failed: No space left on device (errno 28)"
    ), out.stderr[-3000:]
    assert sorted(p.name for p in (saved / "checkpoints").iterdir()) == ["3"]  # no half-written 6 left
    assert "saving checkpoint 6 failed" in (saved / "log.txt").read_text()
    # The write fails in the background; the loop stops at the first step boundary after it does, at the
    # latest before it would save again: it never goes on without checkpoints.
    assert max(r["step"] for r in rows(saved, "loss")) < 9
    out = run(saved, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(step 3)" in out.stdout
    assert_same_as_reference(saved, reference)


@pytest.mark.slow
def test_a_second_process_on_the_run_directory_is_refused_at_once(tiny_data, reference, tmp_path):
    go = tmp_path.parent / f"{tmp_path.name}.go"  # the first run holds after step 5 until this exists
    first = run(tmp_path, tiny_data, fault="hold:5", env={"FAULT_GO": str(go)}, wait=False)
    wait_for_steps(tmp_path, 2, first)
    t0 = time.time()
    second = run(tmp_path, tiny_data)
    go.touch()
    assert second.returncode == 1 and time.time() - t0 < 60, second.stdout[-2000:]
    assert (
        second.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: {tmp_path} is in use by process {first.pid} (since ")
    ), second.stderr[-2000:]
    first.communicate(timeout=300)
    assert first.returncode == 0
    assert_same_as_reference(tmp_path, reference)  # the second one wrote nothing


@pytest.mark.slow
def test_a_lock_held_on_another_host_is_refused_and_nothing_is_written(tiny_data, tmp_path):
    (tmp_path / "lock").write_text(
        json.dumps(
            {"host": "node-7", "pid": 4242, "started": "1", "job": "x", "since": "2026-11-30 09:00:00"}
        )
    )
    out = run(tmp_path, tiny_data)
    assert out.returncode == 1 and f"{tmp_path} is in use by process 4242 on host node-7" in out.stderr
    assert f"remove {tmp_path / 'lock'}" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lock"]


@pytest.mark.slow
def test_an_emptied_checkpoint_folder_retrains_without_repeating_rows(tiny_data, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    shutil.rmtree(run_dir / "checkpoints")
    out = run(run_dir, tiny_data)
    assert out.returncode == 0 and "resuming from" not in out.stdout, out.stderr[-3000:]
    assert_same_as_reference(run_dir, reference)


@pytest.mark.slow
def test_eval_only_adds_a_marked_row_and_never_rewrites_one(tiny_data, reference, tmp_path):
    """--eval_only twice on a finished run: every byte the run wrote stays, two marked rows are added after
    it (the same checkpoint: the same numbers as the run's own evaluation), eval_loss keeps its one meaning;
    on a read-only directory it prints its table and says in one line that it could not add the row."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    config, written = (run_dir / "config.json").read_text(), (run_dir / "metrics.jsonl").read_text()
    for _ in range(2):
        out = run(run_dir, tiny_data, "--eval_only")
        assert out.returncode == 0, out.stderr[-3000:]
    assert f"step {STEPS}: held-out evaluation" in out.stdout
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.startswith(written)
    added = [json.loads(line) for line in text[len(written) :].splitlines()]
    (trained,) = rows(reference[0], "eval_loss")
    assert [r["step"] for r in added] == [STEPS, STEPS] and all(r["eval_only"] for r in added)
    assert [r["eval/lm/tiny-val/CE loss"] for r in added] == [trained["eval/lm/tiny-val/CE loss"]] * 2
    assert all("eval_loss" not in r and r["eval_sets"] == "tiny-val" for r in added)
    assert (run_dir / "config.json").read_text() == config
    out = run(run_dir, tiny_data, "--eval_only", fault=f"in_eval:{STEPS}")  # killed before its row
    assert out.returncode == -9 and (run_dir / "metrics.jsonl").read_text() == text
    # On a read-only mount (a mount namespace of its own; root ignores file modes), the same command.
    command = " ".join([sys.executable, "tests/faults.py", "none:0", *FLAGS, "--data_root", str(tiny_data)])
    readonly = (
        f"mount --bind {run_dir} {run_dir} && mount -o remount,ro,bind {run_dir} && "
        f"! touch {run_dir}/x 2>/dev/null && {command} --run_dir {run_dir} --eval_only"
    )
    out = subprocess.run(["unshare", "-rm", "sh", "-c", readonly], cwd=ROOT, capture_output=True, text=True)
    if "mount" not in out.stderr:  # (no private mounts here: skip this part)
        assert out.returncode == 0 and f"step {STEPS}: held-out evaluation" in out.stdout, out.stderr[-3000:]
        assert "--eval_only: could not add this evaluation to " in out.stdout
        assert (run_dir / "metrics.jsonl").read_text() == text


@pytest.mark.slow
def test_refused_resume_and_dry_run_leave_the_run_directory_as_it_was(tiny_data, reference, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    out = run(run_dir, tiny_data, "--lr", "1e-3")
    assert out.returncode == 2 and "lr: 0.002 -> 0.001" in out.stderr
    out = run(run_dir, tiny_data, "--dry_run")
    assert out.returncode == 0 and "dry run:" in out.stdout
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_a_token_id_past_the_vocabulary_stops_the_run_naming_file_offset_and_id(tiny_data, tmp_path):
    import data
    import train

    tokens = np.fromfile(tiny_data / "train" / "part-00000.npy", np.uint16)[: 64 * 400].copy()
    bad = tmp_path / "bad.npy"
    tokens.tofile(bad)
    loader = data.TokenLoader(
        [str(bad)], 64, 4, seed=train.TrainConfig.seed, dtype=np.uint16, vocab_size=8192
    )
    # A row of step 3's batch past the first 4096 tokens, which the start-up check reads: only the batch finds it.
    step = 2
    row = next(int(i) for i in loader.batch_indices(step) if i >= 4096 // 64)
    tokens[64 * row + 5] = 9000  # past the vocabulary
    tokens.tofile(bad)
    out = run(tmp_path / "run", tiny_data, "--data", str(bad), "--steps", str(step + 1))
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1] == (
        f"error: {bad}: token {64 * row + 5} has id 9000, not below the vocabulary of 8192; `python data.py check "
        f"{bad} --vocab_size 8192` scans every token (another tokenizer? a file of another dtype?)"
    )
    assert len(rows(tmp_path / "run", "loss")) <= step  # it stopped at the batch, before training on it
    assert "Traceback" in (tmp_path / "run" / "log.txt").read_text()  # the full story of what stopped it


@pytest.mark.slow
def test_a_run_dir_that_is_or_lies_under_a_file_is_refused_in_one_line(tiny_data, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    for run_dir, says in [(blocker, " is a file"), (blocker / "run", ": cannot create it (Not a directory)")]:
        out = run(run_dir, tiny_data)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
        assert out.stderr.strip().splitlines()[-1].startswith(f"error: --run_dir {run_dir}{says}")
    assert blocker.read_text() == "not a directory"


def read_only(run_dir: Path, commands: list[list[str]], logs: Path):
    """Each of `commands` run with `run_dir` mounted read-only (a mount namespace of its own), its output in
    logs/<i>.out and .err and its exit status in logs/<i>.rc; skips where private mounts are not allowed."""
    script = [f"mount --bind {run_dir} {run_dir} && mount -o remount,ro,bind {run_dir} && echo mounted"]
    for i, cmd in enumerate(commands):
        script.append(f"{' '.join(map(str, cmd))} >{logs}/{i}.out 2>{logs}/{i}.err; echo $? >{logs}/{i}.rc")
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", "; ".join(script)], cwd=ROOT, capture_output=True, text=True
    )
    if "mounted" not in out.stdout:
        pytest.skip(f"no private read-only mount here (unshare -rm): {out.stderr[-300:]}")
    read = lambda i, ext: (logs / f"{i}.{ext}").read_text()
    return [(int(read(i, "rc")), read(i, "out"), read(i, "err")) for i in range(len(commands))]


@pytest.mark.slow
def test_a_read_only_run_dir_is_read_when_complete_and_refused_in_one_line_otherwise(
    tiny_data, reference, tmp_path
):
    run_dir = tmp_path / "run"
    shutil.copytree(reference[0], run_dir)
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    train = [sys.executable, ROOT / "tests" / "faults.py", "none:0", *FLAGS, "--data_root", tiny_data]
    train += ["--run_dir", run_dir]
    complete, extended = read_only(
        run_dir, [train, [*train, "--steps", "14", "--allow_config_change"]], tmp_path
    )
    assert complete[0] == 0 and "already complete" in complete[1], complete[2][-3000:]
    assert extended[0] == 1 and "Traceback" not in extended[2], extended[2][-3000:]
    assert (
        extended[2]
        .strip()
        .splitlines()[-1]
        .startswith(f"error: --run_dir {run_dir} cannot be written (Read-only file system)")
    ), extended[2][-3000:]
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before


# ---- `ckpt.py from-hf`, then train.py continues from its step 0


@pytest.mark.slow
def test_from_hf_starts_a_run_at_step_0_and_says_how(tiny_data, reference, tmp_path):
    assert ckpt_py("to-hf", reference[0], tmp_path / "hf").returncode == 0
    out = ckpt_py("from-hf", tmp_path / "hf", tmp_path / "run")
    assert out.returncode == 0, out.stderr
    assert f"python train.py --preset tiny --run_dir {tmp_path / 'run'} --data YOUR_TOKEN_FILES" in out.stdout
    assert ckpt.Checkpoints(tmp_path / "run").steps() == [0]
    out = run(tmp_path / "run", tiny_data, "--steps", "2", "--lr_horizon", "2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resuming from" in out.stdout and "(step 0)" in out.stdout
    first = rows(tmp_path / "run", "loss")[0]
    # Training continues from the exported weights: the first loss is the trained model's, far below ln(8192).
    assert first["loss"] < reference[1][STEPS]["loss"] + 0.5
