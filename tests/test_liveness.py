"""The liveness watch as logic (orchestrator/cluster/liveness.py): times are passed in, no Ray.
The Ray side (a slow first step is not a hang, a rank stuck in a collective is caught) is in
tests/test_fault.py."""

from __future__ import annotations

import pytest

from gearshift.orchestrator.cluster.liveness import POLL_AFTER_S, Liveness
from gearshift.workers.group.heartbeat import Activity


def beat(step=0, phase="step", in_collective_s=None, rank=0):
    return {"rank": rank, "step": step, "phase": phase, "phase_s": 0.0, "since_step_s": 0.0,
            "in_collective_s": in_collective_s}


def test_a_long_step_whose_workers_answer_is_not_a_hang():
    watch = Liveness(2, silent_s=10.0, progress_s=3600.0, now=0.0)
    for t in range(1, 60):  # a minute without a report, heartbeats answered every second
        for rank in (0, 1):
            watch.answered(rank, beat(rank=rank), float(t))
        assert watch.verdict(float(t)) is None


def test_a_worker_answering_nothing_is_hung_past_the_collective_timeout_and_margin():
    watch = Liveness(2, silent_s=10.0, progress_s=3600.0, now=0.0)
    for t in range(1, 11):
        watch.answered(0, beat(), float(t))  # rank 1 answers nothing
    assert watch.verdict(10.0) is None
    hung = watch.verdict(10.5)
    assert hung.rank == 1 and "neither with a step nor with a heartbeat" in hung.reason and "10 s" in hung.reason


def test_a_rank_inside_a_collective_past_its_timeout_is_hung_though_it_answers():
    watch = Liveness(2, silent_s=10.0, progress_s=3600.0, now=0.0)
    watch.answered(0, beat(step=4), 1.0)
    watch.answered(1, beat(step=4, phase="step", in_collective_s=2.0), 1.0)
    assert watch.verdict(1.0) is None
    watch.answered(0, beat(step=4), 9.0)
    watch.answered(1, beat(step=4, in_collective_s=9.5), 9.0)  # answers, but the same collective goes on
    assert watch.verdict(9.0) is None
    hung = watch.verdict(9.6)  # 9.5 s inside as answered, 0.6 s since
    assert hung.rank == 1 and "inside one collective" in hung.reason and "step 5" in hung.reason


def test_alive_workers_that_finish_no_step_for_the_progress_timeout_are_hung():
    watch = Liveness(2, silent_s=10.0, progress_s=30.0, now=0.0)
    for t in range(1, 31):
        for rank in (0, 1):
            watch.answered(rank, beat(step=7, phase="checkpoint", rank=rank), float(t))
        assert watch.verdict(float(t)) is None
    hung = watch.verdict(30.5)
    assert hung.rank is None and "fault.progress_timeout_s = 30" in hung.reason
    assert "rank 0: checkpoint at step 8" in hung.reason


def test_a_step_told_by_a_heartbeat_or_a_report_is_progress():
    watch = Liveness(2, silent_s=10.0, progress_s=30.0, now=0.0)

    def answer_until(t0, t1, step):
        for t in range(t0, t1 + 1):
            for rank in (0, 1):
                watch.answered(rank, beat(step=step, rank=rank), float(t))

    answer_until(1, 25, step=1)
    answer_until(26, 50, step=2)  # a step ended between two heartbeats, at 26 s
    assert watch.verdict(50.0) is None
    watch.reported(0, 51.0)  # a report is a step too
    answer_until(52, 81, step=2)
    assert watch.verdict(81.0) is None
    hung = watch.verdict(81.5)  # 30.5 s since the report, no step since
    assert hung is not None and hung.rank is None


def test_a_finished_rank_owes_nothing():
    watch = Liveness(2, silent_s=10.0, progress_s=3600.0, now=0.0)
    watch.finished(0, 1.0)
    for t in range(2, 30):
        watch.answered(1, beat(rank=1), float(t))
        assert watch.verdict(float(t)) is None


def test_heartbeats_are_asked_for_only_while_no_report_comes_in_and_at_most_once_a_second():
    watch = Liveness(2, silent_s=10.0, progress_s=3600.0, now=0.0)
    assert not watch.should_poll(POLL_AFTER_S / 2)
    assert watch.should_poll(POLL_AFTER_S + 0.1)
    assert not watch.should_poll(POLL_AFTER_S + 0.5)
    assert watch.should_poll(POLL_AFTER_S + 1.2)
    watch.reported(0, 5.0)
    assert not watch.should_poll(5.5)


def test_the_activity_tells_phase_step_and_time_inside_a_collective(monkeypatch):
    clock = {"t": 100.0}
    monkeypatch.setattr("gearshift.workers.group.heartbeat.time.monotonic", lambda: clock["t"])
    act = Activity()
    with act.phase_of("build"):
        clock["t"] = 103.0
        assert act.beat(1)["phase"] == "build" and act.beat(1)["phase_s"] == pytest.approx(3.0)
    assert act.beat(1)["phase"] == "starting"
    act.set_phase("step")
    act.stepped(3)
    with act.collective():
        clock["t"] = 105.0
        with act.collective():  # nested: counted from the outermost
            clock["t"] = 106.0
            b = act.beat(1)
    assert b == {"rank": 1, "step": 3, "phase": "step", "phase_s": 3.0, "since_step_s": 3.0, "in_collective_s": 3.0}
    assert act.beat(1)["in_collective_s"] is None
