"""Sharded state end to end on Ray: switches between sharded and unsharded layouts, DCP
checkpoints resumed under another layout and world size, all equal to plain single-process
PyTorch on the same batches. (Each layout alone: test_train_equivalence.py; a killed worker
under fsdp: test_fault.py; the checkpoint protocol: test_dcp.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import load_job
from test_train_equivalence import GPT, max_diff, reference, run_gearshift, step_losses
from gearshift.workers.state import checkpoint
from gearshift.workers.state import dcp

BASE = GPT[1] + ["train.global_batch_size=8", "optimizer.name=adam", "train.grad_clip=0.05"]


@pytest.mark.crossing("switch", "fsdp")
@pytest.mark.crossing("switch", "hsdp")
@pytest.mark.crossing("resume", "fsdp")
def test_forced_switches_through_every_sharded_layout_equal_plain_pytorch(local_workers, tmp_path):
    """data -> fsdp -> sharded hybrid -> hsdp on 4 workers, with a DCP checkpoint taken in each."""
    schedule = ("adapt.schedule=[{step: 3, strategy: fsdp}, {step: 6, strategy: hybrid, tp_size: 2, dp_shard: true},"
                " {step: 9, strategy: hsdp, shard_size: 2}]")
    overrides = BASE + ["train.steps=12", "cluster.num_workers=4", "checkpoint.every=2", "checkpoint.keep=10",
                        schedule]
    ref_state, ref_losses = reference(load_job(GPT[0], overrides))
    run = tmp_path / "run"
    summary = run_gearshift(GPT[0], overrides, run)
    assert [(h["step"], h["strategy"], h.get("shard", 1)) for h in summary["strategy_history"]] == [
        (0, "data", 1), (3, "fsdp", 4), (6, "hybrid", 2), (9, "hsdp", 2)]
    final = torch.load(run / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-4
    losses = step_losses(run)
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses)) <= 1e-4
    # every checkpoint is in DCP format, whatever layout wrote it, and the last one is final.pt
    names = [p.name for p in checkpoint.list_checkpoints(run / "checkpoints")]
    assert names == [f"step_{s:08d}" for s in (2, 4, 6, 8, 10, 12)]
    for name in names:
        assert json.loads((run / "checkpoints" / name / "manifest.json").read_text())["format"] == 2
    last = dcp.load_full(run / "checkpoints" / names[-1])
    assert max_diff(last["model"], final) == 0.0


@pytest.mark.crossing("resume", "fsdp")
@pytest.mark.crossing("resume", "hybrid")
def test_an_fsdp_checkpoint_resumes_under_hybrid_on_another_world_size(local_workers, tmp_path):
    """fsdp(4) writes shards of a quarter each; hybrid(1 x 2) on 2 workers reads what it needs."""
    run = tmp_path / "run"
    run_gearshift(GPT[0], BASE + ["train.steps=6", "cluster.num_workers=4", "parallel.strategy=fsdp",
                                  "checkpoint.every=3"], run)
    assert cli.main(["run", "--resume", str(run), "--set", "train.steps=10", "--set", "cluster.num_workers=2",
                     "--set", "parallel.strategy=hybrid", "--set", "parallel.tp_size=2"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from_step"] == 6
    assert [(h["step"], h["strategy"], h["dp"], h["tp"]) for h in summary["strategy_history"]] == [
        (0, "fsdp", 4, 1), (6, "hybrid", 1, 2)]
    ref, _ = reference(load_job(GPT[0], BASE + ["train.steps=10"]))
    assert max_diff(torch.load(run / "final.pt", weights_only=True), ref) <= 1e-4
