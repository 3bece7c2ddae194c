"""The state of a layout put back together on a new process group by the ranks that hold it: the
survivors of a group that lost ranks (an elastic shrink), joined by new workers that hold nothing
yet (an elastic grow).

Each holder still has its pieces of the old layout: whole tensors under a replicated layout
(data), its slice under tensor-parallel or sharded ones. The old group may be gone, so the old
mesh's collectives cannot gather them. `Survivors.full(t)` rebuilds the full value of `t` on every
rank of the new group instead: a tensor whole on every holder moves only where a newcomer needs
it (one broadcast from new rank 0); a DTensor piece is broadcast by the first rank that holds it.
Every rank knows where every holder sat in the old mesh (`old_ranks`), so nothing but the pieces
is sent. A newcomer walks the same tensors as `Absent` stand-ins made from the old layout's
description (`describe`, on a holder): shape, dtype, placements and mesh, no storage.

Called tensor by tensor in the same order on every rank (strategies/relayout.py walks the state
so), it holds one full tensor at a time, like a switch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


class PiecesLost(RuntimeError):
    """Some piece of a tensor was held by no rank of the new group."""


@dataclass
class _Mesh:
    """What a newcomer knows of the old mesh: its ranks by coordinate and its dims' names (and
    the root mesh's, for a layout's sub-mesh)."""

    mesh: torch.Tensor
    mesh_dim_names: tuple | None
    root: "_Mesh | None" = None

    def _get_root_mesh(self):
        return self.root or self


@dataclass
class Absent:
    """A tensor of the old layout that this rank never held (a newcomer): what it was, no data."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device
    placements: tuple | None = None  # None: whole on every holder
    device_mesh: _Mesh | None = None

    def detach(self) -> "Absent":
        return self


def describe(t: torch.Tensor) -> dict:
    """What a newcomer needs to know of a holder's tensor `t` (plain data, for Ray)."""
    from gearshift.strategies.state import _is_dtensor

    out = {"shape": tuple(t.shape), "dtype": t.dtype}
    if _is_dtensor(t):
        mesh = t.device_mesh
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
        out.update(placements=tuple(t.placements), mesh=mesh.mesh.tolist(), names=mesh.mesh_dim_names,
                   root=root.mesh.tolist(), root_names=root.mesh_dim_names)
    return out


def absent(d: dict, device: torch.device) -> Absent:
    """The stand-in for a tensor `describe` described."""
    mesh = None
    if d.get("placements") is not None:
        root = None if (d["root"], d["root_names"]) == (d["mesh"], d["names"]) else \
            _Mesh(torch.tensor(d["root"]), d["root_names"])
        mesh = _Mesh(torch.tensor(d["mesh"]), d["names"], root)
    return Absent(tuple(d["shape"]), d["dtype"], device, d.get("placements"), mesh)


class Survivors:
    """`old_ranks[i]`: the rank in the old group of rank i of the new one, None for a newcomer."""

    def __init__(self, old_ranks: Sequence[int | None]):
        self.old_ranks = list(old_ranks)
        self.newcomers = any(r is None for r in self.old_ranks)

    def full(self, t) -> torch.Tensor:
        from gearshift.strategies.state import _is_dtensor

        if isinstance(t, Absent) and t.placements is None or not isinstance(t, Absent) and not _is_dtensor(t):
            return self._whole(t)
        return self._assemble(t)

    def _whole(self, t) -> torch.Tensor:
        """Whole on every holder (they stopped at the same step): sent only where a newcomer is."""
        if not self.newcomers:
            return t
        if isinstance(t, Absent):
            t = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        elif not t.is_contiguous():
            t = t.contiguous()
        dist.broadcast(t, src=0)  # new rank 0 holds it: holders are ranked first
        return t

    def _assemble(self, t) -> torch.Tensor:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        if not all(type(p) in (Shard, Replicate) for p in t.placements):
            raise PiecesLost(f"a tensor laid out as {t.placements} cannot be put back together from its pieces")
        mesh = t.device_mesh
        pieces: dict[tuple, int] = {}  # (offset, shape) -> the first new rank holding it
        for new_rank, old_rank in enumerate(self.old_ranks):
            if old_rank is None:
                continue
            coordinate = _coordinate(mesh, old_rank)
            shape, offset = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(mesh.mesh.shape), coordinate,
                                                                   t.placements)
            pieces.setdefault((tuple(offset), tuple(shape)), new_rank)
        local = None if isinstance(t, Absent) else t.to_local()
        device = t.device if isinstance(t, Absent) else local.device
        value = torch.empty(tuple(t.shape), dtype=t.dtype, device=device)
        covered = 0
        me = dist.get_rank()
        for (offset, shape), holder in sorted(pieces.items()):
            if 0 in shape:
                continue
            buf = local.detach().contiguous() if holder == me else torch.empty(shape, dtype=t.dtype, device=device)
            dist.broadcast(buf, src=holder)
            value[tuple(slice(o, o + s) for o, s in zip(offset, shape))].copy_(buf)
            covered += buf.numel()
        if covered != value.numel():
            raise PiecesLost(f"the ranks left hold {covered} of the {value.numel()} values of a {list(t.shape)} "
                             "tensor")
        return value


def _coordinate(mesh, old_rank: int) -> list[int]:
    """Where `old_rank` sits in `mesh`, or in the same place of its sibling: a layout's sub-mesh
    (hybrid's "tp") holds only this rank's group, and another group's rank sits at the same
    coordinate of its own one. The root mesh (every old rank, named dims) says which."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    where = (root.mesh == old_rank).nonzero()
    if where.numel() == 0:
        raise PiecesLost(f"old rank {old_rank} is not in the layout's mesh")
    at = where[0].tolist()
    if root is mesh:
        return at
    names, sub = list(root.mesh_dim_names or ()), list(mesh.mesh_dim_names or ())
    if not sub or any(n not in names for n in sub):
        raise PiecesLost(f"a sub-mesh {sub} of {names} cannot be placed")
    return [at[names.index(n)] for n in sub]
