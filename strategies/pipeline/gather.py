"""A pipeline's whole state streamed to rank 0 one tensor at a time (the full checkpoint format).

Each position of the pipeline holds other parameters: its owner (the rank of that position in
the first replica and, under tensor parallelism, the first of its tp group) says what it holds,
names, dtypes and shapes only, and every rank learns every owner's structure (one small
all-gather of objects). From them every rank derives the same plan: the whole state's structure
(each position's keys after the one before's, as the pickled gather merged them; a parameter two
positions hold, a tied head, taken from the first) and for each tensor the owner that sends it. Then, tensor by tensor in that order, the ranks of the owner's position gather it
whole (`full`: a collective over the stage's tensor-parallel or sharding group where it is split,
nothing where it is not) and the owner sends it to rank 0, which writes it before the next one
comes. Rank 0 holds one received tensor at a time beside its own stage; the other ranks, one
gathered tensor. Before, every owner's part was pickled to rank 0 at once (`gather_object`):
world x the largest part on one rank, staged in the device's memory under NCCL.

Point-to-point sends on the default group, on the layout's device (NCCL sends device tensors
only). What this rests on: gloo on CPU; it has not run on NCCL.
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import torch
import torch.distributed as dist

from gearshift.strategies.state import full


class TensorSpec(NamedTuple):
    dtype: torch.dtype
    shape: tuple[int, ...]


def spec_of(tree) -> Any:
    """`tree` with each tensor replaced by its whole dtype and shape (a DTensor's global shape)."""
    if isinstance(tree, dict):
        return {k: spec_of(v) for k, v in tree.items()}
    if torch.is_tensor(tree):
        return TensorSpec(tree.dtype, tuple(tree.shape))
    return tree


def merged(specs: dict[int, Any]) -> tuple[dict, list[tuple[int, tuple]]]:
    """The whole structure from the owners' (rank -> structure, in rank order), and the plan:
    (owner, path) for each tensor in the structure's order. A tensor several owners hold is the
    first's; any other value, the last's (the optimizer's settings, the same on every stage)."""
    out: dict = {}
    owners: dict[tuple, int] = {}

    def into(dst: dict, src: dict, owner: int, path: tuple) -> None:
        for k, v in src.items():
            at = (*path, k)
            if isinstance(v, dict):
                into(dst.setdefault(k, {}), v, owner, at)
            elif isinstance(v, TensorSpec):
                if at not in owners:
                    owners[at] = owner
                    dst[k] = v
            else:
                dst[k] = v

    for owner, spec in specs.items():
        into(out, spec, owner, ())
    plan: list[tuple[int, tuple]] = []

    def walk(tree: dict, path: tuple) -> None:
        for k, v in tree.items():
            if isinstance(v, dict):
                walk(v, (*path, k))
            elif isinstance(v, TensorSpec):
                plan.append((owners[(*path, k)], (*path, k)))

    walk(out, ())
    return out, plan


def _leaf(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _as_meta(spec) -> Any:
    """The structure with each tensor as a tensor on the meta device: its dtype and shape, no memory."""
    if isinstance(spec, dict):
        return {k: _as_meta(v) for k, v in spec.items()}
    if isinstance(spec, TensorSpec):
        return torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    return spec


class StreamedGather:
    """One gather of a pipeline's whole state (see the module's text). `mine`: this rank's part
    as it holds it (strategies/state.state_tensors); `owner_of(rank)`: the owner rank of that
    rank's position; `device`: the layout's."""

    def __init__(self, mine: dict, rank: int, world: int, owner_of, device: torch.device):
        self.mine, self.rank, self.device = mine, rank, device
        self.owner = owner_of(rank)
        owners = sorted({owner_of(r) for r in range(world)})
        said: list = [None] * world
        dist.all_gather_object(said, spec_of(mine) if rank == self.owner else None)
        self.structure, self.plan = merged({r: said[r] for r in owners})

    def tree(self) -> dict:
        """The whole structure, each tensor on the meta device (what the file's layout needs)."""
        return _as_meta(self.structure)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Rank 0: each whole tensor on the CPU in the plan's order, one at a time. Every other
        rank drives its part by exhausting it (it yields nothing there)."""
        for owner, path in self.plan:
            if owner != self.owner and self.rank != 0:
                continue  # another position's tensor: its ranks and rank 0 exchange it
            if owner == self.owner:  # this rank's position holds it: gathered whole on the stage
                whole = full(_leaf(self.mine, path).detach())
                if self.rank == 0:
                    yield whole.cpu()
                elif self.rank == owner:
                    dist.send(whole.to(self.device).contiguous(), 0)
                continue
            spec = _leaf(self.structure, path)
            got = torch.empty(spec.shape, dtype=spec.dtype, device=self.device)
            dist.recv(got, owner)
            yield got.cpu()
