"""The end of a run is a step like the others: a worker lost while the run writes its final
checkpoint (after every step has trained) is recovered from as anywhere else. Under elastic the
survivors that hold the whole state write it themselves, with no step trained again; where the
lost rank held a piece only it had, the run restarts from its newest checkpoint and trains the
rest again. Either way the run ends done, with final.pt equal to plain PyTorch. The runs are on
the warm processes (tests/process_workers.py): what is tested is the controller's end of a run,
not Ray's account of the loss (tests/test_elastic.py has that)."""

from __future__ import annotations

import shutil

import torch

from gearshift.orchestrator.job import load_job
from gearshift.workers.state import checkpoint
from test_elastic import SGD, sharded_reference
from test_fault import events
from test_train_equivalence import FIXTURES, max_diff, reference, run_gearshift

STEPS = 30
BASE = [f"train.steps={STEPS}", "train.global_batch_size=24", "cluster.num_workers=4", "cluster.cpus_per_worker=1",
        "cluster.min_workers=2", "fault.max_failures=2", "fault.on_node_loss=elastic"]


def _job(tmp_path, *overrides):
    for name in ("user_model.py", "dies_saving.py"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    job = tmp_path / "job.yaml"
    job.write_text(
        "name: dies_saving\n"
        f"model: {{entrypoint: 'dies_saving:build', kwargs: {{width: 32, rank: 3, after: {STEPS}}}}}\n"
        "data: {entrypoint: 'dies_saving:waves', kwargs: {size: 256}}\n"
        "loss: {entrypoint: 'dies_saving:smooth_l1'}\n"
        "optimizer: {name: adamw, lr: 0.003}\n"
        "train: {seed: 4}\n")
    return job, BASE + list(overrides)


def test_survivors_holding_the_state_write_the_final_checkpoint(local_workers, tmp_path):
    job, overrides = _job(tmp_path, "parallel.strategy=data", "checkpoint.every=0", *SGD)
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == STEPS, summary.get("error")
    [failure] = events(tmp_path / "run", "failure")
    assert failure["dead_ranks"] == [3] and failure["steps_to_recompute"] == 0, failure
    assert "elastic: go on in memory" in failure["action"], failure
    [resize] = events(tmp_path / "run", "resize")
    assert resize["from_checkpoint"] is False and resize["steps_redone"] == 0 and resize["world_size"] == [4, 3]
    assert not events(tmp_path / "run", "restored")
    states = [e["state"] for e in events(tmp_path / "run", "state")]
    assert states[-4:] == ["finishing", "training", "finishing", "done"], states  # the end, again on the survivors
    assert summary["final_written_by"] == "rank 0"  # the survivors' first rank, on this node
    [(name, saved)] = [(p.name, p) for p in checkpoint.list_checkpoints(tmp_path / "run" / "checkpoints")]
    assert name == f"step_{STEPS:08d}"
    # every step trained on 4 replicas before the loss: the run's own arithmetic, unchanged
    ref = sharded_reference(load_job(job, overrides), lambda step: 4)
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= 1e-5


def test_a_lost_piece_at_the_end_restarts_from_the_newest_checkpoint(local_workers, tmp_path):
    """fsdp(4) held each shard once: the survivors cannot write it, so the run restarts from the
    checkpoint of step 20 and trains the last 10 steps again (the restarted worker is a new process,
    which does not die)."""
    job, overrides = _job(tmp_path, "parallel.strategy=fsdp", "checkpoint.every=10")
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == STEPS, summary.get("error")
    [failure] = events(tmp_path / "run", "failure")
    assert "only on the lost rank(s) [3]" in failure["elastic"] and "restart from step 20" in failure["action"]
    [restored] = events(tmp_path / "run", "restored")
    assert restored["step"] == 20
    ref, _ = reference(load_job(job, overrides))
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= 1e-4
