"""Nothing lost, every refusal in one line: a sound checkpoint of another shape is never quarantined, a
changed skip window is carried as OLMo-core carries a state without its history, and the cases a sweep of
real commands found unclear each get one line naming the file, flag or path."""

import dataclasses
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import equinox as eqx
import jax
import pytest
from commands import ckpt_py, train_py
from damage import flip_byte

import ckpt
import data
import olmo3
import shard
import train

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ["--preset", "tiny", "--seq_len", "64", "--global_batch", "8", "--lr_horizon", "8", "--eval_every"]
FLAGS += ["1000", "--samples", "0", "--ckpt_every", "4"]


@pytest.fixture(scope="module")
def four_steps(tiny_data, tmp_path_factory):
    """A tiny run of 4 steps, checkpoint at step 4, its skip window 128 (the preset's)."""
    run_dir = tmp_path_factory.mktemp("four") / "run"
    argv = [*FLAGS, "--steps", "4", "--data_root", str(tiny_data), "--run_dir", str(run_dir)]
    assert train.cli(argv) == 0
    return run_dir


def test_a_new_skip_window_allowed_carries_the_state_and_quarantines_nothing(four_steps, tiny_data, tmp_path):
    """The sweep's case: a copy of a 4-step run given --steps 6 --skip_window 64 --allow_config_change. The
    checkpoint is read as saved, Adam goes on, the skip history starts empty; nothing is moved."""
    run_dir = tmp_path / "copy"
    shutil.copytree(four_steps, run_dir)
    argv = [
        *FLAGS,
        "--steps",
        "6",
        "--skip_window",
        "64",
        "--allow_config_change",
        "--data_root",
        str(tiny_data),
    ]
    assert train.cli([*argv, "--run_dir", str(run_dir)]) == 0
    assert not (run_dir / "quarantined").exists()
    ckpts = ckpt.Checkpoints(run_dir, read_only=True)
    assert ckpts.steps() == [4, 6]
    old = ckpts.saved_train_state(4)["opt"]
    new = ckpts.saved_train_state(6)["opt"]
    ckpts.close()
    assert old["losses"].shape == (128,) and new["losses"].shape == (64,)
    _, state, _ = ckpt.Checkpoints(run_dir, read_only=True).read(6)
    assert int(state["opt"]["seen"]) == 2 and float(state["opt"]["count"]) == 6  # history afresh, Adam on
    # OLMo-core after a load without history skips nothing until half its window is known, nor does a run
    # that never stopped (no spike here): steps 5 and 6 are those of 6 steps straight, bit for bit.
    straight = tmp_path / "straight"
    assert train.cli([*FLAGS, "--steps", "6", "--data_root", str(tiny_data), "--run_dir", str(straight)]) == 0
    assert train_rows(run_dir)[4:] == train_rows(straight)[4:] and len(train_rows(run_dir)) == 6


def train_rows(run_dir: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["grad_norm"], r["batch_hash"]) for r in rows if "loss" in r]


def test_a_sound_checkpoint_of_another_shape_is_refused_in_one_line_and_stays(four_steps, tmp_path):
    """Read with another window (as a recipe that differs in it would): ResumeRefused, naming the arrays
    and both shapes; never a corruption, so never moved to quarantined/."""
    run_dir = tmp_path / "copy"
    shutil.copytree(four_steps, run_dir)
    cfg = dataclasses.replace(train.PRESETS["tiny"], seq_len=64, skip_window=32)
    model = olmo3.abstract(train.model_config(cfg))
    opt = eqx.filter_eval_shape(train.init_opt, model, cfg)
    ckpts = ckpt.Checkpoints(run_dir)
    like = {"opt": ckpt.on_first_device(opt), "key": jax.ShapeDtypeStruct((2,), "uint32")}
    with pytest.raises(ckpt.ResumeRefused) as refused:
        ckpts.restore_latest(ckpt.on_first_device(model), like)
    ckpts.close()
    said = str(refused.value)
    assert "opt.losses (128,) vs (32,)" in said and "it is sound" in said and "\n" not in said
    assert (run_dir / "checkpoints" / "4").is_dir() and not (run_dir / "quarantined").exists()


def test_a_corrupt_step_asked_for_is_named_with_its_path_and_step(four_steps, tmp_path):
    run_dir = tmp_path / "copy"
    shutil.copytree(four_steps, run_dir)
    flip_byte(run_dir / "checkpoints" / "4")
    out = ckpt_py("to-hf", run_dir, tmp_path / "hf", "--step", "4")
    where = run_dir.absolute() / "checkpoints" / "4"
    assert out.returncode == 1 and out.stderr.startswith(
        f"error: checkpoint {where} (step 4): checksum mismatch"
    )
    assert out.stderr.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_list_names_an_interrupted_first_write_and_fails(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    (folder / "0.orbax-checkpoint-tmp-1764").mkdir(parents=True)
    (tmp_path / "run" / "lock").write_text("pid 1 on another-host\n")
    out = ckpt_py("list", tmp_path / "run")
    assert out.returncode == 1
    assert out.stdout.splitlines()[-1] == (
        f"no committed checkpoint in {folder}; only interrupted writes, never committed: 0.orbax-checkpoint-tmp-1764"
    )


def test_ckpt_py_names_no_flag_it_does_not_have(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    out = ckpt_py("from-hf", tmp_path / "nowhere", tmp_path / "file" / "run")
    assert out.returncode == 1 and "--run_dir" not in out.stderr and out.stderr.count("\n") == 1


def test_average_of_a_run_with_itself_is_refused_before_anything_is_written(four_steps, tmp_path):
    out = ckpt_py("average", four_steps, f"{four_steps}/", tmp_path / "soup")
    assert out.returncode == 1 and "are one run" in out.stderr and out.stderr.count("\n") == 1
    assert not (tmp_path / "soup").exists()


@pytest.mark.parametrize(
    "flags,says",
    [
        (
            "--global_batch 6",
            "--global_batch 6: expected a multiple of the 8 data x fsdp devices of --mesh fsdp=-1 (each "
            "device takes whole rows)",
        ),
        (
            "--global_batch 16 --microbatch 3",
            "--microbatch 3: expected a divisor of the 2 rows each device takes (--global_batch 16 over the 8 "
            "data x fsdp devices of --mesh fsdp=-1)",
        ),
    ],
)
def test_a_batch_that_does_not_split_names_the_flag_that_must_change(flags, says):
    cfg = train.parse_args(["--preset", "tiny", "--mesh", "fsdp=-1", *flags.split()])
    mesh = jax.make_mesh((1, 8, 1, 1), ("data", "fsdp", "context", "tensor"))
    with pytest.raises(train.FlagError) as refused:
        train.microbatches(cfg, mesh)
    assert str(refused.value) == says


def test_a_wandb_that_fails_to_import_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "wandb", None)  # found, but its import raises
    with pytest.raises(
        train.FlagError, match=r"^--wandb p: wandb is installed but fails to import \(ModuleNotFoundError"
    ):
        train.check_flags(train.parse_args(["--preset", "tiny", "--wandb", "p"]))


def test_a_stage_3_export_is_read_by_transformers_without_a_warning(tmp_path):
    """A YaRN model exported at a --seq_len below the context YaRN extends to: transformers checks
    max_position_embeddings against YaRN's original length times its factor, and warns where they differ."""
    import logging

    import transformers

    cfg = dataclasses.replace(train.PRESETS["tiny"], yarn=8.0, seq_len=512)
    ckpt.save_hf(olmo3.Olmo3(train.model_config(cfg), key=jax.random.key(0)), tmp_path / "hf")
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        hf = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert hf.max_position_embeddings == 8 * olmo3.MODELS["tiny"].max_seq_len and said == []


def test_to_hf_onto_a_full_disk_says_so_in_one_line_and_leaves_nothing(four_steps, tmp_path):
    """OUT on a 2 MB tmpfs of its own (a mount namespace), which the tiny model's 30 MB fill."""
    full = tmp_path / "full"
    full.mkdir()
    command = (
        f"mount -t tmpfs -o size=2m tmpfs {full} && {sys.executable} ckpt.py to-hf {four_steps} {full}/hf; "
    )
    command += f"echo rc=$?; ls -A {full}"
    out = subprocess.run(["unshare", "-rm", "sh", "-c", command], cwd=ROOT, capture_output=True, text=True)
    if "mount" in out.stderr:  # (no private mounts here)
        pytest.skip(out.stderr)
    assert out.stderr.startswith(f"error: writing {full}/hf failed (") and out.stderr.count("\n") == 1
    assert "No space left on device" in out.stderr and out.stdout.split() == ["rc=1"]


def test_eval_only_given_checkpoints_and_other_weights_is_refused_as_ambiguous(
    four_steps, tiny_data, tmp_path, capsys
):
    """--eval_only scores the weights the flags name: a run directory with checkpoints and --init_from both
    name weights, so it is refused in one line, and the run directory is left as it was."""
    ckpt.save_hf(olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(1)), tmp_path / "hf")
    before = {p: p.read_bytes() for p in four_steps.rglob("*") if p.is_file()}
    argv = [
        *FLAGS,
        "--steps",
        "4",
        "--data_root",
        str(tiny_data),
        "--run_dir",
        str(four_steps),
        "--eval_only",
    ]
    assert train.cli([*argv, "--init_from", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --eval_only --init_from {tmp_path / 'hf'}: --run_dir {four_steps} holds ")
    assert "ambiguous" in err and err.count("\n") == 1
    assert {p: p.read_bytes() for p in four_steps.rglob("*") if p.is_file()} == before


def test_a_damaged_init_from_step_stops_in_one_line_and_leaves_no_run_directory(
    four_steps, tiny_data, tmp_path
):
    """The sweep's case: --init_from RUN@STEP whose arrays fail their checksums (its metadata reads, so the
    start is accepted) stops when it is read, naming it, and leaves no run directory (docs/stages.md): not the
    folders it made for one (an empty checkpoints/ would make it look like a run to --init_from and `list`),
    while the folder that was there before stays."""
    source = tmp_path / "source"
    shutil.copytree(four_steps, source)
    flip_byte(source / "checkpoints" / "4")
    new = tmp_path / "new" / "run"  # two folders made for it
    argv = [*FLAGS, "--steps", "6", "--data_root", str(tiny_data), "--run_dir", str(new)]
    out = train_py([*argv, "--init_from", f"{source}@4"])
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith(f"error: --init_from {source}@4: ") and "checksum mismatch" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["source"]


def test_the_sweeps_smaller_storage_cases_each_get_their_line(tmp_path, tiny_data):
    """An http(s):// glob names why it cannot be one; a mix file named by --data is looked for under
    --data_root too, and where it is missing both places are named."""
    with pytest.raises(data.DataError, match="an HTTP server lists no files to glob"):
        data.expand(["http://host/data/*.npy"], "--data")
    mix = tmp_path / "mixes" / "mix.txt"
    mix.parent.mkdir()
    mix.write_text(f"tiny,{tiny_data / 'train' / 'part-00000.npy'}\n")
    assert data.resolve("mixes/mix.txt", str(tmp_path))[0] == [str(tiny_data / "train" / "part-00000.npy")]
    with pytest.raises(FileNotFoundError, match=f"looked for mixes/gone.txt and {tmp_path}/mixes/gone.txt"):
        data.resolve("mixes/gone.txt", str(tmp_path))


def test_a_profile_of_steps_a_resume_is_past_says_so(four_steps, tiny_data, tmp_path, capsys):
    """--profile 2:2 on a run resuming at step 5 traces nothing, and says so in a line (it used to say
    nothing); --profile 4:3 there traces the steps left of it, 5 and 6."""
    profile = ckpt.Profile("2:2", str(tmp_path))
    profile.dispatching(5)
    assert "--profile 2:2: this run starts at step 5, past them: nothing is traced" in capsys.readouterr().out
    assert profile.folder is None
    later = ckpt.Profile("4:3", str(tmp_path))
    later.dispatching(5)
    assert (later.first, later.last, later.folder) == (5, 6, str(tmp_path / "profile"))
    later.dispatching(6)
    later.finished(6)
    assert list((tmp_path / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))


def test_a_7b_on_cpu_devices_is_refused_in_one_line_before_anything_is_written(tmp_path, monkeypatch):
    """The 7B preset on devices that turned out to be CPUs (as on a TPU VM where libtpu did not load): one
    line naming the devices found and the dry run, exit 2, before the model is built or the run directory
    made. A dry run on the same devices is not refused."""
    monkeypatch.setattr(train, "plan_run", lambda *a: pytest.fail("refused only once the run was planned"))
    # --tasks '': checking the preset's 26 task names would import olmo_eval and torch (5 s) first
    out = train_py(["--preset", "7b", "--tasks", "", "--run_dir", tmp_path / "run"])
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr[-3000:]
    assert out.stderr.startswith(
        f"error: --preset 7b: {7_298_617_344:,} parameters, too many for the devices"
    )
    assert f"{jax.device_count()} CPU devices" in out.stderr and "--dry_run --topology v5p-512" in out.stderr
    assert not (tmp_path / "run").exists()
    cfg = train.parse_args(["--preset", "7b", "--dry_run"])
    train.check_devices_suffice(cfg, shard.make_mesh(cfg.mesh, jax.devices()), 7_298_617_344)
