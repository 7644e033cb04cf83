"""From one stage to the next: `ckpt.py next-stage` (a run's weights and Adam state as step 0 of the next
stage's run), `ckpt.py average` (two runs' weights, as AI2 averaged the 32B's midtraining runs) against numpy,
and stage 2 itself against OLMo-core's trainer, which loads its own stage-1 checkpoint as its midtraining
script does and trains on with the stage-2 recipe, scaled down."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_olmo_core_ckpt import restore

import ckpt
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = dataclasses.replace(olmo3.PRESETS["tiny"], n_layers=2, layer_types=(olmo3.SLIDING, olmo3.FULL))


@pytest.fixture
def small_recipe(monkeypatch):
    """A stage-2 recipe (the 7B's midtraining, scaled down) on SMALL's model, and its stage 1 (the tiny preset)."""
    monkeypatch.setitem(olmo3.PRESETS, "small", SMALL)
    stage2 = dataclasses.replace(train.PRESETS["7b-midtrain"], model="small", seq_len=256, skip_window=8)
    stage1 = dataclasses.replace(train.PRESETS["tiny"], preset="small", skip_window=16)
    return stage1, stage2


def stage1_run(run_dir, cfg, seed: int, steps=(30, 40)):
    """A run directory as train.py leaves it after stage 1: SMALL's weights and an Adam state with moments,
    count and a skip-step history (a window of cfg.skip_window) that are all non-zero, saved at `steps`.
    Returns the model and state of the last."""
    keys = jax.random.split(jax.random.key(seed), 4)
    model = olmo3.Olmo3(SMALL, key=keys[0])
    params = eqx.filter(model, eqx.is_array)
    noise = lambda k, f: jax.tree.map(lambda w: f(jax.random.normal(k, w.shape)), params)
    window = jnp.arange(1, cfg.skip_window + 1, dtype=jnp.float32)
    opt = train.OptState(
        jnp.float32(steps[-1] - 3),
        noise(keys[1], lambda x: x),
        noise(keys[2], jnp.square),
        window,
        2 * window,
        99,
    )
    meta = {"model": ckpt.config_to_hf(SMALL), "config": dataclasses.asdict(cfg)}
    saver = ckpt.Checkpoints(run_dir)
    for step in steps:
        saver.save(step, model, {"opt": opt, "key": jax.random.key_data(keys[3])}, meta)
    saver.close()
    return model, opt


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_next_stage_carries_weights_moments_and_adam_count_and_resets_the_rest(small_recipe, tmp_path):
    stage1, stage2 = small_recipe
    model, opt = stage1_run(tmp_path / "stage1", stage1, seed=0)
    assert ckpt.next_stage(tmp_path / "stage1", tmp_path / "stage2", stage2) == (40, 37.0)
    step, got, state, meta = restore(tmp_path / "stage2", stage2)  # as train.py's restore_or_init reads it
    new = state["opt"]
    assert step == 0 and "config" not in meta  # any recipe of this model may continue: the new stage's
    for name, want, have in [("weights", model, got), ("mu", opt.mu, new.mu), ("nu", opt.nu, new.nu)]:
        for a, b in zip(arrays(want), arrays(have), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert float(new.count) == 37.0  # Adam's bias correction goes on where stage 1 left it
    # The skip-step history starts afresh, in the new recipe's window (stage 1's held 16, 99 steps seen).
    assert new.losses.shape == new.grad_norms.shape == (stage2.skip_window,)
    assert int(new.seen) == 0 and not np.asarray(new.losses).any() and not np.asarray(new.grad_norms).any()
    # Its LR is the new recipe's from its own step 1: linear from the literal, not stage 1's cosine.
    assert train.lr_at(1, stage2) == stage2.lr * (1 - 1 / stage2.steps)


def test_next_stage_refuses_another_model_and_a_weights_only_checkpoint(small_recipe, tmp_path):
    stage1, stage2 = small_recipe
    stage1_run(tmp_path / "stage1", stage1, seed=0)
    other_heads = dataclasses.replace(
        stage2, head_layout="2x128"
    )  # the same width in other heads: another model
    with pytest.raises(
        ValueError, match=r"holds another model than --preset 7b-midtrain's \(small\): .*heads"
    ):
        ckpt.next_stage(tmp_path / "stage1", tmp_path / "new", other_heads)
    ckpt.write_first_step(tmp_path / "weights", olmo3.Olmo3(SMALL, key=jax.random.key(0)), None, "hf")
    with pytest.raises(ValueError, match="holds weights only"):
        ckpt.next_stage(tmp_path / "weights", tmp_path / "new", stage2)
    assert not (tmp_path / "new").exists()


def test_average_is_the_mean_of_the_two_runs_weights(small_recipe, tmp_path):
    stage1, _ = small_recipe
    a, _ = stage1_run(tmp_path / "a", stage1, seed=1)
    b, _ = stage1_run(tmp_path / "b", stage1, seed=2, steps=(7,))
    proc = subprocess.run(
        [sys.executable, "ckpt.py", "average", tmp_path / "a", tmp_path / "b", tmp_path / "soup"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "mean of" in proc.stdout and "(step 40)" in proc.stdout, proc.stderr
    step, soup = ckpt.newest_model(tmp_path / "soup")
    assert step == 0
    for x, y, got in zip(arrays(a), arrays(b), arrays(soup), strict=True):
        np.testing.assert_array_equal(got, (x.astype(np.float32) + y.astype(np.float32)) / np.float32(2))
    other = dataclasses.replace(SMALL, norm_eps=1e-5)
    ckpt.write_first_step(tmp_path / "other", olmo3.Olmo3(other, key=jax.random.key(0)), None, "x")
    with pytest.raises(ValueError, match="hold different models: .*rms_norm_eps"):
        ckpt.average(tmp_path / "a", tmp_path / "other", tmp_path / "none")
    assert not (tmp_path / "none").exists()
