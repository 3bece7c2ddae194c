"""Model and optimizer state as full (unsharded) tensors, whatever the layout.

Checkpoints and `final.pt` hold full tensors, so any layout can load what any other wrote.
Gathering is a collective: every rank of the tp group must call it at the same point."""

from __future__ import annotations

import sys

import torch
from torch import nn


def _is_dtensor(t) -> bool:
    # torch.distributed.tensor costs 0.7 s to import; a process that never imported it (a
    # data-parallel worker, the driver) holds no DTensor, so it is not imported to ask
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def full(t):
    return t.full_tensor() if _is_dtensor(t) else t


def shard_like(value: torch.Tensor, like):
    """This rank's piece of the full `value`, laid out as `like` is (a DTensor or a plain tensor)."""
    if not _is_dtensor(like):
        return value
    from torch.distributed.tensor import DTensor, distribute_tensor

    # DTensor cuts the piece itself (src_data_rank=None: every rank has the full value, nothing
    # is sent), which covers the strided shard FSDP2 puts on top of a tensor-parallel shard
    value = value.to(like.to_local().device, like.dtype)
    piece = distribute_tensor(value, like.device_mesh, like.placements, src_data_rank=None)
    local = piece.to_local()
    if local.untyped_storage().data_ptr() == value.untyped_storage().data_ptr():
        local = local.clone()  # a view would keep the whole full tensor alive
    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def model_state(model: nn.Module) -> dict:
    return {k: full(v) for k, v in model.state_dict().items()}


def load_model_state(model: nn.Module, state: dict) -> None:
    own = model.state_dict()
    check_matches(own, state)
    with torch.no_grad():
        for name, target in own.items():
            piece = shard_like(state[name], target)
            (target.to_local() if _is_dtensor(target) else target).copy_(
                piece.to_local() if _is_dtensor(piece) else piece)


class StateMismatch(ValueError):
    """Saved tensors that do not fit the model; the message names the first that differs."""


def check_matches(own: dict, saved: dict) -> None:
    """StateMismatch naming the first tensor whose name or (global) shape differs."""
    for name, target in own.items():
        if name not in saved:
            raise StateMismatch(f"the model has {name} {list(target.shape)}, the saved state does not")
        if torch.is_tensor(saved[name]) and list(saved[name].shape) != list(target.shape):
            raise StateMismatch(f"{name} is {list(saved[name].shape)} in the saved state, {list(target.shape)} "
                                "in the model")
    extra = sorted(set(saved) - set(own))
    if extra:
        raise StateMismatch(f"the saved state has {extra[0]}, the model does not")


def _names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The parameter names in the optimizer's own order (its state is keyed by that position)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """What `model_state` and `optimizer_state` give, with each tensor as this rank holds it (a
    DTensor not gathered): for a caller that gathers them one at a time (`full`), every rank in
    the same order, the structure's."""
    sd = optimizer.state_dict()
    names = _names(optimizer, model)
    hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    return {"model": dict(model.state_dict()),
            "optimizer": {"state": {names[i]: dict(st) for i, st in sd["state"].items()}, "hyperparameters": hyper}}


def optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """Full tensors keyed by parameter name: layouts group and order parameters differently,
    so positions do not carry over from one layout to another; names do."""
    sd = optimizer.state_dict()
    names = _names(optimizer, model)
    hyper = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
    return {"state": {names[i]: {k: full(v) for k, v in st.items()} for i, st in sd["state"].items()},
            "hyperparameters": hyper}


def load_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module, saved: dict) -> None:
    names = _names(optimizer, model)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: (shard_like(v, params[i]) if torch.is_tensor(v) and v.dim() > 0 else v)
                       for k, v in saved["state"][name].items()}
                   for i, name in enumerate(names) if name in saved["state"]}
    for group in sd["param_groups"]:
        group.update({k: v for k, v in saved["hyperparameters"].items()})
    optimizer.load_state_dict(sd)


def tensors_of(tree) -> list[torch.Tensor]:
    """The tensors of a nested dict, in its order (every rank walks the same structure)."""
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in tensors_of(v)]
    return [tree] if torch.is_tensor(tree) else []


class WholeTensors:
    """A layout's whole state for rank 0, one tensor at a time (the full checkpoint format):
    `tree()` its structure, `tensors()` each tensor whole on the CPU in that structure's order.
    Where the layout splits tensors (`collective`), every rank gathers each one with rank 0 by
    exhausting `tensors()`, which yields nothing there; elsewhere only rank 0 has anything to do.
    A pipeline streams its stages' parts instead (strategies/pipeline/gather.py)."""

    def __init__(self, tree: dict, rank: int, collective: bool):
        self._tree, self.rank, self.collective = tree, rank, collective

    def tree(self) -> dict:
        return self._tree

    def tensors(self):
        if self.rank != 0 and not self.collective:
            return
        for t in tensors_of(self._tree):
            whole = full(t)
            if self.rank == 0:
                yield whole.detach().cpu()
