"""The cuDNN attention bug under deterministic ops, in a minute on one GPU: two identical windowed cuDNN
attention calls under jax.grad, run once without shard.deterministic_cudnn_backward and once with it, each in
a process of its own (the failure may take its process down).

    python bench/cudnn_repro.py            # a GPU: batch 1, 32 heads, seq 8192, head_dim 128, window 4096
    python bench/cudnn_repro.py --small    # no GPU (CI): the same path at seq 256, compiled for an H200

The bug (openxla/xla pull request #46500, open): under deterministic ops XLA marks only the first of several
identical cuDNN backward calls `force_deterministic`, and compiles a graph for it alone; the second looks up a
graph that was never built at its first run: `IndexError: raw_hash_map<>::at`. Each case prints whether the
step ran or how it failed (the error's first line), how many backward calls XLA compiled as deterministic,
and each backward call's workspace, which XLA's cuDNN pass sizes on the GPU. The workspace tells which
deterministic backward this cuDNN has: on Hopper the dP-workspace path, quadratic in the sequence
(batch x heads x seq x seq x 2 bytes, 4 GiB here), or cuDNN 9.25+'s ordered-dQ engine, linear in it.

With --small and no GPU, XLA's cuDNN pass does not run: the marks are JAX's alone and the workspaces 0. With
the [gpu] extra (the CUDA plugin) the calls are compiled for an H200 but not run; without it they run on this
CPU through XLA's attention, and the cuDNN case needs a GPU.
"""

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CASES = ("without the workaround", "with the workaround")
SHAPES = {False: dict(batch=1, heads=32, seq=8192, head_dim=128, window=4096)}
SHAPES[True] = dict(batch=1, heads=2, seq=256, head_dim=64, window=128)
BACKWARD = 'custom_call_target="__cudnn$fmhaSoftmaxBackward"'


def one_case(case: str, small: bool) -> None:
    """Compile (and, on a GPU, run) the two calls' gradients under deterministic ops, with or without the
    workaround; print a JSON line once compiled, then one once run, so that a crash leaves the first."""
    import shard

    if case == CASES[1]:
        shard.deterministic_gpu_ops()  # the flag and the workaround, as train.py sets them
    else:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_gpu_deterministic_ops=true"
    import jax
    import jax.numpy as jnp

    shape = SHAPES[small]
    target = None
    if small:
        jax.config.update("jax_platforms", "cpu")
        if importlib.util.find_spec("jax_cuda13_plugin"):
            target = shard.compile_target("h200x1")  # compile-only GPU devices
    device = target.devices[0] if target else jax.devices()[0]
    implementation = "cudnn" if device.platform == "gpu" else "xla"
    attend = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, local_window_size=(shape["window"] - 1, 0)
    )

    def loss(q, k, v):  # two identical calls: the same shapes, window and dtype
        return attend(attend(q, k, v), k, v).astype(jnp.float32).sum()

    sharding = jax.sharding.SingleDeviceSharding(device)
    qkv = (shape["batch"], shape["seq"], shape["heads"], shape["head_dim"])
    like = jax.ShapeDtypeStruct(qkv, jnp.bfloat16, sharding=sharding)
    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(like, like, like).compile()
    calls = [line for line in step.as_text().splitlines() if BACKWARD in line]
    said = dict(
        device=device.device_kind,
        implementation=implementation,
        calls=len(calls),
        marked=sum('"force_deterministic": true' in line for line in calls),
        workspace=[int(re.search(r"u8\[(\d+)\]\S*\) custom-call\(", line)[1]) for line in calls],
    )
    print(json.dumps(said), flush=True)
    if target:
        return
    keys = jax.random.split(jax.random.key(0), 3)
    q, k, v = (jax.device_put(jax.random.normal(key, qkv, jnp.bfloat16), sharding) for key in keys)
    try:
        jax.block_until_ready(step(q, k, v))
        print(json.dumps(dict(ran=True)), flush=True)
    except Exception as e:  # the bug's IndexError, or XLA's error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        print(json.dumps(dict(ran=False, error=f"{type(e).__name__}: {first}"[:300])), flush=True)


def run_case(case: str, small: bool, timeout_s: float) -> dict:
    """One case in a process of its own: what it printed, or how it ended."""
    argv = [sys.executable, __file__, "--case", case] + ["--small"] * small
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(ran=False, error=f"no answer within {timeout_s:.0f} s")
    said = {}
    for line in out.stdout.splitlines():
        if line.startswith("{"):
            said |= json.loads(line)
    if out.returncode and "error" not in said:  # it died without a word: a signal, or a fatal C++ error
        last = [line for line in out.stderr.splitlines() if line.strip()][-1:] or ["no message"]
        said |= dict(ran=False, error=f"exit {out.returncode}: {last[0][:300]}")
    return said


def describe(said: dict, shape: dict) -> str:
    """A case's line: ran or crashed, the calls XLA compiled as deterministic, their workspaces."""
    if "calls" not in said:
        return f"crashed before compiling: {said.get('error', 'no message')}"
    if said["implementation"] != "cudnn":
        outcome = "ran" if said.get("ran") else f"crashed: {said.get('error')}"
        return f"{outcome} (XLA's attention on the {said['device']}: the cuDNN case needs a GPU)"
    outcome = {True: "ran", False: f"crashed: {said.get('error')}", None: "compiled (not run: no GPU)"}
    quadratic = shape["batch"] * shape["heads"] * shape["seq"] ** 2 * 2
    sizes = ", ".join(f"{n:,}" for n in said["workspace"])
    if max(said["workspace"], default=0) == 0:
        path = "not sized: XLA's cuDNN pass runs on a GPU only"
    elif max(said["workspace"]) >= quadratic:
        path = f"the dP-workspace path, quadratic: batch x heads x seq^2 x 2 = {quadratic:,}"
    else:
        path = f"a linear-workspace engine (below batch x heads x seq^2 x 2 = {quadratic:,})"
    return (
        f"{outcome[said.get('ran')]}; backward calls marked force_deterministic: {said['marked']} of "
        f"{said['calls']}; workspace bytes per call: {sizes} ({path})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="no GPU: seq 256, compiled for an H200 (CI)")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in its own process
    parser.add_argument("--timeout_s", type=float, default=55, help="each case's limit (default 55)")
    args = parser.parse_args()
    if args.case:
        one_case(args.case, args.small)
        return 0
    shape = SHAPES[args.small]
    print(
        "cuDNN attention backward under deterministic ops: two identical windowed calls under jax.grad, "
        + ", ".join(f"{k} {v}" for k, v in shape.items())
        + ", bf16"
    )
    for case in CASES:
        said = run_case(case, args.small, args.timeout_s)
        if "device" in said and case == CASES[0]:
            print(f"device: {said['device']}")
        print(f"{case}: {describe(said, shape)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
