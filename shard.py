"""Sharding: the mesh, logical-axis rules, parameter and batch shardings, and the multi-host start.

olmo3.py names every dimension in its jaxtyping annotations (embed, heads, mlp, ...). Here one table maps
those logical names onto four mesh axes, as MaxText and jax-llm-examples do:
    data     pure data parallelism: parameters replicated, the batch split
    fsdp     data parallelism with parameters and optimizer state split too (ZeRO-3)
    context  context parallelism: each row's positions split, balanced for causal work (olmo3.balanced_order)
    tensor   Megatron-style tensor parallelism: heads and the MLP's hidden units split
The axes compose: a row's positions are split over context within each (data, fsdp) group of rows, its
heads over tensor. Weights are split over fsdp and tensor only: the devices of a context group hold the same
weight shards, as those of the data axis do, so a context axis divides a row's activations, not the weights.
Sharding never changes the maths, only where it runs: tests/test_shard.py checks every layout against the
single-device run.
"""

import dataclasses
import functools
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import threading
import time
import typing
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmo3 import is_array

MESH_AXES = (
    "data",
    "fsdp",
    "context",
    "tensor",
)  # outer to inner: tensor, then context, on the fastest links

# Logical axis -> mesh axes (None: replicated). Parameters shard `embed` over fsdp (FSDP), and heads,
# kv_heads, mlp and vocab over tensor (Megatron: column-parallel in, row-parallel out). The batch spans data
# and fsdp.
# One table for every weight keeps each pair of matrices consistent: the layout on which XLA's CPU SPMD
# partitioner computes wrong numbers (jax 0.8-0.10: x -> ((2x) @ up) @ down with both MLP matrices split dim 0
# over fsdp and dim 1 over tensor, so the hidden axis is on fsdp in one and on tensor in the other; see
# tests/test_shard.py) cannot be written with it.
RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": ("context",),  # activations only (no weight has a sequence axis): olmo3 asks via Layout
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": None,
    "window": None,  # train.OptState's ring buffers of recent losses and grad norms
}


def parse_mesh(spec: str, n_devices: int | None) -> dict[str, int]:
    """`data=2,fsdp=4,context=1,tensor=1` -> axis sizes; one size may be -1 ("the rest"); unnamed axes are 1. With
    n_devices None, only the syntax is checked (-1 stays)."""
    sizes, named = dict.fromkeys(MESH_AXES, 1), set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or name in named or not (value.isdigit() and int(value) > 0 or value == "-1"):
            raise ValueError(
                f"--mesh {spec!r}: expected entries like data=2,fsdp=-1,context=1,tensor=1, each of "
                f"{', '.join(MESH_AXES)} at most once, sizes >= 1 or -1 (the rest); "
                f"got {part!r}"
            )
        sizes[name] = int(value)
        named.add(name)
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"--mesh {spec!r}: at most one axis may be -1, got {rest}")
    if n_devices is None:
        return sizes
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if n_devices % known:
            raise ValueError(
                f"--mesh {spec!r}: {n_devices} devices do not divide by the other axes ({known})"
            )
        sizes[rest[0]] = n_devices // known
    if math.prod(sizes.values()) > n_devices:
        raise ValueError(
            f"--mesh {spec!r} needs {math.prod(sizes.values())} devices but there are {n_devices}"
        )
    return sizes


def device_grid(sizes: dict[str, int], devices) -> np.ndarray:
    """The devices as a (data, fsdp, context, tensor) array, in the order JAX's mesh utilities choose: along
    the chips' torus on TPUs; by id on GPUs, which JAX numbers host after host, so that the inner axes
    (tensor, then context, then fsdp) stay within a host wherever they fit.

    Several slices (TPU slices, or GPU partitions: JAX_PARTITION_INDEX) are joined by the slower data-centre
    network (DCN): the slice boundary goes on the outermost axis that divides by the number of slices
    (data, else fsdp), so only data-parallel traffic crosses it, and each slice's share of the mesh is laid
    out on its own fast interconnect (ICI).
    """
    shape = tuple(sizes[a] for a in MESH_AXES)
    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices == 1:
        return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    axis = next((i for i, s in enumerate(shape[:2]) if s % slices == 0), None)
    if axis is None:
        raise ValueError(f"mesh {sizes}: the {slices} slices must divide the data or the fsdp axis")
    dcn = tuple(slices if i == axis else 1 for i in range(len(shape)))
    ici = tuple(s // d for s, d in zip(shape, dcn))
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)


def make_mesh(spec: str, devices=None) -> Mesh:
    """The (data, fsdp, context, tensor) mesh that --mesh describes, over all devices of all processes.

    On one process a mesh may use fewer devices than there are (e.g. the tiny preset's data=1 on a machine
    with several): it takes the first ones.
    """
    devices = devices if devices is not None else jax.devices()
    sizes = parse_mesh(spec, len(devices))
    if math.prod(sizes.values()) < len(devices):
        if jax.process_count() > 1:
            raise ValueError(
                f"--mesh {spec!r} uses {math.prod(sizes.values())} of {len(devices)} devices; "
                "with several processes the mesh must span them all (one axis -1 fills it)"
            )
        devices = devices[: math.prod(sizes.values())]
    # Auto axes: the compiler propagates shardings from the inputs and from gather()'s constraints. Stated,
    # since jax.make_mesh now defaults to Explicit.
    return Mesh(device_grid(sizes, devices), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


# ---------------------------------------------------------------------------------------------------------
# Compiling for hardware this machine does not have (train.py --dry_run --topology).

# Cloud TPU families by the accelerator-type prefix gcloud takes (v5p-512, v6e-256, v5litepod-256, v4-128,
# tpu7x-128): libtpu's topology prefix, how many of the name's count make one chip (v4, v5p and Ironwood count
# TensorCores, two per chip), the torus's dimensions, and each JAX device's HBM in GiB as the TPU compiler
# reports it. v4 and v5p join a chip's two cores into one device (megacore); Ironwood's cores are one device
# each (tpu7x:4x4x4 is 64 chips, 128 devices of 94.75 GiB).
TPU_FAMILIES = {
    "v4": ("v4", 2, 3, 30.75),
    "v5p": ("v5p", 2, 3, 95.74),
    "v5litepod": ("v5e", 1, 2, 15.75),
    "v5e": ("v5e", 1, 2, 15.75),
    "v6e": ("v6e", 1, 2, 31.25),
    "tpu7x": ("tpu7x", 2, 3, 94.75),
}


# Dense bf16 peak FLOP/s per chip (datasheets; TPU7x is Ironwood, whose two devices per chip share it): MFU's
# denominator, with --fp8 too, as OLMo-core's speed monitor (fp8 peaks: README, "FP8").
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "TPU7x": 2307e12 / 2,
    "TPU v7": 2307e12 / 2,
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
}


def peak_flops(device) -> float | None:
    """The device's peak, or None where there is no meaningful MFU (CPU, unknown chips)."""
    kind = device.device_kind
    return next((v for k, v in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])) if k in kind), None)


@dataclasses.dataclass(frozen=True)
class Target:
    """Devices that exist only for the compiler: a TPU slice (or several) described by libtpu."""

    name: str  # as given: v5p-512 or v5p:4x8x8
    topology: str  # libtpu's: v5p:4x8x8
    num_slices: int
    devices: tuple
    hbm_per_device: int  # bytes


def torus(chips: int, dims: int) -> str:
    """The usual shape of a slice of `chips` chips (a power of two): 256 chips of v5p are 4x8x8, of v6e 16x16."""
    shape = [1] * dims
    for _ in range(chips.bit_length() - 1):
        shape[shape.index(min(shape))] *= 2
    shape.sort()
    return "x".join(map(str, [d for d in shape if d > 1] + [d for d in shape if d == 1]))


def tpu_target(name: str, num_slices: int = 1) -> Target:
    """A TPU slice by the name gcloud takes (v5p-512) or a raw topology (v5p:4x8x8), `num_slices` of them
    joined over the data-centre network; needs libtpu (pip install -e '.[tpu]'), not a TPU."""
    family, sep, size = name.lower().partition("-")
    if sep:  # an accelerator type
        if family not in TPU_FAMILIES or not size.isdigit():
            raise ValueError(
                f"--topology {name!r}: expected an accelerator type such as v5p-512, v6e-256, "
                f"v5litepod-256, v4-128 or tpu7x-128 (one of {sorted(TPU_FAMILIES)}), or a "
                "topology such as v5p:4x8x8"
            )
        prefix, per_chip, dims, hbm = TPU_FAMILIES[family]
        chips = int(size) // per_chip
        if chips < 1 or chips & (chips - 1) or int(size) % per_chip:
            raise ValueError(
                f"--topology {name!r}: {size} is not a power-of-two slice of {family} "
                f"(give the topology instead, e.g. {prefix}:4x4x12)"
            )
        topology = f"{prefix}:{torus(chips, dims)}"
    else:
        prefix, _, shape = name.partition(":")
        family = {"v5": "v5p"}.get(prefix.lower(), prefix.lower())
        if family not in TPU_FAMILIES or not all(d.isdigit() for d in shape.split("x")):
            raise ValueError(
                f"--topology {name!r}: expected a topology such as v5p:4x8x8, v6e:16x16, "
                "v5e:2x2, v4:4x4x4 or tpu7x:4x4x4, or an accelerator type such as v5p-512"
            )
        topology, hbm = f"{TPU_FAMILIES[family][0]}:{shape}", TPU_FAMILIES[family][3]
    from jax.experimental import topologies

    # libtpu asks the cloud's metadata server which TPU this host is, and warns at length when there is
    # none; naming the target and a host stops that. It also locks itself to one process per machine, which
    # guards chips; compiling touches none, so other JAX processes here may hold libtpu meanwhile. The
    # default backend stays the CPU (train.py sets it).
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", name if sep else "v5p-8")
    quiet_libtpu()
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    megacore = {"chip_config_name": "megacore"} if family in ("v4", "v5p") else {}
    if importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"--topology {name}: compiling for a TPU needs libtpu: pip install -e '.[tpu]'")
    devices = topologies.get_topology_desc(
        topology, platform="tpu", num_slices=num_slices, **megacore
    ).devices
    return Target(name, topology, num_slices, tuple(devices), int(hbm * 2**30))


# NVIDIA GPUs by the name a host type gives them (h200x8: eight H200s): what XLA's GPU compiler needs to
# know of the chip (its GpuTargetConfigProto) and the JAX device kind. Memory in bytes as the chip reports
# it; Hopper: 132 SMs of 2048 threads, 228 KiB shared memory (227 KiB per block), 64K registers, 50 MiB L2.
# The CUDA versions are those the [gpu] extra's plugin (jax[cuda13]) is built for. XLA needs the runtime's:
# its GEMM rewriter makes fp8 GEMMs only from CUDA 12.0, and a version stated nowhere reads as 0, so fp8
# matmuls (olmo3.fp8_linear) would silently compile as fp16 GEMMs, the weight's fp8 rounding folded away.
GPUS = {
    "h100": dict(kind="NVIDIA H100 80GB HBM3", memory=84_942_979_072, bandwidth=3_352_320_000_000, cc=(9, 0)),
    "h200": dict(
        kind="NVIDIA H200 141GB HBM3e", memory=151_397_597_184, bandwidth=4_800_000_000_000, cc=(9, 0)
    ),
}
HOPPER = """gpu_device_info {{
  core_count: 132  fpus_per_core: 128  clock_rate_ghz: 1.98  threads_per_warp: 32
  threads_per_block_limit: 1024  threads_per_core_limit: 2048
  thread_dim_limit_x: 1024  thread_dim_limit_y: 1024  thread_dim_limit_z: 64
  block_dim_limit_x: 2147483647  block_dim_limit_y: 65535  block_dim_limit_z: 65535
  shared_memory_per_block: 49152  shared_memory_per_block_optin: 232448  shared_memory_per_core: 233472
  registers_per_core_limit: 65536  registers_per_block_limit: 65536  l2_cache_size: 52428800
  device_memory_size: {memory}  memory_bandwidth: {bandwidth}
  cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }}
  runtime_version: "13.0.0"  compile_time_toolkit_version: "13.0.0"  driver_version: "13.0.0"
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 10 }}
device_description_str: "{kind}"
"""
# JAX on a GPU takes this share of its memory up front and XLA works within it (XLA_PYTHON_CLIENT_MEM_FRACTION).
GPU_MEMORY_FRACTION = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))


def gpu_target(name: str, hosts: int = 1) -> Target:
    """`hosts` hosts of GPUs by the name a host type gives them (h200x8), as XLA's GPU compiler sees them;
    needs the CUDA plugin (pip install -e '.[gpu]'), not a GPU. Without a GPU no cuDNN graph is built and
    checked and no GEMM autotuned: a step that compiles here may still be refused by cuDNN on the GPU, and
    cuDNN's workspace is not in the memory figures."""
    chip, _, count = name.lower().partition("x")
    # Without the GPU nothing is autotuned and XLA compiles its GEMMs as Triton fusions by default; on the GPU
    # the autotuner may pick cuBLAS instead. Off here, so that fp8 matmuls compile to cuBLASLt's fp8 GEMM, the
    # kernel torchao's FP8 runs (fast accumulation exactly where olmo3.fp8_linear asks for it). XLA reads its
    # flags once, when the first backend starts: this holds where nothing touched a device before (start()).
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_enable_triton_gemm" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_enable_triton_gemm=false".strip()
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention
    from jax.experimental import topologies

    spec = GPUS[chip]
    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=HOPPER.format(**spec), topology=f"1x{hosts}x{count}"
        )
    except Exception as e:  # no CUDA plugin: JAX raises its own error types
        raise RuntimeError(
            f"--topology {name}: compiling for a GPU needs the CUDA plugin: pip install -e "
            f"'.[gpu]' ({type(e).__name__}: {e})"
        ) from e
    # JAX decides what cuDNN attention supports (head dim 256 from Hopper on) by asking the default backend
    # for its compute capability; on this machine that is the CPU, so answer for the target instead.
    at_least = lambda capability: spec["cc"] >= tuple(map(int, capability.split(".")))
    cudnn_attention.check_compute_capability = at_least
    cudnn_attention.is_cuda_compute_capability_equal = lambda c: spec["cc"] == tuple(map(int, c.split(".")))
    return Target(name, name, hosts, tuple(topology.devices), int(spec["memory"] * GPU_MEMORY_FRACTION))


def compile_target(name: str, num_slices: int = 1) -> Target:
    """Devices that exist only for the compiler: a TPU slice (v5p-512, v5p:4x8x8) or GPU hosts (h200x8),
    `num_slices` of them."""
    if re.fullmatch(r"[a-z]\d+x\d+", name.lower()):
        if name.lower().partition("x")[0] not in GPUS:
            raise ValueError(
                f"--topology {name!r}: expected a GPU host such as {', '.join(g + 'x8' for g in GPUS)}"
            )
        return gpu_target(name, num_slices)
    return tpu_target(name, num_slices)


def start(
    spec: str,
    topology: str = "",
    num_slices: int = 1,
    coordinator: str = "",
    num_processes: int = 0,
    process_id: int = -1,
    heartbeat_timeout: int = 100,
) -> tuple[Mesh, Target | None]:
    """The mesh a run computes on, over every device of every process (started by `initialize`), and None;
    or, given a topology, the mesh over the devices of a slice this machine does not have, which exist only
    for the compiler, and that target. Run before anything touches a device: XLA reads its flags when the
    first backend starts. ValueError names the flag at fault; RuntimeError: the topology's extra is missing."""
    if topology:
        jax.config.update("jax_platforms", "cpu")  # this machine's backend; the target is only described
        # A compile-only executable cannot be loaded back without the target's client: a persistent compilation
        # cache (JAX_COMPILATION_CACHE_DIR) would warn on every later dry run of the same step, and save nothing.
        jax.config.update("jax_enable_compilation_cache", False)
        target = compile_target(topology, num_slices)
        return make_mesh(spec, list(target.devices)), target
    quiet_libtpu()
    initialize(coordinator, num_processes, process_id, heartbeat_timeout)
    return make_mesh(spec), None


def describe(mesh: Mesh, target: Target | None) -> str:
    """The devices a mesh spans, as a dry run names them."""
    if target is None:
        return f"{mesh.size} devices, mesh {dict(mesh.shape)}"
    name = target.name + (f" ({target.topology})" if target.topology != target.name else "")
    gpu = mesh.devices.flat[0].platform == "gpu"
    slices = f" x {target.num_slices} {'hosts' if gpu else 'slices'}" if target.num_slices > 1 else ""
    return (
        f"{name}{slices}, {mesh.size} devices of {mesh.devices.flat[0].device_kind}, mesh {dict(mesh.shape)}"
    )


def memory_limit(mesh: Mesh, target: Target | None) -> int | None:
    """Bytes one device may hold: the target's HBM, or what a real device states (a CPU states nothing)."""
    if target:
        return target.hbm_per_device
    return (mesh.local_devices[0].memory_stats() or {}).get("bytes_limit")  # one of this process's devices


def memory_use(compile_step) -> tuple[list[tuple[str, int]], int]:
    """Compile a step (`compile_step()` returns it compiled and its abstract inputs by name) and return what
    one device holds: (name, bytes) for each input, the compiler's activations and temporaries and its
    generated code, and the total. A TPU compiler refuses a program over its HBM, naming what the
    temporaries need: then no rows, and that as the total."""
    try:
        compiled, inputs = compile_step()
    except Exception as e:  # anything but the TPU compiler's refusal is raised as is
        need = re.search(r"RESOURCE_EXHAUSTED.*required for HLO temporaries \(([\d.]+)G\)", str(e))
        if need is None:
            raise
        return [], int(float(need.group(1)) * 2**30)
    mem = compiled.memory_analysis()
    held = lambda tree: sum(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)
    )
    rows = [(name, held(tree)) for name, tree in inputs.items()]
    rows += [
        ("activations + temporaries", mem.temp_size_in_bytes),
        ("generated code", mem.generated_code_size_in_bytes),
    ]
    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
    return rows, total + mem.temp_size_in_bytes + mem.generated_code_size_in_bytes


def fit_report(compile_step, mesh: Mesh, target: Target | None, tips: str, say=print) -> bool:
    """Compile a step (as memory_use) and say what one device holds, against the device's memory
    (memory_limit), with a verdict. False if it does not fit; `tips` says what to try then."""
    t0 = time.perf_counter()
    rows, total = memory_use(compile_step)
    if not rows:
        say(f"does not fit: the compiler needs {total / 2**30:.2f} GiB of temporaries per device. Try {tips}")
        return False
    hbm = memory_limit(mesh, target)
    say(f"compiled in {time.perf_counter() - t0:.0f} s. Per device:")
    for name, size in rows + [("total", total)] + ([("HBM", hbm)] if hbm else []):
        say(f"  {name:<26} {size / 2**30:9.3f} GiB")
    if target and mesh.devices.flat[0].platform == "gpu":
        say(
            f"  (HBM: the {GPU_MEMORY_FRACTION:.0%} of each GPU's memory JAX takes; XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )
    if hbm and total <= hbm:
        say(f"fits, with {(hbm - total) / 2**30:.1f} GiB to spare")
    elif hbm:
        say(f"does not fit: {(total - hbm) / 2**30:.1f} GiB over. Try {tips}")
    return not hbm or total <= hbm


# ---------------------------------------------------------------------------------------------------------
# What a compiled step sends between devices: its collectives, read from the optimized HLO text (as_text()).

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
# What a device computes between an asynchronous collective's start and its end, if scheduled there.
COMPUTE = {"fusion", "convolution", "dot", "custom-call", "while", "call", "conditional", "sort", "scatter"}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    kind: str  # one of COLLECTIVES
    arrays: tuple[
        tuple[str, int], ...
    ]  # each array it moves whole (gathered, or summed): element type, bytes
    runs: int  # how often a step runs it: the trip counts of the loops around it (layers, microbatches)
    overlapped: bool | None  # asynchronous, with compute scheduled between start and end; None: synchronous
    reduction: str  # what it combines with (add, maximum, ...); "" for gathers and permutes
    padded: bool  # an all-reduce of zero-padded shards (dynamic-update-slice): XLA's way of gathering small arrays


@dataclasses.dataclass
class _Op:
    name: str
    type: str
    opcode: str
    args: str  # the text between its parentheses: operands, or a constant's value
    attributes: str

    @property
    def operands(self) -> list[str]:
        return re.findall(r"%([\w.\-]+)", self.args)


def _outside(text: str, char: str, depth: int = 0) -> int:
    """The index of the first `char` in `text` outside parentheses, `depth` of them open at its start."""
    for i, c in enumerate(text):
        if c == char and depth == (char == ")"):
            return i
        depth += (c == "(") - (c == ")")
    return len(text)


def _parse_op(line: str) -> _Op | None:
    """`%name = TYPE opcode(operands), attributes` -> _Op; None for other lines. A tuple TYPE holds spaces and
    parentheses, so it is read to its closing parenthesis."""
    head = re.match(r"\s*(?:ROOT )?%([\w.\-]+) = ", line)
    if not head:
        return None
    rest = line[head.end() :]
    end = _outside(rest, " ")
    op = re.match(r"([\w\-]+)\(", rest[end + 1 :])
    if not op:
        return None
    args = rest[end + 1 + op.end() :]
    stop = _outside(args, ")", depth=1)
    return _Op(head[1], rest[:end], op[1], args[:stop], args[stop + 1 :])


def _computations(hlo: str) -> tuple[dict[str, list[_Op]], str]:
    """Each computation's instructions, in the order the schedule runs them (HLO text defines each
    computation before those that call it), and the entry computation's name."""
    out, current, entry = {}, None, ""
    for line in hlo.splitlines():
        if m := re.match(r"(ENTRY )?%([\w.\-]+) .*\{$", line):
            current, entry = out.setdefault(m[2], []), m[2] if m[1] else entry
        elif current is not None and (op := _parse_op(line)):
            current.append(op)
    return out, entry


def _arrays(hlo_type: str) -> list[tuple[str, int]]:
    """(element type, bytes) of each array in an HLO type (a tuple's too); tokens are none."""
    found = re.findall(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]", hlo_type)
    bits = lambda name: int(re.search(r"\d+", name)[0]) if re.search(r"\d", name) else 8  # pred: a byte
    return [
        (name, math.prod(int(d) for d in dims.split(",") if d) * bits(name) // 8)
        for name, dims in found
        if name != "token"
    ]


def _trip_count(op: _Op, comps: dict[str, list[_Op]], ops: dict[str, _Op]) -> int:
    """How many times a while loop runs its body: the GPU compiler states it; otherwise its condition's bound
    (counter < N; the counter from its start value in the loop's initial tuple, JAX's scans from 0)."""
    if m := re.search(r'known_trip_count":\{"n":"(\d+)"', op.attributes):
        return int(m[1])
    condition = re.search(r"condition=%([\w.\-]+)", op.attributes)[1]
    constant = lambda o: int(o.args) if o is not None and o.opcode == "constant" else None
    for c in comps[condition]:
        if c.opcode == "compare" and "direction=LT" in c.attributes:
            counter, bound = (ops.get(n) for n in c.operands)
            index = re.search(r"index=(\d+)", counter.attributes) if counter else None
            init = ops.get(op.operands[0])
            start = (
                ops.get(init.operands[int(index[1])]) if init and index and init.opcode == "tuple" else None
            )
            return (constant(bound) or 1) - (constant(start) or 0)
    return 1


def _runs(comps: dict[str, list[_Op]], entry: str, ops: dict[str, _Op]) -> tuple[dict, dict]:
    """How many times a step runs each computation (loops' trip counts multiplied), and the instruction that
    calls each (with the computation it is in)."""
    runs, caller = dict.fromkeys(comps, 0), {}
    runs[entry] = 1
    for name in reversed(list(comps)):  # a caller after its callees in the text: this visits callers first
        for op in comps[name]:
            trip = _trip_count(op, comps, ops) if op.opcode == "while" else 1
            for callee in re.findall(r"%([\w.\-]+)", op.attributes):
                if callee in comps:
                    runs[callee] += runs[name] * trip
                    caller.setdefault(callee, (name, op))
    return runs, caller


def _overlapped(op: _Op, where: str, comps: dict[str, list[_Op]], caller: dict) -> bool | None:
    """Whether a collective runs asynchronously with compute scheduled between its start and its end; None if
    it is synchronous. The start is the op itself (GPU's all-gather-start) or the async start (async-start,
    call-start) of the computation that holds it (XLA wraps collectives so)."""
    unit = op if op.opcode.endswith("-start") else None
    while unit is None and where in caller:
        parent, call = caller[where]
        if not call.opcode.endswith("-start") and call.opcode != "call":
            return None
        unit, where = (call if call.opcode.endswith("-start") else None), parent
    if unit is None:
        return None
    body, waiting = comps[where], {unit.name}
    start = next(i for i, o in enumerate(body) if o.name == unit.name)
    for between in body[start + 1 :]:
        if between.opcode.endswith("-done") and waiting & set(between.operands):
            return False
        if between.opcode == "async-update" and waiting & set(between.operands):
            waiting.add(between.name)
        elif between.opcode in COMPUTE:
            return True
    return False


def collectives(hlo: str) -> list[Collective]:
    """Every collective instruction of a compiled program (its optimized HLO text), with what it moves: an
    all-gather its gathered arrays, the others the arrays they take (a reduce-scatter the whole arrays it
    sums), each counted whole on each device, as often as the step runs it."""
    comps, entry = _computations(hlo)
    ops = {op.name: op for body in comps.values() for op in body}
    runs, caller = _runs(comps, entry, ops)
    taken = lambda op: [a for name in op.operands for a in _arrays(ops[name].type)]
    found = []
    for where, body in comps.items():
        for op in (op for op in body if op.opcode.removesuffix("-start") in COLLECTIVES):
            kind = op.opcode.removesuffix("-start")
            moved = _arrays(op.type) if kind == "all-gather" else taken(op)
            if op.opcode == "all-gather-start":  # (the shards it takes, the arrays it gathers)
                moved = moved[len(taken(op)) :]
            combine = re.search(r"to_apply=%([\w.\-]+)", op.attributes)
            reduction = comps[combine[1]][-1].opcode if combine else ""
            padded = kind == "all-reduce" and all(
                ops[n].opcode == "dynamic-update-slice" for n in op.operands
            )
            overlapped = _overlapped(op, where, comps, caller)
            found.append(Collective(kind, tuple(moved), runs[where], overlapped, reduction, padded))
    return found


def traffic(found: list[Collective]) -> dict[tuple[str, str], list[int]]:
    """(kind, element type) -> [arrays, bytes, arrays overlapped with compute], each as often as it runs."""
    out = {}
    for c in found:
        for dtype, size in c.arrays:
            row = out.setdefault((c.kind, dtype), [0, 0, 0])
            row[0], row[1], row[2] = (
                row[0] + c.runs,
                row[1] + c.runs * size,
                row[2] + c.runs * bool(c.overlapped),
            )
    return out


# ---------------------------------------------------------------------------------------------------------
# What a compiled step computes: its matrix multiplications' FLOPs, read from the optimized HLO text, each
# instruction as often as the step runs it. Whatever recomputation the program does (--remat, a kernel's
# backward pass) is in them; elementwise work is not.


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """One fused attention kernel (Splash's Mosaic call, cuDNN's fmha) of a compiled program: its score
    matrices, and how many matmuls over them it makes."""

    matrices: int  # rows x heads: one (queries, keys) score matrix each
    queries: int
    keys: int
    head_dim: int
    matmuls: int  # forward: scores and their values (2); backward: the scores again, as flash attention's
    # backward recomputes them, then the gradients of the probabilities, queries, keys and values (5)
    runs: int  # how often a step runs it


def matmul_flops(hlo: str) -> tuple[int, list[AttentionCall]]:
    """The FLOPs one device's step spends in matrix multiplications (2 per multiply-add), and its attention
    kernels, whose FLOPs depend on the mask (counted by the caller). XLA's dots and convolutions (CPU, TPU)
    and cuBLAS's GEMMs (GPU) from their shapes: each output element sums over the contracted dimensions (a
    convolution's: its kernel's input features and window). Each as often as the step runs it (_runs)."""
    comps, entry = _computations(hlo)
    ops = {op.name: op for body in comps.values() for op in body}
    runs, _ = _runs(comps, entry, ops)
    flops, kernels = 0, []
    for where, body in comps.items():
        for op in body:
            if call := _attention_call(op, ops, runs[where]):
                kernels.append(call)
            else:
                flops += runs[where] * _matmul_flops(op, ops)
    return flops, kernels


def _dims(hlo_type: str) -> list[tuple[int, ...]]:
    """The dimensions of each array in an HLO type (a tuple's too)."""
    found = re.findall(r"\b[a-z]+\d*[a-z0-9]*\[([\d,]*)\]", hlo_type)
    return [tuple(int(d) for d in dims.split(",") if d) for dims in found]


def _matmul_flops(op: _Op, ops: dict[str, _Op]) -> int:
    """2 x the output's elements x what each sums over, for a dot, a convolution or a cuBLAS GEMM; 0 else."""
    out = math.prod(_dims(op.type)[0])
    if op.opcode == "convolution":  # dim_labels=LHS_RHS->OUT; the kernel's (RHS) labels: i, o, window digits
        kernel = re.search(r"dim_labels=\w+_(\w+)->", op.attributes)[1]
        shape = _dims(ops[op.operands[1]].type)[0]
        return 2 * out * math.prod(n for label, n in zip(kernel, shape, strict=True) if label != "o")
    if op.opcode == "dot":
        summed = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", op.attributes)[1]
    elif op.opcode == "custom-call" and 'custom_call_target="__cublas$' in op.attributes:
        summed = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', op.attributes)[1]
    else:
        return 0
    lhs = _dims(ops[op.operands[0]].type)[0]
    return 2 * out * math.prod(lhs[int(d)] for d in re.findall(r"\d+", summed))


def _attention_call(op: _Op, ops: dict[str, _Op], runs: int) -> AttentionCall | None:
    """A Splash or cuDNN attention kernel, read from its operands' shapes; None for any other instruction.
    Splash takes (mask data, q, k, v, ...), q as (..., heads, queries, head_dim), k as (..., keys, head_dim);
    cuDNN states its score matrices' shape (batch, heads, queries, keys) and takes q first (..., head_dim)."""
    if op.opcode != "custom-call":
        return None
    splash = re.search(r"splash_mha_(fwd|dkv)", op.name + op.attributes)
    if splash and 'custom_call_target="tpu_custom_call"' in op.attributes:
        arrays = [(ops[n].type, _dims(ops[n].type)[0]) for n in op.operands]
        q, k = [shape for t, shape in arrays if t.startswith(("f", "bf")) and len(shape) >= 3][:2]
        return AttentionCall(math.prod(q[:-2]), q[-2], k[-2], q[-1], 2 if splash[1] == "fwd" else 5, runs)
    if cudnn := re.search(r'custom_call_target="__cudnn\$fmha\w*?(Backward)?"', op.attributes):
        scores = re.search(r'"intermediate_tensor_shape":.*?"dimensions": ?\[([^\]]*)\]', op.attributes)
        batch, heads, queries, keys = (int(n) for n in re.findall(r"\d+", scores[1]))
        head_dim = _dims(ops[op.operands[0]].type)[0][-1]
        return AttentionCall(batch * heads, queries, keys, head_dim, 5 if cudnn[1] else 2, runs)
    return None


# ---------------------------------------------------------------------------------------------------------
# Parameters: logical names from olmo3.py's annotations, then the rules.


def logical_axes(tree) -> typing.Any:
    """A pytree like `tree` (a model, one layer, optimizer state) holding each array's logical axis names.

    The names are read from the jaxtyping annotation of the module field that holds the array. An array
    with one axis more than its annotation is a stack of layers (olmo3 stacks its blocks for the scan):
    its first axis is "layers". Arrays that no annotation names (in a plain tuple, say) are replicated:
    None for every axis.
    """

    def axes(path, leaf):
        if not is_array(leaf):
            return None
        node, hint = tree, None
        for key in path:  # down from the root to the leaf, keeping the annotation of the last field
            if isinstance(key, jax.tree_util.GetAttrKey):
                hint = typing.get_type_hints(type(node)).get(key.name)
                node = getattr(node, key.name)
            else:
                hint, node = None, node[key.idx if isinstance(key, jax.tree_util.SequenceKey) else key.key]
        if not hasattr(hint, "dims"):
            return (None,) * leaf.ndim
        names = tuple(d.name for d in hint.dims)
        return ("layers",) * (leaf.ndim == len(names) + 1) + names

    return jax.tree_util.tree_map_with_path(axes, tree)


def spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh, gathered: bool = False) -> P:
    """PartitionSpec for one array; a dimension the mesh axes do not divide stays replicated.
    `gathered`: the weight as a layer uses it, whole over fsdp (FSDP's all-gather), still split over
    tensor."""
    out, used = [], set()
    for name, size in zip(axes, shape, strict=True):
        mesh_axes = tuple(
            a for a in RULES.get(name) or () if mesh.shape[a] > 1 and not (gathered and a == "fsdp")
        )
        if twice := sorted(used & set(mesh_axes)):
            raise ValueError(
                f"mesh axes {twice} appear twice in the spec for logical axes {axes}; fix shard.RULES"
            )
        if not mesh_axes or size % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used |= set(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def cast(w, dtype):
    """`w` in `dtype`, cast where it is (before it is gathered). The barrier keeps it there: XLA's GPU compiler
    would move the cast past the all-gather and send fp32 (measured: the LM head's, doubling its bytes)."""
    return w if w.dtype == jnp.dtype(dtype) else jax.lax.optimization_barrier(w.astype(dtype))


def with_axes(tree) -> list[tuple]:
    """(array, its logical axes) for each array of `tree`, in jax.tree.leaves' order."""
    axes = [ax for ax in jax.tree.leaves(logical_axes(tree), is_leaf=_is_axes) if ax is not None]
    return list(zip(jax.tree.leaves(eqx.filter(tree, is_array)), axes, strict=True))


def elements_held(axes: tuple, shape: tuple[int, ...], mesh: Mesh, gathered: bool = False) -> int:
    """How many of an array's elements one device holds, laid out by RULES (`gathered`: as a layer uses it)."""
    split = [a for s in spec(axes, shape, mesh, gathered) if s for a in ((s,) if isinstance(s, str) else s)]
    return math.prod(shape) // math.prod(mesh.shape[a] for a in split)


def abstract(tree, shardings):
    """`tree` with every array abstract (shape and dtype) and carrying its sharding: what a restore places
    arrays by, and what a compile-only step takes as inputs."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if is_array(x) else x,
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def compile_abstract(fn, *args, donate: int = 0, options: dict | None = None):
    """`fn(*args)` compiled for abstract arrays with shardings (see `abstract`), nothing allocated: a 7B step
    for a pod's worth of devices compiles on a laptop. The first `donate` arguments are donated, as the real
    step donates them; `options`: XLA's, for this compile only (tuning_options). Lowered through jax.jit:
    eqx.filter_jit would take abstract arrays for static values."""
    dynamic, static = eqx.partition(args, is_array)
    run = lambda *dynamic: eqx.filter(fn(*eqx.combine(dynamic, static)), is_array)
    return jax.jit(run, donate_argnums=tuple(range(donate))).lower(*dynamic).compile(options)


def _is_axes(x) -> bool:
    return x is None or isinstance(x, tuple)


def shardings(tree, mesh: Mesh):
    """NamedShardings for every array of `tree` (None for its non-array leaves)."""
    return jax.tree.map(
        lambda ax, x: None if ax is None else NamedSharding(mesh, spec(ax, x.shape, mesh)),
        logical_axes(tree),
        tree,
        is_leaf=_is_axes,
    )


def gather(tree, mesh: Mesh):
    """`tree`'s weights where a layer uses them: all-gathered over fsdp, still split over tensor.

    Explicit, because left to itself XLA may settle the clash between a weight's embed axis and the
    activations' batch axis, both split over fsdp, by gathering the batch instead: every device then
    computes the whole batch (tests/test_shard.py checks the FLOPs per device). Arrays of the layer stack
    are left as they are: olmo3's layer scan gathers each layer as it runs it, so a device holds one layer
    whole at a time, as FSDP intends.
    """

    place = lambda ax, x: x if ax is None or ax[:1] == ("layers",) else gather_array(x, ax, mesh)
    return jax.tree.map(place, logical_axes(tree), tree, is_leaf=_is_axes)


def gather_array(x, axes: tuple, mesh: Mesh):
    """One array of logical `axes` where a layer uses it (gather)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(axes, x.shape, mesh, gathered=True)))


class Layout:
    """The mesh as the model sees it: olmo3.py names logical axes and never imports this file, so the
    train step hands it this object, which knows the mesh and RULES. `reduce_dtype`: the dtype in which the
    backward pass sums each weight's gradient over the devices (OLMo-core's reduce_dtype) where the layers
    compute in a narrower one; None: in the dtype they compute in, as autodiff sums by itself (and as a step
    without a backward pass needs nothing else)."""

    def __init__(self, mesh: Mesh, reduce_dtype: str | None = None):
        self.mesh, self.reduce_dtype = mesh, reduce_dtype
        self.platform = mesh.devices.flat[0].platform  # what the step is compiled for: "tpu", "cpu", ...

    def __eq__(self, other):  # static under jit: equal layouts, one compiled step
        return isinstance(other, Layout) and other.key == self.key

    def __hash__(self):
        return hash(self.key)

    @property
    def key(self) -> tuple:
        return self.mesh, self.reduce_dtype

    def gather(self, tree):
        return gather(tree, self.mesh)

    def copies(self, dtype) -> tuple[int, int, int] | None:
        """How many copies of each weight `weights` makes for layers that compute in `dtype`, along the mesh
        axes that split the tokens (data, fsdp: rows; context: each row's positions): one per device that
        holds other tokens, where the gradients are summed in a wider reduce_dtype. None where autodiff's own
        sums are the recipe's: fp32 layers, reduce_dtype None or no wider, one device holding every token."""
        devices = tuple(self.mesh.shape[a] for a in ("data", "fsdp", "context"))
        reduce = self.reduce_dtype is not None and jnp.dtype(self.reduce_dtype).itemsize
        return devices if reduce and reduce > jnp.dtype(dtype).itemsize and math.prod(devices) > 1 else None

    def weights(self, tree, dtype):
        """`tree`'s fp32 master weights as the layers compute with them: cast to `dtype`, then all-gathered
        over fsdp (gather; the cast is elementwise, so it goes first and the gather sends `dtype`'s bytes);
        the layer stack's arrays as they are (olmo3's scan places one layer at a time).

        Autodiff sums a weight's gradient over the devices where the gradient is made, in the dtype it is
        made in: XLA's partitioner reduces the partial sums of a matmul over a split axis right after it, so a
        bf16 layer's gradients would be summed in bf16. OLMo-core (FSDP with param_dtype bf16, reduce_dtype
        fp32) casts each rank's bf16 gradient to fp32 first, then reduce-scatters. Where `copies(dtype)` says,
        this does the same: each device that holds other tokens gets its own copy of each weight (leading
        "rows positions" axes split as the tokens are: no bytes sent), olmo3.per_device runs the layers on
        each device's tokens with its own copy, so each device's gradient stays its own; this function's
        backward pass casts those to reduce_dtype and sums them into the master's layout (one reduce-scatter
        over fsdp, an all-reduce over data and context)."""
        dynamic, static = eqx.partition(tree, eqx.is_inexact_array)
        pairs = with_axes(dynamic)
        placed = [i for i, (_, ax) in enumerate(pairs) if ax[:1] != ("layers",)]
        if self.copies(dtype) is None:
            used = [gather_array(cast(w, dtype), ax, self.mesh) for w, ax in (pairs[i] for i in placed)]
        else:
            used = self._copies([pairs[i][0] for i in placed], [pairs[i][1] for i in placed], dtype)
        leaves = [w for w, _ in pairs]
        for i, w in zip(placed, used, strict=True):
            leaves[i] = w
        return eqx.combine(jax.tree.unflatten(jax.tree.structure(dynamic), leaves), static)

    def _copies(self, masters: list, axes: list[tuple], dtype) -> list:
        """The per-device copies of `weights`, with the backward pass that sums them in reduce_dtype."""
        mesh, devices = self.mesh, self.copies(dtype)
        data, fsdp, context = (a if mesh.shape[a] > 1 else None for a in ("data", "fsdp", "context"))
        place = lambda x, ax, gathered, *lead: jax.lax.with_sharding_constraint(
            x, NamedSharding(mesh, P(*lead, *spec(ax, x.shape[len(lead) :], mesh, gathered)))
        )
        bits = jnp.finfo(dtype)

        @jax.custom_vjp
        def copies(masters):
            whole = [gather_array(cast(w, dtype), ax, mesh) for w, ax in zip(masters, axes)]
            copy = lambda w: jnp.broadcast_to(w, (*devices, *w.shape))
            return [place(copy(w), ax, True, data, fsdp, context) for w, ax in zip(whole, axes)]

        def backward(_, grads):
            # Each device's gradient in `dtype`, cast up, then summed as HSDP sums: within each fsdp group into
            # the master's shards (a reduce-scatter), then the shards across the groups (an all-reduce). The
            # rounding is stated: XLA may keep a bf16 gradient in fp32 when it is cast up at once (it allows
            # excess precision).
            up = lambda g: jax.lax.reduce_precision(g.astype(self.reduce_dtype), bits.nexp, bits.nmant)
            shards = lambda g, ax: place(up(g).sum(1), ax, False, data, context)
            return ([place(shards(g, ax).sum((0, 1)), ax, False) for g, ax in zip(grads, axes)],)

        copies.defvjp(lambda masters: (copies(masters), None), backward)
        return copies(masters)

    def context(self, seq: int) -> int:
        """Over how many devices a row of `seq` positions is split (olmo3.balanced_order): the context axis's,
        or 1 for a length it does not split (an evaluation batch of another length runs whole on each)."""
        n = self.mesh.shape["context"]
        return n if seq % (2 * n) == 0 else 1

    def constrain(self, x, axes: tuple):
        """`x` laid out as RULES lay out its logical `axes` (None: whole), a layout XLA then keeps."""
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec(axes, x.shape, self.mesh)))

    def per_shard(self, fn, in_axes: list[tuple]):
        """`fn` run on each device's own shard of its arguments (jax.shard_map): for a kernel XLA cannot
        partition, such as a Pallas/Mosaic one. Each argument is split as RULES split its logical axes
        (`in_axes`, one tuple per argument); the result is laid out as the first argument."""

        def run(*args):
            specs = tuple(spec(ax, x.shape, self.mesh) for ax, x in zip(in_axes, args, strict=True))
            return jax.shard_map(fn, mesh=self.mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(
                *args
            )

        return run


def check_rules(tree, mesh: Mesh) -> list[str]:
    """Every array has logical names of its rank, each in RULES, no mesh axis twice in a spec; warns (and
    returns the names) of arrays over 1 MB left fully replicated on a mesh of several devices."""
    problems, replicated = [], []
    arrays = eqx.filter(tree, is_array)
    names = jax.tree.leaves(logical_axes(arrays), is_leaf=lambda x: isinstance(x, tuple))
    for (path, leaf), ax in zip(jax.tree_util.tree_leaves_with_path(arrays), names, strict=True):
        name = jax.tree_util.keystr(path)
        if len(ax) != leaf.ndim:
            problems.append(f"{name}: {len(ax)} logical axes {ax} for a rank-{leaf.ndim} array")
            continue
        if unknown := [a for a in ax if a is not None and a not in RULES]:
            problems.append(f"{name}: logical axes {unknown} have no rule in shard.RULES")
            continue
        try:
            sharded = any(s is not None for s in spec(ax, leaf.shape, mesh))
        except ValueError as e:
            problems.append(f"{name}: {e}")
            continue
        if not sharded and mesh.size > 1 and leaf.size * leaf.dtype.itemsize > 2**20:
            replicated.append(name)
    if problems:
        raise ValueError("sharding rules do not cover the model:\n  " + "\n  ".join(problems))
    if replicated:
        warnings.warn(
            f"arrays over 1 MB left fully replicated on mesh {dict(mesh.shape)}: {replicated}", stacklevel=2
        )
    return replicated


# ---------------------------------------------------------------------------------------------------------
# The batch, and the multi-host start.


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Rows over (data, fsdp), the rest of each row whole."""
    return NamedSharding(mesh, P(RULES["batch"], *[None] * (ndim - 1)))


def sum_over_processes(values: list[int]) -> list[int]:
    """64-bit sums (mod 2**64) over every process, as uint32 words (jax has no uint64 by default)."""
    if jax.process_count() == 1:
        return values
    from jax.experimental import multihost_utils

    words = np.array([[v % 2**32, v >> 32] for v in values], np.uint32)
    every = np.asarray(multihost_utils.process_allgather(words)).reshape(-1, len(values), 2).astype(object)
    return [int(v) % 2**64 for v in (every[..., 0] + every[..., 1] * 2**32).sum(0)]


def put_batch(local_rows: np.ndarray, mesh: Mesh, global_rows: int):
    """This process's rows of the global batch (tokens, or one flag per row) -> one global array sharded over
    (data, fsdp).

    With several processes each one's rows (data.py's strided share) land on its own devices, so the array
    holds the global batch's rows in another order; every row is an independent example and the loss a
    mean, so only the order of the sums differs (tests/test_shard.py checks the losses against one process).
    """
    sharding = batch_sharding(mesh, local_rows.ndim)
    values = local_rows if local_rows.dtype == bool else local_rows.astype(np.int32)
    return jax.make_array_from_process_local_data(sharding, values, (global_rows, *local_rows.shape[1:]))


def cluster() -> str | None:
    """The multi-host environment jax.distributed.initialize() configures by itself, if any (the ones
    jax/_src/clusters knows): a Cloud TPU VM (GCE or GKE, one host or many), a SLURM job step, Open MPI's
    mpirun, an indexed Kubernetes Job (GKE GPU node pools), or a coordinator named in the environment."""
    env = os.environ
    from jax._src import cloud_tpu_init  # set by `import jax` when this machine has TPU chips

    if cloud_tpu_init.running_in_cloud_tpu_vm:
        return "Cloud TPU VM"
    if "SLURM_STEP_NODELIST" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return "SLURM"
    if "OMPI_MCA_orte_hnp_uri" in env:
        return "Open MPI"
    if "KUBERNETES_SERVICE_HOST" in env and "JOB_COMPLETION_INDEX" in env:
        return "Kubernetes"
    if "JAX_COORDINATOR_ADDRESS" in env:
        return "JAX_COORDINATOR_ADDRESS"
    return None


def quiet_libtpu() -> None:
    """Where libtpu is installed but this machine has no TPU chip (JAX looks on the PCI bus when imported),
    libtpu still asks the cloud's metadata server which TPU this host is, and prints a screenful of warnings
    when there is none. Naming a host and a type keeps it quiet; with no chip to drive, it then steps aside
    for the CPU (or GPU) backend as before. Call before anything touches a device."""
    from jax._src import cloud_tpu_init

    if not cloud_tpu_init.running_in_cloud_tpu_vm:
        os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-1")
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")


def deterministic_gpu_ops() -> None:
    """GPU kernels that sum in a fixed order, so that a step retaken after a resume computes the same bits:
    by default autotuned GEMMs and cuDNN attention's backward may sum in a varying order, and two runs of the
    same step drift apart (CPU and TPU steps repeat bit for bit anyway). Call before anything touches a
    device: XLA reads its flags once. Every cuDNN attention backward call is then marked deterministic where
    JAX writes it: without that, a step with several identical calls fails (deterministic_cudnn_backward)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_gpu_deterministic_ops" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_gpu_deterministic_ops=true".strip()
    deterministic_cudnn_backward()


def deterministic_cudnn_backward() -> None:
    """Work around an XLA bug (openxla/xla pull request #46500, open; seen with JAX 0.11.2): under
    deterministic ops, XLA's cuDNN pass fingerprints each attention backward call
    (`__cudnn$fmhaSoftmaxBackward`) *before* it writes `force_deterministic` into the call's backend config.
    Of several identical calls only the first gets the flag and a compiled graph; the others look up, at
    their first run, a graph that was never built: `IndexError: raw_hash_map<>::at`. OLMo 3's layer group
    (sliding x3, full) has three identical calls. Here every backward config gets the flag where JAX writes
    it, before XLA fingerprints anything, so all fingerprints agree. Both ways into cuDNN attention
    (jax.nn.dot_product_attention and JAX's cuDNN module, olmo3._cudnn_attention) lower through this one
    function, looked up at each lowering.

    Remove this once a released jaxlib carries the XLA fix. It replaces a private JAX function: where that is
    not there as expected, JAX is left as it is (a deterministic GPU step with several identical cuDNN calls
    then fails at its first run as above; nothing else changes)."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError:
        return
    config = getattr(cudnn, "create_dot_product_attention_backend_config", None)
    if config is None or getattr(config, "forces_determinism", False):  # absent, or replaced already
        return
    signature = inspect.signature(config)
    if "is_bwd" not in signature.parameters:
        return

    @functools.wraps(config)
    def deterministic_config(*args, **kwargs):
        text = config(*args, **kwargs)
        if not signature.bind(*args, **kwargs).arguments["is_bwd"]:
            return text
        backend = json.loads(text)
        backend["cudnn_fmha_backend_config"]["force_deterministic"] = True
        return json.dumps(backend)

    deterministic_config.forces_determinism = True
    cudnn.create_dot_product_attention_backend_config = deterministic_config


# Deterministic GEMMs that are the autotuned ones. Under deterministic ops XLA's autotuner takes the first
# GEMM configuration that compiles, not the fastest, unless its autotuning cache holds a choice, which it
# looks up first. A compile tuned as without deterministic ops fills this process's cache and writes what XLA
# chose to a file, which a later process loads into its own before compiling (XLA's docs/determinism.md:
# compilation stays deterministic with persisted autotuning). ckpt.autotuned_gemms keeps it in the run's
# directory.


def autotune_name(device) -> str:
    """The file of XLA's GEMM choices for one kind of GPU under one jaxlib: XLA keys its choices by the GPU
    and refuses a file of another version of its own. E.g. NVIDIA_H200_141GB_HBM3e-jaxlib0.10.2.textproto."""
    kind = re.sub(r"[^\w.-]+", "_", device.device_kind)
    return f"{kind}-jaxlib{jaxlib.__version__}.textproto"


def tuning_options(file: str) -> dict:
    """A GPU compile's options (`.compile(options)`) that autotune its GEMMs as without deterministic ops and
    write XLA's choices to local `file`. A compile-only target tunes nothing and writes no file."""
    return {"xla_gpu_deterministic_ops": False, "xla_gpu_dump_autotune_results_to": file}


def load_autotuning(file: str, device) -> None:
    """XLA's GEMM choices in local `file` (written by a compile given tuning_options) loaded into this
    process's autotuning cache, by a compile of nothing much for `device`; XLA loads one file per process."""
    like = jax.ShapeDtypeStruct((), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(device))
    jax.jit(lambda x: x + 1).lower(like).compile({"xla_gpu_load_autotune_results_from": file})


# JAX's persistent compilation cache: a restart loads each program compiled before (the train step: minutes for
# the 7B) from a folder, where JAX keys it on the program, the devices, jaxlib's and the backend's versions and
# XLA's flags. train.py's --compile_cache defaults to JAX's own variable where set, else the user's cache folder.
COMPILE_CACHE = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "olmo3-jax", "jax"
)


def use_compilation_cache(path: str) -> None:
    """Keep every program XLA compiles in folder `path` (or gs://BUCKET/PATH, which JAX writes through etils'
    epath: the gcs extra's gcsfs), and look there first; '' turns the cache off. JAX's own threshold stays:
    only programs that took 1 s or more to compile are kept, the step among them: keeping a restart's six small
    others too (the data's placement, the checksums) spared 0.1-0.2 s of its compiles here (bench/RESULTS.md).
    JAX writes from process 0 only: on a pod, a folder every host reads (gs://) spares each host the compile."""
    from jax.experimental.compilation_cache import compilation_cache

    if "://" in path:  # JAX's eviction (a size limit) locks a local file named as the folder, "gs:/..."
        jax.config.update("jax_compilation_cache_max_size", -1)  # so a bucket keeps every program
    asked = (path or None, bool(path))
    if (jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache) != asked:
        jax.config.update("jax_enable_compilation_cache", bool(path))
        compilation_cache.set_cache_dir(path or None)
        compilation_cache.reset_cache()  # JAX opens its cache once: a process that compiled before (a test's)


def compile_watched(compile_fn) -> tuple[object, float, dict]:
    """`compile_fn()` (a jit's .lower(...).compile()) timed: what it returns, its seconds, and what it compiled, as JAX's events
    in this thread tell: "compiles" (programs handed to XLA or found in the persistent compilation cache; none
    where this process compiled it before), "hits" (found there) and "writes" (compiled, then stored there:
    JAX names that event "cache_misses")."""
    counts, thread = dict(compiles=0, hits=0, writes=0), threading.get_ident()
    names = {
        "/jax/core/compile/backend_compile_duration": "compiles",
        "/jax/compilation_cache/cache_hits": "hits",
        "/jax/compilation_cache/cache_misses": "writes",
    }

    def count(event: str, *_, **__) -> None:
        if event in names and threading.get_ident() == thread:
            counts[names[event]] += 1

    jax.monitoring.register_event_listener(count)
    jax.monitoring.register_event_duration_secs_listener(count)
    start = time.perf_counter()
    try:
        compiled = compile_fn()
    finally:
        jax.monitoring.unregister_event_listener(count)
        jax.monitoring.unregister_event_duration_listener(count)
    return compiled, time.perf_counter() - start, counts


def compiler(device) -> dict:
    """What compiles for `device`: JAX's and jaxlib's versions, the backend's own (libtpu's, CUDA's) and the
    flags XLA and libtpu read."""
    env = {name: os.environ.get(name, "") for name in ("XLA_FLAGS", "LIBTPU_INIT_ARGS")}
    return dict(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=device.client.platform_version, **env)


def initialize(
    coordinator: str = "", num_processes: int = 0, process_id: int = -1, heartbeat_timeout: int = 100
) -> None:
    """Start JAX's multi-host runtime when there are several hosts; must run before anything touches a device.

    The environments cluster() names are detected; elsewhere pass --coordinator host:port --num_processes N
    --process_id i on every host (the same command, each with its own i). Cross-process collectives on the
    CPU use gloo, JAX's default. Only this runtime may handle SIGTERM afterwards (train.py installs no
    handler then), so that every process learns of a preemption at the same step. A process silent for
    `heartbeat_timeout` seconds (killed, or its host gone) makes the others stop with an error, not hang.
    """
    if coordinator or num_processes or process_id != -1:
        if not (
            num_processes > 0
            and 0 <= process_id < num_processes
            and (coordinator or "JAX_COORDINATOR_ADDRESS" in os.environ)
        ):
            raise ValueError(
                "--coordinator host:port, --num_processes N and --process_id 0..N-1 go "
                f"together; got --coordinator {coordinator!r} --num_processes {num_processes} "
                f"--process_id {process_id}"
            )
        jax.distributed.initialize(
            coordinator or None, num_processes, process_id, heartbeat_timeout_seconds=heartbeat_timeout
        )
    elif cluster():
        jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat_timeout)


def exit_alone(code: int) -> None:
    """End a failing process of a multi-process run now, with `code`, skipping JAX's orderly shutdown; with one
    process, do nothing (the caller returns as usual).

    That shutdown waits at a barrier for every process, and the others may be inside a step that waits for
    this one: both would wait forever. Exiting at once stops this process's heartbeats instead, so the others
    stop within --heartbeat_timeout ("another task died"), and the job ends rather than hanging."""
    if not jax.distributed.is_initialized():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
