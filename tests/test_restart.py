"""Restarts that do not recompile: the step read back from the compilation cache (--compile_cache), and the fit
search's choice from the run directory (RUN_DIR/fit.json), reused only for the devices and flags it was made
for; the restart's steps equal an uninterrupted run's."""

import dataclasses
import json
import os
import types
import uuid

import jax
import jax.numpy as jnp
import pytest
from commands import COMPARED, STEPS, rows, run

import ckpt
import shard
import train

# What these tests and shard.use_compilation_cache set besides the folder.
CHANGED = ("jax_persistent_cache_min_compile_time_secs", "jax_compilation_cache_max_size")


@pytest.fixture
def compile_cache(tmp_path):
    """A compilation cache of the test's own, empty; the suite's is this process's again afterwards (an
    in-process run leaves JAX pointed at its --compile_cache)."""
    kept = {name: getattr(jax.config, name) for name in CHANGED}
    yield tmp_path / "compile-cache"
    for name, value in kept.items():
        jax.config.update(name, value)
    shard.use_compilation_cache(shard.COMPILE_CACHE)


def started_afresh(run_dir, tiny_data, *flags):
    """train.py of tests/commands.py's FLAGS in this process, as a new process would run it (nothing compiled
    yet: jax.clear_caches), and how many times the train step was compiled or read from a cache."""
    compiles = []

    def count(event: str, _, fun_name: str = "", **__) -> None:
        if event == "/jax/core/compile/backend_compile_duration":  # XLA's, or the cache's answer
            compiles.append(fun_name)

    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        out = run(run_dir, tiny_data, *flags)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    return out, compiles.count("jit(train_step)")


@pytest.mark.slow
def test_a_restart_reads_the_step_from_the_cache_and_the_fit_from_the_run_directory(
    tmp_path, tiny_data, uninterrupted, compile_cache, monkeypatch
):
    """A run stopped by a bug at step 7 (its checkpoint 6 kept) and started again: the first start searches the
    fit (on devices that state their memory, faked here: a CPU states none) and compiles its step afresh into
    the cache; the restart takes the fit from RUN_DIR/fit.json and its step from the cache, compiled once (the
    loop's first step compiles nothing more), and trains the rows of the uninterrupted run."""
    monkeypatch.setattr(shard, "memory_limit", lambda mesh, target: 64 << 30)
    real_take_step = train.take_step

    def bug_at_7(run, step, *args):
        if step == 7:
            raise RuntimeError("injected")
        return real_take_step(run, step, *args)

    monkeypatch.setattr(train, "take_step", bug_at_7)
    run_dir, flags = tmp_path / "run", ("--compile_cache", compile_cache)
    first, compiled = started_afresh(run_dir, tiny_data, *flags)
    assert first.returncode == 1 and "injected" in first.stderr, first.stderr[-3000:]
    assert "fit: compiling 4 row(s) per device at a time, remat none" in first.stdout
    assert f"(compiled afresh; cached in {compile_cache})" in first.stdout
    assert compiled == 1
    assert json.loads((run_dir / "fit.json").read_text())["n_micro"] == 1

    monkeypatch.setattr(train, "take_step", real_take_step)
    again, compiled = started_afresh(run_dir, tiny_data, *flags)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "fit: compiling" not in again.stdout
    assert f"fit: 1 microbatch(es), remat none, as {run_dir / 'fit.json'} records" in again.stdout
    assert f"(from the compilation cache {compile_cache})" in again.stdout
    assert compiled == 1
    ours, theirs = rows(run_dir, "loss"), rows(uninterrupted, "loss")
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    for got, want in zip(ours, theirs, strict=True):
        assert {k: got[k] for k in COMPARED} == {k: want[k] for k in COMPARED}, got["step"]


def test_the_fit_is_searched_again_for_another_batch_or_other_devices(tmp_path, capsys):
    """RUN_DIR/fit.json answers for the devices and flags it was made for (train.fit_made_for); a change of
    --global_batch or of the devices' count searches again and records that."""
    searches = []

    def search():
        searches.append(1)
        return len(searches), "full"

    def fit(global_batch: int, devices: int):
        cfg = dataclasses.replace(train.PRESETS["tiny"], global_batch=global_batch)
        mesh = shard.make_mesh(f"fsdp={devices}", jax.devices()[:devices])
        run = types.SimpleNamespace(
            cfg=cfg, mesh=mesh, model_cfg=train.model_config(cfg), compute=cfg.compute
        )
        return ckpt.recorded_fit(str(tmp_path), train.fit_made_for(run, 16 << 30), search)

    assert fit(8, 4) == (1, "full")
    assert fit(8, 4) == (1, "full")  # recorded: no search
    assert fit(16, 4) == (2, "full")
    assert "was made for other flags; searching again" in capsys.readouterr().out
    assert fit(16, 8) == (3, "full")
    assert "was made for other devices, mesh; searching again" in capsys.readouterr().out
    assert fit(16, 8) == (3, "full") and len(searches) == 3
    assert json.loads((tmp_path / "fit.json").read_text())["made_for"]["devices"]["count"] == 8


def test_the_compilation_cache_may_be_in_a_bucket(gcs_emulator, compile_cache):
    """--compile_cache gs://BUCKET/PATH: JAX writes each program there (etils' epath over gcsfs) and a process
    that compiles it again reads it back, as shard.compile_watched tells (a program too small for JAX's
    threshold of compile time, which is set aside here)."""
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    bucket = gcs_emulator.create_bucket(f"cache-{uuid.uuid4().hex[:12]}")
    shard.use_compilation_cache(f"gs://{bucket.name}/jax")
    program = jax.jit(lambda x: jnp.tanh(x) @ x.T)
    compile_it = lambda: program.lower(jax.ShapeDtypeStruct((8, 8), jnp.float32)).compile()
    did = []
    for _ in range(2):
        jax.clear_caches()  # as a new process: nothing compiled yet
        did.append(shard.compile_watched(compile_it)[2])
    assert did == [dict(compiles=1, hits=0, writes=1), dict(compiles=1, hits=1, writes=0)]
    names = [blob.name.split("-")[0] for blob in bucket.list_blobs()]
    assert names == ["jax/jit__lambda"]  # the program alone: no eviction's access times
    assert not os.path.exists("gs:")  # nor its lock, a local file named as the bucket's folder
