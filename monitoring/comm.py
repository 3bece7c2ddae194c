"""Comm wait: the part of a step in which this rank's compute is blocked on a collective.

`CommClock` accumulates it per step, fed from three places:

- data parallel: a DDP comm hook marks when each gradient bucket's all-reduce is launched. The
  last launch is the end of the backward computation (the last gradients just became ready);
  from then until backward returns (DDP waits for every bucket there) the rank only waits.
- tensor parallel: DTensor's collectives go through torch's functional collectives; wrappers
  time each launch and each wait (the wait may come later, at the output's first use).
- hybrid's data-parallel average: its buckets are all-reduced asynchronously as backward
  produces them (strategies/grads.py OverlappedAverager); only the wait after backward for
  those still in flight is comm wait, and the time they ran behind backward is counted apart
  as hidden (host timing: the span from each launch to its completion, outside that wait).
- the clipping norm's all-reduce: timed where it runs.

The simulated network (`inject.*`, workers/group/simnet.py) delays collectives from inside these
timed spans, so a known delay shows up as measured wait; the clock itself knows nothing of it.
Timing on the host costs two clock reads per collective; on CUDA, where the host runs ahead of the device, spans are CUDA events that
are resolved once per report, not per step.
"""

from __future__ import annotations

import contextlib
import time

import torch


class CommClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.wait = 0.0  # seconds blocked in this step (host timing)
        self.calls = 0  # collectives timed in this step
        # where a layout can tell (hybrid's overlapped average): seconds its asynchronous collectives
        # ran behind compute in this step, and seconds this rank then waited for them
        self.hidden, self.hidden_waited = 0.0, 0.0
        self._spans: list = []  # CUDA (start, end) event pairs of this step
        self._last_launch = None
        self._timed_hidden = False
        # a pipeline's stage (strategies/pipeline/parallel.py): seconds of this step's comm wait it
        # spent idle for lack of work (the bubble) and on the link (the transfers); None: no pipeline
        self.pipe: list[float] | None = None

    # ------------------------------------------------------------ the step's bookkeeping

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, start, end) -> None:
        if self.cuda:
            self._spans.append((start, end))
        else:
            self.wait += end - start

    def take(self) -> tuple[object, int, tuple[float, float] | None, tuple[float, float] | None]:
        """This step's comm wait (seconds, or CUDA spans to resolve later), call count, (hidden
        seconds, seconds waited for those collectives) and a pipeline's (bubble, link) seconds,
        each None where nothing was measured; resets."""
        wait = self._spans if self.cuda else self.wait
        calls, hidden = self.calls, (self.hidden, self.hidden_waited) if self._timed_hidden else None
        pipe = tuple(self.pipe) if self.pipe is not None else None
        self.wait, self.calls, self._spans, self._last_launch = 0.0, 0, [], None
        self.hidden, self.hidden_waited, self._timed_hidden, self.pipe = 0.0, 0.0, False, None
        return wait, calls, hidden, pipe

    def add_pipe(self, bubble_s: float, link_s: float) -> None:
        """A pipeline stage's wait for a peer: idle for lack of work, and on the link."""
        if self.pipe is None:
            self.pipe = [0.0, 0.0]
        self.pipe[0] += bubble_s
        self.pipe[1] += link_s

    @staticmethod
    def resolve(wait) -> float:
        """Seconds from what `take` returned (waits for the CUDA events to complete)."""
        if isinstance(wait, list):
            total = 0.0
            for start, end in wait:
                end.synchronize()
                total += start.elapsed_time(end) / 1000.0
            return total
        return wait

    def add_hidden(self, hidden_s: float, waited_s: float) -> None:
        self.hidden += hidden_s
        self.hidden_waited += waited_s
        self._timed_hidden = True

    @contextlib.contextmanager
    def waiting(self):
        """Time a wait for collectives launched earlier (counted at their launch)."""
        start = self.mark()
        try:
            yield
        finally:
            self.add(start, self.mark())

    @contextlib.contextmanager
    def blocked(self):
        """Time a region that only waits on one collective (run synchronously on this thread)."""
        start = self.mark()
        try:
            yield
        finally:
            self.add(start, self.mark())
            self.calls += 1

    # ------------------------------------------------------------ data parallel

    def timed_ddp_hook(self, inner):
        """A DDP comm hook around `inner` that marks the last bucket's launch: from there on
        backward computes nothing more, so the rest until backward returns is comm wait."""

        def hook(process_group, bucket):
            if bucket.is_last():
                self._last_launch = self.mark()
            self.calls += 1
            return inner(process_group, bucket)

        return hook

    def after_backward(self) -> None:
        """Called once backward returned: the wait since the last bucket's launch is comm wait."""
        if self._last_launch is not None:
            self.add(self._last_launch, self.mark())
            self._last_launch = None


# ---------------------------------------------------------------- tensor parallel

_ACTIVE: CommClock | None = None
LAUNCHES = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
            "reduce_scatter_single", "all_to_all_single", "broadcast")


def _outermost(orig, depth: list[int], active, around):
    """`orig` run through `around(thing, orig, args, kwargs)` while `active()` returns a thing.
    Some functional collectives call others (all_gather_tensor calls all_gather_single, which may
    wait inside): only the outermost call of a family (`depth` is shared) goes through `around`,
    or its time would count twice."""

    def call(*args, **kwargs):
        thing = active()
        if thing is None or depth[0]:
            return orig(*args, **kwargs)
        depth[0] += 1
        try:
            return around(thing, orig, args, kwargs)
        finally:
            depth[0] -= 1

    call.__wrapped__ = orig
    return call


def wrap_functional_collectives(flag: str, active, around_launch, around_wait=None) -> None:
    """Wrap DTensor's functional collectives once per process (`flag` marks it done). DTensor
    looks the functions up on the module at each call, so wrapping the module attributes
    reaches every collective it issues; a wrapper costs one call of `active()` while inactive."""
    import torch.distributed._functional_collectives as funcol

    if getattr(funcol, flag, False):
        return
    depth = [0]
    for name in LAUNCHES:
        if hasattr(funcol, name):
            setattr(funcol, name, _outermost(getattr(funcol, name), depth, active, around_launch))
    if around_wait is not None:  # the wait may come later, at the output's first use
        funcol.wait_tensor = _outermost(funcol.wait_tensor, depth, active, around_wait)
    setattr(funcol, flag, True)


def _time_launch(clock: CommClock, orig, args, kwargs):
    start = clock.mark()
    out = orig(*args, **kwargs)
    clock.add(start, clock.mark())
    clock.calls += 1
    return out


def _time_wait(clock: CommClock, orig, args, kwargs):
    start = clock.mark()
    out = orig(*args, **kwargs)
    clock.add(start, clock.mark())
    return out


def time_functional_collectives(clock: CommClock | None) -> None:
    """Route the functional collectives that DTensor uses through `clock` (None: stop timing).

    The wrappers stay installed for the life of the process (one worker per process). The
    simulated network's own wrappers are installed first (workers/group/simnet.py), so these time
    the delay they add."""
    global _ACTIVE
    wrap_functional_collectives("_gearshift_timed", lambda: _ACTIVE, _time_launch, _time_wait)
    _ACTIVE = clock
