"""Each bench script at its smallest size: it runs through and prints its table, every row with its figures
(what they are is not checked: they mean nothing on CI's CPU). bench/reference.py is run by
tests/test_reference.py, bench/compare.py by tests/test_compare.py, bench/fp8.py by tests/test_fp8.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def bench(script: str, *args: str, env: dict | None = None) -> str:
    out = subprocess.run(
        [sys.executable, f"bench/{script}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env=os.environ | (env or {}),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


# bench/speed.py --plan N --small: each section's title, then its rows by system (None: the repro's own lines),
# then its closing lines.
PLAN = {
    1: [
        ("the cuDNN attention repro: python bench/cudnn_repro.py --small", None, ["repro: exit 0, "]),
        (
            "8 layers at 7B width, seq 128, batch 1, no remat",
            [
                "olmo3-jax (deterministic ops), process 1",
                "olmo3-jax (deterministic ops), process 2",
                "olmo3-jax, --nondeterministic",
            ],
            [
                "determinism: losses bitwise equal: ",  # the CPU's XLA ops are deterministic
                "ratio deterministic/nondeterministic = ",
            ],
        ),
    ],
    2: [
        (
            "the full 7B on one chip: microbatch 1 x 128, 8 accumulated, remat full",
            ["olmo3-jax 7b preset (remat full)"],
            [],
        ),
        (
            "levers, 8 layers at 7B width, seq 128, batch 1",
            [
                "default: cudnn, remat none",
                "scan_unroll 2",
                "remat save_matmuls",
                "remat save_attention",
                "remat full",
                "heads 2x64 (cudnn)",
            ],
            [
                "ratio scan_unroll 2/default = ",
                "ratio remat save_matmuls/default = ",
                "ratio remat save_attention/default = ",
                "ratio remat full/default = ",
                "ratio heads 2x64 (cudnn)/default = ",
            ],
        ),
    ],
}
FWD_BWD = {"olmo3-jax (deterministic ops), process 1", "olmo3-jax (deterministic ops), process 2"}
FWD_BWD |= {"olmo3-jax, --nondeterministic"}  # the rows whose forward+backward is timed apart


def check_table(block: str, title: str, systems: list[str], closing: list[str]) -> None:
    """A section's title, its columns, a row of figures for each system (on the CPU every lever compiles, so
    a row without figures is a bug; MFU is "-" without a chip's peak), then its closing lines."""
    lines = block.splitlines()
    assert lines[0].startswith(title) and lines[1].split()[:3] == ["system", "tokens/s", "step"], block
    rows, rest = lines[2 : 2 + len(systems)], lines[2 + len(systems) :]
    assert [row[:44].rstrip() for row in rows] == systems, block
    for row in rows:  # tokens/s, step s, MFU, fwd+bwd s, its MFU, peak memory, compile s
        tokens_s, step_s, mfu, fwd_bwd_s, fwd_bwd_mfu, mem, _ = row[44:].split()
        assert float(tokens_s.replace(",", "")) > 0 and float(step_s) > 0 and float(mem) > 0, row
        assert mfu == fwd_bwd_mfu == "-", row
        assert (float(fwd_bwd_s) > 0) if row[:44].rstrip() in FWD_BWD else fwd_bwd_s == "-", row
    assert len(rest) == len(closing), block
    assert all(line.startswith(start) for line, start in zip(rest, closing, strict=True)), block


@pytest.mark.slow
def test_speed_gpu_plan_runs_through_at_a_cpu_s_size(tmp_path):
    """Both calls of a lent GPU's plan, each row in its own process, what they print and what they write to
    $OUT: the transcript, the rows as JSON (with the chip, the versions, the losses), each process's log."""
    for call, sections in PLAN.items():
        out = bench("speed.py", "--plan", str(call), "--small", env={"OUT": str(tmp_path)})
        assert (tmp_path / f"plan{call}.txt").read_text() == out
        blocks = out.strip().split("\n\n")
        assert blocks[0].startswith("jax ") and f"; plan {call} of 2: " in blocks[0], out
        assert len(blocks) == 2 + len(sections), out
        for block, (title, systems, closing) in zip(blocks[1:-1], sections, strict=True):
            if systems is None:  # the repro: its own output, then how it ended
                lines = block.splitlines()
                assert lines[0] == title and lines[-1].startswith(closing[0]), block
            else:
                check_table(block, title, systems, closing)
        measured = [name for _, systems, _ in sections for name in systems or []]
        assert blocks[-1].startswith(f"{len(measured)} rows measured, 0 without figures, on cpu (jax "), out
        rows = json.loads((tmp_path / f"plan{call}.json").read_text())
        assert [r["system"] for r in rows if "exit" not in r] == measured
        for r in rows:
            assert "error" not in r and r.get("exit", 0) == 0, r
            assert (
                "exit" in r
                or r["tokens_per_s"] > 0
                and r["device"] == "cpu"
                and r["versions"].startswith("jax ")
            )
        logs = sorted((tmp_path / f"plan{call}-logs").iterdir())
        assert len(logs) == len(rows) and all(log.read_text().startswith("$ ") for log in logs)
    determinism = [r for r in json.loads((tmp_path / "plan1.json").read_text()) if "losses" in r]
    assert [r["deterministic"] for r in determinism] == [True, True, False]
    assert len(determinism[0]["losses"]) == 2  # the first step and the one timed step


@pytest.mark.slow
def test_speed_gpu_runs_transformers_in_a_process_of_its_own():
    """--gpu without --no_transformers: transformers' row measured beside ours, and the ratio of the two."""
    out = bench("speed.py", "--gpu", "--small", "--only", "7b", env={"OUT": ""})  # no files written
    blocks = out.strip().split("\n\n")
    assert len(blocks) == 3, out
    title = "the full 7B on one chip: microbatch 1 x 128, 8 accumulated, remat full"
    systems = ["olmo3-jax 7b preset (remat full)", "transformers, gradient checkpointing"]
    check_table(blocks[1], title, systems, ["ratio ours/transformers-checkpointing = "])


def test_dry_run_prints_a_row_train_py_refuses_as_an_error_in_its_table():
    """bench/dry_run.py end to end on a row train.py refuses at once (a row that compiles: tests/test_compile.py
    reads a TPU dry run's report with dry_run.report and writes its table row; compiling one here again cost
    47 s of the suite)."""
    out = bench("dry_run.py", "--row", "tiny v5litepod-4 --no_such_flag 1").splitlines()
    assert out[0].startswith("| preset | slice | flags |") and out[1].startswith("|---|") and len(out) == 3
    row = out[2].split(" | ")
    assert row[:3] == ["| tiny", "v5litepod-4", "--no_such_flag 1"], out
    assert row[7] == "error: error: unknown flag --no_such_flag; see --help", out


def test_data_speed_prints_every_row():
    out = bench("data_speed.py", "--small")
    table = out[out.index("what ") :].splitlines()
    names = [line.split(" | ")[0].strip() for line in table[2:-1]]
    assert len(names) == 26 and names[0] == "TokenLoader.global_batch, 64 x 8192, page cache cold", table
    assert table[-1].startswith("peak memory of this process: ")


def test_ckpt_speed_saves_and_restores_on_a_local_disk_and_on_the_gcs_emulator():
    args = ["--preset", "tiny", "--layers", "1", "--repeats", "1", "--moments", "--places", "local,emulator"]
    out = [line for line in bench("ckpt_speed.py", *args).splitlines() if line]
    assert out[0].startswith("state: ") and "+ Adam moments" in out[0]
    for at, place in ((1, "local: "), (5, "emulator: gs://")):
        assert out[at].startswith(place), out
        assert out[at + 1].split() == ["save", "blocked", "s", "committed", "s", "GiB/s"]
        assert out[at + 2].split()[0] == "1", out
        assert out[at + 3].startswith("restore with checksums verified: "), out


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


def test_cudnn_repro_runs_both_cases_at_a_cpu_s_size():
    """bench/cudnn_repro.py --small: each case in its own process, each line saying how it ended. With the
    [gpu] extra the calls are compiled for an H200, and only the workaround marks the backward calls (XLA's
    own marking happens on a GPU only); without it they run on this CPU through XLA's attention."""
    lines = bench("cudnn_repro.py", "--small").splitlines()
    names = ("without the workaround", "with the workaround")
    assert lines[0].startswith("cuDNN attention backward under deterministic ops: two identical"), lines
    cases = {line.partition(": ")[0]: line.partition(": ")[2] for line in lines[1:]}
    if cases["device"] == "cpu":  # without the [gpu] extra
        assert all(cases[c].startswith("ran (XLA's attention on the cpu") for c in names), lines
        return
    assert cases["device"].startswith("NVIDIA H200"), lines
    for case, marked in zip(names, ("0 of 2", "2 of 2"), strict=True):
        assert cases[case].startswith(
            "compiled (not run: no GPU); backward calls marked force_deterministic: "
        ), lines
        assert f"force_deterministic: {marked};" in cases[case], lines
