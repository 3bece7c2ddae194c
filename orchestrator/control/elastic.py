"""Elastic shrink: when workers die mid-step and the ranks that are left still hold every piece
of the model and optimizer state, the run goes on in memory on fewer workers, from the step that
failed, without a checkpoint or a restart of the survivors' processes.

What survives is a property of the layout alone (`pieces_lost`): a rank (dp_rank, tp_rank)
holds the piece (tp_rank, dp_rank % shard), so data parallel loses nothing while one worker is
left, hybrid with a replicated data dimension nothing while each tensor-parallel slice has a
survivor, hsdp nothing while each shard index has one (FSDP2's state of the dropped step is reset
first: Parallel.drop_step); fsdp over every worker, tensor, and hybrid with dp_shard hold each
piece once. `plan` says what the survivors go on as (`shrunk`: the
layout in force, or the nearest one that fits fewer workers and divides the global batch), or
why they cannot, and the controller falls back to the checkpoint. `grown` says what the run
grows to when new workers can join (orchestrator/cluster/growth.py starts them in the slots no
rank holds). `trained` writes the `resize` record once the first step on the new world has
trained.
"""

from __future__ import annotations

import dataclasses
import time

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job, accumulation
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.strategies.layout import Layout, LayoutError


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the survivors go on as: `keep[i]` is the old rank of new rank i; `step` is where they
    all stopped (the failed step is step + 1)."""

    layout: Layout
    keep: list[int]
    step: int
    lost: list[int]
    detected: float
    behind: list[int] = dataclasses.field(default_factory=list)  # kept ranks a step behind: they receive
    redo: int = 1  # steps to train again: the dropped one, or none where the loss came between steps


def pieces_lost(layout: Layout, lost: set[int] | list[int]) -> list[dict]:
    """The pieces of the state that only lost ranks held, as {"tp": t, "shard": j} (none: the
    survivors hold it all)."""
    held = {(r % layout.tp, (r // layout.tp) % layout.shard) for r in range(layout.world) if r not in set(lost)}
    return [{"tp": t, "shard": j} for t in range(layout.tp) for j in range(layout.shard) if (t, j) not in held]


def _same_shape(layout: Layout, n: int) -> Layout:
    """The layout in force, on `n` workers: the same tensor-parallel size or shard group where
    `n` allows it, else fsdp for a sharded one and data parallel for the rest."""
    from gearshift import strategies

    tries = []
    if layout.pp > 1:  # the same stages over fewer replicas where n allows it, else data parallel
        return Layout(layout.strategy, n // layout.pp, 1, 1, layout.pp) if n % layout.pp == 0 else Layout("data", n, 1)
    if layout.tp == 1 and layout.shard == 1:
        tries.append((layout.strategy, n, 1, 1))
    if layout.tp > 1 and n % layout.tp == 0:
        tries.append((layout.strategy, n // layout.tp, layout.tp, 1))
    if layout.shard > 1 and n % layout.shard == 0:
        tries.append((layout.strategy, n, 1, layout.shard))
    if layout.shard > 1 and "fsdp" in strategies.STRATEGIES:
        tries.append(("fsdp", n, 1, n))
    tries.append(("data", n, 1, 1))
    for strategy, dp, tp, shard in tries:
        try:
            return Layout(strategy, dp, tp, shard)
        except LayoutError:
            continue
    return Layout("data", n, 1, 1)


def _cover(layout: Layout, survivors: list[int], n: int, holders: list[int] | None = None) -> list[int] | None:
    """`n` of the survivors that between them hold every piece (one holder per piece first, then
    the others), holders first, each part in rank order; None if they cannot. `holders`: the
    survivors whose state counts (default: all); the others only receive."""
    holders = survivors if holders is None else holders
    first: dict[tuple, int] = {}
    for r in holders:
        first.setdefault((r % layout.tp, (r // layout.tp) % layout.shard), r)
    if len(first) > n or len(first) < layout.tp * layout.shard:
        return None
    chosen = set(first.values())
    for r in [*holders, *survivors]:
        if len(chosen) >= n:
            break
        chosen.add(r)
    return sorted(chosen, key=lambda r: (r not in holders, r))


def shrunk(job: Job, layout: Layout, survivors: list[int], micro: int | None,
           holders: list[int] | None = None) -> tuple[Layout, list[int]] | None:
    """The largest world of survivors (down to cluster.min_workers) whose layout divides the
    global batch (micro-batches included), and the survivors it keeps, `holders` (default: all)
    first; None if none does."""
    for n in range(len(survivors), job.min_workers - 1, -1):
        target = _same_shape(layout, n)
        batch = job.train.global_batch_size
        if batch % target.dp or accumulation(batch, micro, target.dp) is None:
            continue
        keep = _cover(layout, survivors, n, holders)
        if keep is not None:
            return target, keep
    return None


def _piece(layout: Layout, p: dict) -> str:
    parts = ([f"tensor slice {p['tp']}"] if layout.tp > 1 else []) + ([f"shard {p['shard']}"] if layout.shard > 1 else [])
    return " of ".join(parts) or "the whole state"


def grown(job: Job, layout: Layout, home: Layout, ready: int, top: int, micro: int | None) -> Layout | None:
    """The largest world up to `top` workers that `ready` joinable ones can make, whose layout
    divides the global batch: the run's own layout (`home`, before any shrink) once the world is
    its size again, else the layout in force on more workers; None if no larger one does."""
    for n in range(min(layout.world + ready, top), layout.world, -1):
        target = home if n == home.world else _same_shape(layout, n)
        batch = job.train.global_batch_size
        if not batch % target.dp and accumulation(batch, micro, target.dp) is not None:
            return target
    return None


class Elastic:
    """The resizes of one run (the summary's `resizes`) and the one waiting for its first step."""

    def __init__(self, report: Reporter):
        self.report = report
        self.resizes: list[dict] = []
        self._pending: dict | None = None
        self._said: tuple | None = None     # the last grow verdict recorded: (pays, target)
        self._price_at = 0                  # a grow that did not pay is priced again from this step

    def priced(self, policy, target: Layout, node_sizes: list[int], step: int, window: int) -> bool:
        """strategy auto: whether the grow to `target` (on nodes of `node_sizes`) pays, by the
        policy's cost model (policy/growing.py); the verdict is a `decision` record when it is new.
        Deciding by trial, the grow is not priced; with nothing measured yet it waits."""
        from gearshift.orchestrator.policy.adaptive import Report
        from gearshift.orchestrator.policy.growing import price_grow

        if not policy.predicting:
            return True
        if step < self._price_at:
            return False
        pays, evidence = price_grow(policy, target, node_sizes, step,
                                    [r["seconds"] for r in self.resizes if not r["from_checkpoint"]])
        if pays is None:
            return False
        if (pays, target) != self._said:
            self._said = (pays, target)
            self.report.decided(Report("grow" if pays else "no_grow", evidence), step)
        self._price_at = step if pays else step + window
        return pays

    def plan(self, err: WorkerFailed, failures: int, job: Job, layout: Layout, dropped: list[dict],
             micro: int | None, dead: list[int] = ()) -> Plan | str:
        """What the survivors of `err` go on as, or why they cannot (a sentence). `dead`: ranks the
        group finds gone now (a rank may report its step dropped, then die with its node). A
        worker lost while no step ran (`err.at_rest`: the final checkpoint, an evaluation) leaves
        every survivor at that step."""
        if getattr(err, "growing", None):
            return f"a worker was lost while {err.growing}, the state moving between worlds"
        rest = getattr(err, "at_rest", None)
        if rest is None and not getattr(err, "lost_ranks", None):
            return "no worker was lost inside the step loop"
        lost = sorted(set(getattr(err, "lost_ranks", None) or ()) | set(dead))
        if not lost:
            return "no worker was found gone (one stopped answering, or raised)"
        f = job.fault
        if f.max_failures != -1 and failures > f.max_failures:
            return "fault.max_failures is used up"
        if layout.pp > 1:  # the stages' ranks would be numbered anew: each survivor's stage may change
            return f"{layout} cannot go on in memory on fewer workers yet (a pipeline's stages are not moved between ranks)"
        gone = pieces_lost(layout, lost)
        if gone:
            return (f"{layout} held {len(gone)} piece(s) of the state only on the lost rank(s) {lost}: "
                    + ", ".join(_piece(layout, p) for p in gone[:4]) + (", ..." if len(gone) > 4 else ""))
        survivors = [r for r in range(layout.world) if r not in lost]
        if rest is not None:
            step, ahead, redo = rest + 1, survivors, 0
        else:
            step, ahead = self._stopped(layout, lost, survivors, dropped, getattr(err, "raised_ranks", ()))
            if isinstance(ahead, str):
                return ahead
            redo = 1
        found = shrunk(job, layout, survivors, micro, holders=ahead)
        if found is None:
            return (f"no layout on {job.min_workers} to {len(survivors)} of the survivors divides the global batch "
                    f"({job.train.global_batch_size}) (cluster.min_workers = {job.min_workers})")
        target, keep = found
        return Plan(target, keep, step - 1, sorted(lost), getattr(err, "detected", time.time()),
                    behind=[r for r in keep if r not in ahead], redo=redo)

    @staticmethod
    def _stopped(layout: Layout, lost: list[int], survivors: list[int], dropped: list[dict],
                 raised: list[int] = ()) -> tuple[int, list | str]:
        """Lost inside the step loop: the step the survivors dropped, and those that trained
        furthest (or why they cannot go on: a sentence in place of the list). A survivor whose
        loop raised with the loss (`raised`, stream.py) cannot say where it stopped: it counts a
        step behind and receives the state, as a new worker does."""
        dropped = [d for d in dropped if d["rank"] not in lost]
        if not dropped or sorted({d["rank"] for d in dropped} | set(raised)) != survivors:
            return 0, "not every survivor said where it stopped"
        # a collective can complete on some ranks and not on others when a peer dies inside it:
        # the survivors a step behind receive the state of those ahead, as a new worker does
        step = max(d["step"] for d in dropped)
        ahead = [d["rank"] for d in dropped if d["step"] == step]
        if any(d["step"] < step - 1 for d in dropped) or pieces_lost(layout, [r for r in range(layout.world)
                                                                             if r not in ahead]):
            return step, ("the survivors that trained furthest do not hold every piece (stopped: "
                          + ", ".join(f"rank {d['rank']} before step {d['step']}" for d in dropped) + ")")
        return step, ahead

    def resized(self, plan: Plan, old: Layout, err: WorkerFailed, failures: int, job: Job, seconds: float,
                lost_nodes: list[str], results: list[dict] = (), planned: float | None = None) -> None:
        """The survivors are on the new world: the failure record now, `resize` at the first step."""
        self.report.event("failure", step=plan.step + plan.redo, rank=err.rank, kind=err.kind, error=err.reason,
                          failures=failures, max_failures=job.fault.max_failures, dead_ranks=plan.lost,
                          lost_nodes=lost_nodes,
                          action=f"elastic: go on in memory from step {plan.step} on {len(plan.keep)} worker(s) "
                                 f"as {plan.layout}", steps_to_recompute=plan.redo)
        self._pending = {"from": old.to_dict(), "to": plan.layout.to_dict(), "lost_ranks": plan.lost,
                         "lost_nodes": lost_nodes,
                         "kept_ranks": plan.keep, "world_size": [old.world, plan.layout.world],
                         "from_checkpoint": False, "steps_redone": plan.redo, "regroup_seconds": seconds,
                         "detected": plan.detected, "restored_step": plan.step,
                         # where the seconds went: the loss seen to the plan made, forming the new
                         # group, laying the state out on it (the rest: the first step)
                         "phases": {"detect_s": (planned or plan.detected) - plan.detected,
                                    **_phases(seconds, results)}}
        self.report.say(f"step {plan.step + plan.redo}: rank(s) {plan.lost} lost -> going on in memory on "
                        f"{len(plan.keep)} worker(s) as {plan.layout} (the state is all on the survivors)")

    def grew(self, old: Layout, new: Layout, seconds: float, started: float, results: list[dict] = ()) -> None:
        """New workers joined: `resize` at the first step on the larger world."""
        self._pending = {"from": old.to_dict(), "to": new.to_dict(), "world_size": [old.world, new.world],
                         "joined": new.world - old.world, "from_checkpoint": False, "steps_redone": 0,
                         "regroup_seconds": seconds, "detected": started,
                         "phases": _phases(seconds, results)}
        self.report.say(f"{new.world - old.world} worker(s) joined: going on as {new} (no restart)")

    def let_go(self, old: Layout, new: Layout, ranks: list[int], seconds: float, started: float,
               results: list[dict] = ()) -> None:
        """adapt.stragglers drop: ranks let go, the others on the smaller world in memory; `resize`
        at its first step."""
        self._pending = {"from": old.to_dict(), "to": new.to_dict(), "world_size": [old.world, new.world],
                         "let_go": ranks, "reason": "straggler", "from_checkpoint": False, "steps_redone": 0,
                         "regroup_seconds": seconds, "detected": started, "phases": _phases(seconds, results)}
        self.report.say(f"rank(s) {ranks} let go as stragglers: going on as {new} (no restart)")

    def fell_back(self, why: str, restored_step: int, failed_at: int, old: Layout, world: int,
                  detected: float) -> None:
        """No shrink in memory: the restart from a checkpoint carries the `resize` record."""
        self.report.say(f"elastic: not in memory ({why}); restarting from the checkpoint")
        self._pending = {"from": old.to_dict(), "to": None, "world_size": [old.world, world],
                         "from_checkpoint": True, "why": why, "steps_redone": max(0, failed_at - restored_step),
                         "detected": detected, "restored_step": restored_step}

    def trained(self, record: dict, layout: Layout) -> None:
        """The first step after a resize: its record."""
        if self._pending is None:
            return
        r, self._pending = self._pending, None
        r["to"] = r["to"] or layout.to_dict()
        r["world_size"][1] = layout.world
        # to the end of that step on the workers (its record may come up to a report batch later)
        r["seconds"] = (record.get("ended_at") or time.time()) - r.pop("detected")
        self.resizes.append({"step": record["step"], **r})
        self.report.event("resize", step=record["step"], **r)
        if r.get("joined") or r.get("let_go"):
            self.report.say(f"step {record['step']}: training on {layout.world} worker(s), {r['seconds']:.1f} s after "
                            + ("the new ones were taken in" if r.get("joined") else "the straggler was let go"))
        else:
            self.report.say(f"step {record['step']}: training again on {layout.world} worker(s) {r['seconds']:.1f} s "
                            f"after the loss ({'from the checkpoint' if r['from_checkpoint'] else 'in memory'})")


def _phases(seconds: float, results: list[dict]) -> dict:
    """Where a regroup's seconds went (the slowest rank's forming of the new group, the rest the
    state laid out on it) and the largest peak resident memory of a worker process after it."""
    join = max((r.get("join_s", 0.0) for r in results), default=0.0)
    peak = max((r.get("peak_rss_bytes") or 0 for r in results), default=0)
    return {"join_s": join, "move_s": max(0.0, seconds - join), **({"peak_rss_bytes": peak} if peak else {})}


def dead_now(group) -> list[int]:
    """The ranks the group finds gone now (none where it cannot say)."""
    try:
        return sorted(group.dead_ranks())
    except Exception:  # noqa: BLE001 - the ranks the stream lost are what is known
        return []


def gone_nodes(infos: list[dict], lost: list[int], group, patience_s: float = 5.0) -> list[str]:
    """The nodes of the lost ranks that the cluster no longer counts alive (as recovery names
    them: "ip (id)"); none where the cluster knows of no nodes or cannot say. Ray marks a node
    dead after its health checks fail, some seconds after its processes went: where every rank
    of a node is lost (a node's loss is possible), wait up to `patience_s` for that; a node with
    a surviving rank is not gone, and nothing is waited for."""
    held = {infos[r].get("node_id"): infos[r].get("node_ip") for r in lost if r < len(infos)}
    kept = {i.get("node_id") for r, i in enumerate(infos) if r not in set(lost)}
    whole = {nid for nid in held if nid and nid not in kept}
    deadline = time.monotonic() + (patience_s if whole else 0.0)
    while True:
        try:
            alive = group.alive_node_ids()
        except Exception:  # noqa: BLE001 - worker losses, as far as is known
            return []
        if not alive:
            return []
        gone = [f"{ip} ({nid[:8]})" for nid, ip in held.items() if nid and nid not in alive]
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.25)
