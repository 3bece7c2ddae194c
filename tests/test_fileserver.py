"""Sharded checkpoints on a cluster whose nodes share no file system (workers/state/fileserver.py): the
workers reach the driver's checkpoints folder through a FileServer actor on the driver's node, as
an fsspec URL; every rank writes its own DCP shards and reads only its pieces, nothing is
gathered, and a run resumes from there under another layout, equal to plain PyTorch."""

from __future__ import annotations

import json

import pytest
import torch

from test_dcp import _trained
from test_train_equivalence import MLP, max_diff, reference, run_gearshift

from gearshift.orchestrator.job import load_job
from gearshift.workers.state import checkpoint, dcp, fileserver, storage

pytestmark = pytest.mark.ray


@pytest.fixture
def served(ray_cluster, tmp_path):
    """(the served folder, the folder as a worker on another node reaches it); the server is
    stopped afterwards."""
    import ray

    name = f"gearshift-files-test-{tmp_path.name}"[:60]
    root = tmp_path / "checkpoints"
    server = ray.remote(fileserver.FileServer).options(name=name, num_cpus=0, max_concurrency=fileserver.IN_FLIGHT).remote(str(root))
    ray.get(server.mark.remote(name), timeout=60)
    try:
        yield root, storage.location(fileserver.url(name, str(root)))
    finally:
        ray.kill(server, no_restart=True)


def test_a_dcp_checkpoint_written_and_read_through_the_server(process_group, served):
    root, via = served
    assert storage.is_served(via) and via.is_dir()
    model, opt = _trained()
    folder = dcp.tmp_folder(via, 2)
    assert folder.path == str(dcp.tmp_folder(root, 2))  # the same folder the driver commits
    files = dcp.save(model, opt, folder, 0, 1, {"scaler": {}, "step": 2})
    for name, want in files.items():  # hashed on the server: the same digest as here
        assert want["sha256"] == checkpoint.sha256_file(dcp.tmp_folder(root, 2) / name)
    path = checkpoint.commit(root, 2, dcp.tmp_folder(root, 2), files, keep=5)
    assert not list(root.rglob(".*.part-*"))  # every file renamed into place
    fresh, fresh_opt = _trained(seed=1, steps=1)
    ref = checkpoint.load(path)
    extra = dcp.load(fresh, fresh_opt, dcp.locate(ref["dcp"], via))
    assert extra["step"] == 2
    assert max_diff(fresh.state_dict(), model.state_dict()) == 0
    a, b = opt.state_dict()["state"], fresh_opt.state_dict()["state"]
    assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)


def test_the_server_keeps_to_its_folder_and_drops_a_write_cut_short(served):
    root, via = served
    with pytest.raises(PermissionError):
        via.fs.info("/etc/passwd")
    with pytest.raises(FileNotFoundError):
        (via / "missing").read_bytes()
    target = via / "sub" / "data.bin"
    payload = bytes(range(256)) * (fileserver.BLOCK // 256 + 7)  # more than one block
    target.write_bytes(payload)
    assert (root / "sub" / "data.bin").read_bytes() == payload
    with target.open("rb") as f:
        f.seek(fileserver.BLOCK - 3)
        assert f.read(10) == payload[fileserver.BLOCK - 3:fileserver.BLOCK + 7]
    with pytest.raises(RuntimeError):
        with via.fs.open((via / "sub" / "cut.bin").path, "wb") as f:
            f.write(b"x" * (fileserver.BLOCK + 1))  # one block already sent to the server
            raise RuntimeError("the writer died")
    assert not (root / "sub" / "cut.bin").exists()
    assert [p.name for p in (root / "sub").iterdir()] == ["data.bin"]  # nor a temporary file left


def test_a_run_on_unshared_storage_checkpoints_by_shards_and_resumes_under_another_layout(ray_cluster, tmp_path):
    where = ["checkpoint.every=3", "optimizer.name=adam", "inject.unshared_storage=true", "cluster.num_workers=2"]
    first = MLP[1] + where + ["train.steps=6", "parallel.strategy=fsdp"]
    summary = run_gearshift(MLP[0], first, tmp_path / "run")
    assert summary["status"] == "done"
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    starting = next(r for r in records if r.get("state") == "starting")
    assert starting.get("checkpoint_format") == "dcp" and starting.get("checkpoint_served") is True
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000003", "step_00000006"]
    assert checkpoint.verify(root / "step_00000006")[0]["format"] == checkpoint.DCP_FORMAT  # shards, no gather
    # continued to step 9 as data(2), the workers reading their pieces of step 6 through the server
    _resume_to_9_equals_plain_pytorch(tmp_path / "run", where, "data")


def test_a_full_format_checkpoint_is_streamed_in_and_mapped_by_each_worker(ray_cluster, tmp_path):
    """checkpoint.format full under fsdp: the ranks gather the state a tensor at a time and rank 0
    writes state.pt as it comes, through the driver's server (nothing is sent to the driver whole);
    the resume (as tensor parallel) hands the workers a reference, and each maps the file on its
    own node (here fetched through the server into a local copy)."""
    where = ["checkpoint.every=3", "optimizer.name=adam", "inject.unshared_storage=true", "cluster.num_workers=2",
             "checkpoint.format=full"]
    summary = run_gearshift(MLP[0], MLP[1] + where + ["train.steps=6", "parallel.strategy=fsdp"], tmp_path / "run")
    assert summary["status"] == "done"
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    saved = [r for r in records if r.get("event") == "checkpoint"]
    assert [r["step"] for r in saved] == [3, 6]
    assert all(r["format"] == "full" and r["bytes"] > 0 for r in saved)  # rank 0's file, committed by the driver
    root = tmp_path / "run" / "checkpoints"
    assert checkpoint.verify(root / "step_00000006")[0]["format"] == checkpoint.FORMAT
    assert checkpoint.load(root / "step_00000006", whole=False) == {
        "full": str((root / "step_00000006" / "state.pt").resolve()), "step": 6}
    _resume_to_9_equals_plain_pytorch(tmp_path / "run", where, "tensor")


def _resume_to_9_equals_plain_pytorch(run, where: list[str], strategy: str) -> None:
    """The run of 6 steps continued to step 9 under `strategy` ends where 9 single-process steps do."""
    more = MLP[1] + where + ["train.steps=9", f"parallel.strategy={strategy}"]
    summary = run_gearshift(MLP[0], more, run, "--resume", str(run))
    assert summary["resumed_from_step"] == 6 and summary["strategy_history"][-1]["strategy"] == strategy
    ref_state, _ = reference(load_job(MLP[0], MLP[1] + ["train.steps=9", "optimizer.name=adam"]))
    final = torch.load(run / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-4
