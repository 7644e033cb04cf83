"""Each bench script at its smallest size: it runs through and prints its table (its numbers mean nothing on
CI's CPU, so they are not checked). bench/reference.py is run by tests/test_reference.py."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(script: str, *args: str) -> str:
    out = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.slow
def test_speed_cpu_comparison_prints_both_systems_the_ratio_and_determinism():
    out = bench("speed.py", "--preset", "tiny", "--steps", "1")
    for line in ["system ", "olmo3-jax train_step (tiny preset) ", "transformers Olmo3 eager (sdpa), fp32 "]:
        assert f"\n{line}" in out, out
    assert "\nratio ours/transformers-eager = " in out
    assert "\ndeterminism: losses bitwise equal" in out, out  # the CPU's XLA ops are deterministic


def test_speed_gpu_path_runs_through_at_a_cpu_s_size():
    out = bench("speed.py", "--gpu", "--small", "--only", "determinism")
    assert "\nsystem " in out and "\ndeterminism run 1 " in out and "\ndeterminism run 2 " in out, out
    assert "\ndeterminism: losses " in out


def test_dry_run_prints_a_row_train_py_refuses_as_an_error_in_its_table():
    """bench/dry_run.py end to end on a row train.py refuses at once (a row that compiles: tests/test_compile.py
    reads a TPU dry run's report with dry_run.report and writes its table row)."""
    out = bench("dry_run.py", "--row", "tiny v5litepod-4 --no_such_flag 1").splitlines()
    assert out[0].startswith("| preset | slice | flags |") and out[1].startswith("|---|")
    row = out[2].split(" | ")
    assert row[:3] == ["| tiny", "v5litepod-4", "--no_such_flag 1"], out
    assert row[7] == "error: error: unknown flag --no_such_flag; see --help", out


def test_data_speed_prints_every_row():
    out = bench("data_speed.py", "--small")
    table = out[out.index("what ") :].splitlines()
    names = [line.split(" | ")[0].strip() for line in table[2:-1]]
    assert len(names) == 22 and names[0] == "TokenLoader.global_batch, 64 x 8192, page cache cold", table
    assert table[-1].startswith("peak memory of this process: ")


def test_ckpt_speed_saves_and_restores():
    out = bench(
        "ckpt_speed.py", "--preset", "tiny", "--layers", "1", "--repeats", "1", "--moments"
    ).splitlines()
    assert out[0].startswith("state: ") and "+ Adam moments" in out[0]
    assert out[1].split() == ["save", "blocked", "s", "committed", "s", "GiB/s"]
    assert out[2].split()[0] == "1" and out[3].startswith("restore with checksums verified: "), out


@pytest.mark.slow
def test_downstream_prints_ours_beside_the_reference_and_the_speeds(tmp_path, tiny_data):
    import jax

    import ckpt
    import olmo3

    run = tmp_path / "run"  # a tiny run's directory: a checkpoint and the tokenizer
    ckpt.write_first_step(run, olmo3.Olmo3(olmo3.MODELS["tiny"], key=jax.random.key(0)), None)
    (run / "tokenizer.json").write_text((tiny_data / "tokenizer.json").read_text())
    tasks = "copycolors_10way_fast,basic_skills_arithmetic_rc_5shot"
    args = ["--run_dir", str(run), "--data_root", str(tiny_data), "--docs", "2", "--seq_len", "256"]
    out = bench("downstream.py", *args, "--tasks", tasks)
    assert "\n| copycolors_10way_fast | accuracy | 2 | " in out, out
    assert "\n| basic_skills_arithmetic_rc_5shot | " in out
    assert "\nheld-out tiny-val: CE ours " in out
    for line in [
        "| train step, 8 x 256 | ",
        "| held-out evaluation, ",
        "| downstream evaluation, 2 tasks at 256 | ",
    ]:
        assert f"\n{line}" in out, out


@pytest.mark.slow
def test_fp8_prints_the_three_policies_side_by_side(tiny_data):
    args = ["--steps", "3", "--seq_len", "256", "--global_batch", "2", "--held_out", "512"]
    out = bench("fp8.py", *args, "--data_root", str(tiny_data)).splitlines()
    table = [line.split(" | ") for line in out if line.startswith("| ")]
    assert [row[0] for row in table[1:]] == ["| fp32", "| bf16", "| bf16 + fp8"], out
    bf16 = table[2]
    assert (bf16[2], bf16[4]) == ("0.0000", "100.00%"), out  # the bf16 run against itself
