"""What a worker measures besides the step itself: device samples on a background thread,
Ray metrics, peak memory, and turning a report's comm-clock spans into seconds."""

from __future__ import annotations

import time

import torch

from gearshift.monitoring.comm import CommClock
from gearshift.monitoring.host_memory import process_peak
from gearshift.workers.config import WorkerConfig


class WorkerTelemetry:
    def __init__(self, config: WorkerConfig, device: torch.device):
        self.config, self.device = config, device
        self.sampler = None  # the device-sampling thread
        self.ray_metrics = None
        self.rank, self.node_ip = 0, "127.0.0.1"
        self.extras_at = float("-inf")  # when device samples and Ray metrics last went out

    def start(self, rank: int, node_ip: str, gpu_ids: list[str]) -> dict | None:
        """Start device sampling; what it reads and why, for the telemetry."""
        cfg = self.config
        self.rank, self.node_ip = rank, node_ip
        if not cfg.telemetry or self.sampler is not None:
            return None
        from gearshift.monitoring.devices import SamplerThread, make_sampler

        sampler, reason = make_sampler(gpu_ids)
        self.sampler = SamplerThread(sampler, cfg.sample_period_s)
        self.sampler.start()
        if cfg.ray_metrics:
            from gearshift.monitoring.metrics import RayMetrics

            self.ray_metrics = RayMetrics.create(cfg.name, rank)
        return {"source": sampler.source, "reason": reason}

    def peak_memory(self) -> int | None:
        """Peak memory since the last report: device memory on GPU; on CPU the process's peak
        resident set over the same window (monitoring/host_memory.py: the lifetime peak where the
        kernel's mark cannot be reset)."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(peak)
        return process_peak().take()

    EXTRAS_S = 0.5  # device samples and Ray metrics go out at most this often, however often reports do

    def add_timings(self, report: dict, spans: list, cuda: bool) -> None:
        """Per-step data time, comm wait and collective count, peak memory, and (every EXTRAS_S
        seconds) device samples and Ray metrics: under `auto` every step is reported as it ends.
        On CUDA this is where the step's events are read, once per report, not per step."""
        if cuda:  # device time, not the host's (which runs ahead of the device)
            spans[-1][0][1].synchronize()  # every event of the report is on this stream, before it
            report["step_times"] = [a.elapsed_time(b) / 1000.0 for (a, b), _, _ in spans]
        report["data_times"] = [b - a if not cuda else a.elapsed_time(b) / 1000.0 for _, (a, b), _ in spans]
        report["comm_waits"] = [CommClock.resolve(taken[0]) for _, _, taken in spans]
        report["comm_calls"] = [taken[1] for _, _, taken in spans]
        report["comm_hidden"] = [taken[2] for _, _, taken in spans]
        report["pipe_waits"] = [taken[3] for _, _, taken in spans]
        report["peak_mem_bytes"] = self.peak_memory()
        now = time.monotonic()
        if now - self.extras_at < self.EXTRAS_S:
            return
        self.extras_at = now
        if self.sampler is not None:
            report["samples"] = [dict(s, rank=self.rank, node_ip=self.node_ip) for s in self.sampler.drain()]
        if self.ray_metrics is not None:
            self.ray_metrics.update(report)

    def stop(self) -> None:
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
