"""From one stage to the next, in one command: `train.py --init_from` (a run's weights and Adam state carried
into the next stage's run, read where the run starts; every start it refuses refused before anything is
written; a start killed part-way started again as if it never was), `ckpt.py average` (two runs' weights, as
AI2 averaged the 32B's midtraining runs) against numpy, and stage 2 itself against OLMo-core's trainer, which
loads its own stage-1 checkpoint as its midtraining script does and trains on with the stage-2 recipe, scaled
down."""

import dataclasses
import json
import signal
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import train_py

import ckpt
import olmo3
import train

ROOT = Path(__file__).resolve().parent.parent
SMALL = dataclasses.replace(olmo3.MODELS["tiny"], n_layers=2, layer_types=(olmo3.SLIDING, olmo3.FULL))


def on_tiny(cfg: train.TrainConfig, tiny_data, run_dir, **fields) -> train.TrainConfig:
    """Recipe `cfg` as a run of a few steps on the tiny corpus: what train.py needs to start it here."""
    run = dict(data="tiny", data_root=str(tiny_data), tokenizer="tiny", tasks="", run_dir=str(run_dir))
    small = dict(global_batch=8, steps=2, eval_every=10**6, samples=0)
    return dataclasses.replace(cfg, **run, **small, **fields)


@pytest.fixture
def small_recipe(monkeypatch, tiny_data, tmp_path):
    """A stage-2 recipe (the 7B's midtraining, scaled down) on SMALL's model, and its stage 1 (the tiny preset),
    each runnable on the tiny corpus (stage 2 in tmp_path/stage2)."""
    monkeypatch.setitem(olmo3.MODELS, "small", SMALL)
    stage2 = dataclasses.replace(train.PRESETS["7b-midtrain"], model="small", seq_len=256, skip_window=8)
    stage1 = dataclasses.replace(train.PRESETS["tiny"], preset="small", skip_window=16)
    return stage1, on_tiny(stage2, tiny_data, tmp_path / "stage2", compute=olmo3.Compute(dtype="float32"))


def stage1_run(run_dir, cfg, seed: int, steps=(30, 40), model_cfg=SMALL):
    """A run directory as train.py leaves it after stage 1: `model_cfg`'s weights and an Adam state with
    moments, count and a skip-step history (a window of cfg.skip_window) that are all non-zero, saved at
    `steps`. Returns the model and state of the last."""
    keys = jax.random.split(jax.random.key(seed), 4)
    model = olmo3.Olmo3(model_cfg, key=keys[0])
    params = eqx.filter(model, eqx.is_array)
    noise = lambda k, f: jax.tree.map(lambda w: f(jax.random.normal(k, w.shape)), params)
    window = jnp.arange(1, cfg.skip_window + 1, dtype=jnp.float32)
    opt = train.OptState(
        jnp.float32(steps[-1] - 3),
        noise(keys[1], lambda x: x),
        noise(keys[2], jnp.square),
        window,
        2 * window,
        jnp.int32(99),
    )
    save_run(run_dir, cfg, model, opt, steps, keys[3])
    return model, opt


def save_run(run_dir, cfg: train.TrainConfig, model, opt, steps, key) -> None:
    """`model` and `opt` saved as train.py saves them, at each of `steps`, under recipe `cfg`."""
    meta = {"model": ckpt.config_to_hf(model.cfg), "config": dataclasses.asdict(cfg)}
    saver = ckpt.Checkpoints(run_dir)
    for step in steps:
        saver.save(step, model, {"opt": opt, "key": jax.random.key_data(key)}, meta)
    saver.close()


def arrays(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def started(cfg: train.TrainConfig, monkeypatch) -> tuple:
    """train.main(cfg) up to its loop: (the step it starts after, model, optimizer state, key) as the loop
    gets them; the loop itself does not run (nothing trained, saved or sampled)."""
    got = []

    def loop(run, preemption, start, model, opt, key):
        got.append((start, model, opt, key))
        return model, True  # as a preempted run: no samples, no plot

    monkeypatch.setattr(train, "train_loop", loop)
    assert train.main(cfg) == 0
    return got[0]


def test_a_stage_starts_from_a_run_s_weights_moments_and_adam_count_and_resets_the_rest(
    small_recipe, tmp_path, monkeypatch, capsys
):
    """`train.py --preset 7b-midtrain --init_from STAGE1_RUN`: step 1 of the new stage starts from the newest
    checkpoint's weights, both Adam moments and Adam's count; its own step count, data order, LR and
    skip-step history start afresh. Nothing is written as a step 0: a stage's first checkpoint is its own."""
    stage1, stage2 = small_recipe
    model, opt = stage1_run(tmp_path / "stage1", stage1, seed=0)
    cfg = dataclasses.replace(stage2, init_from=str(tmp_path / "stage1"))
    start, got, new, key = started(cfg, monkeypatch)
    said = f"starting from {tmp_path / 'stage1'}@40 (run: weights, Adam's moments and count)"
    assert said in capsys.readouterr().out
    assert start == 0 and not ckpt.has_checkpoints(cfg.run_dir)
    assert got.cfg == train.model_config(cfg) and got.compute == olmo3.Compute(dtype="float32")  # the run's
    for name, want, have in [("weights", model, got), ("mu", opt.mu, new.mu), ("nu", opt.nu, new.nu)]:
        for a, b in zip(arrays(want), arrays(have), strict=True):
            np.testing.assert_array_equal(a, b, err_msg=name)
    assert float(new.count) == 37.0  # Adam's bias correction goes on where stage 1 left it
    # The skip-step history starts afresh, in the new recipe's window (stage 1's held 16, 99 steps seen).
    assert new.losses.shape == new.grad_norms.shape == (stage2.skip_window,)
    assert int(new.seen) == 0 and not np.asarray(new.losses).any() and not np.asarray(new.grad_norms).any()
    assert (jax.random.key_data(key) == jax.random.key_data(jax.random.key(cfg.init_seed))).all()
    # Its LR is the new recipe's from its own step 1: linear from the literal, not stage 1's cosine.
    assert train.lr_at(1, stage2) == stage2.lr * (1 - 1 / stage2.lr_horizon)


def flags_of(cfg: train.TrainConfig, *names) -> list[str]:
    """train.py's command line for `cfg`'s fields `names` (the preset's others at its defaults)."""
    return [arg for name in names for arg in (f"--{name}", str(getattr(cfg, name)))]


def refused(capsys, argv: list[str], run_dir) -> str:
    """train.py's one line for a start refused as bad usage (exit 2), with nothing written."""
    assert train.cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not Path(run_dir).exists()
    return err.removeprefix("error: ")


def test_a_stage_start_is_refused_in_one_line_before_anything_is_written(
    small_recipe, tmp_path, monkeypatch, capsys
):
    """Another model, a checkpoint of weights only (unless --init_weights_only), a step the run does not
    have, @STEP of a directory that is not a run, no --init_from for a stage preset: each refused in one line
    (exit 2), the new run directory never made."""
    stage1, stage2 = small_recipe
    stage1_run(tmp_path / "stage1", stage1, seed=0)
    model = olmo3.Olmo3(SMALL, key=jax.random.key(0))
    ckpt.write_first_step(tmp_path / "weights", model, None, "hf")
    ckpt.save_hf(model, tmp_path / "hf")
    names = ("preset", "model", "seq_len", "skip_window", "data", "data_root", "tokenizer", "global_batch")
    argv = [*flags_of(stage2, *names, "steps", "run_dir"), "--tasks", ""]
    run1, weights, hf, nowhere = tmp_path / "stage1", tmp_path / "weights", tmp_path / "hf", tmp_path / "no"
    for source, extra, said in [
        (
            run1,
            ["--head_layout", "2x128"],
            f"{run1 / 'checkpoints' / '40'} holds another model than the run's",
        ),
        (weights, [], f"{weights / 'checkpoints' / '0'} holds weights only (no Adam state to carry over)"),
        (f"{run1}@7", [], f"{run1 / 'checkpoints'} has no checkpoint at step 7 (steps: [30, 40])"),
        (f"{hf}@7", [], f"@7 names a checkpoint of one of our run directories; {hf} is "),
        (nowhere, [], f"{nowhere} does not exist: expected one of our run directories (checkpoints/)"),
    ]:
        err = refused(capsys, [*argv, *extra, "--init_from", str(source)], stage2.run_dir)
        assert err.startswith(f"--init_from {source}: {said}"), err
        if extra:
            assert (
                "num_attention_heads 4 vs 2, num_key_value_heads 4 vs 2, head_dim 64 vs 128 (checkpoint vs run)"
                in err
            )
    assert refused(capsys, argv, stage2.run_dir) == (
        "--preset 7b-midtrain goes on from stage 1 of the 7B (our runs/7b, or OLMo-core's stage1 step "
        "directory): name it with --init_from (a run directory or RUN_DIR@STEP, an OLMo-core step directory, "
        "or a Hugging Face directory)"
    )
    # Weights alone where asked: Adam from zero.
    cfg = dataclasses.replace(stage2, init_from=str(weights), init_weights_only=True)
    _, got, new, _ = started(cfg, monkeypatch)
    for a, b in zip(arrays(model), arrays(got), strict=True):
        np.testing.assert_array_equal(a, b)
    assert float(new.count) == 0.0 and not any(a.any() for a in arrays(new.mu) + arrays(new.nu))


def test_average_is_the_mean_of_the_two_runs_weights(small_recipe, tmp_path):
    stage1, _ = small_recipe
    a, _ = stage1_run(tmp_path / "a", stage1, seed=1)
    b, _ = stage1_run(tmp_path / "b", stage1, seed=2, steps=(7,))
    with pytest.raises(ValueError, match="at step 40 and .* at step 7: two runs at different stages"):
        ckpt.average(tmp_path / "a", tmp_path / "b", tmp_path / "soup")  # unless asked for
    assert not (tmp_path / "soup").exists()
    proc = subprocess.run(
        [
            sys.executable,
            "ckpt.py",
            "average",
            tmp_path / "a",
            tmp_path / "b",
            tmp_path / "soup",
            "--different_steps",
        ],
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


def counting_adam(monkeypatch) -> list[float]:
    """Adam's count as each train.main that follows starts its loop with it (the loop then runs as ever)."""
    counts, loop = [], train.train_loop

    def counted(run, preemption, start, model, opt, key):
        counts.append(float(opt.count))
        return loop(run, preemption, start, model, opt, key)

    monkeypatch.setattr(train, "train_loop", counted)
    return counts


@pytest.mark.slow
def test_stage2_from_an_olmo_core_checkpoint_follows_olmo_core_step_by_step(
    olmo_core_stages, tiny_data, tmp_path, monkeypatch
):
    """`train.py --preset 7b-midtrain --init_from OLMO_CORE_STEP_DIR` starts our stage-2 run from OLMo-core's
    stage-1 checkpoint and trains the stage-2 recipe while OLMo-core's trainer loads the same checkpoint as
    its midtraining script does: every step's batch, LR, skip, loss and grad norm agree. Had Adam's count or
    moments not carried over, or the LR schedule, the data order or the skip history not restarted, step 1
    or 2 would differ (a count reset to 0 is 8e-3 off at step 2)."""
    step_dir, stage1_rows, theirs, model_cfg = olmo_core_stages
    monkeypatch.setitem(olmo3.MODELS, "oc-stage2", model_cfg)
    cfg = dataclasses.replace(our_stage2(tiny_data, tmp_path / "ours"), init_from=str(step_dir))
    counts = counting_adam(monkeypatch)
    assert train.main(cfg) == 0
    # Adam's count as OLMo-core left it: its steps but the skipped, plus one that torch's checkpointer took to
    # materialise the empty optimizer state when the trainer saved step 0 (lr 0, zero gradients).
    assert counts == [STAGE1["steps"] - sum(r["skipped"] for r in stage1_rows) + 1]
    print(
        f"stage 2 from OLMo-core's checkpoint: max relative difference {follows_step_by_step(cfg.run_dir, theirs)}"
    )


@pytest.mark.slow
def test_stage2_from_our_stage1_run_follows_olmo_core_step_by_step(
    olmo_core_stages, tiny_data, tmp_path, monkeypatch
):
    """The same stage 2 from one of our stage-1 run directories holding OLMo-core's stage-1 state (saved by a
    stage-1 recipe with another skip window, a skip history of its own, and a newer checkpoint of other
    weights after it), by `--init_from RUN_DIR@STEP`: the README's one command."""
    step_dir, _, theirs, model_cfg = olmo_core_stages
    monkeypatch.setitem(olmo3.MODELS, "oc-stage2", model_cfg)
    cfg = our_stage2(tiny_data, tmp_path / "ours")
    stage1 = dataclasses.replace(train.PRESETS["tiny"], model="oc-stage2", skip_window=16)
    model, (mu, nu, count) = ckpt.load_olmo_core(step_dir, model_cfg)
    window = jnp.arange(1, 17, dtype=jnp.float32)
    opt = train.OptState(jnp.float32(count), mu, nu, window, 2 * window, jnp.int32(99))
    save_run(tmp_path / "stage1", stage1, model, opt, [STAGE1["steps"]], jax.random.key(5))
    stage1_run(tmp_path / "stage1", stage1, seed=3, steps=[STAGE1["steps"] + 3], model_cfg=model_cfg)
    cfg = dataclasses.replace(cfg, init_from=f"{tmp_path / 'stage1'}@{STAGE1['steps']}")
    counts = counting_adam(monkeypatch)
    assert train.main(cfg) == 0
    assert counts == [count]
    print(
        f"stage 2 from our stage-1 run: max relative difference {follows_step_by_step(cfg.run_dir, theirs)}"
    )


def command(*argv) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *map(str, argv)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


# A stage 2 of a few steps on the tiny model, as a user starts it from the command line.
STAGE_START = [
    *("--preset", "7b-midtrain", "--model", "tiny", "--data", "tiny", "--tokenizer", "tiny", "--tasks", ""),
    *("--seq_len", "64", "--global_batch", "4", "--steps", "4", "--ckpt_every", "2", "--dtype", "float32"),
    *(
        "--mesh",
        "data=1",
        "--remat",
        "none",
        "--eval_every",
        "1000",
        "--eval_batches",
        "1",
        "--skip_window",
        "4",
    ),
]


def test_the_retired_spellings_and_a_missing_source_exit_2_in_one_line_naming_the_command(
    tmp_path, tiny_data, capsys
):
    """`ckpt.py next-stage` and `from-olmo-core` and `train.py --init_from_hf` name what replaced them; a
    stage's start from a directory that is not there names what --init_from takes. Nothing is written."""
    stage1, stage2 = tmp_path / "stage1", tmp_path / "stage2"
    start = "start the stage with: python train.py --preset PRESET --init_from"
    commands = [  # as typed, started together
        (
            command("ckpt.py", "next-stage", stage1, stage2, "--preset", "7b-midtrain"),
            f"`ckpt.py next-stage` is retired; {start} RUN_DIR[@STEP] --run_dir NEW_RUN_DIR",
        ),
        (
            command("train.py", "--preset", "tiny", "--init_from_hf", stage1, "--run_dir", stage2),
            "--init_from_hf is retired; use --init_from HF_DIR",
        ),
    ]
    for proc, said in commands:
        _, err = proc.communicate(timeout=300)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {said}"), err[-2000:]
    assert ckpt.main(["from-olmo-core", str(stage1), str(stage2), "--preset", "7b"]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"error: `ckpt.py from-olmo-core` is retired; {start} OLMO_CORE_STEP_DIR --run_dir NEW_RUN_DIR"
    )
    argv = [*STAGE_START, "--data_root", str(tiny_data), "--init_from", str(stage1), "--run_dir", str(stage2)]
    said = (
        f"--init_from {stage1}: {stage1} does not exist: expected one of our run directories (checkpoints/)"
    )
    assert refused(capsys, argv, stage2).startswith(said)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_start_killed_while_its_first_checkpoint_is_written_starts_again_bit_for_bit(
    tiny_data, tmp_path, capsys
):
    """A stage started with --init_from and SIGKILLed while its first checkpoint is written leaves no
    checkpoint; the same command run again starts the stage from --init_from again, and its steps are an
    uninterrupted start's, bit for bit. Once the run directory holds the stage, the command without
    --init_from resumes it."""
    stage1 = dataclasses.replace(train.PRESETS["tiny"], skip_window=16)
    stage1_run(tmp_path / "stage1", stage1, seed=0, steps=(40,), model_cfg=olmo3.MODELS["tiny"])
    argv = [*STAGE_START, "--data_root", tiny_data, "--init_from", tmp_path / "stage1"]
    killed = train_py([*argv, "--run_dir", tmp_path / "killed"], "during_save:2", wait=False)
    whole = train_py([*argv, "--run_dir", tmp_path / "whole"])  # meanwhile, in this process
    _, killed_err = killed.communicate(timeout=600)
    assert whole.returncode == 0, whole.stderr[-3000:]
    assert killed.returncode == -signal.SIGKILL, killed_err[-3000:]
    assert not ckpt.has_checkpoints(tmp_path / "killed")  # killed before its first checkpoint committed
    again = train_py([*argv, "--run_dir", tmp_path / "killed"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"starting from {tmp_path / 'stage1'}@40 (run: weights, Adam's moments and count)" in again.stdout
    rows = lambda run: [json.loads(r) for r in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    steps = lambda run: [
        (r["step"], r["loss"], r["grad_norm"], r["batch_hash"]) for r in rows(run) if "loss" in r
    ]
    assert steps("killed") == steps("whole") and [s[0] for s in steps("whole")] == [1, 2, 3, 4]
    for run in ("killed", "whole"):  # no step 0: the stage's checkpoints are its own steps
        assert ckpt.Checkpoints(tmp_path / run, read_only=True).steps() == [2, 4]
    # The stage held in its run directory: the command without --init_from resumes it (here: it is done).
    capsys.readouterr()
    assert (
        train.cli(
            [*map(str, STAGE_START), "--data_root", str(tiny_data), "--run_dir", str(tmp_path / "whole")]
        )
        == 0
    )
    assert "run already complete: step 4" in capsys.readouterr().out
