"""train.profile: a window of updates under torch.profiler on every rank, its files in the run dir."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from gearshift.monitoring import schema
from gearshift.orchestrator.records.rundir import resume_conflicts
from gearshift.orchestrator.job import job_from_dict
from tests.test_train_equivalence import MLP, max_diff, run_gearshift
from gearshift.workers.config import WorkerConfig
from gearshift.workers.step.profiling import MODULE_PREFIX, StepProfiler


def _loop(prof: StepProfiler, model: torch.nn.Module, steps: int) -> list[int]:
    """A step loop as TrainWorker.train runs one; the 1-based updates after which the window closed."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    closed = []
    for step in range(steps):
        prof.before_step(step, model)
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
        if prof.after_step(step + 1):
            closed.append(step + 1)
    return closed


def test_window_covers_exactly_the_profiled_updates():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    prof = StepProfiler((3, 2))
    assert prof.take() == {}
    assert _loop(prof, model, 6) == [4]  # updates 3 and 4: 0-based steps 2..3, closed after the 4th
    out = prof.take()["profile"]
    assert prof.take() == {}  # sent once
    assert out["steps"] == [3, 4]
    events = json.loads(out["trace"])["traceEvents"]
    # two updates of three Linear layers' worth of forward: 2 x 2 addmm, not 6 x 2
    assert sum(e.get("name") == "aten::addmm" for e in events) == 4
    assert sum(e.get("name", "").startswith(MODULE_PREFIX) for e in events) == 2 * 3
    assert "module: 0 (Linear)" in out["table"] and "Self CPU Mem" in out["table"]
    # the hooks went with the window: a later forward adds no scopes
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks


def test_window_is_recorded_once_and_not_without_a_window():
    model = torch.nn.Linear(8, 2)
    prof = StepProfiler((1, 1))
    assert _loop(prof, model, 2) == [1]
    prof.take()
    # a later chunk starting where the window started (a restart from a checkpoint) does not record it again
    assert _loop(prof, model, 2) == [] and prof.take() == {}
    off = StepProfiler(None)
    assert _loop(off, model, 3) == [] and off.take() == {} and off.prof is None


def test_job_carries_the_window_to_the_workers_and_resume_allows_it():
    raw = {"model": "mlp", "train": {"steps": 6, "profile": {"start_step": 2, "steps": 3}}}
    job = job_from_dict(raw)
    assert WorkerConfig.from_job(job.to_dict()).profile == (2, 3)
    assert WorkerConfig.from_job(job_from_dict({"model": "mlp"}).to_dict()).profile is None
    assert resume_conflicts(job_from_dict({"model": "mlp", "train": {"steps": 6}}), job) == []
    assert "profile" in schema.EVENTS


def test_profile_files_events_report_and_unchanged_math(local_workers, tmp_path):
    from gearshift.monitoring.report import make_report

    job_file, overrides = MLP[0], MLP[1] + ["cluster.num_workers=2", "train.steps=6"]
    plain = tmp_path / "plain"
    run_gearshift(job_file, overrides, plain)
    run = tmp_path / "profiled"
    summary = run_gearshift(job_file, overrides + ["train.profile={start_step: 3, steps: 2}"], run)
    assert summary["status"] == "done"

    for rank in (0, 1):
        trace = json.loads((run / "profile" / f"rank{rank}.trace.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "aten::addmm" in names and any(n.startswith(MODULE_PREFIX) for n in names)
        table = (run / "profile" / f"rank{rank}.txt").read_text()
        assert "updates 3..4" in table and "aten::" in table
        assert "Self CPU" in table and "Self CPU Mem" in table  # time and memory columns

    records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
    events = sorted((r for r in records if r.get("event") == "profile"), key=lambda r: r["rank"])
    assert [(e["rank"], e["steps"]) for e in events] == [(0, [3, 4]), (1, [3, 4])]
    for e in events:
        assert pathlib.Path(e["trace"]) == run / "profile" / f"rank{e['rank']}.trace.json"
        assert pathlib.Path(e["table"]).is_file() and not schema.validate(e)

    text = make_report(run).summary_text
    assert "Profile (updates 3..4)" in text
    for rank in (0, 1):
        assert str(run / "profile" / f"rank{rank}.trace.json") in text
        assert str(run / "profile" / f"rank{rank}.txt") in text
    assert (run / "report" / "report.txt").read_text().count("rank1.trace.json") == 1

    # profiling watches the steps: the parameters are the same, bit for bit
    diff = max_diff(torch.load(run / "final.pt", weights_only=True), torch.load(plain / "final.pt", weights_only=True))
    assert diff == 0, f"profiling changed the result: max |diff| = {diff:.3g}"
    assert not (plain / "profile").exists()
