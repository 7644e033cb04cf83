"""A run directory on Cloud Storage (gs://, on a GCS emulator the tests start on 127.0.0.1) and on a folder
that renames no directory (as a gcsfuse mount of a flat bucket), end to end through train.py and ckpt.py:
killed mid-save and rerun, bit for bit the uninterrupted local run, metrics.jsonl one row per step; a SIGTERM
saves and exits 0, and the rerun is bitwise too; one writer, a stale lock taken over, a lease taken over stops
its old holder; a checkpoint without its commit marker never read; a corrupt one set aside by a copy (no
rename); and the --profile trace, which XProf and Perfetto read."""

import gzip
import json
import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import jax
import numpy as np
import pytest
from commands import train_py

import ckpt
import data
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent
STEPS = 12
FLAGS = ["--preset", "tiny", "--seq_len", "64", "--global_batch", "4", "--steps", str(STEPS)]
FLAGS += ["--lr_horizon", str(STEPS), "--warmup_steps", "3", "--ckpt_every", "3", "--eval_every", "1000"]
FLAGS += ["--samples", "0"]
COMPARED = ("loss", "grad_norm", "batch_hash", "lr", "ce_loss", "z_loss", "skipped")


def run(run_dir, data_root, *extra, fault="none:0", no_dir_renames=False, wait=True):
    """train.py (tests/commands.py's train_py), or with no_dir_renames through tests/gcsfuse.py, which refuses
    directory renames under run_dir; wait=False: started, not waited for (a Popen)."""
    argv = [*FLAGS, "--run_dir", run_dir, "--data_root", data_root, *extra]
    if no_dir_renames:
        return train_py(argv, fault, script="gcsfuse.py", env=dict(os.environ, NO_DIR_RENAMES=str(run_dir)))
    return train_py(argv, fault, wait=wait)


def rows(run_dir) -> list[dict]:
    text = data.read_text(data.join(run_dir, "metrics.jsonl"))
    return [json.loads(line) for line in text.splitlines()]


def final_arrays(run_dir, step=STEPS) -> list:
    ckpts = ckpt.Checkpoints(run_dir, read_only=True)
    try:
        return jax.tree.leaves(ckpts.read(step)[:2])
    finally:
        ckpts.close()


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    """The uninterrupted run, on a local disk."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    out = run(run_dir, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    return run_dir


def assert_same_as_reference(run_dir, reference):
    """One train row per step (and the last step's eval row), each bit for bit the reference's, and the
    final model and optimizer state too."""
    train_rows, want = [r for r in rows(run_dir) if "loss" in r], [r for r in rows(reference) if "loss" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows(run_dir) if "eval_loss" in r] == [STEPS]
    for got, ref in zip(train_rows, want, strict=True):
        assert {k: got[k] for k in COMPARED} == {k: ref[k] for k in COMPARED}, got["step"]
    for a, b in zip(final_arrays(run_dir), final_arrays(reference), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def assert_trace_opens(files: dict[str, bytes]):
    """A --profile trace (its files by name) as XProf reads it (the XSpace protobuf) and as Perfetto does (the
    Chrome trace JSON): both hold the traced train steps."""
    xplane = next(data for name, data in files.items() if name.endswith(".xplane.pb"))
    space = jax.profiler.ProfileData.from_serialized_xspace(xplane)
    events = [e.name for plane in space.planes for line in plane.lines for e in line.events]
    assert events.count("PjitFunction(train_step)") >= 2
    perfetto = next(data for name, data in files.items() if name.endswith("perfetto_trace.json.gz"))
    names = [e.get("name") for e in json.loads(gzip.decompress(perfetto))["traceEvents"]]
    assert names.count("PjitFunction(train_step)") >= 2


@pytest.fixture
def bucket(gcs_emulator):
    return gcs_emulator.create_bucket(f"runs-{uuid.uuid4().hex[:12]}")


@pytest.mark.slow
def test_a_run_on_gcs_killed_mid_save_resumes_bitwise_and_sets_aside_a_corrupt_checkpoint(
    tiny_data, reference, bucket, capsys, tmp_path
):
    url = f"gs://{bucket.name}/runs/tiny"
    out = run(url, tiny_data, fault="during_save:6")
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    # Checkpoint 6 was being written in place, never committed (its objects, if any yet, lack the marker):
    # nothing reads it (test_a_checkpoint_without_its_commit_marker_... has one for certain).
    names = names_under(bucket, "runs/tiny/")
    assert "lock" in names and "checkpoints/3/commit_success.txt" in names
    assert "checkpoints/6/commit_success.txt" not in names
    assert ckpt.main(["list", url]) == 0
    assert [line.split()[0] for line in capsys.readouterr().out.splitlines()[1:2]] == ["3"]
    assert [r["step"] for r in rows(url)] == list(range(1, 7))  # stored before checkpoint 6 began
    out = run(url, tiny_data, "--profile", "10:2")
    assert out.returncode == 0, out.stderr[-3000:]
    assert (
        f"resuming from {url}/checkpoints/3 (step 3)" in out.stdout
    )  # the lock of the killed process: taken
    assert_same_as_reference(url, reference)  # ... and rows 4-6 stored before the kill dropped, then retaken
    assert {"config.json", "tokenizer.json", "loss.png"} <= names_under(bucket, "runs/tiny/")
    assert "lock" not in names_under(bucket, "runs/tiny/")
    trace = {
        b.name: b.download_as_bytes() for b in bucket.list_blobs(prefix="runs/tiny/profile/plugins/profile/")
    }
    assert_trace_opens(trace)
    # A flipped bit in the newest checkpoint: found by its checksums, copied to quarantined/ (an object store
    # renames nothing), the one before it resumed from, and the end is the same.
    flipped = max(bucket.list_blobs(prefix=f"runs/tiny/checkpoints/{STEPS}/train/"), key=lambda b: b.size)
    raw = bytearray(flipped.download_as_bytes())
    raw[len(raw) // 2] ^= 0x40
    flipped.upload_from_string(bytes(raw))
    out = run(url, tiny_data)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "is corrupt" in out.stderr and "(step 9)" in out.stdout
    quarantined = names_under(bucket, "runs/tiny/quarantined/")
    assert any(n.endswith("/commit_success.txt") for n in quarantined)
    assert "checkpoint 12 is corrupt" in data.read_text(f"{url}/log.txt")
    assert_same_as_reference(url, reference)
    steps = {n.split("/")[0] for n in names_under(bucket, "runs/tiny/checkpoints/") if n.count("/") == 1}
    assert steps == {"9", "12"}  # --keep_last 2: the older steps removed from the bucket
    readers_take_gs(url, reference, tiny_data, bucket, tmp_path)


@pytest.mark.slow
def test_sigterm_on_gcs_saves_at_the_next_step_exits_0_and_the_rerun_is_bitwise(tiny_data, reference, bucket):
    """A preemption's SIGTERM to a run on gs://: it saves at the next step boundary and exits 0, and the rerun
    resumes there and ends bit for bit the uninterrupted run. The signal is sent once the run holds its lock,
    which it takes after its signal handler is in place."""
    url = f"gs://{bucket.name}/run"
    proc = run(url, tiny_data, wait=False)
    deadline = time.time() + 300
    while not bucket.blob("run/lock").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "exiting for the preemption" in stdout, stderr[-3000:]
    [saved] = [r["step"] for r in ckpt.list_checkpoints(url)][-1:]
    assert 1 <= saved < STEPS and [r["step"] for r in rows(url) if "loss" in r] == list(range(1, saved + 1))
    out = run(url, tiny_data)
    assert out.returncode == 0 and f"(step {saved})" in out.stdout, out.stderr[-3000:]
    assert_same_as_reference(url, reference)


def readers_take_gs(url: str, reference, tiny_data, bucket, tmp_path):
    """What reads a run directory reads one at gs://: train.py --init_from (here with --eval_only, which
    adds its row to a gs:// run's metrics.jsonl), ckpt.py's to-hf and average, bench/compare.py."""
    out = run(f"gs://{bucket.name}/scored", tiny_data, "--init_from", f"{url}@9", "--eval_only")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"starting from {url}@9" in out.stdout and "held-out evaluation" in out.stdout
    assert rows(f"gs://{bucket.name}/scored")[0]["eval_only"]
    assert ckpt.export_hf(url, tmp_path / "hf") == STEPS and (tmp_path / "hf" / "model.safetensors").exists()
    assert ckpt.average(url, reference, f"gs://{bucket.name}/soup") == (STEPS, STEPS)  # the run, twice
    soup = final_arrays(f"gs://{bucket.name}/soup", step=0)
    for a, b in zip(soup, final_arrays(reference)[: len(soup)], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    tokens = np.arange(64) % 100
    ours, theirs = (next(compare.side(str(where))[1](tokens, 64)) for where in (url, reference))
    assert np.array_equal(ours, theirs)


def names_under(bucket, prefix: str) -> set[str]:
    return {blob.name.removeprefix(prefix) for blob in bucket.list_blobs(prefix=prefix)}


@pytest.mark.slow
def test_a_folder_that_renames_no_directory_commits_and_resumes_bitwise(tiny_data, reference, tmp_path):
    """gcsfuse on a flat bucket refuses to rename a directory (EXDEV): Orbax's default commit, a rename of the
    step's temporary folder, would fail at the first save. Committed by marker, it never renames one."""
    run_dir = tmp_path / "mounted"
    out = run(run_dir, tiny_data, "--profile", "2:2", fault="during_save:6", no_dir_renames=True)
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert ckpt.Checkpoints(run_dir, read_only=True).steps() == [3]
    out = run(run_dir, tiny_data, no_dir_renames=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(step 3)" in out.stdout
    assert_same_as_reference(run_dir, reference)
    profiles = list((run_dir / "profile" / "plugins" / "profile").glob("*/*"))
    assert_trace_opens({p.name: p.read_bytes() for p in profiles})


def test_one_writer_on_gcs_and_a_stale_lock_taken_over(bucket):
    url = f"gs://{bucket.name}/run"
    lock = bucket.blob("run/lock")
    with ckpt.RunLock(url) as held:
        with pytest.raises(ckpt.RunDirBusy, match=f"{url} is in use by process {os.getpid()} "):
            ckpt.RunLock(url).__enter__()
        # Another process takes the lock over (this one stopped renewing it): the holder learns so at its
        # next renewal, and stops rather than write beside it.
        lock.upload_from_string(json.dumps(dict(held.held, pid=1, host="other-host")))
        with pytest.raises(ckpt.RunDirBusy, match="was taken over by another process"):
            held.renew()
    assert lock.exists()  # not the holder's any more: left to the process that took it
    holder = dict(host="other-host", pid=1, started="1", job="j", since="then")
    lock.upload_from_string(json.dumps(holder | dict(renewed=time.time())))
    with pytest.raises(ckpt.RunDirBusy, match="on host other-host .*renewed 0 s ago: taken over once not"):
        ckpt.RunLock(url).__enter__()
    lock.upload_from_string(json.dumps(holder | dict(renewed=time.time() - ckpt.LOCK_LEASE_S - 1)))
    with ckpt.RunLock(url):  # a lease not renewed in time: the holder is gone
        assert json.loads(lock.download_as_text())["host"] == socket.gethostname()
    assert not lock.exists()


def test_a_checkpoint_without_its_commit_marker_is_never_read_and_a_writer_removes_it(bucket):
    url = f"gs://{bucket.name}/run"
    cfg = train.model_config(train.PRESETS["tiny"])
    model = olmo3.Olmo3(cfg, key=jax.random.key(0))
    with ckpt.RunLock(url):
        saver = ckpt.Checkpoints(url)
        for step in (1, 2):
            saver.save(step, model, None, {"model": ckpt.config_to_hf(cfg)})
        saver.close()
    bucket.blob("run/checkpoints/2/commit_success.txt").delete()
    assert [r["step"] for r in ckpt.list_checkpoints(url)] == [1]
    assert ckpt.unfinished_writes(f"{url}/checkpoints") == ["2"]
    like = ckpt.on_first_device(olmo3.abstract(cfg))
    reader = ckpt.Checkpoints(url, read_only=True)
    assert reader.restore_latest(like)[0] == 1
    reader.close()
    with ckpt.RunLock(url):
        ckpt.Checkpoints(url).close()  # a writer starting removes the unfinished write
    assert not names_under(bucket, "run/checkpoints/2/")
