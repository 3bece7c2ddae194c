"""LossProbe (orchestrator/cluster/lost.py): which ranks an elastic run counts lost when their peers
drop a step. A node that is silent as a whole is gone; a process slow to answer on a node whose other
ranks answer is not (seen on a loaded 2-core machine: a survivor's heartbeat took over 0.5 s and the
run shrank onto one worker fewer than it had); one whose heartbeat Ray fails is dead at once."""

from __future__ import annotations

import pytest
import ray

from gearshift.orchestrator.cluster import lost
from gearshift.orchestrator.cluster.lost import LossProbe


class Ref:
    def __init__(self, rank):
        self.rank = rank


class Beat:
    def __init__(self, rank, made):
        self.rank, self.made = rank, made

    def options(self, **_):
        return self

    def remote(self):
        ref = Ref(self.rank)
        self.made.append(ref)
        return ref


class Worker:
    def __init__(self, rank, made):
        self.heartbeat = Beat(rank, made)


@pytest.fixture
def cluster(monkeypatch):
    """Four ranks on two nodes (0, 1 on "a"; 2, 3 on "b"); `answers` rank -> "ok" | "dead" (unset: silent)."""
    answers, clock = {}, [100.0]

    def wait(refs, num_returns, timeout):
        return [r for r in refs if r.rank in answers], [r for r in refs if r.rank not in answers]

    def get(ref, timeout=None):
        if answers[ref.rank] == "dead":
            raise ray.exceptions.RayActorError()
        return {"rank": ref.rank}

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(lost.time, "monotonic", lambda: clock[0])
    made: list = []
    probe = LossProbe([Worker(r, made) for r in range(4)], [{"node_id": n} for n in "aabb"])
    return probe, answers, clock


def test_a_silent_node_is_lost_after_the_probe_time_and_not_before(cluster):
    probe, answers, clock = cluster
    probe.step_dropped(0)
    answers[1] = "ok"
    assert probe.gone([1, 2, 3]) == []
    clock[0] += lost.PROBE_S + 0.01
    assert probe.gone([1, 2, 3]) == [2, 3]
    assert "node is gone" in probe.why(2)


def test_a_slow_process_on_a_node_that_answers_is_not_lost(cluster):
    probe, answers, clock = cluster
    probe.step_dropped(2)  # rank 3 on b is slow to answer; a's ranks answer
    answers[0] = answers[1] = "ok"
    clock[0] += 10 * lost.PROBE_S
    assert probe.gone([0, 1, 3]) == []
    probe.step_dropped(3)  # its loop ends as the others' did
    assert probe.gone([0, 1]) == []


def test_a_rank_whose_heartbeat_fails_is_lost_at_once(cluster):
    probe, answers, clock = cluster
    probe.step_dropped(0)
    answers[1], answers[2], answers[3] = "dead", "ok", "ok"
    assert probe.gone([1, 2, 3]) == [1]
    assert "actor is dead" in probe.why(1)


def test_ranks_of_unknown_nodes_are_lost_when_silent(cluster):
    probe, answers, clock = cluster
    probe.nodes = [None] * 4
    probe.step_dropped(0)
    answers[1] = "ok"
    clock[0] += lost.PROBE_S + 0.01
    assert probe.gone([1, 2, 3]) == [2, 3]
