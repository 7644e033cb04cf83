"""Our train step against transformers' Olmo3ForCausalLM on the same shapes; and what a lent GPU measures.

    python bench/speed.py --preset tiny        # 2-core CPU: the tiny preset's shape and batch, fp32
    python bench/speed.py --steps 1            # smallest: the CPU comparison timed over one step (a check)
    python bench/speed.py --gpu                # one GPU: the repro, 8 layers at 7B width, the full 7B, levers
    python bench/speed.py --gpu --only levers --levers scan_unroll,remat   # some rows of the lever table
    python bench/speed.py --gpu --only 7b --no_transformers --profile /tmp/prof   # + where the time goes
    python bench/speed.py --plan 1             # a lent H200's 15 minutes: the first call (330 s) ...
    python bench/speed.py --plan 2             # ... and the second
    python bench/speed.py --plan 1 --small     # the plan's code at a CPU's size: does it run through? (CI)

Prints one row per system (tokens/s, step time, MFU, the forward+backward alone and its MFU, peak memory,
compile time) and lines beginning `ratio`. MFU = tokens/s x Olmo3Config.flops_per_token (exact
causal/sliding attention count) / the chip's peak. The forward+backward (timed on our 8-layer rows) is
train.loss_fn's gradients, jitted alone on the step's shapes: the step without its optimizer, which the
8-layer row runs every 8,192 tokens (~7% of its step; the recipe spreads it over 64-512 microbatches).

On the CPU, ours and transformers take turns in one process, so a noisy neighbour slows both alike. With --gpu
each row is measured in a process of its own (`--one SYSTEM`, its row written as JSON): JAX keeps its memory
pool until its process ends, and transformers' rows ran out of memory beside ours. On a GPU, each row of
ours under deterministic ops first compiles its step once more, tuned (ckpt.autotuned_gemms, as train.py
does before its step first compiles): XLA's autotuner otherwise takes the first GEMM configuration that
compiles, not the fastest, and the rows would overstate what determinism costs. That compile is in the row's
compile column, and its JSON row says gemms_autotuned.

The plan for a lent H200 (15 minutes of device time, its start included): two commands of at most 6 minutes
each, the rows in order of value:
  --plan 1  the cuDNN attention repro (python bench/cudnn_repro.py, about a minute); the deterministic 8-layer
            step at 7B width (train.py's default ops) twice, in two processes: are the losses bitwise equal?
            Then the same step with --nondeterministic: what determinism costs.
            = --gpu --only repro,8layers --no_transformers --budget_s 330
  --plan 2  the 7B preset on one chip (global batch 8, microbatch 1, remat full); the levers on the 8-layer
            step: the default, scan_unroll 2, remat save_matmuls / save_attention / full, heads 16x256.
            = --gpu --only 7b,levers --levers scan_unroll,remat,heads --no_transformers --budget_s 330
Within a budget every process is given what is left of it (at most its own limit, LIMITS_S), and none starts
with under 30 s left: the call ends within 330 s, and a row not measured in time says so. With less device
time left than a call needs, pass --budget_s 30 s under it. Where $OUT is set (a folder the lent machine
sends back), or with --out, a call also writes there plan1.txt (what it printed), plan1.json (its rows, each
with its chip, versions and date) and plan1-logs/ (each process's output); --json writes the rows too.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ckpt  # noqa: E402
import olmo3  # noqa: E402
import shard  # noqa: E402
import train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
PLANS = {
    1: dict(only="repro,8layers", levers=""),
    2: dict(only="7b,levers", levers="scan_unroll,remat,heads"),
}
PLAN_BUDGET_S = 330  # of a call's 360: the last process's output written back and the parent's exit
# The most seconds each kind of process may take on an H200, as estimated from the first measurements (the
# 8-layer step compiled in 20 s, a process starts in about 10): a stuck one cannot eat the rest of a call.
LIMITS_S = {"repro": 120, "8layers": 150, "7b": 300, "lever": 120, "transformers": 300}
MIN_START_S = 30  # a process given less could not start, compile and time a step on an H200: not started
TRANSCRIPT = None  # with $OUT or --out: a copy of what the parent prints
LOGS = None  # ... and the folder for each process's output


def say(line: str = "") -> None:
    print(line, flush=True)
    if TRANSCRIPT:
        with open(TRANSCRIPT, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------------------------------
# Measuring one system: its first call (the compile) apart, then timed steps.


def mfu(tokens_per_s: float, mcfg: olmo3.Olmo3Config, seq: int) -> float | None:
    peak = shard.peak_flops(jax.devices()[0])
    return round(tokens_per_s * mcfg.flops_per_token(seq) / peak, 4) if peak else None


COLUMNS = (
    f"{'system':<44} {'tokens/s':>10} {'step s':>8} {'MFU':>7} {'fwd+bwd s':>9} {'f+b MFU':>7} "
    f"{'mem GiB':>8} {'compile':>8}"
)


def row_line(row: dict) -> str:
    """A row of the table ("-" where a figure is not known: MFU without a chip's peak, the forward+backward
    where it was not timed); a system with no figures says why."""
    if "error" in row:
        return f"{row['system']:<44} {row['error']}"
    known = lambda key, form: format(row[key], form) if row.get(key) is not None else "-"
    pct = lambda key: f"{100 * row[key]:.1f}%" if row.get(key) is not None else "-"
    return (
        f"{row['system']:<44} {row['tokens_per_s']:>10,} {row['step_s']:>8.3f} {pct('mfu'):>7} "
        f"{known('fwd_bwd_s', '.3f'):>9} {pct('fwd_bwd_mfu'):>7} {known('peak_mem_gib', '.1f'):>8} "
        f"{row['compile_s']:>8.1f}"
    )


def device_peak_memory():
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: the process's peak RSS


def peak_memory():
    if "torch" in sys.modules:  # transformers' rows: PyTorch's allocator
        import torch

        if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
            return max(torch.cuda.max_memory_allocated(), device_peak_memory())
    return device_peak_memory()


def measure(systems, mcfg, seq, steps, profile=None) -> list[dict]:
    """Time each (name, tokens per step, make_step) system: the first call (compile) apart, then `steps` rounds.
    The systems take turns within each round, so a noisy neighbour on a shared CPU slows all of them alike.
    Returns a row each; its `losses` are every step's, the first included."""
    runs = []
    for name, tokens, make in systems:
        t0 = time.perf_counter()
        step = make()
        first = step()
        runs.append((name, tokens, step, time.perf_counter() - t0, [], [first]))
    trace = jax.profiler.trace(profile, create_perfetto_trace=True) if profile else contextlib.nullcontext()
    with trace:  # where the time goes: open the trace in XProf, TensorBoard or Perfetto
        for _ in range(steps):
            for _, _, step, _, times, losses in runs:
                t0 = time.perf_counter()
                losses.append(step())
                times.append(time.perf_counter() - t0)
    rows = []
    for name, tokens, _, first_s, times, losses in runs:
        step_s = float(np.median(times))
        peak_mem = peak_memory()
        row = dict(
            system=name,
            tokens_per_s=round(tokens / step_s),
            step_s=round(step_s, 4),
            compile_s=round(first_s - step_s, 1),
            mfu=mfu(tokens / step_s, mcfg, seq),
            peak_mem_gib=round(peak_mem / 2**30, 1) if peak_mem else None,
            loss=round(losses[-1], 4),
            losses=losses,
        )
        rows.append(row)
    if profile:
        rows[0]["profile"] = profile_summary(profile, steps, sum(runs[0][4]) if len(runs) == 1 else None)
    return rows


@dataclasses.dataclass(frozen=True)
class System:
    """What one row measures: `make()` builds it and returns its step (a callable returning the loss);
    `fwd_bwd()`, called once the step is timed, returns our forward+backward alone on one microbatch."""

    tokens: int  # per step
    make: Callable
    mcfg: olmo3.Olmo3Config
    seq: int
    steps: int  # timed
    fwd_bwd: Callable | None = None
    micro_tokens: int = 0
    tuned: bool = False  # its GEMMs autotuned first (on a GPU), as a deterministic train.py run's


def ours(
    mcfg, tcfg, rows: int, steps: int, n_micro: int = 1, fwd_bwd: bool = True, tuned: bool = False
) -> System:
    """Our jitted train step on random tokens; then, with `fwd_bwd`, its forward+backward alone. `tuned`: on a
    GPU, compiled once more first, tuned, as train.py's set_up does under deterministic ops (otherwise XLA
    takes the first GEMM configuration that compiles): its compile column includes that compile."""
    state = {}

    def make():
        compute = dataclasses.replace(
            tcfg.compute, attention=train.attention_kernel(tcfg, jax.devices()[0].platform)
        )
        state["model"] = eqx.filter_jit(olmo3.Olmo3)(mcfg, key=jax.random.key(0), compute=compute)
        state["opt"] = eqx.filter_jit(train.init_opt)(state["model"], tcfg)
        tokens = random_tokens(mcfg, rows, tcfg.seq_len)
        if tuned:  # XLA's choices stay in this process's autotuning cache; the run directory is thrown away
            compile_step = lambda options: train.train_step.lower(
                state["model"], state["opt"], tokens, jnp.float32(1e-4), cfg=tcfg, n_micro=n_micro
            ).compile(options)
            with tempfile.TemporaryDirectory() as run_dir:
                ckpt.autotuned_gemms(run_dir, jax.devices()[0], compile_step)

        def step():
            state["model"], state["opt"], m = train.train_step(
                state["model"], state["opt"], tokens, jnp.float32(1e-4), cfg=tcfg, n_micro=n_micro
            )  # a fresh lr: it is donated
            return float(m["loss"])

        return step

    def make_fwd_bwd():
        del state["opt"]  # Adam's moments: room for the gradients (the 7B's are 54 GiB)
        return forward_backward(state["model"], tcfg, rows // n_micro)

    seq = tcfg.seq_len
    return System(
        rows * seq, make, mcfg, seq, steps, make_fwd_bwd if fwd_bwd else None, rows // n_micro * seq, tuned
    )


def random_tokens(mcfg, rows: int, seq: int):
    return jnp.asarray(np.random.default_rng(0).integers(0, mcfg.vocab_size, (rows, seq)), jnp.int32)


def forward_backward(model, tcfg, rows: int):
    """train.loss_fn's value and gradients on `rows` rows, jitted: a step without its optimizer and without
    accumulation, as a callable returning the loss once the gradients are done."""
    grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(train.loss_fn, has_aux=True))
    tokens, seq = random_tokens(model.cfg, rows, tcfg.seq_len), tcfg.seq_len
    keep = jnp.ones(rows, bool)
    row_weight = train.row_weights(keep, jnp.full(rows, seq - 1), seq, tcfg.dp_ranks)

    def step():
        (loss, _), grads = grad_fn(model, tokens, keep, row_weight, tcfg)
        jax.block_until_ready(grads)
        return float(loss)

    return step


def hf(mcfg, seq: int, steps: int, **kw) -> System:
    """transformers' step (hf_step) on one row."""
    return System(seq, lambda: hf_step(mcfg, seq, 1, **kw), mcfg, seq, steps)


def hf_step(mcfg, seq, batch, compiled=None, bf16=False, checkpointing=False):
    """transformers' Olmo3ForCausalLM with torch AdamW on the same shapes, as a callable returning the loss;
    `compiled`: under torch.compile with this backend."""
    import torch
    from transformers import Olmo3Config, Olmo3ForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    # Our config as an exported config.json states it, on our padded vocabulary: the same FLOPs on both sides.
    cfg = Olmo3Config(
        **{**ckpt.config_to_hf(mcfg), "vocab_size": mcfg.padded_vocab, "max_position_embeddings": seq}
    )
    torch.manual_seed(0)
    model = Olmo3ForCausalLM._from_config(cfg, attn_implementation="sdpa").to(dev)
    if checkpointing:
        model.gradient_checkpointing_enable()  # transformers' own: each decoder layer recomputed in the backward
        model.config.use_cache = False
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev == "cuda"
    )
    tokens = torch.as_tensor(np.random.default_rng(0).integers(0, mcfg.vocab_size, (batch, seq)), device=dev)
    forward = torch.compile(model, backend=compiled) if compiled else model

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
            loss = forward(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()  # waits for the device

    return step


# What an XLA op is, by the names of its HLO instruction and kernel; the first match wins.
OP_KINDS = [
    ("attention", ("fmha", "sdpa", "flash", "splash", "cudnn")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "matmul", "dot", "ynn_fusion")),
    ("collective", ("nccl", "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
]


def profile_summary(trace_dir, steps, wall_s=None) -> list[str]:
    """Where the traced steps' time went: XLA's ops (the trace events naming an HLO instruction; on a GPU or
    TPU those on the device) by kind, the top ones, and, for one system traced alone, the host gaps: the
    wall time no op covers."""
    import collections
    import glob
    import gzip

    newest = max(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)
    with gzip.open(newest) as f:
        events = json.load(f)["traceEvents"]
    devices = {
        e["pid"] for e in events if e.get("name") == "process_name" and "/device:" in e["args"]["name"]
    }
    ops = [
        e
        for e in events
        if e.get("ph") == "X" and "hlo_op" in e.get("args", {}) and (not devices or e["pid"] in devices)
    ]
    if not ops:
        return []
    by_kind, by_op = collections.Counter(), collections.Counter()
    for e in ops:
        label = f"{e['name']} {e['args']['hlo_op']}".lower()
        kind = next((k for k, keys in OP_KINDS if any(key in label for key in keys)), "other fusions")
        by_kind[kind] += e["dur"] / 1e3 / steps  # ms per step
        by_op[e["args"]["hlo_op"]] += e["dur"] / 1e3 / steps
    total = sum(by_kind.values())
    lines = [f"profile ({newest}): XLA op time per step, summed over threads/streams: {total:.1f} ms"]
    lines += [f"  {kind:<16} {ms:9.1f} ms  {100 * ms / total:5.1f}%" for kind, ms in by_kind.most_common()]
    lines.append("  top ops: " + ", ".join(f"{op} {ms:.1f}" for op, ms in by_op.most_common(8)))
    if wall_s:
        covered, end = 0.0, None
        for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in ops):
            if end is None or start > end:
                covered, end = covered + stop - start, stop
            elif stop > end:
                covered, end = covered + stop - end, stop
        gap_ms = (wall_s * 1e6 - covered) / 1e3 / steps
        lines.append(
            f"  host gaps (wall no op covers): {gap_ms:.1f} ms per step of {wall_s * 1e3 / steps:.1f}"
        )
    return lines


# ---------------------------------------------------------------------------------------------------------
# The CPU comparison: both systems in this process, taking turns.


def cpu_comparison(args):
    """The tiny preset's shape and batch (d 256, 4 layers, vocab 8192, 8 x 256 tokens), fp32 on both sides."""
    import torch

    tcfg = train.PRESETS["tiny"]
    mcfg = train.model_config(tcfg)
    b, seq = tcfg.global_batch, tcfg.seq_len
    say(
        f"CPU comparison: tiny preset, batch {b} x {seq}, fp32, {os.cpu_count()} cores "
        f"(torch threads {torch.get_num_threads()}); median of {args.steps} interleaved steps"
    )
    say(COLUMNS)
    systems = [
        ("olmo3-jax train_step (tiny preset)", b * seq, ours(mcfg, tcfg, b, args.steps).make),
        ("transformers Olmo3 eager (sdpa), fp32", b * seq, lambda: hf_step(mcfg, seq, b)),
    ]
    if args.compile:
        compiled = lambda: hf_step(mcfg, seq, b, compiled="inductor")
        systems.append(("transformers Olmo3 + torch.compile, fp32", b * seq, compiled))
    rows = measure(systems, mcfg, seq, args.steps, args.profile)
    show(rows)
    say(ratio("ours/transformers-eager", rows[0], rows[1], "target >= 1.2"))
    if args.compile:
        say(ratio("ours/transformers-compiled", rows[0], rows[2]))
    return rows


def cpu_determinism(args):
    """Two fresh models, the same steps, in this process: are the losses bitwise equal? (XLA's CPU ops are
    deterministic; the GPU's are checked across two processes: --gpu.)"""
    tcfg = train.PRESETS["tiny"]
    mcfg = train.model_config(tcfg)
    rows = tcfg.global_batch
    say(f"\ndeterminism: two fresh runs of {mcfg.n_layers} layers, batch {rows} x {tcfg.seq_len}")
    say(COLUMNS)
    systems = [(f"determinism run {i}", rows * tcfg.seq_len, ours(mcfg, tcfg, rows, 3).make) for i in (1, 2)]
    runs = measure(systems, mcfg, tcfg.seq_len, steps=3)
    show(runs)
    say(bitwise_line(runs))
    return runs


def show(rows):
    for row in rows:
        say(row_line(row))
        for line in row.get("profile", []):
            say(line)


def bitwise_line(runs: list[dict]) -> str:
    if any("losses" not in r for r in runs):
        return "determinism: not known (a run has no losses)"
    a, b = runs[0]["losses"], runs[1]["losses"]
    return f"determinism: losses {'bitwise equal' if a == b else 'DIFFER'}: {a} vs {b}"


# ---------------------------------------------------------------------------------------------------------
# The GPU's systems, each measured by `--one KEY` in a process of its own.


def gpu_shapes(args):
    """The 7B's model and recipe, seq 8192, and its first 8 layers; with --small the same code at a CPU's size
    (d 128, 8 layers, seq 128), which checks that the GPU script runs through, and measures nothing."""
    m, t = olmo3.MODELS["7b"], train.PRESETS["7b"]
    if args.small:
        m = dataclasses.replace(
            m,
            n_layers=8,
            layer_types=m.layer_types[:8],
            d_model=128,
            n_heads=4,
            n_kv_heads=4,
            head_dim=32,
            mlp_hidden=256,
            vocab_size=512,
            sliding_window=32,
            max_seq_len=128,
            # dolma2's ids lie past this vocabulary; transformers' embedding refuses a padding id outside it
            eos_token_id=500,
            pad_token_id=501,
        )
        t = dataclasses.replace(t, seq_len=128)
    return m, t, dataclasses.replace(m, n_layers=8, layer_types=m.layer_types[:8])


def timed_steps(args, steps: int) -> int:
    """Timed steps a system: one with --small, whose run checks the code path and measures nothing."""
    return 1 if args.small else steps


def compile_backend(args) -> str:
    """torch.compile's backend: Inductor, as on the GPU. With --small, Dynamo's capture and AOTAutograd's
    backward without Inductor's code generation: that for a CPU (C++, minutes here) is not what a GPU runs."""
    return "aot_eager" if args.small else "inductor"


def eight_layer_step(args, **flags):
    """The 8-layer step at 7B width, batch 1, no remat; with a lever's `flags` set."""
    _, base, m8 = gpu_shapes(args)
    tcfg = train.with_flag(dataclasses.replace(base, global_batch=1), "remat", "none")
    for name, value in flags.items():
        tcfg = train.with_flag(tcfg, name, value)
    return train.model_config(tcfg, m8), tcfg


def full_7b_step(args):
    """The 7B preset on one chip: --accumulate microbatches of one row, remat full (what fits one H200; the
    preset's own choice is the fit search's, which this step does not run)."""
    m, base, _ = gpu_shapes(args)
    tcfg = dataclasses.replace(base, global_batch=args.accumulate, microbatch=1)
    tcfg = train.with_flag(tcfg, "remat", "full")
    return train.model_config(tcfg, m), tcfg


def lever_table(args) -> dict[str, tuple[str, dict]]:
    """Each lever of the 8-layer step: its name (for --levers), its row, the flags it sets."""
    _, base, m8 = gpu_shapes(args)
    wide = f"{m8.n_heads // 2}x{m8.head_dim * 2}"  # 16x256 on the 7B: half the heads, twice as wide
    return {
        "default": ("default: cudnn, remat none", {}),
        "scan_unroll": ("scan_unroll 2", {"scan_unroll": 2}),
        "remat_save_matmuls": ("remat save_matmuls", {"remat": "save_matmuls"}),
        "remat_save_attention": ("remat save_attention", {"remat": "save_attention"}),
        "remat_full": ("remat full", {"remat": "full"}),
        "heads": (f"heads {wide} (cudnn)", {"head_layout": wide}),
        "heads_xla": (f"heads {wide} (XLA)", {"head_layout": wide, "attention": "reference"}),
        "loss_chunk": ("fused loss in chunks of 1024", {"loss_chunk": min(1024, base.seq_len // 2)}),
        "attention_reference": ("attention reference (XLA)", {"attention": "reference"}),
    }


def picked_levers(args) -> list[str]:
    """--levers: the default (every lever's baseline), then each named lever, or the levers whose names begin
    with NAME_ (remat: its three policies); unset: all."""
    table = lever_table(args)
    if args.levers is None:
        return list(table)
    picked = ["default"]
    for item in filter(None, args.levers.split(",")):
        names = [item] if item in table else [n for n in table if n.startswith(item + "_")]
        if not names:
            raise SystemExit(f"--levers: no lever {item!r}; expected names from: {', '.join(table)}")
        picked += [n for n in names if n not in picked]
    return picked


def system(args, key: str) -> System:
    """The system `--one KEY` measures: 8layers, 7b, lever:NAME, or one of transformers' (8layers-eager,
    8layers-compiled, 7b-checkpointing)."""
    m, base, m8 = gpu_shapes(args)
    seq, tuned = base.seq_len, not args.nondeterministic
    if key == "8layers":
        return ours(*eight_layer_step(args), 1, timed_steps(args, 5), tuned=tuned)
    if key == "7b":  # its optimizer runs once per 8 microbatches, ~1% of its step: no fwd+bwd compiled apart
        steps = timed_steps(args, 3)
        return ours(*full_7b_step(args), args.accumulate, steps, args.accumulate, fwd_bwd=False, tuned=tuned)
    if key.startswith("lever:"):  # the step alone: a call's budget buys more levers
        mcfg, tcfg = eight_layer_step(args, **lever_table(args)[key.removeprefix("lever:")][1])
        return ours(mcfg, tcfg, 1, timed_steps(args, 5), fwd_bwd=False, tuned=tuned)
    if key == "8layers-eager":
        return hf(m8, seq, timed_steps(args, 5), bf16=True)
    if key == "8layers-compiled":
        return hf(m8, seq, timed_steps(args, 5), bf16=True, compiled=compile_backend(args))
    if key == "7b-checkpointing":
        return hf(m, seq, timed_steps(args, 3), bf16=True, checkpointing=True)
    raise SystemExit(f"--one: no system {key!r}; expected 8layers, 7b, lever:NAME, 8layers-eager, ...")


def one(args) -> None:
    """--one KEY: the system measured in this process, its row printed and written to --json."""
    s = system(args, args.one)
    (row,) = measure([(args.one, s.tokens, s.make)], s.mcfg, s.seq, s.steps, args.profile)
    if s.fwd_bwd:
        (fb,) = measure([("fwd+bwd", s.micro_tokens, s.fwd_bwd)], s.mcfg, s.seq, s.steps)
        row |= dict(
            fwd_bwd_s=fb["step_s"],
            fwd_bwd_mfu=mfu(s.micro_tokens / fb["step_s"], s.mcfg, s.seq),
            fwd_bwd_compile_s=fb["compile_s"],
            fwd_bwd_tokens=s.micro_tokens,
        )
    row |= dict(
        device=jax.devices()[0].device_kind,
        versions=versions(),
        deterministic=not args.nondeterministic,
        gemms_autotuned=s.tuned and jax.devices()[0].platform == "gpu",
        date=time.strftime("%Y-%m-%d"),
    )
    show([row])
    if args.json:
        Path(args.json).write_text(json.dumps([row], indent=1))


def versions() -> str:
    import jaxlib

    out = f"jax {jax.__version__}, jaxlib {jaxlib.__version__}"
    if "torch" in sys.modules:
        import torch
        import transformers

        out += f", torch {torch.__version__}, transformers {transformers.__version__}"
    return out


# ---------------------------------------------------------------------------------------------------------
# The GPU bench: sections of rows, each row a process of its own, within the call's budget.


class Parent:
    """What the sections share: the flags, the call's deadline, and the rows measured so far."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None
        self.rows = []
        self.process = None  # the row's process running now
        for stop in (signal.SIGTERM, signal.SIGINT):
            signal.signal(stop, self.stop)

    def stop(self, signum, frame):
        """Stopped from outside (a time limit's SIGTERM, Ctrl-C): the row's process and what it
        started stop too, and free the chip for the next call."""
        if self.process:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.killpg(self.process.pid, signal.SIGKILL)
        raise SystemExit(128 + signum)

    def seconds_left(self) -> float:
        return self.deadline - time.monotonic() if self.deadline else float("inf")

    def run(self, name: str, argv: list[str], limit_s: int) -> tuple[int | None, str, str]:
        """`python argv` in a process of its own, given what is left of the budget, at most `limit_s`: (exit
        code, None if it ran out of time; stdout; stderr). Its output is kept in LOGS."""
        timeout = min(limit_s, self.seconds_left()) if self.deadline else None
        command = [sys.executable, *argv]
        # A session of its own: out of time, it is stopped with the processes it started (the repro's cases,
        # torch.compile's workers), which would otherwise hold the chip.
        with subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        ) as self.process:
            try:
                out, err = self.process.communicate(timeout=timeout)
                rc = self.process.returncode
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                out, err = self.process.communicate()
                rc = None
        self.process = None
        if LOGS:  # named by its order and row, in characters any file transfer keeps
            log = LOGS / f"{len(self.rows) + 1:02d}-{re.sub(r'[^A-Za-z0-9.-]+', '_', name).strip('_')}.log"
            log.write_text(f"$ {shlex.join(command)}\nexit: {rc}\n{out}\n--- stderr\n{err}")
        return rc, out, err

    def measure(self, name: str, key: str, kind: str, nondeterministic: bool = False) -> dict:
        """The row of system `key` (`--one`) under `name`, or a row saying why it has no figures."""
        a = self.args
        argv = ["bench/speed.py", "--one", key, "--accumulate", str(a.accumulate)]
        argv += ["--small"] * a.small + ["--nondeterministic"] * (a.nondeterministic or nondeterministic)
        if a.profile:
            argv += ["--profile", f"{a.profile}/{len(self.rows) + 1:02d}-{key}"]
        if self.seconds_left() < MIN_START_S:
            return self.add(
                dict(system=name, error=f"not measured: {self.seconds_left():.0f} s of the budget left")
            )
        with tempfile.TemporaryDirectory() as tmp:
            rc, _, err = self.run(name, [*argv, "--json", f"{tmp}/row.json"], LIMITS_S[kind])
            rows = json.loads(Path(f"{tmp}/row.json").read_text()) if rc == 0 else [{}]
        row = dict(rows[0], system=name)
        if rc is None:
            row["error"] = "not measured: out of time (killed within the call's budget)"
        elif rc:
            row["error"] = f"failed (exit {rc}): {last_line(err)}"
        return self.add(row | dict(command=shlex.join(argv)))

    def add(self, row: dict) -> dict:
        self.rows.append(row)
        show([row])
        self.write_rows()
        return row

    def write_rows(self):
        """After each row, so that a call cut short keeps what it measured."""
        text = json.dumps(self.rows, indent=1)
        if self.args.json:
            Path(self.args.json).write_text(text)
        if TRANSCRIPT:
            Path(TRANSCRIPT).with_suffix(".json").write_text(text)


def last_line(err: str) -> str:
    """What a failed process said last: its last exception's line (`IndexError: ...`), else its last line."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]+(Error|Exception|Exit)\b", line)]
    return (errors or lines or ["no message"])[-1][:300]


def ratio(name: str, a: dict, b: dict, target: str = "") -> str:
    """`ratio name = a/b` of tokens/s, or why it is not known."""
    if "error" in a or "error" in b:
        return f"ratio {name} = -  (a row has no figures)"
    return f"ratio {name} = {a['tokens_per_s'] / b['tokens_per_s']:.2f}" + (f"  ({target})" if target else "")


def repro(p: Parent) -> None:
    """The one-minute GPU repro of the cuDNN determinism bug, its output as it printed it."""
    argv = ["bench/cudnn_repro.py"] + ["--small"] * p.args.small
    say(f"\nthe cuDNN attention repro: python {shlex.join(argv)}")
    if p.seconds_left() < MIN_START_S:
        p.add(dict(system="cudnn repro", error=f"not measured: {p.seconds_left():.0f} s of the budget left"))
        return
    t0 = time.perf_counter()
    rc, out, err = p.run("cudnn repro", argv, LIMITS_S["repro"])
    for line in filter(str.strip, out.splitlines()):
        say(line)
    row = dict(
        system="cudnn repro", command=shlex.join(argv), exit=rc, seconds=round(time.perf_counter() - t0, 1)
    )
    p.rows.append(row | dict(output=out))
    p.write_rows()
    outcome = "out of time" if rc is None else f"exit {rc}" + (f" ({last_line(err)})" if rc else "")
    say(f"repro: {outcome}, {row['seconds']:.0f} s")


def eight_layers(p: Parent) -> None:
    """8 layers at 7B width, batch 1, no remat: ours twice, in two processes (do the losses repeat bit for
    bit?); without deterministic ops (what they cost); then transformers eager and compiled."""
    a = p.args
    _, base, _ = gpu_shapes(a)
    ops = "--nondeterministic" if a.nondeterministic else "deterministic ops"
    say(f"\n8 layers at 7B width, seq {base.seq_len}, batch 1, no remat, bf16 compute, fp32 weights + Adam")
    say(COLUMNS)
    runs = [p.measure(f"olmo3-jax ({ops}), process {i}", "8layers", "8layers") for i in (1, 2)]
    closing = [bitwise_line(runs)]
    if not a.nondeterministic:
        fast = p.measure("olmo3-jax, --nondeterministic", "8layers", "8layers", nondeterministic=True)
        closing.append(ratio("deterministic/nondeterministic", runs[0], fast, "target >= 0.95"))
    if not a.no_transformers:
        eager = p.measure("transformers eager (sdpa, autocast bf16)", "8layers-eager", "transformers")
        backend = compile_backend(a)
        name = "transformers + torch.compile" + ("" if backend == "inductor" else f" ({backend})")
        comp = p.measure(name, "8layers-compiled", "transformers")
        closing.append(ratio("ours/transformers-eager", runs[0], eager))
        closing.append(ratio("ours/transformers-compiled", runs[0], comp, "target >= 1.35"))
    for line in closing:
        say(line)


def full_7b(p: Parent) -> None:
    """The whole 7B on one chip, microbatches accumulated: ours (target: >= 50% MFU on an H200), then
    transformers' gradient checkpointing."""
    a = p.args
    _, tcfg = full_7b_step(a)
    say(
        f"\nthe full 7B on one chip: microbatch 1 x {tcfg.seq_len}, {a.accumulate} accumulated, "
        f"remat {tcfg.compute.remat}"
    )
    say(COLUMNS)
    ours_row = p.measure(f"olmo3-jax 7b preset (remat {tcfg.compute.remat})", "7b", "7b")
    if not a.no_transformers:
        hf_row = p.measure("transformers, gradient checkpointing", "7b-checkpointing", "transformers")
        say(
            ratio("ours/transformers-checkpointing", ours_row, hf_row, "target >= 1.9, and >= 9,800 tokens/s")
        )


def levers(p: Parent) -> None:
    """Each picked lever on the 8-layer step, one at a time against the default."""
    a = p.args
    _, base, _ = gpu_shapes(a)
    table = lever_table(a)
    ops = ", --nondeterministic" if a.nondeterministic else ""
    say(f"\nlevers, 8 layers at 7B width, seq {base.seq_len}, batch 1{ops}")
    say(COLUMNS)
    rows = [p.measure(table[name][0], f"lever:{name}", "lever") for name in picked_levers(a)]
    for row in rows[1:]:
        say(ratio(f"{row['system']}/default", row, rows[0]))


SECTIONS = {"repro": repro, "8layers": eight_layers, "7b": full_7b, "levers": levers}


def gpu(args) -> None:
    """The picked sections in order, each row in its own process; at the end, what was measured where."""
    p = Parent(args)
    for name in args.only.split(","):
        SECTIONS[name](p)
    measured = [r for r in p.rows if "tokens_per_s" in r]
    chips = sorted({f"{r['device']} ({r['versions']})" for r in measured})
    failed = sum("error" in r for r in p.rows)
    say(f"\n{len(measured)} rows measured, {failed} without figures, on {'; '.join(chips) or 'no chip'}")


# ---------------------------------------------------------------------------------------------------------


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny"], help="tiny: the CPU comparison")
    parser.add_argument(
        "--gpu", action="store_true", help="the H200 shapes, each row in a process of its own"
    )
    parser.add_argument("--plan", type=int, choices=sorted(PLANS), help="call 1 or 2 of a lent H200's plan")
    parser.add_argument(
        "--small", action="store_true", help="with --gpu: the same code at a CPU's size (a check)"
    )
    parser.add_argument(
        "--only", default=None, help=f"with --gpu: these sections, in order (default: {','.join(SECTIONS)})"
    )
    parser.add_argument(
        "--levers",
        default=None,
        help="with --gpu: the default and these levers, e.g. scan_unroll,remat (remat: all its policies)",
    )
    parser.add_argument("--no_transformers", action="store_true", help="with --gpu: ours alone")
    parser.add_argument(
        "--budget_s",
        type=float,
        default=None,
        help="with --gpu: every row ends within this many s (--plan: 330)",
    )
    parser.add_argument("--accumulate", type=int, default=8, help="microbatches per step for the full 7B")
    parser.add_argument("--compile", action="store_true", help="also torch.compile on CPU (slow to compile)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of the CPU comparison")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="with --gpu: write the output here")
    parser.add_argument(
        "--nondeterministic",
        action="store_true",
        help="leave out --xla_gpu_deterministic_ops (GPU: the cost of determinism)",
    )
    parser.add_argument("--profile", default=None, help="write a profiler trace of the timed steps here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a --gpu row's own process
    args = parser.parse_args()
    if args.plan:
        args.gpu, args.no_transformers = True, True
        args.only = args.only or PLANS[args.plan]["only"]
        args.levers = PLANS[args.plan]["levers"] if args.levers is None else args.levers
        args.budget_s = PLAN_BUDGET_S if args.budget_s is None else args.budget_s
    args.only = args.only or ",".join(SECTIONS)
    unknown = [s for s in args.only.split(",") if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: no section {unknown[0]!r}; expected some of {','.join(SECTIONS)}")
    picked_levers(args)  # an unknown lever: refused now, not after the rows before it
    return args


def start_devices(args) -> None:
    """This process measures: XLA's flags, set before the first device is made (XLA reads them once)."""
    if not args.nondeterministic:
        shard.deterministic_gpu_ops()  # as train.py does by default (its `deterministic` field)
    # --small measures nothing, so it compiles as fast as XLA's CPU backend can: LLVM's optimizing is half of
    # each compile, and XLA's older fusion code generation takes half the time of its fusion emitters
    # (measured with every row in one process: the levers 133 -> 66 s, the whole script 108 -> 74 s).
    if args.small:
        fast = " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + fast
    shard.quiet_libtpu()  # libtpu without a TPU would fill the log


def start_parent(args) -> None:
    """The --gpu parent touches no device (its pool would be taken from the rows' processes); they inherit
    its environment, with JAX's pool allowed 95% of the chip's memory (the default 75% of an H200, 105 GiB,
    is less than the 7B's step needs) and grown as needed, as the first measurements ran."""
    global TRANSCRIPT, LOGS
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if args.out:
        stem = f"plan{args.plan}" if args.plan else "gpu"
        TRANSCRIPT, LOGS = Path(args.out) / f"{stem}.txt", Path(args.out) / f"{stem}-logs"
        LOGS.mkdir(parents=True, exist_ok=True)
        TRANSCRIPT.write_text("")


if __name__ == "__main__":
    args = parse_args()
    if args.one:
        start_devices(args)
        print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {time.strftime('%Y-%m-%d')}")
        print(COLUMNS)
        one(args)
    elif args.gpu:
        start_parent(args)
        budget = f"; a budget of {args.budget_s:.0f} s" if args.budget_s else ""
        plan = f"; plan {args.plan} of 2: {args.only}" if args.plan else ""
        say(f"jax {jax.__version__}{plan}{budget}; {time.strftime('%Y-%m-%d')}")
        gpu(args)
    else:
        start_devices(args)
        say(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {time.strftime('%Y-%m-%d')}")
        rows = cpu_comparison(args) + cpu_determinism(args)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
