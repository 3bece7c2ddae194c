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


def test_stages_are_whole_nodes_and_no_more_than_the_blocks():
    assert pipeline_cost.layouts(hw(1.0, nodes=4), 64, MODEL) == [(2, 8), (4, 4)]
    few = ModelShape(params=1e9, flops_per_sample=1.0, blocks=2, block_params=1e8)
    assert pipeline_cost.layouts(hw(1.0, nodes=4), 64, few) == [(2, 8)]
    assert costmodel.strategy_of(4, 1, 1, pp=2) == "pipeline"
