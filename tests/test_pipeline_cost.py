"""The cost model's pipeline layouts (orchestrator/policy/pipeline_cost.py): the bubble, the
link, the replicas' average and a rank's memory, and `gearshift plan` listing them."""

from __future__ import annotations

import pytest

from gearshift.orchestrator.policy import costmodel, pipeline_cost
from gearshift.orchestrator.policy.costmodel import Hardware, Link, ModelShape

MODEL = ModelShape(params=1e9, flops_per_sample=6e12, boundary_bytes_per_sample=4e6, blocks=24, block_params=4e7,
                   activations=costmodel.Activations(layers=24, per_layer=1e7, per_layer_split=0.0, layer_input=1e6))


def hw(inter_gbps: float, nodes: int = 2) -> Hardware:
    return Hardware(nodes=nodes, per_node=4, flops=1e14, intra=Link(1e11, 1e-6), inter=Link(inter_gbps * 1e9, 1e-5))


def test_a_compute_bound_pipeline_idles_for_its_bubble_and_a_slow_link_paces_it():
    fast = pipeline_cost.predict(MODEL, hw(100.0), 64, pp=2, dp=4, microbatches_=8)
    c = MODEL.flops_per_sample * 2 / 2 / 1e14  # a micro-batch of 64 / 4 / 8 = 2 samples, half the layers
    assert fast.microbatches == 8 and fast.bubble_s == pytest.approx(c)
    # compute paces it: the bubble is (pp - 1) / (m + pp - 1) of the compute-bound part
    assert fast.bubble_s / (fast.compute_s + fast.bubble_s) == pytest.approx(1 / 9)
    slow = pipeline_cost.predict(MODEL, hw(0.01), 64, pp=2, dp=4, microbatches_=8)
    t = 4e6 * 2 / 1e7 + 1e-5
    assert slow.step_s >= 8 * 2 * t and slow.step_s > fast.step_s and slow.link_s == pytest.approx(9 * 2 * t)
    # its replicas' average is a stage's gradients (1/pp), inside a node
    assert fast.dp_comm_s == pytest.approx(costmodel.allreduce_time(1e9 * 4 / 2, 4, Link(1e11, 1e-6)))


def test_across_a_slow_link_stages_beat_data_parallelism_and_not_across_a_fast_one():
    for gbps, wins in ((0.5, True), (400.0, False)):
        preds = pipeline_cost.plan(MODEL, hw(gbps), 64)
        pipe = min(p.step_s for p in preds if p.strategy == "pipeline")
        data = min(p.step_s for p in preds if p.strategy == "data")
        assert (pipe < data) is wins, (gbps, pipe, data)


def test_one_f_one_b_holds_fewer_micro_batches_than_gpipe():
    one = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8, schedule="1f1b")
    all_ = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8, schedule="gpipe")
    assert all_["activations"] == pytest.approx(4 * one["activations"])  # 8 in flight against 2
    assert one["params"] == pytest.approx(1e9 / 2 * 4)


def test_a_stage_sharded_over_its_replicas_saves_optimizer_state_beyond_the_whole_stage_it_gathers():
    """parallel.dp_shard: the stage's 0.5e9 parameters' state split over its replicas, and during
    the step its parameters and gradients whole beside the shards. Over 2 replicas that breaks
    even with the unsharded stage (as measured: bench/pipeline_memory.py); over 4 it saves."""
    whole = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8)
    two = pipeline_cost.memory(MODEL, 2, 2, global_batch=64, microbatches_=8, shard=2)
    four = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8, shard=4)
    assert four["params"] == pytest.approx(0.5e9 / 4 * 4) and four["optimizer"] == pytest.approx(0.5e9 / 4 * 8)
    assert four["gathered"] == pytest.approx(0.5e9 * 8)
    state = ("params", "grads", "optimizer", "gathered")
    assert sum(two[k] for k in state) == pytest.approx(sum(whole[k] for k in state))
    assert sum(four[k] for k in state) == pytest.approx(0.75 * sum(whole[k] for k in state))
    from gearshift.strategies.layout import Layout

    layout = Layout.for_workers("pipeline", 8, None, pp_size=2, dp_shard=True)
    assert pipeline_cost.memory_of(MODEL, layout, global_batch=64, microbatches_=8) == four


def test_interleaving_halves_the_bubble_and_crosses_the_link_twice_as_often():
    """Two stages a position, each half a position's layers: the fill costs pp - 1 half-stages
    (zero bubble: a third of that), each micro-batch crosses the link twice each way."""
    c = MODEL.flops_per_sample * 2 / 2 / 1e14
    t = 4e6 * 2 / 1e7 + 1e-5
    for schedule, v, f in (("1f1b", 1, 1.0), ("interleaved_1f1b", 2, 1.0), ("interleaved_zb", 2, 1 / 3)):
        fast = pipeline_cost.predict(MODEL, hw(100.0), 64, pp=2, dp=4, microbatches_=8, schedule=schedule)
        assert fast.bubble_s == pytest.approx(f * c / v), schedule
        slow = pipeline_cost.predict(MODEL, hw(0.01), 64, pp=2, dp=4, microbatches_=8, schedule=schedule)
        assert slow.link_s == pytest.approx((v * 8 + 1) * 2 * t), schedule
        assert slow.step_s >= 8 * 2 * v * t
    # two stages a position: up to (v - 1) pp + 2 pp - 1 = 5 passes of a quarter of the layers in flight
    one = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8, schedule="1f1b")
    inter = pipeline_cost.memory(MODEL, 2, 4, global_batch=64, microbatches_=8, schedule="interleaved_1f1b")
    assert inter["activations"] == pytest.approx(one["activations"] * (5 / 4) / (2 / 2))
    from gearshift.strategies.pipeline import bubble

    assert bubble(2, 8, "interleaved_1f1b") == pytest.approx(1 / 17) and bubble(2, 8, "gpipe") == pytest.approx(1 / 9)


def test_stages_are_whole_nodes_and_no_more_than_the_blocks():
    assert pipeline_cost.layouts(hw(1.0, nodes=4), 64, MODEL) == [(2, 8), (4, 4)]
    few = ModelShape(params=1e9, flops_per_sample=1.0, blocks=2, block_params=1e8)
    assert pipeline_cost.layouts(hw(1.0, nodes=4), 64, few) == [(2, 8)]
    assert costmodel.strategy_of(4, 1, 1, pp=2) == "pipeline"


def test_the_simulated_vit_huge_run_moves_to_stages_of_a_node_and_uses_the_devices_more():
    """ViT-Huge/14 on 16 nodes x 8 A100 joined at 25 GB/s a node, the link at a quarter of its rate
    from step 1000 to 3000 (tests/test_costmodel.py's run): without pipelines the best the policy
    can do is hybrid, 36 % of the devices' time computing; with them it moves at its first
    decision to one stage a node and reaches 62 %, within 2 % of an oracle that knows the link."""
    from gearshift.orchestrator.policy.simulate import Scenario, simulate
    from test_costmodel import VIT_H

    hw = Hardware(nodes=16, per_node=8, flops=150e12, intra=Link(230e9, 3e-6), inter=Link(25e9, 10e-6))
    scenario = Scenario(5000, ((0, 1.0), (1000, 0.25), (3000, 1.0)))
    without = simulate(VIT_H, hw, 4096, scenario, pipelines=False)
    with_ = simulate(VIT_H, hw, 4096, scenario)
    assert not any(name.startswith("pipeline") for name in without["static"])
    assert with_["decisions"][0]["to"] == "pipeline:16 8x1" and with_["reverted_switches"] == 0
    assert with_["utilisation"] > 1.5 * without["utilisation"] and with_["auto_vs_oracle"] >= 0.98
    # the stages' bubble is what is left: more micro-batches than the default 2 x pp shrink it
    default = pipeline_cost.predict(VIT_H, hw, 4096, 16, 8)
    more = pipeline_cost.predict(VIT_H, hw, 4096, 16, 8, microbatches_=128)
    assert default.microbatches == 32 and more.step_s < default.step_s and more.bubble_s < default.bubble_s
    print(f"ViT-H/14, 128 A100: utilisation data {with_['utilisation_static']['data 128x1']:.1%}, auto without "
          f"pipelines {without['utilisation']:.1%}, with {with_['utilisation']:.1%}")


def test_gearshift_simulate_can_leave_the_pipelines_out(capsys):
    import pathlib

    from gearshift.orchestrator.commands import cli

    root = pathlib.Path(__file__).resolve().parents[1]
    args = ["simulate", str(root / "examples" / "gpt.yaml"), "--cluster", "a100-ib200", "--scenario",
            str(root / "examples" / "scenario-link-drop.yaml"), "--global-batch", "1024", "--nodes", "4"]
    assert cli.main(args) == 0
    assert "static pipeline:" in capsys.readouterr().out
    assert cli.main(args + ["--no-pipelines"]) == 0
    assert "pipeline" not in capsys.readouterr().out


def test_tensor_parallelism_inside_a_stage_splits_its_compute_and_memory_and_adds_its_all_reduces():
    """pp x dp x tp: a stage's blocks split tp ways inside the node (compute and the plan's share
    of the state over tp), each micro-batch's activations all-reduced over the tp group, the
    replicas' average a 1/(pp tp) share; `plan` lists each tp that divides a node."""
    shape = ModelShape(params=1e9, flops_per_sample=6e12, boundary_bytes_per_sample=4e6, blocks=24, block_params=4e7,
                       tp_boundaries=96, tp_param_share=0.96, activations=MODEL.activations)
    one = pipeline_cost.predict(shape, hw(0.5), 64, pp=2, dp=4, microbatches_=8)
    two = pipeline_cost.predict(shape, hw(0.5), 64, pp=2, dp=2, microbatches_=8, tp=2)
    assert two.tp == 2 and one.tp_comm_s == 0 and two.tp_comm_s > 0
    assert two.compute_s == pytest.approx(one.compute_s)  # micro-batches of twice the samples, each split in two
    mb = pipeline_cost.stage_tp(shape, hw(0.5), 64 / 2 / 8, 2, 2)
    assert two.tp_comm_s == pytest.approx(8 * mb) and mb == pytest.approx(
        96 / 2 * costmodel.allreduce_time(4e6 * 4, 2, Link(1e11, 1e-6)))
    mem1 = pipeline_cost.memory(shape, 2, 4, global_batch=64, microbatches_=8)
    mem2 = pipeline_cost.memory(shape, 2, 2, global_batch=64, microbatches_=8, tp=2)
    assert mem2["params"] == pytest.approx(mem1["params"] * (0.96 / 2 + 0.04))
    labels = {p.label for p in pipeline_cost.plan(shape, hw(0.5), 64)}
    assert {"pipeline:2", "pipeline:2xtp2", "pipeline:2xtp4"} <= labels, labels
    with pytest.raises(ValueError, match=r"pp\(2\) x dp\(4\) x tp\(2\) = 16 devices"):
        pipeline_cost.predict(shape, hw(0.5), 64, pp=2, dp=4, tp=2)
