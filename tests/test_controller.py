"""The controller's state machine with a stand-in worker group: no Ray, no processes."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from monitoring.telemetry import read
from orchestrator.controller import Controller, StepMerger
from orchestrator.errors import WorkerFailed
from orchestrator.job import load_job
from orchestrator.rundir import RunDir
from workers import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeGroup:
    """Two ranks whose 'training' adds 1 to a weight per step; rank 1 reports in odd-sized batches
    so the controller has to merge reports that do not line up."""

    def __init__(self, job, fail_at: int | None = None):
        self.job, self.fail_at = job, fail_at
        self.w = torch.zeros(2)
        self.step = 0
        self.shut = False
        self.loaded = None

    def start(self):
        return [{"rank": r, "node_ip": "127.0.0.1", "pid": 1, "backend": "gloo", "parameters": 2} for r in range(2)]

    def put(self, value):
        return value

    def call(self, method, *args):
        if method == "state":
            return [self.call_rank(0, "state"), None]
        assert method == "load"
        self.loaded = args[0]
        self.step = args[0]["step"]
        self.w = args[0]["model"]["w"].clone()
        return [self.step, self.step]

    def call_rank(self, rank, method):
        assert (rank, method) == (0, "state")
        return {"model": {"w": self.w.clone()}, "step": self.step}

    def train(self, until, every):
        chunk = {0: 2, 1: 3}
        pending = {0: [], 1: []}
        for step in range(self.step, until):
            if self.fail_at is not None and step == self.fail_at:
                raise WorkerFailed(1, "ValueError: boom", details="Traceback: ... ValueError: boom")
            self.w += 1
            self.step = step + 1
            for rank in (0, 1):
                pending[rank].append(step)
                if len(pending[rank]) == chunk[rank] or self.step == until or (every and self.step % every == 0):
                    report = {"rank": rank, "first_step": pending[rank][0],
                              "losses": [10.0 - s - rank for s in pending[rank]],
                              "step_times": [0.01 * (1 + rank)] * len(pending[rank])}
                    if rank == 0 and every and self.step % every == 0 and self.step < until:
                        report["checkpoint"] = self.call_rank(0, "state")
                    pending[rank] = []
                    yield rank, report

    def shutdown(self, polite=True):
        self.shut = "polite" if polite else "killed"


def make(tmp_path, overrides, **group_kw):
    job = load_job(ROOT / "examples/mlp.yaml", overrides)
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    def factory(j):
        groups.append(FakeGroup(j, **group_kw))
        return groups[-1]

    return job, run, factory, groups


def test_merger_releases_a_step_only_when_every_rank_reported():
    m = StepMerger(world=2, global_batch=8)
    assert m.add(0, {"first_step": 0, "losses": [1.0, 2.0], "step_times": [0.1, 0.1]}) == []
    done = m.add(1, {"first_step": 0, "losses": [3.0], "step_times": [0.4]})
    assert [r["step"] for r in done] == [1]
    assert done[0]["loss"] == 2.0 and done[0]["slowest_rank"] == 1 and done[0]["samples_per_s"] == pytest.approx(20)


def test_run_writes_checkpoints_final_and_summary(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=4", "checkpoint.keep=5"])
    summary = Controller(job, run, factory).run()
    assert summary["status"] == "done" and summary["steps_done"] == 10 and groups[0].shut == "polite"
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == [
        "step_00000004", "step_00000008", "step_00000010"]
    assert checkpoint.load(run.checkpoints / "step_00000008")["model"]["w"].tolist() == [8.0, 8.0]
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [10.0, 10.0]
    steps = [r for r in read(run.telemetry) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert steps[0]["loss"] == pytest.approx((10 + 9) / 2)  # mean of the two ranks' losses of step 0
    states = [r["state"] for r in read(run.telemetry) if r.get("event") == "state"]
    assert states == ["placing", "starting", "training", "done"]
    assert json.loads(run.summary.read_text())["strategy_history"][0]["strategy"] == "data"


def test_resume_loads_the_state_into_the_workers(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=6"])
    state = {"model": {"w": torch.full((2,), 3.0)}, "step": 3}
    summary = Controller(job, run, factory, resume=("step_00000003", state)).run()
    assert groups[0].loaded is state and summary["resumed_from_step"] == 3
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [6.0, 6.0]


def test_a_failing_worker_ends_the_run_cleanly(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=2"], fail_at=5)
    with pytest.raises(WorkerFailed, match="worker rank 1: ValueError: boom"):
        Controller(job, run, factory).run()
    assert groups[0].shut == "killed", "after a failure the group is killed, not asked"
    summary = json.loads(run.summary.read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"] and summary["steps_done"] == 4  # step 5 never completed on every rank
    assert "Traceback" in run.log.read_text()
    assert not run.final.exists()
    assert checkpoint.load_latest(run.checkpoints)[1]["step"] == 4
