"""Gradient work that must know about shards: the global norm for clipping, and averaging
gradients over the data-parallel replicas of a tensor-parallel model (hybrid)."""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, tp_group=None, timer=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm) for a model whose parameters may be tensor-parallel
    shards: a shard's squares are summed over its tp group, a replicated gradient counts once.
    `timer(nbytes)`, if given, is a context manager wrapped around the all-reduce (comm timing)."""
    params = list(params)
    total = grad_norm(params, tp_group, timer)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in (p.grad for p in params if p.grad is not None):
        _local(g).mul_(coef.to(_local(g).dtype))
    return total


def grad_norm(params: Iterable[torch.Tensor], tp_group=None, timer=None) -> torch.Tensor:
    """The gradients' global 2-norm, the same on every rank of a tp group (see clip_grad_norm)."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    # every rank reaches the all-reduce below, even one without gradients, or the others would wait
    device = _local(grads[0]).device if grads else _local(params[0]).device if params else torch.device("cpu")
    sharded = torch.zeros((), device=device, dtype=torch.float32)
    replicated = torch.zeros((), device=device, dtype=torch.float32)
    for g in grads:
        sq = _local(g).float().pow(2).sum()
        if isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements):
            sharded += sq
        else:
            replicated += sq
    if tp_group is not None:
        with timer(sharded.element_size()) if timer is not None else contextlib.nullcontext():
            dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


class GradAverager:
    """Average gradients over the data-parallel group after backward, in buckets of at most
    `bucket_cap_mb` (one all-reduce per bucket). Used where DDP cannot wrap the model: its
    tensor-parallel parameters are DTensors. Runs after backward, so it does not overlap."""

    def __init__(self, params: list[torch.nn.Parameter], group, bucket_cap_mb: float):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.size = dist.get_world_size(group)
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.timer = None  # timer(nbytes): a context manager around each all-reduce (comm timing), or None

    def __call__(self) -> None:
        if self.size == 1:
            return
        bucket, used = [], 0
        for p in reversed(self.params):  # the order backward produced them: last layers first
            if p.grad is None:
                continue
            g = _local(p.grad)
            bucket.append(g)
            used += g.numel() * g.element_size()
            if used >= self.cap_bytes:
                self._reduce(bucket)
                bucket, used = [], 0
        if bucket:
            self._reduce(bucket)

    def _reduce(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        with self.timer(flat.numel() * flat.element_size()) if self.timer is not None else contextlib.nullcontext():
            dist.all_reduce(flat, group=self.group)  # gloo has no AVG: sum, then divide
        flat.div_(self.size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def sharded_grad_scaler(device_type: str, enabled: bool, group=None):
    """fp16 loss scaling for a model with tensor-parallel shards: each rank unscales its local
    gradients and all ranks agree whether any overflowed, so they skip or take a step together."""
    from collections import defaultdict

    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler, _GeneralMultiDeviceReplicator

    class _Scaler(ShardedGradScaler):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
            inv = _GeneralMultiDeviceReplicator(inv_scale)
            inf = _GeneralMultiDeviceReplicator(found_inf)
            grouped = defaultdict(lambda: defaultdict(list))
            with torch.no_grad():
                for group_ in optimizer.param_groups:
                    for p in group_["params"]:
                        if p.grad is not None:
                            g = _local(p.grad)  # a shard's local piece; the base class sees DTensors
                            grouped[g.device][g.dtype].append(g)
                for device, per_dtype in grouped.items():
                    for grads in per_dtype.values():
                        torch._amp_foreach_non_finite_check_and_unscale_(grads, inf.get(device), inv.get(device))
            return inf._per_device_tensors

    return _Scaler(device_type, enabled=enabled, process_group=group or dist.group.WORLD)


def _shard_dims(t: DTensor) -> tuple[int, ...]:
    """The mesh dimensions over which `t` is split (FSDP2's strided shard on top of a tp shard
    is not a Shard subclass, so it is named separately)."""
    return tuple(i for i, pl in enumerate(t.placements) if isinstance(pl, (Shard, _StridedShard)))


def mesh_grad_norm(params: Iterable[torch.Tensor], timer=None) -> torch.Tensor:
    """The global 2-norm of gradients that are DTensors on any meshes (fsdp, hsdp, fsdp x tp),
    or plain tensors: squares are summed locally per (mesh, sharded dimensions) and all-reduced
    over exactly those dimensions, so a piece held by several replicas counts once. The result
    is the same on every rank. `timer(nbytes, dim_name)`: a context around each all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    device = _local(grads[0]).device if grads else torch.device("cpu")
    sums: dict[tuple, list] = {}
    for g in grads:
        key, mesh = ((), None)
        if isinstance(g, DTensor) and _shard_dims(g):
            key, mesh = (g.device_mesh.mesh_dim_names or (), _shard_dims(g)), g.device_mesh
        entry = sums.setdefault(key, [mesh, torch.zeros((), device=device, dtype=torch.float32)])
        entry[1] += _local(g).float().pow(2).sum()
    total = torch.zeros((), device=device, dtype=torch.float32)
    # every rank holds the same keys (same model, same layout): sorted, the all-reduces line up
    for key in sorted(sums, key=repr):
        mesh, sq = sums[key]
        for dim in key[1] if key else ():
            name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else str(dim)
            with timer(sq.element_size(), name) if timer is not None else contextlib.nullcontext():
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    return total.sqrt()


def mesh_clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, timer=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm, same coefficient) over `mesh_grad_norm`."""
    params = list(params)
    total = mesh_grad_norm(params, timer)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in (p.grad for p in params if p.grad is not None):
        _local(g).mul_(coef.to(_local(g).dtype))
    return total
