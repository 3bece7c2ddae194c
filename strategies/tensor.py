"""Tensor parallelism, Megatron style: a column-parallel Linear (output features split) feeds a
row-parallel one (input features split), so each pair needs one all-reduce forward and one
backward. Attention splits by heads because q, k and v are column-parallel and the attention
code infers its local head count from their width.

Sharded parameters are DTensors on the tp mesh; everything else stays replicated."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from strategies import plan as tp_plan

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def shard(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following `plan` (patterns -> colwise | rowwise)."""
    resolved = tp_plan.resolve(model, plan, tp_mesh.size())
    return parallelize_module(model, tp_mesh, {name: _STYLES[style]() for name, style in resolved.items()})
