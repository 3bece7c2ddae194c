"""The adaptive policy on synthetic step records: pure logic, no process group, no Ray."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from gearshift.monitoring.schema import validate
from gearshift.orchestrator.policy.adaptive import (
    AdaptConfig,
    Keep,
    Policy,
    Report,
    Revert,
    Rules,
    Switch,
    candidate_layouts,
)
from gearshift.strategies.layout import Layout

DATA4, HYB2, HYB4 = Layout("data", 4, 1), Layout("hybrid", 2, 2), Layout("hybrid", 1, 4)
TENSOR4 = Layout("tensor", 1, 4)


def record(step, layout, *, step_time=0.1, wait=0.05, data=0.02, batch=32, telemetry=True):
    """One merged step record; `wait` and `data` are fractions of the step, a number or one per rank."""
    world = layout.dp * layout.tp
    waits = wait if isinstance(wait, list) else [wait] * world
    datas = data if isinstance(data, list) else [data] * world
    st = [step_time] * world  # ranks leave a synchronous step together
    dt = [d * step_time for d in datas]
    cw = [w * step_time for w in waits]
    ct = [s - w - d for s, w, d in zip(st, cw, dt)]
    mean = lambda xs: sum(xs) / len(xs)
    t = (lambda v: v) if telemetry else (lambda v: None)
    return {
        "type": "step", "time": 1.7e9 + step, "ended_at": 1.7e9 + step, "step": step, **layout.to_dict(),
        "bucket_cap_mb": 25, "loss": 1.0, "lr": 1e-3,
        "step_time_max": max(st), "step_time_mean": mean(st), "slowest_rank": 0,
        "data_time_mean": t(mean(dt)), "data_time_max": t(max(dt)),
        "compute_time_mean": t(mean(ct)), "comm_wait_mean": t(mean(cw)), "comm_wait_max": t(max(cw)),
        "comm_wait_frac_mean": t(mean(waits)), "comm_wait_frac_max": t(max(waits)), "comm_calls": 3,
        "comm_hidden_mean": None, "comm_hidden_frac_mean": None, "bubble_frac_mean": None, "link_wait_frac_mean": None,
        "samples_per_s": batch / max(st), "tokens_per_s": None, "peak_mem_bytes": None,
        "ranks": {"step_time": st, "data_time": t(dt), "compute_time": t(ct), "comm_wait": t(cw),
                  "comm_wait_frac": t(waits), "samples_per_s": [batch / world / s for s in st]},
    }


def run(policy, steps, shape, lag=2, start=1):
    """Feed `steps` records made by shape(layout, step) -> record kwargs, acting as the controller:
    a Switch/Revert is carried out `lag` steps later, and the policy told then."""
    decisions, pending = [], None
    for step in range(start, start + steps):
        if pending and step > pending[1]:
            policy.switched(pending[0].to, pending[1])
            pending = None
        d = policy.observe(record(step, policy.current, **shape(policy.current, step)))
        if not isinstance(d, Keep):
            decisions.append((step, d))
        if isinstance(d, (Switch, Revert)):
            pending = (d, step + lag)
    return decisions


def names(decisions):
    return [d.name for _, d in decisions]


def test_records_conform_to_the_schema():
    assert validate(record(1, DATA4)) == []
    assert validate(record(1, HYB2, wait=[0.4, 0.4, 0.02, 0.4], telemetry=False)) == []


@pytest.mark.parametrize("world, nodes, expected", [
    (4, [2, 2], [DATA4, HYB2]),
    (4, [4], [DATA4, HYB2, TENSOR4]),
    (4, [1, 1, 1, 1], [DATA4]),
    (8, [4, 4], [Layout("data", 8, 1), Layout("hybrid", 4, 2), Layout("hybrid", 2, 4)]),
    (1, [1], [Layout("data", 1, 1)]),
])
def test_candidates_ordered_node_local(world, nodes, expected):
    assert candidate_layouts(world, nodes, sharded=False) == expected


@pytest.mark.parametrize("nodes", [[2, 2], [4, 4], [4], [8], [2, 4, 2], [6, 6], [3, 1], [1, 1, 1, 1], [8, 8, 8, 8]])
def test_no_tp_group_spans_nodes(nodes):
    node_of = [i for i, n in enumerate(nodes) for _ in range(n)]
    cands = candidate_layouts(sum(nodes), nodes)
    assert cands[0].strategy == "data"
    assert [c.tp for c in cands] == sorted(c.tp for c in cands)
    for layout in cands:
        assert layout.world == sum(nodes)
        for group in layout.tp_groups():
            assert len({node_of[r] for r in group}) == 1, (nodes, layout)
    assert any(c.strategy == "tensor" for c in cands) == (len(nodes) == 1 and nodes[0] > 1)


def test_candidates_reject_a_placement_that_does_not_add_up():
    with pytest.raises(ValueError, match="world"):
        candidate_layouts(4, [2, 1])


def test_switches_on_sustained_wait_not_on_one_spike():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    spike = run(policy, 100, lambda lay, s: {"wait": 0.9 if s % 20 == 7 else 0.05})
    assert spike == []
    sustained = run(policy, 20, lambda lay, s: {"wait": 0.3}, start=101)
    assert [(s, d.name, d.to) for s, d in sustained] == [(120, "switch", HYB2)]
    # not carried out yet: the policy waits to be told, whatever the records say
    assert all(isinstance(policy.observe(record(s, DATA4, wait=0.5)), Keep) for s in range(121, 200))
    assert policy.current == DATA4 and policy.state()["pending"]["to"]["tp"] == 2


def test_switch_evidence_is_complete_and_json_ready():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    [(_step, switch)] = run(policy, 20, lambda lay, s: {"wait": 0.3, "step_time": 0.2})
    ev = switch.evidence
    assert ev["threshold"] == 0.15 and ev["window"] == 20 and ev["steps"] == [1, 20]
    assert ev["comm_wait_frac"] == pytest.approx(0.3)
    assert ev["samples_per_s"] == pytest.approx(32 / 0.2) and ev["step_time"] == pytest.approx(0.2)
    assert ev["candidate"] == {"strategy": "hybrid", "dp": 2, "tp": 2}
    assert ev["from"] == {"strategy": "data", "dp": 4, "tp": 1}
    out = json.loads(json.dumps(switch.to_dict()))
    assert out["decision"] == "switch" and out["to"] == {"strategy": "hybrid", "dp": 2, "tp": 2}
    assert policy.history[-1]["step"] == 20 and policy.history[-1]["decision"] == "switch"


def test_reverts_when_the_switch_did_not_help_and_blocks_that_layout():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [4]), DATA4)
    slower = lambda lay, s: {"wait": 0.3, "step_time": 0.1 if lay == DATA4 else 0.12}  # not a loss to cut short
    decisions = run(policy, 200, slower)
    assert names(decisions)[:2] == ["switch", "revert"]
    (s1, switch), (s2, revert) = decisions[:2]
    assert switch.to == HYB2 and revert.to == DATA4
    # the judging window is the first full window after settle on the new layout
    assert s2 == s1 + 2 + AdaptConfig().settle + AdaptConfig().window
    assert revert.evidence["samples_per_s_before"] == pytest.approx(320)
    assert revert.evidence["samples_per_s_after"] == pytest.approx(32 / 0.12)
    assert "reason" in revert.evidence and revert.evidence["layout"]["tp"] == 2
    # the next try skips the blocked hybrid tp=2 and goes on to tensor
    assert decisions[2][1].name == "switch" and decisions[2][1].to == TENSOR4
    assert policy.state()["blocked"][0]["layout"] == {"strategy": "hybrid", "dp": 2, "tp": 2}


def test_keeps_the_switch_when_it_helped():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    faster = lambda lay, s: {"wait": 0.3, "step_time": 0.1} if lay == DATA4 else {"wait": 0.05, "step_time": 0.08}
    decisions = run(policy, 500, faster)
    assert names(decisions) == ["switch"] and policy.current == HYB2
    kept = [h for h in policy.history if h["decision"] == "keep"]
    assert len(kept) == 1 and kept[0]["evidence"]["reason"] == "kept"
    assert kept[0]["evidence"]["samples_per_s_after"] > kept[0]["evidence"]["samples_per_s_before"]


def test_min_gain_demands_a_margin():
    policy = Policy(AdaptConfig(min_gain=0.1), candidate_layouts(4, [2, 2]), DATA4)
    slightly = lambda lay, s: {"wait": 0.3, "step_time": 0.1 if lay == DATA4 else 0.095}  # +5 %
    assert names(run(policy, 60, slightly)) == ["switch", "revert"]


def test_straggler_is_reported_not_switched():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    # rank 2 computes ~2x longer; the others sit in the all-reduce waiting for it
    straggler = lambda lay, s: {"wait": [0.45, 0.45, 0.02, 0.45]}
    decisions = run(policy, 200, straggler)
    assert decisions and all(isinstance(d, Report) and d.kind == "straggler" for _, d in decisions)
    assert decisions[0][1].evidence["rank"] == 2
    assert decisions[0][1].evidence["comm_wait_frac"] > 0.15  # a switch would have fired on the wait
    # said once per cooldown, not every window
    steps = [s for s, _ in decisions]
    assert all(b - a >= AdaptConfig().cooldown for a, b in itertools.pairwise(steps))
    assert len(steps) < 200 // AdaptConfig().window


def test_a_slow_rank_that_also_waits_is_no_straggler():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    # rank 2 computes 2x longer, yet it waits on the network too: the link is the bottleneck
    decisions = run(policy, 20, lambda lay, s: {"wait": [0.7, 0.7, 0.4, 0.7]})
    assert [d.name for _, d in decisions] == ["switch"]


def test_throughput_is_total_samples_over_total_time():
    policy = Policy(AdaptConfig(early_check=20), candidate_layouts(4, [2, 2]), DATA4)  # judged on full windows
    # hybrid is slower, but one step per window is absurdly fast: a mean of per-step rates
    # (dominated by that step) would call the switch a gain
    shape = lambda lay, s: {"wait": 0.3, "step_time": 0.1 if lay == DATA4 else (0.001 if s % 20 == 0 else 0.125)}
    decisions = run(policy, 60, shape)
    assert names(decisions) == ["switch", "revert"]
    assert decisions[1][1].evidence["samples_per_s_after"] == pytest.approx(20 * 32 / (19 * 0.125 + 0.001))


def test_input_bound_is_reported_not_switched():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    decisions = run(policy, 100, lambda lay, s: {"wait": 0.2, "data": 0.4})
    assert decisions and all(isinstance(d, Report) and d.kind == "input_bound" for _, d in decisions)
    assert decisions[0][1].evidence["data_frac"] == pytest.approx(0.4)
    assert decisions[0][1].to_dict()["kind"] == "input_bound"


def test_respects_the_cooldown():
    cfg = AdaptConfig(window=5, settle=0, cooldown=40)
    policy = Policy(cfg, candidate_layouts(4, [4]), DATA4)
    # every layout is faster than the last, but the wait stays high: each switch is kept
    shape = lambda lay, s: {"wait": 0.3, "step_time": 0.1 / lay.tp}
    decisions = run(policy, 200, shape, lag=0)
    assert [(s, d.to) for s, d in decisions] == [(5, HYB2), (45, TENSOR4)]


@pytest.mark.parametrize("seed, penalty", [(5, 1.0), (6, 1.0), (7, 1.2), (8, 1.2)])
def test_never_oscillates_over_a_long_noisy_trace(seed, penalty):
    rng = random.Random(seed)
    cfg = AdaptConfig()
    cands = candidate_layouts(8, [4, 4])
    policy = Policy(cfg, cands, cands[0])
    # the network is always slow and no layout helps: equally slow up to noise (penalty 1.0),
    # or clearly slower than data (1.2: beyond the noise of 20 steps each side), which makes the
    # policy revert every try
    noisy = lambda lay, s: {"wait": rng.uniform(0.2, 0.6),
                            "step_time": 0.1 * rng.uniform(0.8, 1.3) * (1 if lay.tp == 1 else penalty)}
    decisions = run(policy, 5000, noisy)
    switches = [(s, d.to) for s, d in decisions if d.name == "switch"]
    reverts = [s for s, d in decisions if d.name == "revert"]
    assert switches and len(reverts) <= len(switches)
    assert len([s for s, _ in switches if s <= cfg.retry_after]) <= len(cands) - 1
    assert len(switches) <= (len(cands) - 1) * (5000 // cfg.retry_after + 1)
    assert all(b - a >= cfg.cooldown for (a, _), (b, _) in itertools.pairwise(switches))
    # no ping-pong: a layout is tried again only after its retry period
    for layout in cands[1:]:
        tries = [s for s, to in switches if to == layout]
        assert all(b - a > cfg.retry_after for a, b in itertools.pairwise(tries)), (layout, tries)
    if penalty > 1:
        assert len(reverts) >= 6  # the trace really exercises revert and retry (ever less often: back-off)


def test_slow_network_for_data_only_switches_once_and_stays():
    rng = random.Random(7)
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    shape = lambda lay, s: ({"wait": rng.uniform(0.25, 0.35), "step_time": rng.uniform(0.095, 0.105)}
                            if lay == DATA4 else
                            {"wait": rng.uniform(0.03, 0.07), "step_time": rng.uniform(0.07, 0.075)})
    decisions = run(policy, 5000, shape)
    assert [(d.name, d.to) for _, d in decisions] == [("switch", HYB2)]
    assert policy.current == HYB2


def test_telemetry_off_always_keeps():
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    for step in range(1, 300):
        assert policy.observe(record(step, DATA4, wait=0.9, data=0.05, telemetry=False)) == Keep()
    assert policy.history == []


def test_late_records_from_the_old_layout_are_ignored():
    policy = Policy(AdaptConfig(window=5, settle=0, cooldown=0), candidate_layouts(4, [2, 2]), DATA4)
    [(_, switch)] = run(policy, 5, lambda lay, s: {"wait": 0.3})
    policy.switched(switch.to, 5)
    # stale records from data must not count towards judging hybrid
    for step in range(3, 20):
        assert policy.observe(record(step, DATA4, step_time=1.0)) == Keep()
    assert policy.state()["window_fill"] == 0 and policy.state()["trial"] is not None


def test_steps_back_when_the_network_recovers_and_stays_there():
    """Slow link until step 2000, fast after: data -> hybrid while it is slow, back to data once
    hybrid's wait has collapsed (data is faster on a fast link), and no further churn."""
    rng = random.Random(3)
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)

    def shape(lay, step):
        slow = step < 2000
        if lay == DATA4:
            return {"wait": rng.uniform(0.45, 0.55) if slow else rng.uniform(0.04, 0.06),
                    "step_time": rng.uniform(0.19, 0.21) if slow else rng.uniform(0.078, 0.082)}
        return {"wait": rng.uniform(0.28, 0.32) if slow else rng.uniform(0.02, 0.04),
                "step_time": rng.uniform(0.135, 0.145) if slow else rng.uniform(0.098, 0.102)}

    decisions = run(policy, 5000, shape)
    summary = [(s, d.name, getattr(d, "to", None), d.evidence.get("reason")) for s, d in decisions]
    # (kept switches are Keep decisions, which `run` leaves out)
    assert [(n, to, why) for _, n, to, why in summary] == [
        ("switch", HYB2, "comm_wait"), ("switch", DATA4, "comm_wait_fell")], summary
    back = summary[1][0]
    assert 2000 < back <= 2000 + 3 * AdaptConfig().window  # reacts within a few windows
    assert policy.current == DATA4


def test_a_steady_network_never_steps_back():
    """The step back needs the wait to fall below half of what it was when the layout was kept:
    noise around a steady level must not trigger it."""
    rng = random.Random(11)
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)
    shape = lambda lay, s: ({"wait": rng.uniform(0.4, 0.6), "step_time": rng.uniform(0.18, 0.22)} if lay == DATA4
                            else {"wait": rng.uniform(0.08, 0.14), "step_time": rng.uniform(0.13, 0.15)})
    decisions = run(policy, 5000, shape)
    assert [(d.name, getattr(d, "to", None)) for _, d in decisions] == [("switch", HYB2)]
    assert policy.current == HYB2


def test_a_reverted_layout_is_retried_early_when_the_network_gets_much_worse():
    """Reverted on a fast link (hybrid slower there), hybrid is blocked for retry_after steps;
    when the link slows so that data waits far longer than when it left, it is retried at once."""
    rng = random.Random(5)
    policy = Policy(AdaptConfig(), candidate_layouts(4, [2, 2]), DATA4)

    def shape(lay, step):
        slow = step >= 200
        if lay == DATA4:
            return {"wait": rng.uniform(0.75, 0.85) if slow else rng.uniform(0.25, 0.3),
                    "step_time": rng.uniform(0.38, 0.42) if slow else rng.uniform(0.078, 0.082)}
        return {"wait": rng.uniform(0.5, 0.6) if slow else rng.uniform(0.1, 0.12),
                "step_time": rng.uniform(0.28, 0.3) if slow else rng.uniform(0.098, 0.102)}

    decisions = run(policy, 1000, shape)
    got = [(d.name, getattr(d, "to", None)) for _, d in decisions]
    assert got[:3] == [("switch", HYB2), ("revert", DATA4), ("switch", HYB2)], got
    retried = [s for s, d in decisions if d.name == "switch"][1]
    reverted = next(s for s, d in decisions if d.name == "revert")
    assert 200 < retried < reverted + AdaptConfig().retry_after, "retried only once the block ran out"
    assert policy.current == HYB2


def test_a_clearly_worse_trial_is_cut_short():
    cfg = AdaptConfig()
    policy = Policy(cfg, candidate_layouts(4, [2, 2]), DATA4)
    much_slower = lambda lay, s: {"wait": 0.4, "step_time": 0.1 if lay == DATA4 else 0.2}  # half the samples/s
    (s1, switch), (s2, revert) = run(policy, 60, much_slower)[:2]
    assert switch.to == HYB2 and revert.to == DATA4
    assert s2 == s1 + 2 + cfg.settle + cfg.early_check  # not a full window of the slow layout
    assert revert.evidence["early_loss"] == cfg.early_loss
    assert revert.evidence["samples_per_s_after"] == pytest.approx(160)
    assert "first 5 steps" in revert.evidence["reason"]
    assert policy.state()["blocked"][0]["layout"] == HYB2.to_dict()
    assert [h["decision"] for h in policy.history[:2]] == ["switch", "revert"]


def test_a_trial_just_below_the_bar_runs_its_full_window():
    cfg = AdaptConfig()
    policy = Policy(cfg, candidate_layouts(4, [2, 2]), DATA4)
    a_bit_faster = lambda lay, s: {"wait": 0.4, "step_time": 0.1 if lay == DATA4 else 0.09}
    decisions = run(policy, 200, a_bit_faster)
    assert names(decisions) == ["switch"] and policy.current == HYB2
    kept = [h for h in policy.history if h["decision"] == "keep"]
    assert kept[0]["step"] == decisions[0][0] + 2 + cfg.settle + cfg.window


def test_next_decision_is_where_the_policy_decides():
    """Chunks ending at next_decision() carry every switch and revert out on the step it was made."""
    cfg = AdaptConfig()
    policy = Policy(cfg, candidate_layouts(4, [2, 2]), DATA4)
    shape = lambda lay, s: {"wait": 0.4, "step_time": 0.1 if lay == DATA4 else 0.2}
    step, made = 0, []
    while step < 300:
        until = policy.next_decision(step)
        assert until > step
        pending = None
        for s in range(step + 1, until + 1):
            d = policy.observe(record(s, policy.current, **shape(policy.current, s)))
            if isinstance(d, (Switch, Revert)):
                assert s == until, "a decision came before the chunk's end"
                pending = d
        step = until
        if pending:
            made.append((step, pending.name))
            policy.switched(pending.to, step)
    assert made[:2] == [(cfg.window, "switch"), (cfg.window + cfg.settle + cfg.early_check, "revert")]


def test_fast_slow_fast_with_a_chatty_layout_ends_where_the_link_allows():
    """Measured on the two-namespace testbed (GPT, 2 x 2 ranks): on a fast link data is faster,
    though it waits 40 % of its step, and hybrid's own tensor-parallel collectives keep its wait
    above the threshold too; on a slow one hybrid is faster. The policy tries hybrid once on the
    fast link and cuts the trial short, takes it when the link slows, steps back to data when the
    link recovers, and then leaves hybrid alone: no trial of it again while the link stays fast."""
    rng = random.Random(7)
    cfg = AdaptConfig(window=10, cooldown=20)
    policy = Policy(cfg, candidate_layouts(4, [2, 2]), DATA4)
    figures = {(DATA4, False): (0.40, 0.084), (DATA4, True): (0.90, 0.58),
               (HYB2, False): (0.52, 0.155), (HYB2, True): (0.80, 0.486)}

    def shape(lay, step):
        wait, time = figures[(lay, 300 <= step < 700)]
        return {"wait": wait * rng.uniform(0.95, 1.05), "step_time": time * rng.uniform(0.97, 1.03)}

    decisions = run(policy, 1100, shape)  # hybrid is held back for retry_after (400) steps after the step back
    got = [(d.name, d.to, d.evidence.get("reason", "")[:14]) for _, d in decisions]
    assert got == [("switch", HYB2, "comm_wait"), ("revert", DATA4, "samples/s afte"),
                   ("switch", HYB2, "comm_wait"), ("switch", DATA4, "comm_wait_fell")], got
    steps = [s for s, _ in decisions]
    assert steps[1] - steps[0] <= 2 + cfg.settle + cfg.early_check  # the fast-link trial is cut short
    assert 300 < steps[2] <= 300 + 3 * cfg.window and 700 < steps[3] <= 700 + 3 * cfg.window
    assert policy.current == DATA4
    kept = [h for h in policy.history if h["decision"] == "keep"]
    assert len(kept) == 2 and kept[-1]["evidence"]["layout"]["strategy"] == "data"


def test_each_revert_of_a_layout_doubles_its_block():
    cfg = AdaptConfig(window=10, cooldown=20)
    policy = Policy(cfg, candidate_layouts(4, [2, 2]), DATA4)
    shape = lambda lay, s: {"wait": 0.4, "step_time": 0.1 if lay == DATA4 else 0.2}
    decisions = run(policy, 3500, shape)
    reverts = [s for s, d in decisions if d.name == "revert"]
    tries = [s for s, d in decisions if d.name == "switch"]
    assert len(tries) == len(reverts) == 4
    gaps = [t - r for r, t in zip(reverts, tries[1:])]
    assert [g // cfg.retry_after for g in gaps] == [1, 2, 4], gaps  # 400, 800, 1600 steps (+ a window)
    assert all(g < b * cfg.retry_after + 2 * cfg.window for g, b in zip(gaps, [1, 2, 4]))


def test_the_rules_are_passed_in_and_asked_in_order():
    """A rule put before the default ones answers first; one that answers None leaves the window
    to the others (here rule 4's switch)."""
    config, asked = AdaptConfig(window=5), []

    def first(answer):  # the default rules, fresh (they keep what they said), after one of the test's
        def rule(st, window, means, step):
            asked.append((step, means["steps"]))
            return answer
        default = Rules.default(config)
        return Rules(default.every_step, (rule, *default.every_window))

    said = Report("test", {})
    policy = Policy(config, [DATA4, HYB2], DATA4, rules=first(said))
    assert run(policy, 5, lambda layout, step: {"wait": 0.4}) == [(5, said)]
    assert policy.history == [{"step": 5, **said.to_dict()}]
    policy = Policy(config, [DATA4, HYB2], DATA4, rules=first(None))
    assert [(s, d.name, d.to) for s, d in run(policy, 5, lambda layout, step: {"wait": 0.4})] == [(5, "switch", HYB2)]
    assert asked == [(5, [1, 5]), (5, [1, 5])]
