"""Sharding: the mesh, logical-axis rules, parameter and batch shardings, and the multi-host start.

olmo3.py names every dimension in its jaxtyping annotations (embed, heads, mlp, ...). Here one table maps
those logical names onto three mesh axes, as MaxText and jax-llm-examples do:
    data    pure data parallelism: parameters replicated, the batch split
    fsdp    data parallelism with parameters and optimizer state split too (ZeRO-3)
    tensor  Megatron-style tensor parallelism: heads and the MLP's hidden units split
Sharding never changes the maths, only where it runs: tests/test_shard.py checks every layout against the
single-device run.
"""

import math
import os
import typing
import warnings

import equinox as eqx
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")

# Logical axis -> mesh axes (None: replicated). Parameters shard `embed` over fsdp (FSDP), and heads,
# kv_heads, mlp and vocab over tensor (Megatron: column-parallel in, row-parallel out). The batch spans data
# and fsdp.
# One table for every weight keeps each pair of matrices consistent: the layout on which XLA miscompiles
# (shared/docs/ecosystem.md section 2: both MLP matrices split dim 0 over fsdp and dim 1 over tensor, so the
# hidden axis is on fsdp in one and on tensor in the other) cannot be written with it.
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
    "window": None,  # train.OptState's ring buffers of recent losses and grad norms
}


def parse_mesh(spec: str, n_devices: int) -> dict[str, int]:
    """`data=2,fsdp=4,tensor=1` -> axis sizes; one size may be -1 ("the rest"); unnamed axes are 1."""
    sizes, named = dict.fromkeys(MESH_AXES, 1), set()
    for part in filter(None, spec.replace(" ", "").split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or name in named or not (value.isdigit() and int(value) > 0 or value == "-1"):
            raise ValueError(f"--mesh {spec!r}: expected entries like data=2,fsdp=-1,tensor=1, each of "
                             f"{', '.join(MESH_AXES)} at most once, sizes >= 1 or -1 (the rest); "
                             f"got {part!r}")
        sizes[name] = int(value)
        named.add(name)
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"--mesh {spec!r}: at most one axis may be -1, got {rest}")
    known = math.prod(s for s in sizes.values() if s != -1)
    if rest:
        if n_devices % known:
            raise ValueError(f"--mesh {spec!r}: {n_devices} devices do not divide by the other axes "
                             f"({known})")
        sizes[rest[0]] = n_devices // known
    if math.prod(sizes.values()) > n_devices:
        raise ValueError(f"--mesh {spec!r} needs {math.prod(sizes.values())} devices but there are "
                         f"{n_devices}")
    return sizes


def device_grid(sizes: dict[str, int], devices) -> np.ndarray:
    """The devices as a (data, fsdp, tensor) array, in the order JAX's mesh utilities choose: along the
    chips' torus on TPUs; by id on GPUs, which JAX numbers host after host, so that the inner axes (tensor,
    then fsdp) stay within a host wherever they fit.

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
    dcn = tuple(slices if i == axis else 1 for i in range(3))
    ici = tuple(s // d for s, d in zip(shape, dcn))
    return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, allow_split_physical_axes=True)


def make_mesh(spec: str, devices=None) -> Mesh:
    """The (data, fsdp, tensor) mesh that --mesh describes, over all devices of all processes.

    On one process a mesh may use fewer devices than there are (e.g. the tiny preset's data=1 on a machine
    with several): it takes the first ones.
    """
    devices = devices if devices is not None else jax.devices()
    sizes = parse_mesh(spec, len(devices))
    if math.prod(sizes.values()) < len(devices):
        if jax.process_count() > 1:
            raise ValueError(f"--mesh {spec!r} uses {math.prod(sizes.values())} of {len(devices)} devices; "
                             "with several processes the mesh must span them all (one axis -1 fills it)")
        devices = devices[: math.prod(sizes.values())]
    # Auto axes: the compiler propagates shardings from the inputs and from gather()'s constraints. Stated,
    # since jax.make_mesh now defaults to Explicit.
    return Mesh(device_grid(sizes, devices), MESH_AXES, axis_types=(AxisType.Auto,) * 3)


# ---------------------------------------------------------------------------------------------------------
# Parameters: logical names from olmo3.py's annotations, then the rules.


def is_array(x) -> bool:
    """An array or an abstract one (from eval_shape)."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


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
        mesh_axes = tuple(a for a in RULES.get(name) or ()
                          if mesh.shape[a] > 1 and not (gathered and a == "fsdp"))
        if twice := sorted(used & set(mesh_axes)):
            raise ValueError(f"mesh axes {twice} appear twice in the spec for logical axes {axes}; "
                             "fix shard.RULES")
        if not mesh_axes or size % math.prod(mesh.shape[a] for a in mesh_axes):
            out.append(None)
            continue
        used |= set(mesh_axes)
        out.append(mesh_axes[0] if len(mesh_axes) == 1 else mesh_axes)
    return P(*out)


def _is_axes(x) -> bool:
    return x is None or isinstance(x, tuple)


def shardings(tree, mesh: Mesh):
    """NamedShardings for every array of `tree` (None for its non-array leaves)."""
    return jax.tree.map(lambda ax, x: None if ax is None else NamedSharding(mesh, spec(ax, x.shape, mesh)),
                        logical_axes(tree), tree, is_leaf=_is_axes)


def gather(tree, mesh: Mesh):
    """`tree`'s weights where a layer uses them: all-gathered over fsdp, still split over tensor.

    Explicit, because left to itself XLA may settle the clash between a weight's embed axis and the
    activations' batch axis, both split over fsdp, by gathering the batch instead: every device then
    computes the whole batch (tests/test_shard.py checks the FLOPs per device). Arrays of the layer stack
    are left as they are: olmo3's layer scan gathers each layer as it runs it, so a device holds one layer
    whole at a time, as FSDP intends.
    """
    def place(ax, x):
        if ax is None or ax[:1] == ("layers",):
            return x
        where = NamedSharding(mesh, spec(ax, x.shape, mesh, gathered=True))
        return jax.lax.with_sharding_constraint(x, where)

    return jax.tree.map(place, logical_axes(tree), tree, is_leaf=_is_axes)


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
        warnings.warn(f"arrays over 1 MB left fully replicated on mesh {dict(mesh.shape)}: {replicated}")
    return replicated


# ---------------------------------------------------------------------------------------------------------
# The batch, and the multi-host start.


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(RULES["batch"], None))


def put_batch(local_rows: np.ndarray, mesh: Mesh, global_rows: int):
    """This process's rows of the global batch -> one global array sharded over (data, fsdp).

    With several processes each one's rows (data.py's strided share) land on its own devices, so the array
    holds the global batch's rows in another order; every row is an independent example and the loss a
    mean, so only the order of the sums differs (tests/test_shard.py checks the losses against one process).
    """
    sharding = batch_sharding(mesh)
    return jax.make_array_from_process_local_data(sharding, local_rows.astype(np.int32),
                                                  (global_rows, local_rows.shape[1]))


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


def initialize(coordinator: str = "", num_processes: int = 0, process_id: int = -1) -> None:
    """Start JAX's multi-host runtime when there are several hosts; must run before anything touches a device.

    The environments cluster() names are detected; elsewhere pass --coordinator host:port --num_processes N
    --process_id i on every host (the same command, each with its own i). Cross-process collectives on the
    CPU use gloo, JAX's default. Only this runtime may handle SIGTERM afterwards (train.py installs no
    handler then), so that every process learns of a preemption at the same step.
    """
    if coordinator or num_processes or process_id != -1:
        if not (num_processes > 0 and 0 <= process_id < num_processes
                and (coordinator or "JAX_COORDINATOR_ADDRESS" in os.environ)):
            raise ValueError("--coordinator host:port, --num_processes N and --process_id 0..N-1 go "
                             f"together; got --coordinator {coordinator!r} --num_processes {num_processes} "
                             f"--process_id {process_id}")
        jax.distributed.initialize(coordinator or None, num_processes, process_id)
    elif cluster():
        jax.distributed.initialize()
