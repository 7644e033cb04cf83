"""ckpt.py from-olmo-core against OLMo-core itself: a small OLMo 3 trained a few steps on the CPU by OLMo-core's
SkipStepAdamW (one step skipped as a spike) and saved by OLMo-core's checkpointer (real DCP files), imported:
weights and both Adam moments bit for bit, Adam's count as OLMo-core kept it, the same logits as OLMo-core's
model, and a run directory train.py restores. Bad checkpoints are refused in one line, nothing written."""

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from olmo_core_runs import SPIKE, STEPS, VOCAB, olmo_core_config, olmo_core_rank, olmo_core_train
from test_model import olmo_core_fields

import ckpt
import olmo3
import shard
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
def recipe(monkeypatch):
    """train.py's tiny recipe on our_config()'s model, under a preset name of its own."""
    monkeypatch.setitem(olmo3.MODELS, "olmo-core-14m", our_config())
    return dataclasses.replace(train.PRESETS["tiny"], preset="olmo-core-14m", skip_window=8)


def olmo_core_layout(tree, cfg) -> dict[str, np.ndarray]:
    """Our model (or moments shaped like it) by OLMo-core's parameter names, in OLMo-core's layout."""
    out = {}
    for leaf, layer, fqn, n_in in ckpt.olmo_core_names(cfg):
        w = np.asarray(ckpt.leaf_at(tree, leaf) if layer is None else ckpt.leaf_at(tree, leaf)[layer])
        out[fqn] = ckpt.ours_to_hf(w, n_in, cfg.padded_vocab if leaf in ckpt.VOCAB_LEAVES else None)
    return out


def restore(run_dir, recipe):
    """The run directory's newest checkpoint restored as train.py's restore_or_init restores it: into the
    recipe's abstract state on a mesh, refused by check_resume if it were of another model."""
    cfg = train.model_config(recipe)
    mesh = shard.make_mesh("fsdp=2")
    model_like, opt_like = train.abstract_state(recipe, mesh, cfg, olmo3.Compute())
    key_like = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=shard.replicated(mesh))
    expected = {"model": ckpt.config_to_hf(cfg), "config": dataclasses.asdict(recipe)}
    check = lambda meta: ckpt.check_resume(meta, expected, train.RECIPE_FIELDS, False, str(run_dir))
    checkpoints = ckpt.Checkpoints(run_dir, read_only=True)
    try:
        return checkpoints.restore_latest(model_like, {"opt": opt_like, "key": key_like}, check=check)
    finally:
        checkpoints.close()


@pytest.mark.slow
def test_olmo_core_checkpoint_imports_bit_for_bit_and_restores_in_train(olmo_core_step, recipe, tmp_path):
    import torch

    step_dir, held, skipped = olmo_core_step
    chunks = {len(t.chunks) for t in ckpt.read_dcp_metadata(step_dir).values() if t.shape}
    assert chunks == {2}  # FSDP's shards, placed at their offsets
    count = ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe)
    step, model, state, _ = restore(tmp_path / "run", recipe)
    opt = state["opt"]
    assert step == 0 and isinstance(opt, train.OptState)
    # Adam's count is what OLMo-core's optimizer kept: the spike was skipped and did not count.
    assert SPIKE in skipped and len(skipped) < STEPS - 1  # the spike, and no more than one other
    assert {float(h["step"]) for h in held.values()} == {STEPS - len(skipped)}
    assert count == float(opt.count) == STEPS - len(skipped)
    assert int(opt.seen) == 0 and not np.asarray(opt.losses).any()  # the skip window starts empty
    cfg = olmo3.MODELS[recipe.preset]
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


def ckpt_cli(*args):
    return subprocess.run(
        [sys.executable, "ckpt.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def copy_of(step_dir: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "step"
    shutil.copytree(step_dir, copy)
    return copy


def refused(step_dir, run_dir, *flags) -> str:
    """ckpt.py from-olmo-core refuses in one line (exit 1) and leaves no run directory."""
    proc = ckpt_cli("from-olmo-core", step_dir, run_dir, "--preset", "tiny", *flags)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert not Path(run_dir).exists()
    return lines[0]


def test_truncated_distcp_is_named(one_process_step, tmp_path):
    step_dir = copy_of(one_process_step, tmp_path)
    largest = max((step_dir / "model_and_optim").glob("*.distcp"), key=lambda f: f.stat().st_size)
    largest.write_bytes(largest.read_bytes()[: largest.stat().st_size // 2])
    line = refused(step_dir, tmp_path / "run")
    assert str(largest) in line and "cut short" in line


def test_missing_metadata_is_named(one_process_step, tmp_path):
    step_dir = copy_of(one_process_step, tmp_path)
    (step_dir / "model_and_optim" / ".metadata").unlink()
    line = refused(step_dir, tmp_path / "run")
    assert str(step_dir / "model_and_optim" / ".metadata") in line and "not found" in line


def test_checkpoint_of_another_model_names_what_differs(one_process_step, tmp_path):
    # The tiny preset (4 layers of 256) against OLMo-core's 2 layers of 128.
    line = refused(one_process_step, tmp_path / "run")
    assert "another model than --preset tiny" in line
    assert (
        "n_layers 2 (checkpoint) vs 4 (preset); d_model 128 (checkpoint) vs 256 (preset); vocab rows" in line
    )
    assert "model.embeddings.weight [256, 128] (checkpoint) vs [8192, 256] (preset)" in line


def test_checkpoint_of_another_width_is_refused(recipe, tmp_path):
    step_dir = tmp_path / "narrow"
    olmo_core_train(step_dir, olmo_core_config(d_model=64), spike=None)
    with pytest.raises(
        ValueError,
        match=r"another model than --preset olmo-core-14m: d_model 64 \(checkpoint\) vs 128 \(preset\); .*embeddings.weight \[256, 64\] \(checkpoint\) vs \[256, 128\]",
    ):
        ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe)
    assert not (tmp_path / "run").exists()


def test_config_json_of_other_heads_is_refused(one_process_step, recipe, tmp_path):
    """The same shapes in another head layout (4 heads of 32 for 8 of 16): only config.json tells."""
    step_dir = copy_of(one_process_step, tmp_path)
    config = json.loads((step_dir / "config.json").read_text())
    config["model"]["block"]["sequence_mixer"]["n_heads"] = 4
    (step_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match=r"config.json describes another model .*: n_heads 4 \(config.json\) vs 8"
    ):
        ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe)
    assert not (tmp_path / "run").exists()


def test_differing_adam_counts_name_the_parameters(recipe, tmp_path):
    step_dir = tmp_path / "behind"
    held, _ = olmo_core_train(step_dir, olmo_core_config(), spike=None, stop_one="lm_head.w_out.weight")
    counts = [float(h["step"]) for h in held.values()]
    most, behind = max(counts), min(counts)  # every parameter but the LM head has the larger count
    assert counts.count(behind) == 1 and most == behind + 1
    with pytest.raises(
        ValueError,
        match=rf"step count is {most:g} for most parameters but {behind:g} for lm_head.w_out.weight;",
    ):
        ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe)
    assert not (tmp_path / "run").exists()


def test_weights_without_optimizer_state_need_weights_only(recipe, tmp_path):
    """A checkpoint saved without its optimizer is refused, unless --weights_only: then Adam starts at zero."""
    step_dir = tmp_path / "nooptim"
    held, _ = olmo_core_train(step_dir, olmo_core_config(), spike=None, optim=False)
    with pytest.raises(ValueError, match="holds no optimizer state .* pass --weights_only"):
        ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe)
    assert not (tmp_path / "run").exists()
    assert ckpt.import_olmo_core(step_dir, tmp_path / "run", recipe, weights_only=True) is None
    step, model, state, _ = restore(tmp_path / "run", recipe)
    assert state is None  # train.py then starts Adam from zero (restore_or_init's make_opt)
    np.testing.assert_array_equal(np.asarray(model.embed_tokens), held["embeddings.weight"]["weight"].numpy())
