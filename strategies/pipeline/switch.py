"""A switch into or out of a pipeline (or between two pipelines) on the same workers, one tensor
at a time, as strategies/relayout.py moves the other layouts.

Under a pipeline each rank holds only its stage's tensors, so the ranks no longer walk the same
names: here every rank walks the whole model's names in one order (the architecture built on
the meta device), and for each name its full value is made on every rank, by the layout that
holds it now:
- out of a pipeline, the first rank whose stage holds the tensor broadcasts it (every rank
  learns who holds what, and each optimizer state's shape, from one exchange of names first);
  where the stage's blocks are sharded over its replicas (parallel.dp_shard), they gather it first;
- out of another layout, as relayout does: its own gather (a collective for a sharded tensor),
  or the tensor itself where it is whole.
The new layout keeps its piece of the value (its stage's tensors, its shard, or the whole) and
the value is dropped before the next name: a rank holds one full tensor beyond the two layouts'
own state at any time, never a whole copy. The optimizer's state moves the same way, keyed by
parameter name.

What it rests on: gloo on CPU, torch 2.13 (tests/test_pipeline_run.py)."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from gearshift.strategies import parallelize
from gearshift.strategies.base import Options, Parallel, SwitchAborted
from gearshift.strategies.layout import Layout
from gearshift.strategies.state import full, shard_like


def _tensors(model: nn.Module, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Parameters by name, buffers as "buffer:NAME" (a pipeline stage's stand-ins left out)."""
    out = dict(model.named_parameters())
    out.update({f"buffer:{n}": b for n, b in model.named_buffers() if n not in skip})
    return out


def _stand_ins(parallel: Parallel) -> set[str]:
    info = getattr(parallel, "info", None)
    return set(getattr(info, "stand_ins", ()) or ())


class _Source:
    """The old layout's state on this rank, and how a full value is made from it on every rank."""

    def __init__(self, old: Parallel, optimizer: torch.optim.Optimizer, device: torch.device):
        self.pipeline, self.device = old.layout.pp > 1, device
        self.tensors = _tensors(old.model, _stand_ins(old))
        name_of = {id(p): n for n, p in old.model.named_parameters()}
        self.saved = {name_of[id(p)]: dict(st) for p, st in optimizer.state.items()}
        self.hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
        optimizer.state.clear()
        self.holder: dict[str, int] = {}
        self.described: dict[str, dict] = {}  # param name -> {key: (shape, dtype) | plain value}
        self._exchange()

    def _exchange(self) -> None:
        """Out of a pipeline: who holds each tensor, and what each optimizer state is."""
        mine = {n: {k: (tuple(v.shape), v.dtype, str(v.device)) if torch.is_tensor(v) else v for k, v in st.items()}
                for n, st in self.saved.items()}
        if not self.pipeline:
            self.described = mine
            return
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (sorted(self.tensors), mine))
        for rank, (names, states) in enumerate(everyone):
            for n in names:
                self.holder.setdefault(n, rank)
            for n, st in states.items():
                self.described.setdefault(n, st)

    def value(self, name: str, like: torch.Tensor, key: str | None = None) -> torch.Tensor:
        """The full value of tensor `name` (optimizer state `key` of it), on every rank. It crosses
        on the layout's device whatever device it lives on (Adam's `step` is a CPU tensor, which
        NCCL would refuse), and comes back on the device the holder kept it on."""
        t = self.tensors.get(name) if key is None else self.saved.get(name, {}).get(key)
        if not self.pipeline:
            return full(t.detach())
        if t is not None and hasattr(t, "to_local"):  # a block sharded over its stage's replicas: they gather it
            t = full(t.detach())
        src = self.holder[name]
        shape, dtype, home = ((tuple(like.shape), like.dtype, str(self.device)) if key is None
                              else self.described[name][key])
        if dist.get_rank() == src:
            buf = t.detach().to(self.device).contiguous()
        else:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(buf, src=src)
        return buf.to(home)

    def drop(self, name: str) -> None:
        """The old layout's tensor `name`, moved: its memory (a shard's, too) given back now."""
        from gearshift.strategies.relayout import _free

        t = self.tensors.pop(name, None)
        if t is not None:
            _free(t.detach())


def relayout(old: Parallel, old_optimizer: torch.optim.Optimizer, model: nn.Module, layout: Layout,
             plan: dict[str, str] | None, options: Options,
             make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
             agree: Callable[[bool], bool] | None = None, gather=None) -> tuple[Parallel, torch.optim.Optimizer]:
    """Move `old` (with `old_optimizer`) to `layout`, where either is a pipeline; `model` is the
    architecture on the meta device. Every rank calls it at the same step boundary."""
    if gather is not None:
        raise SwitchAborted("a pipeline's state cannot be put back together by survivors of a broken group", own=True)
    from gearshift.strategies.relayout import _at_rest, _drop_grads, _free_after_commit

    names = _tensors(model)  # the whole model's names and shapes, in one order on every rank
    _at_rest(old.model)
    shared = _drop_grads(old.model, old.grads_in_kept_storage)
    old.detach()
    new, failure = None, None
    try:
        new = _allocate(model, layout, plan, options)
    except torch.OutOfMemoryError as err:
        failure = err
    if agree is not None and not agree(failure is None) or failure is not None:
        raise SwitchAborted(f"the new layout {layout} could not be allocated"
                            + (f": {type(failure).__name__}: {failure}" if failure is not None else
                               " on another rank (out of memory)"), own=failure is not None)
    _free_after_commit(shared)
    source = _Source(old, old_optimizer, options.device)
    target_model = new.model if new is not None else model
    targets = _tensors(target_model, _stand_ins(new) if new is not None else set())
    with torch.no_grad():
        for name, like in names.items():
            value = source.value(name, like)
            if name in targets:
                target = targets[name]
                piece = shard_like(value, target)
                (target.to_local() if hasattr(target, "to_local") else target).copy_(
                    piece.to_local() if hasattr(piece, "to_local") else piece)
            del value
            source.drop(name)
    if new is None:  # a layout applied to real tensors (DDP): filled first, laid out after
        new = parallelize(model, layout, plan, options)
    optimizer = make_optimizer(new.param_groups())
    _fill_optimizer(optimizer, new.model, names, source)
    return new, optimizer


def _allocate(model: nn.Module, layout: Layout, plan, options: Options) -> Parallel | None:
    """The new layout with its storage allocated, empty: a layout applied on the meta device
    (a pipeline, fsdp, tensor, hybrid), or, for one applied to real tensors, None with `model`
    materialised whole."""
    from gearshift import strategies
    from gearshift.strategies.relayout import _params_keep_identity

    if layout.pp > 1 or strategies.lookup(layout.strategy).meta_ok:
        new = parallelize(model, layout, plan, options)
        with _params_keep_identity():
            new.model.to_empty(device=options.device)
        if layout.pp > 1:
            new.info.restore_stand_ins(new.model)
        return new
    model.to_empty(device=options.device)
    return None


@torch.no_grad()
def _fill_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, names: dict, source: _Source) -> None:
    for group in optimizer.param_groups:
        group.update(source.hyper)
    params = dict(model.named_parameters())
    for name, like in names.items():
        states = source.described.get(name)
        if name.startswith("buffer:") or not states:
            continue
        p = params.get(name)
        moved = {}
        for key, what in sorted(states.items()):
            if not isinstance(what, tuple) or len(what) != 3 or not isinstance(what[1], torch.dtype):
                moved[key] = what  # a plain number
                continue
            value = source.value(name, like, key)
            if p is not None:
                moved[key] = shard_like(value, p) if value.dim() > 0 else value.clone()
        if p is not None:
            optimizer.state[p] = moved
