"""Faults, for real: a worker SIGKILLed mid-run, a rank stuck in a step, a NaN, a checkpoint
write killed halfway. The run recovers, and ends where an uninterrupted run ends."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch.utils.data import default_collate

from gearshift.orchestrator.cluster import liveness, stream
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import load_job
from gearshift.monitoring.telemetry import read
from test_train_equivalence import MLP, max_diff, reference, run_gearshift
from gearshift.workers.build import components
from gearshift.workers.state import checkpoint
from gearshift.workers.step.data import GlobalBatches

ROOT = pathlib.Path(__file__).resolve().parents[1]
# 30 ms per collective: long enough a run to kill a worker in the middle of it
SLOW = ["train.steps=40", "checkpoint.every=10", "inject.comm_delay_ms=30", "fault.max_failures=2"]
LAYOUTS = {"data": ["cluster.num_workers=2"],
           "hybrid": ["cluster.num_workers=4", "cluster.cpus_per_worker=1", "parallel.strategy=hybrid",
                      "parallel.tp_size=2"],
           "fsdp": ["cluster.num_workers=2", "parallel.strategy=fsdp"],
           "tensor": ["cluster.num_workers=2", "parallel.strategy=tensor"],
           "hsdp": ["cluster.num_workers=4", "cluster.cpus_per_worker=1", "parallel.strategy=hsdp",
                    "parallel.shard_size=2"]}


def records(run_dir) -> list[dict]:
    """The run's records so far; read while the run writes, so a torn last line is skipped
    (monitoring/telemetry.read), as `gearshift watch` skips it."""
    path = pathlib.Path(run_dir) / "telemetry.jsonl"
    return read(path) if path.exists() else []


def events(run_dir, name) -> list[dict]:
    return [r for r in records(run_dir) if r["type"] == "event" and r["event"] == name]


class Killer(threading.Thread):
    """Waits for the run to pass `at_step` (and, given `checkpointed`, for the checkpoint of that
    step to be committed), then SIGKILLs the process of worker `rank`. A test that expects the
    run restored from a checkpoint names it: a kill at a step alone once came, on a loaded
    machine, before the step-10 checkpoint's write ended, and the run started again from step 0."""

    def __init__(self, run_dir, rank: int, at_step: int, checkpointed: int | None = None):
        super().__init__(daemon=True)
        self.run_dir, self.rank, self.at_step, self.checkpointed = run_dir, rank, at_step, checkpointed
        self.killed: tuple[int, float, int] | None = None  # (pid, time, last step seen)
        self.error: BaseException | None = None  # what stopped the thread, for the test's message

    def run(self):
        try:
            self._watch()
        except BaseException as e:  # a test asserting `killed` says why it is None
            self.error = e
            raise

    def _watch(self):
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            recs = records(self.run_dir)
            steps = [r["step"] for r in recs if r["type"] == "step"]
            started = [r for r in recs if r.get("event") == "state" and r.get("state") == "starting"]
            saved = [r["step"] for r in recs if r.get("event") == "checkpoint"]
            ready = self.checkpointed is None or self.checkpointed in saved
            if started and steps and max(steps) >= self.at_step and ready:
                pid = started[0]["workers"][self.rank]["pid"]
                os.kill(pid, signal.SIGKILL)
                self.killed = (pid, time.time(), max(steps))
                return
            time.sleep(0.05)


# fsdp is an extended variant: a sharded layout's restore from its checkpoint after a lost rank also runs in
# tests/test_elastic.py (test_layouts_that_cannot_shrink_in_memory_fall_back_to_the_checkpoint_and_say_why[fsdp])
@pytest.mark.parametrize("layout", [pytest.param("data", marks=pytest.mark.smoke), "hybrid",
                                    pytest.param("fsdp", marks=pytest.mark.extended),
                                    pytest.param("tensor", marks=pytest.mark.crossing("restart", "tensor")),
                                    pytest.param("hsdp", marks=pytest.mark.crossing("restart", "hsdp"))])
@pytest.mark.crossing("restart", "data")
@pytest.mark.crossing("restart", "hybrid")
def test_a_killed_worker_is_replaced_and_the_run_ends_where_an_uninterrupted_one_ends(local_workers, tmp_path, layout):
    overrides = MLP[1] + LAYOUTS[layout] + SLOW
    killer = Killer(tmp_path / "killed", rank=1, at_step=15, checkpointed=10)
    killer.start()
    summary = run_gearshift(MLP[0], overrides, tmp_path / "killed")
    killer.join(timeout=5)
    assert killer.killed, f"the worker was never killed ({killer.error!r})"
    assert summary["status"] == "done" and summary["steps_done"] == 40
    [failure] = events(tmp_path / "killed", "failure")
    # the first to tell may be the killed rank's actor, or a peer whose collective lost it
    assert failure["kind"] in ("died", "raised") and failure["dead_ranks"] == [1], failure
    [restored] = events(tmp_path / "killed", "restored")
    assert restored["step"] % 10 == 0 and restored["step"] <= failure["step"]  # the newest checkpoint before it
    [recovered] = events(tmp_path / "killed", "recovered")
    assert recovered["restored_step"] == restored["step"] and recovered["step"] == restored["step"] + 1
    assert summary["failures"][0]["steps_recomputed"] == failure["steps_to_recompute"]
    # where an uninterrupted run of the layout ends: the plain loop's weights (every layout equals it,
    # tests/test_train_equivalence.py); a restore from the wrong step or batch ends far from them
    a = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    ref, _ = reference(load_job(MLP[0], overrides))
    assert max_diff(a, ref) <= (1e-4 if layout in ("tensor", "hsdp") else 1e-5)  # reordered sums: 1e-4
    seconds = recovered["time"] - killer.killed[1]
    print(f"{layout}: killed pid {killer.killed[0]} at step {killer.killed[2]}; training again at step "
          f"{recovered['step']} {seconds:.1f} s after the kill; {failure['steps_to_recompute']} step(s) recomputed")


def test_failures_past_max_failures_end_the_run_with_what_happened(local_workers, tmp_path):
    killer = Killer(tmp_path / "run", rank=0, at_step=5)
    killer.start()
    code = cli.main(["run", str(MLP[0]), "--run-dir", str(tmp_path / "run"),
                     *[a for o in MLP[1] + LAYOUTS["data"] + SLOW + ["fault.max_failures=0"] for a in ("--set", o)]])
    killer.join(timeout=5)
    assert code == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed" and "died" in summary["error"]
    [failure] = events(tmp_path / "run", "failure")
    assert failure["action"] == "stop" and failure["max_failures"] == 0


def faulty(tmp_path, entrypoint: str, **kwargs) -> tuple[pathlib.Path, list[str]]:
    """The MLP job with its model built by a fault entry point of tests/fixtures/faults.py,
    copied next to the job; the fault fires once per run (a marker under tmp_path)."""
    import shutil

    shutil.copy(ROOT / "tests/fixtures/faults.py", tmp_path / "faults.py")
    job = tmp_path / "mlp.yaml"
    shutil.copy(MLP[0], job)
    model_kwargs = {**load_job(MLP[0]).model.kwargs, **kwargs, "marker": str(tmp_path / "fired")}
    return job, [f"model={{entrypoint: 'faults:{entrypoint}', kwargs: {json.dumps(model_kwargs)}}}"]


def noticed_by_s(collective_timeout_s: float, steps: list[dict]) -> float:
    """How long after the last step before a hang the controller may know of it: the collective
    timeout plus the margin past it that the train stream allows (stream.STALL_MARGIN_S), the
    heartbeats' cadence (asked for after liveness.POLL_AFTER_S without a report, then every
    liveness.POLL_EVERY_S, with a poll coming back every stream.POLL_S), and twenty times the
    slowest step of the run before the hang: the longest from one step's end to the next's, as
    the workers stamped them, or from a step's end to its record at the controller. A loaded
    machine, which makes every step slower, widens the bound with it."""
    ends = [r["ended_at"] for r in steps]
    slowest = max([b - a for a, b in zip(ends, ends[1:])] + [r["time"] - r["ended_at"] for r in steps])
    return (collective_timeout_s + stream.STALL_MARGIN_S + liveness.POLL_AFTER_S + liveness.POLL_EVERY_S
            + stream.POLL_S + 20 * slowest)


def noticed_in_time(run_dir, summary: dict, collective_timeout_s: float) -> tuple[dict, float]:
    """The run's one failure event, and how long after the last step before it the controller
    knew of it (its `detected`: the event itself comes after the workers are torn down), checked
    against `noticed_by_s`."""
    [failure] = events(run_dir, "failure")
    before = [r for r in records(run_dir) if r["type"] == "step" and r["time"] < failure["time"]]
    detected_after = summary["failures"][0]["detected"] - max(r["ended_at"] for r in before)
    bound = noticed_by_s(collective_timeout_s, before)
    assert detected_after <= bound, f"noticed {detected_after:.1f} s after the last step (bound {bound:.1f} s)"
    return failure, detected_after


def test_a_rank_stuck_in_a_step_is_detected_within_the_collective_timeout(local_workers, tmp_path):
    base = MLP[1] + LAYOUTS["data"] + ["train.steps=12", "checkpoint.every=2", "fault.collective_timeout_s=5"]
    run_gearshift(MLP[0], base, tmp_path / "clean")
    job, hang = faulty(tmp_path, "hanging_mlp", hang_at_step=5, hang_rank=1)
    summary = run_gearshift(job, base + hang, tmp_path / "stuck")
    assert summary["status"] == "done" and summary["steps_done"] == 12
    # a group whose collectives took no timeout would be noticed only by its silence
    # (collective_timeout_s + 30 s on the warm processes) or never
    failure, detected_after = noticed_in_time(tmp_path / "stuck", summary, 5)
    assert failure["kind"] in ("silent", "raised")
    a = torch.load(tmp_path / "stuck" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    assert max_diff(a, b) <= 1e-6
    print(f"stuck rank: detected {detected_after:.1f} s after the last step (collective_timeout_s = 5)")


def test_a_first_step_three_times_the_collective_timeout_on_every_rank_is_not_a_hang(local_workers, tmp_path):
    base = MLP[1] + LAYOUTS["data"] + ["train.steps=6", "fault.collective_timeout_s=5", "fault.max_failures=0"]
    run_gearshift(MLP[0], base, tmp_path / "clean")
    job, slow = faulty(tmp_path, "slow_first_step_mlp", sleep_s=15)
    start = time.monotonic()
    summary = run_gearshift(job, base + slow, tmp_path / "slow")
    took = time.monotonic() - start
    assert summary["status"] == "done" and summary["steps_done"] == 6
    assert not events(tmp_path / "slow", "failure") and not summary.get("failures")
    steps = [r for r in records(tmp_path / "slow") if r["type"] == "step"]
    assert steps[0]["step"] == 1 and steps[0]["step_time_max"] >= 15  # the first step did take that long
    a = torch.load(tmp_path / "slow" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "clean" / "final.pt", weights_only=True)
    assert max_diff(a, b) == 0.0
    print(f"first step {steps[0]['step_time_max']:.1f} s with collective_timeout_s = 5: no recovery, run {took:.0f} s")


@pytest.mark.ray  # the heartbeats are Ray's control-thread calls
def test_every_rank_stuck_forever_inside_a_collective_is_caught_by_the_heartbeats(ray_cluster, tmp_path):
    # no rank's collective raises (every rank waits in one that never times out): only the
    # heartbeats can tell, by the time spent inside it
    base = MLP[1] + LAYOUTS["data"] + ["train.steps=8", "checkpoint.every=2", "fault.collective_timeout_s=5"]
    job, hang = faulty(tmp_path, "collective_hang_mlp", hang_at_step=5, hang_ranks=[0, 1])
    summary = run_gearshift(job, base + hang, tmp_path / "stuck")
    assert summary["status"] == "done" and summary["steps_done"] == 8
    # without the heartbeats' time inside one collective it would be fault.progress_timeout_s (an hour)
    failure, detected_after = noticed_in_time(tmp_path / "stuck", summary, 5)
    assert failure["kind"] == "silent" and failure["rank"] in (0, 1)
    assert "inside one collective" in failure["error"] and "step 5" in failure["error"], failure["error"]
    print(f"stuck in a collective: detected {detected_after:.1f} s after the last step (collective_timeout_s = 5): "
          f"{failure['error']}")


def reference_skipping(job, skip_step: int) -> dict:
    """Plain PyTorch on the same batches, with step `skip_step`'s update left out."""
    spec, paths = job.to_dict(), [job.base_dir]
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], paths)
    dataset = components.build_dataset(spec["data"], spec["model"], paths)
    loss_fn = components.build_loss(spec["loss"], paths)
    opt = components.build_optimizer(model.parameters(), spec["optimizer"])
    order = GlobalBatches(len(dataset), job.train.global_batch_size, job.train.seed)
    for step in range(job.train.steps):
        if step + 1 == skip_step:
            continue
        x, y = default_collate([dataset[i] for i in order.indices(step)])
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if job.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), job.train.grad_clip)
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("layout", ["data", "hybrid"])
def test_a_nan_step_is_not_applied_and_its_batch_is_skipped(local_workers, tmp_path, layout):
    job_file, nan = faulty(tmp_path, "nan_mlp", nan_at_step=4)
    summary = run_gearshift(job_file, MLP[1] + LAYOUTS[layout] + nan, tmp_path / "run")
    overrides = MLP[1] + LAYOUTS[layout]  # the same job with the plain built-in model
    assert summary["status"] == "done" and summary["steps_done"] == 12
    [bad] = events(tmp_path / "run", "non_finite")
    assert bad["step"] == 4 and bad["layer"] and "skipped" in bad["action"]
    job = load_job(MLP[0], overrides)
    model = components.build_model(job.to_dict()["model"], [job.base_dir])
    first_leaf = next(n for n, m in model.named_modules() if n and not list(m.children()))
    assert bad["layer"] == first_leaf  # where the NaN was injected (nan_module defaults to it)
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "run") if r["type"] == "step"}
    assert losses[4] != losses[4] and all(v == v for s, v in losses.items() if s != 4)  # NaN only at step 4
    assert summary["final_loss"] == summary["final_loss"]
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert all(torch.isfinite(t).all() for t in final.values())
    assert max_diff(final, reference_skipping(job, 4)) <= 1e-4


def test_a_nan_step_skipped_on_the_device_with_a_fused_optimizer(local_workers, tmp_path):
    """optimizer.fused (the default on GPU): the step's found-inf flag goes into the fused kernel,
    which leaves the state as it was, and the worker reads the flag with the step's report, so
    the step never waits on the host. The record says so; the result is the one without step 4."""
    job_file, nan = faulty(tmp_path, "nan_mlp", nan_at_step=4)
    overrides = MLP[1] + LAYOUTS["fsdp"] + ["optimizer.fused=true"]
    summary = run_gearshift(job_file, overrides + nan, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 12
    [bad] = events(tmp_path / "run", "non_finite")
    assert bad["step"] == 4 and bad["layer"] is None and "on the device" in bad["checked"]
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, reference_skipping(load_job(MLP[0], overrides), 4)) <= 1e-4


def test_on_nan_rollback_goes_back_to_the_checkpoint_at_a_lower_rate(local_workers, tmp_path):
    """Non-finite steps 5 and 6 with nan_patience 2: the run goes back to the checkpoint of step 4
    and trains on at half the rate; its end equals plain PyTorch resuming that checkpoint by hand
    with that rate."""
    from test_elastic import SGD
    from test_train_equivalence import continued

    from gearshift.workers.state import dcp

    job_file, nan = faulty(tmp_path, "nan_steps_mlp", nan_at_steps=[5, 6])
    overrides = MLP[1] + LAYOUTS["data"] + SGD + ["checkpoint.every=4", "checkpoint.keep=10", "fault.on_nan=rollback",
                                                  "fault.nan_patience=2", "fault.rollback_lr_factor=0.5"]
    summary = run_gearshift(job_file, overrides + nan, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 12
    assert [b["step"] for b in events(tmp_path / "run", "non_finite")] == [5, 6]
    [rolled] = events(tmp_path / "run", "rollback")
    assert (rolled["to_step"], rolled["checkpoint"], rolled["bad_steps"]) == (4, "step_00000004", [5, 6])
    assert rolled["lr"] == pytest.approx(0.01) and rolled["previous_lr"] == pytest.approx(0.02)
    assert summary["rollbacks"][0]["to_step"] == 4
    state = dcp.load_full(tmp_path / "run" / "checkpoints" / "step_00000004")
    by_hand = continued(load_job(MLP[0], MLP[1] + SGD), state, 4, 12, lr=0.01)  # at the lowered rate
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, by_hand) <= 1e-5


def test_on_nan_stop_ends_the_run_naming_the_layer(local_workers, tmp_path, capsys):
    job_file, nan = faulty(tmp_path, "nan_mlp", nan_at_step=3)
    code = cli.main(["run", str(job_file), "--run-dir", str(tmp_path / "run"),
                     *[a for o in MLP[1] + LAYOUTS["data"] + nan + ["fault.on_nan=stop"] for a in ("--set", o)]])
    assert code == 1
    err = capsys.readouterr().err
    assert "step 3" in err and "first non-finite output was" in err and "fault.on_nan = stop" in err
    assert not events(tmp_path / "run", "failure"), "an error in the step is not retried"


WRITER = r"""
import sys, time, pathlib
sys.path.insert(0, sys.argv[2])
import torch
from gearshift.workers.state import checkpoint
root = pathlib.Path(sys.argv[1])
state = lambda s: {"model": {"w": torch.full((256, 256), float(s))}, "step": s}
checkpoint.save(root, 10, state(10), keep=5)
real = checkpoint.os.fsync
def slow(fd):
    real(fd)
    print("writing", flush=True)  # state.pt is on disk in the temp folder, the manifest is not
    time.sleep(60)  # killed here, mid-write
checkpoint.os.fsync = slow
checkpoint.save(root, 20, state(20), keep=5)
"""


def test_a_checkpoint_write_killed_halfway_leaves_the_previous_one_in_use(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path / "ckpt"), str(ROOT)],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    left = [p.name for p in (tmp_path / "ckpt").iterdir()]
    assert any(name.startswith(".step_00000020.tmp") for name in left), left  # the half-written one is there
    path, state = checkpoint.load_latest(tmp_path / "ckpt")
    assert path.name == "step_00000010" and state["step"] == 10
    assert float(state["model"]["w"][0, 0]) == 10.0
