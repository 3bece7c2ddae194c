"""The cost model against hand-computed cases, and against Megatron-LM's published scaling."""

from __future__ import annotations

import pathlib

import pytest

from orchestrator import cli, costmodel
from orchestrator.costmodel import Hardware, Link, ModelShape, allgather_time, allreduce_time, overlap, predict

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_ring_collectives_by_hand():
    link = Link(bandwidth=10e9, latency=1e-3)
    # 100 MB over 4 ranks: 2 * 3/4 * 1e8 / 1e10 = 15 ms, plus 2 * 3 hops of 1 ms
    assert allreduce_time(100e6, 4, link) == pytest.approx(0.015 + 0.006)
    # all-gather: half the traffic and half the hops
    assert allgather_time(100e6, 4, link) == pytest.approx(0.0075 + 0.003)
    assert allreduce_time(100e6, 1, link) == 0.0 and allreduce_time(0, 8, link) == 0.0


def test_buckets_fill_in_backward_order():
    mb = 2**20
    assert costmodel.buckets(10 * mb, 4 * mb) == [4 * mb, 4 * mb, 2 * mb]
    assert costmodel.buckets(3 * mb, 25 * mb) == [3 * mb]


def test_overlap_with_a_known_bucket_schedule():
    # backward takes 1 s and fills 4 equal buckets at 0.25, 0.5, 0.75 and 1.0 s; each all-reduce
    # takes 0.3 s and they run one after another: 0.25-0.55, 0.55-0.85, 0.85-1.15, 1.15-1.45
    total, left = overlap(1.0, [1.0] * 4, [0.3] * 4)
    assert total == pytest.approx(1.2) and left == pytest.approx(0.45)
    # fast collectives hide behind backward but for the last one
    assert overlap(1.0, [1.0] * 4, [0.1] * 4)[1] == pytest.approx(0.1)
    # one bucket: nothing overlaps
    assert overlap(1.0, [4.0], [0.5])[1] == pytest.approx(0.5)


def test_one_device_is_all_compute_and_small_buckets_pay_latency():
    hw = Hardware(nodes=2, per_node=2, flops=1e12, intra=Link(10e9, 1e-5), inter=Link(1e9, 1e-3))
    m = ModelShape(params=10e6, flops_per_sample=6 * 10e6)
    one = predict(m, hw, 32, 1, 1)
    assert one.step_s == pytest.approx(one.compute_s) == pytest.approx(32 * 6 * 10e6 / 1e12)
    small, big = predict(m, hw, 32, 4, 1, bucket_cap_mb=0.1), predict(m, hw, 32, 4, 1, bucket_cap_mb=5)
    assert small.dp_comm_s > big.dp_comm_s  # 382 buckets x 6 ms of latency against 8
    # a dp group inside one node uses the fast link
    assert predict(m, hw, 32, 2, 1).dp_comm_s < predict(m, hw, 32, 4, 1).dp_comm_s


def test_megatron_lm_weak_scaling_is_reproduced():
    """8.3B GPT (72 layers, hidden 3072, seq 1024, vocab 51200), tp 8 x dp 64 on 512 V100s with
    Megatron-LM's own hardware figures: 76 % weak-scaling efficiency against one GPU at 39 TFLOP/s
    (arXiv 1909.08053). Megatron-LM then all-reduced gradients after backward: one bucket."""
    m = ModelShape.transformer(layers=72, hidden=3072, seq=1024, vocab=51200)
    assert m.params == pytest.approx(8.3e9, rel=0.01)
    p = predict(m, costmodel.PRESETS["v100-dgx2h"], 512, dp=64, tp=8, bucket_cap_mb=1e9)
    efficiency = p.compute_s / p.step_s  # achieved FLOP/s per GPU over the single GPU's 39 TFLOP/s
    assert efficiency == pytest.approx(0.76, rel=0.10), efficiency
    print(f"Megatron-LM 8.3B on 512 V100: predicted {efficiency:.1%} weak-scaling efficiency (published 76 %)")


@pytest.mark.parametrize("preset", sorted(costmodel.PRESETS))
def test_plan_on_every_preset_recommends_a_layout(capsys, preset):
    assert cli.main(["plan", str(ROOT / "examples" / "gpt.yaml"), "--cluster", preset, "--global-batch", "1024"]) == 0
    out = capsys.readouterr().out
    assert "recommended: strategy" in out and "samples/s" in out
    rows = [line for line in out.splitlines() if line.startswith(("data ", "hybrid ", "tensor "))]
    assert rows and float(rows[0].split()[3]) <= min(float(r.split()[3]) for r in rows)  # fastest first


def test_plan_reads_a_cluster_file(tmp_path, capsys):
    spec = tmp_path / "cluster.yaml"
    spec.write_text("nodes: 2\nper_node: 4\ntflops: 100\nintra_gb_s: 200\ninter_gb_s: 12.5\n")
    assert cli.main(["plan", str(ROOT / "examples" / "gpt.yaml"), "--cluster", str(spec), "--global-batch", "64"]) == 0
    assert "2 x 4 devices at 100 TFLOP/s" in capsys.readouterr().out


@pytest.mark.parametrize("text, says", [
    ("nodes: 2\n", "needs"), ("preset: tpu\n", "not one of"), ("nodes: -1\nper_node: 1\ntflops: 1\nintra_gb_s: 1\n"
                                                             "inter_gb_s: 1\n", "must be a number > 0"),
    ("colour: red\n", "unknown cluster spec keys"), ("[1, 2", "not valid YAML"),
])
def test_bad_cluster_specs_say_what_is_wrong(tmp_path, capsys, text, says):
    spec = tmp_path / "cluster.yaml"
    spec.write_text(text)
    assert cli.main(["plan", str(ROOT / "examples" / "gpt.yaml"), "--cluster", str(spec)]) == 2
    assert says in capsys.readouterr().err
