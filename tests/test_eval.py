"""Evaluation (eval.every, eval.data, eval.batches) and checkpoint.keep_best.

The Ray tests recompute each eval record's loss in plain single-process PyTorch from the
checkpoint written at that step: the model the record says it evaluated, on the same held-out
samples. The controller tests use the stand-in worker group of test_controller (no Ray).
"""

from __future__ import annotations

import json
import math
import pathlib

import pytest
import torch

from gearshift.monitoring.report import make_report
from gearshift.monitoring.schema import validate
from gearshift.monitoring.telemetry import read
from gearshift.monitoring.watch import WatchState, render
from gearshift.orchestrator.control.controller import Controller
from gearshift.orchestrator.job import load_job
from test_controller import make
from test_train_equivalence import GPT, MLP, run_gearshift
from gearshift.workers.build import components
from gearshift.workers.state import checkpoint
from gearshift.workers.state import dcp
from gearshift.workers.step.data import load_batch

ROOT = pathlib.Path(__file__).resolve().parents[1]
# 100 held-out samples in batches of 32: the last batch is short (4 samples, 2 per dp rank)
HELD_OUT = "eval.data={name: synthetic_digits, kwargs: {seed: 99, size: 100}}"


def plain_eval_loss(job, state: dict, batches: int | None) -> tuple[float, int]:
    """The mean loss of the checkpoint's model over the first `batches` global batches of
    eval.data, in plain PyTorch: one forward over all of those samples at once."""
    spec = job.to_dict()
    model = components.build_model(spec["model"], [job.base_dir])
    model.load_state_dict(state["model"])
    model.eval()
    dataset = components.build_dataset(spec["eval"]["data"], spec["model"], [job.base_dir])
    n = len(dataset) if batches is None else min(len(dataset), batches * job.train.global_batch_size)
    x, y = load_batch(dataset, list(range(n)))
    with torch.no_grad():
        return components.build_loss(spec["loss"])(model(x), y).item(), n


def eval_records(run_dir) -> list[dict]:
    return [r for r in read(run_dir / "telemetry.jsonl") if r["type"] == "eval"]


def check_against_checkpoints(job, run_dir, tolerance) -> list[dict]:
    evals = eval_records(run_dir)
    assert [p for r in read(run_dir / "telemetry.jsonl") for p in validate(r)] == []
    for r in evals:
        state = dcp.load_full(run_dir / "checkpoints" / f"step_{r['step']:08d}")
        assert state["step"] == r["step"]
        want, n = plain_eval_loss(job, state, job.eval.batches)
        assert r["samples"] == n
        assert abs(r["loss"] - want) <= tolerance, (r["step"], r["strategy"], r["loss"], want)
    return evals


@pytest.mark.crossing("evaluation", "data")
@pytest.mark.crossing("evaluation", "tensor")
def test_eval_loss_equals_plain_pytorch_under_data_then_tensor(local_workers, tmp_path):
    """data parallel (2 workers) to step 6, then a forced switch to tensor parallel: the evals at
    4 (data), 8 and 12 (tensor) each equal the plain loss of the checkpoint at that step."""
    overrides = MLP[1] + ["checkpoint.every=4", "checkpoint.keep=5", "checkpoint.keep_best=true", "eval.every=4",
                          HELD_OUT, "cluster.num_workers=2", "adapt.schedule=[{step: 6, strategy: tensor}]"]
    job = load_job(MLP[0], overrides)
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    evals = check_against_checkpoints(job, tmp_path / "run", 1e-4)
    assert [(r["step"], r["strategy"], r["dp"]) for r in evals] == [(4, "data", 2), (8, "tensor", 1), (12, "tensor", 1)]
    assert abs(evals[0]["loss"] - plain_eval_loss(job, dcp.load_full(tmp_path / "run/checkpoints/step_00000004"),
                                                  None)[0]) <= 1e-5  # data parallel: the tighter bound
    assert all(r["perplexity"] is None and r["batches"] == 4 for r in evals)  # class targets: no perplexity
    best = min(evals, key=lambda r: r["loss"])
    assert summary["eval_loss"] == evals[-1]["loss"]
    assert (summary["best_eval_step"], summary["best_eval_loss"]) == (best["step"], best["loss"])
    marked = json.loads((tmp_path / "run/checkpoints/best.json").read_text())
    assert marked == {"step": best["step"], "path": f"step_{best['step']:08d}", "eval_loss": best["loss"]}


@pytest.mark.crossing("evaluation", "hybrid")
def test_eval_loss_equals_plain_pytorch_under_hybrid(local_workers, tmp_path):
    """hybrid dp 2 x tp 2 on 4 workers, the first 3 held-out batches (eval.batches)."""
    overrides = MLP[1] + ["checkpoint.every=4", "checkpoint.keep=5", "eval.every=4", "eval.batches=3", HELD_OUT,
                          "cluster.num_workers=4", "parallel.strategy=hybrid", "parallel.tp_size=2"]
    job = load_job(MLP[0], overrides)
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    evals = check_against_checkpoints(job, tmp_path / "run", 1e-4)
    assert [(r["step"], r["strategy"], r["dp"], r["tp"], r["samples"]) for r in evals] == \
        [(s, "hybrid", 2, 2, 96) for s in (4, 8, 12)]


def test_gpt_eval_records_perplexity(local_workers, tmp_path):
    overrides = GPT[1] + ["train.steps=4", "cluster.num_workers=2", "eval.every=2", "eval.batches=2",
                          "eval.data={name: chars, kwargs: {chars: 4000, seed: 3}}"]
    job = load_job(GPT[0], overrides)
    summary = run_gearshift(GPT[0], overrides, tmp_path / "run")
    evals = eval_records(tmp_path / "run")
    assert [r["step"] for r in evals] == [2, 4]
    assert all(r["perplexity"] == pytest.approx(math.exp(r["loss"]), rel=1e-12) for r in evals)
    final = {"model": torch.load(tmp_path / "run/final.pt", weights_only=True)}
    assert abs(evals[-1]["loss"] - plain_eval_loss(job, final, 2)[0]) <= 1e-5
    assert summary["eval_loss"] == evals[-1]["loss"]


# ------------------------------------------------------------------ the controller, no Ray


def test_chunks_end_at_eval_steps_and_the_run_ends_with_one(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "eval.every=4", "eval.batches=2", HELD_OUT])
    summary = Controller(job, run, factory).run()
    assert groups[0].evaluated == [(4, 2), (8, 2), (10, 2)]
    evals = [r for r in read(run.telemetry) if r["type"] == "eval"]
    assert [(r["step"], r["loss"]) for r in evals] == [(4, 5.0), (8, 1.0), (10, 3.0)]
    assert [p for r in read(run.telemetry) for p in validate(r)] == []
    assert (summary["eval_loss"], summary["best_eval_loss"], summary["best_eval_step"]) == (3.0, 1.0, 8)
    assert not (run.checkpoints / "best.json").exists()  # keep_best is off


def test_no_eval_section_means_no_evaluation(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=6"])
    summary = Controller(job, run, factory).run()
    assert not hasattr(groups[0], "evaluated") and summary["eval_loss"] is None
    assert summary["best_eval_step"] is None


def test_keep_best_keeps_the_lowest_eval_loss_checkpoint(tmp_path):
    """keep 2, a checkpoint every 2 steps: step 8 (the lowest eval loss) would have been pruned
    at step 12; it stays, named by best.json."""
    job, run, factory, groups = make(tmp_path, ["train.steps=16", "checkpoint.every=2", "checkpoint.keep=2",
                                                "checkpoint.keep_best=true", "eval.every=4", HELD_OUT])
    summary = Controller(job, run, factory).run()
    names = [p.name for p in checkpoint.list_checkpoints(run.checkpoints)]
    assert names == ["step_00000008", "step_00000014", "step_00000016"]
    assert checkpoint.load(run.checkpoints / "step_00000008")["model"]["w"].tolist() == [8.0, 8.0]
    assert json.loads((run.checkpoints / "best.json").read_text()) == {
        "step": 8, "path": "step_00000008", "eval_loss": 1.0}
    assert summary["best_eval_step"] == 8
    bests = [r["step"] for r in read(run.telemetry) if r.get("event") == "best"]
    assert bests == [4, 8]


def test_keep_best_writes_a_checkpoint_at_a_best_step_that_has_none(tmp_path):
    """No checkpoint.every: the best eval step gets a checkpoint of its own, the old best goes."""
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=0", "checkpoint.keep=1",
                                                "checkpoint.keep_best=true", "eval.every=3", HELD_OUT])
    Controller(job, run, factory).run()
    # evals at 3 (loss 6), 6 (3), 9 (2), 10 (3): 9 is the best; 10 is the final checkpoint
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == ["step_00000009", "step_00000010"]
    assert checkpoint.load(run.checkpoints / "step_00000009")["step"] == 9


def test_a_resumed_run_keeps_the_earlier_best(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=12", "checkpoint.every=4", "checkpoint.keep=1",
                                                "checkpoint.keep_best=true", "eval.every=4", HELD_OUT])
    Controller(job, run, factory).run()
    assert json.loads((run.checkpoints / "best.json").read_text())["step"] == 8
    state = dcp.load_full(run.checkpoints / "step_00000012")
    job2 = load_job(ROOT / "examples/mlp.yaml", ["train.steps=16", "checkpoint.every=4", "checkpoint.keep=1",
                                                 "checkpoint.keep_best=true", "eval.every=4", HELD_OUT])
    summary = Controller(job2, run, factory, resume=("step_00000012", state)).run()
    assert groups[-1].evaluated == [(16, None)]  # 12 was the earlier leg's end; the next eval step is 16
    assert (summary["best_eval_step"], summary["best_eval_loss"]) == (8, 1.0)
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == ["step_00000008", "step_00000016"]


def test_watch_and_report_show_the_eval_loss(tmp_path):
    from rich.console import Console

    job, run, factory, groups = make(tmp_path, ["train.steps=12", "eval.every=4", HELD_OUT])
    Controller(job, run, factory).run()
    state = WatchState()
    for r in read(run.telemetry):
        state.add(r)
    console = Console(record=True, width=160)
    console.print(render(state))
    assert "eval loss 5.0000 @ step 12" in console.export_text()
    report = make_report(run.path)
    assert "eval loss    5 at step 12 (best 1 at step 8; 3 evaluations)" in report.summary_text
    assert (run.path / "report/loss.png").is_file()


def _eval_in_micro_batches(rank, world, out_dir):
    from gearshift.strategies.layout import Layout
    from gearshift.workers.step.evaluation import held_out_loss

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    dataset = components.build_dataset({"name": "synthetic_digits", "kwargs": {"seed": 99, "size": 100}}, {})
    sizes = []
    model.register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[0]))
    loss = torch.nn.functional.cross_entropy
    forward_loss = lambda x, y: loss(model(x), y)  # noqa: E731
    layout = Layout.for_workers("data", world, None)
    whole = held_out_loss(dataset, forward_loss, model, torch.device("cpu"), 32, layout, rank, world)
    calls_whole, sizes[:] = len(sizes), []
    micro = held_out_loss(dataset, forward_loss, model, torch.device("cpu"), 32, layout, rank, world, micro_batch=5)
    (out_dir / f"eval-{rank}.json").write_text(json.dumps({"whole": whole, "micro": micro, "sizes": sizes,
                                                           "calls_whole": calls_whole}))


def test_evaluation_runs_in_micro_batches_with_the_same_loss(tmp_path):
    """100 held-out samples, global batch 32 over 2 ranks (slices of 16, the last batch 2 each),
    5 samples a forward: the same mean loss as whole slices and as plain PyTorch, never more than
    5 samples in a forward, and as many forwards on both ranks (their collectives stay in step)."""
    from test_fsdp import spawn_gloo

    spawn_gloo(_eval_in_micro_batches, 2, (tmp_path,))
    ranks = [json.loads((tmp_path / f"eval-{r}.json").read_text()) for r in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    dataset = components.build_dataset({"name": "synthetic_digits", "kwargs": {"seed": 99, "size": 100}}, {})
    x, y = load_batch(dataset, list(range(100)))
    with torch.no_grad():
        plain = torch.nn.functional.cross_entropy(model(x), y).item()
    for r in ranks:
        assert abs(r["micro"]["loss"] - plain) <= 1e-6 and abs(r["whole"]["loss"] - plain) <= 1e-6
        assert r["micro"]["samples"] == 100 and max(r["sizes"]) == 5
        assert r["calls_whole"] == 4  # one forward per batch without micro-batches
    assert len(ranks[0]["sizes"]) == len(ranks[1]["sizes"]) == 3 * 4 + 1  # 16 -> 4 forwards; the last batch's 2 -> 1
    assert sum(ranks[0]["sizes"]) + sum(ranks[1]["sizes"]) == 100
