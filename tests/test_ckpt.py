"""ckpt.py: Orbax checkpoints (checksums, restores onto another mesh, failed saves, the walk back past corrupt
ones), the run directory (lock, log.txt, the loss plot, the metrics log's W&B run read back from what wandb
wrote offline), Hugging Face conversion against transformers, and the command line. Kill-and-resume through
train.py is tests/test_resume.py's."""

import dataclasses
import importlib.util
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import ckpt_py
from damage import flip_byte, truncate
from hf_models import FULL, hf_logits, make_hf
from transformers import Olmo3ForCausalLM

import ckpt
import data
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
SMALL = dataclasses.replace(olmo3.MODELS["tiny"], n_layers=2, layer_types=(olmo3.SLIDING, olmo3.FULL))


def tokens(n=40, vocab=300, seed=0, batch=2):
    return np.random.default_rng(seed).integers(0, vocab, (batch, n))


def rel_err(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def saved_run(run_dir, tiny_data, steps=(9, 12)):
    """A run directory as train.py leaves it, written here: the SMALL model and a stand-in optimizer state at
    `steps`, the tiny tokenizer beside them. Returns the model."""
    model = olmo3.Olmo3(SMALL, key=jax.random.key(1))
    state = {"mu": jax.random.normal(jax.random.key(2), (256, 256))}
    meta = {"model": ckpt.config_to_hf(SMALL), "config": {"tokenizer": "tiny"}}
    saver = ckpt.Checkpoints(run_dir)
    for step in steps:
        saver.save(step, model, state, meta)
    saver.close()
    shutil.copy(tiny_data / "tokenizer.json", Path(run_dir) / "tokenizer.json")
    return model


def tree(path: Path) -> dict:
    """Every file and folder under path, with its bytes and modification time: to check a command wrote nothing."""
    return {
        p: (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))
    }


# ---- Orbax checkpoints


@pytest.mark.slow
def test_restore_onto_another_mesh_is_bitwise(tmp_path):
    cfg = train.PRESETS["tiny"]
    mcfg = olmo3.MODELS["tiny"]
    abstract = olmo3.abstract(mcfg)
    abstract_opt = eqx.filter_eval_shape(train.init_opt, abstract, cfg)

    def on(mesh_spec):
        mesh = shard.make_mesh(mesh_spec)
        return shard.shardings(abstract, mesh), shard.shardings(abstract_opt, mesh)

    model_sh, opt_sh = on("fsdp=4,tensor=2")
    model = eqx.filter_jit(lambda k: eqx.filter_shard(olmo3.Olmo3(mcfg, key=k), model_sh))(jax.random.key(3))
    opt = train.init_opt(model, cfg)
    opt = dataclasses.replace(opt, mu=jax.tree.map(lambda w: w * 0.5, eqx.filter(model, eqx.is_array)))
    opt = eqx.filter_shard(opt, opt_sh)
    saver = ckpt.Checkpoints(tmp_path)
    saver.save(5, model, {"opt": opt}, {"note": "8 devices"})
    saver.close()
    for spec in ["fsdp=4", "data=1", "tensor=2"]:
        m_sh, o_sh = on(spec)
        like_model = shard.abstract(abstract, m_sh)
        like_opt = shard.abstract(abstract_opt, o_sh)
        got_model, got_train, meta = ckpt.Checkpoints(tmp_path).read(5, like_model, {"opt": like_opt})
        assert meta["note"] == "8 devices"
        for a, b in zip(
            jax.tree.leaves((model, opt)), jax.tree.leaves((got_model, got_train["opt"])), strict=True
        ):
            if isinstance(a, jax.Array):
                assert np.array_equal(np.asarray(a), np.asarray(b)), spec
                assert b.sharding.mesh.size == shard.make_mesh(spec).size


def test_checksums_do_not_depend_on_sharding():
    x = jax.random.normal(jax.random.key(0), (64, 32))
    mesh = shard.make_mesh("fsdp=8")
    sharded = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp")))
    assert int(ckpt.checksums(x)) == int(ckpt.checksums(sharded))
    y = np.asarray(x).copy()
    y.reshape(-1).view(np.uint8)[100] ^= 1  # one flipped bit
    assert int(ckpt.checksums(jax.numpy.asarray(y))) != int(ckpt.checksums(x))


def test_a_failed_save_is_removed_even_when_another_of_its_writers_comes_late(tmp_path, monkeypatch):
    """Orbax reports a save's first failing item while another may still be writing, which makes its folders
    again: as the optimizer state's writer can after the model's has failed (seen in CI, rarely)."""
    saver = ckpt.Checkpoints(tmp_path)
    late = tmp_path / "checkpoints" / "6" / "train" / "d"  # written in place; committed by a marker, never

    def write_late():
        time.sleep(0.3)
        late.mkdir(parents=True)
        (late / "part").write_bytes(b"x" * 1000)

    def fails():
        raise OSError("File too large")

    (tmp_path / "checkpoints" / "6" / "model").mkdir(parents=True)
    writer = threading.Thread(target=write_late)
    writer.start()
    saver.saving = 6  # save 6 is in flight, and its background write has failed
    monkeypatch.setattr(saver.manager, "wait_until_finished", fails)
    with pytest.raises(
        ckpt.CheckpointError, match="saving checkpoint 6 to .* failed: OSError: File too large"
    ):
        saver.wait()
    writer.join()
    assert not (tmp_path / "checkpoints" / "6").exists()
    monkeypatch.undo()
    saver.close()


def test_keep_last_below_two_is_refused(tmp_path):
    with pytest.raises(ValueError, match="keep at least 2"):
        ckpt.Checkpoints(tmp_path, keep_last=1)


def test_late_orbax_reports_go_to_the_log_and_any_other_is_printed(tmp_path, capsys, monkeypatch):
    # A damaged checkpoint fails one read; Orbax's other read coroutines are collected later and Python
    # reports each (it happens under load, so it is simulated here): the one-line summary stands alone.
    from orbax.checkpoint._src.serialization import serialization

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class Ours:
        def __del__(self):
            raise ValueError("ours")

    Ours()  # Python reports the error in __del__ as unraisable: the hook's real argument type
    (ours,) = seen
    coroutine = type("Coroutine", (), {"cr_code": serialization._read_array_index_and_device_put.__code__})
    error = ValueError("OUT_OF_RANGE: Error reading embed_tokens")
    orbax_read = type(ours)((ValueError, error, None, None, coroutine()))
    ckpt.Checkpoints(tmp_path).close()  # a writing Checkpoints sends Orbax's detail to RUN_DIR/log.txt
    log = tmp_path / "log.txt"
    sys.unraisablehook(orbax_read)
    assert capsys.readouterr().err == "" and "OUT_OF_RANGE" in log.read_text()
    sys.unraisablehook(ours)
    assert "ours" in capsys.readouterr().err and "ours" not in log.read_text()


def test_every_checkpoint_corrupt_is_refused_unless_starting_over(tmp_path, tiny_data, capsys):
    saved_run(tmp_path, tiny_data)
    for step in (9, 12):
        truncate(tmp_path / "checkpoints" / str(step))
    like = ckpt.on_first_device(olmo3.abstract(SMALL))
    with pytest.raises(ckpt.NoValidCheckpoint) as refused:
        ckpt.Checkpoints(tmp_path).restore_latest(like)
    quarantined = sorted(p.name for p in (tmp_path / "quarantined").iterdir())
    assert [q.split("-")[0] for q in quarantined] == ["12", "9"]  # set aside, never deleted
    assert all(q in str(refused.value) for q in quarantined) and "--start_over" in str(refused.value)
    assert capsys.readouterr().err.count("is corrupt") == 2
    with pytest.raises(ckpt.NoValidCheckpoint):  # the next start finds none either: it refuses again
        ckpt.Checkpoints(tmp_path).restore_latest(like)
    assert ckpt.Checkpoints(tmp_path).restore_latest(like, start_over=True) is None


def test_a_corrupt_newest_checkpoint_falls_back_to_the_one_before(tmp_path, tiny_data):
    model = saved_run(tmp_path, tiny_data)
    flip_byte(tmp_path / "checkpoints" / "12")
    step, got, _, _ = ckpt.Checkpoints(tmp_path).restore_latest(
        ckpt.on_first_device(olmo3.abstract(SMALL)), {"mu": ckpt.on_first_device(jnp.zeros((256, 256)))}
    )
    assert step == 9
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(model), strict=True)
    )


# ---- the run directory


def test_a_run_dir_that_is_a_file_is_refused_in_one_line(tmp_path):
    (tmp_path / "file").write_text("notes")
    with (
        pytest.raises(ckpt.RunDirError, match=f"--run_dir {tmp_path / 'file'} is a file"),
        ckpt.RunLock(tmp_path / "file"),
    ):
        pass
    with pytest.raises(ckpt.RunDirError, match="cannot create it"), ckpt.RunLock(tmp_path / "file" / "run"):
        pass
    assert (tmp_path / "file").read_text() == "notes"


def test_errors_that_stop_a_run_are_logged_where_the_run_directory_holds_a_run(tmp_path):
    def stop(error, run_dir, unless=()):
        with pytest.raises(type(error)), ckpt.errors_logged(run_dir, unless):
            raise error

    stop(ValueError("bad data at token 7"), tmp_path)  # before the run was accepted: no config.json yet
    assert sorted(tmp_path.iterdir()) == []
    (tmp_path / "config.json").write_text("{}")
    stop(ValueError("bad data at token 7"), tmp_path)
    log = (tmp_path / "log.txt").read_text()
    assert "ValueError: bad data at token 7" in log and "Traceback" in log
    stop(KeyError("usage"), tmp_path, unless=(KeyError,))  # refused before the run starts: not its story
    stop(ckpt.RunDirBusy("in use by another process"), tmp_path)  # another process's directory
    assert (tmp_path / "log.txt").read_text() == log
    stop(ValueError("typo"), tmp_path / "typo")
    assert not (tmp_path / "typo").exists()  # nothing is created to hold a log


# ---- Hugging Face conversion


def test_hf_round_trip(tmp_path):
    hf = make_hf(tmp_path / "in", heads=8, kv_heads=2, vocab=1000, yarn=YARN)
    model = ckpt.load_hf(tmp_path / "in")
    ckpt.save_hf(model, tmp_path / "out", shard_bytes=200_000)  # several shards and an index
    assert (tmp_path / "out" / "model.safetensors.index.json").exists()
    back = Olmo3ForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    ids = tokens(vocab=1000)
    np.testing.assert_array_equal(hf_logits(back, ids), hf_logits(hf, ids))
    assert back.config.rope_parameters[FULL]["rope_type"] == "yarn"


def test_round_trip_of_our_own_init_single_file(tmp_path):
    cfg = dataclasses.replace(olmo3.MODELS["tiny"], n_layers=4, vocab_size=8000)
    model = olmo3.Olmo3(cfg, key=jax.random.key(1))
    ckpt.save_hf(model, tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors").exists()
    hf = Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = tokens(vocab=8000)
    ours = np.asarray(jax.vmap(model)(jnp.asarray(ids)))[..., :8000]
    assert rel_err(ours, hf_logits(hf, ids)) <= 1e-5


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_load_hf_rejects_other_model_types(tmp_path):
    make_hf(tmp_path)
    edit_config(tmp_path, model_type="llama")
    with pytest.raises(ValueError, match="model_type is 'llama', expected 'olmo3'"):
        ckpt.load_hf(tmp_path)


def test_load_hf_rejects_unsupported_rope(tmp_path):
    make_hf(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"][FULL] = {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_type 'linear' on full_attention"):
        ckpt.load_hf(tmp_path)


def rewrite_weights(path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def test_load_hf_names_missing_extra_and_misshapen_tensors(tmp_path):
    make_hf(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        ckpt.load_hf(tmp_path)
    make_hf(tmp_path / "b")
    rewrite_weights(
        tmp_path / "b", lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)})
    )
    with pytest.raises(ValueError, match="unexpected tensors.*q_proj.bias"):
        ckpt.load_hf(tmp_path / "b")
    make_hf(tmp_path / "c")
    rewrite_weights(
        tmp_path / "c",
        lambda t: t.update({"model.layers.1.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}),
    )
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \[32, 64\], expected \[64, 64\]"):
        ckpt.load_hf(tmp_path / "c")


def test_train_py_refuses_a_damaged_hf_directory_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """`train.py --init_from HF_DIR` reads config.json and the files' headers before anything is written: a
    damaged directory, or a tensor missing, extra or of another shape, is refused in one line (exit 2), the
    run directory never made."""
    make_hf(tmp_path / "whole")
    monkeypatch.setitem(olmo3.MODELS, "hf-small", ckpt.read_hf_config(tmp_path / "whole"))
    np.random.default_rng(0).integers(0, 300, 4096, dtype=np.uint16).tofile(tmp_path / "tokens.npy")
    cases = list(damaged_hf_dirs(tmp_path / "damaged").values())
    for name, edit, says in [
        ("missing", lambda t: t.pop("model.layers.2.mlp.up_proj.weight"), "missing tensors ['model.layers.2"),
        ("extra", lambda t: t.update({"lm_head.bias": np.zeros(300, np.float32)}), "unexpected tensors"),
        (
            "misshapen",
            lambda t: t.update({"model.norm.weight": np.ones(32, np.float32)}),
            "model.safetensors",
        ),
    ]:
        shutil.copytree(tmp_path / "whole", tmp_path / name)
        rewrite_weights(tmp_path / name, edit)
        cases.append((tmp_path / name, f"{tmp_path / name}" + ("/" if name == "misshapen" else ": ") + says))
    run_dir = tmp_path / "run"
    argv = [
        "--preset",
        "tiny",
        "--model",
        "hf-small",
        "--data",
        str(tmp_path / "tokens.npy"),
        "--seq_len",
        "16",
    ]
    argv += ["--global_batch", "2", "--steps", "1", "--run_dir", str(run_dir)]
    capsys.readouterr()  # transformers' progress bars, making the directories
    for hf_dir, says in cases:
        assert train.cli([*argv, "--init_from", str(hf_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: --init_from {hf_dir}: {says}") and "\n" not in err, err
        assert not run_dir.exists()
    assert "tensor model.norm.weight has shape [32], expected [64]" in err


def damaged_hf_dirs(root: Path) -> dict[str, tuple[Path, str]]:
    """HF directories each damaged one way: (directory, the file the error must name and what it must say)."""
    out = {}
    for name in ("not_json", "no_fields", "truncated"):
        make_hf(root / name)
    (root / "not_json" / "config.json").write_text('{"model_type": "olmo3", "vocab_')
    out["not_json"] = (root / "not_json", f"{root / 'not_json' / 'config.json'}: not valid JSON")
    config = json.loads((root / "no_fields" / "config.json").read_text())
    (root / "no_fields" / "config.json").write_text(
        json.dumps({k: config[k] for k in ("model_type", "vocab_size")})
    )
    out["no_fields"] = (root / "no_fields", f"{root / 'no_fields' / 'config.json'}: no hidden_size")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size - 1000])
    out["truncated"] = (root / "truncated", f"{weights}: not a readable safetensors file")
    return out


def test_a_damaged_hf_directory_is_named_in_one_line(tmp_path):
    for hf_dir, says in damaged_hf_dirs(tmp_path).values():
        with pytest.raises(ValueError) as refused:
            ckpt.load_hf(hf_dir)
        assert str(refused.value).startswith(says) and "\n" not in str(refused.value)
        with pytest.raises(ValueError) as refused:  # train.py --init_from checks before anything compiles
            ckpt.check_hf(hf_dir, olmo3.MODELS["tiny"])
        assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


def test_save_hf_never_leaves_a_complete_looking_directory(tmp_path, monkeypatch):
    model = olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0))
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        ckpt.save_hf(model, tmp_path / "taken")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"

    written, write_file = [], data.write_file

    def disk_full(path, body):  # the first file fits; the disk fills on the second
        if written:
            raise OSError(28, "No space left on device")
        written.append(path)
        write_file(path, body)

    monkeypatch.setattr(data, "write_file", disk_full)
    with pytest.raises(OSError, match="No space"):
        ckpt.save_hf(model, tmp_path / "out")
    assert written and not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_save_hf_finishes_an_export_cut_short_and_keeps_any_other_directory(tmp_path):
    """A directory holding an export's files but no config.json (written last) is an export cut short (a
    bucket cut off mid-export leaves one), not an export: save_hf writes it whole, byte for byte the export
    into a new directory. One that holds config.json, or a file no export writes, is refused and kept."""
    model = olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0))
    extra = {"tokenizer.json": "{}", "tokenizer_config.json": "{}"}
    ckpt.save_hf(model, tmp_path / "whole", dtype="bfloat16", extra=extra)
    files = lambda folder: {p.name: p.read_bytes() for p in folder.iterdir()}
    whole = files(tmp_path / "whole")
    for name, left in {"cut": [], "foreign": ["notes.txt"], "done": ["config.json"]}.items():
        (tmp_path / name).mkdir()
        for file in ["model.safetensors", "generation_config.json", *left]:
            (tmp_path / name / file).write_bytes(whole.get(file, b"mine")[:1000])  # the weights cut short
    kept = {name: files(tmp_path / name) for name in ("foreign", "done")}
    ckpt.save_hf(model, tmp_path / "cut", dtype="bfloat16", extra=extra)
    assert files(tmp_path / "cut") == whole and not list(tmp_path.glob("*.tmp"))
    for name in ("foreign", "done"):
        with pytest.raises(FileExistsError, match=f"{tmp_path / name} exists and is not empty"):
            ckpt.save_hf(model, tmp_path / name, dtype="bfloat16", extra=extra)
        assert files(tmp_path / name) == kept[name]


# ---- the command line: list, to-hf, from-hf


@pytest.mark.slow
def test_list_shows_steps_and_validity_and_writes_nothing(tiny_data, tmp_path):
    run_dir = tmp_path / "run"
    saved_run(run_dir, tiny_data)
    before = tree(run_dir)
    out = ckpt_py("list", run_dir)
    assert out.returncode == 0, out.stderr
    assert [line.split()[0] for line in out.stdout.splitlines()[1:]] == ["9", "12"]
    assert tree(run_dir) == before  # read-only: no probe file, no lock, no log
    # On a read-only mount (a mount namespace of its own), where a write would fail: the same listing.
    readonly = (
        f"mount --bind {run_dir} {run_dir} && mount -o remount,ro,bind {run_dir} && "
        f"! touch {run_dir}/x 2>/dev/null && {sys.executable} ckpt.py list {run_dir}"
    )
    mounted = subprocess.run(
        ["unshare", "-rm", "sh", "-c", readonly], cwd=ROOT, capture_output=True, text=True
    )
    if "mount" not in mounted.stderr:  # (no private mounts here: skip this part)
        assert mounted.returncode == 0 and mounted.stdout == out.stdout, mounted.stderr[-2000:]
    flip_byte(run_dir / "checkpoints" / "9")
    truncate(run_dir / "checkpoints" / "12")
    out = ckpt_py("list", run_dir)
    assert out.returncode == 1 and "NO: checksum mismatch in train" in out.stdout
    assert f"{12:>10}" in out.stdout and "NO: arrays unreadable: " in out.stdout
    lines = (out.stdout + out.stderr).strip().splitlines()  # a line each, no pages of TensorStore detail
    assert len(lines) <= 4 and not any("Traceback" in line or len(line) > 400 for line in lines), lines


def test_list_tells_a_checkpoint_removed_while_listed_from_a_damaged_one(tmp_path, monkeypatch):
    """`ckpt.py list` on a run being trained: retention removes checkpoints while they are read, here step 1
    whole between the listing and its read, and step 2 half-way (its model first: a removal goes in any
    order). Each is "removed while listed", not damaged, and the listing exits 0; a damaged one is NO."""
    saver = ckpt.Checkpoints(tmp_path, keep_last=3)
    for step in (1, 2, 3):
        saver.save(
            step,
            {"w": jnp.full((64, 64), step, jnp.float32)},
            {"mu": jax.random.normal(jax.random.key(step), (256, 256))},
        )
    saver.close()
    folder = tmp_path / "checkpoints"
    removals = {1: lambda: shutil.rmtree(folder / "1"), 2: lambda: shutil.rmtree(folder / "2" / "model")}
    read = ckpt.Checkpoints.read

    def read_while_retention_removes(self, step, *likes):
        removals.pop(step, lambda: None)()
        return read(self, step, *likes)

    monkeypatch.setattr(ckpt.Checkpoints, "read", read_while_retention_removes)
    out = ckpt_py("list", tmp_path)
    rows = [(line.split()[0], line.rsplit("  ", 1)[-1]) for line in out.stdout.splitlines()[1:]]
    assert out.returncode == 0 and out.stderr == "", out.stdout + out.stderr
    assert rows == [
        ("1", "removed while listed"),
        ("2", "removed while listed"),
        ("3", "yes"),
    ], out.stdout
    shutil.rmtree(folder / "2")  # retention done
    flip_byte(folder / "3")
    out = ckpt_py("list", tmp_path)
    assert out.returncode == 1 and out.stdout.splitlines()[1:][-1].endswith(
        "NO: checksum mismatch in train: ['mu']"
    )
    saver = ckpt.Checkpoints(tmp_path, keep_last=3)
    saver.save(4, {"w": jnp.ones((64, 64))}, {"mu": jnp.ones((256, 256))})
    saver.close()
    shutil.rmtree(folder / "4" / "model")  # by hand, not by retention: the step stays, damaged
    out = ckpt_py("list", tmp_path)
    assert out.returncode == 1 and out.stderr == "", out.stderr
    assert out.stdout.splitlines()[-1].endswith("NO: its model arrays are missing"), out.stdout


def test_read_commands_name_their_real_error_in_one_line_and_create_nothing(tmp_path):
    for args in [("list", tmp_path / "typo"), ("to-hf", tmp_path / "typo", tmp_path / "out")]:
        out = ckpt_py(*args)
        assert out.returncode == 1
        assert (
            out.stderr.strip()
            == f"error: {tmp_path / 'typo' / 'checkpoints'} does not exist: is {tmp_path / 'typo'} "
            "a run directory?"
        ), out.stderr
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    out = ckpt_py("to-hf", tmp_path / "empty", tmp_path / "out")
    assert out.returncode == 1 and out.stderr.strip() == (
        f"error: {tmp_path / 'empty' / 'checkpoints'} has no checkpoint (steps: [])"
    ), out.stderr
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["checkpoints", "empty"]


@pytest.mark.slow
def test_to_hf_exports_what_transformers_loads_with_its_tokenizer(tiny_data, tmp_path):
    import torch
    from transformers import AutoTokenizer

    ours = saved_run(tmp_path / "run", tiny_data)
    flip_byte(tmp_path / "run" / "checkpoints" / "12")  # the newest is corrupt: the one before is exported
    out = ckpt_py("to-hf", tmp_path / "run", tmp_path / "hf")
    assert out.returncode == 0, out.stderr
    assert "wrote step 9" in out.stdout and "checkpoint 12 is corrupt" in out.stderr
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["12", "9"]  # reads only
    hf = Olmo3ForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = np.random.default_rng(0).integers(0, SMALL.vocab_size, (1, 50))
    with torch.no_grad():
        theirs = hf(input_ids=torch.as_tensor(ids)).logits.numpy()[0]
    mine = np.asarray(ours(jax.numpy.asarray(ids[0])))[:, : SMALL.vocab_size]
    assert np.abs(mine - theirs).max() / np.abs(theirs).max() < 1e-5
    # The run's own tokenizer travels with the weights (the tiny preset's, trained on Shakespeare).
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = data.tiny_plays()["val"][0][:5000]
    assert tokenizer(text)["input_ids"] == data.get_tokenizer(
        "tiny", str(tiny_data / "tokenizer.json")
    ).encode(text)
    assert tokenizer.eos_token_id == SMALL.eos_token_id


def test_from_hf_names_a_damaged_directory_in_one_line_and_writes_nothing(tmp_path):
    for name, (hf_dir, says) in damaged_hf_dirs(tmp_path).items():
        out = ckpt_py("from-hf", hf_dir, tmp_path / f"run-{name}")
        assert out.returncode == 1 and out.stderr.strip().startswith(f"error: {says}"), out.stderr[-2000:]
        assert len(out.stderr.strip().splitlines()) == 1 and not (tmp_path / f"run-{name}").exists()


# ---------------------------------------------------------------------------------------------------------
# --wandb: every metrics row under OLMo-core's names, read back from what wandb itself wrote (offline).

OLMO_CORE = Path(importlib.util.find_spec("olmo_core").origin).parent
# Each name we log, and the code in OLMo-core 3.0.0 that logs it (record_metric joins namespace and name).
OLMO_CORE_SOURCE = {
    "train/CE loss": ("train/common.py", 'TRAIN_CE_LOSS_METRIC = "train/CE loss"'),
    "train/PPL": ("train/common.py", 'TRAIN_PPL_METRIC = "train/PPL"'),
    "train/Z loss": ("train/common.py", 'TRAIN_Z_LOSS_METRIC = "train/Z loss"'),
    "optim/total grad norm": ("train/common.py", 'OPTIM_GRAD_NORM_METRIC = "optim/total grad norm"'),
    "optim/LR (group 0)": (TRAIN_MODULE := "train/train_module/transformer/train_module.py", "LR (group {"),
    "optim/LR (group 1)": (TRAIN_MODULE, 'namespace="optim"'),
    "optim/step skipped": (TRAIN_MODULE, '"step skipped", self.optim.step_skipped, namespace="optim"'),
    "train/masked instances (%)": (TRAIN_MODULE, '"train/masked instances (%)"'),
    "throughput/device/TPS": (SPEED := "train/callbacks/speed_monitor.py", '"throughput/device/TPS", tps)'),
    "throughput/device/MFU": (SPEED, '"throughput/device/MFU", mfu)'),
    "throughput/total tokens": (SPEED, '"throughput/total tokens", self.trainer.global_train_tokens_seen'),
    "throughput/device/data loading (s)": (SPEED, '"throughput/device/data loading (s)"'),
}


def test_wandb_names_and_units_are_olmo_core_s():
    row = dict(step=7, loss=3.5, ce_loss=3.25, z_loss=0.25, lr=2e-4, grad_norm=0.5, skipped=False, filtered=2)
    row |= dict(tokens=7168, tokens_per_s=8000.0, mfu=0.25, data_wait_s=0.01, batch_hash="00ab")
    row |= {
        "eval/lm/c4_en-validation/CE loss": 3.0,
        "eval/downstream/arc_easy_test_mc_5shot_fast (accuracy)": 0.5,
    }
    logged = ckpt.olmo_core_metrics(row, devices=8, batch=4)
    assert set(logged) == set(OLMO_CORE_SOURCE) | {k for k in row if "/" in k}  # the rest passes unchanged
    for name, (file, code) in OLMO_CORE_SOURCE.items():
        assert code in (OLMO_CORE / file).read_text(), (name, file)
    # OLMo-core's TPS is a rank's tokens over the ranks sharing them: per device; its MFU a percentage; its
    # masked instances a proportion; its PPL exp(CE), only below a CE of 10.
    assert logged["throughput/device/TPS"] == 1000.0 and logged["throughput/device/MFU"] == 25.0
    assert logged["train/masked instances (%)"] == 0.5 and logged["optim/LR (group 1)"] == 2e-4
    assert logged["train/PPL"] == pytest.approx(np.exp(3.25))
    assert "train/PPL" not in ckpt.olmo_core_metrics(row | dict(ce_loss=10.5), devices=8, batch=4)
    assert "throughput/device/MFU" not in ckpt.olmo_core_metrics(row | dict(mfu=None), devices=8, batch=4)


def wandb_segments(run_dir: Path) -> list[tuple[str, dict[int, dict]]]:
    """Each process's part of the run's W&B run as wandb wrote it offline, in order: its run id and its
    history (step: {name: value})."""
    segments = []
    for log in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):
        run_id, history = None, {}
        for record in ckpt.wandb_records(log):
            if record.HasField("run"):
                run_id = record.run.run_id
            if record.HasField("history"):
                items = {
                    "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item
                }
                assert record.history.step.num not in history  # one W&B row per step
                history[record.history.step.num] = items
        segments.append((run_id, history))
    return segments


def assert_wandb_holds_each_step_once_as_metrics_jsonl(run_dir: Path, segments, devices: int, batch: int):
    """Every step of metrics.jsonl is in W&B once (none lost, none repeated), with the same numbers (a
    resume retakes a step bit for bit; only its time is its own)."""
    assert {found for found, _ in segments} - {None} == {(run_dir / "wandb_id").read_text()}  # one run
    logged = {step: row for _, history in segments for step, row in history.items()}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert sorted(step for _, history in segments for step in history) == sorted({r["step"] for r in rows})
    for row in rows:
        for name, value in ckpt.olmo_core_metrics(row, devices, batch).items():
            if not name.startswith("throughput/"):
                assert logged[row["step"]][name] == pytest.approx(value, rel=1e-6), (row["step"], name)


WRITE_ROWS = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
import ckpt
log = ckpt.MetricsLog(Path(sys.argv[1]), True, False, ckpt.WandbRun("olmo3-jax-test", None, {}, 8, 4))
for step in range(int(sys.argv[2]), int(sys.argv[3]) + 1):
    log.write(dict(step=step, ce_loss=10 - step / 8, lr=step / 1e4, tokens_per_s=1000.0 + os.getpid()))
    if step % 3 == 0:  # an evaluated step: its eval row follows its train row
        log.write({"step": step, "eval/lm/val/CE loss": 9 - step / 8, "eval_loss": 9 - step / 8})
if sys.argv[4] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
log.close()
"""


def test_wandb_after_a_kill_and_a_retake_holds_each_step_once(tmp_path, monkeypatch):
    """A process killed mid-run loses what wandb had not flushed; the next continues the same W&B run and
    sends what W&B lacks (from metrics.jsonl, up to the checkpoint it resumes from), and never a step W&B
    holds. Each process here writes the rows a run would, from the checkpoint it resumes from."""
    monkeypatch.setenv("WANDB_MODE", "offline")

    def process(resume_from, last, end="close"):
        ckpt.MetricsLog(tmp_path, True, False).rewind(resume_from)
        cmd = [sys.executable, "-c", WRITE_ROWS, str(tmp_path), str(resume_from + 1), str(last), end]
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    assert process(0, 5, "kill").returncode == -signal.SIGKILL  # checkpoint 3 written, killed at step 5
    assert (out := process(3, 8)).returncode == 0, out.stderr[-3000:]  # W&B lost 1-5: 1-3 sent again
    assert (out := process(6, 8)).returncode == 0, out.stderr[-3000:]  # checkpoint 8 lost: 7-8 retaken
    segments = wandb_segments(tmp_path)
    assert len(segments) == 3 and segments[0][1] == {} and segments[2][1] == {}  # a 32 KiB block unwritten
    assert sorted(segments[1][1]) == list(range(1, 9))
    assert "eval/lm/val/CE loss" in segments[1][1][3] and "train/CE loss" in segments[1][1][3]  # one row
    assert_wandb_holds_each_step_once_as_metrics_jsonl(tmp_path, segments, devices=8, batch=4)


@pytest.mark.slow
def test_train_py_logs_to_wandb_and_a_retaken_step_is_not_sent_again(tiny_data, tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    argv = ["--preset", "tiny", "--seq_len", "64", "--global_batch", "4", "--steps", "4", "--lr_horizon", "4"]
    argv += ["--warmup_steps", "2", "--ckpt_every", "2", "--eval_every", "2", "--eval_batches", "1"]
    argv += ["--samples", "0", "--wandb", "olmo3-jax-test", "--wandb_run", "tiny", "--run_dir", str(run_dir)]
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert train.main(train.parse_args([*argv, "--data_root", str(tiny_data)])) == 0
    shutil.rmtree(run_dir / "checkpoints" / "4")  # steps 3 and 4 are taken again; W&B holds them
    assert train.main(train.parse_args([*argv, "--data_root", str(tiny_data)])) == 0
    segments = wandb_segments(run_dir)
    assert [sorted(history) for _, history in segments] == [[1, 2, 3, 4], []]
    names = set(OLMO_CORE_SOURCE) - {"throughput/device/MFU"}  # no MFU on a CPU
    assert set(segments[0][1][4]) >= names | {"eval/lm/tiny-val/CE loss", "eval/lm/tiny-val/PPL"}
    assert_wandb_holds_each_step_once_as_metrics_jsonl(run_dir, segments, devices=8, batch=4)
    # The run's summary: its goodput account as of each start's end, as `ckpt.py goodput` reads it (whose last
    # record, after the plots, is a moment later): the second start took steps 3 and 4 again.
    summary = {}
    for log in sorted(run_dir.glob("wandb/offline-run-*/*.wandb")):  # in the order the starts ran
        for record in (r for r in ckpt.wandb_records(log) if r.HasField("summary")):
            summary |= {i.key: json.loads(i.value_json) for i in record.summary.update if "goodput/" in i.key}
    account = ckpt.goodput_account(ckpt.goodput_records(str(run_dir / "goodput.jsonl")))
    assert summary.keys() == ckpt.goodput_scalars(account).keys()
    assert summary["goodput/steps_retaken"] == account["steps_retaken"] == 2
    assert summary["goodput/wall_s"] == pytest.approx(account["wall_s"], abs=5)


def test_wandb_without_the_extra_is_refused_in_one_line_before_the_run_dir(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    argv = ["--preset", "tiny", "--run_dir", str(tmp_path / "run"), "--wandb", "p"]
    assert train.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "error: --wandb p: needs wandb: pip install -e '.[wandb]'" and not (tmp_path / "run").exists()
    )
    with pytest.raises(train.FlagError, match=r"^--wandb_run x: goes with --wandb PROJECT$"):
        train.check_flags(train.parse_args(["--preset", "tiny", "--wandb_run", "x"]))


def test_loss_plot_draws_each_held_out_set(tmp_path):
    rows = [dict(step=s, loss=5.0 - s / 10) for s in range(1, 5)]
    rows += [
        {"step": s, "eval/lm/a/CE loss": 4.0, "eval/lm/b/CE loss": 4.5, "eval_loss": 4.0} for s in (2, 4)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ckpt.plot_losses(tmp_path) == ["train loss", "held-out a", "held-out b"]
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert ckpt.plot_downstream(tmp_path) == [] and not (tmp_path / "downstream.png").exists()


def test_downstream_plot_draws_each_task_s_own_metric(tmp_path):
    rows = [dict(step=1, loss=5.0)]
    for s in (2, 4):
        rows.append(
            {
                "step": s,
                "eval/downstream/arc_easy_test_mc_5shot_fast (accuracy)": 0.2 * s,
                "eval/downstream/arc_easy_test_mc_5shot_fast (CE loss)": 3.0,
                "eval/downstream/hellaswag_bpb_5shot (requests truncated)": 7,
                "eval/downstream/hellaswag_bpb_5shot (BPB v2)": 2.0 / s,
            }
        )
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ckpt.plot_downstream(tmp_path) == [
        "arc_easy_test_mc_5shot_fast\naccuracy",
        "hellaswag_bpb_5shot\nBPB v2",
    ]
    assert (tmp_path / "downstream.png").stat().st_size > 10_000
