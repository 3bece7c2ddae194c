"""Deciding by prediction: the online cost model, change points and the policy on step records
that a known "true" cluster makes (the cost model with the true figures), the policy knowing only
what it fits from them. Pure logic: no process group, no Ray."""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from gearshift.orchestrator.policy import costmodel
from gearshift.orchestrator.policy.costmodel import Hardware, Link, ModelShape
from gearshift.orchestrator.policy.online import ChangePoint, OnlineModel
from gearshift.orchestrator.policy.adaptive import AdaptConfig, Policy, Report, Revert, Switch, candidate_layouts
from gearshift.orchestrator.policy.simulate import record
from gearshift.strategies.layout import Layout

GPT = ModelShape.transformer(layers=24, hidden=2048, seq=1024, vocab=50304, heads=16)
HW = Hardware(nodes=2, per_node=4, flops=100e12, intra=Link(200e9, 2e-6), inter=Link(10e9, 10e-6))
BATCH = 256
DATA, HYB2, HYB4 = Layout("data", 8, 1), Layout("hybrid", 4, 2), Layout("hybrid", 2, 4)
CANDIDATES = candidate_layouts(8, [4, 4], sharded=False)  # sharded state only saves memory


def at(hw: Hardware, factor: float) -> Hardware:
    return replace(hw, inter=Link(hw.inter.bandwidth * factor, hw.inter.latency))


def drive(policy: Policy, truth: ModelShape, hw: Hardware, steps: int, factor=lambda step: 1.0,
          noise: float = 0.0, seed: int = 0):
    """Feed the policy the records `truth` on `hw` makes, acting as the controller (a switch is
    carried out at once and takes 2 steps' time). Returns [(step, decision)] and the time spent."""
    rng, out, clock = random.Random(seed), [], 0.0
    for step in range(1, steps + 1):
        layout = policy.current
        pred = costmodel.predict(truth, at(hw, factor(step)), BATCH, layout.dp, layout.tp, shard=layout.shard)
        if noise:  # every timing of the step off by the same random factor
            k = 1 + rng.uniform(-noise, noise)
            pred = replace(pred, step_s=pred.step_s * k, compute_s=pred.compute_s * k,
                           exposed_wait_s=pred.exposed_wait_s * k)
        clock += pred.step_s
        d = policy.observe(record(step, layout, pred, BATCH))
        if d.name != "keep" or d.evidence:
            out.append((step, d))
        if isinstance(d, (Switch, Revert)):
            clock += 2 * pred.step_s
            policy.switched(d.to, step, 2 * pred.step_s)
    return out, clock


def policy_for(candidates=CANDIDATES, prior: Hardware | None = HW, model: ModelShape = GPT, steps: int = 2000,
               **config) -> Policy:
    c = AdaptConfig(window=10, cooldown=20, **config)
    online = OnlineModel(model, BATCH, [4, 4], prior=prior, predict_error=c.predict_error,
                         unseen_error=c.unseen_error)
    return Policy(c, candidates, candidates[0], model=online, total_steps=steps)


def moves(decisions):
    return [(s, d.name, d.to) for s, d in decisions if isinstance(d, (Switch, Revert))]


def test_the_online_model_recovers_the_device_rate_and_the_link_from_data_parallel_steps():
    online = OnlineModel(GPT, BATCH, [4, 4])  # no prior at all
    for factor in (1.0, 0.1, 0.03):
        hw = at(HW, factor)
        pred = costmodel.predict(GPT, hw, BATCH, 8, 1)
        online.update(DATA, [record(s, DATA, pred, BATCH) for s in range(1, 11)])
        assert online.hw.flops == pytest.approx(HW.flops, rel=1e-6)
        # a link that shows in the wait is recovered; a fast one only as fast as the wait can show
        # (the slowest link that leaves it within 1 % of the compute)
        assert online.predict(DATA).step_s == pytest.approx(pred.step_s, rel=1e-3 if factor < 1 else 0.015)
        if pred.comm_wait_frac > 0.05:
            # (no prior: the link's latency, 10 us a hop, is taken into its bandwidth)
            assert online.bandwidth == pytest.approx(hw.inter.bandwidth, rel=0.01)


def test_no_move_when_the_best_candidate_is_predicted_slower():
    """Data waits 34 % of the step, over the threshold, but tensor parallelism on this node's slow
    link costs more than it saves: the policy says so once (a `hold` with every prediction) and
    stays, where trial would have tried a layout and reverted it."""
    hw = replace(HW, intra=Link(5e9, 2e-6))
    policy = policy_for(prior=hw)
    decisions, _ = drive(policy, GPT, hw, 300, factor=lambda s: 0.1)
    assert moves(decisions) == []
    holds = [d for _, d in decisions if isinstance(d, Report) and d.kind == "hold"]
    assert len(holds) == 1, decisions
    ev = holds[0].evidence
    assert ev["comm_wait_frac"] > 0.15 and ev["gain_s_per_step"] < 0
    by_layout = {(p["layout"]["dp"], p["layout"]["tp"]): p["step_s"] for p in ev["predictions"]}
    assert by_layout[(8, 1)] < min(by_layout[(4, 2)], by_layout[(2, 4)])
    # trial, on the same records, tries and reverts
    trial = policy_for(prior=hw, decide="trial")
    assert [m[1] for m in moves(drive(trial, GPT, hw, 300, factor=lambda s: 0.1)[0])][:2] == ["switch", "revert"]


def test_a_direct_move_to_the_best_of_three_candidates():
    """At a tenth of the link, hybrid 2x4 beats hybrid 4x2 beats data: the policy goes straight to
    2x4 (trial would try 4x2 first) after the run's first 5 steps (a prediction needs fewer steps
    than a trial's window), keeps it, and its prediction was right."""
    policy = policy_for()
    decisions, _ = drive(policy, GPT, HW, 200, factor=lambda s: 0.1)
    assert moves(decisions) == [(5, "switch", HYB4)]
    switch = decisions[0][1]
    assert switch.evidence["reason"] == "comm_wait" and len(switch.evidence["predictions"]) == 3
    kept = next(d for _, d in decisions if d.name == "keep")
    assert abs(kept.evidence["prediction_error"]) < 0.01
    trial = policy_for(decide="trial")
    assert moves(drive(trial, GPT, HW, 200, factor=lambda s: 0.1)[0])[0][2] == HYB2


def test_a_misprediction_is_reverted_and_the_model_refitted():
    """Sharding adds 60 % to the compute on this cluster, which nothing has measured yet: the
    model (no prior: a live run) predicts hybrid 2x4 well ahead, the move loses, is reverted with
    the prediction's error in its evidence, and the layout, now measured, is not tried again."""
    truth = replace(GPT, tp_overhead_flops=GPT.flops_per_sample * BATCH / 8 * 0.6)
    policy = policy_for(candidates=[DATA, HYB4], prior=None)
    decisions, _ = drive(policy, truth, HW, 600, factor=lambda s: 0.1)
    assert [(m[1], m[2]) for m in moves(decisions)] == [("switch", HYB4), ("revert", DATA)]
    revert = next(d for _, d in decisions if isinstance(d, Revert))
    assert revert.evidence["prediction_error"] > 0.25
    assert policy.predicting  # one miss is not a pattern
    fitted = policy.model.predict(HYB4).step_s
    true = costmodel.predict(truth, at(HW, 0.1), BATCH, 2, 4).step_s
    assert fitted == pytest.approx(true, rel=0.05)


def test_repeated_misses_fall_back_to_trial_and_say_so():
    """A policy told to trust the model for layouts it has not run (unseen_error 5 %) on a cluster
    where sharding adds 60 % to the compute: both hybrid moves miss, and after the second it says
    that it decides by trial from now on."""
    truth = replace(GPT, tp_overhead_flops=GPT.flops_per_sample * BATCH / 8 * 0.6)
    policy = policy_for(prior=None, unseen_error=0.05)
    decisions, _ = drive(policy, truth, HW, 600, factor=lambda s: 0.1)
    reverts = [(s, d) for s, d in decisions if isinstance(d, Revert)]
    assert len(reverts) >= 2
    (_, first), (fell_back, second) = reverts[:2]
    assert "fallback" not in first.evidence and second.evidence["fallback"] == "trial"
    assert "decides by trial" in second.evidence["reason"]
    assert not policy.predicting
    later = [d for s, d in decisions if s > fell_back and isinstance(d, Switch)]
    assert later and all("predictions" not in d.evidence for d in later)  # trial: the next candidate, tried


@pytest.mark.parametrize("direction", ["down", "up"])
def test_a_change_of_the_link_is_noticed_within_5_steps(direction):
    """The link drops to 3 % of its rate at step 200 and comes back at 500. Each change is a
    decision within 5 steps, on the steps since the change, not at the window's end; the policy
    moves to the best layout under the new link each time."""
    policy = policy_for()
    decisions, _ = drive(policy, GPT, HW, 700, factor=lambda s: 0.03 if 200 <= s < 500 else 1.0)
    assert moves(decisions) == [(202, "switch", HYB4), (502, "switch", DATA)], decisions
    change = 200 if direction == "up" else 500
    step, d = next((s, d) for s, d in decisions if s >= change)
    assert step - change < 5 and d.evidence["reason"] == "link_changed"


def test_change_points_ignore_noise_and_single_slow_steps():
    rng = random.Random(1)
    cp = ChangePoint()
    found = [cp.add(0.1 * (1 + rng.uniform(-0.3, 0.3)) * (3 if s % 50 == 0 else 1), 0.5) for s in range(1, 400)]
    assert not any(found)
    found = [cp.add(0.3, 0.5) for _ in range(3)]
    assert found == [None, None, "up"]


def test_with_noisy_steps_the_policy_ends_near_the_oracle(capsys):
    """±10 % noise on every step: the policy moves once a phase and never reverts."""
    steps = 1500
    factor = lambda s: 0.03 if 500 <= s < 1000 else 1.0  # noqa: E731
    policy = policy_for(steps=steps)
    decisions, clock = drive(policy, GPT, HW, steps, factor=factor, noise=0.1)
    oracle = sum(min(costmodel.predict(GPT, at(HW, factor(s)), BATCH, c.dp, c.tp).step_s for c in CANDIDATES)
                 for s in range(1, steps + 1))
    assert [m[1] for m in moves(decisions)] == ["switch", "switch"], decisions
    assert oracle / clock > 0.97


# ---- reverts only on evidence

DATA_TB, HYB_TB = Layout("data", 4, 1), Layout("hybrid", 2, 2)


def two_node_policy(steps: int) -> Policy:
    """The two-node testbed's run: 4 workers, 2 a node, so data or hybrid 2 x 2."""
    c = AdaptConfig()
    online = OnlineModel(GPT, 32, [2, 2], predict_error=c.predict_error, unseen_error=c.unseen_error)
    return Policy(c, candidate_layouts(4, [2, 2], sharded=False), DATA_TB, model=online, total_steps=steps)


def _replay(policy: Policy, pace, steps: int, seed: int = 0, lag: int = 2):
    """Feed the policy records whose step time `pace(layout, steps_on_it, step)` gives (seconds,
    and the comm-wait share of it); a Switch or Revert is carried out `lag` steps after it."""
    rng, out, pending, since = random.Random(seed), [], None, 0
    for step in range(1, steps + 1):
        if pending and step > pending[1]:
            policy.switched(pending[0].to, pending[1], 0.3)
            pending, since = None, pending[1]
        layout = policy.current
        step_s, frac = pace(layout, step - since, step, rng)
        pred = SimpleNamespace(step_s=step_s, exposed_wait_s=step_s * frac, comm_wait_frac=frac, bucket_cap_mb=25.0)
        d = policy.observe(record(step, layout, pred, 32))
        if d.name != "keep" or d.evidence:
            out.append((step, d))
        if isinstance(d, (Switch, Revert)) and pending is None:
            pending = (d, step + lag)
    return out


def test_a_switch_whose_first_steps_are_slow_and_noisy_is_not_reverted():
    """The shape of a run that once threw a good move away: data waits 83 % of a 456 ms step on a
    slow link; hybrid's steady pace is 5 % better, but its first steps after the build are 3x,
    2x, 1.5x, 1.2x and 1.1x slower and every step is off by up to +-12 %. Judged after the warm-up
    against data's steps at the same link, within the noise of both: kept, never reverted."""
    def pace(layout, on_it, step, rng):
        if layout == DATA_TB:
            return 0.456 * rng.uniform(0.9, 1.1), 0.83
        warm = {1: 3.0, 2: 2.0, 3: 1.5, 4: 1.2, 5: 1.1}.get(on_it, 1.0)
        return 0.434 * warm * rng.uniform(0.88, 1.12), 0.6

    for seed in range(20):  # judged on the first steps against 3 steps of data, 2 of these seeds revert
        policy = two_node_policy(70)
        decisions = _replay(policy, pace, 70, seed=seed)
        assert [(d.name, d.to) for _, d in decisions if isinstance(d, (Switch, Revert))][:1] == [("switch", HYB_TB)]
        assert not [d for _, d in decisions if isinstance(d, Revert)], (seed, [d.evidence for _, d in decisions])
    kept = [h for h in policy.history if h["decision"] == "keep" and h["evidence"].get("reason") == "kept"]
    if kept:  # the judgement says what it compared and what it left out
        ev = kept[-1]["evidence"]
        assert ev["noise_samples_per_s"] > 0 and ev["steps_before"] and ev["steps_judged"]


def test_a_switch_clearly_slower_than_the_noise_is_reverted():
    """The same run with hybrid 25 % slower than data once warm: that is evidence, and it reverts."""
    def pace(layout, on_it, step, rng):
        if layout == DATA_TB:
            return 0.456 * rng.uniform(0.95, 1.05), 0.83
        return 0.57 * {1: 3.0, 2: 2.0}.get(on_it, 1.0) * rng.uniform(0.95, 1.05), 0.6

    policy = two_node_policy(200)
    decisions = _replay(policy, pace, 80)
    names = [(d.name, d.to) for _, d in decisions if isinstance(d, (Switch, Revert))]
    assert names[:2] == [("switch", HYB_TB), ("revert", DATA_TB)], decisions
    revert = next(d for _, d in decisions if isinstance(d, Revert))
    ev = revert.evidence
    assert ev["samples_per_s_after"] < ev["samples_per_s_before"] - ev["noise_samples_per_s"]
    assert "noise" in ev["reason"]


def test_a_link_change_during_the_judgement_restarts_it_instead_of_reverting():
    """The link gets fast while hybrid is on trial: its steps change pace under another link than
    the one data's steps were measured at. The judgement is dropped (said in a keep record), not
    counted against the move, and the policy decides afresh on the new link."""
    def pace(layout, on_it, step, rng):
        fast = step >= 14
        if layout == DATA_TB:
            return (0.2, 0.3) if fast else (0.456, 0.83)
        return (0.3, 0.5) if fast else (0.434, 0.6)

    policy = two_node_policy(200)
    decisions = _replay(policy, pace, 60)
    restarted = [h for h in policy.history if h["decision"] == "keep"
                 and h["evidence"].get("reason", "").startswith("judgement restarted")]
    assert restarted, decisions
    assert not [d for _, d in decisions if isinstance(d, Revert)]


def _fitted_on(truth_hw: Hardware, layout: Layout, node_sizes: list[int]) -> Policy:
    """A live run's policy (no prior) that has measured `layout` on `truth_hw` for a window."""
    c = AdaptConfig(window=10, cooldown=20)
    online = OnlineModel(GPT, BATCH, node_sizes, predict_error=c.predict_error, unseen_error=c.unseen_error)
    policy = Policy(c, candidate_layouts(layout.world, node_sizes, sharded=False), layout, model=online,
                    total_steps=2000)
    pred = costmodel.predict(GPT, truth_hw, BATCH, layout.dp, layout.tp)
    online.update(layout, [record(s, layout, pred, BATCH) for s in range(1, 11)])
    return policy


@pytest.mark.parametrize("factor,pays", [(1.0, True), (0.01, False)], ids=["fast_link", "slow_link"])
def test_a_grow_is_priced_by_the_cost_model_and_pays_only_where_the_larger_world_is_faster(factor, pays):
    """data(4) on two nodes of 2 grows to data(8) on four: half the compute a rank, a ring with
    more hops. On the fast link the gain pays the grow many times; on a link 100x slower, where the
    wait is most of the step, the larger world is predicted slower, and the run stays as it is
    (measured against the cost model given the true figures of both worlds)."""
    from gearshift.orchestrator.policy.growing import price_grow

    truth = replace(at(HW, factor), nodes=2, per_node=2)
    policy = _fitted_on(truth, Layout("data", 4, 1), [2, 2])
    verdict, ev = price_grow(policy, Layout("data", 8, 1), [2, 2, 2, 2], step=100, resizes_s=[3.0])
    # the truth, for the check: the cost model with the true figures on the larger world
    now = costmodel.predict(GPT, truth, BATCH, 4, 1).step_s
    bigger = costmodel.predict(GPT, replace(truth, nodes=4), BATCH, 8, 1).step_s
    assert (bigger < now) is pays and verdict is pays
    assert ev["now"]["step_s"] == pytest.approx(now, rel=0.02)
    assert ev["grown"]["step_s"] == pytest.approx(bigger, rel=0.05) and ev["link_measured"] is True
    assert ev["grow_cost_s"] == 3.0 and ev["steps_left"] == 1900 and ev["pays"] is pays
    # the fast link's wait is all behind compute: the larger world priced as if it stayed hidden
    assert ev["link_hidden"] is pays and ("grown_at_slowest_link" in ev) is pays


def test_a_grow_onto_a_second_node_takes_the_unmeasured_link_as_no_faster_than_the_nodes_own():
    """A run on one node has not measured a link between nodes: the grow is priced with the node's
    own link (a bound) and the larger error of an unseen cost; nothing measured yet: no verdict."""
    from gearshift.orchestrator.policy.growing import price_grow

    one = replace(HW, nodes=1, per_node=4)
    c = AdaptConfig(window=10)
    fresh = Policy(c, candidate_layouts(4, [4], sharded=False), Layout("data", 4, 1),
                   model=OnlineModel(GPT, BATCH, [4]), total_steps=2000)
    assert price_grow(fresh, Layout("data", 8, 1), [4, 4], step=5) == (None, {})
    policy = _fitted_on(one, Layout("data", 4, 1), [4])
    _, ev = price_grow(policy, Layout("data", 8, 1), [4, 4], step=100)
    assert ev["link_measured"] is False and ev["grown"]["error"] == c.unseen_error
    larger, measured = policy.model.on([4, 4])
    assert not measured and larger.hw.inter.bandwidth <= policy.model.hw.intra.bandwidth
    assert larger.hw.nodes == 2 and policy.model.hw.nodes == 1  # the run's own model is left as it was


# ---- a link that comes back while a pipeline hides it

TESTBED_GPT = ModelShape.transformer(layers=2, hidden=128, seq=64, vocab=128, heads=4)
PIPE_TB = Layout("pipeline", 2, 1, pp=2)

# (step s, comm-wait share) near what the two-node testbed measured (bench/adaptive.py, own
# cores): data and the pipeline of a stage a node at 1 Gbit/s and at 40 Mbit/s, the pipeline with
# 2 micro-batches (a third of its step a bubble). Its wait is its bubble with the link inside it,
# more than the schedule's bubble and its activations explain: read alone, a slower link
TESTBED_PACE = {(DATA_TB, "fast"): (0.093, 0.27), (DATA_TB, "slow"): (0.59, 0.88),
                (PIPE_TB, "fast"): (0.125, 0.40), (PIPE_TB, "slow"): (0.25, 0.67),
                (HYB_TB, "fast"): (0.187, 0.5), (HYB_TB, "slow"): (0.56, 0.8)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_when_the_link_comes_back_under_a_pipeline_the_policy_moves_back_to_data(seed):
    """Fast, slow from step 60, fast again from 140, at the testbed's measured paces (+-3 %). The
    policy moves to stages a node when the link drops, and back to data when it returns, though
    the pipeline's waits barely show the link: the link is then taken as data measured it before
    it dropped (said in the evidence), and the move back is kept on its measurements."""
    def pace(layout, on_it, step, rng):
        step_s, frac = TESTBED_PACE[layout, "slow" if 60 <= step < 140 else "fast"]
        return step_s * rng.uniform(0.97, 1.03), frac

    c = AdaptConfig(window=10, cooldown=20)
    online = OnlineModel(TESTBED_GPT, 32, [2, 2], predict_error=c.predict_error, unseen_error=c.unseen_error)
    candidates = candidate_layouts(4, [2, 2], sharded=False, pipelines=[2])
    assert PIPE_TB in candidates
    policy = Policy(c, candidates, DATA_TB, model=online, total_steps=300)
    decisions = _replay(policy, pace, 300, seed=seed)
    moves_ = [(s, d.name, d.to) for s, d in decisions if isinstance(d, (Switch, Revert))]
    assert [(name, to) for _, name, to in moves_] == [("switch", PIPE_TB), ("switch", DATA_TB)], decisions
    assert 60 <= moves_[0][0] < 66 and 140 <= moves_[1][0] < 150, moves_
    back = next(d for s, d in decisions if isinstance(d, Switch) and d.to == DATA_TB)
    assert back.evidence["reason"] == "link_changed" and back.evidence["link"] == "down"
    before = back.evidence["link_assumed_gb_s"]  # data's link before the drop
    assert before == pytest.approx(policy.history[0]["evidence"]["model"]["inter_link_gb_s"], rel=0.3)
