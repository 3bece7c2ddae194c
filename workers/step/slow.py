"""inject.slow: a simulated straggler, for trying adapt.stragglers on one machine (as
workers/group/simnet.py simulates a slow network)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping
from statistics import median


class SlowRank:
    """inject.slow: this worker, if named, computes `factor` times as long over its steps. Before a
    step's forward it sleeps (factor - 1) x its samples x the median time a sample of its last
    steps' forward and backward took: a smaller share shortens the sleep as it would a slower
    device's compute, and one noisy step does not carry over. The sleep comes before any gradient
    exists, so the peers wait for it in their comm wait and it counts as this worker's compute.
    Host-timed: on a GPU it follows the launches, not the kernels (a CPU run is what it simulates
    faithfully)."""

    def __init__(self, spec: Mapping):
        self.ranks, self.factor = set(spec["ranks"]), float(spec["factor"])
        self.first, self.last = spec.get("from_step", 0), spec.get("to_step")
        self.per_sample: deque = deque(maxlen=9)

    def before_compute(self, rank: int, step: int, samples: int) -> None:
        if rank in self.ranks and self.per_sample and step >= self.first and (self.last is None or step < self.last):
            time.sleep((self.factor - 1) * samples * median(self.per_sample))

    def computed(self, seconds: float, samples: int) -> None:
        self.per_sample.append(seconds / max(1, samples))
