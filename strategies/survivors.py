"""The state of a layout whose process group lost ranks, put back together by the ranks that are
left, on the new group they formed (an elastic shrink).

Each survivor still holds its pieces of the old layout: whole tensors under a replicated layout
(data), its slice under tensor-parallel or sharded ones. Their old group is gone, so the old
mesh's collectives cannot gather them. `Survivors.full(t)` rebuilds the full value of `t` on every
survivor instead: where `t` is whole everywhere nothing moves; where it is a DTensor piece, each
distinct piece is broadcast on the new group by the first survivor that holds it. Every survivor
knows where every other one sat in the old mesh (`old_ranks`), so nothing but the pieces is sent.

Called tensor by tensor in the same order on every survivor (strategies/relayout.py walks the
state so), it holds one full tensor at a time, like a switch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist


class PiecesLost(RuntimeError):
    """Some piece of a tensor was held by no survivor."""


class Survivors:
    """`old_ranks[i]`: the rank in the old group of the survivor that is rank i of the new one."""

    def __init__(self, old_ranks: Sequence[int]):
        self.old_ranks = list(old_ranks)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        from gearshift.strategies.state import _is_dtensor

        if not _is_dtensor(t):
            return t  # whole on every survivor already (they stopped at the same step)
        return self._assemble(t)

    def _assemble(self, t) -> torch.Tensor:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

        if not all(isinstance(p, (Shard, Replicate)) and type(p) in (Shard, Replicate) for p in t.placements):
            raise PiecesLost(f"a tensor laid out as {t.placements} cannot be put back together from its pieces")
        mesh = t.device_mesh
        local = t.to_local()
        pieces: dict[tuple, tuple[int, tuple]] = {}  # (offset, shape) -> (first new rank holding it, shape)
        for new_rank, old_rank in enumerate(self.old_ranks):
            coordinate = _coordinate(mesh, old_rank)
            shape, offset = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(mesh.mesh.shape), coordinate,
                                                                   t.placements)
            pieces.setdefault((tuple(offset), tuple(shape)), (new_rank, tuple(shape)))
        value = torch.empty(tuple(t.shape), dtype=local.dtype, device=local.device)
        covered = 0
        me = dist.get_rank()
        for (offset, shape), (holder, _) in sorted(pieces.items()):
            if 0 in shape:
                continue
            buf = local.detach().contiguous() if holder == me else torch.empty(shape, dtype=local.dtype,
                                                                                device=local.device)
            dist.broadcast(buf, src=holder)
            value[tuple(slice(o, o + s) for o, s in zip(offset, shape))].copy_(buf)
            covered += buf.numel()
        if covered != value.numel():
            raise PiecesLost(f"the survivors hold {covered} of the {value.numel()} values of a {list(t.shape)} "
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
