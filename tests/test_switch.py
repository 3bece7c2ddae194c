"""Switching layouts while training: the live model and Adam state move, in memory, between
data, hybrid and tensor layouts on the same workers, and training ends where plain single-process
PyTorch ends on the same batches."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import default_collate

from gearshift.orchestrator.job import load_job
from test_train_equivalence import GPT, MLP, USER_PLAN, max_diff, run_gearshift, user_job
from gearshift.workers.build import components
from gearshift.workers.state import dcp
from gearshift.workers.step.data import GlobalBatches


# data -> hybrid -> tensor -> data, on 4 workers
SCHEDULE = ("adapt.schedule=[{step: 3, strategy: hybrid, tp_size: 2}, {step: 5, strategy: tensor}, "
            "{step: 7, strategy: data}]")
BASE = ["cluster.num_workers=4", "cluster.cpus_per_worker=1", "train.steps=9", "train.global_batch_size=16",
        "optimizer.name=adam", "checkpoint.every=9", "train.grad_clip=0.05"]


def reference_with_optimizer(job):
    """Plain PyTorch on the same global batches; the model and Adam's state by parameter name."""
    spec, paths = job.to_dict(), [job.base_dir]
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], paths)
    dataset = components.build_dataset(spec["data"], spec["model"], paths)
    loss_fn = components.build_loss(spec["loss"], paths)
    o = job.optimizer
    opt = torch.optim.Adam(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    order = GlobalBatches(len(dataset), job.train.global_batch_size, job.train.seed)
    for step in range(job.train.steps):
        x, y = default_collate([dataset[i] for i in order.indices(step)])
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.train.grad_clip)
        opt.step()
    names = {id(p): n for n, p in model.named_parameters()}
    state = {names[id(p)]: s for p, s in opt.state.items()}
    return model.state_dict(), state


@pytest.mark.parametrize("which", [pytest.param("mlp", marks=pytest.mark.smoke), "gpt", "user"])
@pytest.mark.crossing("switch", "data")
@pytest.mark.crossing("switch", "hybrid")
@pytest.mark.crossing("switch", "tensor")
def test_forced_switches_reach_the_single_process_result(local_workers, tmp_path, which):
    job_file, overrides = {"mlp": MLP, "gpt": GPT}.get(which) or user_job(tmp_path)
    overrides = overrides + BASE + [SCHEDULE] + ([USER_PLAN] if which == "user" else [])
    ref_model, ref_adam = reference_with_optimizer(load_job(job_file, overrides))

    summary = run_gearshift(job_file, overrides, tmp_path / "run")
    assert [(h["step"], h["strategy"], h["dp"], h["tp"]) for h in summary["strategy_history"]] == [
        (0, "data", 4, 1), (3, "hybrid", 2, 2), (5, "tensor", 1, 4), (7, "data", 4, 1)]
    assert [s["seconds"] > 0 for s in summary["switches"]] == [True] * 3
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    diff = max_diff(final, ref_model)
    assert diff <= 1e-4, f"{which}: max |final - reference| = {diff:.3g} after three switches"

    # Adam's moments and step count came through every switch (a reset would restart them)
    saved = dcp.load_full(tmp_path / "run" / "checkpoints" / "step_00000009")["optimizer"]["state"]
    assert saved.keys() == ref_adam.keys()
    for name, ref in ref_adam.items():
        assert float(saved[name]["step"]) == float(ref["step"]) == 9
        for moment in ("exp_avg", "exp_avg_sq"):
            assert (saved[name][moment] - ref[moment]).abs().max().item() <= 1e-4, (name, moment)

    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    steps = {r["step"]: (r["strategy"], r["tp"]) for r in records if r["type"] == "step"}
    assert steps[3] == ("data", 1) and steps[4] == ("hybrid", 2) and steps[6] == ("tensor", 4) and steps[8] == ("data", 1)


def test_auto_moves_to_pipeline_stages_by_itself_when_the_link_between_nodes_is_slow(local_workers, tmp_path,
                                                                                      monkeypatch):
    """4 workers in 2 simulated nodes joined by a 2.5 MB/s link, starting on data (`adapt.start:
    memory`; the probe would start it on the pipeline: the test below): data parallelism
    all-reduces every gradient over it and waits most of each step. The policy predicts hybrid (tensor-parallel
    inside a node, half the gradient bytes over the link) and a pipeline of one stage a node (only
    the activations at the cut over the link, 1 MiB a step each way here) and moves to the faster,
    the pipeline, within two steps of the record that showed it; it keeps it because it is faster
    (measured here: 0.80 s a step under data, 0.38 s under the pipeline, 0.38 s predicted)."""
    # the policy also judges memory, from each worker's peak resident set, which on CPU is the
    # process's lifetime peak (workers/step/telemetry.py): fresh processes, so that no earlier
    # test's peak reads as pressure (a warm one once switched this run to hybrid for memory)
    monkeypatch.setenv("GEARSHIFT_TEST_FRESH_PROCESSES", "1")
    run = tmp_path / "run"
    overrides = ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=auto",
                 "inject.nodes=2", "inject.link={mb_per_s: 2.5, latency_ms: 2}", "train.steps=30",
                 "train.global_batch_size=32", "checkpoint.every=0", "adapt.start=memory"]
    summary = run_gearshift(GPT[0], overrides, run)
    records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
    [policy] = [r for r in records if r.get("event") == "policy"]
    # no tp across the link; the sharded layouts are candidates for memory only (all fit here); a
    # pipeline of one stage a node last
    assert [(c["strategy"], c["tp"], c.get("shard", 1), c.get("pp", 1)) for c in policy["candidates"]] == [
        ("data", 1, 1, 1), ("hsdp", 1, 2, 1), ("fsdp", 1, 4, 1), ("hybrid", 2, 1, 1), ("hybrid", 2, 2, 1),
        ("pipeline", 1, 1, 2)]
    switches = [r for r in records if r.get("event") == "switch"]
    assert [(s["from"]["strategy"], s["to"]["strategy"], s["to"].get("pp"), s["reason"]) for s in switches] == [
        ("data", "pipeline", 2, "switch")], switches
    decision = next(r for r in records if r.get("event") == "decision" and r["decision"] == "switch")
    assert decision["evidence"]["comm_wait_frac"] > decision["evidence"]["threshold"] == 0.15
    # carried out within two steps of the step whose record triggered it, all ranks at one boundary
    assert 0 < decision["applied_step"] - decision["seen_step"] <= 2 and decision["applied_step"] == switches[0]["step"]
    assert not [r for r in records if r.get("event") == "decision" and r["decision"] == "revert"]

    at = switches[0]["step"]
    rate = lambda rs: sum(32 for _ in rs) / sum(r["step_time_max"] for r in rs)  # noqa: E731
    steps = [r for r in records if r["type"] == "step"]
    before = rate([r for r in steps if 3 < r["step"] <= at])  # past the first steps' warm-up
    after = rate([r for r in steps if r["step"] > at + 3])
    assert after > before, f"samples/s before the switch {before:.1f}, after {after:.1f}"
    assert summary["strategy_history"][-1]["strategy"] == "pipeline"
    predicted = [p for p in decision["evidence"]["predictions"] if p["layout"].get("pp") == 2][0]["step_s"]
    print(f"auto: data {before:.1f} samples/s -> pipeline {after:.1f} samples/s at step {at}, predicted "
          f"{32 / predicted:.1f} "
          f"(switch took {switches[0]['seconds']:.2f} s)")


def test_auto_starts_on_pipeline_stages_when_its_probe_finds_the_link_between_nodes_slow(local_workers, tmp_path,
                                                                                         monkeypatch):
    """The same 2.5 MB/s link, `adapt.start: probe` (the default): before the model is built the
    workers time all-reduces over the link and a matmul, and the run starts on the pipeline of a
    stage a node, the layout the cost model predicts fastest, with the probe and every layout's
    prediction in the policy's evidence. It never trains a step on data, and ends where plain
    PyTorch ends on the same batches."""
    from test_train_equivalence import reference

    monkeypatch.setenv("GEARSHIFT_TEST_FRESH_PROCESSES", "1")  # its own peak memory: as the test above

    run = tmp_path / "run"
    # plain SGD: AdamW's first steps turn float noise in tiny gradients into whole updates
    overrides = ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=auto",
                 "inject.nodes=2", "inject.link={mb_per_s: 2.5, latency_ms: 2}", "train.steps=4",
                 "train.global_batch_size=32", "checkpoint.every=0", "optimizer.name=sgd", "optimizer.lr=0.5"]
    summary = run_gearshift(GPT[0], overrides, run)
    records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
    [policy] = [r for r in records if r.get("event") == "policy"]
    start = policy["start"]
    assert start["by"] == "prediction" and start["layout"] == {"strategy": "pipeline", "dp": 2, "tp": 1, "pp": 2}
    # the simulated link charges an all-reduce bytes / rate: a ring of 4 moves 1.5 x the bytes
    assert start["probe"]["inter_link_gb_s"] == pytest.approx(1.5 * 2.5e-3, rel=0.3), start["probe"]
    assert not start["probe"]["link_bound"] and start["probe"]["device_tflops"] > 0
    steps = {(p["layout"]["strategy"], p["layout"]["dp"], p["layout"].get("pp", 1)): p["step_s"]
             for p in start["step_predictions"]}
    assert steps[("pipeline", 2, 2)] * 1.25 < steps[("data", 4, 1)], steps
    assert {r["strategy"] for r in records if r["type"] == "step"} == {"pipeline"}
    assert not [r for r in records if r.get("event") == "switch"]
    ref, _ = reference(load_job(GPT[0], overrides))
    assert max_diff(torch.load(run / "final.pt", weights_only=True), ref) <= 1e-5
    assert summary["strategy_history"][0]["pp"] == 2
