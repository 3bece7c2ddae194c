"""Comm wait under FSDP2 where its collectives run on streams of their own (CUDA): only the
compute stream's waits on a collective's event count (strategies/stream_waits.py).

No GPU here: the streams are stand-ins that behave as CUDA's do where it matters (an event
recorded on a stream; `stream.wait_event(e)` is `e.wait(stream)`; `wait_stream` waits on an
event the other stream records). First the rule alone, then FSDP2's own code driving it on two
gloo processes."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import pytest
import torch

from gearshift.strategies import stream_waits
from test_fsdp import BATCH, batches, loss_of, spawn_gloo, tiny_gpt


class FakeEvent:
    def record(self, stream=None):
        self.stream = stream

    def wait(self, stream=None):
        pass


class FakeStream:
    def __init__(self, name="compute"):
        self.name = name

    def record_event(self, event=None):
        event = event if event is not None else FakeEvent()
        event.record(self)
        return event

    def wait_event(self, event):
        if event is not None:
            event.wait(self)

    def wait_stream(self, stream):
        self.wait_event(stream.record_event())


class FakeStreams:
    """StreamWaits' device side on the CPU: torch.cpu's current stream and stream context."""

    def __init__(self):
        self.Stream, self.Event = stream_waits.timed_types(FakeStream, FakeEvent)

    def wrap(self, stream):
        return self.Stream(getattr(stream, "name", "comm"))

    current_stream = staticmethod(torch.cpu.current_stream)
    stream = staticmethod(torch.cpu.stream)


class Ctx:
    """FSDP2's communication context as far as StreamWaits uses it."""

    def lazy_init(self, device=None):
        for name in stream_waits.COMM_STREAMS:
            setattr(self, name, FakeStream(name))


class RecordingComm:
    """A comm route that records each timed wait (the stream current at the time, and which
    FSDP2 function waited), each blocked span and each counted-and-delayed collective."""

    def __init__(self):
        self.waits, self.blocks, self.delays = [], 0, 0

    def ddp_hook(self, default):
        return None

    def functional(self, active):
        pass

    @contextlib.contextmanager
    def waiting(self):
        frames, f = [], sys._getframe(1)
        while f is not None and len(frames) < 12:
            frames.append(f.f_code.co_name)
            f = f.f_back
        self.waits.append({"stream": getattr(torch.cpu.current_stream(), "name", "compute"), "frames": frames})
        yield

    @contextlib.contextmanager
    def blocked(self, nbytes, dim):
        self.blocks += 1
        yield

    @contextlib.contextmanager
    def delayed(self, nbytes, dim):
        self.delays += 1
        yield


# ---------------------------------------------------------------- the rule alone

def _waits():
    ctx = Ctx()
    waits = stream_waits.StreamWaits(ctx, FakeStreams())
    ctx.lazy_init()  # FSDP2 makes its streams at the first forward; they are taken over right after
    return ctx, waits


def test_only_the_compute_streams_waits_on_collective_events_count():
    ctx, waits = _waits()
    comm = RecordingComm()
    waits.comm = comm
    compute = torch.cpu.current_stream()
    gathered = ctx.all_gather_stream.record_event()  # a collective's end, as FSDP2 records it
    reduced = ctx.reduce_scatter_stream.record_event()
    plain = FakeStream("compute").record_event()  # recorded on a stream that is not FSDP2's

    compute.wait_event = lambda e: e.wait(compute)  # torch.cuda.Stream.wait_event is e.wait(self)
    compute.wait_event(gathered)
    compute.wait_event(reduced)
    assert len(comm.waits) == 2
    assert all(w["stream"] == "compute" for w in comm.waits)  # marks on the stream that waits
    ctx.all_reduce_stream.wait_event(reduced)  # hsdp: one communication stream after another
    ctx.all_reduce_stream.wait_stream(ctx.reduce_scatter_stream)
    ctx.all_gather_copy_in_stream.wait_event(gathered)
    compute.wait_event(plain)
    assert len(comm.waits) == 2

    other = FakeStream("other")  # a wait by a stream that is not current: its marks go on it
    gathered.wait(other)
    assert len(comm.waits) == 3 and comm.waits[-1]["stream"] == "other"
    del compute.wait_event


def test_nothing_is_timed_without_a_route_or_a_wait_span():
    ctx, waits = _waits()
    event = ctx.all_gather_stream.record_event()
    event.wait(torch.cpu.current_stream())  # no route attached: a plain wait
    waits.comm = type("NoWaitSpan", (), {})()
    event.wait(torch.cpu.current_stream())
    assert not waits.counts(None)


def test_streams_made_before_the_route_are_taken_over_at_once():
    ctx = Ctx()
    ctx.lazy_init()
    first = ctx.all_gather_stream
    waits = stream_waits.StreamWaits(ctx, FakeStreams())
    assert ctx.all_gather_stream is not first and isinstance(ctx.all_gather_stream, waits.streams.Stream)
    assert ctx.all_gather_copy_in_stream.__class__ is FakeStream  # its events are copies, never a collective's end
    assert waits.active


def test_without_what_it_needs_the_host_spans_stay_with_a_note(monkeypatch, caplog):
    monkeypatch.setattr(stream_waits, "unsupported", lambda: "a torch without it")
    with caplog.at_level(logging.WARNING, logger="gearshift.comm"):
        assert stream_waits.for_root(None, torch.device("cuda"), streams=FakeStreams()) is None
    assert "a torch without it" in caplog.text and "host" in caplog.text
    assert stream_waits.for_root(None, torch.device("cpu")) is None  # gloo: the host spans are the wait

    class Bare:
        def lazy_init(self):
            pass

    ctx = Bare()
    waits = stream_waits.StreamWaits(ctx, FakeStreams())
    with caplog.at_level(logging.WARNING, logger="gearshift.comm"):
        ctx.lazy_init()  # a torch whose context names its streams otherwise
    assert not waits.active and "has no all_gather_copy_in_stream" in caplog.text


def test_this_torch_has_what_the_cuda_path_reads():
    assert stream_waits.unsupported() is None


# ---------------------------------------------------------------- FSDP2's own code on gloo

def _cuda_like_cpu_streams():
    """torch.cpu's stream (the compute stream here) waits as a CUDA stream does."""
    torch.cpu.Stream.wait_event = lambda self, e: e.wait(self) if e is not None else None
    torch.cpu.Stream.wait_stream = lambda self, s: self.wait_event(s.record_event())


def _fsdp_waits(rank, world, out_dir, strategy):
    from gearshift import strategies
    from gearshift.strategies import Layout

    _cuda_like_cpu_streams()
    layout = Layout.for_workers(strategy, world, None, shard_size=2 if strategy == "hsdp" else None)
    par = strategies.parallelize(tiny_gpt(), layout, None, strategies.Options(torch.device("cpu")))
    par._stream_waits = stream_waits.for_root(par.model, torch.device("cpu"), streams=FakeStreams())
    comm = RecordingComm()
    par.attach(comm)
    gather = type(par.model._get_fsdp_state()._fsdp_param_group._all_gather_comm)
    opt = torch.optim.Adam(par.param_groups(), lr=1e-2)
    for x, y in batches(2):
        share = BATCH // layout.dp
        x, y = x[layout.dp_rank(rank) * share:][:share], y[layout.dp_rank(rank) * share:][:share]
        opt.zero_grad(set_to_none=True)
        loss_of(par.module, x, y).backward()
        opt.step()
    par.detach()
    groups = [m._get_fsdp_state()._fsdp_param_group for m in par.model.modules()
              if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None]
    with open(os.path.join(out_dir, f"{strategy}{rank}.json"), "w") as f:
        json.dump({"waits": comm.waits, "blocks": comm.blocks, "delays": comm.delays, "units": len(groups),
                   "gather_type": gather.__name__}, f)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "hsdp"])
def test_fsdp2_code_times_what_compute_waits_for(tmp_path, strategy):
    world = 2 if strategy == "fsdp" else 4
    spawn_gloo(_fsdp_waits, world, (str(tmp_path), strategy), timeout_s=150)
    for r in range(world):
        res = json.loads((tmp_path / f"{strategy}{r}.json").read_text())
        assert res["gather_type"] == "_TimedAllGather"
        assert res["blocks"] == 0  # nothing timed around a launch: the collectives only count
        assert res["delays"] > 0
        waits = res["waits"]
        assert all(w["stream"] == "compute" for w in waits), waits  # never a communication stream waiting
        where = [next((n for n in w["frames"] if n in (
            "foreach_all_gather_copy_out", "post_backward", "finalize_backward",
            "_root_post_backward_final_callback")), None) for w in waits]
        assert None not in where, [w["frames"] for w, n in zip(waits, where) if n is None]
        copy_outs = where.count("foreach_all_gather_copy_out")
        # every unit gathered in each forward, each resharded one again in backward: each all-gather
        # is waited for by compute exactly once
        all_gathers = res["delays"] - _reduces(res, strategy)
        assert copy_outs == all_gathers and copy_outs >= 2 * res["units"], (copy_outs, all_gathers, res["units"])
        # the reduce-scatters (and hsdp's all-reduces) are waited for at the end of each backward
        assert {"finalize_backward", "_root_post_backward_final_callback"} & set(where)


def _reduces(res, strategy) -> int:
    """Reduce-scatters counted over the 2 steps (one per unit per backward), and hsdp's all-reduces."""
    per_step = res["units"] * (2 if strategy == "hsdp" else 1)
    return 2 * per_step
