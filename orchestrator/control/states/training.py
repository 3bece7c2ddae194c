"""TRAINING: one chunk at a time, each to the next step at which something may change (the
forced schedule's steps, where a bucket-tuning trial ends, each eval step, where the policy may
decide or, elastic, where new workers may join), or sooner where the workers stopped for a
decision. At the chunk's end `next_boundary` (orchestrator/control/boundary.py) says what happens
there: training goes on, SWITCHING carries out a layout change, or FINISHING ends the run. A
step dropped on some rank goes the out-of-memory path (dropped_step.py) first."""

from __future__ import annotations

import dataclasses
import time

from gearshift.orchestrator.control.boundary import next_boundary
from gearshift.orchestrator.control.elastic import grown
from gearshift.orchestrator.control.finishing import at_rest
from gearshift.orchestrator.control.reporting import StepMerger
from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.control.states.dropped_step import DroppedStep
from gearshift.orchestrator.control.states.placing import node_sizes
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job, scheduled
from gearshift.orchestrator.policy.adaptive import Decision
from gearshift.strategies.layout import Layout

GROW_EVERY = 5  # elastic, below max_workers: steps between looks for workers that can join


class TrainingState:
    """`stoppable`: the workers can end a chunk early for a decision (WorkerGroup.stop_early);
    without it, chunks end where the policy may decide (`Policy.next_decision`)."""

    name = State.TRAINING

    def __init__(self, ctl):
        self.ctl = ctl
        self.stoppable = False
        self.dropped_step = DroppedStep(ctl)

    def begin(self, start_step: int) -> None:
        """Training (re)starts at `start_step`, on workers STARTING has just restored."""
        ctl = self.ctl
        job = ctl.job
        # a resumed run continues in the layout its schedule had in force at the resume point
        resumed_layout = scheduled_layout(job, start_step) if start_step else None
        if resumed_layout is not None and resumed_layout != ctl.layout:
            ctl.switch(resumed_layout, start_step, "schedule (resume)")
        ctl.schedule = [e for e in job.adapt.schedule if e["step"] > start_step]
        auto = job.parallel.strategy == "auto" and job.adapt.enabled and ctl.tuning.grid is None and ctl.script is None
        ctl.policy = ctl.make_policy() if auto else None
        ctl.stragglers.start_over()
        deciding = ctl.policy is not None or ctl.stragglers.watching
        self.stoppable = deciding and callable(getattr(ctl.group, "stop_early", None))
        ctl.step = start_step
        ctl.tuning.begin(start_step)
        if ctl.script is not None:  # a replay: what the original put in force at this boundary, first
            replayed, bucket = ctl.script.switch_at(start_step), ctl.script.bucket_at(start_step)
            # (a restart from this boundary's checkpoint, after the switch was carried out here
            # once: the layout is in force already, and a second switch record would be one the
            # original does not have)
            if replayed is not None and replayed.to != ctl.layout:
                ctl.switch(replayed.to, start_step, replayed.name, replayed.evidence, bucket=replayed.bucket)
            if bucket is not None:
                ctl.tuning.apply_bucket(bucket, start_step)

    def run(self) -> State:
        """Train one chunk, to the next step at which something may change (or sooner, where the
        workers stopped for a decision); what happens there."""
        ctl = self.ctl
        if ctl.step >= ctl.job.train.steps:
            return State.FINISHING
        if self._may_grow() and ctl.step > ctl.settling:
            self._grow()
        until = self._chunk_end(ctl.step)
        decision, kept, until = self._train_chunk(until)
        ctl.step = until
        if ctl.dropped:
            return self.dropped_step.run()
        if ctl.nan_rollback.due(ctl.job):  # fault.on_nan rollback: back to a checkpoint, at a lower rate
            ctl.job, ctl.step = ctl.nan_rollback.roll_back(ctl.job, ctl.group, until)
            return State.TRAINING
        with at_rest(until):
            ctl.evals.after_chunk(ctl.group, until, ctl.job.train.steps, ctl.layout)
        if ctl.script is not None and decision is None:  # a replay: the original's switch at this boundary
            decision = ctl.script.switch_at(until)
        tuning_over = ctl.tuning.chunk_done(until)
        due = ctl.schedule and ctl.schedule[0]["step"] == until
        boundary = next_boundary(until, ctl.job.train.steps, scheduled_layout(ctl.job, until) if due else None,
                                 decision, judged=ctl.policy is not None, tuning=ctl.tuning.active, kept=kept,
                                 tuning_over=tuning_over)
        if ctl.decided is not None and (boundary.to is None or boundary.reason != decision.name):
            ctl.record_decision(None)  # not carried out: the run ended, or the schedule came first
        if boundary.stop:
            return State.FINISHING
        if boundary.to is not None:
            ctl.boundary = boundary
            return State.SWITCHING
        ctl.stragglers.carry_out(until)
        if ctl.script is not None and ctl.script.bucket_at(until) is not None:  # a replay: the bucket put in force
            ctl.tuning.apply_bucket(ctl.script.bucket_at(until), until)
        ctl.tune_after(boundary)
        return State.TRAINING

    def _chunk_end(self, step: int) -> int:
        ctl = self.ctl
        until = ctl.evals.chunk_end(step, ctl.job.train.steps)  # evaluation runs where a chunk ends
        if ctl.schedule:
            until = min(until, ctl.schedule[0]["step"])
        if ctl.tuning.active:  # end the chunk where the trial ends
            until = min(until, ctl.tuning.trial_end)
        elif ctl.policy is not None and not self.stoppable:  # end the chunk where the policy may decide
            until = min(until, ctl.policy.next_decision(step))
        if self._may_grow():  # new workers are taken in where a chunk ends
            until = min(until, step + GROW_EVERY)
        elif ctl.stragglers.held_until > step:  # a device let go may be taken back from there
            until = min(until, ctl.stragglers.held_until)
        if ctl.script is not None and ctl.script.next_step(step) is not None:  # a replay's next move
            until = min(until, ctl.script.next_step(step))
        return until

    def _may_grow(self) -> bool:
        ctl = self.ctl
        n = ctl.job.cluster.num_workers  # a tuning round's trials are timed on one world: not during one
        # a pipeline's stages are not moved onto new workers in memory (strategies/pipeline/switch.py)
        # a device let go as a straggler is held out a while (orchestrator/control/stragglers.py)
        return (ctl.job.on_node_loss == "elastic" and n < ctl.max_workers and hasattr(ctl.group, "joinable")
                and not ctl.tuning.active and ctl.layout.pp == 1 and ctl.step >= ctl.stragglers.held_until)

    def _grow(self) -> None:
        """Elastic: workers placed since (a node joined, a lost worker's place came back) join
        the run here, with no restart: the state moves onto the larger world."""
        ctl = self.ctl
        target = grown(ctl.job, ctl.layout, ctl.home, ctl.group.joinable(), ctl.max_workers, ctl.micro)
        if target is None:
            return
        if ctl.policy is not None:  # strategy auto: a bigger world on a slow link may not pay
            infos = ctl.infos + ctl.group.joining(target.world - ctl.layout.world)
            sizes = node_sizes(dataclasses.replace(ctl.job, cluster=dataclasses.replace(
                ctl.job.cluster, num_workers=target.world)), infos)
            if not ctl.elastic.priced(ctl.policy, target, sizes, ctl.step, ctl.job.adapt.window):
                return
        start, old = time.time(), ctl.layout
        try:
            results = ctl.group.grow(target.world - old.world, target.to_dict())
        except WorkerFailed as err:  # the state was moving between worlds: the checkpoint has it whole
            err.growing = f"{target.world - old.world} new worker(s) joined as {target}"
            raise
        ctl.on_world(target, list(ctl.group.infos))
        ctl.elastic.grew(old, target, max(r["seconds"] for r in results), start, results)

    def _train_chunk(self, until: int) -> tuple[Decision | None, bool, int]:
        """Train to `until`. Returns the first switch or revert the policy asked for on the way
        (None: none), whether it kept a switch it had judged (its new layout may be tuned), and
        the step boundary the workers stopped at: `until`, or, when they can stop early, within
        two steps of the step whose record brought the decision."""
        ctl = self.ctl
        job, report = ctl.job, ctl.report
        merger = StepMerger(job.cluster.num_workers, job.train.global_batch_size,
                            {**ctl.layout.to_dict(), "bucket_cap_mb": ctl.tuning.bucket, **ctl.stragglers.context()},
                            ctl.tokens_per_sample)
        pending, kept, reached = None, False, ctl.step
        stoppable = self.stoppable and not ctl.tuning.active
        ctl.checkpoints.new_chunk()
        for rank, batch in self._stream(merger, until, stoppable):
            if "step_failed" in batch:  # this rank dropped its step; its loop has ended
                ctl.dropped.append(batch["step_failed"])
                continue
            report.samples(batch.get("samples", ()))
            if rank == 0:  # every rank saw the same bad step (their gradient norms agree)
                for bad in batch.get("non_finite", ()):
                    report.non_finite(bad)
                for anomaly in batch.get("grad_anomalies", ()):
                    report.grad_anomaly(anomaly)
                if batch.get("module_memory"):
                    report.event("module_memory", step=batch.get("first_step", 0) + 1, rank=0, top=batch["module_memory"])
            for record in merger.add(rank, batch):
                reached = record["step"]
                ctl.recovery.trained(record, job.cluster.num_workers)
                ctl.elastic.trained(record, ctl.layout)
                report.step(record)
                if ctl.tuning.active:
                    ctl.tuning.add(record)
                elif ctl.policy is not None:
                    decision = ctl.policy.observe(record)
                    if pending is None and decision.name in ("switch", "revert"):
                        pending, ctl.decided = decision, (decision, record["step"])
                        if stoppable and record["step"] < until:
                            ctl.group.stop_early()  # carried out where the workers stop
                    elif ctl.stragglers.says(decision):  # a straggler the rebalancer watches: its record says it
                        pass
                    elif decision.name != "keep" or decision.evidence:  # a kept switch is news too
                        report.decided(decision, record["step"], record["step"])
                        kept = kept or decision.name == "keep"
                if pending is None and ctl.stragglers.observe(record) and stoppable and record["step"] < until:
                    ctl.group.stop_early()  # the new shares are taken where the workers stop
            if "profile" in batch:  # train.profile's window ended on this rank
                report.profiled(rank, batch["profile"])
            ctl.checkpoints.add(batch, job.cluster.num_workers)
        return pending, kept, reached if stoppable or ctl.dropped else until

    def _stream(self, merger: StepMerger, until: int, stoppable: bool):
        """The workers' reports; where ranks were lost, the steps they never reported are recorded
        over the ranks that did (`partial`) before the failure goes on to RECOVERING."""
        ctl = self.ctl
        try:
            yield from ctl.group.train(until, ctl.job.checkpoint.every, last_step=ctl.job.train.steps,
                                       **({"stoppable": True} if stoppable else {}))
        except WorkerFailed as err:
            if getattr(err, "lost_ranks", None):
                for record in merger.partial():
                    ctl.report.step(record)
            raise


def scheduled_layout(job: Job, step: int) -> Layout | None:
    """The layout the forced schedule has in force at `step` (None: the schedule says nothing)."""
    entries = [e for e in job.adapt.schedule if e["step"] <= step]
    if not entries:
        return None
    return scheduled(job, entries[-1])
