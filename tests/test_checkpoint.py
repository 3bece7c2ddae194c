"""Atomic checkpoints: what verifies is used, what does not is skipped with a warning."""

from __future__ import annotations

import logging
import os
import pickle

import pytest
import torch

from gearshift.workers.state import checkpoint


def state(step: int) -> dict:
    return {"model": {"w": torch.full((3,), float(step))}, "step": step, "optimizer": {"state": {}, "lr": [0.1]}}


def test_round_trip_and_keep_last_k(tmp_path):
    for step in (2, 4, 6, 8):
        checkpoint.save(tmp_path, step, state(step), keep=2)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000006", "step_00000008"]
    path, loaded = checkpoint.load_latest(tmp_path)
    assert path.name == "step_00000008" and loaded["step"] == 8 and torch.equal(loaded["model"]["w"], torch.full((3,), 8.0))


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, caplog):
    checkpoint.save(tmp_path, 1, state(1), keep=3)
    newest = checkpoint.save(tmp_path, 2, state(2), keep=3)
    data = bytearray((newest / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (newest / "state.pt").write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="gearshift.checkpoint"):
        path, loaded = checkpoint.load_latest(tmp_path)
    assert loaded["step"] == 1 and "skipping checkpoint step_00000002" in caplog.text
    assert "does not match its manifest" in caplog.text


def test_truncated_and_manifestless_checkpoints_are_skipped(tmp_path):
    checkpoint.save(tmp_path, 1, state(1), keep=5)
    two = checkpoint.save(tmp_path, 2, state(2), keep=5)
    three = checkpoint.save(tmp_path, 3, state(3), keep=5)
    with open(two / "state.pt", "r+b") as f:
        f.truncate(10)
    (three / "manifest.json").unlink()
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 1


def test_an_interrupted_write_leaves_nothing_that_loads(tmp_path, monkeypatch):
    checkpoint.save(tmp_path, 1, state(1), keep=5)

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.os, "rename", crash)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, 2, state(2), keep=5)
    monkeypatch.undo()
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000001"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # the temp folder is cleaned up
    # a temp folder left by a killed process (no cleanup ran) is never taken for a checkpoint
    (tmp_path / ".step_00000009.tmp-1-1").mkdir()
    assert checkpoint.load_latest(tmp_path)[1]["step"] == 1


def test_checkpoints_load_as_data_only(tmp_path):
    """weights_only: a state that would need arbitrary code to unpickle is refused, and skipped."""
    path = checkpoint.save(tmp_path, 1, {"step": 1, "obj": os.environ.__class__}, keep=2)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        checkpoint.load(path)
    assert checkpoint.load_latest(tmp_path) is None


def test_atomic_file_write_replaces_whole(tmp_path):
    target = tmp_path / "final.pt"
    checkpoint.write_file_atomic(target, b"one")
    checkpoint.write_file_atomic(target, b"two")
    assert target.read_bytes() == b"two" and os.listdir(tmp_path) == ["final.pt"]
