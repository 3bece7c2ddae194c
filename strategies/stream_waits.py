"""Comm wait under FSDP2 on CUDA: the time the compute stream stands still waiting for a collective.

FSDP2 runs its all-gathers, reduce-scatters and hsdp's all-reduces on streams of its own (the
root's communication context: `all_gather_stream`, `reduce_scatter_stream`, `all_reduce_stream`)
and records an event on that stream after each; the compute stream waits for such an event only
where it needs the result (`current_stream().wait_event(...)`: the all-gather's copy-out in
`foreach_all_gather_copy_out`, the oldest reduce-scatter's buffer in `post_backward`, every reduce
at the end of backward in `finalize_backward` and the root's final callback). A prefetched
all-gather that finished behind compute costs nothing there; one still running costs exactly
what the compute stream waits. So that wait is what is measured, and nothing else:

- the communication streams are replaced, once FSDP2 has made them, by objects of a Stream
  subclass on the same device streams, whose `record_event()` returns a `_WaitTimedEvent`;
- `Stream.wait_event(event)` is `event.wait(stream)` in torch (checked by `unsupported`), so
  every wait on one of those events reaches `_WaitTimedEvent.wait`; when the stream that waits is
  not one of FSDP2's communication streams (it is the compute stream), the wait is bracketed by
  two timing events recorded on that stream, which the comm clock resolves with the step's
  report: their distance is how long that stream stood still for the collective (nothing else
  is queued between them). Waits of one communication stream on another (hsdp's all-reduce after
  its reduce-scatter) are not compute waiting, and are not counted.

This leans on private names of FSDP2 (the communication context's stream attributes and its
`lazy_init`), read in torch 2.13's `_fsdp_param_group.py`; `unsupported()` says when they are
not there, and the layout then keeps the host-side spans with a logged note. Not yet run on a
GPU: what runs on CPU is this logic with stand-in streams (tests/test_stream_waits.py), driven by
FSDP2's own code on gloo.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

log = logging.getLogger("gearshift.comm")

# the communication context's streams: those whose events count when compute waits for them, and
# the copy-in stream (compute-side work of the all-gather, never a collective's end)
TIMED_STREAMS = ("all_gather_stream", "reduce_scatter_stream", "all_reduce_stream")
COMM_STREAMS = ("all_gather_copy_in_stream",) + TIMED_STREAMS


def unsupported() -> str | None:
    """Why the compute stream's waits cannot be timed with this torch (None: they can)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPCommContext
    except ImportError as err:
        return f"FSDP2's communication context is not where torch 2.13 has it ({err})"
    if not callable(getattr(FSDPCommContext, "lazy_init", None)):
        return "FSDP2's communication context has no lazy_init"
    try:
        waits_via_event = "event.wait(self)" in inspect.getsource(torch.cuda.Stream.wait_event)
    except (OSError, TypeError):
        waits_via_event = False
    if not waits_via_event:
        return "torch.cuda.Stream.wait_event no longer goes through Event.wait"
    return None


def timed_types(stream_base: type, event_base: type):
    """A Stream subclass whose recorded events time the waits on them, and that event type."""

    class _WaitTimedEvent(event_base):
        waits: "StreamWaits | None" = None

        def wait(self, stream=None):
            waits = self.waits
            if waits is None or not waits.counts(stream):
                return super().wait(stream)
            with waits.timing(stream):
                return super().wait(stream)

    class _WaitTimedStream(stream_base):
        waits: "StreamWaits | None" = None

        def record_event(self, event=None):
            if event is None:
                event = _WaitTimedEvent()
                event.waits = self.waits
            return super().record_event(event)

    return _WaitTimedStream, _WaitTimedEvent


class CudaStreams:
    """The CUDA side of StreamWaits (a stand-in replaces it in the CPU tests)."""

    def __init__(self):
        self.Stream, self.Event = timed_types(torch.cuda.Stream, torch.cuda.Event)

    def wrap(self, stream):
        # the same device stream (same priority) as FSDP2 made, seen through the subclass
        return self.Stream(stream_id=stream.stream_id, device_index=stream.device_index,
                           device_type=stream.device_type)

    current_stream = staticmethod(torch.cuda.current_stream)
    stream = staticmethod(torch.cuda.stream)


class StreamWaits:
    """The compute stream's waits on one FSDP2 root's collectives, timed through `comm` (its
    `waiting()` span) while a comm route is attached."""

    def __init__(self, ctx, streams):
        self.ctx, self.streams = ctx, streams
        self.comm = None
        self.comm_streams: list = []
        self.failed: str | None = None  # why the streams could not be taken over (then nothing is timed)
        if all(hasattr(ctx, n) for n in COMM_STREAMS):
            self._take_over()
        else:  # FSDP2 makes its streams at the first forward (the root's lazy init)
            made = ctx.lazy_init

            def lazy_init(*args, **kwargs):
                out = made(*args, **kwargs)
                self._take_over()
                return out

            ctx.lazy_init = lazy_init

    @property
    def active(self) -> bool:
        return self.failed is None

    def _take_over(self) -> None:
        missing = [n for n in COMM_STREAMS if not hasattr(self.ctx, n)]
        if missing:
            self.failed = f"FSDP2's communication context has no {', '.join(missing)}"
            log.warning("comm wait under FSDP: %s; timing the collectives on the host instead", self.failed)
            return
        for name in TIMED_STREAMS:
            stream = getattr(self.ctx, name)
            if not isinstance(stream, self.streams.Stream):
                stream = self.streams.wrap(stream)
                stream.waits = self
                setattr(self.ctx, name, stream)
        self.comm_streams = [getattr(self.ctx, n) for n in COMM_STREAMS]

    def counts(self, waiter) -> bool:
        """Whether a wait by `waiter` (None: the current stream) is compute waiting for a
        collective: a route is attached and the waiting stream is none of FSDP2's own."""
        if self.comm is None or getattr(self.comm, "waiting", None) is None:
            return False
        waiter = self.streams.current_stream() if waiter is None else waiter
        return not any(waiter == s for s in self.comm_streams)

    def timing(self, waiter):
        """The comm route's wait span, its marks recorded on `waiter`."""
        if waiter is None or waiter == self.streams.current_stream():
            return self.comm.waiting()
        stack = contextlib.ExitStack()
        stack.enter_context(self.streams.stream(waiter))
        stack.enter_context(self.comm.waiting())
        return stack


def for_root(root, device: torch.device, streams=None) -> StreamWaits | None:
    """StreamWaits for an FSDP2 root on `device`, or None where the host-side spans are right
    (CPU, gloo: the collectives block the thread) or the waits cannot be taken over (logged)."""
    if device.type != "cuda" and streams is None:
        return None
    why = unsupported()
    if why is None:
        ctx = getattr(root._get_fsdp_state(), "_comm_ctx", None)
        why = None if ctx is not None else "the FSDP2 root has no communication context"
    if why is not None:
        log.warning("comm wait under FSDP: %s; timing the collectives on the host instead (on CUDA that counts "
                    "prefetched all-gathers as waiting)", why)
        return None
    return StreamWaits(ctx, streams or CudaStreams())
