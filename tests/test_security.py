"""What gearshift never does: run code from a job file, load a checkpoint as code, serve metrics
beyond this host unless told, or start Ray without token authentication."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from gearshift.orchestrator.job import JobError, load_job

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_a_job_file_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    job = tmp_path / "job.yaml"
    job.write_text(f'model: !!python/object/apply:os.system ["touch {marker}"]\n')
    with pytest.raises(JobError):
        load_job(job)
    assert not marker.exists()


def test_the_metrics_endpoint_binds_localhost_unless_told():
    job = load_job(ROOT / "examples" / "mlp.yaml", ["telemetry.metrics_port=0"])
    assert job.telemetry.metrics_host == "127.0.0.1"


def test_checkpoints_refuse_pickled_code(tmp_path):
    import torch

    from gearshift.workers.state import checkpoint

    class Evil:
        def __reduce__(self):
            return (print, ("code ran",))

    path = checkpoint.save(tmp_path, 1, {"model": {}, "step": 1, "x": Evil()}, keep=2)
    with pytest.raises(Exception, match="[Ww]eights only|Unsupported global|weights_only"):
        torch.load(path / "state.pt", weights_only=True)
    assert checkpoint.load_latest(tmp_path) is None  # not loadable as data: never used


@pytest.mark.slow
def test_the_ray_gearshift_starts_keeps_token_authentication_on():
    code = ("from gearshift.orchestrator.cluster.worker_group import ray_session\n"
            "from ray._private.authentication.authentication_utils import is_token_auth_enabled\n"
            "with ray_session(None, num_cpus=1):\n"
            "    print('token auth', is_token_auth_enabled())\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "token auth True" in done.stdout
