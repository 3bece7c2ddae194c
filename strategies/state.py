"""Model and optimizer state as full (unsharded) tensors, whatever the layout.

Checkpoints and `final.pt` hold full tensors, so any layout can load what any other wrote.
Gathering is a collective: every rank of the tp group must call it at the same point."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(value: torch.Tensor, like):
    """This rank's piece of the full `value`, laid out as `like` is (a DTensor or a plain tensor)."""
    if not isinstance(like, DTensor):
        return value
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
    missing = set(own) ^ set(state)
    if missing:
        raise KeyError(f"state does not match the model: {sorted(missing)[:5]}")
    with torch.no_grad():
        for name, target in own.items():
            piece = shard_like(state[name], target)
            (target.to_local() if isinstance(target, DTensor) else target).copy_(
                piece.to_local() if isinstance(piece, DTensor) else piece)


def _names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The parameter names in the optimizer's own order (its state is keyed by that position)."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


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
