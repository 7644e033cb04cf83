"""train.py --init_from an OLMo-core step directory, against OLMo-core itself: a small OLMo 3 trained a few steps
on the CPU by OLMo-core's SkipStepAdamW (one step skipped as a spike) and saved by OLMo-core's checkpointer
(real DCP files), read where the run starts, each device's half from the chunks that hold it: weights and
both Adam moments bit for bit, Adam's count as OLMo-core kept it, the same logits as OLMo-core's model. Bad
checkpoints are refused in one line before anything is written."""

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from olmo_core_runs import SPIKE, STEPS, VOCAB, olmo_core_config, olmo_core_rank, olmo_core_train
from test_model import olmo_core_fields
from test_stages import started

import ckpt
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent


def our_config() -> olmo3.Olmo3Config:
    """Our Olmo3Config for olmo_core_config(), read off OLMo-core's config as tests/test_model.py reads it."""
    from olmo_core.data import TokenizerConfig

    tokenizer = TokenizerConfig(vocab_size=VOCAB, eos_token_id=0, pad_token_id=1)
    fields = olmo_core_fields(olmo_core_config(), tokenizer)
    return dataclasses.replace(olmo3.MODELS["tiny"], **fields, max_seq_len=64)


@pytest.fixture(scope="module")
def olmo_core_step(tmp_path_factory):
    """An OLMo-core step directory written by two FSDP ranks (each tensor in two chunks), and what OLMo-core's
    model and optimizer held, whole, when they saved it, with the steps it skipped."""
    import socket

    import torch

    step_dir = tmp_path_factory.mktemp("olmo-core") / "step5"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(olmo_core_rank, args=(port, step_dir), nprocs=2)
    reference = torch.load(step_dir.parent / "reference.pt")
    return step_dir, reference["held"], reference["skipped"]


@pytest.fixture(scope="module")
def one_process_step(tmp_path_factory):
    """An OLMo-core step directory written by one process (each tensor one chunk): for the bad inputs."""
    step_dir = tmp_path_factory.mktemp("olmo-core-one") / "step5"
    olmo_core_train(step_dir, olmo_core_config())
    return step_dir


@pytest.fixture
def recipe(monkeypatch, tmp_path):
    """train.py's tiny recipe on our_config()'s model, a model of its own, for a step on token files of its
    vocabulary, FSDP over two devices (each holds half of every tensor), in tmp_path/run."""
    monkeypatch.setitem(olmo3.MODELS, "olmo-core-14m", our_config())
    tokens = tmp_path / "tokens.npy"
    np.random.default_rng(0).integers(0, VOCAB, 4096, dtype=np.uint8).tofile(tokens)
    return dataclasses.replace(
        train.PRESETS["tiny"],
        model="olmo-core-14m",
        skip_window=8,
        data=str(tokens),
        seq_len=16,
        global_batch=2,
        steps=1,
        mesh="fsdp=2",
        run_dir=str(tmp_path / "run"),
        eval_every=10**6,
        samples=0,
    )


def olmo_core_layout(tree, cfg) -> dict[str, np.ndarray]:
    """Our model (or moments shaped like it) by OLMo-core's parameter names, in OLMo-core's layout."""
    out = {}
    for leaf, layer, fqn, n_in in ckpt.olmo_core_names(cfg):
        w = np.asarray(ckpt.leaf_at(tree, leaf) if layer is None else ckpt.leaf_at(tree, leaf)[layer])
        out[fqn] = ckpt.ours_to_hf(w, n_in, cfg.padded_vocab if leaf in ckpt.VOCAB_LEAVES else None)
    return out


@pytest.mark.slow
def test_olmo_core_checkpoint_starts_a_run_bit_for_bit(olmo_core_step, recipe, monkeypatch, capsys):
    import torch

    step_dir, held, skipped = olmo_core_step
    chunks = {len(t.chunks) for t in ckpt.read_dcp_metadata(step_dir).values() if t.shape}
    assert chunks == {2}  # FSDP's shards, placed at their offsets
    start, model, opt, _ = started(dataclasses.replace(recipe, init_from=str(step_dir)), monkeypatch)
    said = f"starting from {step_dir} (olmo-core: weights, Adam's moments and count); this process read"
    assert said in capsys.readouterr().out
    assert start == 0 and isinstance(opt, train.OptState)
    assert {len(w.sharding.device_set) for w in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {2}
    # Adam's count is what OLMo-core's optimizer kept: the spike was skipped and did not count.
    assert SPIKE in skipped and len(skipped) < STEPS - 1  # the spike, and no more than one other
    assert {float(h["step"]) for h in held.values()} == {STEPS - len(skipped)}
    assert float(opt.count) == STEPS - len(skipped)
    assert int(opt.seen) == 0 and not np.asarray(opt.losses).any()  # the skip window starts empty
    cfg = olmo3.MODELS[recipe.model]
    for name, ours in [("weight", model), ("exp_avg", opt.mu), ("exp_avg_sq", opt.nu)]:
        for fqn, got in olmo_core_layout(ours, cfg).items():
            np.testing.assert_array_equal(got, held[fqn][name].numpy(), err_msg=f"{name} of {fqn}")
    # The layouts are right (not just the same numbers in our own mapping): OLMo-core's logits.
    theirs = olmo_core_config().build(init_device="cpu")
    theirs.load_state_dict({fqn: h["weight"] for fqn, h in held.items()})
    ids = np.random.default_rng(0).integers(0, VOCAB, (1, 24))
    with torch.no_grad():
        want = theirs(torch.as_tensor(ids)).numpy()
    got = np.asarray(model(jnp.asarray(ids)))[..., :VOCAB]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def copy_of(step_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step"
    shutil.copytree(step_dir, copy)
    return copy


def refused(capsys, tiny_data, step_dir, run_dir) -> str:
    """`train.py --preset tiny --init_from STEP_DIR` refuses in one line (exit 2) and leaves no run directory."""
    argv = ["--preset", "tiny", "--data_root", str(tiny_data), "--init_from", str(step_dir)]
    assert train.cli([*argv, "--run_dir", str(run_dir)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --init_from {step_dir}: "), lines
    assert not Path(run_dir).exists()
    return lines[0]


def start_refused(cfg: train.TrainConfig) -> str:
    """train.main(cfg) refuses its --init_from as bad usage (exit 2 from the command line) in one line, the run
    directory never made."""
    with pytest.raises(train.FlagError) as e:
        train.main(cfg)
    assert "\n" not in str(e.value) and not Path(cfg.run_dir).exists()
    return str(e.value)


def test_truncated_distcp_is_named(one_process_step, tiny_data, tmp_path, capsys):
    step_dir = copy_of(one_process_step, tmp_path)
    largest = max((step_dir / "model_and_optim").glob("*.distcp"), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    line = refused(capsys, tiny_data, step_dir, tmp_path / "run")
    assert str(largest) in line and "cut short" in line


def test_missing_metadata_is_named(one_process_step, tiny_data, tmp_path, capsys):
    step_dir = copy_of(one_process_step, tmp_path)
    (step_dir / "model_and_optim" / ".metadata").unlink()
    line = refused(capsys, tiny_data, step_dir, tmp_path / "run")
    assert str(step_dir / "model_and_optim" / ".metadata") in line and "not found" in line


def test_checkpoint_of_another_model_names_what_differs(one_process_step, tiny_data, tmp_path, capsys):
    # The tiny preset (4 layers of 256) against OLMo-core's 2 layers of 128.
    line = refused(capsys, tiny_data, one_process_step, tmp_path / "run")
    assert "another model than the run's" in line
    assert "n_layers 2 (checkpoint) vs 4 (run); d_model 128 (checkpoint) vs 256 (run); vocab rows" in line
    assert "model.embeddings.weight [256, 128] (checkpoint) vs [8192, 256] (run)" in line


class RunsCode:
    """Pickled, a call of os.system: what a checkpoint's pickle could hold to run code when loaded."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def blob_of_length(pkl: bytes, length: int) -> bytes:
    """A torch.save-like zip whose data.pkl is `pkl`, padded to `length` bytes, to stand in a chunk's place."""

    def zipped(pad: int) -> bytes:
        out = io.BytesIO()
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
            z.writestr("archive/data.pkl", pkl)
            z.writestr("archive/pad", b"\0" * pad)
        return out.getvalue()

    blob = zipped(length - len(zipped(0)))
    assert len(blob) == length
    return blob


def test_a_pickle_that_would_run_code_is_refused_and_never_run(one_process_step, recipe, tmp_path, capsys):
    """The .metadata is a pickle: one that would run code is refused in one line before anything is written;
    one in a chunk's torch.save blob, which only the read of that chunk opens, stops the run in one line
    (exit 1) with no checkpoint written. The code runs in neither."""
    marker, step_dir = tmp_path / "ran", copy_of(one_process_step, tmp_path)
    metadata = step_dir / "model_and_optim" / ".metadata"
    original = metadata.read_bytes()
    metadata.write_bytes(pickle.dumps(RunsCode(marker)))
    cfg = dataclasses.replace(recipe, init_from=str(step_dir))
    line = start_refused(cfg)
    assert line.startswith(f"--init_from {step_dir}: {metadata}: not the metadata of a torch distributed")
    assert "posix.system has no place in a torch checkpoint" in line
    metadata.write_bytes(original)
    _, _, file, start, length = ckpt.read_dcp_metadata(step_dir)["model.embeddings.weight"].chunks[0]
    with open(file, "r+b") as f:
        f.seek(start)
        f.write(blob_of_length(pickle.dumps(RunsCode(marker)), length))
    argv = [
        "--preset",
        "tiny",
        "--model",
        "olmo-core-14m",
        "--data",
        cfg.data,
        "--seq_len",
        "16",
        "--steps",
        "1",
    ]
    argv += [
        "--global_batch",
        "2",
        "--mesh",
        "fsdp=2",
        "--init_from",
        str(step_dir),
        "--run_dir",
        cfg.run_dir,
    ]
    assert train.cli(argv) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --init_from {step_dir}: {file}: bytes "), lines
    assert "posix.system has no place in a torch checkpoint" in lines[0]
    assert not ckpt.has_checkpoints(cfg.run_dir) and not marker.exists()


def test_checkpoint_of_another_width_is_refused(recipe, tmp_path):
    step_dir = tmp_path / "narrow"
    olmo_core_train(step_dir, olmo_core_config(d_model=64), spike=None)
    line = start_refused(dataclasses.replace(recipe, init_from=str(step_dir)))
    assert re.search(
        r"another model than the run's: d_model 64 \(checkpoint\) vs 128 \(run\); .*embeddings.weight "
        r"\[256, 64\] \(checkpoint\) vs \[256, 128\]",
        line,
    ), line


def test_config_json_of_other_heads_is_refused(one_process_step, recipe, tmp_path):
    """The same shapes in another head layout (4 heads of 32 for 8 of 16): only config.json tells."""
    step_dir = copy_of(one_process_step, tmp_path)
    config = json.loads((step_dir / "config.json").read_text())
    config["model"]["block"]["sequence_mixer"]["n_heads"] = 4
    (step_dir / "config.json").write_text(json.dumps(config))
    line = start_refused(dataclasses.replace(recipe, init_from=str(step_dir)))
    assert re.search(r"config.json describes another model .*: n_heads 4 \(config.json\) vs 8", line), line


def test_differing_adam_counts_name_the_parameters(recipe, tmp_path):
    step_dir = tmp_path / "behind"
    held, _ = olmo_core_train(step_dir, olmo_core_config(), spike=None, stop_one="lm_head.w_out.weight")
    counts = [float(h["step"]) for h in held.values()]
    most, behind = max(counts), min(counts)  # every parameter but the LM head has the larger count
    assert counts.count(behind) == 1 and most == behind + 1
    line = start_refused(dataclasses.replace(recipe, init_from=str(step_dir)))
    assert f"step count is {most:g} for most parameters but {behind:g} for lm_head.w_out.weight;" in line


def test_weights_without_optimizer_state_need_init_weights_only(recipe, tmp_path, monkeypatch):
    """A checkpoint saved without its optimizer is refused, unless --init_weights_only: then Adam starts at
    zero."""
    step_dir = tmp_path / "nooptim"
    held, _ = olmo_core_train(step_dir, olmo_core_config(), spike=None, optim=False)
    cfg = dataclasses.replace(recipe, init_from=str(step_dir))
    assert (
        "holds no optimizer state (no optim.state.* tensors: saved without it?); pass --init_weights_only true"
        in (start_refused(cfg))
    )
    _, model, opt, _ = started(dataclasses.replace(cfg, init_weights_only=True), monkeypatch)
    assert float(opt.count) == 0 and not any(np.asarray(m).any() for m in jax.tree.leaves(opt.mu))
    np.testing.assert_array_equal(np.asarray(model.embed_tokens), held["embeddings.weight"]["weight"].numpy())
