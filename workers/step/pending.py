"""What a worker's step loop keeps between two reports: the steps' losses and found-inf flags
(still on the device, so a step never waits for a device-to-host copy), their times and comm
spans; and whether the optimizer skips a step on the device itself."""

from __future__ import annotations

import time

import torch

from gearshift.monitoring.comm import CommClock


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` takes a found-inf flag and skips the update on the device (torch's
    fused kernels, as GradScaler uses them)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False) and optimizer.defaults.get("fused"))


class PendingSteps:
    """The steps since the last report: losses (still on the device), times and comm spans."""

    def __init__(self, first: int, clock: CommClock | None):
        self.first, self.clock = first, clock
        self.losses: list[torch.Tensor] = []
        self.times: list[float] = []
        self.ends: list[float] = []
        self.lrs: list[float] = []
        self.found: list[tuple[int, torch.Tensor]] = []  # (index, found-inf flag) of steps checked on the device
        self.spans: list = []
        self.started = self.t_prev = time.perf_counter()
        self.step_start = clock.mark() if clock else None

    def add(self, loss: torch.Tensor, data_span, lr: float, found: torch.Tensor | None = None) -> None:
        now = time.perf_counter()
        if found is not None:
            self.found.append((len(self.losses), found))
        self.losses.append(loss)
        self.lrs.append(lr)
        self.times.append(now - self.t_prev)
        self.ends.append(time.time())  # wall clock: steps line up across processes and tools
        self.t_prev = now
        if self.clock:
            step_end = self.clock.mark()
            self.spans.append(((self.step_start, step_end), data_span, self.clock.take()))
            self.step_start = step_end

    def age(self) -> float:
        return self.t_prev - self.started

    def skipped_on_device(self, losses: list[float]) -> list[int]:
        """The steps (counted from 1) whose update the device skipped for a non-finite gradient;
        their flags come to the host in one copy, after the losses' (`report` made that one)."""
        if not self.found:
            return []
        flags = torch.stack([f for _, f in self.found]).tolist()
        return [self.first + i + 1 for (i, _), flag in zip(self.found, flags) if flag]

    def report(self, rank: int) -> dict:
        return {"rank": rank, "first_step": self.first, "losses": torch.stack(self.losses).float().tolist(),
                "step_times": self.times, "step_ends": self.ends, "lrs": self.lrs}
