"""Model and optimizer state as full (unsharded) tensors, whatever the layout.

Checkpoints and `final.pt` hold full tensors, so any layout can load what any other wrote.
Gathering is a collective: every rank of the tp group must call it at the same point."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(value: torch.Tensor, like):
    """This rank's piece of the full `value`, laid out as `like` is (a DTensor or a plain tensor)."""
    if not isinstance(like, DTensor):
        return value
    local = value
    mesh = like.device_mesh
    for dim, placement in enumerate(like.placements):
        if isinstance(placement, Shard):
            local = local.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_local_rank(dim)]
    return DTensor.from_local(local.to(like.to_local().device, like.dtype), mesh, like.placements, run_check=False)


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


def _params(optimizer: torch.optim.Optimizer) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: full(v) for k, v in s.items()} for i, s in sd["state"].items()}
    return sd


def load_optimizer_state(optimizer: torch.optim.Optimizer, sd: dict) -> None:
    params = _params(optimizer)
    sd = dict(sd)
    sd["state"] = {i: {k: (shard_like(v, params[int(i)]) if torch.is_tensor(v) and v.dim() > 0 else v)
                       for k, v in s.items()} for i, s in sd["state"].items()}
    optimizer.load_state_dict(sd)
