"""DCP checkpoints: the commit protocol (manifest last, rename, verify) and a save/load round
trip on a one-process gloo group. Multi-worker layouts and resharding are covered end to end in
tests/test_sharded.py."""

from __future__ import annotations

import json
import os
import pathlib

import pytest
import torch

from gearshift.workers.state import checkpoint, dcp
from gearshift.workers.build.models import mlp


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
    manifest = json.loads((path / "manifest.json").read_text())
    assert ref == {"dcp": str(path.resolve()), "step": 2, "files": manifest["files"]}
    extra = dcp.load(fresh, fresh_opt, ref["dcp"], ref["files"])
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


def test_the_driver_reads_no_data_and_the_workers_find_a_changed_file_before_loading(process_group, tmp_path,
                                                                                     monkeypatch):
    """A flipped byte keeps the file's size: the driver's check (manifest, sizes) passes it and
    hashes nothing; the workers' load hashes the files and refuses before reading anything in.
    A shorter file the driver's check passes over at once, for the checkpoint before it."""
    model, opt = _trained()
    _write(tmp_path, 2, model, opt)
    newer = _write(tmp_path, 4, model, opt)
    shard = next((newer / checkpoint.DCP_DIR).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    hashed = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda path, *a: hashed.append(path) or real(path, *a))
    path, ref = checkpoint.load_latest(tmp_path, whole=False)
    assert (path, ref["step"], hashed) == (newer, 4, [])  # the driver: metadata only
    fresh, fresh_opt = _trained(seed=1, steps=1)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(checkpoint.CheckpointError, match=f"{shard.name} do.es. not match its manifest"):
        dcp.load(fresh, fresh_opt, ref["dcp"], ref["files"])
    assert len(hashed) == len(ref["files"])  # one rank: it hashed every file
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing read in
    shard.write_bytes(bytes(data[:-1]))
    path, ref = checkpoint.load_latest(tmp_path, whole=False)
    assert path.name == "step_00000002"


def _shares(rank, world, root):
    import json as json_

    import torch.distributed as dist

    model, opt = _trained()
    folder = dcp.tmp_folder(root, 2)
    files = dcp.save(model, opt, folder, rank, world, {"scaler": {}, "step": 2})
    parts = [None] * world
    dist.all_gather_object(parts, files)
    if rank == 0:
        checkpoint.commit(root, 2, folder, {k: v for p in parts for k, v in p.items()}, keep=5)
    dist.barrier()
    ref = checkpoint.load(root / "step_00000002", whole=False)
    mine = checkpoint.verify_share(root / "step_00000002", ref["files"], rank, world)
    seen = sorted(ref["files"])[rank::world]
    dist.barrier()
    if rank == 0:  # one file changed: every rank refuses, naming it
        victim = root / "step_00000002" / sorted(ref["files"])[1]
        victim.write_bytes(b"x" * victim.stat().st_size)
    dist.barrier()
    try:
        dcp.check_files(root / "step_00000002", ref["files"])
        said = None
    except checkpoint.CheckpointError as err:
        said = str(err)
    (root / f"shares-{rank}.json").write_text(json_.dumps({"bad": mine, "seen": seen, "said": said,
                                                           "all": sorted(ref["files"])}))


def test_the_ranks_share_the_hashing_and_all_refuse_a_changed_file(tmp_path):
    from test_fsdp import spawn_gloo

    spawn_gloo(_shares, 2, (tmp_path,))
    got = [json.loads((tmp_path / f"shares-{r}.json").read_text()) for r in range(2)]
    assert sorted(got[0]["seen"] + got[1]["seen"]) == got[0]["all"] and not set(got[0]["seen"]) & set(got[1]["seen"])
    assert got[0]["bad"] == got[1]["bad"] == []
    victim = got[0]["all"][1]
    assert all(g["said"] and victim in g["said"] for g in got), got


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


def test_a_checkpoint_the_workers_refuse_is_passed_over_for_the_one_before_it(process_group, tmp_path):
    from gearshift.orchestrator.control.checkpoints import load_into
    from gearshift.orchestrator.errors import WorkerFailed

    model, opt = _trained()
    for step in (2, 4, 6):
        _write(tmp_path, step, model, opt)

    class Group:  # workers that find step 6's files changed
        loaded = []

        def put(self, value):
            return value

        def call(self, method, state):
            assert method == "load"
            if state["step"] == 6:
                raise WorkerFailed(1, "CheckpointError: x: y do(es) not match its manifest (size or checksum)")
            self.loaded.append(state["step"])
            return [state["step"]] * 2

    said = []

    class Report:
        def say(self, text):
            said.append(text)

    found = checkpoint.load_latest(tmp_path, whole=False)
    assert load_into(Group(), tmp_path, (found[0].name, found[1]), Report()) == (4, "step_00000004")
    assert Group.loaded == [4] and "step_00000006" in said[0] and "loading step_00000004 instead" in said[0]
    # a rollback never goes back to a step at or after its first bad one
    assert load_into(Group(), tmp_path, (found[0].name, found[1]), Report(), before=4) == (2, "step_00000002")
    with pytest.raises(WorkerFailed):
        load_into(Group(), tmp_path, (found[0].name, found[1]), Report(), before=2)


def test_rank_0_writes_final_pt_only_where_it_sees_the_runs_folder(process_group, tmp_path):
    from types import SimpleNamespace

    from gearshift.workers.state import storage
    from gearshift.workers.state.state_io import FINAL_MARK, StateIO

    model, opt = _trained()
    path = _write(tmp_path / "checkpoints", 2, model, opt)
    worker = SimpleNamespace(rank=0, dcp_root=storage.location(tmp_path / "checkpoints"),
                             config=SimpleNamespace(checkpoint_options=None))
    run = tmp_path / "run"
    run.mkdir()
    target = run / "final.pt"
    assert StateIO(worker).write_final(str(path), str(target), "token") == {"written": False}  # not the driver's
    (run / FINAL_MARK).write_text("another run's token")
    assert StateIO(worker).write_final(str(path), str(target), "token") == {"written": False}
    (run / FINAL_MARK).write_text("token")
    assert StateIO(SimpleNamespace(**{**vars(worker), "rank": 1})).write_final(str(path), str(target), "token") == {}
    assert StateIO(worker).write_final(str(path), str(target), "token")["written"] and target.is_file()
    final = torch.load(target, weights_only=True)
    assert final.keys() == model.state_dict().keys()
    assert all(torch.equal(final[k], v) for k, v in model.state_dict().items())
