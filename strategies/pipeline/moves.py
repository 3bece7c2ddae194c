"""A pipeline cut again on the same ranks (a recut: a slow stage's blocks moved to a faster
position): only the tensors that change holder move, point to point from the rank of the same
replica that held them to the rank that holds them now; a tensor a rank holds under both cuts
stays where it is, in the same storage, with its optimizer state.

A full relayout (pipeline/switch.py) broadcasts every tensor of the model and its optimizer
state to every rank, across the slow link a pipeline is chosen to avoid; a recut that moves one
block between two neighbouring positions sends that block's tensors over that one link.

It applies where both cuts hold whole stages on the same mesh (no tensor-parallel or dp_shard
pieces, which are DTensors of the mesh: those go through the full relayout). Every rank walks the
whole model's names in one order, so each send meets its receive. What it rests on: gloo on CPU,
torch 2.13 (tests/test_pipeline_run.py); every tensor crosses on the layout's device."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from gearshift.strategies import parallelize
from gearshift.strategies.base import Options, Parallel, SwitchAborted
from gearshift.strategies.layout import Layout


def applies(old: Parallel, layout: Layout, gather) -> bool:
    """Whether moving `old` onto `layout` is a recut this module carries out."""
    return (gather is None and getattr(old, "cut", None) is not None and old.layout == layout
            and layout.tp == 1 and layout.shard == 1)


@dataclass
class Moved:
    """What a recut sent from this rank: bytes point to point, and what a full relayout would
    have sent from it (each tensor it was the first holder of, broadcast to every other rank)."""

    sent_bytes: int = 0
    relayout_bytes: int = 0
    tensors: list[str] = field(default_factory=list)  # the names this rank received


def _named(model: nn.Module, stand_ins) -> dict[str, torch.Tensor]:
    out = dict(model.named_parameters())
    out.update({f"buffer:{n}": b for n, b in model.named_buffers() if n not in stand_ins})
    return out


def _stand_ins(parallel: Parallel) -> set[str]:
    return set(getattr(parallel.info, "stand_ins", ()) or ())


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def recut(old: Parallel, old_optimizer: torch.optim.Optimizer, model: nn.Module, layout: Layout, plan,
          options: Options, make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
          agree: Callable[[bool], bool] | None = None) -> tuple[Parallel, torch.optim.Optimizer, Moved]:
    """`old` cut again as `model` (the architecture on the meta device) is cut under `options`
    (its pp_split); every rank calls it at the same step boundary."""
    from gearshift.strategies.relayout import _at_rest, _drop_grads, _free_after_commit

    _at_rest(old.model)
    shared = _drop_grads(old.model, old.grads_in_kept_storage)
    old.detach()
    order = list(_named(model, ()))  # the whole model's names, in one order on every rank
    new = parallelize(model, layout, plan, options)  # cut on the meta device: nothing allocated yet
    have, want = _named(old.model, _stand_ins(old)), _named(new.model, _stand_ins(new))
    name_of = {id(p): n for n, p in old.model.named_parameters()}
    saved = {name_of[id(p)]: dict(st) for p, st in old_optimizer.state.items()}
    hyper = {k: v for k, v in old_optimizer.param_groups[0].items() if k != "params"}
    failure = None
    try:
        fresh, new = _place(new, have, want, options.device)
        want = _named(new.model, _stand_ins(new))  # the real tensors now
    except torch.OutOfMemoryError as err:
        failure = err
    if agree is not None and not agree(failure is None) or failure is not None:
        raise SwitchAborted("the new cut could not be allocated" + (f": {type(failure).__name__}: {failure}"
                            if failure is not None else " on another rank (out of memory)"), own=failure is not None)
    _free_after_commit(shared)
    peers = _Peers(layout, have, want, saved)
    moved = Moved()
    with torch.no_grad():
        for name in order:
            peers.move(name, want.get(name), have.get(name), moved, fresh)
    optimizer = make_optimizer(new.param_groups())
    for group in optimizer.param_groups:
        group.update(hyper)
    params = dict(new.model.named_parameters())
    for name, p in params.items():
        states = saved.get(name) if name in have else peers.states(name, moved)
        if states:
            optimizer.state[p] = states
    old_optimizer.state.clear()
    return new, optimizer, moved


def _place(new: Parallel, have: dict, want: dict, device: torch.device) -> tuple[set[str], Parallel]:
    """The new stages' tensors: one this rank held already is put in (the same Parameter object,
    its storage unmoved), the others allocated empty; the stand-ins made again on the device; the
    layout made again over the real parameters (its gradient average holds them). The names
    allocated, and that layout."""
    from gearshift.strategies.pipeline.parallel import PipelineParallel
    from gearshift.strategies.pipeline.stage import _stand_in

    fresh, replace = set(), {}
    for name, target in want.items():
        source = have.get(name)
        if source is None:
            source = torch.empty_like(target, device=device)
            source = nn.Parameter(source, requires_grad=target.requires_grad) if isinstance(target, nn.Parameter) \
                else source
            fresh.add(name)
        if isinstance(target, nn.Parameter):
            replace[id(target)] = source
        else:
            _set_buffer(new.model, name[len("buffer:"):], source)
    for module in new.model.modules():  # every place a parameter sits (a tied one sits in two)
        for leaf, p in list(module._parameters.items()):
            if p is not None and id(p) in replace:
                module._parameters[leaf] = replace[id(p)]
    for view in new.views:
        view.own = [replace.get(id(p), p) for p in view.own]
    for name in new.info.stand_ins:
        parent, _, leaf = name.rpartition(".")
        module = new.model.get_submodule(parent) if parent else new.model
        b = getattr(module, leaf)
        module.register_buffer(leaf, _stand_in(b.shape, b.dtype, device), persistent=False)
    return fresh, PipelineParallel(new.views, new.info, new.cut, new.layout, new.options, new.mesh, new.tie_stages)


def _set_buffer(model: nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    module = model.get_submodule(parent) if parent else model
    persistent = leaf not in module._non_persistent_buffers_set
    module.register_buffer(leaf, value, persistent=persistent)


class _Peers:
    """Who holds what, learned in one exchange of names (and each optimizer state's shape), and
    the point-to-point moves inside each replica of the pipeline."""

    def __init__(self, layout: Layout, have: dict, want: dict, saved: dict):
        self.layout, self.saved, self.rank = layout, saved, dist.get_rank()
        described = {n: {k: (tuple(v.shape), v.dtype, str(v.device)) if torch.is_tensor(v) else v
                          for k, v in st.items()} for n, st in saved.items()}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (sorted(have), sorted(want), described))
        self.had = [set(h) for h, _, _ in everyone]
        self.wants = [set(w) for _, w, _ in everyone]
        self.described: dict[str, dict] = {}
        for _, _, d in everyone:
            for n, st in d.items():
                self.described.setdefault(n, st)
        replica = layout.dp_rank(self.rank)
        self.replica = [r for r in range(dist.get_world_size()) if layout.dp_rank(r) == replica]
        self.received: dict[str, dict] = {}

    def _route(self, name: str) -> tuple[int | None, list[int]]:
        """The rank of this replica that sends `name` and the ranks that receive it."""
        holders = [r for r in self.replica if name in self.had[r]]
        takers = [r for r in self.replica if name in self.wants[r] and name not in self.had[r]]
        return (holders[0] if holders else None), takers

    def move(self, name: str, target, held, moved: Moved, fresh: set) -> None:
        """`name` sent by its holder in this replica to the ranks that hold it now and did not,
        with its optimizer state; `target` is this rank's tensor under the new cut (the data,
        where it held it already), `held` its tensor under the old one."""
        src, takers = self._route(name)
        value = held  # what this rank held (kept or not: the same tensor)
        if value is not None and self.rank == min(r for r, h in enumerate(self.had) if name in h):
            states = [v for v in self.saved.get(name, {}).values() if torch.is_tensor(v)]
            moved.relayout_bytes += (_nbytes(value) + sum(map(_nbytes, states))) * (dist.get_world_size() - 1)
        if src is None or not takers:
            return
        if self.rank == src:
            for dst in takers:
                dist.send(value.detach().contiguous(), dst)
                moved.sent_bytes += _nbytes(value)
                for _, state in sorted(self.saved.get(name, {}).items()):
                    if torch.is_tensor(state):  # on the layout's device whatever its own (Adam's step)
                        dist.send(state.detach().to(value.device).contiguous(), dst)
                        moved.sent_bytes += _nbytes(state)
        elif self.rank in takers:
            dist.recv(target.detach(), src)
            moved.tensors.append(name)
            state = {}
            for key, what in sorted(self.described.get(name, {}).items()):
                if isinstance(what, tuple) and len(what) == 3 and isinstance(what[1], torch.dtype):
                    buf = torch.empty(what[0], dtype=what[1], device=target.device)
                    dist.recv(buf, src)
                    state[key] = buf.to(what[2])
                else:
                    state[key] = what
            if state:
                self.received[name] = state

    def states(self, name: str, moved: Moved) -> dict | None:
        return self.received.get(name)


__all__ = ["Moved", "applies", "recut"]
