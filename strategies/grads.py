"""Gradient work that must know about shards: the global norm for clipping, and averaging
gradients over the data-parallel replicas of a tensor-parallel model (hybrid)."""

from __future__ import annotations

import contextlib
import time
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
    is_shard = [isinstance(g, DTensor) and any(isinstance(pl, Shard) for pl in g.placements) for g in grads]
    sharded = _sum_of_squares([_local(g) for g, s in zip(grads, is_shard) if s], device)
    replicated = _sum_of_squares([_local(g) for g, s in zip(grads, is_shard) if not s], device)
    if tp_group is not None:
        with timer(sharded.element_size()) if timer is not None else contextlib.nullcontext():
            dist.all_reduce(sharded, group=tp_group)
    return (sharded + replicated).sqrt()


def _sum_of_squares(tensors: list[torch.Tensor], device) -> torch.Tensor:
    """The sum of the tensors' squared 2-norms in fp32, by foreach kernels (one launch per dtype)."""
    total = torch.zeros((), device=device, dtype=torch.float32)
    by_dtype: dict = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        norms = torch._foreach_norm(group)
        total += torch.stack(norms).float().pow(2).sum()
    return total


class GradAverager:
    """Average gradients over the data-parallel group after backward, in buckets of at most
    `bucket_cap_mb` (one all-reduce per bucket), one bucket after the other. Where DDP cannot
    wrap the model (its tensor-parallel parameters are DTensors), `OverlappedAverager` is what
    runs; this one stays for comparison (parallel.dp_overlap: false) and as its reference."""

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

    def syncing(self, on: bool) -> None:
        """Nothing to switch: this one averages after backward, when the worker asks."""

    def close(self) -> None:
        """Nothing to remove."""

    def _reduce(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.reshape(-1) for g in grads])
        with self.timer(flat.numel() * flat.element_size()) if self.timer is not None else contextlib.nullcontext():
            dist.all_reduce(flat, group=self.group)  # gloo has no AVG: sum, then divide
        flat.div_(self.size)
        _scatter(flat, grads)


def _scatter(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _buckets(params: list[torch.nn.Parameter], cap_bytes: int) -> list[list[torch.nn.Parameter]]:
    """Consecutive runs of `params` of at least `cap_bytes` each (the last may be smaller), as
    DDP cuts its buckets: a bucket is sent once its last parameter's gradient is in."""
    out, bucket, used = [], [], 0
    for p in params:
        bucket.append(p)
        local = _local(p)
        used += local.numel() * local.element_size()
        if used >= cap_bytes:
            out.append(bucket)
            bucket, used = [], 0
    return out + ([bucket] if bucket else [])


class OverlappedAverager:
    """Average gradients over the data-parallel group while backward still computes, as DDP does
    for a model it can wrap: parameters are cut into buckets of about `bucket_cap_mb` in the
    reverse of their order (the order backward produces their gradients), each parameter's
    post-accumulate-grad hook counts its bucket down, and a bucket whose gradients are all in is
    all-reduced asynchronously at once. Buckets are launched in their fixed order on every rank
    (a bucket ready early waits for the ones before it), so the collectives line up across ranks
    whatever order the hooks fire in. `finish()`, after backward, launches what backward never
    reached (parameters without a gradient this step), waits, and writes each average back.

    Comm wait is only the time `finish` blocks: an all-reduce that completed behind backward is
    not waited for. `route` (the worker's CommRoute, or None) times that wait, counts the
    launches, delays each all-reduce's completion by the simulated link, and is told how much of
    the all-reduces' time was hidden behind backward and how long this rank then waited."""

    def __init__(self, model: torch.nn.Module, group, bucket_cap_mb: float):
        self.model, self.group = model, group
        self.size = dist.get_world_size(group)
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.route = None
        self._sync = True  # False in the micro-batches of a step before its last (no_sync)
        self.buckets: list[list[torch.nn.Parameter]] = []
        self._bucket_of: dict[int, int] = {}
        self._hooks: list = []
        # Bound on the first forward, not here: a model laid out on the meta device gets its real
        # storage afterwards (to_empty swaps it into the same Parameter objects), and a hook put
        # on a parameter before that swap stays with the meta storage and never fires
        self._rebind = model.register_forward_pre_hook(self._bind_once) if self.size > 1 else None
        self._reset()

    def _bind(self) -> None:
        """Buckets and hooks on the model's parameters as they are now."""
        for h in self._hooks:
            h.remove()
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.buckets = _buckets(list(reversed(trained)), self.cap_bytes)
        self._bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        for p in trained:
            if p._post_accumulate_grad_hooks is not None and not p._post_accumulate_grad_hooks:
                # an empty table left from before a storage swap: dropped, so that the hook below is
                # registered with the storage the parameter has now
                p._post_accumulate_grad_hooks = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in trained]

    def _bind_once(self, module, args) -> None:
        self._rebind.remove()
        self._rebind = None
        self._bind()
        self._reset()

    def _reset(self) -> None:
        self._missing = [len(b) for b in self.buckets]
        self._next = 0  # the next bucket to launch: buckets go out in order
        self._inflight: list[tuple] = []  # (grads, flat, future, launched_at, done_at holder)
        self._heard = False  # some hook fired this step

    def syncing(self, on: bool) -> None:
        """Off around the backward of a micro-batch that is not the step's last: gradients only
        accumulate, and the hooks launch nothing."""
        self._sync = on

    def _ready(self, param: torch.nn.Parameter) -> None:
        if not self._sync:
            return
        self._heard = True
        b = self._bucket_of[id(param)]
        self._missing[b] -= 1
        while self._next < len(self.buckets) and self._missing[self._next] <= 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        grads = [_local(p.grad) for p in self.buckets[b] if p.grad is not None]
        if not grads:  # every rank skips the same bucket: the same parameters went unused
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        nbytes = flat.numel() * flat.element_size()
        route = self.route
        launched = time.perf_counter()
        fut = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
        delay = route.delay_s(nbytes, "dp") if route is not None else 0.0
        done: list[float] = []

        def complete(f):
            if delay:  # the simulated link: the all-reduce completes later by its delay
                time.sleep(delay)
            done.append(time.perf_counter())
            return f.value()

        fut = fut.then(complete)
        if route is not None:
            route.launched("dp")
        self._inflight.append((grads, flat, fut, launched, done))

    def finish(self) -> None:
        """After backward: the buckets backward never completed go out now, every all-reduce is
        waited for, and the averages are written back into the gradients."""
        if self.size == 1:
            return
        if not self._sync:
            raise RuntimeError("the data-parallel average was asked for inside no_sync")
        if not self.buckets:  # no forward ran through the model itself (its wrapper called around it)
            self._bind()
        stale = not self._heard  # no hook fired: the parameters were replaced since the hooks went on
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        route = self.route
        started = time.perf_counter()
        with route.waiting() if route is not None else contextlib.nullcontext():
            for _, _, fut, _, _ in self._inflight:
                fut.wait()
        ended = time.perf_counter()
        if route is not None:
            route.hidden(_hidden(self._inflight, started, ended), ended - started)
        for grads, flat, _, _, _ in self._inflight:
            flat.div_(self.size)  # gloo has no AVG: sum, then divide
            _scatter(flat, grads)
        if stale:  # this step's average ran after backward; the next one overlaps again
            self._bind()
        self._reset()

    __call__ = finish

    def close(self) -> None:
        """Remove the hooks (the layout goes; the parameters may live on in another)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._rebind is not None:
            self._rebind.remove()
            self._rebind = None


def _hidden(inflight: list[tuple], wait_start: float, wait_end: float) -> float:
    """Seconds in which some all-reduce was in flight while this rank was not waiting for it (it
    computed backward meanwhile): the union of the [launch, done] spans outside the wait."""
    spans = sorted((launched, done[0] if done else wait_end) for _, _, _, launched, done in inflight)
    total, cur_start, cur_end = 0.0, None, None
    for a, b in spans:
        b = min(b, wait_start)  # what ran on into the wait was waited for, not hidden
        if b <= a:
            continue
        if cur_end is None or a > cur_end:
            total += (cur_end - cur_start) if cur_end is not None else 0.0
            cur_start, cur_end = a, b
        else:
            cur_end = max(cur_end, b)
    return total + ((cur_end - cur_start) if cur_end is not None else 0.0)


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
    return mesh_grad_squares([p.grad for p in params], timer).sqrt()


def mesh_grad_squares(grads: Iterable[torch.Tensor | None], timer=None, device=None) -> torch.Tensor:
    """The sum of the squares of `grads` (None: no gradient) as `mesh_grad_norm` counts them,
    on `device` (default: the first gradient's, else the CPU)."""
    grads = [g for g in grads if g is not None]
    device = device or (_local(grads[0]).device if grads else torch.device("cpu"))
    sums: dict[tuple, list] = {}
    for g in grads:
        key, mesh = ((), None)
        if isinstance(g, DTensor) and _shard_dims(g):
            key, mesh = (g.device_mesh.mesh_dim_names or (), _shard_dims(g)), g.device_mesh
        sums.setdefault(key, [mesh, []])[1].append(_local(g))
    for entry in sums.values():
        entry[1] = _sum_of_squares(entry[1], device)
    total = torch.zeros((), device=device, dtype=torch.float32)
    # every rank holds the same keys (same model, same layout): sorted, the all-reduces line up
    for key in sorted(sums, key=repr):
        mesh, sq = sums[key]
        for dim in key[1] if key else ():
            name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else str(dim)
            with timer(sq.element_size(), name) if timer is not None else contextlib.nullcontext():
                dist.all_reduce(sq, group=mesh.get_group(dim))
        total += sq
    return total


def mesh_clip_grad_norm(params: Iterable[torch.Tensor], max_norm: float, timer=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ (2-norm, same coefficient) over `mesh_grad_norm`."""
    params = list(params)
    total = mesh_grad_norm(params, timer)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in (p.grad for p in params if p.grad is not None):
        _local(g).mul_(coef.to(_local(g).dtype))
    return total
