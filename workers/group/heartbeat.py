"""What a worker is doing, told apart from its step reports.

A worker's training thread can be busy for minutes on healthy work (a first torch.compile, NCCL's
start-up, a checkpoint inside the step loop, a slow first step) and sends no report meanwhile.
`TrainWorker.heartbeat` runs on the actor's "control" thread, which that work does not block, and
answers from `ACTIVITY`: the step, the phase, how long since the last step ended and how long the
worker has been inside a collective that it waits on itself. The training thread only writes a
few attributes (under the GIL, so a reader sees each value whole); nothing here is on the step's
path beyond that.

One worker per process (a Ray actor), so the record is the process's own: a model's code, a
layout or a test fixture can say "inside a collective" with `ACTIVITY.collective()` without being
handed the worker.
"""

from __future__ import annotations

import contextlib
import functools
import time


class Activity:
    def __init__(self):
        now = time.monotonic()
        self.phase, self.phase_at = "starting", now
        self.step, self.step_at = 0, now
        self.collective_at: float | None = None  # when the outermost collective being waited on began
        self._depth = 0

    @contextlib.contextmanager
    def phase_of(self, phase: str):
        """`phase` while the block runs, the one before it afterwards (phases nest: a checkpoint
        taken inside the step loop is back to "step" when it ends)."""
        before = self.phase, self.phase_at
        self.phase, self.phase_at = phase, time.monotonic()
        try:
            yield
        finally:
            self.phase, self.phase_at = before

    def set_phase(self, phase: str) -> None:
        self.phase, self.phase_at = phase, time.monotonic()

    def stepped(self, step: int) -> None:
        """A step ended: `step` steps are done."""
        self.step, self.step_at = step, time.monotonic()

    def progressed(self) -> None:
        """Progress without a step (a training chunk begins): the clock since the last step
        starts again, so idle time between chunks does not count against the next one."""
        self.step_at = time.monotonic()

    @contextlib.contextmanager
    def collective(self):
        """Waiting on a collective: a wait that only a peer (or the network) can end. Nested
        waits count from the outermost."""
        if self._depth == 0:
            self.collective_at = time.monotonic()
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0:
                self.collective_at = None

    def beat(self, rank: int) -> dict:
        """The heartbeat's answer. Times are seconds, measured here (no clocks compared across
        machines)."""
        now = time.monotonic()
        inside = self.collective_at
        return {"rank": rank, "step": self.step, "phase": self.phase, "phase_s": round(now - self.phase_at, 3),
                "since_step_s": round(now - self.step_at, 3),
                "in_collective_s": None if inside is None else round(now - inside, 3)}


ACTIVITY = Activity()


def in_phase(phase: str):
    """A worker method that runs as `phase` (for a method called apart from the step loop)."""

    def wrap(method):
        @functools.wraps(method)
        def run(*args, **kwargs):
            with ACTIVITY.phase_of(phase):
                return method(*args, **kwargs)

        return run

    return wrap
