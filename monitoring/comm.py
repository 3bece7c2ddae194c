"""Comm wait: the part of a step in which this rank's compute is blocked on a collective.

`CommClock` accumulates it per step, fed from three places:

- data parallel: a DDP comm hook marks when each gradient bucket's all-reduce is launched. The
  last launch is the end of the backward computation (the last gradients just became ready);
  from then until backward returns (DDP waits for every bucket there) the rank only waits.
- tensor parallel: DTensor's collectives go through torch's functional collectives; wrappers
  time each launch and each wait (the wait may come later, at the output's first use).
- gradient averaging (hybrid) and the clipping norm's all-reduce: timed where they run.

`inject.comm_delay_ms` (a test knob) adds that much latency to every timed collective, so the
measurement can be checked against a known delay. Timing on the host costs two clock reads
per collective; on CUDA, where the host runs ahead of the device, spans are CUDA events that
are resolved once per report, not per step.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist


class CommClock:
    def __init__(self, device: torch.device, delay_ms: float = 0.0):
        self.cuda = device.type == "cuda"
        self.delay_s = delay_ms / 1000.0
        self.wait = 0.0  # seconds blocked in this step (host timing)
        self.calls = 0  # collectives timed in this step
        self._spans: list = []  # CUDA (start, end) event pairs of this step
        self._last_launch = None
        self.link: tuple[float, float] | None = None  # simulated link: (bytes/s, latency s)
        self.tp_slow = self.dp_slow = False  # whether this rank's tp / dp group spans simulated nodes

    def simulate_link(self, mb_per_s: float, latency_ms: float, tp_slow: bool, dp_slow: bool) -> None:
        """`inject.link`: a collective whose group spans simulated nodes takes bytes / B + L longer."""
        self.link = (mb_per_s * 1e6, latency_ms / 1000.0)
        self.tp_slow, self.dp_slow = tp_slow, dp_slow

    def extra_delay(self, nbytes: int, slow: bool) -> float:
        """Seconds the test knobs add to one collective of `nbytes` on a group (slow: spans nodes)."""
        delay = self.delay_s
        if slow and self.link is not None:
            delay += nbytes / self.link[0] + self.link[1]
        return delay

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

    def take(self) -> tuple[object, int]:
        """This step's comm wait (seconds, or CUDA spans to resolve later) and call count; resets."""
        wait = self._spans if self.cuda else self.wait
        calls = self.calls
        self.wait, self.calls, self._spans, self._last_launch = 0.0, 0, [], None
        return wait, calls

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

    @contextlib.contextmanager
    def blocked(self, nbytes: int = 0, slow: bool = False):
        """Time a region that only waits on one collective (run synchronously on this thread)."""
        start = self.mark()
        try:
            yield
            delay = self.extra_delay(nbytes, slow)
            if delay:
                time.sleep(delay)
        finally:
            self.add(start, self.mark())
            self.calls += 1

    def dp_blocked(self, nbytes: int = 0):
        return self.blocked(nbytes, self.dp_slow)

    def tp_blocked(self, nbytes: int = 0):
        return self.blocked(nbytes, self.tp_slow)

    # ------------------------------------------------------------ data parallel

    def ddp_hook(self, process_group, bucket):
        """A DDP comm hook: DDP's default all-reduce (scale by 1/world, then sum; multiplying by
        the reciprocal as DDP does, so the result is bit for bit the same), with the last
        bucket's launch marked: from there on backward computes nothing more."""
        if bucket.is_last():
            self._last_launch = self.mark()
        self.calls += 1
        group = process_group or dist.group.WORLD
        tensor = bucket.buffer()
        tensor.mul_(1.0 / dist.get_world_size(group))
        fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
        delay = self.extra_delay(tensor.numel() * tensor.element_size(), self.dp_slow)

        def done(f):
            # the injected latency is part of the collective. On gloo this runs on the
            # communication thread once the all-reduce completes; an NCCL future is complete
            # at launch, so there it delays the launching thread
            if delay:
                time.sleep(delay)
            return f.value()[0]

        return fut.then(done)

    def after_backward(self) -> None:
        """Called once backward returned: the wait since the last bucket's launch is comm wait."""
        if self._last_launch is not None:
            self.add(self._last_launch, self.mark())
            self._last_launch = None


# ---------------------------------------------------------------- tensor parallel

_ACTIVE: CommClock | None = None
# Some functional collectives call others (all_gather_tensor calls all_gather_single, which may
# wait inside): only the outermost call is timed, or its time would count twice.
_DEPTH = 0
_LAUNCHES = ("all_reduce", "all_gather_tensor", "all_gather_single", "reduce_scatter_tensor",
             "reduce_scatter_single", "all_to_all_single", "broadcast")


def _timed_launch(orig):
    def launch(*args, **kwargs):
        global _DEPTH
        clock = _ACTIVE
        if clock is None or _DEPTH:
            return orig(*args, **kwargs)
        _DEPTH += 1
        try:
            start = clock.mark()
            out = orig(*args, **kwargs)
            # DTensor's collectives here are those of the tensor-parallel mesh dimension
            sent = args[0] if args and isinstance(args[0], torch.Tensor) else None
            delay = clock.extra_delay(sent.numel() * sent.element_size() if sent is not None else 0, clock.tp_slow)
            if delay:
                time.sleep(delay)
            clock.add(start, clock.mark())
            clock.calls += 1
        finally:
            _DEPTH -= 1
        return out

    launch.__wrapped__ = orig
    return launch


def _timed_wait(orig):
    def wait_tensor(tensor):
        global _DEPTH
        clock = _ACTIVE
        if clock is None or _DEPTH:
            return orig(tensor)
        _DEPTH += 1
        try:
            start = clock.mark()
            out = orig(tensor)
            clock.add(start, clock.mark())
        finally:
            _DEPTH -= 1
        return out

    wait_tensor.__wrapped__ = orig
    return wait_tensor


def time_functional_collectives(clock: CommClock | None) -> None:
    """Route the functional collectives that DTensor uses through `clock` (None: stop timing).

    The wrappers stay installed for the life of the process (one worker per process) and cost
    one global read when no clock is active; DTensor looks the functions up on the module at
    each call, so wrapping the module attributes reaches every collective it issues."""
    global _ACTIVE
    import torch.distributed._functional_collectives as funcol

    if not getattr(funcol, "_gearshift_timed", False):
        for name in _LAUNCHES:
            if hasattr(funcol, name):
                setattr(funcol, name, _timed_launch(getattr(funcol, name)))
        funcol.wait_tensor = _timed_wait(funcol.wait_tensor)
        funcol._gearshift_timed = True
    _ACTIVE = clock
