"""Where the 7B and 32B recipes fit: `train.py --dry_run --topology` for each slice below, compiled by the TPU's
own compiler (libtpu, the [tpu] extra) on this machine, with the real Splash kernel. Prints a markdown table:
slice, flags, memory per device (state, activations, total), HBM, the spare or the overshoot, and what a step
sends per device (the dry run's traffic table: its total and its floor; --json holds each row of it).

    python bench/dry_run.py                    # every row below (hours on 2 cores: one compile at a time)
    python bench/dry_run.py --only 7b-256      # one group
    python bench/dry_run.py --row "7b v5p-512 --remat save_matmuls"   # one row of your own

Each row compiles in its own process. `optimal_seconds` from XLA's cost analysis came out negative for these
compiles: nothing here is a speed estimate; speed on a TPU is measured on a TPU.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (group, "preset topology flags"): the 7B on 256 chips of each TPU family (v5p-512 and tpu7x-512 count
# TensorCores), the smallest slices it fits, the 32B on 256 and 512 chips, and the remat policies.
ROWS = [
    ("7b-256", "7b v5p-512"),
    ("7b-256", "7b v6e-256"),
    ("7b-256", "7b v5litepod-256"),
    ("7b-256", "7b tpu7x-512"),
    ("7b-256", "7b v5p-512 --head_layout 16x256"),
    ("7b-small", "7b v5p-8 --microbatch 1"),
    ("7b-small", "7b v5p-8 --microbatch 1 --loss_chunk 1024"),
    ("7b-small", "7b tpu7x-8 --microbatch 1 --loss_chunk 1024"),
    ("7b-small", "7b v6e-8 --microbatch 1 --loss_chunk 1024"),
    ("7b-small", "7b v6e-16 --microbatch 1 --loss_chunk 1024"),
    ("7b-small", "7b v5litepod-16 --microbatch 1 --loss_chunk 1024"),
    ("7b-small", "7b v5litepod-32 --microbatch 1 --loss_chunk 1024"),
    ("32b", "32b v5p-512"),
    ("32b", "32b v5p-1024"),
    ("32b", "32b tpu7x-512"),
    ("32b", "32b tpu7x-1024"),
    ("remat", "7b v5p-512 --remat none"),
    ("remat", "7b v5p-512 --remat save_attention"),
    ("remat", "7b v5p-512 --remat save_matmuls"),
    ("remat", "7b tpu7x-512 --remat none"),
    ("remat", "7b tpu7x-512 --remat save_attention"),
    ("remat", "7b tpu7x-512 --remat save_matmuls"),
    # --remat auto (the presets' default): the policy and microbatch the fit search takes, and what the step
    # computes over the model's FLOPs (the "recompute" line), for the 7B and the 32B.
    *[
        ("auto", f"{p} {t}")
        for p in ("7b", "32b")
        for t in ("v5p-512", "tpu7x-512", "v6e-256", "h200x8", "h200x1")
    ],
    # Stage 3: 64 (the 32B: 128) rows of 65,536 tokens, documents packed; the fsdp x tensor mesh, or a context
    # axis of 8 as OLMo-core's scripts split a row.
    ("long-context", "7b-long-context v5p-512 --mesh=fsdp=64,tensor=4"),
    ("long-context", "7b-long-context v5p-512 --mesh=fsdp=32,context=8"),
    ("long-context", "7b-long-context v5p-128 --mesh=fsdp=8,context=8 --microbatch 1"),
    ("long-context", "7b-long-context v6e-256 --mesh=fsdp=32,context=8 --microbatch 1"),
    ("long-context", "7b-long-context tpu7x-128 --mesh=fsdp=16,context=8 --microbatch 1"),
    ("long-context", "32b-long-context v5p-1024 --mesh=fsdp=64,context=8 --microbatch 1"),
    # GPU hosts (the [gpu] extra: pip install -e '.[gpu]'), JAX's default 75% of each GPU's memory unless the
    # row sets XLA_PYTHON_CLIENT_MEM_FRACTION.
    ("gpu", "7b h200x1 --microbatch 1"),
    ("gpu", "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 7b h200x1 --microbatch 1"),
    ("gpu", "7b h200x8 --microbatch 1"),
    ("gpu", "7b h200x8 --microbatch 2"),
    ("gpu", "7b h200x8 --microbatch 1 --remat save_attention"),
    ("gpu", "7b h100x8 --microbatch 1"),
    # Stage 3 on GPU hosts: cuDNN's packed layout, compiled for --max_documents documents a row (a real run
    # counts them in its data; what a row of the longmino mix holds is not known here: 64 and 256 bracket it).
    ("gpu-long-context", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64"),
    ("gpu-long-context", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 2"),
    ("gpu-long-context", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 256 --microbatch 1"),
    (
        "gpu-long-context",
        "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1 --remat save_attention",
    ),
    ("gpu-long-context", "7b-long-context h200x8 --mesh=fsdp=4,tensor=2 --max_documents 64 --microbatch 1"),
    ("gpu-long-context", "7b-long-context h100x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1"),
    ("gpu-long-context", "7b-long-context h100x8 --mesh=fsdp=4,tensor=2 --max_documents 64 --microbatch 1"),
    # Stage 3 with its block linears in FP8 (the 7b-long-context preset's own policy, as the rows above) and
    # without (--fp8=), side by side on 8 H200s (the [gpu] extra) and on Ironwood.
    ("fp8", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1"),
    ("fp8", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1 --fp8="),
    ("fp8", "7b-long-context tpu7x-128 --mesh=fsdp=16,context=8 --microbatch 1"),
    ("fp8", "7b-long-context tpu7x-128 --mesh=fsdp=16,context=8 --microbatch 1 --fp8="),
    # What a step sends (the traffic table's totals beside its floor): stages 1 and 3 of the 7B and the 32B on
    # 256 v5p chips, on Ironwood and on one 8 x H200 host.
    *[
        ("traffic", f"{p} {t}")
        for p in ("7b", "32b")
        for t in ("v5p-512", "tpu7x-512", "h200x8 --microbatch 1")
    ],
    ("traffic", "7b-long-context v5p-512 --mesh=fsdp=32,context=8"),
    ("traffic", "7b-long-context tpu7x-128 --mesh=fsdp=16,context=8 --microbatch 1"),
    ("traffic", "7b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1"),
    ("traffic", "32b-long-context v5p-512 --mesh=fsdp=32,context=8 --microbatch 1"),
    ("traffic", "32b-long-context tpu7x-512 --mesh=fsdp=64,context=8 --microbatch 1"),
    ("traffic", "32b-long-context h200x8 --mesh=fsdp=8 --max_documents 64 --microbatch 1"),
]


def dry_run(row: str) -> dict:
    words = row.split()
    env = dict(os.environ, **dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("--")))
    preset, topology, *flags = [w for w in words if "=" not in w or w.startswith("--")]
    args = ["--preset", preset, "--dry_run", "--topology", topology, *flags]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:  # a dry run writes nothing there
        out = subprocess.run(
            [sys.executable, "train.py", *args, "--run_dir", run_dir],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
    result = {"row": row, "exit": out.returncode, "seconds": round(time.perf_counter() - t0)}
    result.update(report(out.stdout))
    if out.returncode not in (0, 1) or "verdict" not in result:
        result["error"] = (out.stderr or out.stdout)[-1500:]
    return result


TRAFFIC = re.compile(r"^  ([a-z-]+) +(\w+) +(\d+) +([\d,.]+) +([\d,.]+|-)  (\d+) of \d+$", re.MULTILINE)


def report(text: str) -> dict:
    """What train.py --dry_run printed: its memory rows (GiB by name), its set-up line, its verdict, its
    recompute factor, and its traffic table: each row's arrays, MiB, floor MiB (None: no floor) and arrays
    overlapped, and the totals."""
    found = {m[0].strip(): float(m[1]) for m in re.findall(r"^  (.{26}) +([\d.]+) GiB$", text, re.MULTILINE)}
    if m := re.search(r"^dry run: .*$", text, re.MULTILINE):
        found["setup"] = m.group(0)
    if m := re.search(r"^(fits.*|does not fit.*)$", text, re.MULTILINE):
        found["verdict"] = m.group(1)
    if m := re.search(r"^recompute: ([\d.]+)× ", text, re.MULTILINE):
        found["recompute"] = float(m[1])
    mib = lambda said: None if said == "-" else float(said.replace(",", ""))
    if rows := TRAFFIC.findall(text):
        found["traffic"] = {
            f"{kind} {dtype}": {
                "arrays": int(n),
                "MiB": mib(size),
                "floor MiB": mib(floor),
                "overlapped": int(o),
            }
            for kind, dtype, n, size, floor, o in rows
        }
    if m := re.search(r"^  total +([\d,.]+) +([\d,.]+)$", text, re.MULTILINE):
        found["traffic MiB"], found["floor MiB"] = mib(m[1]), mib(m[2])
    return found


def table_row(r: dict) -> str:
    preset, topology, *flags = [w for w in r["row"].split() if "=" not in w or w.startswith("--")]
    flags += [w for w in r["row"].split() if "=" in w and not w.startswith("--")]
    gib = lambda k, scale=1: f"{r[k] / scale:.1f}" if k in r else "-"
    state = r.get("parameters (fp32)", 0) + r.get("optimizer state (fp32)", 0)
    return (
        f"| {preset} | {topology} | {' '.join(flags) or 'preset defaults'} | {state:.1f} | "
        f"{gib('activations + temporaries')} | {gib('total')} | {gib('HBM')} | "
        f"{r.get('verdict', 'error: ' + r.get('error', '?').splitlines()[-1][:120])} | "
        f"{gib('traffic MiB', 1024)} | {gib('floor MiB', 1024)} | {r['seconds']} |"
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help=f"one group: {sorted({g for g, _ in ROWS})}")
    parser.add_argument(
        "--row", action="append", default=[], help="'PRESET TOPOLOGY [FLAGS]' instead of the list"
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    rows = args.row or [row for group, row in ROWS if args.only in (None, group)]
    print(
        "| preset | slice | flags | params + Adam GiB | activations + temps GiB | total GiB | HBM GiB | verdict "
        "| traffic GiB | floor GiB | compile s |\n|---|---|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )
    results = []
    for row in rows:
        results.append(dry_run(row))
        print(table_row(results[-1]), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
