"""Hybrid (2-D) parallelism on a (dp, tp) mesh: tensor-parallel shards inside a tp group (the
workers of one node, on the fast link), data-parallel replicas of that group across nodes, or
(parallel.dp_shard) the data dimension fully sharded with FSDP2 (strategies/fsdp.py)."""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from gearshift.strategies import fsdp, tensor
from gearshift.strategies.base import Options, Parallel
from gearshift.strategies.grads import GradAverager, OverlappedAverager
from gearshift.strategies.layout import Layout


class HybridParallel(tensor.TensorParallel):
    def __init__(self, model: nn.Module, layout: Layout, options: Options, mesh: DeviceMesh):
        super().__init__(model, model, layout, options, mesh)
        # DDP cannot wrap a model of DTensors: the data-parallel average is ours, launched bucket
        # by bucket as backward produces the gradients (or, parallel.dp_overlap false, after it)
        group = mesh["dp"].get_group()
        if options.dp_overlap:
            self.averager = OverlappedAverager(model, group, options.bucket_cap_mb)
        else:
            self.averager = GradAverager(list(model.parameters()), group, options.bucket_cap_mb)
            self.averager.timer = lambda nbytes: self.blocked(nbytes, "dp")

    @contextlib.contextmanager
    def no_sync(self):
        self.averager.syncing(False)
        try:
            yield
        finally:
            self.averager.syncing(True)

    def after_backward(self) -> None:
        self.averager()

    def attach(self, comm) -> None:
        super().attach(comm)
        self.averager.route = comm

    def detach(self) -> None:
        super().detach()
        self.averager.close()


def apply(model: nn.Module, mesh: DeviceMesh, layout: Layout, plan: dict[str, str],
          options: Options) -> Parallel:
    """Shard over mesh["tp"]; gradients are averaged over mesh["dp"] after backward, or, with
    the data dimension sharded (layout.shard == dp > 1, parallel.dp_shard), parameters,
    gradients and optimizer state are fully sharded over mesh["dp"] by FSDP2."""
    if layout.shard > 1:
        return fsdp.apply_2d(model, mesh, layout, plan, options)
    tensor.shard(model, mesh["tp"], plan)
    return HybridParallel(model, layout, options, mesh)
