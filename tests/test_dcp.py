"""DCP checkpoints: the commit protocol (manifest last, rename, verify) and a save/load round
trip on a one-process gloo group. Multi-worker layouts and resharding are covered end to end in
tests/test_sharded.py."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from gearshift.workers import checkpoint, dcp
from gearshift.workers.models import mlp


def _trained(seed: int = 0, steps: int = 2):
    torch.manual_seed(seed)
    model = mlp(in_features=8, hidden=16, out_features=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        x, y = torch.randn(5, 8), torch.randint(0, 4, (5,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _write(root: pathlib.Path, step: int, model, opt) -> pathlib.Path:
    folder = dcp.tmp_folder(root, step)
    files = dcp.save(model, opt, folder, 0, 1, {"scaler": {}, "step": step})
    return checkpoint.commit(root, step, folder, files, keep=5)


def test_round_trip_restores_model_and_optimizer(process_group, tmp_path):
    model, opt = _trained()
    path = _write(tmp_path, 2, model, opt)
    assert json.loads((path / "manifest.json").read_text())["format"] == checkpoint.DCP_FORMAT
    fresh, fresh_opt = _trained(seed=1, steps=1)  # other weights, other optimizer state
    ref = checkpoint.load(path)
    assert ref == {"dcp": str(path.resolve()), "step": 2}
    extra = dcp.load(fresh, fresh_opt, ref["dcp"])
    assert extra["step"] == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), key
    full = dcp.full_model(path)  # what final.pt holds, read without a process group
    assert set(full) == set(model.state_dict())
    assert all(torch.equal(full[k], v) for k, v in model.state_dict().items())


def test_interrupted_write_is_never_loaded(process_group, tmp_path):
    model, opt = _trained()
    _write(tmp_path, 2, model, opt)
    # step 4's shards are on disk but the driver never committed them (killed mid-write)
    folder = dcp.tmp_folder(tmp_path, 4)
    dcp.save(model, opt, folder, 0, 1, {"scaler": {}, "step": 4})
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000002"]
    path, state = checkpoint.load_latest(tmp_path)
    assert (path.name, state["step"]) == ("step_00000002", 2)


def test_corrupt_shard_falls_back_to_the_previous_checkpoint(process_group, tmp_path):
    model, opt = _trained()
    _write(tmp_path, 2, model, opt)
    newer = _write(tmp_path, 4, model, opt)
    shard = next((newer / checkpoint.DCP_DIR).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="does not match its manifest"):
        checkpoint.verify(newer)
    path, state = checkpoint.load_latest(tmp_path)
    assert state["step"] == 2


def test_commit_refuses_files_it_cannot_see(process_group, tmp_path):
    model, opt = _trained()
    folder = dcp.tmp_folder(tmp_path, 2)
    files = dcp.save(model, opt, folder, 0, 1, {"scaler": {}, "step": 2})
    files["dcp/__7_0.distcp"] = {"bytes": 10, "sha256": "0" * 64}  # a rank that wrote elsewhere
    with pytest.raises(checkpoint.CheckpointError, match="share the run directory"):
        checkpoint.commit(tmp_path, 2, folder, files, keep=3)
    assert not folder.exists() and checkpoint.list_checkpoints(tmp_path) == []


def test_a_checkpoint_of_another_model_names_the_first_mismatch(process_group, tmp_path):
    model, opt = _trained()
    path = _write(tmp_path, 2, model, opt)
    torch.manual_seed(0)
    wider = mlp(in_features=8, hidden=32, out_features=4)
    opt2 = torch.optim.AdamW(wider.parameters(), lr=1e-2)
    with pytest.raises(checkpoint.CheckpointError, match=r"is \[16, 8\] in the checkpoint, \[32, 8\] in the model"):
        dcp.load(wider, opt2, path)


def test_full_format_checkpoints_of_earlier_versions_still_load(tmp_path):
    model, _ = _trained()
    state = {"model": model.state_dict(), "optimizer": {}, "step": 3}
    path = checkpoint.save(tmp_path, 3, state, keep=2)
    assert json.loads((path / "manifest.json").read_text())["format"] == checkpoint.FORMAT
    loaded = checkpoint.load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["out.weight"], model.state_dict()["out.weight"])
    assert os.path.isfile(path / "state.pt")


def test_a_full_format_state_of_another_model_names_the_first_mismatch():
    from gearshift.strategies import state

    model, _ = _trained()
    saved = state.model_state(model)
    torch.manual_seed(0)
    with pytest.raises(state.StateMismatch, match=r"hidden.0.weight is \[16, 8\] in the saved state, \[32, 8\]"):
        state.load_model_state(mlp(in_features=8, hidden=32, out_features=4), saved)
    del saved["out.bias"]
    with pytest.raises(state.StateMismatch, match=r"the model has out.bias \[4\], the saved state does not"):
        state.load_model_state(model, saved)
