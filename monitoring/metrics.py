"""Prometheus metrics: an optional /metrics endpoint served by the controller, and the same
figures per worker through Ray's metrics API (they show on Ray's own Prometheus endpoint and
dashboard, prefixed `ray_` there).

Both are fed from telemetry records, off the hot path: the controller updates its gauges as it
merges step records; a worker updates its Ray gauges once per report (about twice a second).
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("gearshift")

# name -> (help, extra labels beyond "job"). Per-rank figures are labelled with the rank.
RUN_GAUGES = {
    "gearshift_step": ("optimizer steps completed", ()),
    "gearshift_loss": ("loss over the global batch at the last step", ()),
    "gearshift_samples_per_second": ("global batch / step time of the slowest rank", ()),
    "gearshift_tokens_per_second": ("samples per second x tokens per sample (sequence models)", ()),
    "gearshift_comm_wait_fraction_mean": ("comm wait / step time, mean over ranks", ()),
    "gearshift_bucket_cap_mb": ("DDP gradient bucket size in force", ()),
    "gearshift_eval_loss": ("mean loss over the held-out data (eval.data) at the last evaluation", ()),
    "gearshift_eval_step": ("the step of the last evaluation", ()),
    "gearshift_strategy_info": ("the layout in force (value 1)", ("strategy", "dp", "tp")),
    "gearshift_world_size": ("workers training at the last step (elastic runs shrink and grow)", ()),
}
RANK_GAUGES = {
    "gearshift_step_time_seconds": ("wall time of this rank's last step", ("rank",)),
    "gearshift_data_time_seconds": ("time loading the batch in this rank's last step", ("rank",)),
    "gearshift_comm_wait_seconds": ("time blocked on collectives in this rank's last step", ("rank",)),
    "gearshift_comm_wait_fraction": ("comm wait / step time of this rank's last step", ("rank",)),
    "gearshift_rank_share_samples": ("this rank's samples of the global batch (its data-parallel replica's share; "
                                     "adapt.stragglers moves them to match the speeds)", ("rank",)),
    "gearshift_rank_speed_samples_per_second": ("this rank's samples over its compute time in its last step",
                                                ("rank",)),
    "gearshift_device_utilization_percent": ("GPU utilisation (nvml) or worker CPU % (psutil)", ("rank", "source")),
    "gearshift_device_memory_used_bytes": ("GPU memory used (nvml) or worker resident memory (psutil)",
                                           ("rank", "source")),
    "gearshift_device_memory_total_bytes": ("GPU memory total (nvml) or host memory (psutil)", ("rank", "source")),
    "gearshift_device_power_watts": ("GPU board power (nvml only)", ("rank", "source")),
}
COUNTERS = {
    "gearshift_checkpoints": ("checkpoints written", ()),
    "gearshift_decisions": ("automatic decisions taken", ("decision",)),
    "gearshift_switches": ("layout switches carried out", ()),
    "gearshift_grad_anomalies": ("gradient anomalies train.grad_check found", ("module", "kind")),
    "gearshift_resizes": ("elastic resizes (from_checkpoint: true when the run restarted to do it)",
                          ("from_checkpoint",)),
}
_RANK_FIELDS = {"step_time": "gearshift_step_time_seconds", "data_time": "gearshift_data_time_seconds",
                "comm_wait": "gearshift_comm_wait_seconds", "comm_wait_frac": "gearshift_comm_wait_fraction",
                "share": "gearshift_rank_share_samples", "speed": "gearshift_rank_speed_samples_per_second"}
_SAMPLE_FIELDS = {"util_pct": "gearshift_device_utilization_percent",
                  "mem_used_bytes": "gearshift_device_memory_used_bytes",
                  "mem_total_bytes": "gearshift_device_memory_total_bytes", "power_w": "gearshift_device_power_watts"}


class MetricsEndpoint:
    """The controller's own /metrics, on `host:port` (port 0: a free one). Its registry holds
    only gearshift's metrics, so a scrape is small and says nothing about the Python process."""

    def __init__(self, job_name: str, host: str = "127.0.0.1", port: int = 0):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        self.job = job_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.gauges = {name: Gauge(name, text, ("job", *labels), registry=self.registry)
                       for name, (text, labels) in {**RUN_GAUGES, **RANK_GAUGES}.items()}
        self.counters = {name: Counter(name, text, ("job", *labels), registry=self.registry)
                         for name, (text, labels) in COUNTERS.items()}
        self._strategy: tuple | None = None
        self._world = 0
        self._sources: dict[int, set] = {}  # rank -> the sample sources it reported (to drop them)
        try:
            self.server, self.thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as err:
            raise OSError(f"cannot serve /metrics on {host}:{port}: {err.strerror or err}") from None
        self.host, self.port = host, self.server.server_port
        self.url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{self.port}/metrics"

    def observe(self, record: dict) -> None:
        kind = record.get("type")
        if kind == "step":
            self._step(record)
        elif kind == "eval":
            self.gauges["gearshift_eval_loss"].labels(self.job).set(record["loss"])
            self.gauges["gearshift_eval_step"].labels(self.job).set(record["step"])
        elif kind == "sample":
            source = record.get("source", "")
            self._sources.setdefault(int(record["rank"]), set()).add(source)
            for field, name in _SAMPLE_FIELDS.items():
                if record.get(field) is not None:
                    self.gauges[name].labels(self.job, str(record["rank"]), source).set(record[field])
        elif kind == "event":
            event = record.get("event")
            if event == "checkpoint":
                self.counters["gearshift_checkpoints"].labels(self.job).inc()
            elif event == "decision":
                self.counters["gearshift_decisions"].labels(self.job, str(record.get("decision", ""))).inc()
            elif event == "switch":
                self.counters["gearshift_switches"].labels(self.job).inc()
            elif event == "grad_anomaly":
                self.counters["gearshift_grad_anomalies"].labels(self.job, str(record.get("module")),
                                                                 str(record.get("kind"))).inc()
            elif event == "resize":
                self.counters["gearshift_resizes"].labels(self.job, str(record.get("from_checkpoint")).lower()).inc()

    def _step(self, r: dict) -> None:
        g, job = self.gauges, self.job
        g["gearshift_step"].labels(job).set(r["step"])
        g["gearshift_loss"].labels(job).set(r["loss"])
        g["gearshift_samples_per_second"].labels(job).set(r["samples_per_s"])
        if r.get("tokens_per_s") is not None:
            g["gearshift_tokens_per_second"].labels(job).set(r["tokens_per_s"])
        if r.get("comm_wait_frac_mean") is not None:
            g["gearshift_comm_wait_fraction_mean"].labels(job).set(r["comm_wait_frac_mean"])
        g["gearshift_bucket_cap_mb"].labels(job).set(r["bucket_cap_mb"])
        strategy = (r["strategy"], str(r["dp"]), str(r["tp"]))
        if strategy != self._strategy:  # exactly one layout series is 1 at a time
            if self._strategy is not None:
                g["gearshift_strategy_info"].remove(job, *self._strategy)
            g["gearshift_strategy_info"].labels(job, *strategy).set(1)
            self._strategy = strategy
        self._world_is(r["dp"] * r["tp"])
        for field, name in _RANK_FIELDS.items():
            for rank, value in enumerate(r["ranks"].get(field) or []):
                if value is not None:
                    g[name].labels(job, str(rank)).set(value)

    def _world_is(self, world: int) -> None:
        """The world size gauge; after a shrink the series of the ranks that are gone are dropped
        (a scrape would otherwise go on showing their last figures)."""
        self.gauges["gearshift_world_size"].labels(self.job).set(world)
        for rank in range(world, self._world):
            for name in _RANK_FIELDS.values():
                with contextlib.suppress(KeyError):
                    self.gauges[name].remove(self.job, str(rank))
            for source in self._sources.pop(rank, ()):
                for name in _SAMPLE_FIELDS.values():
                    with contextlib.suppress(KeyError):
                        self.gauges[name].remove(self.job, str(rank), source)
        self._world = world

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


class RayMetrics:
    """One worker's figures through ray.util.metrics, tagged with the job and rank."""

    def __init__(self, job_name: str, rank: int):
        from ray.util.metrics import Gauge

        self.tags = {"job": job_name, "rank": str(rank)}
        self.gauges = {name: Gauge(name, text, tag_keys=("job", *labels))
                       for name, (text, labels) in RANK_GAUGES.items()}

    @classmethod
    def create(cls, job_name: str, rank: int) -> RayMetrics | None:
        """None outside a Ray worker (a worker class used directly, as in the benchmarks)."""
        try:
            import ray

            if not ray.is_initialized():
                return None
            return cls(job_name, rank)
        except Exception as err:  # metrics must never stop training
            log.warning("Ray metrics unavailable on rank %s: %s", rank, err)
            return None

    def update(self, report: dict) -> None:
        """Figures of the report's last step, and its latest device reading."""
        if not report.get("step_times"):
            return
        step_time, wait = report["step_times"][-1], report["comm_waits"][-1]
        figures = {"gearshift_step_time_seconds": step_time, "gearshift_data_time_seconds": report["data_times"][-1],
                   "gearshift_comm_wait_seconds": wait,
                   "gearshift_comm_wait_fraction": wait / step_time if step_time > 0 else 0.0}
        for name, value in figures.items():
            self.gauges[name].set(value, tags=self.tags)
        for sample in report.get("samples", [])[-1:]:
            tags = {**self.tags, "source": sample["source"]}
            for field, name in _SAMPLE_FIELDS.items():
                if sample.get(field) is not None:
                    self.gauges[name].set(sample[field], tags=tags)
