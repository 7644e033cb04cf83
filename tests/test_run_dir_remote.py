"""A run directory on Cloud Storage (gs://, on a GCS emulator the tests start on 127.0.0.1, behind their
FaultProxy) and on a folder that renames no directory (as a gcsfuse mount of a flat bucket), end to end
through train.py and ckpt.py: killed mid-save and rerun, bit for bit the uninterrupted local run, metrics.jsonl
one row per step; a SIGTERM saves and exits 0, and the rerun is bitwise too; one writer, a stale lock taken
over, a lease taken over stops its old holder; a checkpoint without its commit marker never read; a corrupt
one set aside by a copy (no rename), and moved back by `ckpt.py restore-quarantined`; the --profile trace,
which XProf and Perfetto read; every command's paths in and out of the bucket. And the bucket's weather: a
503, a reset and a lost answer on every kind of request, outages shorter and longer than --storage_patience,
503s throughout a restore, an account that may only read."""

import gzip
import json
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
import types
import urllib.parse
import uuid
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
import servers
from commands import COMPARED, STEPS, rows, run

import ckpt
import data
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent


def final_arrays(run_dir, step=STEPS) -> list:
    ckpts = ckpt.Checkpoints(run_dir, read_only=True)
    try:
        return jax.tree.leaves(ckpts.read(step)[:2])
    finally:
        ckpts.close()


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


def is_train_step(event) -> bool:
    """A train step's call in a trace: PjitFunction(jit(train_step)) as the loop calls it, compiled before."""
    return event == "PjitFunction(jit(train_step))"


def assert_trace_opens(files: dict[str, bytes]):
    """A --profile trace (its files by name) as XProf reads it (the XSpace protobuf) and as Perfetto does (the
    Chrome trace JSON): both hold the traced train steps."""
    xplane = next(data for name, data in files.items() if name.endswith(".xplane.pb"))
    space = jax.profiler.ProfileData.from_serialized_xspace(xplane)
    events = [e.name for plane in space.planes for line in plane.lines for e in line.events]
    assert sum(map(is_train_step, events)) >= 2
    perfetto = next(data for name, data in files.items() if name.endswith("perfetto_trace.json.gz"))
    names = [e.get("name") for e in json.loads(gzip.decompress(perfetto))["traceEvents"]]
    assert sum(map(is_train_step, names)) >= 2


@pytest.fixture
def bucket(gcs_emulator):
    return gcs_emulator.create_bucket(f"runs-{uuid.uuid4().hex[:12]}")


@pytest.mark.slow
def test_a_run_on_gcs_killed_mid_save_resumes_bitwise_and_sets_aside_a_corrupt_checkpoint(
    tiny_data, uninterrupted, bucket, capsys, tmp_path
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
    # ... and rows 4-6 stored before the kill dropped, then retaken
    assert_same_as_reference(url, uninterrupted)
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
    assert_same_as_reference(url, uninterrupted)
    steps = {n.split("/")[0] for n in names_under(bucket, "runs/tiny/checkpoints/") if n.count("/") == 1}
    assert steps == {"9", "12"}  # --keep_last 2: the older steps removed from the bucket
    readers_take_gs(url, uninterrupted, tiny_data, bucket, tmp_path)


@pytest.mark.slow
def test_sigterm_on_gcs_saves_at_the_next_step_exits_0_and_the_rerun_is_bitwise(
    tiny_data, uninterrupted, bucket
):
    """A preemption's SIGTERM to a run on gs://. Once the run holds its lock (taken after its signal handler
    is in place), before its first step: it exits 0 at once, its lock released (a restart on other hosts need
    not wait out the lease). Once it has saved step 3: it saves at the next step boundary and exits 0, and
    the rerun resumes there and ends bit for bit the uninterrupted run."""
    url = f"gs://{bucket.name}/run"
    for sign_of_it in ("run/lock", f"run/checkpoints/3/{ckpt.COMMIT_MARKER}"):
        proc = run(url, tiny_data, wait=False)
        deadline = time.time() + 300
        while not bucket.blob(sign_of_it).exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr[-3000:]
        assert not bucket.blob("run/lock").exists()
    assert "exiting for the preemption" in stdout, stderr[-3000:]
    [saved] = [r["step"] for r in ckpt.list_checkpoints(url)][-1:]
    assert 1 <= saved < STEPS and [r["step"] for r in rows(url) if "loss" in r] == list(range(1, saved + 1))
    out = run(url, tiny_data)
    assert out.returncode == 0 and f"(step {saved})" in out.stdout, out.stderr[-3000:]
    assert_same_as_reference(url, uninterrupted)
    # The goodput account, written and read in the bucket: every step kept, none trained twice (a SIGTERM
    # saves the step it stops at), the parts summing to the wall time; its plot drawn there.
    account = ckpt.goodput_account(ckpt.goodput_records(f"{url}/goodput.jsonl"))
    assert account["steps_kept"] == STEPS and account["steps_retaken"] == 0 and len(account["starts"]) >= 2
    assert account["kept_s"] + sum(account["badput_s"].values()) == pytest.approx(account["wall_s"])
    assert ckpt.main(["goodput", url]) == 0 and bucket.blob("run/goodput.png").exists()


def readers_take_gs(url: str, reference, tiny_data, bucket, tmp_path):
    """Every command that takes a path takes gs://, in and out: train.py --init_from a run (here with
    --eval_only, which adds its row to a gs:// run's metrics.jsonl) and an HF directory in the bucket; ckpt.py's
    to-hf (out to the bucket too), from-hf (in from it) and average (out to it); bench/compare.py on a run and
    an HF directory there, ours and transformers'. A place nothing can write is refused before a read."""
    out = run(f"gs://{bucket.name}/scored", tiny_data, "--init_from", f"{url}@9", "--eval_only")
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"starting from {url}@9" in out.stdout and "held-out evaluation" in out.stdout
    assert rows(f"gs://{bucket.name}/scored")[0]["eval_only"]
    assert ckpt.export_hf(url, tmp_path / "hf") == STEPS and (tmp_path / "hf" / "model.safetensors").exists()
    hf = f"gs://{bucket.name}/hf"
    assert ckpt.main(["to-hf", url, hf]) == 0
    assert data.listing(hf) == sorted(os.listdir(tmp_path / "hf"))  # the same files as the local export
    assert ckpt.main(["from-hf", hf, f"gs://{bucket.name}/imported"]) == 0
    imported, final = final_arrays(f"gs://{bucket.name}/imported", step=0), final_arrays(url)
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(imported, final, strict=False))
    out = run(f"gs://{bucket.name}/from-hf", tiny_data, "--init_from", hf, "--eval_only")
    assert out.returncode == 0 and f"starting from {hf} (hf: weights only" in out.stdout, out.stderr[-3000:]
    assert ckpt.average(url, reference, f"gs://{bucket.name}/soup") == (STEPS, STEPS)  # the run, twice
    soup = final_arrays(f"gs://{bucket.name}/soup", step=0)
    for a, b in zip(soup, final_arrays(reference)[: len(soup)], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    tokens = np.arange(64) % 100
    sides = (url, reference, hf, f"transformers:{hf}")
    ours, theirs, in_hf, transformers = (next(compare.side(str(where))[1](tokens, 64)) for where in sides)
    assert np.array_equal(ours, theirs) and np.array_equal(ours, in_hf)
    np.testing.assert_allclose(transformers, ours, rtol=1e-4, atol=1e-4)  # fp32: another library's sums
    for argv in (
        ["to-hf", url, "http://host/out"],
        ["average", url, str(reference), f"s3://{bucket.name}/x"],
    ):
        assert ckpt.main(argv) == 1


def names_under(bucket, prefix: str) -> set[str]:
    return {blob.name.removeprefix(prefix) for blob in bucket.list_blobs(prefix=prefix)}


@pytest.mark.slow
def test_a_folder_that_renames_no_directory_commits_and_resumes_bitwise(tiny_data, uninterrupted, tmp_path):
    """gcsfuse on a flat bucket refuses to rename a directory (EXDEV): Orbax's default commit, a rename of the
    step's temporary folder, would fail at the first save. Committed by marker, it never renames one."""
    run_dir = tmp_path / "mounted"
    out = run(
        run_dir,
        tiny_data,
        "--profile",
        "2:2",
        fault="during_save:6",
        script="gcsfuse.py",
        env={"NO_DIR_RENAMES": str(run_dir)},
    )
    assert out.returncode == -signal.SIGKILL, out.stderr[-3000:]
    assert ckpt.Checkpoints(run_dir, read_only=True).steps() == [3]
    out = run(run_dir, tiny_data, script="gcsfuse.py", env={"NO_DIR_RENAMES": str(run_dir)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "(step 3)" in out.stdout
    assert_same_as_reference(run_dir, uninterrupted)
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


@pytest.mark.parametrize("started", [False, True])
def test_a_signal_as_the_lock_is_taken_leaves_no_lock_behind(bucket, monkeypatch, started):
    """A SIGTERM (here KeyboardInterrupt, as the handler's exception) lands as the lock's renewer starts:
    before the thread ran, or once it did. Either way the signal is what propagates and the lock is gone."""

    class CutShort(threading.Thread):
        def start(self):
            if started:
                super().start()
            raise KeyboardInterrupt

    # ckpt's threads only: the emulator in this process starts one for each request it answers
    monkeypatch.setattr(ckpt, "threading", types.SimpleNamespace(**vars(threading) | {"Thread": CutShort}))
    with pytest.raises(KeyboardInterrupt):
        ckpt.RunLock(f"gs://{bucket.name}/run").__enter__()
    assert not bucket.blob("run/lock").exists()


def test_a_lock_renewal_rides_out_an_outage_shorter_than_the_lease(bucket, gcs_proxy):
    """The bucket out for 2 s as the holder renews its lease: the renewal waits it out and lands, at the
    generation the lock was written at, so the lock stays this process's."""
    url = f"gs://{bucket.name}/lease"
    with ckpt.RunLock(url) as held:
        before = held.generation
        with gcs_proxy.outage(seconds=2):
            held.renew()
        assert held.generation != before and any(status == 503 for *_, status in gcs_proxy.log)
        assert json.loads(bucket.blob("lease/lock").download_as_text()) == held.held


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


# ---- A bucket's weather: every request through the one storage layer's policy, behind the tests' FaultProxy


def in_bucket(bucket, tiny_data) -> list[str]:
    """The tiny corpus copied into the bucket, and the flags that train on it there (instead of --data tiny):
    the same files in the same order, so the same batches."""
    prepared = data.prepare_tiny(str(tiny_data))
    for f in map(Path, prepared["train"] + prepared["val"]):
        bucket.blob(f"corpus/{f.parent.name}/{f.name}").upload_from_filename(f)
    corpus = f"gs://{bucket.name}/corpus"
    return ["--data", f"{corpus}/train/*.npy", "--eval_data", f"tiny-val={corpus}/val/*.npy"]


def under_checkpoints(method, path, body) -> bool:
    """A request (of any kind) on a checkpoint's objects."""
    return "checkpoints/" in urllib.parse.unquote(path) + urllib.parse.unquote(body[:2048].decode("latin-1"))


def checkpoint_write(method, path, body) -> bool:
    return method in ("POST", "PUT") and path.startswith("/upload/") and under_checkpoints(method, path, body)


def outage_after(proxy, match, seconds: float) -> None:
    """An outage of `seconds`, begun once a request that `match` holds for has been let through."""

    def start(method, path, body):
        if match(method, path, body):
            threading.Thread(target=proxy.outage, args=(seconds,)).start()
        return False  # (this rule never answers a request itself)

    proxy.fail(start, times=1)


def marker(step: int):
    """The upload of checkpoint `step`'s commit marker."""
    name = f"checkpoints/{step}/commit_success.txt"
    return lambda method, path, body: method in ("POST", "PUT") and name in urllib.parse.unquote(path)


@pytest.mark.slow
def test_a_run_rides_out_a_503_a_reset_and_a_lost_answer_on_every_kind_of_request_and_a_short_outage_bitwise(
    tiny_data, uninterrupted, bucket, gcs_proxy
):
    """Each kind of request a run makes of a bucket (the lock, the metrics' appends, the run files, the
    checkpoints' writes, listings, metadata and deletes, the data's reads) is answered once 503, once by a
    reset and once with its answer lost after it was done; and the bucket is out for 3 s after checkpoint 6.
    The run rides it all out and is the uninterrupted local run bit for bit, each metrics row once."""
    url = f"gs://{bucket.name}/weather"
    kinds = {
        "lock": servers.CREATE_IF_ABSENT,
        "append": servers.COMPOSE,
        "run file": servers.upload("weather/config.json"),
        "checkpoint write": checkpoint_write,
        "listing": servers.LIST,
        "read": servers.READ,
        "metadata": servers.METADATA,
        "delete": servers.DELETE,
    }
    for match in kinds.values():
        for how in ("503", "reset", "lost"):
            gcs_proxy.fail(match, times=1, how=how)
    outage_after(gcs_proxy, marker(6), seconds=3)
    out = run(url, tiny_data, *in_bucket(bucket, tiny_data))
    assert out.returncode == 0, out.stderr[-3000:]
    assert [rule[1] for rule in gcs_proxy.rules[: 3 * len(kinds)]] == [0] * 3 * len(kinds)  # each one met
    assert sum(status == 503 for *_, status in gcs_proxy.log) > len(kinds)  # the outage's too
    assert_same_as_reference(url, uninterrupted)


@pytest.mark.slow
def test_an_outage_longer_than_the_patience_stops_in_one_line_and_the_rerun_loses_nothing(
    tiny_data, uninterrupted, bucket, gcs_proxy, tmp_path
):
    """The bucket out past --storage_patience (3 s here) while step 8 runs: the run stops (exit 1) in one line
    naming a gs:// URL, the last answer and how long it tried, no traceback; nothing committed is touched,
    nothing set aside; run again once the bucket answers, it resumes from checkpoint 6, bit for bit."""
    url, go = f"gs://{bucket.name}/outage", tmp_path / "go"
    proc = run(
        url, tiny_data, "--storage_patience", "3", fault="hold:7", wait=False, env={"FAULT_GO": str(go)}
    )
    deadline = time.time() + 300
    while not bucket.blob("outage/checkpoints/6/commit_success.txt").exists():
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    with gcs_proxy.outage():
        go.touch()
        stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    said = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.search(
        r"gs://\S+: .*no answer but transient ones .*503 Service Unavailable.*storage_patience 3", said[0]
    )
    assert [r["step"] for r in ckpt.list_checkpoints(url)] == [3, 6]
    assert not names_under(bucket, "outage/quarantined/")
    out = run(url, tiny_data)
    assert out.returncode == 0 and "(step 6)" in out.stdout, out.stderr[-3000:]
    assert_same_as_reference(url, uninterrupted)


def two_checkpoints(url: str) -> list:
    """Steps 1 and 2 of the tiny model (weights only, as `ckpt.py from-hf` writes them) in a run directory:
    their arrays."""
    cfg = train.model_config(train.PRESETS["tiny"])
    models = [olmo3.Olmo3(cfg, key=jax.random.key(k)) for k in (1, 2)]
    with ckpt.RunLock(url):
        saver = ckpt.Checkpoints(url)
        for step, model in enumerate(models, 1):
            saver.save(step, model, None, {"model": ckpt.config_to_hf(cfg)})
        saver.close()
    return [jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in models]


def test_an_export_cut_off_by_an_outage_is_finished_by_the_same_command(
    bucket, gcs_proxy, tmp_path, capsys, monkeypatch
):
    """`ckpt.py to-hf` into a bucket that goes out after the export's first files stops in one line, config.json
    (written last) unwritten; once the bucket answers, the same command writes the export whole: the files of
    the export into a local directory, byte for byte."""
    monkeypatch.setattr(data, "PATIENCE_S", data.PATIENCE_S)  # (ckpt.main sets it)
    run_dir, out = tmp_path / "run", f"gs://{bucket.name}/hf"
    ckpt.write_first_step(str(run_dir), olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0)), None)
    assert ckpt.main(["to-hf", str(run_dir), str(tmp_path / "hf")]) == 0  # in fair weather, locally
    outage_after(gcs_proxy, servers.upload("hf/generation_config.json"), seconds=None)
    assert ckpt.main(["to-hf", str(run_dir), out, "--storage_patience", "0.2"]) == 1
    gcs_proxy.clear()
    err = capsys.readouterr().err
    assert err.startswith(f"error: {out}/config.json: ") and err.count("\n") == 1, err
    assert names_under(bucket, "hf/") == {"model.safetensors", "generation_config.json"}  # cut short
    assert ckpt.main(["to-hf", str(run_dir), out]) == 0, capsys.readouterr().err
    local = {p.name: p.read_bytes() for p in (tmp_path / "hf").iterdir()}
    assert {
        name: bucket.blob(f"hf/{name}").download_as_bytes() for name in names_under(bucket, "hf/")
    } == local


def test_503s_throughout_a_restore_set_nothing_aside_and_roll_nothing_back(bucket, gcs_proxy, tiny_data):
    """Every read of a checkpoint's objects (their listing aside) answered 503 while a run restores: it stops in
    one line naming the checkpoint's object and the outage; it moves nothing to quarantined/ and never falls back to the older one.
    Once the bucket answers, the run resumes from the newest."""
    url = f"gs://{bucket.name}/restore"
    two_checkpoints(url)
    read = lambda m, p, b: (servers.READ(m, p, b) or servers.METADATA(m, p, b)) and under_checkpoints(m, p, b)
    gcs_proxy.fail(read, times=10**6, how="503")
    out = run(url, tiny_data, "--steps", "2", "--storage_patience", "2")
    assert out.returncode == 1, out.stderr[-3000:]
    said = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and said[0].startswith(f"error: {url}/checkpoints/"), out.stderr[-3000:]
    assert "no answer but transient ones" in said[0] and "503 Service Unavailable" in said[0]
    assert "Traceback" not in out.stderr and "resuming" not in out.stdout
    gcs_proxy.clear()
    assert not names_under(bucket, "restore/quarantined/")
    assert [r["step"] for r in ckpt.list_checkpoints(url)] == [1, 2]
    out = run(url, tiny_data, "--steps", "2")
    assert out.returncode == 0 and "run already complete: step 2" in out.stdout, out.stderr[-3000:]


def test_orbax_detail_that_cannot_reach_log_txt_is_dropped_in_one_line(
    bucket, gcs_proxy, capsys, monkeypatch
):
    """While the bucket is down, Orbax's failure detail (its log records, the late report of its closed event
    loop) cannot reach RUN_DIR/log.txt: each piece is tried once, not for a patience (which would delay the
    stop), and dropped; one line says so, never a traceback. Once the bucket answers, detail reaches the log."""
    log, absl = f"gs://{bucket.name}/detail/log.txt", logging.getLogger("absl")
    for owner, name in [(sys, "unraisablehook"), (absl, "propagate"), (data, "PATIENCE_S")]:
        monkeypatch.setattr(owner, name, getattr(owner, name))  # restored after the test
    monkeypatch.setattr(absl, "handlers", list(absl.handlers))
    data.set_patience(5)
    ckpt._orbax_detail_to(log)
    closed = RuntimeError("Event loop is closed")
    late = types.SimpleNamespace(exc_type=RuntimeError, exc_value=closed, exc_traceback=None, object=None)
    start = time.monotonic()
    with gcs_proxy.outage():
        for _ in range(2):
            try:
                raise ValueError("UNAVAILABLE: reading an array")
            except ValueError:
                absl.exception("Orbax's detail")
            sys.unraisablehook(late)
    assert time.monotonic() - start < data.PATIENCE_S  # four pieces, none waited a patience
    dropped = f"also: Orbax's failure detail dropped: {log} not written (503 Service Unavailable)"
    assert capsys.readouterr().err.splitlines() == [dropped]
    absl.error("after the outage")
    assert data.read_text(log).endswith("after the outage\n") and not capsys.readouterr().err


def test_a_restore_cut_off_by_an_outage_is_named_and_stops_in_one_patience(bucket, gcs_proxy, tiny_data):
    """The bucket goes out as a run that holds its lock reads its newest checkpoint: the restore is the failure
    named, in the one error line; the lock's release, tried once (the patience is spent), an `also:` line; no
    traceback. Nothing is set aside."""
    url = f"gs://{bucket.name}/cut"
    two_checkpoints(url)
    locked = []

    def once_locked_an_array_read(method, path, body):
        if servers.CREATE_IF_ABSENT(method, path, body) and b"cut/lock" in body:
            locked.append(path)
        return bool(locked) and servers.READ(method, path, body) and "manifest" in path

    outage_after(gcs_proxy, once_locked_an_array_read, seconds=10**6)  # (gcs_proxy ends it after the test)
    out = run(url, tiny_data, "--steps", "2", "--storage_patience", "2")
    said = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 1 and len(said) == 1, out.stderr[-3000:]
    assert said[0].startswith(f"error: {url}/checkpoints/2") and "no answer but transient ones" in said[0]
    assert f"also: {url}/lock not released (503 Service Unavailable)" in out.stderr
    for trace in ("Traceback", "Logging error", "Exception ignored"):
        assert trace not in out.stderr, out.stderr[-3000:]
    assert sum(status == 503 for _, path, status in gcs_proxy.log if "cut%2Flock" in path) == 1  # tried once
    gcs_proxy.clear()
    assert [r["step"] for r in ckpt.list_checkpoints(url)] == [1, 2] and not names_under(
        bucket, "cut/quarantined/"
    )


def test_a_read_only_account_reads_a_finished_run_and_scores_it_without_a_write(
    uninterrupted, bucket, gcs_proxy, tiny_data
):
    """An account that may only read (403 on every write): a finished run in its bucket is read without a
    write, as on a read-only mount, and --eval_only prints its table, with one line saying the row could not be
    recorded. Only the probes that learn so are refused; nothing is written."""
    url = f"gs://{bucket.name}/finished"
    data.copy_tree(str(uninterrupted), url)
    before = data.read_text(f"{url}/metrics.jsonl")
    gcs_proxy.clear()
    gcs_proxy.read_only()
    out = run(url, tiny_data)
    assert out.returncode == 0 and f"run already complete: step {STEPS}" in out.stdout, out.stderr[-3000:]
    out = run(url, tiny_data, "--eval_only")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "held-out evaluation" in out.stdout and "--eval_only: could not add this evaluation" in out.stdout
    writes = [entry for entry in gcs_proxy.log if entry[0] in servers.WRITES]
    assert writes and all(status == 403 for *_, status in writes)
    gcs_proxy.read_only(False)
    assert data.read_text(f"{url}/metrics.jsonl") == before and "lock" not in names_under(bucket, "finished/")


@pytest.mark.parametrize("where", ["local", "gs"])
def test_restore_quarantined_moves_a_checkpoint_set_aside_back(where, bucket, tmp_path):
    """A checkpoint whose bytes read back wrong once is set aside; when the fault was the storage's (its
    copy is sound), `ckpt.py restore-quarantined` moves it back, commit marker last, and it is read again."""
    url = f"gs://{bucket.name}/q" if where == "gs" else str(tmp_path / "q")
    saved = two_checkpoints(url)
    model_files = data.listing(f"{url}/checkpoints/2/model")
    file = f"{url}/checkpoints/2/model/" + max(
        model_files, key=lambda f: data.file_size(f"{url}/checkpoints/2/model/{f}")
    )
    sound = data.read_bytes(file)
    data.write_file(file, sound[:100] + bytes([sound[100] ^ 0x40]) + sound[101:])
    like = ckpt.on_first_device(olmo3.abstract(train.model_config(train.PRESETS["tiny"])))
    reader = ckpt.Checkpoints(url)
    assert reader.restore_latest(like)[0] == 1  # 2 set aside
    reader.close()
    [aside] = ckpt.quarantined_steps(url)
    data.write_file(file.replace("/checkpoints/2/", f"/quarantined/{aside}/"), sound)  # it was the storage
    assert ckpt.main(["restore-quarantined", url]) == 0
    assert ckpt.quarantined_steps(url) == [] and ckpt.main(["restore-quarantined", url, "2"]) == 1
    reader = ckpt.Checkpoints(url, read_only=True)
    step, model, _, _ = reader.restore_latest(like)
    reader.close()
    assert step == 2
    for a, b in zip(jax.tree.leaves(eqx.filter(model, eqx.is_array)), saved[1], strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
