"""On an NVIDIA GPU: the worker picks NCCL and CUDA, and still matches the CPU reference.

These run the TrainWorker in-process (world size 1, no Ray), so they need only torch and a GPU.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from conftest import free_port
from gearshift.orchestrator.job import load_job
from gearshift.workers.worker import TrainWorker, WorkerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.gpu


def train_on_gpu(job):
    worker = TrainWorker(WorkerConfig.from_job(job.to_dict(), [job.base_dir]))
    try:
        assert worker.setup(0, 1, "127.0.0.1", free_port(), 60) == "nccl"
        worker.build()
        reports = list(worker.train(job.train.steps))
        return worker.state()["model"], [loss for r in reports for loss in r["losses"]]
    finally:
        worker.shutdown()


def test_gpu_worker_uses_nccl_and_matches_the_cpu_reference():
    from test_train_equivalence import MLP, reference

    job = load_job(MLP[0], MLP[1] + ["cluster.num_workers=1", "cluster.gpus_per_worker=1"])
    state, losses = train_on_gpu(job)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_state, ref_losses = reference(job)
    diff = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    # CUDA and CPU kernels sum in different orders; 1e-4 allows that, not a wrong update
    assert diff <= 1e-4, diff
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-4


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_gpu_mixed_precision_trains(precision):
    job = load_job(ROOT / "examples/gpt.yaml", ["train.steps=30", "cluster.num_workers=1", "cluster.gpus_per_worker=1",
                                                 f"train.precision={precision}"])
    state, losses = train_on_gpu(job)
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in state.values())
    assert sum(losses[-5:]) / 5 < 0.8 * losses[0]


def test_gpu_tensor_layout_shards_with_dtensor_and_matches_the_reference():
    """One GPU can hold a tensor-parallel group of one: the DTensor path on CUDA and NCCL."""
    from test_train_equivalence import GPT, max_diff, reference

    job = load_job(GPT[0], GPT[1] + ["cluster.num_workers=1", "cluster.gpus_per_worker=1", "parallel.strategy=tensor"])
    state, losses = train_on_gpu(job)
    torch.backends.cuda.matmul.allow_tf32 = False
    ref_state, ref_losses = reference(job)
    assert max_diff(state, ref_state) <= 1e-4
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-4


def test_gpu_telemetry_reads_nvml_and_times_with_cuda_events():
    """The NVML sampler on a real GPU, and comm wait timed with CUDA events under NCCL: an
    injected delay on the one gradient bucket must show up in the measured wait."""
    import statistics

    from gearshift.monitoring.schema import validate

    delay_ms = 5.0
    job = load_job(ROOT / "examples/mlp.yaml", ["cluster.num_workers=1", "cluster.gpus_per_worker=1",
                                                "train.steps=300", "telemetry.sample_period_s=0.2",
                                                f"inject.comm_delay_ms={delay_ms}", "parallel.bucket_cap_mb=100"])
    worker = TrainWorker(WorkerConfig.from_job(job.to_dict(), [job.base_dir]))
    worker.member.gpu_ids = ["0"]  # what Ray would hand the worker; NVML counts physical devices
    try:
        worker.setup(0, 1, "127.0.0.1", free_port(), 60)
        info = worker.build()
        assert info["sampler"]["source"] == "nvml", info["sampler"]
        reports = list(worker.train(job.train.steps, 0, 0.2))
    finally:
        worker.shutdown()
    samples = [dict(s, rank=0, node_ip="127.0.0.1") for r in reports for s in r.get("samples", [])]
    assert samples and all(validate(s) == [] and s["source"] == "nvml" for s in samples)
    assert all(s["mem_total_bytes"] > 2**30 and 0 <= s["util_pct"] <= 100 for s in samples)
    waits = [w for r in reports for w in r["comm_waits"]][10:]
    times = [t for r in reports for t in r["step_times"]][10:]
    assert all(0 <= w <= t * 1.05 for w, t in zip(waits, times))
    assert statistics.median(waits) >= 0.5 * delay_ms / 1000, statistics.median(waits)
    assert all(r["peak_mem_bytes"] > 0 for r in reports)
