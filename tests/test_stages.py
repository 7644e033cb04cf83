"""From one stage to the next: `ckpt.py next-stage` (a run's weights and Adam state as step 0 of the next
stage's run), `ckpt.py average` (two runs' weights, as AI2 averaged the 32B's midtraining runs) against numpy,
and stage 2 itself against OLMo-core's trainer, which loads its own stage-1 checkpoint as its midtraining
script does and trains on with the stage-2 recipe, scaled down."""

import dataclasses
import json
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
SMALL = dataclasses.replace(olmo3.MODELS["tiny"], n_layers=2, layer_types=(olmo3.SLIDING, olmo3.FULL))


@pytest.fixture
def small_recipe(monkeypatch):
    """A stage-2 recipe (the 7B's midtraining, scaled down) on SMALL's model, and its stage 1 (the tiny preset)."""
    monkeypatch.setitem(olmo3.MODELS, "small", SMALL)
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


# ---- stage 2 against OLMo-core: its trainer's stage 1, saved by its checkpointer; then both sides' stage 2

STAGE1 = dict(steps=6, batch=4, lr=2e-3, warmup=2, lr_final=0.1, seed=34521)  # the cosine of stage 1
STAGE2 = dict(steps=24, batch=2, lr=7e-4, seed=1337)  # LinearWithWarmup(warmup=0, alpha_f=0.0) over 24 steps
SIZES = dict(seq_len=64, window=16, layers=4, kv_heads=4, skip_window=4)  # the skip rule live from step 2


def reference_bench():
    """bench/reference.py as a module: its OLMo-core configuration of stage 1 and its tolerances."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reference", ROOT / "bench" / "reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def olmo_core_stage(bench, tok, files, out: Path, stage: dict, load_path: Path | None = None):
    """One stage of OLMo-core's own Trainer on the tiny corpus: stage 1 (CosWithWarmup, from its initial
    weights, which go to out/init-hf) or, with `load_path`, stage 2 as OLMo-3-1025-7B-midtrain.py runs it
    (the checkpoint loaded with its optimizer state and without its trainer state, LinearWithWarmup(0, 0.0),
    a new LR and seed). Saves its last step with its checkpointer in out/run/stepN; returns its rows."""
    from types import SimpleNamespace
    from unittest import mock

    import torch
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig
    from olmo_core.nn.hf.checkpoint import save_hf_model
    from olmo_core.optim import LinearWithWarmup
    from olmo_core.train import Duration, LoadStrategy, TrainerConfig

    args = SimpleNamespace(**SIZES, **{"warmup": 0, "lr_final": 0.0} | stage)
    tokenizer = bench.olmo_core_tokenizer(tok)
    linear = LinearWithWarmup(warmup=0, alpha_f=0.0) if load_path else None
    module = bench.olmo_core_module(args, tokenizer, scheduler=linear)
    if load_path is None:
        save_hf_model(out / "init-hf", module.model.state_dict(), module.model, save_overwrite=True)
    work = str(out / "work")
    dataset = NumpyFSLDatasetConfig(
        paths=files, sequence_length=args.seq_len, tokenizer=tokenizer, work_dir=work
    ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=args.batch * args.seq_len, seed=args.seed, work_dir=work)
    recorder = bench.Recorder()
    trainer = TrainerConfig(
        save_folder=str(out / "run"),
        max_duration=Duration.steps(args.steps),
        metrics_collect_interval=1,
        callbacks={"recorder": recorder},
        load_path=None if load_path is None else str(load_path),
        load_strategy=LoadStrategy.always if load_path else LoadStrategy.if_available,
        load_trainer_state=False,
        load_optim_state=True,
    ).build(module, loader.build(dataset))
    with mock.patch.object(torch.nn.utils, "get_total_norm", bench.exact_total_norm):  # as the bench: exact
        trainer.fit()
    return [recorder.rows[s] for s in range(1, args.steps + 1)]


@pytest.fixture(scope="module")
def olmo_core_stages(tiny_data, tmp_path_factory):
    """OLMo-core's trainer trains stage 1 and saves it (real DCP files, train/rank0.pt), then trains stage 2
    from it: (its stage-1 step directory, its stage-1 rows, its stage-2 rows, our config of its model)."""
    import data

    bench, out = reference_bench(), tmp_path_factory.mktemp("olmo-core-stages")
    prepared = data.prepare_tiny(str(tiny_data))
    tok = data.get_tokenizer("tiny", prepared["tokenizer"])
    stage1_rows = olmo_core_stage(bench, tok, prepared["train"], out / "oc1", STAGE1)
    step_dir = out / "oc1" / "run" / f"step{STAGE1['steps']}"
    assert (step_dir / "train" / "rank0.pt").is_file() and (
        step_dir / "model_and_optim" / ".metadata"
    ).is_file()
    theirs = olmo_core_stage(bench, tok, prepared["train"], out / "oc2", STAGE2, load_path=step_dir)
    hf = json.loads((out / "oc1" / "init-hf" / "config.json").read_text())
    hf["eos_token_id"] = tok.eos_id  # OLMo-core's export knows the model, not its tokenizer
    return step_dir, stage1_rows, theirs, ckpt.config_from_hf(hf)


def our_stage2(tiny_data, run_dir) -> train.TrainConfig:
    """The stage-2 recipe (7b-midtrain) scaled down as OLMo-core's side runs it, on the model "oc-stage2"."""
    return dataclasses.replace(
        train.PRESETS["7b-midtrain"],
        model="oc-stage2",
        data="tiny",
        data_root=str(tiny_data),
        tokenizer="tiny",
        seq_len=SIZES["seq_len"],
        global_batch=STAGE2["batch"],
        seed=STAGE2["seed"],
        lr=STAGE2["lr"],
        lr_horizon=STAGE2["steps"],
        steps=STAGE2["steps"],
        skip_window=SIZES["skip_window"],
        compute=olmo3.Compute(dtype="float32", attention="reference"),
        mesh="data=1",
        run_dir=str(run_dir),
        eval_batches=1,
        eval_every=10**6,
        tasks="",  # the preset's downstream tasks need a longer context; test_downstream.py scores them
    )


def follows_step_by_step(run_dir, theirs: list[dict]) -> dict:
    """Our run's metrics against OLMo-core's rows, step by step, within the stage-1 comparison's tolerances;
    returns the largest relative differences."""
    import data

    bench = reference_bench()
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ours = [r for r in map(json.loads, lines) if "loss" in r]
    assert [r["step"] for r in ours] == list(range(1, STAGE2["steps"] + 1))
    tol, rel = bench.TOLERANCE, bench.rel
    for o, t in zip(ours, theirs, strict=True):
        where = f"step {o['step']}: ours {o}, OLMo-core {t}"
        assert o["batch_hash"] == data.format_hash(t["hash"]), where  # the new seed's order, from its start
        assert all(rel(o["lr"], lr) <= 1e-12 for lr in t["lr"]), where
        assert o["skipped"] == t["skipped"], where
        assert rel(o["loss"], t["loss"]) <= tol["loss"], where
        assert rel(o["grad_norm"], t["grad_norm"]) <= tol["grad_norm"], where
    assert ours[-1]["lr"] == 0.0 and ours[0]["lr"] == pytest.approx(STAGE2["lr"] * (1 - 1 / 24), rel=1e-12)
    assert any(r["skipped"] for r in ours) and ours[-1]["loss"] < ours[0]["loss"]  # it compared a live run
    return {k: max(rel(o[k], t[k]) for o, t in zip(ours, theirs)) for k in ("loss", "grad_norm")}


@pytest.mark.slow
def test_stage2_from_an_olmo_core_checkpoint_follows_olmo_core_step_by_step(
    olmo_core_stages, tiny_data, tmp_path, monkeypatch
):
    """`from-olmo-core` imports OLMo-core's stage-1 checkpoint as step 0 of our stage-2 run; train.py's main
    trains the stage-2 recipe from it while OLMo-core's trainer loads the same checkpoint as its midtraining
    script does: every step's batch, LR, skip, loss and grad norm agree. Had Adam's count or moments not
    carried over, or the LR schedule, the data order or the skip history not restarted, step 1 or 2 would
    differ (a count reset to 0 is 8e-3 off at step 2)."""
    step_dir, stage1_rows, theirs, model_cfg = olmo_core_stages
    monkeypatch.setitem(olmo3.MODELS, "oc-stage2", model_cfg)
    cfg = our_stage2(tiny_data, tmp_path / "ours")
    count = ckpt.import_olmo_core(step_dir, cfg.run_dir, cfg)
    # Adam's count as OLMo-core left it: its steps but the skipped, plus one that torch's checkpointer took to
    # materialise the empty optimizer state when the trainer saved step 0 (lr 0, zero gradients).
    assert count == STAGE1["steps"] - sum(r["skipped"] for r in stage1_rows) + 1
    assert train.main(cfg) == 0
    print(
        f"stage 2 from OLMo-core's checkpoint: max relative difference {follows_step_by_step(cfg.run_dir, theirs)}"
    )


@pytest.mark.slow
def test_stage2_from_our_stage1_run_follows_olmo_core_step_by_step(
    olmo_core_stages, tiny_data, tmp_path, monkeypatch
):
    """The same stage 2 from one of our stage-1 run directories holding OLMo-core's stage-1 state (imported
    under a stage-1 recipe with another skip window), by `ckpt.py next-stage`: the two README commands."""
    step_dir, _, theirs, model_cfg = olmo_core_stages
    monkeypatch.setitem(olmo3.MODELS, "oc-stage2", model_cfg)
    cfg = our_stage2(tiny_data, tmp_path / "ours")
    stage1 = dataclasses.replace(train.PRESETS["tiny"], model="oc-stage2", skip_window=16)
    ckpt.import_olmo_core(step_dir, tmp_path / "stage1", stage1)
    ckpt.next_stage(tmp_path / "stage1", cfg.run_dir, cfg)
    assert train.main(cfg) == 0
    print(f"stage 2 by next-stage: max relative difference {follows_step_by_step(cfg.run_dir, theirs)}")


def test_next_stage_command_refuses_in_one_line_and_writes_nothing(tmp_path):
    for args, said in [
        (["--preset", "7b-midtran"], "error: --preset 7b-midtran: expected one of tiny, 190m"),
        (["--preset", "7b-midtrain"], f"error: {tmp_path / 'stage1' / 'checkpoints'} does not exist"),
    ]:
        proc = subprocess.run(
            [sys.executable, "ckpt.py", "next-stage", tmp_path / "stage1", tmp_path / "stage2", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith(said), proc.stderr[-2000:]
    assert not (tmp_path / "stage2").exists()
