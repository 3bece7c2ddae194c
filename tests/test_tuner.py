"""The tuner on fake score functions: pure logic, no process group, no Ray."""

from __future__ import annotations

import math
import random

import pytest

from gearshift.orchestrator.policy.tuner import Tuner

VALUES = [1, 5, 10, 25, 50, 100]


def curve(best_at: float):
    """Samples/s over bucket size, peaking at `best_at` (log-parabola, like latency vs overlap)."""
    return lambda s: 100 - (math.log(s["bucket_cap_mb"]) - math.log(best_at)) ** 2


@pytest.mark.parametrize("best_at", VALUES)
def test_search_finds_the_peak_of_a_known_curve(best_at):
    tuner = Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": 25})
    best = tuner.run(curve(best_at))
    assert best.setting == {"bucket_cap_mb": best_at}
    assert len(tuner.trials) < len(VALUES) + 1
    assert tuner.trials[0].setting == {"bucket_cap_mb": 25}  # starts from the value in force
    assert len({t.setting["bucket_cap_mb"] for t in tuner.trials}) == len(tuner.trials), "a setting tried twice"


def test_search_needs_fewer_trials_than_the_grid_near_the_start():
    tuner = Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": 25})
    tuner.run(curve(25))
    assert [t.setting["bucket_cap_mb"] for t in tuner.trials] == [25, 10, 50]


def test_grid_tries_every_combination_and_marks_the_best():
    def score(s):
        return curve(10)(s) + (5 if s["strategy"] == "hybrid" else 0)

    tuner = Tuner({"bucket_cap_mb": VALUES, "strategy": ["data", "hybrid"]}, mode="grid")
    best = tuner.run(score)
    assert len(tuner.trials) == 12
    assert {(t.setting["bucket_cap_mb"], t.setting["strategy"]) for t in tuner.trials} == \
        {(b, s) for b in VALUES for s in ("data", "hybrid")}
    assert best.setting == {"bucket_cap_mb": 10, "strategy": "hybrid"}


def test_pinned_values_are_left_alone():
    seen = []

    def score(s):
        seen.append(dict(s))
        return curve(5)(s)

    tuner = Tuner({"bucket_cap_mb": VALUES, "strategy": ["data", "hybrid"]}, pinned={"strategy": "data"})
    best = tuner.run(score)
    assert seen and all(s["strategy"] == "data" for s in seen)
    assert "strategy" not in tuner.space
    assert best.setting == {"strategy": "data", "bucket_cap_mb": 5}
    # everything pinned: one trial of the pinned setting, nothing tuned
    only = Tuner({"bucket_cap_mb": VALUES}, pinned={"bucket_cap_mb": 25})
    only.run(curve(5))
    assert [t.setting for t in only.trials] == [{"bucket_cap_mb": 25}]


@pytest.mark.parametrize("budget", [1, 2, 3])
def test_stops_within_its_trial_budget(budget):
    tuner = Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": 100}, max_trials=budget)
    calls = []
    tuner.run(lambda s: calls.append(s) or curve(1)(s))  # the peak is far: an unbounded climb takes 6
    assert len(calls) == len(tuner.trials) == budget and tuner.done
    assert tuner.next() is None


def test_every_trial_is_logged_with_its_evidence():
    tuner = Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": 25})
    while (s := tuner.next()) is not None:
        tuner.report(curve(10)(s), comm_wait_frac=0.1 * s["bucket_cap_mb"], steps=[1, 10])
    logged = [t.to_dict() for t in tuner.trials]
    assert [t["setting"]["bucket_cap_mb"] for t in logged] == [25, 10, 5]
    assert all(t["steps"] == [1, 10] and t["score"] == pytest.approx(curve(10)(t["setting"])) for t in logged)
    assert logged[1]["comm_wait_frac"] == pytest.approx(1.0)


def test_two_knobs_are_climbed_one_after_the_other():
    def score(s):
        return curve(50)(s) + {"a": 0, "b": 3, "c": 1}[s["mode"]]

    tuner = Tuner({"bucket_cap_mb": VALUES, "mode": ["a", "b", "c"]}, start={"bucket_cap_mb": 5, "mode": "a"})
    assert tuner.run(score).setting == {"bucket_cap_mb": 50, "mode": "b"}


def test_noise_does_not_make_it_try_a_setting_twice_or_run_forever():
    rng = random.Random(0)
    for _ in range(50):
        tuner = Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": rng.choice(VALUES)})
        tuner.run(lambda s: curve(10)(s) + rng.gauss(0, 2))
        settings = [t.setting["bucket_cap_mb"] for t in tuner.trials]
        assert len(settings) == len(set(settings)) <= len(VALUES)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="not one of"):
        Tuner({"bucket_cap_mb": VALUES}, start={"bucket_cap_mb": 7})
    with pytest.raises(ValueError, match="repeat"):
        Tuner({"bucket_cap_mb": [1, 1]})
    tuner = Tuner({"bucket_cap_mb": VALUES})
    tuner.next()
    with pytest.raises(RuntimeError, match="report"):
        tuner.next()
