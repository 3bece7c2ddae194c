"""The controller's state machine with a stand-in worker group: no Ray, no processes."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from gearshift.monitoring.schema import validate
from gearshift.monitoring.telemetry import read
from gearshift.orchestrator.control.controller import Controller
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import load_job
from gearshift.orchestrator.control.reporting import StepMerger
from gearshift.orchestrator.records.rundir import RunDir
from gearshift.strategies.layout import Layout
from gearshift.orchestrator.cluster.worker_group import WorkerGroup
from gearshift.workers.state import checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]


class FakeGroup:
    """Two ranks whose 'training' adds 1 to a weight per step; rank 1 reports in odd-sized batches
    so the controller has to merge reports that do not line up."""

    def __init__(self, job, fail_at: int | None = None, run=None, scrape_at: int | None = None):
        self.job, self.fail_at = job, fail_at
        self.run, self.scrape_at, self.scraped = run, scrape_at, None
        self.w = torch.zeros(2)
        self.step = 0
        self.shut = False
        self.loaded = None
        self.reshards: list = []
        self.shares = None  # set_shares: each rank's samples (rank 1 computes each at half rank 0's speed)
        self.share_calls: list = []
        self.world = 2
        self.slow = 0.015  # rank 1's compute time a step on an even share (rank 0's: 8 ms)

    def start(self):
        return [{"rank": r, "node_ip": "127.0.0.1", "pid": 1, "backend": "gloo", "parameters": 2} for r in range(2)]

    def put(self, value):
        return value

    def call(self, method, *args):
        if method == "checkpoint":  # full format: rank 0 sends the state, the others nothing
            return [{"checkpoint": self.call_rank(0, "state")}, {}]
        if method == "reshard":  # reshard(layout dict, bucket_cap_mb or None), recorded as (step, strategy, tp[, bucket])
            layout, bucket = args
            self.reshards.append((self.step, layout["strategy"], layout["tp"], *([bucket] if bucket is not None else [])))
            return [{"seconds": 0.01 * (r + 1), "step": self.step} for r in range(2)]
        if method == "evaluate":  # evaluate(batches): a held-out loss lowest at step 8, the same on every rank
            self.evaluated = getattr(self, "evaluated", []) + [(self.step, args[0])]
            return [{"loss": abs(self.step - 8) + 1.0, "samples": 64, "batches": 2, "token_targets": False}] * 2
        if method == "write_final":  # (folder, target, token): these workers never see the run's folder
            return [{"written": False}, {}]
        if method == "set_shares":
            self.shares = args[0]
            self.share_calls.append((self.step, args[0]))
            return [{"shares": args[0], "accumulation": 1}] * 2
        assert method == "load"
        self.loaded = state = args[0]
        if "full" in state:  # a full-format checkpoint by reference: a worker maps the file itself
            state = torch.load(state["full"], weights_only=True)
        self.step = state["step"]
        self.w = state["model"]["w"].clone()
        return [self.step, self.step]

    def call_rank(self, rank, method):
        assert (rank, method) == (0, "state")
        return {"model": {"w": self.w.clone()}, "step": self.step}

    def stop_early(self):  # the ranks agree to stop at the second boundary after the one being trained
        self.stop_at = self.step + 2
        self.stops = getattr(self, "stops", []) + [(self.step, self.stop_at)]

    def train(self, until, every, last_step=None, stoppable=False):
        last_step = last_step or until
        chunk = {0: 2, 1: 3}
        pending = {0: [], 1: []}
        self.stop_at = None
        for step in range(self.step, until):
            if self.fail_at is not None and step == self.fail_at:
                raise WorkerFailed(1, "ValueError: boom", details="Traceback: ... ValueError: boom")
            self.w += 1
            self.step = step + 1
            stopping = stoppable and self.stop_at is not None and self.step >= self.stop_at
            for rank in range(self.world):
                pending[rank].append(step)
                ckpt = every and self.step % every == 0 and self.step < last_step
                if len(pending[rank]) == chunk[rank] or self.step == until or ckpt or stopping or stoppable:
                    yield rank, self.report(rank, pending[rank], ckpt)
                    pending[rank] = []
            if self.scrape_at is not None and self.step == self.scrape_at:
                self.scraped = scrape(self.run)
            if stopping:
                break

    def report(self, rank, steps, ckpt):
        n = len(steps)
        even = self.job.train.global_batch_size / 2
        share = self.shares[rank] if self.shares else 2 * even / self.world
        # compute (the step less data and comm wait) 8 ms at rank 0 and 15 ms at rank 1 on even shares
        compute = share / even * (0.008 if rank == 0 else self.slow)
        report = {"rank": rank, "first_step": steps[0],
                  "losses": [10.0 - s - rank for s in steps],
                  "step_times": [compute + 0.001 + 0.001 * (1 + 3 * rank)] * n,
                  # rank 1 waits 4 ms of its 20 ms on collectives, rank 0 1 ms of 10
                  "data_times": [0.001] * n, "comm_waits": [0.001 * (1 + 3 * rank)] * n,
                  "comm_calls": [2] * n, "peak_mem_bytes": 1000 * (rank + 1),
                  "samples": [{"type": "sample", "time": 1.0, "rank": rank, "node_ip": "127.0.0.1",
                               "source": "psutil", "device": "cpu", "util_pct": 50.0 + rank,
                               "mem_used_bytes": 10, "mem_total_bytes": 100, "power_w": None,
                               "sm_clock_mhz": None, "host_cpu_pct": 70.0}]}
        if rank == 0 and ckpt:
            report["checkpoint"] = self.call_rank(0, "state")
        return report

    def dead_ranks(self):
        return {}

    def regroup(self):
        raise AssertionError("no step runs out of memory here")

    def shrink(self, keep, layout, behind=()):
        raise AssertionError("no worker is lost in memory here")

    def joinable(self):  # no new worker is ever placed
        return 0

    def joining(self, count):
        raise AssertionError("no worker joins here")

    def grow(self, count, layout):
        raise AssertionError("no worker joins here")

    def alive_node_ids(self):  # no nodes known: a failure is a worker loss
        return set()

    def alive_node_resources(self):
        return []

    def shutdown(self, polite=True):
        self.shut = "polite" if polite else "killed"


def scrape(run) -> dict:
    """Scrape the controller's /metrics (its URL is in the telemetry) and parse it as Prometheus does."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    url = next(r["url"] for r in read(run.telemetry) if r.get("event") == "metrics")
    assert url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {s.name + str(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def make(tmp_path, overrides, **group_kw):
    # the fake's rank 1 computes twice as long as rank 0: a straggler, left alone but where a test asks
    if not any(o.startswith("adapt.stragglers=") for o in overrides):
        overrides = [*overrides, "adapt.stragglers=off"]
    job = load_job(ROOT / "examples/mlp.yaml", overrides)
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    def factory(j):
        groups.append(FakeGroup(j, run=run, **group_kw))
        return groups[-1]

    return job, run, factory, groups


CONTEXT = {"strategy": "data", "dp": 2, "tp": 1, "bucket_cap_mb": 25.0}


def test_merger_releases_a_step_only_when_every_rank_reported():
    m = StepMerger(world=2, global_batch=8, context=CONTEXT)
    assert m.add(0, {"first_step": 0, "losses": [1.0, 2.0], "step_times": [0.1, 0.1]}) == []
    done = m.add(1, {"first_step": 0, "losses": [3.0], "step_times": [0.4]})
    assert [r["step"] for r in done] == [1]
    assert done[0]["loss"] == 2.0 and done[0]["slowest_rank"] == 1 and done[0]["samples_per_s"] == pytest.approx(20)
    # without timings (telemetry off) the timing fields are null and the record still conforms
    assert done[0]["comm_wait_mean"] is None and done[0]["ranks"]["comm_wait"] is None
    assert validate(done[0]) == []


def test_merger_aggregates_timings_over_ranks():
    m = StepMerger(world=2, global_batch=8, context=CONTEXT, tokens_per_sample=16)
    m.add(0, {"first_step": 0, "losses": [1.0], "step_times": [0.1], "data_times": [0.01], "comm_waits": [0.02],
              "comm_calls": [3], "peak_mem_bytes": 500})
    [r] = m.add(1, {"first_step": 0, "losses": [3.0], "step_times": [0.2], "data_times": [0.03],
                    "comm_waits": [0.1], "comm_calls": [3], "peak_mem_bytes": 900})
    assert validate(r) == []
    assert r["comm_wait_mean"] == pytest.approx(0.06) and r["comm_wait_max"] == pytest.approx(0.1)
    assert r["comm_wait_frac_mean"] == pytest.approx((0.2 + 0.5) / 2) and r["comm_wait_frac_max"] == pytest.approx(0.5)
    assert r["data_time_max"] == pytest.approx(0.03) and r["compute_time_mean"] == pytest.approx((0.07 + 0.07) / 2)
    assert r["ranks"]["samples_per_s"] == pytest.approx([40.0, 20.0])  # 4 samples per rank
    assert r["samples_per_s"] == pytest.approx(40.0) and r["tokens_per_s"] == pytest.approx(640.0)
    assert r["peak_mem_bytes"] == 900 and r["comm_calls"] == 3 and r["strategy"] == "data"


def test_every_record_of_a_run_conforms_to_the_schema(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=4"])
    Controller(job, run, factory).run()
    records = read(run.telemetry)
    assert {r["type"] for r in records} == {"step", "sample", "event"}
    assert [p for r in records for p in validate(r)] == []
    step = [r for r in records if r["type"] == "step"][-1]
    assert step["ranks"]["comm_wait_frac"] == pytest.approx([0.1, 0.2]) and step["slowest_rank"] == 1


def test_metrics_endpoint_serves_the_live_figures(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "telemetry.metrics_port=0"], scrape_at=6)
    Controller(job, run, factory).run()
    got = groups[0].scraped
    assert got is not None, "the endpoint was not reachable while the run trained"
    job_label = ("job", job.name)
    assert got["gearshift_step" + str([job_label])] >= 5
    assert got["gearshift_comm_wait_fraction" + str(sorted([job_label, ("rank", "1")]))] == pytest.approx(0.2)
    assert got["gearshift_device_utilization_percent" + str(sorted([job_label, ("rank", "0"), ("source", "psutil")]))] == 50.0
    assert got["gearshift_strategy_info" + str(sorted([job_label, ("strategy", "data"), ("dp", "2"), ("tp", "1")]))] == 1
    url = next(r["url"] for r in read(run.telemetry) if r.get("event") == "metrics")
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.URLError):  # the endpoint closes with the run
        urllib.request.urlopen(url, timeout=5)


def test_run_writes_checkpoints_final_and_summary(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=4", "checkpoint.keep=5"])
    summary = Controller(job, run, factory).run()
    assert summary["status"] == "done" and summary["steps_done"] == 10 and groups[0].shut == "polite"
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == [
        "step_00000004", "step_00000008", "step_00000010"]
    assert checkpoint.load(run.checkpoints / "step_00000008")["model"]["w"].tolist() == [8.0, 8.0]
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [10.0, 10.0]
    steps = [r for r in read(run.telemetry) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert steps[0]["loss"] == pytest.approx((10 + 9) / 2)  # mean of the two ranks' losses of step 0
    states = [r["state"] for r in read(run.telemetry) if r.get("event") == "state"]
    assert states == ["placing", "starting", "training", "finishing", "done"]
    assert json.loads(run.summary.read_text())["strategy_history"][0]["strategy"] == "data"


@pytest.mark.parametrize("setting,parameters,written", [("auto", 2, True), ("auto", 600_000_000, False),
                                                         ("none", 2, False), ("full", 600_000_000, True)])
def test_final_pt_is_written_as_checkpoint_final_says(tmp_path, setting, parameters, written):
    """auto: final.pt for a model under 2 GiB in fp32 (600M parameters are 2.2 GiB: not written, and
    the run says how to export); the final checkpoint is written either way."""
    from gearshift.orchestrator.control.checkpoints import final_wanted

    assert final_wanted(setting, parameters) is written
    job, run, factory, groups = make(tmp_path, ["train.steps=4", f"checkpoint.final={setting}"])
    real_start = FakeGroup.start
    FakeGroup.start = lambda self: [dict(i, parameters=parameters) for i in real_start(self)]
    said = []

    class View:  # the terminal: what the run says
        def say(self, text):
            said.append(text)

        def __getattr__(self, name):
            return lambda *a, **k: None

    try:
        summary = Controller(job, run, factory, view=View()).run()
    finally:
        FakeGroup.start = real_start
    assert summary["status"] == "done" and summary["final"] == (str(run.final) if written else None)
    assert run.final.is_file() is written
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == ["step_00000004"]
    told = [t for t in said if t.startswith("final.pt: not written")]
    assert len(told) == (0 if written else 1) and all(f"gearshift export {run.path}" in t for t in told), said


def test_resume_loads_the_state_into_the_workers(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=6"])
    state = {"model": {"w": torch.full((2,), 3.0)}, "step": 3}
    summary = Controller(job, run, factory, resume=("step_00000003", state)).run()
    assert groups[0].loaded is state and summary["resumed_from_step"] == 3
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [6.0, 6.0]


def test_a_failing_worker_ends_the_run_cleanly(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=10", "checkpoint.every=2"], fail_at=5)
    with pytest.raises(WorkerFailed, match="worker rank 1: ValueError: boom"):
        Controller(job, run, factory).run()
    assert groups[0].shut == "killed", "after a failure the group is killed, not asked"
    summary = json.loads(run.summary.read_text())
    assert summary["status"] == "failed" and "boom" in summary["error"] and summary["steps_done"] == 4  # step 5 never completed on every rank
    assert "Traceback" in run.log.read_text()
    assert not run.final.exists()
    assert checkpoint.load_latest(run.checkpoints)[1]["step"] == 4


def test_a_workers_error_leaves_the_runs_secrets_nowhere_in_the_run_dir_or_the_raised_error(tmp_path, monkeypatch):
    import secrets

    token, password = "tok-" + secrets.token_hex(8), "pw-" + secrets.token_hex(8)
    monkeypatch.setenv("GS_TOKEN", token)
    job, run, _, groups = make(tmp_path, ["train.steps=6", "checkpoint.every=2", "cluster.env.HF_TOKEN=${GS_TOKEN}"])
    said = f"ValueError: s3://me:{password}@minio/b refused token {token}"

    class Leaking(FakeGroup):  # rank 1's code raises an error that names them (fsspec's would)
        def train(self, until, every, last_step=None, stoppable=False):
            for item in super().train(until, every, last_step, stoppable):
                if self.step == 4:
                    raise WorkerFailed(1, said, details=f"Traceback (most recent call last): ...\n{said}",
                                       cause=ValueError(said))
                yield item

    def factory(j):
        groups.append(Leaking(j, run=run))
        return groups[-1]

    with pytest.raises(WorkerFailed) as failed:
        Controller(job, run, factory).run()
    raised = [str(failed.value), failed.value.details, failed.value.cause_text, repr(failed.value.cause)]
    files = [p for p in run.path.rglob("*") if p.is_file()]
    assert run.log in files and run.summary in files
    for secret in (token, password):
        assert not [t for t in raised if secret in t]
        assert [str(p) for p in files if secret.encode() in p.read_bytes()] == []
    assert "refused token ***" in json.loads(run.summary.read_text())["error"]


def test_forced_schedule_switches_at_its_steps_and_records_them(tmp_path):
    job, run, factory, groups = make(tmp_path, [
        "train.steps=10", "checkpoint.every=2", "checkpoint.keep=10",
        "adapt.schedule=[{step: 4, strategy: tensor}, {step: 7, strategy: hybrid, tp_size: 2}]"])
    summary = Controller(job, run, factory).run()
    assert groups[0].reshards == [(4, "tensor", 2), (7, "hybrid", 2)]
    # the chunk ending at a switch still writes its checkpoint
    assert [p.name for p in checkpoint.list_checkpoints(run.checkpoints)] == [
        f"step_{s:08d}" for s in (2, 4, 6, 8, 10)]
    records = read(run.telemetry)
    assert [p for r in records for p in validate(r)] == []
    layout_of = {r["step"]: (r["strategy"], r["dp"], r["tp"]) for r in records if r["type"] == "step"}
    assert layout_of[4] == ("data", 2, 1) and layout_of[5] == ("tensor", 1, 2) and layout_of[8] == ("hybrid", 1, 2)
    switches = [r for r in records if r.get("event") == "switch"]
    assert [(s["step"], s["to"]["strategy"], s["reason"]) for s in switches] == [(4, "tensor", "schedule"),
                                                                                  (7, "hybrid", "schedule")]
    assert switches[0]["seconds"] == pytest.approx(0.02)  # the slowest rank's time
    assert [h["strategy"] for h in summary["strategy_history"]] == ["data", "tensor", "hybrid"]
    states = [r["state"] for r in records if r.get("event") == "state"]
    assert states == ["placing", "starting", "training", "switching", "training", "switching", "training", "finishing",
                      "done"]


def test_a_resumed_run_continues_in_the_layout_its_schedule_had_in_force(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=8", "adapt.schedule=[{step: 3, strategy: tensor}]"])
    state = {"model": {"w": torch.full((2,), 5.0)}, "step": 5}
    summary = Controller(job, run, factory, resume=("step_00000005", state)).run()
    assert groups[0].reshards == [(5, "tensor", 2)]
    assert summary["strategy_history"][-1]["strategy"] == "tensor"


# ---- the worker-group protocol, recovery and the injected policy, with the stand-in group

def test_the_stand_in_group_is_a_worker_group(tmp_path):
    job, run, factory, groups = make(tmp_path, ["train.steps=2"])
    assert isinstance(factory(job), WorkerGroup)


def test_the_controller_leaves_ray_to_the_worker_group():
    import subprocess
    import sys

    code = ("import sys, gearshift.orchestrator.control.controller, gearshift.orchestrator.control.recovery, gearshift.orchestrator.control.bucket_tuning; "
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_lost_worker_is_restarted_from_the_latest_checkpoint_without_ray(tmp_path):
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=10", "checkpoint.every=2", "checkpoint.keep=10",
                                                "adapt.stragglers=off"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    class DyingGroup(FakeGroup):
        def train(self, until, every, last_step=None):
            for item in super().train(until, every, last_step):
                if len(groups) == 1 and self.step == 6:
                    raise WorkerFailed(1, "its process died", kind=WorkerFailed.DIED)
                yield item

    def factory(j):
        groups.append(DyingGroup(j, run=run))
        return groups[-1]

    summary = Controller(job, run, factory).run()
    assert summary["status"] == "done" and summary["steps_done"] == 10 and len(groups) == 2
    assert groups[0].shut == "killed" and groups[1].loaded["step"] == 4
    # a group that knows of no nodes makes it a worker loss: no node lost, no shrink
    [failure] = summary["failures"]
    assert failure["lost_nodes"] == [] and failure["restored_step"] == 4
    records = read(run.telemetry)
    assert [p for r in records for p in validate(r)] == []
    states = [r["state"] for r in records if r.get("event") == "state"]
    assert states == ["placing", "starting", "training", "placing", "starting", "training", "finishing", "done"]
    assert [r["event"] for r in records if r.get("event") in ("failure", "restored", "recovered")] == [
        "failure", "restored", "recovered"]
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [10.0, 10.0]


def test_the_policy_is_passed_in_and_told_of_the_switch_it_asked_for(tmp_path):
    from gearshift.orchestrator.policy.adaptive import KEEP, AdaptConfig, Switch
    from gearshift.strategies.layout import Layout

    made = []

    class AtStepFour:
        config = AdaptConfig()

        def __init__(self, job, layout, node_sizes, device_memory):
            self.candidates, self.told = [layout, Layout("tensor", 1, 2)], []
            made.append(self)

        def observe(self, record):
            return Switch(self.candidates[1], {"why": "test"}) if record["step"] == 4 else KEEP

        def next_decision(self, step):
            return step + 1

        def switched(self, to, step, seconds=None):  # the switch's measured time: the policy's switch cost
            self.told.append((str(to), step, seconds))

        def resume_at(self, step):
            raise AssertionError("no tuning in this run")

    job, run, factory, groups = make(tmp_path, ["train.steps=12", "parallel.strategy=auto"])
    summary = Controller(job, run, factory, policy_factory=AtStepFour).run()
    # seen in step 4's record, the workers asked to stop then, and they stop two steps on, in one
    # chunk (no chunk ends where the policy may decide)
    assert groups[0].stops == [(4, 6)]
    assert groups[0].reshards == [(6, "tensor", 2)]
    assert made[0].told == [("tensor dp=1 tp=2", 6, 0.02)]  # the slowest rank's reshard
    assert [(s["step"], s["reason"]) for s in summary["switches"]] == [(6, "switch")]
    [decision] = [r for r in read(run.telemetry) if r.get("event") == "decision"]
    assert (decision["decision"], decision["seen_step"], decision["applied_step"]) == ("switch", 4, 6)
    assert summary["steps_done"] == 12 and torch.load(run.final, weights_only=True)["w"].tolist() == [12.0, 12.0]
    [policy] = [r for r in read(run.telemetry) if r.get("event") == "policy"]
    assert policy["candidates"][1] == {"strategy": "tensor", "dp": 1, "tp": 2} and policy["decide"] == "predict"


# ---- what happens at a step boundary

def _layouts():
    from gearshift.strategies.layout import Layout

    return Layout("data", 2, 1), Layout("tensor", 1, 2)


def test_next_boundary_stops_when_the_steps_or_the_grid_are_done():
    from gearshift.orchestrator.control.boundary import next_boundary
    from gearshift.orchestrator.policy.adaptive import Switch

    data, tensor = _layouts()
    assert next_boundary(10, 10, tensor, Switch(tensor, {})).stop
    assert next_boundary(4, 10, None, None, tuning_over=True).stop
    assert not next_boundary(4, 10, None, None).stop


def test_next_boundary_puts_the_schedule_before_the_policy():
    from gearshift.orchestrator.control.boundary import Then, next_boundary
    from gearshift.orchestrator.policy.adaptive import Revert, Switch

    data, tensor = _layouts()
    b = next_boundary(4, 10, tensor, Switch(data, {"x": 1}), judged=True, tuning=True)
    assert (b.to, b.reason, b.evidence, b.scheduled) == (tensor, "schedule", None, True)
    assert b.abandon_tuning and b.tell_policy and b.then is Then.NOTHING  # the dropped decision is judged first
    # a revert in the same chunk still only brings back a remembered bucket size
    assert next_boundary(4, 10, tensor, Revert(data, {}), judged=True).then is Then.REMEMBERED
    # a forced switch with nothing to judge it is tuned at once; no policy, nothing to tell
    b = next_boundary(4, 10, tensor, None)
    assert b.then is Then.TUNE and not b.tell_policy and not b.abandon_tuning


def test_next_boundary_carries_out_the_policy_and_tunes_what_it_kept():
    from gearshift.orchestrator.control.boundary import Then, next_boundary
    from gearshift.orchestrator.policy.adaptive import Revert, Switch

    data, tensor = _layouts()
    b = next_boundary(4, 10, None, Switch(tensor, {"w": 0.3}), judged=True)
    assert (b.to, b.reason, b.evidence, b.scheduled, b.then) == (tensor, "switch", {"w": 0.3}, False, Then.NOTHING)
    assert b.tell_policy
    b = next_boundary(4, 10, None, Revert(data, {}), judged=True, kept=True)
    assert (b.to, b.reason, b.then) == (data, "revert", Then.REMEMBERED)
    assert next_boundary(4, 10, None, Switch(tensor, {}), judged=True, kept=True).then is Then.TUNE
    b = next_boundary(4, 10, None, None, judged=True, kept=True)
    assert b.to is None and b.then is Then.TUNE and not b.tell_policy
    assert next_boundary(4, 10, None, None, judged=True, tuning=True) == next_boundary(4, 10, None, None)


def test_memory_near_the_threshold_moves_to_a_lighter_layout_before_an_oom(tmp_path):
    """The workers' devices hold 2100 bytes each and the samplers report a peak of 2000 on rank 1:
    95 % of the device, past adapt.memory_threshold (0.92). The policy moves to the layout the
    memory model predicts needs less (fsdp), says why, and does not judge that move on speed."""
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=20", "parallel.strategy=auto", "checkpoint.every=0"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    class NearlyFull(FakeGroup):
        def start(self):
            return [dict(info, device_memory={"bytes": 2100, "shared": False}) for info in super().start()]

    def factory(j):
        groups.append(NearlyFull(j, run=run))
        return groups[-1]

    summary = Controller(job, run, factory).run()
    [decision] = [r for r in read(run.telemetry) if r.get("event") == "decision" and r["decision"] == "switch"]
    ev = decision["evidence"]
    assert ev["reason"] == "memory_pressure" and ev["peak_mem_bytes"] == 2000 and ev["device_memory_bytes"] == 2100
    assert ev["peak_share"] > ev["memory_threshold"] == 0.92
    assert decision["to"]["strategy"] == "fsdp" and ev["predicted_bytes"] < ev["predicted_bytes_now"]
    assert groups[0].reshards == [(decision["applied_step"], "fsdp", 1)]
    assert decision["applied_step"] - decision["seen_step"] <= 2
    assert not [r for r in read(run.telemetry) if r.get("event") == "decision" and r["decision"] == "revert"]
    assert summary["strategy_history"][-1]["strategy"] == "fsdp"


def _auto_with_devices(tmp_path, device_bytes):
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=6", "parallel.strategy=auto", "checkpoint.every=0"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    class Chooses(FakeGroup):  # the real group asks before it builds: so does this one
        def start(self):
            infos = [dict(info, node_id="n0", device_memory={"bytes": device_bytes, "shared": False})
                     for info in super().start()]
            layout = self.choose_layout(infos)
            self.started_in = layout
            return [dict(info, layout=layout.to_dict()) for info in infos]

    def factory(j):
        groups.append(Chooses(j, run=run))
        return groups[-1]

    return job, run, groups, factory


def test_auto_starts_in_the_least_sharded_layout_that_fits(tmp_path):
    """Devices with room for fsdp's share but not data's whole replica and Adam state: auto starts
    in the fitting layout that needs the most (not data), and its first policy record says what
    every layout was predicted to need."""
    from gearshift.orchestrator.policy import job_shape

    job, _, _, _ = _auto_with_devices(tmp_path / "probe", 1)
    check = job_shape.memory_check(job, 1)
    need = {s: check(Layout.for_workers(s, 2, None))[1]["predicted_bytes"] for s in ("data", "fsdp")}
    assert need["fsdp"] < need["data"]
    device = int((need["fsdp"] + need["data"]) / 2)
    job, run, groups, factory = _auto_with_devices(tmp_path, device)
    summary = Controller(job, run, factory).run()
    [policy] = [r for r in read(run.telemetry) if r.get("event") == "policy"]
    start = policy["start"]
    fitting = [p for p in start["predictions"] if p["fits"]]
    assert start["available_bytes"] == device and all(p["predicted_bytes"] <= device for p in fitting)
    assert {p["strategy"]: p["fits"] for p in start["predictions"]}["data"] is False
    best = max(fitting, key=lambda p: p["predicted_bytes"])
    assert start["layout"]["strategy"] == best["strategy"] != "data"
    assert groups[0].started_in.strategy == best["strategy"]
    assert summary["strategy_history"][0]["strategy"] == best["strategy"]


def test_auto_with_a_model_that_fits_nowhere_stops_with_the_predictions(tmp_path):
    from gearshift.orchestrator.errors import GearshiftError

    job, run, _, factory = _auto_with_devices(tmp_path, 1000)
    with pytest.raises(GearshiftError, match="fits no layout") as err:
        Controller(job, run, factory).run()
    assert "data dp=2" in str(err.value) and "fsdp" in str(err.value) and "GiB" in str(err.value)
    summary = json.loads(run.summary.read_text())
    assert summary["status"] == "failed" and "fits no layout" in summary["error"]


class LosingGroup(FakeGroup):
    """Rank 1 is lost inside step `lose_at` of the first group (rank 0 drops that step); a second
    loss lands while the survivors form their new group."""

    def train(self, until, every, last_step=None, stoppable=False):
        lose = self.fail_at is not None and self.step <= self.fail_at < until and not getattr(self, "lost_once", False)
        for rank, report in super().train(self.fail_at if lose else until, every, last_step, stoppable):
            yield rank, report
        if lose:
            self.lost_once = True
            yield 0, {"rank": 0, "step_failed": {"kind": "aborted", "rank": 0, "step": self.step + 1,
                                                 "message": "RuntimeError: Connection closed by peer"}}
            err = WorkerFailed(1, "its process died", kind=WorkerFailed.DIED)
            err.lost_ranks = [1]
            raise err

    def shrink(self, keep, layout, behind=()):
        self.shrunk = (keep, layout)
        raise WorkerFailed(0, "a worker process died during 'rejoin'", kind=WorkerFailed.DIED)


def test_a_loss_during_an_elastic_resize_falls_back_to_the_checkpoint(tmp_path):
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=10", "checkpoint.every=2", "cluster.min_workers=1"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    def factory(j):
        groups.append(LosingGroup(j, fail_at=5 if not groups else None, run=run))
        return groups[-1]

    summary = Controller(job, run, factory).run()
    assert groups[0].shrunk == ([0], {"strategy": "data", "dp": 1, "tp": 1})  # what the survivor was to go on as
    assert summary["status"] == "done" and summary["steps_done"] == 10
    records = read(run.telemetry)
    [failure] = [r for r in records if r.get("event") == "failure"]
    assert failure["elastic"].startswith("the resize failed: a worker process died") and failure["dead_ranks"] == []
    [resize] = [r for r in records if r.get("event") == "resize"]
    assert resize["from_checkpoint"] is True and resize["restored_step"] == 4 and resize["steps_redone"] == 1
    assert [r["step"] for r in records if r.get("event") == "restored"] == [4]
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [10.0, 10.0]


class LosingWhileGrowing(FakeGroup):
    """A new worker is ready to join from step 5; a worker is lost while the group takes it in."""

    def joinable(self):
        return int(self.step >= 5)

    def joining(self, count):
        return [{"rank": 2, "node_ip": "127.0.0.2", "node_id": "n2", "pid": 2, "backend": "gloo"}] * count

    def grow(self, count, layout):
        self.grew = (count, layout)
        raise WorkerFailed(1, "a worker process died during 'rejoin'", kind=WorkerFailed.DIED)


def test_a_loss_while_new_workers_join_restarts_from_the_checkpoint_and_says_why(tmp_path):
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=10", "checkpoint.every=2", "cluster.max_workers=3",
                                                 "train.global_batch_size=24"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    def factory(j):
        groups.append((LosingWhileGrowing if not groups else FakeGroup)(j, run=run))
        return groups[-1]

    summary = Controller(job, run, factory).run()
    assert groups[0].grew == (1, {"strategy": "data", "dp": 3, "tp": 1})  # what the run was growing to
    assert summary["status"] == "done" and summary["steps_done"] == 10 and len(groups) == 2
    records = read(run.telemetry)
    [failure] = [r for r in records if r.get("event") == "failure"]
    assert "during 'rejoin'" in failure["error"] and "restart from step 4" in failure["action"], failure
    assert failure["elastic"] == ("a worker was lost while 1 new worker(s) joined as data dp=3 tp=1, the state "
                                  "moving between worlds")
    [resize] = [r for r in records if r.get("event") == "resize"]
    assert resize["from_checkpoint"] is True and resize["world_size"] == [2, 2] and resize["restored_step"] == 4
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [10.0, 10.0]


@pytest.mark.parametrize("mode", ["rebalance", "report"])
def test_a_slow_rank_gets_a_smaller_share_within_two_steps_of_the_record_that_showed_it(tmp_path, mode):
    job, run, factory, groups = make(tmp_path, ["train.steps=40", f"adapt.stragglers={mode}"])
    Controller(job, run, factory).run()
    records = read(run.telemetry)
    decided = [r for r in records if r.get("event") == "decision"]
    group = groups[0]
    if mode == "report":  # said, with the shares it would take, and nothing moved
        assert group.share_calls == [] and [d["decision"] for d in decided] == ["straggler"]
        assert decided[0]["evidence"]["shares_after"][0] > 64
        return
    [move] = [d for d in decided if d["decision"] == "rebalance"]
    ev = move["evidence"]
    assert move["applied_step"] - move["seen_step"] <= 2 and move["seen_step"] == 10  # a window of 10 steps
    assert ev["replica"] == 1 and ev["rank"] == 1 and ev["speed_ratio"] == pytest.approx(15 / 8, rel=0.01)
    assert group.share_calls == [(move["applied_step"], move["shares"])]
    assert move["shares"] == ev["shares_after"] == [83, 45] and ev["shares_before"] == [64, 64]
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    assert "shares" not in steps[move["applied_step"]] and steps[move["applied_step"] + 1]["shares"] == [83, 45]
    assert steps[move["applied_step"] + 1]["ranks"]["share"] == [83, 45]
    [checked] = [d for d in decided if d["decision"] == "rebalanced"]  # a window later: measured as predicted
    assert abs(checked["evidence"]["prediction_error"]) < 0.02
    assert steps[40]["step_time_max"] < 0.8 * steps[5]["step_time_max"]
    # each rank's speed in the records, and the report plots them with the shares
    assert steps[5]["ranks"]["speed"] == pytest.approx([64 / 0.008, 64 / 0.015])
    from gearshift.monitoring.report import make_report
    assert "speeds.png" in [p.name for p in make_report(run.path).paths]


class DroppingGroup(FakeGroup):
    """Rank 1 computes 4x slower than rank 0 until step 100; let go, its slot is placed again at once
    (a worker there is joinable whenever the run is on one)."""

    def __init__(self, job, **kw):
        super().__init__(job, **kw)
        self.slow, self.moves = 0.032, []

    def train(self, until, every, last_step=None, stoppable=False):
        for rank, report in super().train(until, every, last_step, stoppable):
            if self.step >= 100:
                self.slow = 0.008
            yield rank, report

    def shrink(self, keep, layout, behind=()):
        self.moves.append(("shrink", self.step, keep, layout))
        self.world, self.shares = len(keep), None
        return [{"seconds": 0.01, "join_s": 0.005, "step": self.step}] * self.world

    def joinable(self):
        return int(self.world == 1)

    def joining(self, count):
        return [{"rank": 1, "node_ip": "127.0.0.2", "node_id": "n2", "pid": 2, "backend": "gloo"}] * count

    def grow(self, count, layout):
        self.moves.append(("grow", self.step, count, layout))
        self.world, self.shares = 2, None
        self.infos = self.start()
        return [{"seconds": 0.02, "join_s": 0.005, "step": self.step}] * 2


def test_drop_lets_a_very_slow_rank_go_in_memory_and_takes_it_back_after_a_hold_out(tmp_path):
    """Under adapt.stragglers drop, rank 1 at 4x rank 0's compute is let go where the workers stop
    (within two steps of the record), held out 50 steps, taken back by the elastic growth, let go
    again while still slow (held out twice as long), and kept once it computes as fast."""
    job = load_job(ROOT / "examples/mlp.yaml", ["train.steps=200", "adapt.stragglers=drop", "cluster.min_workers=1",
                                                 "checkpoint.every=0"])
    run = RunDir.create(job, str(tmp_path / "run"))
    groups = []

    def factory(j):
        groups.append(DroppingGroup(j, run=run))
        return groups[-1]

    summary = Controller(job, run, factory).run()
    assert summary["status"] == "done" and len(groups) == 1
    group, records = groups[0], read(run.telemetry)
    drops = [r for r in records if r.get("event") == "decision" and r["decision"] == "drop"]
    moves = group.moves
    assert [m[0] for m in moves] == ["shrink", "grow", "shrink", "grow"], moves
    first, second = drops
    assert first["seen_step"] == 10 and first["applied_step"] - first["seen_step"] <= 2
    assert first["ranks"] == [1] and first["evidence"]["rule"] == "ratio" and first["evidence"]["speed_ratio"] > 3
    assert moves[0] == ("shrink", first["applied_step"], [0], {"strategy": "data", "dp": 1, "tp": 1})
    # held out 5 windows, then 10
    assert first["evidence"]["held_out_steps"] == 50 and second["evidence"]["held_out_steps"] == 100
    assert moves[1][1] == first["applied_step"] + 50 and moves[1][3] == {"strategy": "data", "dp": 2, "tp": 1}
    assert moves[2][1] == second["applied_step"] and moves[3][1] == second["applied_step"] + 100
    resizes = [r for r in records if r.get("event") == "resize"]
    assert [r["world_size"] for r in resizes] == [[2, 1], [1, 2], [2, 1], [1, 2]]
    assert resizes[0]["let_go"] == [1] and resizes[0]["reason"] == "straggler"
    # back for good: no drop or rebalance after the slow rank recovered (step 100)
    assert not [r for r in records if r.get("event") == "decision" and r["decision"] in ("drop", "rebalance")
                and r["seen_step"] > moves[3][1]]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 201))
    assert torch.load(run.final, weights_only=True)["w"].tolist() == [200.0, 200.0]


def test_the_policys_straggler_report_is_left_to_the_straggler_watcher():
    """strategy auto's rule 3 (a rank computing long while the others wait: no switch) says a
    straggler too; where adapt.stragglers watches the layout, its own record says it once."""
    from gearshift.orchestrator.control.stragglers import Stragglers
    from gearshift.orchestrator.policy.decisions import Report

    watcher = Stragglers(ctl=None)
    said = Report("straggler", {"rank": 1, "compute_ratio": 2.0})
    assert not watcher.says(said)  # not watched (off, or no replicas): the policy's record stands
    watcher.rebalancer = object()
    assert watcher.says(said) and not watcher.says(Report("input_bound", {}))
