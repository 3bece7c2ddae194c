"""A pipeline run through `gearshift run` on Ray: its final weights, its checkpoints and its
held-out losses against plain single-process PyTorch on the same batches, and resumes from a
pipeline checkpoint under data parallelism and the other way round. (The pipelined step
itself, for more models and schedules: tests/test_pipeline.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from gearshift.orchestrator.job import load_job
from test_eval import HELD_OUT, check_against_checkpoints
from test_train_equivalence import MLP, max_diff, reference, run_gearshift


# four hidden layers: the blocks a pipeline is cut at
DEEP = MLP[1] + ["model.kwargs={in_features: 784, hidden: 64, out_features: 10, layers: 4}", "checkpoint.every=4",
                 "checkpoint.keep=5", "eval.every=4", HELD_OUT, "train.grad_clip=1.0"]
PIPE = ["parallel.strategy=pipeline", "parallel.pp_size=2"]


@pytest.mark.parametrize("layout", [PIPE + ["cluster.num_workers=2", "parallel.pp_schedule=gpipe"],
                                    PIPE + ["cluster.num_workers=4", "parallel.pp_microbatches=2",
                                            "train.micro_batch_size=8", "parallel.pp_schedule=interleaved_1f1b"]],
                         ids=["pp2-gpipe", "pp2xdp2-interleaved-accumulated"])
@pytest.mark.crossing("evaluation", "pipeline")
@pytest.mark.crossing("evaluation", "interleaved")
@pytest.mark.crossing("accumulation", "interleaved")
@pytest.mark.crossing("resume", "pipeline")
def test_a_pipeline_run_equals_plain_pytorch(local_workers, tmp_path, layout):
    """Final weights within 1e-5 of the plain loop (the global norm clipped over both stages),
    each eval record the plain loss of the checkpoint of its step."""
    overrides = DEEP + layout
    job = load_job(MLP[0], overrides)
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["strategy_history"][0]["pp"] == 2, summary
    ref, ref_losses = reference(job)
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert final.keys() == ref.keys()
    assert max_diff(final, ref) <= 1e-5
    evals = check_against_checkpoints(job, tmp_path / "run", 1e-5)
    assert [(r["step"], r["strategy"]) for r in evals] == [(4, "pipeline"), (8, "pipeline"), (12, "pipeline")]
    assert all(r["samples"] == 100 for r in evals)  # the short last batch counted once, by the last stage


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.crossing("precision", "pipeline")
def test_a_pipeline_trains_in_reduced_precision(local_workers, tmp_path, precision):
    """Autocast through the stages after an fp32 warm-up (the activations crossing change dtype
    there); fp16's loss scaled on the last stage, every stage unscaling its own gradients and the
    scaler's state checkpointed: close to the fp32 loop (the tolerance the other layouts' reduced
    precision has), never equal to it."""
    from test_train_equivalence import max_diff as diff_of

    overrides = DEEP + PIPE + ["cluster.num_workers=2", "checkpoint.every=6", "train.steps=12",
                               f"train.precision={{dtype: {precision}, fp32_warmup_steps: 3}}"]
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["final_loss"] < summary["first_loss"], summary
    ref, _ = reference(load_job(MLP[0], DEEP + ["train.steps=12"]))
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in final.values())
    diff = diff_of(final, ref)
    print(f"{precision}: max |pipeline - fp32 loop| {diff:.2e}")
    assert 1e-6 < diff <= 0.03, diff
    from gearshift.workers.state import checkpoint, dcp

    path, _ = checkpoint.load_latest(tmp_path / "run" / "checkpoints")
    scaler = dcp.load_full(path)["scaler"]
    if precision == "fp16":  # dynamic loss scaling ran and its state is checkpointed
        assert scaler["scale"] > 0 and "_growth_tracker" in scaler
    else:
        assert scaler == {}


@pytest.mark.crossing("resume", "pipeline")
@pytest.mark.crossing("resume", "data")
def test_a_pipeline_checkpoint_resumes_under_data_parallelism_and_back(local_workers, tmp_path):
    """Cut at step 4 and resumed under the other layout: both end where the plain loop ends."""
    job = load_job(MLP[0], DEEP)
    ref, _ = reference(job)
    for first, then, name in ((PIPE, ["parallel.strategy=data"], "pipe_then_data"),
                              (["parallel.strategy=data"], PIPE, "data_then_pipe")):
        run = tmp_path / name
        run_gearshift(MLP[0], DEEP + first, run)
        for path in (run / "checkpoints").iterdir():
            if path.name.startswith("step_") and path.name != "step_00000004":
                shutil.rmtree(path)
        (run / "final.pt").unlink()
        summary = run_gearshift(MLP[0], DEEP + then, run, "--resume", str(run))
        assert summary["resumed_from_step"] == 4
        assert max_diff(torch.load(run / "final.pt", weights_only=True), ref) <= 1e-5, name


@pytest.mark.parametrize("workers, schedule, pp_schedule", [
    (2, "[{step: 4, strategy: pipeline, pp_size: 2}, {step: 8, strategy: data}]", "1f1b"),
    # a pipeline of 2 replicas, then its stages' layers split over 2 workers each (pp x tp), then fsdp
    (4, "[{step: 3, strategy: pipeline, pp_size: 2}, {step: 6, strategy: pipeline, pp_size: 2, tp_size: 2}, "
        "{step: 9, strategy: fsdp}]", "interleaved_1f1b"),
    # each stage's blocks sharded over its 2 replicas: moved into shards, checkpointed and gathered out
    (4, "[{step: 4, strategy: pipeline, pp_size: 2, dp_shard: true}, {step: 8, strategy: data}]", "1f1b"),
], ids=["data-pipeline-data", "data-pipeline2x2interleaved-pipeline2xtp2-fsdp", "data-pipeline2x2sharded-data"])
@pytest.mark.crossing("switch", "pipeline")
@pytest.mark.crossing("switch", "interleaved")
@pytest.mark.crossing("switch", "pipeline_tp")
@pytest.mark.crossing("switch", "pipeline_dp_shard")
def test_a_run_switches_into_a_pipeline_and_out_live(local_workers, tmp_path, workers, schedule, pp_schedule):
    """adapt.schedule moves the running job into pipeline stages, between two pipelines and out
    again on the same workers, the state moved tensor by tensor, the optimizer's with it: the run
    ends where the plain loop ends."""
    overrides = DEEP + [f"cluster.num_workers={workers}", f"adapt.schedule={schedule}",
                        f"parallel.pp_schedule={pp_schedule}"]
    job = load_job(MLP[0], overrides)
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    want = [(e["step"], e["strategy"], e.get("pp_size") or 1, e.get("tp_size") or 1,
             workers // (e.get("pp_size") or 1) if e.get("dp_shard") or e["strategy"] == "fsdp" else 1)
            for e in job.adapt.schedule]
    assert [(s["step"], s["strategy"], s.get("pp", 1), s["tp"], s.get("shard", 1))
            for s in summary["strategy_history"]][1:] == want, summary["strategy_history"]
    ref, _ = reference(job)
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= 1e-5
    check_against_checkpoints(job, tmp_path / "run", 1e-5)


def test_a_pipelines_wait_splits_into_its_bubble_and_the_link(local_workers, tmp_path):
    """Two stages on two simulated nodes joined by a slow link: each step record says, per rank,
    how long the stage waited on the link (its micro-batches' activations or gradients, each
    bytes / rate + latency, what the link costs) and how long it sat idle for lack of work; the
    progress line, watch and the report show both."""
    from gearshift.monitoring.report import make_report
    from gearshift.monitoring.telemetry import read
    from gearshift.monitoring.watch import WatchState, render
    from rich.console import Console

    overrides = DEEP[:2] + ["model.kwargs={in_features: 784, hidden: 64, out_features: 10, layers: 4}",
                            "checkpoint.every=0", "train.steps=6"] + PIPE + \
        ["inject.nodes=2", "inject.link={mb_per_s: 50, latency_ms: 5}", "parallel.pp_microbatches=4"]
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    records = list(read(tmp_path / "run" / "telemetry.jsonl"))
    steps = [r for r in records if r["type"] == "step"]
    per_message = 8 * 64 * 4 / 50e6 + 0.005  # a micro-batch of 8 rows of 64 float32 across the link
    for r in steps:
        assert r["ranks"]["link_wait"] == pytest.approx([4 * per_message] * 2, rel=1e-9)
        assert all(b >= 0 for b in r["ranks"]["bubble"])
        for rank in range(2):
            assert r["ranks"]["bubble"][rank] + r["ranks"]["link_wait"][rank] <= r["ranks"]["comm_wait"][rank] + 1e-6
        assert r["link_wait_frac_mean"] > 0 and r["bubble_frac_mean"] is not None
    state = WatchState()
    for r in records:
        state.add(r)
    console = Console(record=True, width=120)
    console.print(render(state))
    shown = console.export_text()
    assert "bubble" in shown and "link" in shown, shown
    assert "pipeline wait" in make_report(tmp_path / "run").summary_text


@pytest.mark.parametrize("layout", [
    pytest.param(["cluster.num_workers=2"], marks=pytest.mark.crossing("restart", "pipeline"), id="1f1b"),
    pytest.param(["cluster.num_workers=2", "parallel.pp_schedule=interleaved_1f1b"],
                 marks=pytest.mark.crossing("restart", "interleaved"), id="interleaved"),
    pytest.param(["cluster.num_workers=4", "parallel.dp_shard=true"],
                 marks=pytest.mark.crossing("restart", "pipeline_dp_shard"), id="dp_shard"),
    pytest.param(["cluster.num_workers=4", "parallel.tp_size=2"],
                 marks=pytest.mark.crossing("restart", "pipeline_tp"), id="tp"),
])
def test_a_stage_killed_mid_run_is_recovered_from_the_checkpoint(local_workers, tmp_path, layout):
    """The worker of the last stage SIGKILLed at step 10: the first stage, blocked on its
    activations' gradients, fails (gloo's receive ends, or the job's collective timeout), the run
    goes back to its newest checkpoint under the same pipeline, and ends where the plain loop
    ends. (A pipeline does not go on in memory without a stage: orchestrator/control/elastic.py.)"""
    from test_fault import Killer, events

    overrides = DEEP[:2] + ["model.kwargs={in_features: 784, hidden: 64, out_features: 10, layers: 4}",
                            "train.steps=24", "checkpoint.every=8", "inject.comm_delay_ms=30",
                            "fault.max_failures=2"] + PIPE + layout
    killer = Killer(tmp_path / "run", rank=1, at_step=10)
    killer.start()
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    killer.join(timeout=5)
    assert killer.killed, f"the worker was never killed ({killer.error!r})"
    assert summary["status"] == "done" and summary["steps_done"] == 24, summary
    [failure] = events(tmp_path / "run", "failure")
    assert failure["dead_ranks"] == [1], failure
    [restored] = events(tmp_path / "run", "restored")
    assert restored["step"] == 8 or restored["step"] == 16, restored  # the newest checkpoint before the failure
    assert summary["strategy_history"][-1]["pp"] == 2, summary["strategy_history"]
    ref, _ = reference(load_job(MLP[0], overrides))
    tol = 1e-4 if len(layout) > 1 and "interleaved" not in layout[1] else 1e-5  # a sharded or tp stage: 1e-4
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= tol


@pytest.mark.crossing("recut", "pipeline")
def test_a_slow_stage_hands_blocks_to_the_other_live_and_the_run_equals_plain_pytorch(local_workers, tmp_path):
    """Two stages of four 512-wide blocks; rank 1 (the second stage) computes 4x as long
    (inject.slow). Within two steps of the window that showed it, the pipeline is cut again with
    fewer blocks on the slow stage, the state moved between the stages in memory, and the run ends
    where plain PyTorch does on the same batches."""
    from gearshift.monitoring.telemetry import read

    overrides = MLP[1] + ["model.kwargs={in_features: 784, hidden: 512, out_features: 10, layers: 8}",
                          # 96 steps: nine windows of ten, one of which must show the straggler past the
                          # noise of its medians (48, four windows, once showed none on a loaded machine)
                          "train.steps=96", "train.global_batch_size=64", "train.grad_clip=1.0",
                          "cluster.num_workers=2", "inject.slow={ranks: [1], factor: 4}",
                          # Adam turns float rounding into 1e-3 over 48 steps of this pipeline, recut or not
                          # (8.7e-4 measured on a static 4/4 and 7/1 cut alike): SGD with momentum here
                          "optimizer.name=sgd", "optimizer.momentum=0.9", "optimizer.lr=0.02",
                          "optimizer.weight_decay=0"] + PIPE
    job = load_job(MLP[0], overrides)
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    assert summary["status"] == "done", summary.get("error")
    records = list(read(tmp_path / "run" / "telemetry.jsonl"))
    recuts = [r for r in records if r.get("event") == "decision" and r["decision"] == "recut"]
    assert recuts, [r for r in records if r.get("event") == "decision"]
    first = recuts[0]
    ev = first["evidence"]
    # the first window shows it, or on a machine loaded by other tests (the noise of the medians
    # past the gain) one of the next
    assert first["applied_step"] - first["seen_step"] <= 2 and ev["position"] == 1 and ev["reason"] == "straggler"
    assert ev["blocks_per_stage_after"][1] < ev["blocks_per_stage_before"][1]
    assert ev["blocks_per_stage_before"] == [4, 4] and first["split"][0].startswith("hidden.")
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert steps[first["applied_step"] + 1]["stage_blocks"] == ev["blocks_per_stage_after"]
    # what the recut buys in step time is measured in bench/recut.py, beside the same pipeline left as it was
    ref, _ = reference(job)
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref) <= 1e-5
