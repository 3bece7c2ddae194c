"""Hybrid (2-D) parallelism on a (dp, tp) mesh: tensor-parallel shards inside a tp group (the
workers of one node, on the fast link), data-parallel replicas of that group across nodes."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from strategies import tensor
from strategies.grads import GradAverager


def shard(model: nn.Module, mesh: DeviceMesh, plan: dict[str, str], bucket_cap_mb: float):
    """Shard over mesh["tp"]; return the model and the hook that averages gradients over mesh["dp"]."""
    tensor.shard(model, mesh["tp"], plan)
    return model, GradAverager(list(model.parameters()), mesh["dp"].get_group(), bucket_cap_mb)
