"""Precision modes, progress output and a worker that fails, on a real Ray cluster."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

from orchestrator import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
pytestmark = [pytest.mark.ray]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_with_fp32_master_weights(ray_cluster, tmp_path, precision, capsys):
    code = cli.main(["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(tmp_path / "run"),
                     "--set", f"train.precision={precision}", "--set", "train.steps=30",
                     "--set", "train.log_every=10", "--set", "checkpoint.every=0"])
    assert code == 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["final_loss"] < 0.9 * summary["first_loss"], summary
    final = torch.load(tmp_path / "run/final.pt", weights_only=True)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in final.values())
    err = capsys.readouterr().err
    assert "step 30/30  loss" in err and "samples/s" in err and "ETA" in err


def test_an_exception_in_user_code_ends_the_run_with_one_paragraph(ray_cluster, tmp_path, capsys):
    shutil.copy(FIXTURES / "user_model.py", tmp_path / "user_model.py")
    (tmp_path / "job.yaml").write_text(
        "model: {entrypoint: 'user_model:flaky', kwargs: {fail_on: 3}}\ndata: 'user_model:waves'\nloss: mse\n"
        "train: {steps: 10, global_batch_size: 8}\n")
    code = cli.main(["run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED
    assert "Training failed in worker rank" in err and "ValueError: bad activation on call 3" in err
    assert "Traceback" not in err
    assert "user_model.py" in (tmp_path / "run/gearshift.log").read_text()  # the traceback is kept for the user
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["status"] == "failed"

    import psutil
    import ray
    from ray.util import placement_group_table

    from conftest import wait_until

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    assert wait_until(lambda: ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"))

    def worker_processes():
        return [p for p in psutil.process_iter(["cmdline"]) if "ray::TrainWorker" in " ".join(p.info["cmdline"] or [])]

    assert wait_until(lambda: not worker_processes()), "no TrainWorker process may outlive a failed run"


def test_ctrl_c_stops_workers_and_ray_and_records_the_interruption(tmp_path):
    """The real command in its own process: SIGINT mid-run exits 130 within seconds, the summary
    says interrupted, the last checkpoint is intact and the embedded Ray is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_bad_input import _ray_daemons

    before = _ray_daemons()
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.cli", "run", str(ROOT / "examples/mlp.yaml"),
                             "--run-dir", str(run), "--set", "train.steps=100000", "--set", "checkpoint.every=20"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""})
    try:
        deadline = time.monotonic() + 90
        from workers import checkpoint

        while not checkpoint.list_checkpoints(run / "checkpoints"):  # a complete one, not a temp folder
            assert proc.poll() is None and time.monotonic() < deadline, "the run never reached a checkpoint"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == cli.EXIT_INTERRUPTED, out
    assert "interrupted" in out and "Traceback" not in out
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert checkpoint.load_latest(run / "checkpoints")[1]["step"] % 20 == 0
    deadline = time.monotonic() + 15
    while _ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (_ray_daemons() - before), "the embedded Ray must be shut down"
