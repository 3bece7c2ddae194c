"""Losing a node mid-run on a real two-node Ray cluster (ray.cluster_utils.Cluster): the job
shrinks to what is left or waits for a replacement, as configured, and says which; under
`fault.on_node_loss: elastic` it shrinks in memory, grows onto a node that joins mid-run, and
takes a node lost and another joined at the same step. Each case runs in its own process: a
cluster of its own, apart from the test session's Ray."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest
import torch

from gearshift.orchestrator.job import load_job
from test_elastic import SGD, replicas_of, sharded_reference
from test_train_equivalence import MLP, max_diff, reference

pytestmark = [pytest.mark.ray, pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, pathlib, sys, threading, time
sys.path.insert(0, sys.argv[3])
from ray.cluster_utils import Cluster
import ray

mode, run_dir, root = sys.argv[1], pathlib.Path(sys.argv[2]), sys.argv[3]
fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                        "_system_config": fast})
node = cluster.add_node(num_cpus=2) if mode != "join" else None  # join: the head alone at first
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="WARNING")
log, joined = [], []

def chaos():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        tel = run_dir / "telemetry.jsonl"
        recs = []
        for l in (tel.read_text().splitlines() if tel.exists() else []):
            try:  # the run is writing: a torn last line is skipped
                recs.append(json.loads(l))
            except ValueError:
                pass
        if max((r["step"] for r in recs if r["type"] == "step"), default=0) >= (2 if mode == "join" else 12):
            break
        time.sleep(0.05)
    if node is not None:
        cluster.remove_node(node, allow_graceful=False)
        log.append(("removed", time.time()))
    if mode in ("wait", "join", "replace"):  # a node joins, as an autoscaler's or an operator's would
        time.sleep(3 if mode == "wait" else 0)  # replace: the moment the other is lost
        import subprocess, shutil
        joined.append(subprocess.Popen([shutil.which("ray") or "ray", "start", "--address", cluster.address,
                                        "--num-cpus", "2", "--block", "--disable-usage-stats"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        log.append(("added", time.time()))

# once the node is added, the driver's look for joiners waits for their workers (test_elastic.await_joiners): on
# a loaded machine they may take longer to start than the rest of the run
from gearshift.orchestrator.cluster.growth import Growth
_ready = Growth.ready
def _waiting(self, spawn):
    count = _ready(self, spawn)
    if self.waiting and joined:
        ray.wait(list(self.waiting), num_returns=len(self.waiting), timeout=120)
        count = _ready(self, spawn)
    return count
Growth.ready = _waiting
threading.Thread(target=chaos, daemon=True).start()
from gearshift.orchestrator.commands import cli
overrides = json.loads(sys.argv[4])
code = cli.main(["run", str(pathlib.Path(root) / "examples" / "mlp.yaml"), "--run-dir", str(run_dir),
                 *[a for o in overrides for a in ("--set", o)]])
(run_dir / "chaos.json").write_text(json.dumps(log))
ray.shutdown()
for proc in joined:  # stop the replacement node by the pid we started it with
    proc.terminate()
    proc.wait(timeout=60)
cluster.shutdown()
sys.exit(code)
"""

BASE = MLP[1] + ["train.steps=40", "checkpoint.every=5", "inject.comm_delay_ms=30", "cluster.num_workers=4",
                 "cluster.cpus_per_worker=1", "cluster.placement=pack", "fault.max_failures=3"]


def run(tmp_path, mode: str, overrides: list[str]) -> pathlib.Path:
    run_dir = tmp_path / mode
    # its own session: whatever the cluster started goes with it, even if the test gives up
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(run_dir), str(ROOT), json.dumps(overrides)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:"
                                                                              f"{os.environ.get('PATH', '')}"})
    try:
        _, err = proc.communicate(timeout=280)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == 0, err[-4000:]
    return run_dir


def recorded(run_dir, name):
    recs = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    return [r for r in recs if r["type"] == "event" and r["event"] == name]


@pytest.mark.parametrize("mode", ["shrink", "wait"])
def test_a_lost_node_shrinks_the_job_or_waits_for_a_replacement(tmp_path, mode):
    """(Elastic, in memory: the test after this one.)"""
    run_dir = run(tmp_path, mode, BASE + [f"fault.on_node_loss={mode}", "fault.replacement_timeout_s=120"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done" and summary["steps_done"] == 40
    failures = recorded(run_dir, "failure")
    assert failures and failures[0]["lost_nodes"], failures
    action = failures[0]["action"]
    [recovered] = recorded(run_dir, "recovered")[-1:]
    if mode == "shrink":
        assert "continuing on 2 worker(s)" in action and recovered["world_size"] == 2
        assert summary["world_size"] == 2
    else:
        assert "waiting up to" in action and recovered["world_size"] == 4
        assert summary["world_size"] == 4
    # the same global batches, averaged over 2 or 4 ranks: the same model up to float rounding
    final = torch.load(run_dir / "final.pt", weights_only=True)
    ref, _ = reference(load_job(MLP[0], BASE))
    assert max_diff(final, ref) <= 1e-4
    chaos = dict(json.loads((run_dir / "chaos.json").read_text()))
    print(f"{mode}: node removed; training again {recovered['time'] - chaos['removed']:.1f} s later on "
          f"{recovered['world_size']} workers, {recovered['steps_recomputed']} step(s) recomputed")


# SGD with momentum: its state moves as Adam's does (test_elastic.sharded_reference says why the reference
# cuts the batch as the run does). A new node takes 10-15 s to register and its workers 5-10 s to start and
# warm up (over 40 s on a loaded machine): the driver waits for them (SCRIPT), so the steps can be short
ELASTIC = BASE + SGD + ["fault.on_node_loss=elastic", "cluster.min_workers=1", "cluster.max_workers=4",
                        "train.steps=80", "inject.comm_delay_ms=150"]


# join alone is an extended variant: replace takes a joining node in too, after its loss (make test-extended).
# replace once failed in CI (1 run of 3): news of the loss reached the driver in an order the stream took as a
# plain failure, and the run restarted from its checkpoint instead of shrinking in memory. Every order of that
# race is now a test of its own (test_train_stream.py).
@pytest.mark.parametrize("mode", [pytest.param("join", marks=pytest.mark.extended), "replace"])
def test_an_elastic_run_grows_onto_a_node_that_joins_even_as_another_is_lost(tmp_path, mode):
    """join: a 2-worker run on the head alone grows to 4 when a node joins (from step 2).
    replace: a 4-worker run loses one node and gains another at the same moment: it goes on in
    memory on the head's 2 workers (the lost node's two ranks, whichever the nodes' order made
    them), then takes the new node's 2 in, with no restart."""
    overrides = ELASTIC + (["cluster.num_workers=2"] if mode == "join" else [])
    run_dir = run(tmp_path, mode, overrides)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "done" and summary["steps_done"] == 80 and summary["world_size"] == 4
    resizes = recorded(run_dir, "resize")
    assert all(r["from_checkpoint"] is False for r in resizes) and not recorded(run_dir, "restored"), resizes
    assert [r["world_size"] for r in resizes] == ([[2, 4]] if mode == "join" else [[4, 2], [2, 4]]), resizes
    if mode == "replace":
        shrink = resizes[0]
        assert len(shrink["lost_ranks"]) == 2 and sorted(shrink["lost_ranks"] + shrink["kept_ranks"]) == [0, 1, 2, 3]
        assert shrink["lost_nodes"] and recorded(run_dir, "failure")[0]["lost_nodes"] == shrink["lost_nodes"]
    assert resizes[-1]["joined"] == 2 and resizes[-1]["steps_redone"] == 0
    assert sum(r["steps_redone"] for r in resizes) <= 1
    job = load_job(MLP[0], overrides)
    replicas = replicas_of(run_dir, job.layout.dp)
    off = max_diff(torch.load(run_dir / "final.pt", weights_only=True), sharded_reference(job, replicas))
    # float rounding only: where the data-parallel size changes, the run sums its shares in another order than
    # the reference, and over 80 momentum steps that grows to 1e-5..6e-5 (measured). A grow that lost the
    # optimizer's state (the momentum) would land 100 times further off: the yardstick below says how far
    lost = max_diff(sharded_reference(job, replicas, state_lost_at=resizes[-1]["step"] - 1),
                    sharded_reference(job, replicas))
    assert off <= 2e-4 and lost >= 50 * off, (off, lost)
    chaos = dict(json.loads((run_dir / "chaos.json").read_text()))
    print(f"{mode}: node added; training on 4 workers {resizes[-1]['time'] - chaos['added']:.1f} s later")
