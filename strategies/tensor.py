"""Tensor parallelism, Megatron style: a column-parallel Linear (output features split) feeds a
row-parallel one (input features split), so each pair needs one all-reduce forward and one
backward. Attention splits by heads because q, k and v are column-parallel and the attention
code infers its local head count from their width.

Sharded parameters are DTensors on the tp mesh; everything else stays replicated."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from gearshift.strategies import grads
from gearshift.strategies import tp_plan as plans
from gearshift.strategies.base import Options, Parallel
from gearshift.strategies.layout import Layout

_STYLES = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def shard(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str]) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following `plan` (patterns -> colwise | rowwise)."""
    resolved = plans.resolve(model, plan, tp_mesh.size())
    return parallelize_module(model, tp_mesh, {name: _STYLES[style]() for name, style in resolved.items()})


class TensorParallel(Parallel):
    # a shard's full tensor exists only across its tp group: gathering is a collective
    gathers_collectively = True

    @property
    def tp_group(self):
        return self.mesh["tp"].get_group() if self.layout.tp > 1 else None

    def param_groups(self) -> list[dict]:
        """Shards (DTensors) apart from plain tensors: fused multi-tensor updates (the default on
        GPU) cannot mix the two in one call."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [[p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)]]
        return [{"params": g} for g in groups if g]

    def make_scaler(self):
        # ranks hold different gradients: whether any overflowed is agreed over all of them
        return grads.sharded_grad_scaler(self.options.device.type, self.options.fp16)

    def grad_norm(self):
        return grads.grad_norm(self.model.parameters(), self.tp_group, self._tp_timer)

    def clip_grad_norm(self, max_norm: float):
        return grads.clip_grad_norm(self.model.parameters(), max_norm, self.tp_group, self._tp_timer)

    def _tp_timer(self, nbytes: int):
        return self.blocked(nbytes, "tp")

    def attach(self, comm) -> None:
        if self.comm is not None and comm is None:
            self.comm.functional(False)
        super().attach(comm)
        if comm is not None:
            comm.functional(True)  # DTensor's collectives are this layout's tp traffic


def apply(model: nn.Module, mesh: DeviceMesh, layout: Layout, plan: dict[str, str],
          options: Options) -> TensorParallel:
    shard(model, mesh["tp"], plan)
    return TensorParallel(model, model, layout, options, mesh)
