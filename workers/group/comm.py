"""The route a layout's collectives take on this worker: through the comm clock (timing, when
telemetry is on) and the simulated network (delays, when the job asks for one). A `Parallel`
calls these at its collectives without knowing which of the two is there."""

from __future__ import annotations

import contextlib

from gearshift.monitoring.comm import CommClock, time_functional_collectives
from gearshift.workers.group.simnet import SimulatedNetwork, delay_functional_collectives


class CommRoute:
    def __init__(self, clock: CommClock | None, net: SimulatedNetwork | None):
        self.clock, self.net = clock, net

    def ddp_hook(self, default):
        """DDP's all-reduce, delayed, then timed; None when neither is wanted (DDP's own runs)."""
        hook = default
        if self.net is not None:
            hook = self.net.ddp_hook(hook)
        if self.clock is not None:
            hook = self.clock.timed_ddp_hook(hook)
        return hook if hook is not default else None

    @contextlib.contextmanager
    def blocked(self, nbytes: int, dim: str):
        with self.clock.blocked() if self.clock is not None else contextlib.nullcontext():
            with self.net.blocked(nbytes, dim) if self.net is not None else contextlib.nullcontext():
                yield

    @contextlib.contextmanager
    def idle(self):
        """Around a wait that carries no bytes of its own (a pipeline's send waiting for its
        peer to take it): comm wait, with no simulated link delay."""
        with self.clock.blocked() if self.clock is not None else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def delayed(self, nbytes: int, dim: str):
        if self.clock is not None:
            self.clock.calls += 1
        with self.net.blocked(nbytes, dim) if self.net is not None else contextlib.nullcontext():
            yield

    def launched(self, dim: str) -> None:
        if self.clock is not None:
            self.clock.calls += 1

    def delay_s(self, nbytes: int, dim: str) -> float:
        """How much later an asynchronous collective completes on the simulated link."""
        return self.net.delay(nbytes, dim) if self.net is not None else 0.0

    def waiting(self):
        return self.clock.waiting() if self.clock is not None else contextlib.nullcontext()

    def pipe(self, bubble_s: float, link_s: float) -> None:
        if self.clock is not None:
            self.clock.add_pipe(bubble_s, link_s)

    def hidden(self, hidden_s: float, waited_s: float) -> None:
        if self.clock is not None and not self.clock.cuda:  # host times: meaningless where the host runs ahead
            self.clock.add_hidden(hidden_s, waited_s)

    def functional(self, active: bool) -> None:
        # the delay wrappers go in first, so the timing wrappers (outside them) see the delay
        delay_functional_collectives(self.net if active else None)
        time_functional_collectives(self.clock if active else None)

    @staticmethod
    def off() -> None:
        """No clock or delay on DTensor's collectives in this process (a worker shutting down)."""
        delay_functional_collectives(None)
        time_functional_collectives(None)
