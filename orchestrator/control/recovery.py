"""Recovery after a worker or node failure: tear the group down, decide whether a restart can fix
it (`fault.max_failures`), find the nodes that went with it, choose what to continue on
(`fault.on_node_loss`: wait for a replacement, or shrink), and pick the checkpoint to restore.

It asks the worker group, not Ray, which ranks and nodes are gone (`dead_ranks`,
`alive_node_ids`, `alive_node_resources`): a group that knows of no nodes (a test's stand-in)
makes every failure a worker loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import re
import time

from gearshift.orchestrator.errors import GearshiftError, WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.orchestrator.cluster.worker_group import WorkerGroup, worker_bundle
from gearshift.strategies.layout import LayoutError
from gearshift.workers.state import checkpoint

# how Ray says an actor went down with its node (a killed worker process reads "worker process has died")
_NODE_DIED = re.compile(r"node (has )?died|node is dead|NODE_DIED|NodeDied", re.IGNORECASE)


class Recovery:
    """The failures of one run and what was done about each (the summary's `failures`)."""

    def __init__(self, report: Reporter, checkpoints: pathlib.Path):
        self.report = report
        self.checkpoints = checkpoints
        self.failures: list[dict] = []   # worker or node failures recovered from
        self._recovering: dict | None = None  # the failure whose restart has not trained a step yet

    def recover(self, err: WorkerFailed, failures: int, job: Job, group: WorkerGroup | None, infos: list[dict],
                failed_at: int, elastic: str | None = None) -> tuple[Job, tuple[str, dict] | None]:
        """After a lost, silent or disconnected worker: tear the group down (no survivor is left
        blocked in a collective: every actor is killed), pick what to continue on, and return the
        job to restart and the latest checkpoint that verifies (None: from the start). `elastic`:
        why the survivors could not go on in memory (fault.on_node_loss elastic). Raises
        `err` when the failure is not one a restart can fix, or the job's fault.max_failures is
        used up."""
        f = job.fault
        detected = time.time()
        dead = _tear_down(err, group)
        if not err.recoverable or (f.max_failures != -1 and failures > f.max_failures):
            if err.recoverable:
                self.report.event("failure", step=failed_at, rank=err.rank, kind=err.kind, error=err.reason,
                                  failures=failures, max_failures=f.max_failures, action="stop")
            raise err
        lost = lost_nodes(err, group, infos, dead)
        found = checkpoint.load_latest(self.checkpoints, whole=False)  # the workers read it
        restore_step = found[1]["step"] if found else 0
        action = f"restart from step {restore_step}" + (f" ({found[0].name})" if found else " (no checkpoint yet)")
        if lost:
            job, how = after_node_loss(job, lost, group)
            action += f"; {how}"
        self.report.event("failure", step=failed_at, rank=err.rank, kind=err.kind, error=err.reason,
                          failures=failures, max_failures=f.max_failures, lost_nodes=lost, dead_ranks=sorted(dead),
                          action=action, steps_to_recompute=max(0, failed_at - restore_step),
                          **({"elastic": elastic} if elastic else {}))
        self.failures.append({"step": failed_at, "detected": detected, "kind": err.kind, "rank": err.rank,
                              "restored_step": restore_step, "lost_nodes": lost})
        self._recovering = self.failures[-1]
        self.report.say(f"step {failed_at}: {err} -> {action} (failure {failures} of "
                        f"{'unlimited' if f.max_failures == -1 else f.max_failures})")
        return job, ((found[0].name, found[1]) if found else None)

    def trained(self, record: dict, world_size: int) -> None:
        """A step trained: the first after a restart says how long the recovery took."""
        if self._recovering is None:
            return
        f, self._recovering = self._recovering, None
        f["seconds_to_training"] = time.time() - f["detected"]
        f["steps_recomputed"] = max(0, f["step"] - f["restored_step"])
        self.report.event("recovered", step=record["step"], restored_step=f["restored_step"],
                          seconds_since_detected=f["seconds_to_training"], steps_recomputed=f["steps_recomputed"],
                          world_size=world_size)
        self.report.say(f"step {record['step']}: training again {f['seconds_to_training']:.1f} s after the failure "
                        f"was detected ({f['steps_recomputed']} step(s) to compute again)")


def _tear_down(err: WorkerFailed, group: WorkerGroup | None) -> dict[int, str]:
    """Kill the group; the ranks whose actors were already gone, with the reason the group gives."""
    dead: dict[int, str] = {}
    if group is not None:
        if err.recoverable:
            # the first error may come from a survivor ("connection reset"): who is really gone?
            with contextlib.suppress(Exception):
                dead = group.dead_ranks()
        group.shutdown(polite=False)
    return dead


def lost_nodes(err: WorkerFailed, group: WorkerGroup | None, infos: list[dict], dead: dict[int, str]) -> list[str]:
    """Nodes that held workers of the failed group and are gone, as the cluster sees them. Ray marks
    a node dead after its health checks fail, some seconds after its processes went: wait for
    that a while when a worker's death is put down to its node, briefly otherwise."""
    held = {i.get("node_id"): i.get("node_ip") for i in infos if i.get("node_id")}
    if group is None or not held or (err.kind != WorkerFailed.DIED and not dead):
        return []
    try:
        said = " ".join([err.details or "", *dead.values()])
        patience = 30.0 if _NODE_DIED.search(said) else 2.0
        deadline = time.monotonic() + patience
        while True:
            alive = group.alive_node_ids()
            gone = [f"{ip} ({nid[:8]})" for nid, ip in held.items() if nid not in alive]
            if gone or time.monotonic() > deadline:
                return gone
            time.sleep(0.5)
    except Exception:  # the cluster cannot say: treat it as a worker loss
        return []


def after_node_loss(job: Job, lost: list[str], group: WorkerGroup) -> tuple[Job, str]:
    """fault.on_node_loss: wait for a replacement (placement waits up to replacement_timeout_s),
    or shrink to the workers that fit what is left. The job to restart, and what was done."""
    f = job.fault
    if job.on_node_loss == "wait":
        cluster = dataclasses.replace(job.cluster, placement_timeout_s=max(f.replacement_timeout_s, 1.0))
        return (dataclasses.replace(job, cluster=cluster),
                f"node {', '.join(lost)} lost: waiting up to {f.replacement_timeout_s:g} s for a replacement "
                f"(fault.on_node_loss = wait)")
    # what the nodes still alive hold, worker by worker (our own group is gone, so its share counts)
    bundle = worker_bundle(job)
    free = group.alive_node_resources()
    fit = sum(min(int(r.get(k, 0) // v) for k, v in bundle.items() if v > 0) for r in free)
    batch, n = job.train.global_batch_size, min(fit, job.cluster.num_workers)
    while n > 0 and batch % n:
        n -= 1
    if n < 1:
        raise GearshiftError(f"node {', '.join(lost)} was lost and what is left cannot hold one worker of "
                             f"{bundle} (free: {free}); fault.on_node_loss = {job.on_node_loss} has nothing to "
                             "shrink to")
    if n < (job.cluster.min_workers or 1):
        raise GearshiftError(f"node {', '.join(lost)} was lost: what is left holds {n} worker(s) of {bundle} that "
                             f"divide the global batch ({batch}), below cluster.min_workers "
                             f"({job.cluster.min_workers})")
    job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, num_workers=n))
    try:
        job.layout  # noqa: B018 (it validates)
    except LayoutError:  # a tensor-parallel or shard size the fewer workers cannot hold: data parallel
        job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, strategy="data", tp_size=None,
                                                                    shard_size=None, dp_shard=False))
    return job, (f"node {', '.join(lost)} lost: continuing on {n} worker(s) (fault.on_node_loss = {job.on_node_loss}; the "
                 f"global batch stays {batch})")
