"""TrainStream (orchestrator/cluster/stream.py) on a scripted world: which news of a lost node
reaches the driver first is a race, and under `fault.on_node_loss: elastic` every order of it ends
as a loss naming the lost ranks (the survivors go on in memory), never as a plain failure (a
restart from the checkpoint). Seen in a CI run on a real two-node cluster: a survivor's loop
failed before the lost node's polls did, the stream raised that failure, and the run restarted
where it should have shrunk.

Each rank's calls are fake Ray refs that resolve at scripted times of a fake clock; ray.wait
advances the clock by its timeout when nothing is ready, so no test waits in real time."""

from __future__ import annotations

import types

import pytest
import ray

from gearshift.orchestrator.cluster import stream as stream_mod
from gearshift.orchestrator.cluster.stream import HOLD_S, TrainStream
from gearshift.orchestrator.errors import WorkerFailed

NEVER = float("inf")


class Clock:
    def __init__(self):
        self.now = 0.0


class Ref:
    def __init__(self, clock: Clock, at: float, result):
        self.ready_at = max(clock.now, at)  # a call made after its answer's time answers at once
        self.result = result  # a value, or an exception to raise


class Call:
    def __init__(self, clock: Clock, answer):
        self.clock, self.answer = clock, answer  # answer(): (time, result)

    def options(self, **_):
        return self

    def remote(self, *_):
        at, result = self.answer()
        return Ref(self.clock, at, result)


def task_error(rank: int) -> ray.exceptions.RayTaskError:
    return ray.exceptions.RayTaskError("run_train", f"Traceback: rank {rank}", RuntimeError(f"rank {rank} failed"))


class Rank:
    """One rank's script. `ends`: when its loop ends (NEVER: blocked in a collective until its
    timeout); `dropped`: its loop ends with a step_failed report (else with none); `raises`: its
    run_train raises; `dies`: Ray fails its calls from then on; `answers`: its heartbeat answers
    after this long (NEVER: its node is silent)."""

    def __init__(self, clock: Clock, rank: int, ends=NEVER, dropped=True, raises=False, dies=NEVER, answers=0.01):
        self.clock, self.rank = clock, rank
        self.ends, self.dropped, self.raises, self.dies, self.answers = ends, dropped, raises, dies, answers
        self.polled = False
        self.run_train = Call(clock, self._run)
        self.take_reports = Call(clock, self._poll)
        self.heartbeat = Call(clock, self._beat)

    def _dead(self):
        return ray.exceptions.RayActorError()

    def _run(self):
        if self.dies < self.ends:
            return self.dies, self._dead()
        return self.ends, task_error(self.rank) if self.raises else None

    def _poll(self):
        if self.dies < min(self.ends, self.clock.now + 1.0):
            return self.dies, self._dead()
        if self.ends <= self.clock.now + 1.0 and not self.polled:
            self.polled = True
            reports = [{"rank": self.rank, "step_failed": {"rank": self.rank, "step": 5}}] if self.dropped else []
            return self.ends, (reports, True)
        return self.clock.now + 1.0, ([], False)  # an empty poll comes back after POLL_S

    def _beat(self):
        if self.dies <= self.clock.now + self.answers:
            return max(self.dies, self.clock.now), self._dead()
        return self.clock.now + self.answers, {"rank": self.rank, "step": 4, "phase": "step"}


@pytest.fixture
def world(monkeypatch):
    clock = Clock()

    def wait(refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.ready_at <= clock.now]
        if len(ready) < num_returns:
            soonest = min((r.ready_at for r in refs if r.ready_at > clock.now), default=NEVER)
            clock.now = min(clock.now + (timeout if timeout is not None else NEVER), soonest)
            ready = [r for r in refs if r.ready_at <= clock.now]
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def get(ref, timeout=None):
        if ref.ready_at > clock.now:
            if timeout is not None and ref.ready_at > clock.now + timeout:
                clock.now += timeout
                raise ray.exceptions.GetTimeoutError()
            clock.now = ref.ready_at
        if isinstance(ref.result, BaseException):
            raise ref.result
        return ref.result

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(stream_mod.time, "monotonic", lambda: clock.now)

    def run(ranks: list[Rank], elastic: bool = True):
        job = types.SimpleNamespace(on_node_loss="elastic" if elastic else "restart",
                                    fault=types.SimpleNamespace(collective_timeout_s=60.0, progress_timeout_s=600.0),
                                    checkpoint=types.SimpleNamespace(async_save=True))
        infos = [{"node_id": "ab"[r.rank // 2], "pid": 100 + r.rank, "node_ip": f"10.0.0.{r.rank // 2}"}
                 for r in ranks]
        stream = TrainStream(job, types.SimpleNamespace(workers=ranks, infos=infos), {})
        with pytest.raises(WorkerFailed) as failed:
            for _ in stream.reports(10, 5, None, 10, 0):
                pass
        return failed.value, clock.now

    return clock, run


def test_a_survivor_that_raises_before_the_lost_node_is_seen_ends_as_the_loss(world):
    """The CI case: rank 0's loop raises at t=1, rank 1 drops its step; the lost node's ranks (2,
    3) answer nothing, and Ray fails their calls only at t=30."""
    clock, run = world
    ranks = [Rank(clock, 0, ends=1.0, dropped=False, raises=True), Rank(clock, 1, ends=1.2),
             Rank(clock, 2, dies=30.0, answers=NEVER), Rank(clock, 3, dies=30.0, answers=NEVER)]
    err, when = run(ranks)
    assert err.lost_ranks == [2, 3], (err, getattr(err, "lost_ranks", None))
    assert "rank 0 raised meanwhile" in err.details and "rank 0 failed" in err.details
    assert when < 30.0  # counted lost by the probe (a silent node), not by Ray's later verdict


def test_a_lost_rank_whose_heartbeat_fails_first_is_counted_lost(world):
    """No survivor has reported yet (its step is slow) when the liveness heartbeat of a dead rank
    fails: that rank is lost, not the run's failure."""
    clock, run = world
    ranks = [Rank(clock, 0, ends=4.0), Rank(clock, 1, ends=4.0),
             Rank(clock, 2, dies=1.5, answers=0.01), Rank(clock, 3, dies=1.5, answers=0.01)]
    for r in ranks[2:]:
        r._poll = lambda: (NEVER, ([], False))  # their polls hang: only the heartbeats tell
        r.take_reports = Call(clock, r._poll)
    err, when = run(ranks)
    assert err.lost_ranks == [2, 3], (err, getattr(err, "lost_ranks", None))
    assert err.kind == WorkerFailed.DIED


def test_a_raised_failure_with_every_other_rank_alive_is_raised_once_they_answer(world):
    """Nobody lost (the user's code raised on rank 0; the others wait in a collective): the failure
    is raised as soon as every other rank has answered, not after the hold."""
    clock, run = world
    ranks = [Rank(clock, 0, ends=1.0, dropped=False, raises=True)] + [Rank(clock, r) for r in (1, 2, 3)]
    err, when = run(ranks)
    assert not getattr(err, "lost_ranks", None) and err.rank == 0 and "rank 0 failed" in err.reason
    assert when < 1.0 + HOLD_S / 2, when


def test_a_raised_failure_is_held_no_longer_than_the_hold(world):
    """Nobody answers and nobody is counted lost (a rank on each node silent, its node-mates
    answering: slow, not lost): the held failure is raised when the hold is over."""
    clock, run = world
    ranks = [Rank(clock, 0, ends=1.0, dropped=False, raises=True), Rank(clock, 1, answers=NEVER),
             Rank(clock, 2), Rank(clock, 3, answers=NEVER)]
    err, when = run(ranks)
    assert not getattr(err, "lost_ranks", None) and err.rank == 0
    assert 1.0 + HOLD_S <= when < 1.0 + HOLD_S + 1.0, when


def test_without_elastic_a_raised_failure_ends_the_stream_at_once(world):
    clock, run = world
    ranks = [Rank(clock, 0, ends=1.0, dropped=False, raises=True), Rank(clock, 1, ends=1.2),
             Rank(clock, 2, dies=30.0, answers=NEVER), Rank(clock, 3, dies=30.0, answers=NEVER)]
    err, when = run(ranks, elastic=False)
    assert not getattr(err, "lost_ranks", None) and err.rank == 0 and when == 1.0
