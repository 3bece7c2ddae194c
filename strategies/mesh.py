"""Device meshes, one per shape, made once per process group and reused by every switch.

`init_device_mesh` makes new communicators on every call, and torch keeps each of them until
the process group is destroyed: a run that switched between layouts a hundred times would hold
a hundred sets. So `device_mesh` keeps the mesh of each (device type, shape, dim names) and
hands the same one out again, for as long as the default process group that it was made on is
alive; a new default group (a rejoin after an OOM) gets meshes of its own, and `forget` drops
them when the group is left.

Every group made here carries the default group's timeout (`fault.collective_timeout_s`, which
the worker passes to `init_process_group`), where torch would give the sub-groups its own
default (30 min for gloo, 10 for NCCL).
"""

from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist

# (device type, shape, dim names) -> (mesh, the default group it was made on, its groups), the
# groups held weakly: the cache must not keep a destroyed group's connections open
_MESHES: dict[tuple, tuple] = {}
# how groups are made: the worker wraps it to note the connections they open, so that leaving
# (workers/group/rendezvous.py) reaches the sub-groups' peers too
MAKE_GROUPS = [lambda make: make()]


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """The mesh of `shape` over the default process group, made on the first call for this
    shape (a collective: every rank calls it at the same point) and reused after that."""
    key = (device_type, tuple(int(s) for s in shape), tuple(names))
    world = dist.distributed_c10d._get_default_group()
    if any(not _alive(world, made_on, groups) for _, made_on, groups in _MESHES.values()):
        forget()  # made on a group that is gone: their names may now resolve to new groups
    if key not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        made = []
        MAKE_GROUPS[0](lambda: made.append(init_device_mesh(
            device_type, key[1], mesh_dim_names=key[2],
            backend_override=_with_timeout(key[1], group_timeout(world)) or None)))
        mesh = made[0]
        _MESHES[key] = (mesh, weakref.ref(world), tuple(weakref.ref(g) for g in mesh.get_all_groups()))
    return _MESHES[key][0]


def forget() -> None:
    """Drop every cached mesh: the default group is being left or destroyed. DTensor's own caches
    go too: it caches each op's sharding by the meshes' values (shape, ranks, names), not their
    groups, so a mesh of the same shape on a new default group would be handed results that hold
    the old mesh, whose groups are gone ("Could not resolve the process group registered under the
    name ...", seen in a process that made a second default group of the same size).

    Each cached mesh also lets go of its groups: a mesh holds them (its `_pg_registry`, the
    root's for its sub-meshes) for as long as anything holds the mesh, and DTensor's caches hold
    meshes where this process cannot clear them all (another thread's sharding cache, the native
    one). Left there, every layout with a mesh kept its gloo groups, their threads and
    connections, for the process's life: 2 threads more per tensor-parallel run in one
    process. A caller that still needs the groups (`rendezvous.leave` holds them until their
    collectives have timed out) holds them through the default group's list, not the mesh."""
    for mesh, _, _ in _MESHES.values():
        _release_groups(mesh)
    _MESHES.clear()
    _forget_dtensor_caches()


def _release_groups(mesh) -> None:
    """Drop `mesh`'s references to its process groups (torch keeps them in `_pg_registry`)."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


def _forget_dtensor_caches() -> None:
    """DTensor's sharding-propagation caches (the native one, this thread's Python one) and its
    redistribute planners; each where this torch has it."""
    import sys

    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing of DTensor's has run in this process
    from torch.distributed.tensor import DTensor

    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    cache = getattr(propagator, "propagate_op_sharding", None)
    if hasattr(cache, "cache_clear"):
        cache.cache_clear()
    meta = getattr(type(propagator), "_propagate_tensor_meta_cached", None)
    if hasattr(meta, "cache_clear"):
        meta.cache_clear()
    from torch.distributed.tensor import _collective_utils, _redistribute

    if hasattr(_redistribute, "clear_redistribute_planner_cache"):
        _redistribute.clear_redistribute_planner_cache()
    transforms = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()
    topology = getattr(getattr(_collective_utils, "MeshTopoInfo", None), "build_from_mesh", None)
    if hasattr(topology, "cache_clear"):
        topology.cache_clear()


def cached() -> int:
    """How many meshes are cached (for tests)."""
    return len(_MESHES)


def group_timeout(group=None) -> datetime.timedelta:
    """The timeout `group` (default: the default group) was made with, as its backend holds it."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    device = group._device_types[0] if group._device_types else torch.device("cpu")
    return group._get_backend(device).options._timeout


def _alive(world, made_on, groups) -> bool:
    # identity, not names: after a destroy torch numbers groups from "0" again
    live = dist.distributed_c10d._world.pg_map
    return made_on() is world and all(g() is not None and g() in live for g in groups)


def _with_timeout(shape: tuple[int, ...], timeout: datetime.timedelta) -> dict:
    """backend_override for the dims that make new groups, carrying `timeout`. A dim spanning
    every rank is left without one: torch then reuses the default group, which has the timeout
    already (an override there would make a second world-sized communicator), except where a
    gloo default group on a host with CUDA makes torch build a new one anyway."""
    world = dist.get_world_size()
    reuses_default = not (torch.cuda.is_available() and dist.get_backend() == "gloo")
    return {dim: _options(timeout) for dim, size in enumerate(shape) if size != world or not reuses_default}


def _options(timeout: datetime.timedelta):
    # DeviceMesh passes an override's options._timeout on to new_group / split_group
    if dist.get_backend() == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False  # torch's own default for groups made without options
    else:
        options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options
