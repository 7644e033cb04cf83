"""Every URL judged where the storage layer takes it, before anything is read or written: train.py's flags and
ckpt.py's arguments alike. A URL with no bucket is bad usage (exit 2, one line naming the flag and the form); so
is a name that a URL would cut (# a fragment, ? a query) or that Orbax would change ([ ], empty, . and ..
folders); every other character an object name may hold works end to end, on a Cloud Storage emulator; a
bucket that does not exist is named as such (exit 1), for inputs and outputs, before any input is read."""

import uuid
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from commands import ckpt_py, in_process

import ckpt
import data
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent


def train_refused(tmp_path, *flags):
    """train.py on a token file that does not exist, with `flags`: refused before it is looked for, or not."""
    base = ["--preset", "tiny", "--data", str(tmp_path / "none.npy"), "--run_dir", str(tmp_path / "run")]
    return in_process(train.cli, [*base, *flags])


def assert_one_line(out, code: int, message: str):
    assert out.returncode == code and out.stderr == f"error: {message}\n", (
        out.returncode,
        out.stderr[-2000:],
    )


def test_a_url_with_no_bucket_is_refused_in_one_line_naming_the_flag_and_the_form(tmp_path):
    cases = [
        (["--run_dir", "gs://"], "--run_dir gs://: no bucket; expected gs://BUCKET/PATH"),
        (["--run_dir", "gs:///runs/x"], "--run_dir gs:///runs/x: no bucket; expected gs://BUCKET/PATH"),
        (["--data", "gs:///corpus/*.npy"], "--data gs:///corpus/*.npy: no bucket; expected gs://BUCKET/PATH"),
        (
            ["--eval_data", "c4=s3:///c4.npy"],
            "--eval_data s3:///c4.npy: no bucket; expected s3://BUCKET/PATH",
        ),
        (["--data_root", "s3://"], "--data_root s3://: no bucket; expected s3://BUCKET/PATH"),
        (
            ["--init_from", "gs:///runs/x@3"],
            "--init_from gs:///runs/x@3: no bucket; expected gs://BUCKET/PATH",
        ),
        (["--data", "https:///x.npy"], "--data https:///x.npy: no host; expected https://HOST/PATH"),
    ]
    for flags, message in cases:
        assert_one_line(train_refused(tmp_path, *flags), 2, message)
    assert not (ROOT / "gs:").exists() and not (tmp_path / "run").exists()
    run, hf = tmp_path / "run", tmp_path / "hf"
    for args, message in [
        (["list", "gs:///runs/x"], "RUN_DIR gs:///runs/x: no bucket"),
        (["restore-quarantined", "gs://"], "RUN_DIR gs://: no bucket"),
        (["to-hf", run, "gs:///hf"], "OUT gs:///hf: no bucket"),
        (["from-hf", hf, "gs://"], "RUN_DIR gs://: no bucket"),
        (["from-hf", "gs:///hf", run], "HF_DIR gs:///hf: no bucket"),
        (["average", run, run, "gs:///soup"], "OUT gs:///soup: no bucket"),
    ]:
        assert_one_line(ckpt_py(*args), 2, f"{message}; expected gs://BUCKET/PATH")


def test_a_name_a_url_would_cut_or_orbax_change_is_refused_in_one_line(tmp_path):
    """# and ? (a URL's fragment and query), [ ] (which Orbax's way to TensorStore does not keep), control
    characters, and empty, . or .. folders (which Orbax normalises away): each refused, naming the flag. In
    --data and --eval_data, ? [ ] of a bucket's glob are a pattern (expand), and taken."""
    for name in ["a b#c", "a?b", "a[1]", "a\nb", "a\x7fb", "/a", "./a", "../a", "a/./b", "a//b", "a/../b"]:
        url = f"gs://bkt/runs/{name}"
        for value, flag, pattern in [(url, "--run_dir", False), (f"{url}/x.npy", "--data", True)]:
            if pattern and set(name) & set("?[]"):
                data.check_url(value, flag, pattern)  # a glob
                continue
            with pytest.raises(data.BadURL) as e:
                data.check_url(value, flag, pattern)
            message, shown = str(e.value), value.replace("\n", "\\x0a").replace("\x7f", "\\x7f")
            assert message.startswith(f"{flag} {shown}: ") and "\n" not in message, message
            assert "expected a name without # " in message or "expected gs://BUCKET/PATH without" in message
    for url in ["http://host/x.npy?sig=1", "https://host/a#b.npy", "http://host/c[1].npy"]:
        with pytest.raises(data.BadURL, match="expected a name without # . \\[ \\]"):
            data.check_url(f"c4={url}", "--eval_data", pattern=True)
    assert_one_line(
        train_refused(tmp_path, "--run_dir", "gs://bkt/runs/a b#c"),
        2,
        "--run_dir gs://bkt/runs/a b#c: '#' is not kept alike by every client (a URL reads # as a fragment, ? "
        "as a query; Orbax does not keep [ ]); expected a name without # ? [ ] or control characters",
    )
    out = ckpt_py("to-hf", tmp_path / "run", "gs://bkt/hf?x")
    assert out.returncode == 2 and out.stderr.startswith("error: OUT gs://bkt/hf?x: '?' is not kept alike")


# Every other printable character an object name may hold, in one run directory's name.
ODD_NAME = "runs/a b%20c+d&e=f;g,h@i:j'k\"l!m$n(o)p~q*r\\s-ü€日本"


def test_every_other_character_of_an_object_name_works_end_to_end(gcs_emulator):
    """A run directory whose name holds them all: a file written and read back, a log appended to, a lock, a
    checkpoint saved, listed and restored, every object of it at its own name inside the run directory."""
    bucket = gcs_emulator.create_bucket(f"odd-{uuid.uuid4().hex[:12]}")
    url = f"gs://{bucket.name}/{ODD_NAME}"
    data.check_url(url, "--run_dir")
    data.write_file(f"{url}/f.txt", "hello")
    data.append(f"{url}/log.txt", "one\n")
    data.append(f"{url}/log.txt", "two\n")
    assert data.read_text(f"{url}/f.txt") == "hello" and data.read_text(f"{url}/log.txt") == "one\ntwo\n"
    cfg = train.model_config(train.PRESETS["tiny"])
    numbers = np.random.default_rng(3)  # (the model's own init takes seconds, outside a jit)
    fill = lambda like: jax.numpy.asarray(numbers.standard_normal(like.shape), like.dtype)
    model = jax.tree.map(lambda x: fill(x) if olmo3.is_array(x) else x, olmo3.abstract(cfg))
    with ckpt.RunLock(url):
        saver = ckpt.Checkpoints(url)
        saver.save(1, model, None, {"model": ckpt.config_to_hf(cfg)})
        saver.close()
    out = ckpt_py("list", url)
    assert out.returncode == 0 and out.stdout.splitlines()[1].split()[0] == "1", out.stderr[-2000:]
    like = ckpt.on_first_device(olmo3.abstract(cfg))
    reader = ckpt.Checkpoints(url, read_only=True)
    step, restored, _, _ = reader.restore_latest(like)
    reader.close()
    assert step == 1
    for a, b in zip(*(jax.tree.leaves(eqx.filter(m, eqx.is_array)) for m in (restored, model)), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    names = [blob.name for blob in bucket.list_blobs()]
    assert all(name.startswith(ODD_NAME + "/") for name in names), names
    inside = {name.removeprefix(ODD_NAME + "/") for name in names}
    assert {"f.txt", "log.txt", "checkpoints/1/commit_success.txt"} <= inside
    assert any(name.startswith("checkpoints/1/model/") and "/d/" in name for name in inside)  # the arrays


def test_a_missing_bucket_is_named_for_inputs_and_outputs_before_any_input_is_read(
    tmp_path, gcs_emulator, s3_server
):
    """A bucket that does not exist, in any flag or argument, read or written: `gs://BUCKET: no such bucket`
    (exit 1), named before the inputs are read (here they do not exist either, and are not the error)."""
    gone = f"gone-{uuid.uuid4().hex[:12]}"
    for flags, url in [
        (["--run_dir", f"gs://{gone}/runs/x"], f"gs://{gone}"),
        (["--data", f"gs://{gone}/corpus/*.npy"], f"gs://{gone}"),
        (["--eval_data", f"c4=s3://{gone}/c4.npy"], f"s3://{gone}"),
        (["--init_from", f"gs://{gone}/runs/x@3"], f"gs://{gone}"),
    ]:
        value = flags[1].removeprefix("c4=")
        assert_one_line(train_refused(tmp_path, *flags), 1, f"{flags[0]} {value}: {url}: no such bucket")
    run = tmp_path / "nowhere"
    for args, named in [
        (["list", f"gs://{gone}/run"], "RUN_DIR"),
        (["restore-quarantined", f"gs://{gone}/run"], "RUN_DIR"),
        (["to-hf", run, f"gs://{gone}/hf"], "OUT"),
        (["from-hf", run, f"gs://{gone}/run"], "RUN_DIR"),
        (["average", run, run, f"gs://{gone}/soup"], "OUT"),
    ]:
        assert_one_line(ckpt_py(*args), 1, f"{named} {args[-1]}: gs://{gone}: no such bucket")
    with pytest.raises(ckpt.RunDirError, match="no such bucket"):  # the storage layer's own word for it
        ckpt.RunLock(f"gs://{gone}/run").__enter__()
