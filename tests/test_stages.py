"""A slow pipeline stage (orchestrator/policy/stages.py) on synthetic step records: its blocks move
to the faster stage where the cost says so, the step as predicted, an even pipeline moves
nothing; and the cut at unequal speeds (strategies/pipeline/cut.py). Pure logic."""

from __future__ import annotations

import random

import pytest

from gearshift.orchestrator.policy.decisions import Report
from gearshift.orchestrator.policy.stages import Recut, StageBalancer
from gearshift.strategies.layout import Layout
from gearshift.strategies.pipeline.cut import balanced

BLOCKS = [f"layers.{i}" for i in range(8)]
CUT = {"blocks": BLOCKS, "weights": [100] * 8, "rest": 0, "starts": [0, 4]}


def test_a_cut_at_unequal_speeds_gives_the_slow_stage_fewer_blocks():
    assert balanced([1] * 8, 2) == [0, 4]
    assert balanced([1] * 8, 2, speeds=[1.0, 0.5]) == [0, 5]  # 5 / 1 against 3 / 0.5: the slowest 6, not 8
    assert balanced([1] * 9, 3, speeds=[1.0, 1.0, 0.25]) == [0, 4, 8]
    assert balanced([1] * 8, 2, 4, 0, speeds=[1.0, 1.0]) == [0, 2]  # a heavy first stage's extra counts


def record(step, starts, speeds, rng, jitter=0.05, ranks_per_stage=1):
    """Each position computes its blocks (100 weight each) at its speed (weight/ms), a fixed 0.1 ms
    beside (a micro-batch's own overhead), plus jitter."""
    n = len(BLOCKS)
    sizes = [b - a for a, b in zip(starts, list(starts[1:]) + [n])]
    compute = []
    for size, speed in zip(sizes, speeds):
        t = (0.0001 + size * 100 / speed / 1000) * (1 + rng.uniform(-jitter, jitter))
        compute += [t] * ranks_per_stage
    return {"step": step, "step_time_max": 1.4 * max(compute), "ranks": {"compute_time": compute}}


def feed(bal, speeds_at, steps, jitter=0.05, seed=0, ranks_per_stage=1):
    rng, out = random.Random(seed), []
    for step in range(1, steps + 1):
        got = bal.observe(record(step, bal.starts, speeds_at(step), rng, jitter, ranks_per_stage))
        if got is not None:
            out.append((step, got))
            if isinstance(got, Recut):
                bal.applied(got, step)
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_a_stage_at_half_speed_hands_blocks_to_the_other_and_the_step_follows(dp):
    layout = Layout("pipeline", dp, 1, pp=2)
    infos = [{"node_ip": "10.0.0.1"}] * dp + [{"node_ip": "10.0.0.2"}] * dp
    bal = StageBalancer("rebalance", layout, CUT, infos)
    out = feed(bal, lambda s: [400.0, 200.0], 60, ranks_per_stage=dp)
    recuts = [d for _, d in out if isinstance(d, Recut)]
    assert len(recuts) == 1 and out[0][0] == 10, out
    r = recuts[0]
    assert r.split == ("layers.5",) and r.starts == (0, 5)  # 5 blocks at 400 against 3 at 200
    ev = r.evidence
    assert ev["reason"] == "straggler" and ev["position"] == 1 and ev["node"] == "10.0.0.2" and ev["rank"] == dp
    assert ev["blocks_per_stage_before"] == [4, 4] and ev["blocks_per_stage_after"] == [5, 3]
    assert ev["speed_ratio"] == pytest.approx(2.1 / 1.1, rel=0.1)  # 2.1 ms against 1.1, the fixed part in each
    [check] = [d for _, d in out if isinstance(d, Report) and d.kind == "recut_checked"]
    # the slowest stage 2.1 ms -> 1.6 (3 blocks at half speed, and the fixed part), as predicted
    assert abs(check.evidence["prediction_error"]) < 0.1, check.evidence
    assert check.evidence["measured_step_s"] < 0.8 * ev["measured_step_s"]


def test_an_even_pipeline_moves_nothing_and_report_mode_only_says():
    for seed in range(5):
        bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)
        assert not feed(bal, lambda s: [300.0, 300.0], 200, jitter=0.3, seed=seed)
    bal = StageBalancer("report", Layout("pipeline", 1, 1, pp=2), CUT, cooldown=40)
    out = feed(bal, lambda s: [400.0, 200.0], 60)
    assert [s for s, _ in out] == [10, 50] and all(d.kind == "straggler" for _, d in out)
    assert bal.starts == (0, 4)


def test_a_recovered_stage_gets_its_blocks_back():
    bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)
    out = feed(bal, lambda s: [400.0, 200.0] if s < 40 else [400.0, 400.0], 100)
    recuts = [(s, d) for s, d in out if isinstance(d, Recut)]
    assert [d.starts for _, d in recuts] == [(0, 5), (0, 4)], out
    assert recuts[1][1].evidence["reason"] == "balance"


def test_a_cut_measured_slower_lately_is_not_gone_back_to():
    """A stage slowed by a share of its device (a CPU quota: below its share it runs at full speed)
    looks fast once it has fewer blocks; priced per parameter it would get them back, and lose them
    again a window later. The step measured on the old cut holds the move back."""
    bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)

    def quota(step):  # stage 1 at half speed while it holds 4 blocks, at full speed with fewer
        return [400.0, 200.0 if bal.starts[1] <= 4 else 400.0]

    out = feed(bal, quota, 120)
    recuts = [d for _, d in out if isinstance(d, Recut)]
    assert [d.starts for d in recuts] == [(0, 5)], out
    forgets = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)
    forgets._remember = lambda steps: setattr(forgets, "measured", {forgets.starts: 1.0})  # no memory of other cuts

    def quota_forgotten(step):
        return [400.0, 200.0 if forgets.starts[1] <= 4 else 400.0]

    flips = [d.starts for _, d in feed(forgets, quota_forgotten, 120) if isinstance(d, Recut)]
    assert len(flips) >= 3 and flips[:2] == [(0, 5), (0, 4)], flips  # what the memory prevents


def test_a_stage_measured_slow_with_some_work_is_not_given_more():
    """The quota case on a cut never tried: stage 1 slow at 4 blocks, fast at 2; moving 5 blocks
    onto it (it looks fast per parameter now) is priced at the speed it showed with 4."""
    bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)

    def quota(step):  # stage 1 slow at 4 blocks or more; stage 0 slower than stage 1 at 2 blocks
        return [400.0, 200.0 if bal.starts[1] <= 4 else 800.0]

    out = feed(bal, quota, 150)
    assert [d.starts for _, d in out if isinstance(d, Recut)] == [(0, 5)], out


def test_the_whole_machine_slowing_a_little_does_not_undo_what_was_measured():
    """The quota case again, with every stage a sixth slower from step 60 (the machine's own
    drift): the speeds against each other hold, so the cut measured slower stays unvisited."""
    bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)

    def drifting(step):
        f = 1.0 if step < 60 else 0.85
        return [400.0 * f, (200.0 if bal.starts[1] <= 4 else 400.0) * f]

    out = feed(bal, drifting, 150)
    assert [d.starts for _, d in out if isinstance(d, Recut)] == [(0, 5)], out


def test_a_recut_that_could_not_be_allocated_is_not_proposed_again():
    """The cut 5 / 3 ran out of memory on some rank: the balancer does not propose it window after
    window (as a switch that ran out is not tried again)."""
    bal = StageBalancer("rebalance", Layout("pipeline", 1, 1, pp=2), CUT)
    rng, proposed = random.Random(0), []
    for step in range(1, 61):
        got = bal.observe(record(step, bal.starts, [400.0, 200.0], rng))
        if isinstance(got, Recut):
            proposed.append(got.starts)
            bal.not_allocated(got)  # the workers answered "failed": the old cut stays in force
    assert proposed == [(0, 5)], proposed


def test_a_recut_is_priced_against_its_gain_over_the_steps_left():
    """As a grow or a switch is: the step's predicted gain over the steps left must beat (1 +
    margin) x a recut's cost, two steps before any is measured, then what the run's recuts took."""
    layout = Layout("pipeline", 1, 1, pp=2)
    near_end = StageBalancer("rebalance", layout, CUT, total_steps=11)  # the slowdown is seen at step 10
    assert not [d for _, d in feed(near_end, lambda s: [400.0, 200.0], 11) if isinstance(d, Recut)]

    far = StageBalancer("rebalance", layout, CUT, total_steps=1000)
    rng, recuts = random.Random(0), []
    for step in range(1, 120):
        speeds = [400.0, 200.0] if step < 40 else [200.0, 400.0]  # the other position slows at step 40
        got = far.observe(record(step, far.starts, speeds, rng))
        if isinstance(got, Recut):
            recuts.append((step, got))
            got.evidence["seconds"] = 1e6  # as TrainWorker.recut measured it: far more than any gain
            far.applied(got, step)
    [(step, first)] = recuts  # the second slowdown's recut would cost more than it gains
    ev = first.evidence
    assert ev["pays"] and ev["steps_left"] == 1000 - step and not ev["recut_cost_measured"]
    assert ev["gain_s_per_step"] * ev["steps_left"] > ev["recut_cost_s"] * (1 + ev["switch_margin"])
    assert (ev["moved_weight"], ev["total_weight"]) == (100, 800)  # 4 + 4 -> 5 + 3: one block changes position
    assert far.recuts_s == [1e6] and far.recut_rates == [1e6 / 100]

    unmeasured = StageBalancer("rebalance", layout, CUT, total_steps=1000)
    out = feed(unmeasured, lambda s: [400.0, 200.0] if s < 40 else [200.0, 400.0], 119)
    assert len([d for _, d in out if isinstance(d, Recut)]) == 2  # without the measured cost, both pay


def test_a_recut_is_priced_by_the_weight_that_changes_position():
    """A recut sends only the blocks that change position: once one is measured, the next is
    priced at the measured seconds per unit of weight times the weight it would move."""
    layout = Layout("pipeline", 1, 1, pp=2)
    bal = StageBalancer("rebalance", layout, CUT, total_steps=10_000)
    assert bal.moved_weight((0, 4)) == 0 and bal.moved_weight((0, 6)) == 200 and bal.moved_weight((0, 2)) == 200
    rng, recuts = random.Random(0), []
    for step in range(1, 160):
        speeds = [400.0, 200.0] if step < 40 else [100.0, 400.0]  # then the first position slows, more
        got = bal.observe(record(step, bal.starts, speeds, rng))
        if isinstance(got, Recut):
            recuts.append(got)
            got.evidence["seconds"] = 0.002 * got.evidence["moved_weight"] / 100  # 2 ms a block moved
            bal.applied(got, step)
    first, second = recuts[:2]
    assert not first.evidence["recut_cost_measured"] and second.evidence["recut_cost_measured"]
    moved = second.evidence["moved_weight"]
    assert moved > first.evidence["moved_weight"]  # the slower first position gives more blocks back
    assert second.evidence["recut_cost_s"] == pytest.approx(0.002 / 100 * moved)
