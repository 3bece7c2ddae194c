"""DCP checkpoints written behind the training steps (checkpoint.async_save): the files are
hashed as they are written, the state saved is the one of the checkpoint's step however the
model changes while it is written, training goes on during the write, and a worker killed
mid-write leaves the previous checkpoint in use, the run ending equal to plain PyTorch."""

from __future__ import annotations

import json
import pathlib
import threading
import time

import pytest
import torch

from test_dcp import _trained
from test_fault import events, faulty, records
from test_train_equivalence import MLP, max_diff, reference, run_gearshift

from gearshift.orchestrator.job import JobError, load_job
from gearshift.workers.state import checkpoint, dcp, hashing


def _rehashed(folder: pathlib.Path, files: dict) -> dict:
    return {name: {"bytes": (folder / name).stat().st_size, "sha256": checkpoint.sha256_file(folder / name)}
            for name in files}


def test_the_digests_are_those_of_the_files_written_and_nothing_is_read_back(process_group, tmp_path, monkeypatch):
    model, opt = _trained()
    read = []
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path, *a: read.append(path))
    folder = dcp.tmp_folder(tmp_path, 2)
    files = dcp.save(model, opt, folder, 0, 1, {"scaler": {}, "step": 2})
    behind = dcp.start_save(model, opt, dcp.tmp_folder(tmp_path, 4), 4, 0, {"scaler": {}, "step": 4},
                            dcp.save_group()).part()
    assert read == []  # no file was hashed by reading it
    monkeypatch.undo()
    for where, got in ((folder, files), (pathlib.Path(behind["folder"]), behind["files"])):
        assert {"dcp/.metadata", "extra.pt"} <= set(got) and any(n.endswith(".distcp") for n in got)
        assert got == _rehashed(where, got)
    path = checkpoint.commit(tmp_path, 4, pathlib.Path(behind["folder"]), behind["files"], keep=3)
    checkpoint.verify(path)


def test_a_write_behind_saves_the_state_of_its_step_while_the_caller_goes_on(process_group, tmp_path, monkeypatch):
    model, opt = _trained()
    at_step = {k: v.clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    close = hashing.HashedStream.close

    def held(self):  # storage that takes its time: the shard's close waits for the test
        if not self.closed and self.name.endswith(".distcp"):
            assert release.wait(30)
        close(self)

    monkeypatch.setattr(hashing.HashedStream, "close", held)
    pending = dcp.start_save(model, opt, dcp.tmp_folder(tmp_path, 2), 2, 0, {"scaler": {}, "step": 2},
                             dcp.save_group())
    for _ in range(3):  # training goes on while the write is held: the saved state must not change
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    assert not pending.done()
    stepped = time.time()
    release.set()
    part = pending.part(timeout=60)
    assert part["written"][1] >= stepped  # the write ended after the steps that ran behind it
    path = checkpoint.commit(tmp_path, 2, pathlib.Path(part["folder"]), part["files"], keep=3)
    saved = dcp.load_full(path)["model"]
    assert max_diff(saved, at_step) == 0.0
    assert max_diff(model.state_dict(), at_step) > 0  # the model did move on


def test_a_write_that_does_not_end_is_a_clear_error_not_a_hang(process_group, tmp_path, monkeypatch):
    model, opt = _trained()
    release = threading.Event()
    close = hashing.HashedStream.close
    monkeypatch.setattr(hashing.HashedStream, "close", lambda self: (release.wait(30), close(self)))
    pending = dcp.start_save(model, opt, dcp.tmp_folder(tmp_path, 2), 2, 0, {"scaler": {}, "step": 2},
                             dcp.save_group())
    try:
        with pytest.raises(checkpoint.CheckpointError, match="step 2 was still being written after 0.5 s"):
            pending.part(timeout=0.5)
    finally:
        release.set()
        pending.future.result(timeout=30)


def test_async_save_is_a_checked_job_field():
    assert load_job(MLP[0]).checkpoint.async_save is True
    assert load_job(MLP[0], ["checkpoint.async_save=false"]).checkpoint.async_save is False
    with pytest.raises(JobError, match="checkpoint.async_save"):
        load_job(MLP[0], ["checkpoint.async_save=sometimes"])


# ---------------------------------------------------------------- on Ray, end to end

BASE = MLP[1] + ["cluster.num_workers=2", "train.steps=30", "checkpoint.every=10", "checkpoint.keep=2"]


def test_an_async_save_overlaps_the_training_steps_and_the_run_equals_plain_pytorch(local_workers, tmp_path):
    job, slow = faulty(tmp_path, "slow_storage_mlp", close_delay_s=2.0)
    summary = run_gearshift(job, BASE + slow, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 30
    recs = records(tmp_path / "run")
    ended = {r["step"]: r["ended_at"] for r in recs if r["type"] == "step"}
    saved = {e["step"]: e for e in events(tmp_path / "run", "checkpoint")}
    assert {10, 20, 30} <= set(saved)
    for step in (10, 20):
        write = saved[step]
        assert write["write_ended"] - write["write_started"] >= 2.0
        behind = [s for s in range(step + 1, step + 10) if ended[s] < write["write_ended"]]
        assert len(behind) >= 5, f"steps {behind} ended while the checkpoint of step {step} was written"
    ref_state, _ = reference(load_job(job, BASE + slow))
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-5
    # the checkpoint of step 20, written while steps 21-29 changed the model, holds step 20
    ref_20, _ = reference(load_job(job, BASE + slow + ["train.steps=20"]))
    at_20 = dcp.load_full(tmp_path / "run" / "checkpoints" / "step_00000020")
    assert at_20["step"] == 20 and max_diff(at_20["model"], ref_20) <= 1e-5
    print(f"steps ended during the write of step 10's checkpoint: "
          f"{sum(ended[s] < saved[10]['write_ended'] for s in range(11, 20))} of 9")


def test_a_worker_killed_mid_write_leaves_the_previous_checkpoint_and_the_run_equals_plain_pytorch(
        local_workers, tmp_path):
    job, kill = faulty(tmp_path, "slow_storage_mlp", close_delay_s=1.0, kill_at_step=20, kill_rank=1)
    overrides = BASE + kill + ["fault.max_failures=2"]
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 30
    assert (tmp_path / "fired.rank1").exists(), "rank 1 was never killed mid-write"
    [failure] = events(tmp_path / "run", "failure")
    [restored] = events(tmp_path / "run", "restored")
    assert restored["checkpoint"] == "step_00000010" and restored["step"] == 10  # not the half-written 20
    before = [e["step"] for e in events(tmp_path / "run", "checkpoint") if e["time"] < failure["time"]]
    assert before == [10]
    steps = [r for r in records(tmp_path / "run") if r["type"] == "step" and r["time"] < failure["time"]]
    assert max(r["step"] for r in steps) > 20  # the kill came while steps went on behind the write
    ref_state, _ = reference(load_job(job, overrides))
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-5
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path / "run" / "checkpoints")] == \
        ["step_00000020", "step_00000030"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".step_*"))  # the cut-short write was redone in place
    print(json.dumps({"failure": failure.get("kind"), "restored": restored["checkpoint"]}))
