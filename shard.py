"""Sharding: the mesh, logical-axis rules, parameter and batch shardings, and the multi-host start.

olmo3.py names every dimension in its jaxtyping annotations (embed, heads, mlp, ...). Here one table maps
those logical names onto three mesh axes, as MaxText and jax-llm-examples do:
    data    pure data parallelism: parameters replicated, the batch split
    fsdp    data parallelism with parameters and optimizer state split too (ZeRO-3)
    tensor  Megatron-style tensor parallelism: heads and the MLP's hidden units split
"""

import dataclasses
import math
import os
import typing
import warnings

import equinox as eqx
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import olmo3

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes (None: replicated). Parameters shard `embed` over fsdp (FSDP), and heads, kv_heads,
# mlp and vocab over tensor (Megatron: column-parallel in, row-parallel out). The batch spans data and fsdp.
RULES: dict[str, tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "seq": None,
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "head_dim": None,
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "layers": None,
}


def parse_mesh(spec: str, n_devices: int) -> dict[str, int]:
    """`data=2,fsdp=4,tensor=1` -> axis sizes; one size may be -1 ("the rest"); unnamed axes are 1."""
    sizes = dict.fromkeys(MESH_AXES, 1)
    for part in filter(None, spec.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.lstrip("-").isdigit():
            raise ValueError(f"--mesh {spec!r}: expected entries like data=2,fsdp=-1,tensor=1 over {MESH_AXES}")
        sizes[name] = int(value)
    if list(sizes.values()).count(-1) > 1:
        raise ValueError(f"--mesh {spec!r}: at most one axis may be -1")
    known = math.prod(s for s in sizes.values() if s != -1)
    for name, size in sizes.items():
        if size == -1:
            if n_devices % known:
                raise ValueError(f"--mesh {spec!r}: {n_devices} devices do not divide by the other axes ({known})")
            sizes[name] = n_devices // known
    if math.prod(sizes.values()) > n_devices:
        raise ValueError(f"--mesh {spec!r} needs {math.prod(sizes.values())} devices but there are {n_devices}")
    return sizes


def make_mesh(spec: str, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh, in the device order JAX's mesh utilities choose for the topology.

    Several TPU slices (or GPU hosts) are joined by the slower data-centre network (DCN): that split goes
    on the outermost axis that divides by it (data, else fsdp), so only gradient reductions cross it.
    """
    devices = devices if devices is not None else jax.devices()
    sizes = parse_mesh(spec, len(devices))
    shape = tuple(sizes[a] for a in MESH_AXES)
    if math.prod(shape) < len(devices):  # e.g. the tiny preset's data=1 on a machine with several devices
        if jax.process_count() > 1:
            raise ValueError(f"--mesh {spec!r} uses {math.prod(shape)} of {len(devices)} devices; with several "
                             "processes the mesh must span them all")
        devices = devices[: math.prod(shape)]
    slices = {getattr(d, "slice_index", 0) for d in devices}
    granules = len(slices) if len(slices) > 1 else (jax.process_count() if devices[0].platform == "gpu" else 1)
    if granules > 1:
        axis = next((i for i, s in enumerate(shape[:2]) if s % granules == 0), None)
        if axis is None:
            raise ValueError(f"--mesh {spec!r}: {granules} slices/hosts must divide the data or fsdp axis")
        dcn = tuple(granules if i == axis else 1 for i in range(3))
        ici = tuple(s // d for s, d in zip(shape, dcn))
        grid = mesh_utils.create_hybrid_device_mesh(
            ici, dcn, devices, process_is_granule=len(slices) == 1)
    else:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    # Auto axes: the compiler propagates shardings from the inputs; we state it, since jax.make_mesh now
    # defaults to Explicit.
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# ---------------------------------------------------------------------------------------------------------
# Parameters: logical names from olmo3.py's annotations, then the rules.


def is_array(x) -> bool:
    """An array or an abstract one (from eval_shape)."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def _field_axes(module_type: type, field: str) -> tuple[str, ...]:
    hint = typing.get_type_hints(module_type)[field]
    return tuple(d.name for d in hint.dims)


def logical_axes(tree) -> typing.Any:
    """A pytree like `tree` (a model or optimizer state) holding each array's logical axis names.

    The names are read from the jaxtyping annotations of the module field that holds the array; blocks
    stacked for the scan gain a leading "layers". Arrays that are not module fields (step counters,
    windows) are replicated: their names are None for every axis.
    """

    def axes(path, leaf):
        if not is_array(leaf):
            return None
        names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
        owner, found = olmo3.Olmo3, None
        for i, name in enumerate(names):
            field_type = typing.get_type_hints(owner).get(name) if dataclasses.is_dataclass(owner) else None
            if isinstance(field_type, type) and issubclass(field_type, eqx.Module):
                owner = field_type
            elif field_type is not None and i == len(names) - 1:
                found = _field_axes(owner, name)
        if found is None:
            return (None,) * leaf.ndim
        stacked = "layers" in names and owner is not olmo3.Olmo3
        return ("layers",) * stacked + found

    return jax.tree_util.tree_map_with_path(axes, tree)


def spec(axes: tuple, shape: tuple[int, ...], mesh: Mesh) -> P:
    """PartitionSpec for one array; a dimension the mesh axes do not divide stays replicated."""
    out, used = [], set()
    for name, size in zip(axes, shape):
        mesh_axes = tuple(a for a in (RULES.get(name) or ()) if mesh.shape[a] > 1)
        if used & set(mesh_axes):
            raise ValueError(f"mesh axes {mesh_axes} appear twice in the spec for logical axes {axes}")
        if not mesh_axes or size % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used |= set(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def shardings(tree, mesh: Mesh):
    """NamedShardings for every array of `tree` (None for its non-array leaves)."""
    return jax.tree.map(lambda ax, leaf: NamedSharding(mesh, spec(ax, leaf.shape, mesh)) if ax is not None else None,
                        logical_axes(tree), tree, is_leaf=lambda x: x is None or isinstance(x, tuple))


def check_rules(tree, mesh: Mesh) -> list[str]:
    """Every array has names of matching rank, each known to RULES; warns of big replicated arrays."""
    problems, replicated = [], []
    arrays = eqx.filter(tree, is_array)
    names = jax.tree.leaves(logical_axes(arrays), is_leaf=lambda x: isinstance(x, tuple))
    for (path, leaf), ax in zip(jax.tree_util.tree_leaves_with_path(arrays), names, strict=True):
        name = jax.tree_util.keystr(path)
        if len(ax) != leaf.ndim:
            problems.append(f"{name}: {len(ax)} logical axes {ax} for a rank-{leaf.ndim} array")
        elif unknown := [a for a in ax if a is not None and a not in RULES]:
            problems.append(f"{name}: logical axes {unknown} have no rule in shard.RULES")
        elif all(s is None for s in spec(ax, leaf.shape, mesh)) and leaf.size * leaf.dtype.itemsize > 2**20 and mesh.size > 1:
            replicated.append(name)
    if problems:
        raise ValueError("sharding rules do not cover the model:\n  " + "\n  ".join(problems))
    if replicated:
        warnings.warn(f"parameters over 1 MB left fully replicated on mesh {dict(mesh.shape)}: {replicated}")
    return replicated


# ---------------------------------------------------------------------------------------------------------
# The batch, and the multi-host start.


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(RULES["batch"], None))


def put_batch(local_rows: np.ndarray, mesh: Mesh, global_rows: int):
    """This process's rows of the global batch -> one global array sharded over (data, fsdp)."""
    sharding = batch_sharding(mesh)
    return jax.make_array_from_process_local_data(sharding, local_rows.astype(np.int32),
                                                  (global_rows, local_rows.shape[1]))


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Start JAX's multi-host runtime when there are several hosts.

    TPU VMs and the cloud GPU clusters JAX knows (SLURM, Kubernetes, ...) are detected by
    jax.distributed.initialize() itself; elsewhere pass --coordinator host:port --num_processes N
    --process_id i on every host.
    """
    if coordinator or num_processes:
        if not (coordinator and num_processes > 0 and 0 <= process_id < num_processes):
            raise ValueError(f"--coordinator, --num_processes and --process_id go together; got "
                             f"{coordinator!r}, {num_processes}, {process_id}")
        jax.distributed.initialize(coordinator, num_processes, process_id)
    elif os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") or "SLURM_JOB_ID" in os.environ \
            or "OMPI_COMM_WORLD_SIZE" in os.environ or "JAX_COORDINATOR_ADDRESS" in os.environ:
        jax.distributed.initialize()
