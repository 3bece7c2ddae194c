"""Memory per rank and sharded layouts in the cost model, `gearshift plan` and the adaptive
policy: pure logic against hand-computed figures, no process group, no Ray."""

from __future__ import annotations

import json
import pathlib
import random
from types import SimpleNamespace

import pytest

from gearshift import strategies
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.policy import costmodel
from gearshift.orchestrator.policy import job_shape
from gearshift.orchestrator.policy import hardware
from gearshift.orchestrator.policy.costmodel import GiB, Activations, Hardware, Link, MemoryOverhead, ModelShape, memory, predict
from gearshift.orchestrator.policy.adaptive import AdaptConfig, Policy, Switch, candidate_layouts
from gearshift.strategies.base import REPLICATE, Strategy
from gearshift.strategies.layout import GROUPED, REPLICATED, SHARDED, Layout

ROOT = pathlib.Path(__file__).resolve().parents[1]
NO_OVERHEAD = MemoryOverhead(0.0, 0.0)
BIG_GPT = "model.kwargs={vocab_size: 50304, block_size: 1024, n_layer: 24, n_head: 16, n_embd: 2048}"

# 1e9 parameters: 10 blocks of 0.07e9 and a root (embeddings, head) of 0.3e9; tp splits 0.75 of them.
# A sample leaves 100 bytes a layer that tp does not split, 400 that it does, and 50 outside the layers.
SHAPE = ModelShape(params=1e9, flops_per_sample=1.0, tp_param_share=0.75, blocks=10, block_params=0.07e9,
                   activations=Activations(layers=10, per_layer=100, per_layer_split=400, layer_input=10, outside=50))


def mem(dp, tp=1, shard=1, **kw):
    return memory(SHAPE, dp, tp, shard, **{"global_batch": 32, "overhead": NO_OVERHEAD, **kw})


def state(m):
    return m["params"] + m["grads"] + m["optimizer"]


@pytest.fixture
def sharded_strategies(monkeypatch):
    """fsdp and hsdp as the strategies branch registers them (same mesh and sharding forms), so
    that Layouts of them are validated here too; the registry is restored afterwards."""
    def never(*args):
        raise AssertionError("a stand-in is not applied")

    monkeypatch.setitem(strategies.STRATEGIES, "fsdp", Strategy("fsdp", REPLICATE, never, sharding=(SHARDED,)))
    monkeypatch.setitem(strategies.STRATEGIES, "hsdp", Strategy("hsdp", REPLICATE, never,
                                                                sharding=(GROUPED, SHARDED, REPLICATED)))


# ----------------------------------------------------------------------------- memory by hand

def test_replicated_state_by_hand():
    m = mem(4)
    # fp32 parameters and gradients, Adam's two fp32 moments: 4 + 4 + 8 bytes a parameter
    assert (m["params"], m["grads"], m["optimizer"]) == (4e9, 4e9, 8e9)
    assert m["gathered"] == 0 and m["cast_weights"] == 0
    # 32 / 4 = 8 samples at once, each 10 x (100 + 400) + 50 bytes
    assert m["micro_batch"] == 8 and m["activations"] == 8 * 5050
    assert m["total"] == pytest.approx(16e9 + 8 * 5050)


def test_sharded_state_divides_by_the_shard_group():
    data, fsdp = mem(4), mem(4, shard=4)
    assert state(fsdp) == pytest.approx(state(data) / 4)
    assert fsdp["activations"] == data["activations"]  # sharding state leaves the micro-batch as it was
    # gathered for a while: the root (0.3e9) and two blocks (0.07e9 each) of fp32 parameters, one
    # block's fp32 gradients, less the quarter this rank holds anyway
    assert fsdp["gathered"] == pytest.approx((0.44e9 * 4 + 0.07e9 * 4) * 3 / 4)
    assert fsdp["total"] < data["total"] / 2
    hsdp = mem(8, shard=4)  # two groups of four: the state of fsdp over four, replicated twice
    assert state(hsdp) == pytest.approx(state(mem(8)) / 4) == pytest.approx(state(fsdp))
    assert mem(8, shard=8)["total"] < hsdp["total"] < mem(8)["total"]


def test_tensor_parallelism_divides_only_what_it_splits():
    hybrid = mem(2, tp=2)
    # 0.25e9 whole on every rank, 0.75e9 halved: 0.625e9 parameters a rank
    assert hybrid["params"] == pytest.approx(0.625e9 * 4)
    # 16 samples at once (32 over dp 2), each 10 x (100 + 400 / 2) + 50 bytes
    assert hybrid["activations"] == 16 * 3050
    sharded = mem(2, tp=2, shard=2)  # hybrid with dp_shard: the tp slice split again over dp
    assert state(sharded) == pytest.approx(state(hybrid) / 2)
    assert mem(1, tp=4)["params"] == pytest.approx(1e9 * (0.25 + 0.75 / 4) * 4)


def test_optimizer_micro_batch_checkpointing_precision_and_overhead():
    assert mem(4, optimizer_states=1)["optimizer"] == 4e9 and mem(4, optimizer_states=0)["optimizer"] == 0
    assert mem(4, micro_batch=2)["activations"] == 2 * 5050
    assert mem(4, micro_batch=100)["micro_batch"] == 8  # larger than the share: the share
    ckpt = costmodel.replace(SHAPE, activations=costmodel.replace(SHAPE.activations, recompute=True))
    # every layer's input (10 bytes) kept, one layer (500) rebuilt at a time, and the 50 outside
    assert memory(ckpt, 4, global_batch=32, overhead=NO_OVERHEAD)["activations"] == 8 * (100 + 500 + 50)
    # bf16 autocast: the Linear weights' bf16 casts stay until backward, all of them when replicated
    assert mem(4, compute_bytes=2)["cast_weights"] == pytest.approx(1e9 * 2)
    assert mem(4, shard=4, compute_bytes=2)["cast_weights"] == pytest.approx(0.44e9 * 2)  # root and two blocks
    m = memory(SHAPE, 4, global_batch=32, overhead=MemoryOverhead(fixed=1 * GiB, fraction=0.1))
    tensors = 16e9 + 8 * 5050
    assert m["overhead"] == pytest.approx(GiB + 0.1 * tensors) and m["total"] == pytest.approx(tensors + m["overhead"])
    # the fraction that makes the prediction a measured peak
    fitted = costmodel.fit_memory_overhead(mem(4), measured_bytes=tensors * 1.2 + GiB)
    assert fitted.fraction == pytest.approx(0.2)
    ok, said = costmodel.fits(m, 16 * GiB)
    assert not ok and said["reason"] == f"does not fit: {m['total'] / GiB:.1f} > 16 GiB"
    assert said["predicted_bytes"] == m["total"] and said["available_bytes"] == 16 * GiB
    assert costmodel.fits(m, 0)[0]  # an unknown device size judges nothing


def test_the_optimizer_and_precision_are_read_from_the_job():
    def job(name, momentum=0.0, precision="fp32"):
        return SimpleNamespace(optimizer=SimpleNamespace(name=name, momentum=momentum),
                               train=SimpleNamespace(micro_batch_size=4, precision=precision))

    assert job_shape.memory_settings(job("adamw")) == {"micro_batch": 4, "optimizer_states": 2, "compute_bytes": 4.0}
    assert job_shape.memory_settings(job("sgd"))["optimizer_states"] == 0
    assert job_shape.memory_settings(job("sgd", 0.9))["optimizer_states"] == 1
    assert job_shape.memory_settings(job("adam", precision="bf16"))["compute_bytes"] == 2.0
    assert job_shape.memory_settings(job("adam", precision={"dtype": "fp16"}))["compute_bytes"] == 2.0


def test_a_gpt_layer_saves_what_korthikanti_counts_less_dropout():
    # 16-bit activations (arXiv 2205.05198): 34 s h bytes a layer, with dropout masks (2 s h) and the
    # norms' inputs in 16 bits. The built-in GPT: no dropout (-2), fp32 norm inputs (+4) and attention's
    # output kept twice, by the attention kernel and as the projection's input after a reshape (+2): 38 s h
    a = costmodel.transformer_activations(layers=1, hidden=64, seq=32, vocab=100, act_bytes=2.0)
    sh = 32 * 64
    assert a.per_layer + a.per_layer_split == 38 * sh
    assert a.per_layer_split == 26 * sh  # q, k, v, attention's output, the projection's input, 2 x 4h of MLP
    gpt = ModelShape.transformer(layers=24, hidden=2048, seq=1024, vocab=50304)
    assert gpt.blocks == 24 and gpt.block_params == 12 * 2048 ** 2
    assert gpt.tp_param_share == pytest.approx(24 * 12 * 2048 ** 2 / gpt.params)


def test_the_built_in_gpt_splits_what_its_plan_shards():
    from gearshift.orchestrator.job import load_job

    model = job_shape.shape_of_job(load_job(ROOT / "examples" / "gpt.yaml"))
    # examples/gpt.yaml: 2 layers of width 128, vocabulary 128, block 64; what tp splits: q, k, v,
    # fc (weights and biases, colwise), the projections' weights (rowwise; their biases stay whole)
    h = 128
    split = 2 * (3 * (h * h + h) - h + h * h + (4 * h * h + 4 * h) + 4 * h * h)  # k has no bias
    assert model.tp_param_share == pytest.approx(split / model.params)
    assert model.blocks == 2 and model.activations is not None and model.activations.layers == 2


def saved_for_backward(model, x, target, dtype=None) -> int:
    """Bytes autograd keeps from a forward and loss for backward, each storage once, the
    parameters themselves left out (what `activations` and `cast_weights` predict)."""
    import torch
    import torch.nn.functional as F

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            out = model(x)
            if out.dim() == 3:  # a GPT's (batch, seq, vocab) logits against its next tokens
                out, target = out.flatten(0, 1), target.flatten()
            F.cross_entropy(out, target)
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_predicted_activations_are_what_autograd_keeps(precision):
    """The built-in GPT and MLP forward on the CPU, their saved tensors counted: the prediction
    (activations, and under bf16 the weights' casts) within 15 %."""
    import torch

    from gearshift.orchestrator.job import load_job
    from gearshift.workers.build import components

    overrides = [f"train.precision={precision}", "train.global_batch_size=4"]
    for example, x, y in [("gpt.yaml", torch.randint(0, 128, (4, 64)), None),
                          ("mlp.yaml", torch.randn(4, 784), torch.randint(0, 10, (4,)))]:
        job = load_job(ROOT / "examples" / example, overrides)
        torch.manual_seed(0)
        model = components.build_model(job.to_dict()["model"], [job.base_dir])
        shape = job_shape.shape_of_job(job)
        settings = job_shape.memory_settings(job)
        m = memory(shape, 1, global_batch=4, **settings)
        measured = saved_for_backward(model, x, x if y is None else y,
                                      torch.bfloat16 if precision == "bf16" else None)
        predicted = m["activations"] + m["cast_weights"]
        assert measured == pytest.approx(predicted, rel=0.15), (example, measured, predicted)


# ----------------------------------------------------------------------------- sharded step time

def test_prefetched_gathers_by_hand():
    # 4 units of 0.25 s compute; each gather may start once the unit before it starts computing
    assert costmodel.prefetched(1.0, [0.1] * 4) == pytest.approx(0.1)  # only the first gather shows
    assert costmodel.prefetched(1.0, [0.5] * 4) == pytest.approx(1.25)  # gathers set the pace
    assert costmodel.prefetched(1.0, []) == 0.0


def test_fsdp_moves_one_and_a_half_times_ddps_bytes():
    hw = Hardware(nodes=1, per_node=4, flops=1e12, intra=Link(10e9), inter=Link(10e9))
    one_unit = ModelShape(params=1e8, flops_per_sample=6e8)  # no blocks: FSDP gathers the model at once
    data, fsdp = predict(one_unit, hw, 32, 4, 1, bucket_cap_mb=1e9), predict(one_unit, hw, 32, 4, 1, shard=4)
    assert fsdp.dp_comm_s == pytest.approx(1.5 * data.dp_comm_s)
    assert fsdp.strategy == "fsdp" and fsdp.shard == 4 and fsdp.to_dict()["shard"] == 4
    # nothing to overlap forward's gather of a single unit with: it is all exposed
    assert fsdp.exposed_wait_s > allgather(4e8, 4, hw.intra)
    with pytest.raises(ValueError, match="shard"):
        predict(one_unit, hw, 32, 4, 1, shard=3)


def allgather(nbytes, n, link):
    return costmodel.allgather_time(nbytes, n, link)


def test_hsdp_gathers_inside_the_node_and_all_reduces_a_shard_across_nodes():
    hw = Hardware(nodes=2, per_node=4, flops=1e15, intra=Link(100e9), inter=Link(1e9))
    one_unit = ModelShape(params=1e8, flops_per_sample=6.0)  # compute ~0: every transfer shows
    hsdp = predict(one_unit, hw, 32, 8, 1, shard=4)
    nbytes = 4e8
    inside = allgather(nbytes, 4, hw.intra)
    # four rings leave each node at once, each with a quarter of the gradients over 2 replicas
    across = costmodel.allreduce_time(nbytes / 4, 2, Link(1e9 / 4))
    assert hsdp.strategy == "hsdp" and hsdp.dp_comm_s == pytest.approx(3 * inside + across)
    fsdp = predict(one_unit, hw, 32, 8, 1, shard=8)  # every gather crosses the slow link, whole
    assert fsdp.dp_comm_s == pytest.approx(3 * 7 / 8 * nbytes / 1e9) and fsdp.dp_comm_s > 2 * hsdp.dp_comm_s


# ----------------------------------------------------------------------------- gearshift plan

def test_plan_marks_what_does_not_fit_and_recommends_what_does(capsys):
    argv = ["plan", str(ROOT / "examples" / "gpt.yaml"), "--cluster", "a100-ib200", "--nodes", "2", "--global-batch",
            "256", "--set", BIG_GPT, "--set", "train.precision=bf16", "--set", "train.micro_batch_size=4"]
    assert cli.main([*argv, "--device-memory", "24"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] + " " + line.split()[1]: line for line in out.splitlines()
            if line.split() and line.split()[0] in ("data", "fsdp", "hsdp:8", "hybrid", "hybrid:fsdp", "tensor")}
    assert {"data 16x1", "fsdp 16x1", "hsdp:8 16x1", "hybrid 8x2", "hybrid:fsdp 8x2"} <= set(rows), out
    assert "24 GiB each" in out and "GiB/rank" in out
    data_gib = float(rows["data 16x1"].split()[7])
    assert data_gib > 24 and rows["data 16x1"].endswith(f"does not fit: {data_gib:.1f} > 24 GiB"), out
    assert "does not fit" not in rows["hsdp:8 16x1"]
    # data is the fastest row but does not fit: the fastest that fits is recommended
    lines = out.splitlines()
    assert lines[2].startswith("data 16x1"), out
    best = next(line for line in lines[3:] if "does not fit" not in line)
    assert best.startswith(("fsdp", "hsdp")), out
    assert f"recommended: strategy {best.split(':')[0].split()[0]}" in out, out
    # the same as JSON, with each layout's breakdown
    assert cli.main([*argv, "--device-memory", "24", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["recommended"]["fits"] and doc["recommended"]["strategy"] == best.split(":")[0].split()[0]
    assert doc["cluster"]["device_memory"] == 24 * GiB
    first = doc["predictions"][0]
    assert not first["fits"] and first["predicted_bytes"] > first["available_bytes"]
    assert set(first["memory"]) >= {"params", "grads", "optimizer", "activations", "overhead", "total"}
    # the preset's own 80 GB: data fits and is recommended
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "80 GiB each" in out and "recommended: strategy data" in out and "does not fit" not in out


def test_the_recommendation_names_the_settings_of_a_sharded_layout():
    from gearshift.orchestrator.commands.plan import recommendation

    hw = Hardware(nodes=2, per_node=8, flops=1e12, intra=Link(1e9), inter=Link(1e9))
    m = ModelShape(params=1e6, flops_per_sample=1e6)
    assert recommendation(predict(m, hw, 64, 16, 1, shard=8), hw) == "strategy hsdp, shard_size 8"
    assert recommendation(predict(m, hw, 64, 16, 1, shard=16), hw) == "strategy fsdp"
    assert recommendation(predict(m, hw, 64, 8, 2, shard=8), hw) == "strategy hybrid, tp_size 2, dp_shard true"
    assert recommendation(predict(m, hw, 64, 8, 2, 5), hw) == "strategy hybrid, tp_size 2, bucket_cap_mb 5"
    labels = {p.label for p in costmodel.plan(m, hw, 64)}
    assert {"data", "hsdp:8", "fsdp", "hybrid", "hybrid:fsdp", "tensor"} == labels


def test_plan_says_when_nothing_fits_and_reads_device_memory_from_a_spec(tmp_path, capsys):
    spec = tmp_path / "small.yaml"
    spec.write_text("{preset: a100-ib200, nodes: 2, device_memory_gb: 2, memory_overhead_gb: 0.5}\n")
    argv = ["plan", str(ROOT / "examples" / "gpt.yaml"), "--cluster", str(spec), "--global-batch", "256",
            "--set", BIG_GPT]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "2 GiB each" in out and "recommended: none: no layout fits 2 GiB a device" in out, out
    assert cli.main([*argv, "--device-memory", "0"]) == 2
    assert "--device-memory 0" in capsys.readouterr().err
    hw = hardware.hardware_from_spec({"preset": "a100-ib200", "device_memory_gb": 40, "memory_overhead_frac": 0})
    assert hw.device_memory == 40 * GiB and hw.memory_overhead.fraction == 0
    assert hardware.PRESETS["v100-dgx2h"].device_memory == 32 * GiB
    with pytest.raises(ValueError, match="device_memory_gb = -1"):
        hardware.hardware_from_spec({"preset": "a100-ib200", "device_memory_gb": -1})


# ----------------------------------------------------------------------------- the policy

def test_candidates_include_sharded_state(sharded_strategies):
    hyb = Layout("hybrid", 4, 2)
    assert candidate_layouts(8, [4, 4]) == [
        Layout("data", 8, 1), Layout("hsdp", 8, 1, 4), Layout("fsdp", 8, 1, 8), hyb, Layout("hybrid", 4, 2, 4),
        Layout("hybrid", 2, 4), Layout("hybrid", 2, 4, 2)]
    # one node: no hsdp (its groups would be the whole world); tensor has no dp to shard
    assert candidate_layouts(4, [4]) == [Layout("data", 4, 1), Layout("fsdp", 4, 1, 4), Layout("hybrid", 2, 2),
                                         Layout("hybrid", 2, 2, 2), Layout("tensor", 1, 4)]
    assert candidate_layouts(4, [1, 1, 1, 1]) == [Layout("data", 4, 1), Layout("fsdp", 4, 1, 4)]  # nodes of 1
    assert candidate_layouts(6, [4, 2])[:2] == [Layout("data", 6, 1), Layout("fsdp", 6, 1, 6)]  # unequal nodes
    assert candidate_layouts(1, [1]) == [Layout("data", 1, 1)]
    assert candidate_layouts(8, [4, 4], sharded=False) == [Layout("data", 8, 1), hyb, Layout("hybrid", 2, 4)]


def record(step, layout, wait, step_time=0.1, batch=32):
    world = layout.world
    return {"type": "step", "step": step, **layout.to_dict(), "step_time_max": step_time,
            "step_time_mean": step_time, "samples_per_s": batch / step_time, "data_time_mean": 0.0,
            "compute_time_mean": step_time * (1 - wait), "comm_wait_mean": wait * step_time,
            "comm_wait_frac_mean": wait,
            "ranks": {"compute_time": [step_time * (1 - wait)] * world, "comm_wait_frac": [wait] * world}}


def drive(policy, steps, shape, start=1):
    """Feed records, carrying out a Switch/Revert two steps later like the controller."""
    out, pending = [], None
    for step in range(start, start + steps):
        if pending and step > pending[1]:
            policy.switched(pending[0].to, pending[1])
            pending = None
        d = policy.observe(record(step, policy.current, **shape(policy.current, step)))
        if isinstance(d, Switch) or d.name == "revert":
            out.append((step, d))
            pending = (d, step + 2)
    return out


def fits_except(*too_big, available=24 * GiB):
    def fits(layout):
        predicted = 30 * GiB if layout in too_big else 10 * GiB
        ok = predicted <= available
        return ok, {"predicted_bytes": predicted, "available_bytes": available,
                    "reason": None if ok else costmodel.does_not_fit(predicted, available)}
    return fits


def test_the_policy_skips_a_candidate_that_does_not_fit(sharded_strategies):
    cands = candidate_layouts(8, [4, 4])
    data, hyb, hyb_sharded = cands[0], Layout("hybrid", 4, 2), Layout("hybrid", 4, 2, 4)
    policy = Policy(AdaptConfig(), cands, data, fits=fits_except(hyb))
    [(step, switch)] = drive(policy, 20, lambda lay, s: {"wait": 0.4})
    # the replicated hybrid does not fit: its sharded twin at the same tp is taken, not hsdp or fsdp
    assert switch.to == hyb_sharded
    assert switch.evidence["skipped"] == [{"layout": {"strategy": "hybrid", "dp": 4, "tp": 2},
                                           "predicted_bytes": 30 * GiB, "available_bytes": 24 * GiB,
                                           "reason": "does not fit: 30.0 > 24 GiB"}]
    assert json.loads(json.dumps(switch.to_dict()))["to"] == {"strategy": "hybrid", "dp": 4, "tp": 2, "shard": 4}
    # records of the sharded layout are recognised as the current one (shard included)
    policy.switched(hyb_sharded, 22)
    assert policy.current == hyb_sharded and policy._on_current(record(30, hyb_sharded, 0.1))
    assert not policy._on_current(record(30, hyb, 0.1))


def test_the_policy_stays_when_nothing_further_fits(sharded_strategies):
    cands = candidate_layouts(4, [2, 2])
    policy = Policy(AdaptConfig(), cands, cands[0], fits=fits_except(*cands[1:]))
    assert drive(policy, 100, lambda lay, s: {"wait": 0.5}) == []
    assert [s["layout"]["strategy"] for s in policy.state()["skipped"]] == ["hybrid", "hybrid"]


def test_without_a_memory_check_sharded_state_is_never_chosen(sharded_strategies):
    """Sharded state moves more bytes than replicated state at the same tp: once hybrid is
    reverted, the policy stays on data rather than trying hsdp, fsdp or the sharded hybrid."""
    cands = candidate_layouts(4, [2, 2])
    policy = Policy(AdaptConfig(), cands, cands[0])
    slower = lambda lay, s: {"wait": 0.3, "step_time": 0.1 if lay.strategy == "data" else 0.12}
    decisions = drive(policy, 300, slower)
    assert [(d.name, d.to) for _, d in decisions] == [("switch", Layout("hybrid", 2, 2)),
                                                      ("revert", Layout("data", 4, 1))]


def test_stepping_back_skips_a_layout_that_does_not_fit(sharded_strategies):
    """A faster link after a move to hybrid: back to the least sharded tp-1 layout that fits (hsdp,
    data being too big), with data named in the evidence."""
    cands = candidate_layouts(8, [4, 4])
    data, hsdp, hyb = cands[0], cands[1], Layout("hybrid", 4, 2)
    policy = Policy(AdaptConfig(), cands, hsdp, fits=fits_except(data))
    rng = random.Random(1)

    def shape(lay, step):
        slow = step < 1000
        if lay.tp == 1:
            return {"wait": 0.5 if slow else 0.05, "step_time": rng.uniform(0.19, 0.21) if slow else 0.08}
        return {"wait": 0.1 if slow else 0.02, "step_time": rng.uniform(0.135, 0.145) if slow else 0.1}

    decisions = drive(policy, 2000, shape)
    assert [(d.name, d.to) for _, d in decisions] == [("switch", hyb), ("switch", hsdp)]
    back = decisions[1][1]
    assert back.evidence["reason"] == "comm_wait_fell"
    assert [s["layout"] for s in back.evidence["skipped"]] == [{"strategy": "data", "dp": 8, "tp": 1}]


def test_job_policy_builds_the_memory_check_from_the_job():
    from gearshift.orchestrator.control.controller import job_policy
    from gearshift.orchestrator.job import load_job

    job = load_job(ROOT / "examples" / "gpt.yaml", ["cluster.num_workers=4", "parallel.strategy=auto", BIG_GPT])
    start = Layout("data", 4, 1)
    plain = job_policy(job, start, [2, 2])
    stages = Layout("pipeline", 2, 1, 1, 2)  # one stage a node (a GPT's cut is modelled), last
    assert plain.fits is None and plain.candidates == [start, Layout("hybrid", 2, 2), stages]  # as before, and stages
    checked = job_policy(job, start, [2, 2], device_memory_bytes=24 * GiB)
    assert checked.candidates == [start, Layout("hsdp", 4, 1, 2), Layout("fsdp", 4, 1, 4), Layout("hybrid", 2, 2),
                                  Layout("hybrid", 2, 2, 2), stages]
    # a stage holds half the model: the pipeline's memory is its own (pipeline_cost.memory), not data's
    assert checked.fits(stages)[1]["predicted_bytes"] < checked.fits(start)[1]["predicted_bytes"]
    ok, said = checked.fits(start)
    want = costmodel.memory(job_shape.shape_of_job(job), 4, 1, 1, global_batch=job.train.global_batch_size,
                            **job_shape.memory_settings(job))
    assert said["predicted_bytes"] == pytest.approx(want["total"]) and said["available_bytes"] == 24 * GiB
    assert ok == (want["total"] <= 24 * GiB) and said["breakdown"]["params"] == want["params"]
    tiny = job_policy(job, start, [2, 2], device_memory_bytes=1)
    assert not tiny.fits(Layout("hybrid", 2, 2, 2))[0]
