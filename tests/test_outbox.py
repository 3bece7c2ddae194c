"""The step loop's outbox (workers/step/outbox.py): the controller's long polls take every report
once, in order, then the loop's end, and its failure only after the reports made before it; a
poll for a loop not started yet reads nothing of the loop before."""

from __future__ import annotations

import threading

import pytest

from gearshift.workers.step.outbox import ReportOutbox

WAIT_S = 10.0  # a bound on each wait below; none is reached when the outbox works


def drain(box: ReportOutbox, call: int) -> list[dict]:
    taken, ended = [], False
    while not ended:
        reports, ended = box.take(call, WAIT_S)
        taken += reports
    return taken


def test_every_report_is_taken_once_in_order_then_the_end():
    box = ReportOutbox()
    go = [threading.Event() for _ in range(3)]

    def loop():
        for i in range(3):
            go[i].wait(WAIT_S)
            yield {"step": i}

    runner = threading.Thread(target=box.run, args=(1, loop()))
    runner.start()
    assert box.take(1, 0.05) == ([], False)  # nothing made yet: the poll returns after its wait
    go[0].set()
    assert box.take(1, WAIT_S) == ([{"step": 0}], False)  # the first report ends the poll at once
    go[1].set(), go[2].set()
    assert drain(box, 1) == [{"step": 1}, {"step": 2}]
    runner.join(WAIT_S)
    assert box.take(1, 0.0) == ([], True)


def test_a_failure_comes_after_the_reports_made_before_it():
    box = ReportOutbox()

    def loop():
        yield {"step": 0}
        raise RuntimeError("the step broke")

    with pytest.raises(RuntimeError, match="the step broke"):
        box.run(2, loop())
    assert box.take(2, WAIT_S) == ([{"step": 0}], True)


def test_a_poll_before_its_loop_starts_reads_nothing_of_the_last_one():
    box = ReportOutbox()
    box.run(1, iter([{"step": 0}]))
    assert box.take(2, 0.05) == ([], False)  # loop 2 has not started: loop 1's end is not its end
    started = threading.Thread(target=box.run, args=(2, iter([{"step": 1}])))
    started.start()
    assert drain(box, 2) == [{"step": 1}]
    started.join(WAIT_S)
