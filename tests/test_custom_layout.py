"""A layout of the user's own, registered by naming it in the job, trains end to end through
the normal job path (job file -> controller -> Ray workers) and matches plain PyTorch."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from gearshift import strategies
from gearshift.orchestrator.job import JobError, load_job
from test_train_equivalence import FIXTURES, MLP, max_diff, reference, run_gearshift, step_losses


def job_with_own_layout(tmp_path, *extra: str):
    shutil.copy(FIXTURES / "replicate_layout.py", tmp_path / "replicate_layout.py")
    shutil.copy(MLP[0], tmp_path / "mlp.yaml")
    return tmp_path / "mlp.yaml", MLP[1] + ["parallel.strategy=replicate_layout:replicate", *extra]


def test_a_layout_named_by_entry_point_is_checked_like_any_other(tmp_path):
    job_file, overrides = job_with_own_layout(tmp_path)
    job = load_job(job_file, overrides)
    assert job.layout == strategies.Layout("replicate_layout:replicate", 2, 1)  # replicates: dp = workers
    with pytest.raises(JobError, match=r"parallel.tp_size = 2.*uses no tensor parallelism"):
        load_job(job_file, overrides + ["parallel.tp_size=2"])
    with pytest.raises(JobError, match=r"parallel.strategy = 'replicate_layout:nothing'.*not a strategies.Strategy"):
        load_job(job_file, MLP[1] + ["parallel.strategy=replicate_layout:nothing"])
    with pytest.raises(JobError, match=r"parallel.strategy = 'no_such_module:x'.*importing 'no_such_module' failed"):
        load_job(job_file, MLP[1] + ["parallel.strategy=no_such_module:x"])


def test_a_layout_of_ones_own_trains_end_to_end_and_matches_plain_pytorch(local_workers, tmp_path):
    job_file, overrides = job_with_own_layout(tmp_path)
    ref_state, ref_losses = reference(load_job(job_file, overrides))
    summary = run_gearshift(job_file, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["world_size"] == 2
    assert summary["strategy_history"][0]["strategy"] == "replicate_layout:replicate"
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-5
    losses = step_losses(tmp_path / "run")
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses)) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["type"] == "step"]
    # its all-reduces go through the worker's comm timing like any layout's: one per parameter
    assert steps[-1]["comm_calls"] == len(ref_state) and steps[-1]["comm_wait_mean"] > 0
