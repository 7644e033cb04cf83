"""Each bench script at its smallest size: it runs through and prints its table, every row with its figures
(what they are is not checked: they mean nothing on CI's CPU). bench/reference.py is run by
tests/test_reference.py, bench/compare.py by tests/test_compare.py, bench/fp8.py by tests/test_fp8.py."""

import json
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


# bench/speed.py --gpu --small: each section's title, then its rows by system, then its closing lines.
GPU_SECTIONS = [
    (
        "8 layers at 7B width, seq 256, batch 1",
        [
            "olmo3-jax (cudnn window, no remat)",
            "transformers eager (sdpa, autocast bf16)",
            "transformers + torch.compile (aot_eager)",
        ],
        ["ratio ours/transformers-eager = ", "ratio ours/transformers-compiled = "],
    ),
    (
        "the full 7B on one chip: microbatch 1 x 256, 8 accumulated, remat full",
        ["olmo3-jax 7b preset (remat full)", "transformers, gradient checkpointing"],
        ["ratio ours/transformers-checkpointing = "],
    ),
    (
        "levers, 8 layers at 7B width, seq 256, batch 1",
        [
            "default: cudnn, remat none",
            "remat save_matmuls",
            "remat save_attention",
            "remat full",
            "fused loss in chunks of 1024",
            "scan_unroll 2",
            "attention reference (XLA)",
            "heads 2x128 (cudnn)",
            "heads 2x128 (XLA)",
        ],
        [],
    ),
    (
        "determinism: two fresh runs of 4 layers, batch 1 x 256",
        ["determinism run 1", "determinism run 2"],
        ["determinism: losses bitwise equal: "],  # the CPU's XLA ops are deterministic
    ),
]


@pytest.mark.slow
def test_speed_gpu_path_runs_through_every_section_at_a_cpu_s_size(tmp_path):
    """Each section prints its table, a row of figures for every system (on the CPU every lever compiles, so a
    lever's "failed" row is a bug), and its ratios."""
    out = bench("speed.py", "--gpu", "--small", "--json", str(tmp_path / "rows.json"))
    blocks = out.strip().split("\n\n")
    assert blocks[0].startswith("jax ") and len(blocks) == 1 + len(GPU_SECTIONS), out
    for block, (title, systems, closing) in zip(blocks[1:], GPU_SECTIONS, strict=True):
        lines = block.splitlines()
        assert lines[0].startswith(title) and lines[1].split()[:3] == ["system", "tokens/s", "step"], block
        rows, rest = lines[2 : 2 + len(systems)], lines[2 + len(systems) :]
        assert [row[:44].rstrip() for row in rows] == systems, block
        for row in rows:  # tokens/s, step s, MFU ("-" without a peak), peak memory, compile s
            assert "failed:" not in row and len(row[44:].split()) == 5, row
            tokens_s, step_s, _, mem, _ = row[44:].split()
            assert float(tokens_s.replace(",", "")) > 0 and float(step_s) > 0 and float(mem) > 0, row
        assert len(rest) == len(closing), block
        assert all(line.startswith(start) for line, start in zip(rest, closing, strict=True)), block
    rows = json.loads((tmp_path / "rows.json").read_text())
    assert [r["system"] for r in rows] == [name for _, systems, _ in GPU_SECTIONS for name in systems]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows


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
