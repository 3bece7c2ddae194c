"""How a model is laid out on the workers: `data`, `tensor` or `hybrid`, looked up by name.

`parallelize(model, layout, device, ...)` returns a `Parallel`: the module to call, the model
whose parameters the optimizer updates, and what to run after backward. Strategies import
neither the orchestrator nor the workers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from strategies.layout import Layout, LayoutError
from strategies.plan import PlanError

__all__ = ["Layout", "LayoutError", "Parallel", "PlanError", "STRATEGIES", "parallelize"]


@dataclass
class Parallel:
    module: nn.Module  # what forward is called on (a DDP wrapper for data)
    model: nn.Module  # the model itself; its parameters may be DTensor shards
    layout: Layout
    mesh: object | None = None  # the (dp, tp) DeviceMesh, when the layout shards
    after_backward: Callable[[], None] | None = None

    @property
    def tp_group(self):
        return self.mesh["tp"].get_group() if self.mesh is not None and self.layout.tp > 1 else None


def _data(model, layout, device, bucket_cap_mb, plan, mesh):
    from strategies import data

    return Parallel(data.apply(model, device, bucket_cap_mb), model, layout)


def _tensor(model, layout, device, bucket_cap_mb, plan, mesh):
    from strategies import tensor

    return Parallel(tensor.shard(model, mesh["tp"], plan), model, layout, mesh)


def _hybrid(model, layout, device, bucket_cap_mb, plan, mesh):
    from strategies import hybrid

    model, average = hybrid.shard(model, mesh, plan, bucket_cap_mb)
    return Parallel(model, model, layout, mesh, average)


def param_groups(model: nn.Module) -> list[dict]:
    """Parameters for the optimizer, tensor-parallel shards (DTensors) apart from plain tensors:
    fused multi-tensor updates (the default on GPU) cannot mix the two in one call."""
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
    return [{"params": g} for g in groups if g]


STRATEGIES: dict[str, Callable[..., Parallel]] = {"data": _data, "tensor": _tensor, "hybrid": _hybrid}


def parallelize(model: nn.Module, layout: Layout, device: torch.device, bucket_cap_mb: float,
                plan: dict[str, str] | None = None) -> Parallel:
    """Lay `model` (already on `device`, same initial weights on every rank) out as `layout`
    over the default process group."""
    try:
        apply = STRATEGIES[layout.strategy]
    except KeyError:
        raise LayoutError(f"unknown strategy {layout.strategy!r}; available: {', '.join(STRATEGIES)}") from None
    mesh = None
    if layout.strategy != "data":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    return apply(model, layout, device, bucket_cap_mb, plan, mesh)
