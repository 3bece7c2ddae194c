"""A switch without a full copy: move the live model and optimizer state from one layout to
another one tensor at a time.

`Parallel.full_state(everywhere=True)` followed by `load_full_state` holds the whole gathered
state next to the old layout and then next to the new one. Here each parameter, buffer and
optimizer-state tensor is gathered alone (only when the old layout shards it; a collective, so
every rank walks the tensors in the same order), cut to the new layout's piece, and the old
tensor's storage is freed right away, so the peak stays near the larger layout's own size.

Layouts that can be applied on the meta device (`Strategy.meta_ok`: fsdp, hsdp, tensor,
hybrid) are laid out first and materialised empty (`to_empty`), then filled. The others (DDP
broadcasts real tensors at construction; a user's own strategy, by default) get the whole model
filled first and are applied afterwards.

The old layout is unusable afterwards: its storage is gone.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from typing import Callable

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from gearshift.strategies import lookup, parallelize
from gearshift.strategies.base import Options, Parallel, SwitchAborted
from gearshift.strategies.layout import Layout

# Gathering a tensor that FSDP shards on top of tensor parallelism takes two all-gathers, and
# torch warns about it on every such tensor; one gather per tensor is what a switch is.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
from gearshift.strategies.state import full, shard_like
from gearshift.strategies.survivors import Absent


@dataclasses.dataclass
class Held:
    """The old layout's state as `relayout` takes it from a layout: tensors by name (parameters,
    and buffers as "buffer:NAME"), the optimizer's per-parameter state by parameter name, its
    hyperparameters. A worker joining a group holds it as stand-ins (strategies/survivors.py)."""

    sources: dict
    saved: dict
    hyper: dict


def held_state(parallel: Parallel, optimizer: torch.optim.Optimizer) -> Held:
    """This rank's `Held` state, for describing it; nothing is moved or freed."""
    _at_rest(parallel.model)
    name_of = {id(p): n for n, p in parallel.model.named_parameters()}
    return Held({**dict(parallel.model.named_parameters()), **_buffers(parallel.model)},
                {name_of[id(p)]: st for p, st in optimizer.state.items()},
                {k: v for k, v in optimizer.param_groups[0].items() if k != "params"})


def relayout(old: Parallel | Held, old_optimizer: torch.optim.Optimizer | None, model: nn.Module, layout: Layout,
             plan: dict[str, str] | None, options: Options,
             make_optimizer: Callable[[list[dict]], torch.optim.Optimizer],
             agree: Callable[[bool], bool] | None = None,
             gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[Parallel, torch.optim.Optimizer]:
    """Move `old` (with `old_optimizer`) to `layout`. `model` is the same architecture built on
    the meta device; `make_optimizer(param_groups)` builds the optimizer for the new layout.
    Every rank calls this at the same step boundary. Returns the new layout and its optimizer,
    whose next `step()` continues exactly where the old one stopped.

    The new layout's storage is allocated before anything moves; `agree(ok)` (every rank's ok,
    all ranks calling it) is the commit point after it. A rank that ran out of memory there says
    so, and every rank raises SwitchAborted with the old layout and its optimizer untouched.

    `gather(t)` gives a tensor's full value where the old layout's own group cannot (its ranks
    are gone: strategies/survivors.py); with it no piece is taken to be in place already. A rank
    that held nothing before (joining a group) passes its stand-ins as `old` (a Held)."""
    shared: list[torch.Tensor] = []
    if isinstance(old, Held):
        sources = dict(old.sources)
    else:
        _at_rest(old.model)
        shared = _drop_grads(old.model, old.grads_in_kept_storage)
        old.detach()
        sources = {**dict(old.model.named_parameters()), **_buffers(old.model)}
    meta_ok = lookup(layout.strategy).meta_ok
    failure = None
    try:
        if meta_ok:
            new = parallelize(model, layout, plan, options)
            with _params_keep_identity():  # the new layout may hold its parameters already (hybrid's averager)
                new.model.to_empty(device=options.device)
        else:
            model.to_empty(device=options.device)
    except torch.OutOfMemoryError as err:
        failure = err
    if agree is not None and not agree(failure is None) or failure is not None:
        model = new = None
        raise SwitchAborted(f"the new layout {layout} could not be allocated"
                            + (f": {type(failure).__name__}: {failure}" if failure is not None else
                               " on another rank (out of memory)"), own=failure is not None)
    _free_after_commit(shared)
    saved, hyper = (dict(old.saved), old.hyper) if isinstance(old, Held) else \
        _take_optimizer_state(old_optimizer, old.model)
    move = functools.partial(_move, gather=gather)
    if meta_ok:
        _fill(new.model, sources, move)
    else:
        _fill(model, sources, move)
        new = parallelize(model, layout, plan, options)
    optimizer = make_optimizer(new.param_groups())
    _fill_optimizer(optimizer, new.model, saved, hyper, move)
    return new, optimizer


def _at_rest(model: nn.Module) -> None:
    """FSDP2 leaves a unit gathered after a forward without backward (an evaluation at the step
    boundary, reshard_after_forward=False): its shards go back in place, so the parameters
    found by name are the ones the optimizer holds."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


@contextlib.contextmanager
def _params_keep_identity():
    """`to_empty` swaps the new storage into the Parameter objects the layout already holds,
    rather than replacing plain parameters with new objects (torch's opt-in)."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"buffer:{name}": b for name, b in model.named_buffers()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _free(t: torch.Tensor, keep: torch.Tensor | None = None) -> None:
    """Give back `t`'s memory now, unless `keep` (what replaces it) lives in the same storage."""
    if not torch.is_tensor(t):  # a stand-in for a tensor this rank never held
        return
    storage = _local(t).untyped_storage()
    if keep is not None and _local(keep).untyped_storage().data_ptr() == storage.data_ptr():
        return
    if storage.device.type != "meta":
        storage.resize_(0)


def _drop_grads(model: nn.Module, kept: bool = False) -> list[torch.Tensor]:
    """Gradients go first: they are not carried over, and are freed now. Where they are views of
    storage the layout keeps from step to step (`kept`: Parallel.grads_in_kept_storage, DDP's
    buckets) they are only let go here and returned, to be freed with `_free_after_commit` once
    the move is sure: where the new layout cannot be allocated, the old one trains on with its
    buckets whole."""
    shared = []
    for p in model.parameters():
        if p.grad is not None:
            if kept:
                shared.append(p.grad)
            else:
                _free(p.grad)
            p.grad = None
    return shared


def _free_after_commit(shared: list[torch.Tensor]) -> None:
    """The old layout never steps again: the storage its gradients were views of goes now."""
    for t in shared:
        _free(t)


def _same_piece(old: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether `old` and `like` are cut the same way over meshes of the same shape: then this
    rank's piece of one is its piece of the other, and nothing needs to be sent."""
    return (isinstance(old, DTensor) and isinstance(like, DTensor) and old.placements == like.placements
            and tuple(old.device_mesh.mesh.shape) == tuple(like.device_mesh.mesh.shape)
            and tuple(old.shape) == tuple(like.shape) and tuple(old.to_local().shape) == tuple(like.to_local().shape))


@torch.no_grad()
def _move(old: torch.Tensor, like: torch.Tensor, gather: Callable | None = None) -> torch.Tensor:
    """This rank's piece of `old`'s full value laid out as `like` is (a DTensor shard or a plain
    tensor), as a tensor of its own; `old`'s storage is freed."""
    if gather is None and _same_piece(old, like):  # this rank holds its piece already (a new mesh of the same shape)
        piece = DTensor.from_local(old.to_local().detach().clone(), like.device_mesh, like.placements,
                                   run_check=False, shape=like.shape, stride=like.stride())
        _free(old)
        return piece
    value = (gather or full)(old.detach())  # a collective when `old` is sharded
    if isinstance(like, DTensor) and tuple(value.shape) == tuple(like.shape):
        piece = shard_like(value, like)
    else:
        piece = value.to(like.device)
    _free(old, keep=piece)
    return piece


@torch.no_grad()
def _fill(model: nn.Module, sources: dict[str, torch.Tensor], move: Callable = _move) -> None:
    """Copy every parameter and buffer of `model` (materialised, empty) from `sources` (the old
    layout's tensors, by name), one at a time, in the same order on every rank."""
    targets = {**dict(model.named_parameters()), **_buffers(model)}
    missing = set(targets) ^ set(sources)
    if missing:
        raise KeyError(f"the new model does not match the old one: {sorted(missing)[:5]}")
    for name, target in targets.items():
        piece = move(sources.pop(name), target)
        _local(target).copy_(_local(piece))
        _free(piece)  # may be the old tensor itself (a whole one moving to a whole one)


def _take_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> tuple[dict, dict]:
    """The optimizer's per-parameter state keyed by parameter name (layouts order and group
    parameters differently) and its hyperparameters; the optimizer is left empty."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    saved = {name_of[id(p)]: st for p, st in optimizer.state.items()}
    hyper = {k: v for k, v in optimizer.param_groups[0].items() if k != "params"}
    optimizer.state.clear()
    return saved, hyper


def _fill_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict, hyper: dict,
                    move: Callable = _move) -> None:
    """Each parameter's state moved to its new layout: tensors shaped like the parameter
    (exp_avg, exp_avg_sq, momentum_buffer) become its piece; scalars (step) carry over as they are."""
    for group in optimizer.param_groups:
        group.update(hyper)
    for name, p in model.named_parameters():
        old = saved.pop(name, None)
        if old is None:
            continue
        optimizer.state[p] = {k: move(v, p) if torch.is_tensor(v) and v.dim() > 0 or isinstance(v, Absent) else v
                              for k, v in old.items()}
