"""An input-bound dataset for bench/loop.py: every sample costs `delay_ms` of waiting (a stand-in
for decoding or reading from slow storage), so the step loop waits on its data unless loader
processes read ahead. Job: `data: {entrypoint: "slow_data:slow_vectors"}` with bench/ on the
job's search path."""

from __future__ import annotations

import time

import torch
from torch.utils.data import Dataset


class SlowVectors(Dataset):
    def __init__(self, size: int, features: int, classes: int, delay_ms: float, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(size, features, generator=g)
        self.targets = torch.randint(0, classes, (size,), generator=g)
        self.delay_s = delay_ms / 1000.0

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return self.inputs[i], self.targets[i]


def slow_vectors(size: int = 4096, features: int = 64, classes: int = 10, delay_ms: float = 2.0,
                 seed: int = 0) -> SlowVectors:
    return SlowVectors(size, features, classes, delay_ms, seed)
