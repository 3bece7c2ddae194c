"""Telemetry measured for real: comm wait against a known injected delay (plain gloo processes:
what must hold on any machine: the delay adds no collective, each wait lies within its step; how
much of the delay the wait shows is bench/comm_wait.py's figure), and the records a Ray run writes, checked
against the schema."""

from __future__ import annotations

import json
import pathlib
import statistics

import pytest

from gearshift.monitoring.schema import validate
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import job_from_dict
from process_workers import PooledGroup

ROOT = pathlib.Path(__file__).resolve().parents[1]
WARMUP = 5  # the first steps build DDP's buckets and warm the allocator


def measure(strategy: str, world: int, delay_ms: float, steps: int = 25, **parallel) -> list[dict]:
    """Per rank: median comm wait, median collectives per step and median step time (seconds)."""
    job = job_from_dict({
        "model": "mlp", "train": {"steps": steps, "global_batch_size": 64},
        "cluster": {"num_workers": world},
        # one gradient bucket: the whole injected delay falls after backward, none hides behind it
        "parallel": {"strategy": strategy, "bucket_cap_mb": 100, **parallel},
        "inject": {"comm_delay_ms": delay_ms}, "telemetry": {"ray_metrics": False, "sample_period_s": 0.5},
    }).to_dict()
    with PooledGroup(job, world, search_paths=[str(ROOT)]) as group:
        reports = group.call("train", steps, 0, 1000.0)
    out = []
    for per_rank in reports:
        flat = {k: [v for r in per_rank for v in r[k]][WARMUP:] for k in ("comm_waits", "comm_calls", "step_times")}
        out.append({"wait": statistics.median(flat["comm_waits"]), "calls": statistics.median(flat["comm_calls"]),
                    "step": statistics.median(flat["step_times"]),
                    "samples": [s for r in per_rank for s in r.get("samples", [])]})
    return out


def test_one_worker_runs_one_all_reduce_a_step_and_its_wait_lies_within_the_step():
    [rank0] = measure("data", 1, 0.0)
    assert rank0["calls"] == 1  # DDP still runs its (trivial) all-reduce through the hook
    # how little a 1-rank all-reduce waits is a figure (bench/comm_wait.py: lone_wait_over_step)
    assert 0 <= rank0["wait"] <= rank0["step"], rank0


@pytest.mark.parametrize("strategy,world,parallel", [
    ("data", 2, {}),
    ("tensor", 2, {}),
    ("hybrid", 4, {"tp_size": 2}),  # the forward all-reduce in each tp pair, and the dp averaging
], ids=["data", "tensor", "hybrid"])
def test_an_injected_delay_adds_no_collective_and_each_wait_lies_within_its_step(strategy, world, parallel):
    """The delay is injected around each collective, inside the timing: it adds no collective, the
    delayed run still counts its waits, and each wait lies within its step. How much of the delay
    the wait shows (0.75..1.25 of delay x collectives) is bench/comm_wait.py's figure: part of a
    delay can overlap other work (DDP's hook sleeps on gloo's thread while backward ends; a
    tensor-parallel collective's launch), so not even a lower bound holds on every machine."""
    delay_ms = 20.0
    base = measure(strategy, world, 0.0, steps=12, **parallel)
    slow = measure(strategy, world, delay_ms, steps=12, **parallel)
    for rank, (b, s) in enumerate(zip(base, slow)):
        assert s["calls"] == b["calls"] >= 1, (strategy, rank, b, s)  # the delay adds no collective
        for run in (b, s):
            assert 0 <= run["wait"] <= run["step"], (strategy, rank, run)
        assert s["wait"] > 0, (strategy, rank, s)


# A straggler (one rank computing longer) shows as the others' comm wait, not its own: a figure
# of how the machine schedules the ranks, measured side by side in bench/comm_wait.py
# (straggler_*: rank 0's wait rise / lag, rank 1's wait / lag).


def test_timing_leaves_the_arithmetic_alone():
    """The comm hook replaces DDP's built-in all-reduce: at a world size where dividing and
    multiplying by the reciprocal round differently (3), the result must still be bit for bit."""
    import torch

    finals = {}
    for enabled in (True, False):
        job = job_from_dict({"model": {"name": "mlp", "kwargs": {"hidden": 64}}, "train": {"steps": 6, "global_batch_size": 48},
                             "cluster": {"num_workers": 3}, "telemetry": {"enabled": enabled, "ray_metrics": False}}).to_dict()
        with PooledGroup(job, 3, search_paths=[str(ROOT)]) as group:
            group.call("train", 6, 0, 1000.0)
            finals[enabled] = group.call("state")[0]["model"]
    assert all(torch.equal(finals[True][k], finals[False][k]) for k in finals[False])


def test_workers_report_device_samples():
    [rank0] = measure("data", 1, 0.0, steps=1000)  # a few seconds: several 0.5 s samples
    assert rank0["samples"], "no device samples arrived with the reports"
    for sample in rank0["samples"]:
        assert sample["source"] == "psutil" and sample["rank"] == 0  # no NVIDIA GPU here
        assert validate(sample) == []


@pytest.mark.ray
def test_a_ray_run_writes_conforming_telemetry(ray_cluster, tmp_path):
    run = tmp_path / "run"
    args = ["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run), "--set", "train.steps=8",
            "--set", "train.global_batch_size=8", "--set", "checkpoint.every=4", "--set", "telemetry.sample_period_s=0.2",
            "--set", "model.kwargs={vocab_size: 128, block_size: 32, n_layer: 1, n_head: 2, n_embd: 32}"]
    assert cli.main(args) == 0
    records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
    assert [p for r in records for p in validate(r)] == []
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 9))
    last = steps[-1]
    assert last["strategy"] == "data" and last["dp"] == 2 and last["comm_calls"] >= 1
    assert last["tokens_per_s"] == pytest.approx(last["samples_per_s"] * 32)  # block_size tokens per sample
    for r in steps:  # the parts add up: waiting never exceeds the step, compute is what is left
        assert all(0 <= w <= t for w, t in zip(r["ranks"]["comm_wait"], r["ranks"]["step_time"]))
        assert all(c >= 0 for c in r["ranks"]["compute_time"])
    events = {r["event"] for r in records if r["type"] == "event"}
    assert {"state", "sampler", "checkpoint"} <= events
    samplers = [r for r in records if r.get("event") == "sampler"]
    assert sorted(r["rank"] for r in samplers) == [0, 1] and {r["source"] for r in samplers} == {"psutil"}


def test_the_docs_describe_every_schema_field_and_event():
    from gearshift.monitoring import schema

    text = (ROOT / "docs/telemetry.md").read_text()
    names = [*schema.COMMON, *schema.STEP, *schema.SAMPLE, *schema.EVAL, *schema.EVENT, *schema.EVENTS]
    assert [n for n in names if f"`{n}`" not in text] == []


def test_log_echo_throttles_steps_but_never_drops_the_last_one_before_an_event():
    import io

    from gearshift.monitoring.telemetry import LOG_PREFIX, LogEcho

    out = io.StringIO()
    echo = LogEcho(every_s=3600, stream=out)
    echo.observe({"type": "step", "step": 1})  # the first goes out
    for step in range(2, 50):
        echo.observe({"type": "sample", "rank": 0, "util_pct": step})
        echo.observe({"type": "step", "step": step})
    echo.observe({"type": "event", "event": "state", "state": "done"})
    lines = out.getvalue().splitlines()
    assert all(line.startswith(LOG_PREFIX) for line in lines)
    got = [json.loads(line[len(LOG_PREFIX):]) for line in lines]
    assert [(r["type"], r.get("step"), r.get("util_pct")) for r in got] == [
        ("step", 1, None), ("sample", None, 49), ("step", 49, None), ("event", None, None)]


def test_logs_leave_out_telemetry_lines_even_split_across_chunks():
    import io

    from gearshift.orchestrator.cluster.jobs_api import _WithoutTelemetry

    out = io.StringIO()
    w = _WithoutTelemetry(out)
    for chunk in ["step 1/2 loss 1.0\n@gearshift-tel", 'emetry {"type": "step"}\nstep 2/2', " loss 0.5\n",
                  "no newline at the end"]:
        w.write(chunk)
    w.flush()
    assert out.getvalue() == "step 1/2 loss 1.0\nstep 2/2 loss 0.5\nno newline at the end"


@pytest.mark.ray
def test_workers_export_ray_metrics_to_rays_prometheus_endpoint(ray_cluster, tmp_path):
    """While a run trains, Ray's own /metrics carries every worker's gearshift gauges."""
    import threading
    import urllib.request

    import ray
    from prometheus_client.parser import text_string_to_metric_families

    from gearshift.orchestrator.control.controller import Controller
    from gearshift.orchestrator.job import load_job
    from gearshift.orchestrator.records.rundir import RunDir
    from gearshift.orchestrator.cluster.worker_group import RayWorkerGroup
    from conftest import wait_until

    node = ray._private.worker._global_node
    url = f"http://{node.node_ip_address}:{node.metrics_export_port}/metrics"
    job = load_job(ROOT / "examples/mlp.yaml", ["name=raymetrics", "train.steps=100000", "checkpoint.every=0",
                                                "model.kwargs={hidden: 32}", "telemetry.sample_period_s=0.2"])
    controller = Controller(job, RunDir.create(job, str(tmp_path / "run")), lambda j: RayWorkerGroup(j, False))
    stop = threading.Event()
    outcome = {}

    def train():
        try:
            outcome["summary"] = controller.run()
        except BaseException as err:  # the KeyboardInterrupt that stops it below
            outcome["error"] = err

    # the run is stopped from inside: the group's report stream raises once the test has seen enough
    original_train = RayWorkerGroup.train

    def stoppable(self, *args, **kwargs):
        for item in original_train(self, *args, **kwargs):
            if stop.is_set():
                raise KeyboardInterrupt("test done")
            yield item

    RayWorkerGroup.train = stoppable
    thread = threading.Thread(target=train, daemon=True)
    try:
        thread.start()
        found: dict = {}

        def scraped() -> bool:
            text = urllib.request.urlopen(url, timeout=5).read().decode()
            for family in text_string_to_metric_families(text):
                for s in family.samples:
                    if s.name.startswith("ray_gearshift_") and s.labels.get("job") == "raymetrics":
                        found[(s.name, s.labels["rank"])] = s.value
            return {(name, r) for r in "01" for name in ("ray_gearshift_step_time_seconds",
                                                         "ray_gearshift_device_utilization_percent")} <= set(found)

        assert wait_until(scraped, timeout_s=60, interval_s=1.0), f"gearshift gauges not on {url}: {found}"
    finally:
        stop.set()
        thread.join(timeout=120)
        RayWorkerGroup.train = original_train
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), KeyboardInterrupt), outcome
    assert 0 < found[("ray_gearshift_step_time_seconds", "0")] < 5
    assert 0 <= found[("ray_gearshift_comm_wait_fraction", "1")] <= 1
    assert found[("ray_gearshift_device_utilization_percent", "0")] >= 0


def test_the_sink_flushes_step_records_by_count_and_by_time(tmp_path, monkeypatch):
    from gearshift.monitoring import telemetry

    now = [100.0]
    monkeypatch.setattr(telemetry.time, "monotonic", lambda: now[0])
    sink = telemetry.JsonlSink(tmp_path / "t.jsonl", flush_every=3, flush_s=1.0)
    seen = lambda: (tmp_path / "t.jsonl").read_text().count("\n")
    sink.write({"type": "step", "step": 1})
    sink.write({"type": "step", "step": 2})
    assert seen() == 0  # buffered
    sink.write({"type": "step", "step": 3})
    assert seen() == 3  # the third record flushes
    sink.write({"type": "step", "step": 4})
    assert seen() == 3
    now[0] += 1.5  # a slow step: a reader still sees it within flush_s
    sink.write({"type": "step", "step": 5})
    assert seen() == 5
    sink.event("switch", step=5)
    assert seen() == 6  # events go out at once
    sink.close()
