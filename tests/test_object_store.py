"""Checkpoints in an object store (checkpoint.path: s3://...), against a local S3-compatible
server this module starts (moto's, in this process, on a free port): every rank writes its DCP
shards there directly, the driver's manifest (written last) makes a checkpoint, a write killed
midway is never loaded, and a run resumes from there under another layout, equal to plain
single-process PyTorch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from conftest import free_port  # noqa: E402
from test_dcp import _trained, _write  # noqa: E402
from test_train_equivalence import MLP, max_diff, reference, run_gearshift  # noqa: E402

from gearshift.orchestrator.job import JobError, load_job  # noqa: E402
from gearshift.workers.state import checkpoint, dcp, export, storage  # noqa: E402

BUCKET = "gearshift-test"


@pytest.fixture(scope="module")
def s3():
    """(the bucket's URL, storage options) of a fresh S3-compatible server; stopped afterwards."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    options = {"key": "testing", "secret": "testing", "endpoint_url": f"http://127.0.0.1:{port}"}
    try:
        import s3fs

        s3fs.S3FileSystem(**options).mkdir(BUCKET)
        yield f"s3://{BUCKET}", options
    finally:
        server.stop()


def _root(s3, name: str) -> storage.RemotePath:
    url, options = s3
    return storage.location(f"{url}/{name}", options)


def test_a_dcp_checkpoint_round_trips_through_the_object_store(process_group, s3):
    root = _root(s3, "round-trip")
    model, opt = _trained()
    path = _write(root, 2, model, opt)
    assert isinstance(path, storage.RemotePath) and path.url.startswith("s3://")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000002"]
    manifest, _ = checkpoint.verify(path)
    assert manifest["format"] == checkpoint.DCP_FORMAT and "dcp/.metadata" in manifest["files"]
    ref = checkpoint.load(path)
    fresh, fresh_opt = _trained(seed=1, steps=1)
    assert dcp.load(fresh, fresh_opt, storage.location(ref["dcp"], s3[1]))["step"] == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    # final.pt and the export read the same checkpoint tensor by tensor
    tensors = export.ModelTensors(path)
    assert all(torch.equal(tensors.read(k), v) for k, v in model.state_dict().items())


def test_a_checkpoint_without_its_manifest_is_never_loaded_and_is_pruned(process_group, s3):
    root = _root(s3, "uncommitted")
    model, opt = _trained()
    _write(root, 2, model, opt)
    dcp.save(model, opt, dcp.tmp_folder(root, 4), 0, 1, {"scaler": {}, "step": 4})  # never committed
    assert (root / "step_00000004" / "dcp" / ".metadata").exists()
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000002"]
    path, state = checkpoint.load_latest(root)
    assert (path.name, state["step"]) == ("step_00000002", 2)
    _write(root, 6, model, opt)  # a later commit prunes the older folder that never got its manifest
    assert not (root / "step_00000004").exists()
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000002", "step_00000006"]


def test_a_corrupt_object_falls_back_to_the_previous_checkpoint(process_group, s3):
    root = _root(s3, "corrupt")
    model, opt = _trained()
    _write(root, 2, model, opt)
    newer = _write(root, 4, model, opt)
    shard = next(p for p in (newer / "dcp").iterdir() if p.name.endswith(".distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    path, state = checkpoint.load_latest(root)
    assert state["step"] == 2


def test_a_full_format_checkpoint_and_best_json_in_the_object_store(s3):
    root = _root(s3, "full")
    model, _ = _trained()
    path = checkpoint.save(root, 3, {"model": model.state_dict(), "optimizer": {}, "step": 3}, keep=2)
    loaded = checkpoint.load(path)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["out.weight"], model.state_dict()["out.weight"])
    checkpoint.mark_best(root, 3, 0.5, keep=2)
    assert checkpoint.best(root)["path"] == "step_00000003"


_KILLED_MID_WRITE = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [{tests!r}]
    import torch.distributed as dist
    from conftest import free_port
    from test_dcp import _trained, _write
    from gearshift.workers.state import checkpoint, dcp, storage
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{free_port()}}", rank=0, world_size=1)
    root = storage.location({url!r}, {options!r})
    model, opt = _trained()
    _write(root, 2, model, opt)
    # step 4: the shards and DCP's metadata go out, then the process is killed before extra.pt
    checkpoint.write_file_atomic = lambda path, data: os.kill(os.getpid(), signal.SIGKILL)
    dcp.save(model, opt, dcp.tmp_folder(root, 4), 0, 1, {{"scaler": {{}}, "step": 4}})
""")


def test_a_writer_killed_mid_write_leaves_the_previous_checkpoint(s3):
    url, options = s3
    code = _KILLED_MID_WRITE.format(tests=os.path.dirname(__file__), url=f"{url}/killed", options=options)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    root = _root(s3, "killed")
    assert (root / "step_00000004" / "dcp" / ".metadata").exists()  # the killed write got that far
    assert not (root / "step_00000004" / "manifest.json").exists()
    path, state = checkpoint.load_latest(root)
    assert (path.name, state["step"]) == ("step_00000002", 2)


def test_an_unreachable_checkpoint_path_is_a_job_error(tmp_path, s3):
    job = tmp_path / "job.yaml"
    job.write_text("name: x\nmodel: mlp\n")
    _, options = s3
    closed = {**options, "endpoint_url": f"http://127.0.0.1:{free_port()}",
              "config_kwargs": {"connect_timeout": 2, "retries": {"max_attempts": 1}}}
    with pytest.raises(JobError) as err:
        load_job(job, ["checkpoint.path=s3://gearshift-test/x", "checkpoint.storage_options=" + json.dumps(closed)])
    assert "checkpoint.path" in str(err.value) and "cannot be written from here" in str(err.value)
    with pytest.raises(JobError) as err:
        load_job(job, ["checkpoint.path=s3://no-such-bucket/x", "checkpoint.storage_options=" + json.dumps(options)])
    assert "cannot be written from here" in str(err.value)
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(JobError, match="checkpoint.path"):
        load_job(job, [f"checkpoint.path={tmp_path / 'file' / 'sub'}"])


@pytest.mark.slow
def test_a_run_checkpoints_to_the_object_store_and_resumes_under_another_layout(local_workers, tmp_path, s3):
    url, options = s3
    where = ["checkpoint.path=" + url + "/runs", "checkpoint.storage_options=" + json.dumps(options),
             "checkpoint.every=3", "optimizer.name=adam"]
    first = MLP[1] + where + ["train.steps=6", "cluster.num_workers=2"]
    summary = run_gearshift(MLP[0], first, tmp_path / "run")
    assert summary["status"] == "done"
    root = _root(s3, "runs/run")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000003", "step_00000006"]
    assert checkpoint.verify(root / "step_00000006")[0]["format"] == checkpoint.DCP_FORMAT  # auto: dcp, no gather
    assert not list((tmp_path / "run" / "checkpoints").iterdir())  # nothing in the run dir
    # continued to step 9 as fsdp(2): reads its slices of step 6 from the object store
    more = MLP[1] + where + ["train.steps=9", "cluster.num_workers=2", "parallel.strategy=fsdp"]
    summary = run_gearshift(MLP[0], more, tmp_path / "run", "--resume", str(tmp_path / "run"))
    assert summary["resumed_from_step"] == 6 and summary["strategy_history"][-1]["strategy"] == "fsdp"
    ref_state, _ = reference(load_job(MLP[0], MLP[1] + ["train.steps=9", "optimizer.name=adam"]))
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-4
    assert [p.name for p in checkpoint.list_checkpoints(root)][-1] == "step_00000009"


def test_a_full_format_run_streams_its_state_into_the_object_store(local_workers, tmp_path, s3):
    """checkpoint.format full with checkpoint.path in the store: rank 0 uploads the state.pt it
    wrote as the ranks gathered it (fsdp: every rank takes part in each gather), the driver's
    manifest makes it a checkpoint, and final.pt read back from it equals plain PyTorch."""
    url, options = s3
    where = ["checkpoint.path=" + url + "/full-runs", "checkpoint.storage_options=" + json.dumps(options),
             "checkpoint.every=3", "checkpoint.format=full", "optimizer.name=adam", "cluster.num_workers=2",
             "parallel.strategy=fsdp", "train.steps=3"]
    summary = run_gearshift(MLP[0], MLP[1] + where, tmp_path / "run")
    assert summary["status"] == "done"
    root = _root(s3, "full-runs/run")
    assert [p.name for p in checkpoint.list_checkpoints(root)] == ["step_00000003"]
    manifest, _ = checkpoint.verify(root / "step_00000003")
    assert manifest["format"] == checkpoint.FORMAT and list(manifest["files"]) == ["state.pt"]
    ref_state, _ = reference(load_job(MLP[0], MLP[1] + ["train.steps=3", "optimizer.name=adam"]))
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-4


def test_a_place_a_worker_cannot_reach_says_why_where_auto_falls_back_to_full(process_group, s3):
    """checkpoint.format auto, credentials the store refuses: this rank cannot write shards there,
    so the full format is taken, and what the store said travels with it to the start line."""
    url, options = s3
    root, why = dcp.root_for(f"{url}/refused", "auto", torch.device("cpu"),
                             {**options, "endpoint_url": f"http://127.0.0.1:{free_port()}"})  # no server there
    assert root is None and why and ("Error" in why or "error" in why), why
    reached, none = dcp.root_for(f"{url}/reached", "auto", torch.device("cpu"), options)
    assert reached is not None and none is None
