"""Our train step against transformers' Olmo3ForCausalLM, side by side in one run, on the same shapes.

    python bench/speed.py --preset tiny        # 2-core CPU: the tiny preset's shape and batch, fp32
    python bench/speed.py --gpu                # one GPU: 8 layers at 7B width, then the full 7B, plus levers
    python bench/speed.py --gpu --only levers  # just the lever table (or 8layers, 7b, determinism)
    python bench/speed.py --gpu --small        # the GPU code path at a CPU's size: does it run through? (CI)
    python bench/speed.py --steps 1            # smallest: the CPU comparison timed over one step (a check)
    python bench/speed.py --gpu --small --only determinism   # smallest GPU path: one 4-layer model, twice
    python bench/speed.py --gpu --only 7b --profile /tmp/prof   # + where the 7B step's time goes, by kind

Prints one row per system (tokens/s, MFU, peak memory, compile time) and lines beginning `ratio`.
MFU = tokens/s x Olmo3Config.flops_per_token (exact causal/sliding attention count) / the chip's peak.
"""

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import resource
import sys
import time
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

# As train.py does by default (its `deterministic` field); --nondeterministic measures what that costs.
if "--nondeterministic" not in sys.argv:
    shard.deterministic_gpu_ops()

ROWS = []
PROFILE_DIR = None  # --profile


def report(name, tokens, step_s, compile_s, mcfg, seq, peak_mem, loss, note=""):
    peak = shard.peak_flops(jax.devices()[0])
    tps = tokens / step_s
    mfu = tps * mcfg.flops_per_token(seq) / peak if peak else None
    row = dict(
        system=name,
        tokens_per_s=round(tps),
        step_s=round(step_s, 4),
        compile_s=round(compile_s, 1),
        mfu=round(mfu, 4) if mfu else None,
        peak_mem_gib=round(peak_mem / 2**30, 1) if peak_mem else None,
        loss=round(float(loss), 4),
        note=note,
    )
    ROWS.append(row)
    mfu_s = f"{100 * mfu:5.1f}%" if mfu else "    -"
    mem_s = f"{row['peak_mem_gib']:6.1f}" if peak_mem else "     -"
    print(
        f"{name:<44} {tps:>10,.0f} {step_s:>8.3f} {mfu_s:>7} {mem_s:>8} {compile_s:>8.1f}  {note}", flush=True
    )
    return tps


def header():
    print(f"{'system':<44} {'tokens/s':>10} {'step s':>8} {'MFU':>7} {'mem GiB':>8} {'compile':>8}")


def device_peak_memory():
    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        return stats["peak_bytes_in_use"]
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # CPU: the process's peak RSS


def ours_step(mcfg, tcfg, batch, n_micro=1):
    """Our jitted train step on random tokens, as a callable returning the loss."""
    compute = dataclasses.replace(
        tcfg.compute, attention=train.attention_kernel(tcfg, jax.devices()[0].platform)
    )
    state = {"model": eqx.filter_jit(olmo3.Olmo3)(mcfg, key=jax.random.key(0), compute=compute)}
    state["opt"] = eqx.filter_jit(train.init_opt)(state["model"], tcfg)
    tokens = jnp.asarray(
        np.random.default_rng(0).integers(0, mcfg.vocab_size, (batch, tcfg.seq_len)), jnp.int32
    )

    def step():
        state["model"], state["opt"], m = train.train_step(
            state["model"], state["opt"], tokens, jnp.float32(1e-4), cfg=tcfg, n_micro=n_micro
        )  # a fresh lr: it is donated
        return float(m["loss"])

    return step


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


def measure(systems, mcfg, seq, steps):
    """Time each (name, tokens per step, make_step) system: the first call (compile) apart, then `steps` rounds.
    The systems take turns within each round, so a noisy neighbour on a shared CPU slows all of them alike."""
    runs = []
    for name, tokens, make in systems:
        t0 = time.perf_counter()
        step = make()
        step()
        runs.append((name, tokens, step, time.perf_counter() - t0, []))
    losses = {name: [] for name, *_ in runs}
    trace = (
        jax.profiler.trace(PROFILE_DIR, create_perfetto_trace=True)
        if PROFILE_DIR
        else contextlib.nullcontext()
    )
    with trace:  # where the time goes: open the trace in XProf, TensorBoard or Perfetto
        for _ in range(steps):
            for name, _, step, _, times in runs:
                t0 = time.perf_counter()
                losses[name].append(step())
                times.append(time.perf_counter() - t0)
    tps = {}
    for name, tokens, _, first_s, times in runs:
        step_s = float(np.median(times))
        tps[name] = report(name, tokens, step_s, first_s - step_s, mcfg, seq, peak_memory(), losses[name][-1])
    if PROFILE_DIR:
        profile_summary(PROFILE_DIR, steps, sum(runs[0][4]) if len(runs) == 1 else None)
    return tps, losses


# What an XLA op is, by the names of its HLO instruction and kernel; the first match wins.
OP_KINDS = [
    ("attention", ("fmha", "sdpa", "flash", "splash", "cudnn")),
    ("matmul", ("gemm", "xmma", "cutlass", "cublas", "matmul", "dot", "ynn_fusion")),
    ("collective", ("nccl", "all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective")),
    ("copy/transpose", ("copy", "transpose", "memcpy", "memset")),
]


def profile_summary(trace_dir, steps, wall_s=None):
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
        return
    by_kind, by_op = collections.Counter(), collections.Counter()
    for e in ops:
        label = f"{e['name']} {e['args']['hlo_op']}".lower()
        kind = next((k for k, keys in OP_KINDS if any(key in label for key in keys)), "other fusions")
        by_kind[kind] += e["dur"] / 1e3 / steps  # ms per step
        by_op[e["args"]["hlo_op"]] += e["dur"] / 1e3 / steps
    total = sum(by_kind.values())
    print(f"profile ({newest}): XLA op time per step, summed over threads/streams: {total:.1f} ms")
    for kind, ms in by_kind.most_common():
        print(f"  {kind:<16} {ms:9.1f} ms  {100 * ms / total:5.1f}%")
    print("  top ops: " + ", ".join(f"{op} {ms:.1f}" for op, ms in by_op.most_common(8)))
    if wall_s:
        covered, end = 0.0, None
        for start, stop in sorted((e["ts"], e["ts"] + e["dur"]) for e in ops):
            if end is None or start > end:
                covered, end = covered + stop - start, stop
            elif stop > end:
                covered, end = covered + stop - end, stop
        gap_ms = (wall_s * 1e6 - covered) / 1e3 / steps
        print(f"  host gaps (wall no op covers): {gap_ms:.1f} ms per step of {wall_s * 1e3 / steps:.1f}")


def peak_memory():
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.max_memory_allocated():
            return max(torch.cuda.max_memory_allocated(), device_peak_memory())
    except ImportError:
        pass
    return device_peak_memory()


def cpu_comparison(args):
    """The tiny preset's shape and batch (d 256, 4 layers, vocab 8192, 8 x 256 tokens), fp32 on both sides."""
    import torch

    tcfg = train.PRESETS["tiny"]
    mcfg = train.model_config(tcfg)
    b, seq = tcfg.global_batch, tcfg.seq_len
    print(
        f"CPU comparison: tiny preset, batch {b} x {seq}, fp32, {os.cpu_count()} cores "
        f"(torch threads {torch.get_num_threads()}); median of {args.steps} interleaved steps"
    )
    header()
    systems = [
        ("olmo3-jax train_step (tiny preset)", b * seq, lambda: ours_step(mcfg, tcfg, b)),
        ("transformers Olmo3 eager (sdpa), fp32", b * seq, lambda: hf_step(mcfg, seq, b)),
    ]
    if args.compile:
        systems.append(
            (
                "transformers Olmo3 + torch.compile, fp32",
                b * seq,
                lambda: hf_step(mcfg, seq, b, compiled="inductor"),
            )
        )
    tps, _ = measure(systems, mcfg, seq, args.steps)
    ours = tps[systems[0][0]]
    print(f"ratio ours/transformers-eager = {ours / tps[systems[1][0]]:.2f}  (target >= 1.2)")
    if args.compile:
        print(f"ratio ours/transformers-compiled = {ours / tps[systems[2][0]]:.2f}")


def alone(name, tokens, make, mcfg, seq, steps=5):
    """One system at a time (on a GPU the two models would not fit together), its memory freed after."""
    import gc

    tps, losses = measure([(name, tokens, make)], mcfg, seq, steps)
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    except ImportError:
        pass
    return tps[name], losses[name]


def gpu_shapes(args):
    """The 7B's model and recipe, seq 8192; with --small the same code at a CPU's size (d 256, 8 layers, seq
    256), which checks that the GPU script runs through, and measures nothing."""
    m, t = olmo3.MODELS["7b"], train.PRESETS["7b"]
    if args.small:
        m = dataclasses.replace(
            m,
            n_layers=8,
            layer_types=m.layer_types[:8],
            d_model=256,
            n_heads=4,
            n_kv_heads=4,
            head_dim=64,
            mlp_hidden=512,
            vocab_size=1024,
            sliding_window=64,
            max_seq_len=256,
            # dolma2's ids lie past this vocabulary; transformers' embedding refuses a padding id outside it
            eos_token_id=1000,
            pad_token_id=1001,
        )
        t = dataclasses.replace(t, seq_len=256)
    return m, t, dataclasses.replace(m, n_layers=8, layer_types=m.layer_types[:8])


def gpu_comparison(args):
    sections = {"8layers": eight_layers, "7b": full_7b, "levers": levers, "determinism": determinism}
    for name, section in sections.items():
        if args.only in ("all", name):
            section(args)


def timed_steps(args, steps: int) -> int:
    """Timed steps a system: one with --small, whose run checks the code path and measures nothing."""
    return 1 if args.small else steps


def compile_backend(args) -> str:
    """torch.compile's backend: Inductor, as on the GPU. With --small, Dynamo's capture and AOTAutograd's
    backward without Inductor's code generation: that for a CPU (C++, minutes here) is not what a GPU runs."""
    return "aot_eager" if args.small else "inductor"


def eight_layers(args):
    """8 layers at 7B width, batch 1, no remat: ours against transformers eager and compiled."""
    _, base, m8 = gpu_shapes(args)
    seq, steps, backend = base.seq_len, timed_steps(args, 5), compile_backend(args)
    t8 = train.with_flag(dataclasses.replace(base, global_batch=1), "remat", "none")
    print(f"\n8 layers at 7B width, seq {seq}, batch 1, bf16 compute, fp32 weights + Adam")
    header()
    ours, _ = alone(
        "olmo3-jax (cudnn window, no remat)",
        seq,
        lambda: ours_step(train.model_config(t8, m8), t8, 1),
        m8,
        seq,
        steps,
    )
    eager, _ = alone(
        "transformers eager (sdpa, autocast bf16)",
        seq,
        lambda: hf_step(m8, seq, 1, bf16=True),
        m8,
        seq,
        steps,
    )
    comp, _ = alone(
        "transformers + torch.compile" + ("" if backend == "inductor" else f" ({backend})"),
        seq,
        lambda: hf_step(m8, seq, 1, bf16=True, compiled=backend),
        m8,
        seq,
        steps,
    )
    print(f"ratio ours/transformers-eager = {ours / eager:.2f}")
    print(f"ratio ours/transformers-compiled = {ours / comp:.2f}  (target >= 1.35)")


def full_7b(args):
    """The whole 7B on one chip, microbatches accumulated: our remat against transformers' checkpointing."""
    m, base, _ = gpu_shapes(args)
    seq, steps = base.seq_len, timed_steps(args, 3)
    t7 = dataclasses.replace(base, global_batch=args.accumulate, microbatch=1)
    m7 = train.model_config(t7, m)
    print(
        f"\nthe full 7B on one chip: microbatch 1 x {seq}, {args.accumulate} accumulated, remat {t7.compute.remat}"
    )
    header()
    ours, _ = alone(
        f"olmo3-jax 7b preset (remat {t7.compute.remat})",
        args.accumulate * seq,
        lambda: ours_step(m7, t7, args.accumulate, n_micro=args.accumulate),
        m7,
        seq,
        steps,
    )
    hf, _ = alone(
        "transformers, gradient checkpointing",
        seq,
        lambda: hf_step(m, seq, 1, bf16=True, checkpointing=True),
        m7,
        seq,
        steps,
    )
    print(f"ratio ours/transformers-checkpointing = {ours / hf:.2f}  (target >= 1.9, and >= 9,800 tokens/s)")


def levers(args):
    """Each lever on the 8-layer shape, one at a time against the default."""
    _, base, m8 = gpu_shapes(args)
    base = train.with_flag(dataclasses.replace(base, global_batch=1), "remat", "none")
    flag = functools.partial(train.with_flag, base)
    wide = f"{m8.n_heads // 2}x{m8.head_dim * 2}"  # 16x256 on the 7B: half the heads, twice as wide
    variants = [
        ("default: cudnn, remat none", base),
        ("remat save_matmuls", flag("remat", "save_matmuls")),
        ("remat save_attention", flag("remat", "save_attention")),
        ("remat full", flag("remat", "full")),
        ("fused loss in chunks of 1024", dataclasses.replace(base, loss_chunk=min(1024, base.seq_len // 2))),
        ("scan_unroll 2", flag("scan_unroll", 2)),
        ("attention reference (XLA)", flag("attention", "reference")),
        (f"heads {wide} (cudnn)", dataclasses.replace(base, head_layout=wide)),
        (
            f"heads {wide} (XLA)",
            train.with_flag(dataclasses.replace(base, head_layout=wide), "attention", "reference"),
        ),
    ]
    print(f"\nlevers, 8 layers at 7B width, seq {base.seq_len}, batch 1")
    header()
    for name, tcfg in variants:
        try:
            mcfg = train.model_config(tcfg, m8)
            alone(
                name, tcfg.seq_len, lambda: ours_step(mcfg, tcfg, 1), mcfg, tcfg.seq_len, timed_steps(args, 5)
            )
        except Exception as e:  # a lever that does not compile on this chip is a result, not a crash
            print(f"{name:<44} failed: {type(e).__name__}: {str(e)[:200]}")
            ROWS.append(dict(system=name, error=f"{type(e).__name__}: {str(e)[:300]}"))


def determinism(args):
    """Two fresh runs of the same steps: are the losses bitwise equal?"""
    if args.gpu:
        m, t, _ = gpu_shapes(args)
        tcfg = train.with_flag(dataclasses.replace(t, global_batch=1), "remat", "none")
        mcfg = train.model_config(tcfg, dataclasses.replace(m, n_layers=4, layer_types=m.layer_types[:4]))
    else:
        tcfg = train.PRESETS["tiny"]
        mcfg = train.model_config(tcfg)
    tokens = tcfg.global_batch * tcfg.seq_len
    print(
        f"\ndeterminism: two fresh runs of {mcfg.n_layers} layers, batch {tcfg.global_batch} x {tcfg.seq_len}"
    )
    header()
    runs = [
        alone(
            f"determinism run {i + 1}",
            tokens,
            lambda: ours_step(mcfg, tcfg, tcfg.global_batch),
            mcfg,
            tcfg.seq_len,
            steps=4,
        )[1]
        for i in range(2)
    ]
    print(
        f"determinism: losses {'bitwise equal' if runs[0] == runs[1] else 'DIFFER'}: {runs[0]} vs {runs[1]}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny", choices=["tiny"], help="tiny: the CPU comparison")
    parser.add_argument("--gpu", action="store_true", help="the H200 shapes")
    parser.add_argument(
        "--small", action="store_true", help="with --gpu: the same code at a CPU's size (a check)"
    )
    parser.add_argument(
        "--only", default="all", choices=["all", "8layers", "7b", "levers", "determinism"], help="with --gpu"
    )
    parser.add_argument("--accumulate", type=int, default=8, help="microbatches per step for the full 7B")
    parser.add_argument("--compile", action="store_true", help="also torch.compile on CPU (slow to compile)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of the CPU comparison")
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument(
        "--nondeterministic",
        action="store_true",
        help="leave out --xla_gpu_deterministic_ops (GPU: the cost of determinism)",
    )
    parser.add_argument("--profile", default=None, help="write a profiler trace of the timed steps here")
    args = parser.parse_args()
    # --small measures nothing, so it compiles as fast as XLA's CPU backend can (set before the first device
    # is made, so XLA reads the flags): LLVM's optimizing is half of each compile (without it the levers section
    # compiles in 66 s instead of 133 s), and XLA's older fusion code generation takes half the time of its
    # fusion emitters (the whole script: 108 -> 74 s on 2 cores).
    if args.small:
        fast = " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + fast
    shard.quiet_libtpu()  # before the first device: libtpu without a TPU would fill the log
    PROFILE_DIR = args.profile
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {time.strftime('%Y-%m-%d')}")
    if args.gpu:
        gpu_comparison(args)
    else:
        cpu_comparison(args)
        determinism(args)
    if args.json:
        Path(args.json).write_text(json.dumps(ROWS, indent=1))
