"""Data parallelism: every rank holds the whole model; gradients are all-reduced in buckets.

DDP starts each bucket's all-reduce as soon as the bucket's gradients are ready, overlapping
communication with the rest of backward; `bucket_cap_mb` sets that granularity (small buckets
start early but pay more per-message latency, large ones overlap less).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def apply(model: nn.Module, device: torch.device, bucket_cap_mb: float) -> DistributedDataParallel:
    """Wrap `model` (already on `device`) for data parallelism over the default process group.

    DDP broadcasts rank 0's parameters and buffers at construction, so every replica starts equal.
    """
    device_ids = [device.index] if device.type == "cuda" else None
    # gradient_as_bucket_view: gradients live in the all-reduce buckets, saving a copy per step
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                                   gradient_as_bucket_view=True)
