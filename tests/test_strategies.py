"""Strategies on a real (one-process, gloo) process group."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from conftest import free_port
from strategies import data as data_strategy
from workers.models import mlp


@pytest.fixture
def process_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mb", [1.0, 7.5, 25.0])
def test_bucket_cap_mb_reaches_ddp(process_group, mb):
    ddp = data_strategy.apply(mlp(hidden=64), torch.device("cpu"), bucket_cap_mb=mb)
    assert ddp.bucket_bytes_cap == int(mb * 1024 * 1024)
    ddp(torch.randn(4, 784)).sum().backward()  # buckets work with gradients as bucket views
    assert all(p.grad is not None for p in ddp.parameters())
