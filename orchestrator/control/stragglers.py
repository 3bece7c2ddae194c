"""adapt.stragglers on a live run: the step records fed to the rebalancer
(orchestrator/policy/rebalance.py), and its decision carried out where the workers stop for it
(within two steps of the record that showed it, as a switch is), by `TrainWorker.set_shares` on
every rank at the same step boundary. A rebalance waits while a bucket-tuning round or a switch's
trial runs (their timings must not see the shares move), and every new layout, world or
micro-batch starts over on even shares: the workers' own reset (workers/build/builder.py).

Under `drop` a replica the rebalancer lets go leaves through the elastic shrink (the survivors
renumbered on a new process group, in memory, as after a lost worker; the global batch
unchanged), where only the layout allows it: the state held elsewhere, the survivors' world
dividing the batch, cluster.min_workers kept. Its slot is held out of the run's growth for
HOLD_OUT windows, twice as long each time a device is let go again; then the elastic growth takes
a worker there back, and the rebalancer judges it again on its speed.

Under a pipeline the stages are watched instead (orchestrator/policy/stages.py): a slow stage's
blocks move to the faster ones by `TrainWorker.recut` (the same pipeline cut again, the state
moved between the stages as in a switch), where the workers stop for it."""

from __future__ import annotations

import time

from gearshift.orchestrator.control.elastic import pieces_lost, shrunk
from gearshift.orchestrator.control.script import ScriptedWatch
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.policy.decisions import Report
from gearshift.orchestrator.policy.rebalance import WINDOW, Drop, DropRule, Rebalance, Rebalancer
from gearshift.orchestrator.policy.stages import Recut, StageBalancer

HOLD_OUT = 5     # windows a device let go waits before the run's growth may take it back
HOLD_OUT_MAX = 16  # the hold-out doubles for each further drop, up to this many times


class Stragglers:
    def __init__(self, ctl):
        self.ctl = ctl
        self.rebalancer: Rebalancer | None = None
        self.pending: tuple[Rebalance, int] | None = None  # the chunk's rebalance and the step it was seen
        self.shares: tuple[int, ...] | None = None  # the shares in force (None: even)
        self.stage_blocks: list[int] | None = None  # a pipeline's blocks a stage after a recut (None: the job's cut)
        self.held_until = 0  # drop: no worker is taken in before this step (a device let go is held out)
        self.drops = 0  # drop: the devices let go in this run

    def start_over(self) -> None:
        """Even shares on the layout in force (the workers are there already, or were just built)."""
        ctl = self.ctl
        mode, lay = ctl.job.adapt.stragglers, ctl.layout
        on = mode != "off" and ctl.job.telemetry.enabled
        if ctl.script is not None:  # a replay: the original's moves, at their steps (control/script.py)
            self.rebalancer = ScriptedWatch()
        elif on and lay.pp > 1:  # a pipeline's stages: their cut follows the speeds (a drop is not made)
            cut = ctl.group.call("pipeline_cut")[0]
            self.rebalancer = StageBalancer("report" if mode == "report" else "rebalance", lay, cut, ctl.infos,
                                            cooldown=ctl.job.adapt.cooldown,
                                            total_steps=ctl.job.train.steps) if cut else None
        elif on and lay.dp > 1:
            drop = DropRule(ctl.job.adapt.straggler_drop_ratio, self.may_drop) if mode == "drop" else None
            self.rebalancer = Rebalancer(mode, lay, ctl.job.train.global_batch_size, ctl.micro, ctl.infos,
                                         cooldown=ctl.job.adapt.cooldown, drop=drop)
        else:
            self.rebalancer = None
        if self.pending is not None:
            self._report(*self.pending, applied=None)
        self.pending, self.shares, self.stage_blocks = None, None, None

    @property
    def watching(self) -> bool:
        return self.rebalancer is not None

    def says(self, decision) -> bool:
        """Whether the policy's own straggler report (a rank computing long while the others wait,
        which holds its switches back) is this watcher's to say: it is watched here, and a
        `rebalance`, `drop`, `recut` or `straggler` record says it with the shares or blocks."""
        return self.rebalancer is not None and isinstance(decision, Report) and decision.kind == "straggler"

    def context(self) -> dict:
        """What the step records of the chunk about to run are stamped with."""
        return {**({"shares": list(self.shares)} if self.shares else {}),
                **({"stage_blocks": self.stage_blocks} if self.stage_blocks else {})}

    def observe(self, record: dict) -> bool:
        """Feed one step record; True where a rebalance is now waiting for the chunk to end."""
        ctl = self.ctl
        if self.rebalancer is None or self.pending is not None or ctl.tuning.active or self._on_trial():
            return False
        got = self.rebalancer.observe(record)
        if isinstance(got, Report):
            ctl.report.decided(got, record["step"], record["step"])
        elif isinstance(got, (Rebalance, Drop, Recut)):
            self.pending = (got, record["step"])
            return True
        return False

    def carry_out(self, step: int) -> None:
        """At chunk end `step`: the pending rebalance on every rank (the workers agree on nothing
        more: each takes the same list). A replay takes the original's move at `step`, if any."""
        if self.ctl.script is not None and self.ctl.script.straggler_at(step) is not None:
            self.pending = self.ctl.script.straggler_at(step)
        if self.pending is None:
            return
        decision, seen = self.pending
        self.pending = None
        if isinstance(decision, Drop):
            self._let_go(decision, seen, step)
            return
        if isinstance(decision, Recut):
            self._recut(decision, seen, step)
            return
        self.ctl.group.call("set_shares", list(decision.shares))
        self.rebalancer.applied(decision, step)
        self.shares = decision.shares
        self._report(decision, seen, applied=step)

    def may_drop(self, ranks: list[int]) -> str | None:
        """None where `ranks` can be let go in memory now; else why not."""
        ctl = self.ctl
        lay, job = ctl.layout, ctl.job
        if job.on_node_loss != "elastic" or not callable(getattr(ctl.group, "shrink", None)):
            return f"fault.on_node_loss is {job.on_node_loss}, not elastic"
        if pieces_lost(lay, ranks):
            return f"{lay} holds pieces of the state only on rank(s) {ranks}"
        survivors = [r for r in range(lay.world) if r not in ranks]
        if len(survivors) < job.min_workers:
            return f"cluster.min_workers is {job.min_workers}: {len(survivors)} worker(s) would be left"
        found = shrunk(job, lay, survivors, ctl.micro)
        if found is None or len(found[1]) < len(survivors):
            return (f"the global batch ({job.train.global_batch_size}) does not divide evenly over the "
                    f"{len(survivors)} worker(s) left")
        return None

    def _let_go(self, decision: Drop, seen: int, step: int) -> None:
        """At chunk end `step`: the dropped ranks leave, the others go on in memory on a new group."""
        ctl = self.ctl
        why = self.may_drop(list(decision.ranks))
        if why is not None:  # not expected: the world is the one the rule judged
            decision.evidence["not_dropped"] = why
            self._report(decision, seen, applied=None)
            return
        old = ctl.layout
        target, keep = shrunk(ctl.job, old, [r for r in range(old.world) if r not in decision.ranks], ctl.micro)
        self.drops += 1
        hold = HOLD_OUT * WINDOW * min(HOLD_OUT_MAX, 2 ** (self.drops - 1))
        self.held_until = step + hold
        decision.evidence.update(to=target.to_dict(), held_out_steps=hold, held_until=self.held_until)
        start = time.time()
        try:
            results = ctl.group.shrink(keep, target.to_dict(), [])
        except WorkerFailed as err:  # the state was moving between worlds: the checkpoint has it whole
            err.growing = f"rank(s) {list(decision.ranks)} were let go as stragglers"
            raise
        self._report(decision, seen, applied=step)
        ctl.on_world(target, [dict(ctl.infos[r], rank=i) for i, r in enumerate(keep)])
        ctl.elastic.let_go(old, target, list(decision.ranks), time.time() - start, start, results)
        ctl.group.joinable()  # a worker starts in the slot now (it never waits): warm when the hold-out ends

    def _recut(self, decision: Recut, seen: int, step: int) -> None:
        """At chunk end `step`: every rank cuts the pipeline again at the decision's blocks."""
        results = self.ctl.group.call("recut", list(decision.split))
        failed = next((r["failed"] for r in results if r.get("failed")), None)
        decision.evidence["seconds"] = max(r.get("seconds", 0.0) for r in results)
        if any("moved_bytes" in r for r in results):  # only the blocks that changed position crossed
            decision.evidence["moved_bytes"] = sum(r.get("moved_bytes", 0) for r in results)
            decision.evidence["relayout_bytes"] = sum(r.get("relayout_bytes", 0) for r in results)
        if failed is not None:  # the new stages could not be allocated: the old cut is in force, whole
            decision.evidence["not_carried_out"] = failed.get("message")
            self.rebalancer.not_allocated(decision)  # as a switch that ran out is: not tried again
            self._report(decision, seen, applied=None)
            return
        self.rebalancer.applied(decision, step)
        self.stage_blocks = decision.evidence["blocks_per_stage_after"]
        self._report(decision, seen, applied=step)

    def _report(self, decision: Rebalance, seen: int, applied: int | None) -> None:
        self.ctl.report.decided(decision, seen, applied)

    def _on_trial(self) -> bool:
        policy = self.ctl.policy
        standing = getattr(policy, "standing", None)
        return getattr(standing, "trial", None) is not None
