"""Data parallelism: every rank holds the whole model; gradients are all-reduced in buckets.

DDP starts each bucket's all-reduce as soon as the bucket's gradients are ready, overlapping
communication with the rest of backward; `bucket_cap_mb` sets that granularity (small buckets
start early but pay more per-message latency, large ones overlap less).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gearshift.strategies.base import Options, Parallel
from gearshift.strategies.layout import Layout


def allreduce_hook(process_group, bucket):
    """DDP's own default all-reduce as a comm hook (scale by 1/world, then sum; multiplying by
    the reciprocal as DDP does, so the result is bit for bit the same), for wrappers to time
    or delay."""
    group = process_group or dist.group.WORLD
    tensor = bucket.buffer()
    tensor.mul_(1.0 / dist.get_world_size(group))
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


class _Router:
    """DDP's comm hook state: the hook in force and DDP's group. DDP's reducer (C++) holds its comm
    hook and the hook's state for the DDP's life, out of reach of Python's cycle collector, so
    neither may lead back to the DDP: a bound method of the layout did, and every layout torn
    down (a switch, a regroup, a run's end) kept its DDP, gradient buckets and process group
    (with gloo's threads) alive for the rest of the process."""

    __slots__ = ("group", "route")

    def __init__(self, group):
        self.group = group
        self.route = None  # the attached route's hook, or None (the plain all-reduce)


def _routed(router: _Router, bucket):
    return (router.route or allreduce_hook)(router.group, bucket)


class DataParallel(Parallel):
    grads_in_kept_storage = True  # gradient_as_bucket_view: views of DDP's buckets
    _router = None  # DDP's comm hook state, once registered (DDP takes one hook for its life)

    def no_sync(self):
        return self.module.no_sync()  # the all-reduce waits for the step's last micro-batch

    def attach(self, comm) -> None:
        """Route the gradient all-reduce through `comm`. DDP takes one comm hook for its life, and
        the same layout is attached again where a switch away from it was aborted (its new
        layout could not be allocated): the hook registered first dispatches to the route in
        force, so attaching again only swaps the route. Without a route ever attached, DDP's
        built-in all-reduce runs, no hook at all."""
        super().attach(comm)
        route = comm.ddp_hook(allreduce_hook) if comm is not None else None
        if route is not None and self._router is None:
            self._router = _Router(self.module.process_group)
            self.module.register_comm_hook(self._router, _routed)
        if self._router is not None:
            self._router.route = route


def apply(model: nn.Module, mesh, layout: Layout, plan, options: Options) -> DataParallel:
    """Wrap `model` (already on the device) for data parallelism over the default process group.

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal.
    """
    device = options.device
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step
    ddp = DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=options.bucket_cap_mb,
                                  gradient_as_bucket_view=True)
    return DataParallel(ddp, model, layout, options)
