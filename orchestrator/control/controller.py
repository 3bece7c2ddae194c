"""The controller: an explicit state machine that places the workers, streams their reports,
writes checkpoints and the run's outputs, and tears everything down whatever happens.

    PLACING -> STARTING -> TRAINING <-> SWITCHING
       ^                      |  ^  \\-> FINISHING -> DONE
       |                      v  |     (elastic: the survivors go on in memory, orchestrator/control/elastic.py)
       \\------------- RECOVERING        (a worker lost in PLACING, STARTING, SWITCHING or FINISHING too)

    any state -> FAILED                 (an error no restart fixes, fault.max_failures used up, Ctrl-C)

`run()` is a loop over `_step()`, which carries out one state and returns the next. Training
runs in chunks that end where something may change: at the forced schedule's steps, where a
bucket-tuning trial ends, and at each eval step (eval.every; orchestrator/evaluation.py evaluates
there, on all ranks, before anything else happens at that boundary). Under `strategy: auto` a
switch or revert ends its chunk early: the workers stop for it within two steps of the step whose
record brought it (`WorkerGroup.stop_early`; a group that cannot has its chunks end where the
policy may decide, `next_decision`). A step dropped for an out-of-memory error on any rank ends
the chunk too: the workers form a new process group and go on at that step with less
(orchestrator/control/memory.py). At each chunk's end `next_boundary` (orchestrator/boundary.py) says what
happens there, and the controller carries it out, on the same workers (`reshard`), all ranks
at the same step boundary. A worker failure in any state but RECOVERING goes to RECOVERING
(orchestrator/recovery.py), which restarts from a checkpoint or gives up.

Every state entered is announced as a `state` event, except RECOVERING, which its `failure`
event announces (readers know placing, starting, training, switching, finishing, done and failed).
FINISHING (orchestrator/control/finishing.py) writes the final checkpoint and final.pt: a worker
lost there is recovered from like anywhere else.

What is injected, so that tests can swap it: the worker group (`group_factory`, a
`WorkerGroup`), the policy (`policy_factory`), and the bucket-tuning driver (`tuning`; `gearshift
tune` hands in one with a grid). Records and terminal lines go through `Reporter`
(orchestrator/reporting.py).
"""

from __future__ import annotations

import dataclasses
import enum
import time
import traceback
from typing import Callable

from gearshift.monitoring.progress import ProgressView
from gearshift.orchestrator.control.boundary import Boundary, Then, next_boundary
from gearshift.orchestrator.control.bucket_tuning import BucketTuning, initial_bucket
from gearshift.orchestrator.control.checkpoints import Checkpoints
from gearshift.orchestrator.errors import GearshiftError, WorkerFailed
from gearshift.orchestrator.control.elastic import Elastic, Plan, dead_now, gone_nodes, grown
from gearshift.orchestrator.control.evaluation import Evaluation
from gearshift.orchestrator.control.finishing import Finishing, at_rest
from gearshift.orchestrator.control.memory import OutOfMemory
from gearshift.orchestrator.control import startup
from gearshift.orchestrator.job import Job, scheduled
from gearshift.orchestrator.policy.adaptive import Decision, Policy
from gearshift.orchestrator.policy.for_job import job_policy, layout_candidates
from gearshift.orchestrator.control.recovery import Recovery
from gearshift.orchestrator.control.rollback import NanRollback
from gearshift.orchestrator.control.reporting import Reporter, StepMerger
from gearshift.orchestrator.records.rundir import RunDir, earlier_history
from gearshift.orchestrator.cluster.worker_group import WorkerGroup
from gearshift.strategies.layout import Layout


GROW_EVERY = 5  # elastic, below max_workers: steps between looks for workers that can join


class State(enum.Enum):
    PLACING = "placing"
    STARTING = "starting"
    TRAINING = "training"
    SWITCHING = "switching"
    FINISHING = "finishing"
    RECOVERING = "recovering"
    DONE = "done"
    FAILED = "failed"


PolicyFactory = Callable[[Job, Layout, list[int], "int | None"], Policy]  # the last: device memory (bytes)


class Controller:
    def __init__(self, job: Job, run: RunDir, group_factory: Callable[[Job], WorkerGroup],
                 resume: tuple[str, dict] | None = None, view: ProgressView | None = None,
                 policy_factory: PolicyFactory = job_policy, tuning: BucketTuning | None = None):
        self.job = job
        self.run_dir = run
        self.group_factory = group_factory
        self.policy_factory = policy_factory
        self.resume = resume  # (checkpoint name, state) to continue from
        self.report = Reporter(job, run, view)
        self.checkpoint_root = run.checkpoint_root(job.checkpoint, job.base_dir)  # checkpoint.path, or the run dir's
        self.recovery = Recovery(self.report, self.checkpoint_root)
        self.nan_rollback = NanRollback(self.report, self.checkpoint_root)
        self.elastic = Elastic(self.report)
        self.home = job.layout  # elastic: the layout a run grows back to at its own size
        self.max_workers = job.cluster.max_workers or job.cluster.num_workers
        self._settling = -1  # elastic: the step of the last shrink (no worker is started before its first chunk)
        self.tuning = tuning or BucketTuning()
        self.tuning.attach(self)
        self.checkpoints = Checkpoints(job, self.checkpoint_root, self.report)
        self.evals = Evaluation(job, self.report, self.checkpoint_root, self.checkpoints.save_now)
        self.memory = OutOfMemory(job, self.report)
        self.finishing = Finishing(self)
        self.micro = job.train.micro_batch_size  # the micro-batch in force (None: a rank's whole share)
        self.state = State.PLACING
        self.layout = job.layout  # the layout in force now
        self.history: list[dict] = []
        self.switches: list[dict] = []
        self.node_sizes: list[int] = [job.cluster.num_workers]
        self.policy: Policy | None = None
        self.group: WorkerGroup | None = None
        self.infos: list[dict] = []
        self.summary: dict = {}
        self.tokens_per_sample: int | None = None
        self.start_step = 0   # where the workers started training last
        self.step = 0         # the step boundary the workers are at
        self._load = resume   # what STARTING loads into the workers: the resume point, or a recovery's checkpoint
        self._restart = False  # STARTING after a failure: the workers are restored, not resumed
        self._failure: WorkerFailed | None = None
        self._failures = 0
        self._schedule: list[dict] = []  # forced switches still ahead
        self._boundary: Boundary | None = None  # the boundary SWITCHING carries out
        self._stoppable = False  # the workers can end a chunk early for a decision (WorkerGroup.stop_early)
        self._start_choice: dict | None = None  # strategy auto: where it started, and every layout's prediction
        self._decided: tuple[Decision, int] | None = None  # the chunk's switch or revert, and the step it was seen
        self._dropped: list[dict] = []  # the chunk's step that ranks dropped (out of memory here or on a peer)

    # ------------------------------------------------------------------ the state machine

    def run(self) -> dict:
        t0 = time.time()
        self.summary = {"job": self.job.name, "fingerprint": self.job.fingerprint(),
                        "run_dir": str(self.run_dir.path), "steps_target": self.job.train.steps}
        try:
            self.run_dir.write_driver()
            self.report.open()
            state = State.PLACING
            while state is not State.DONE:
                state = self._step(state)
        except BaseException as err:  # whatever ends the run, the run dir says so
            self._failed(err)
            raise
        finally:
            self._close(time.time() - t0)
        return self.summary

    def _step(self, state: State) -> State:
        """Carry out `state`; the state that follows. A worker lost in any state is RECOVERING's to
        handle; a failure in RECOVERING itself (nothing to recover to) ends the run."""
        if state is State.RECOVERING:
            return self._recover()
        handler = {State.PLACING: self._place, State.STARTING: self._start, State.TRAINING: self._train,
                   State.SWITCHING: self._switching, State.FINISHING: self._finish}[state]
        try:
            return handler()
        except WorkerFailed as err:
            self._failure = err
            return State.RECOVERING

    def _enter(self, state: State, **fields) -> None:
        self.state = state
        self.report.event("state", state=state.value, **fields)

    # ------------------------------------------------------------------ the states

    def _say_how_checkpoints_go(self, info: dict) -> None:
        """At a run's start: how the workers reach the checkpoints, where it costs."""
        if info.get("checkpoint_served"):
            self.report.say(f"checkpoints: the workers do not all see {self.checkpoint_root}; they write and read "
                            "their shards there through a file server on this node (give checkpoint.path a folder "
                            "every node shares, or an object store, to spare this node's network)")
        if info.get("checkpoint_format") == "full" and self.job.checkpoint.format == "auto":
            # some worker reaches the checkpoints' place by no route: the full format, gathered a tensor at a time
            self.report.say("checkpoints: not every worker reaches " + str(self.checkpoint_root) + ", so each "
                            "checkpoint is gathered whole, a tensor at a time, into one file (format full); "
                            "give checkpoint.path an object store or a folder every node shares to write shards")

    def _place(self) -> State:
        job = self.job
        self._enter(State.PLACING, workers=job.cluster.num_workers, placement=job.cluster.placement)
        self.group = self.group_factory(job)
        if job.parallel.strategy == "auto" and job.adapt.enabled and self.tuning.grid is None:
            self.group.choose_layout = self._starting_layout  # auto starts where the model fits
        self.infos = self.group.start()
        return State.STARTING

    def _starting_layout(self, infos: list[dict]) -> Layout:
        """strategy auto: the least-sharded layout (the one needing the most memory among those
        that fit) the memory model predicts fits the workers' devices (free memory, each worker's
        share of its host's on CPU), given the workers' `device_memory` before the model is built.
        Nothing fits: a GearshiftError with every layout's prediction."""
        from gearshift.orchestrator.policy import costmodel

        job, device = self.job, device_memory(infos)
        if device is None:
            return job.layout
        check = costmodel.memory_check(job, device, model=costmodel.shape_of_job(job))
        table = []
        for layout in layout_candidates(job, node_sizes(job, infos), sharded=True):
            ok, said = check(layout)
            table.append((layout, ok, said["predicted_bytes"]))
        fitting = [row for row in table if row[1]]
        self._start_choice = {"available_bytes": device,
                              "predictions": [{**lay.to_dict(), "predicted_bytes": need, "fits": ok}
                                              for lay, ok, need in table]}
        if not fitting:
            rows = "; ".join(f"{lay}: {need / costmodel.GiB:.2f} GiB" for lay, _, need in table)
            raise GearshiftError(
                f"strategy auto: the model fits no layout the workers can take. Predicted memory per worker "
                f"against {device / costmodel.GiB:.2f} GiB free: {rows}. Use more workers, a smaller "
                "micro-batch (train.micro_batch_size), activation checkpointing, or bigger devices.")
        chosen = max(fitting, key=lambda row: row[2])[0]  # first of equals: the candidates' order
        self._start_choice["layout"] = chosen.to_dict()
        return chosen

    def _start(self) -> State:
        """Restore the checkpoint into the started workers, and the layout and bucket in force."""
        job, infos, restart = self.job, self.infos, self._restart
        started = Layout.from_dict(infos[0]["layout"]) if infos[0].get("layout") else None
        if started is not None and started != job.layout and job.layout.strategy == "hsdp":  # hsdp's group, by placement
            job = self.job = dataclasses.replace(job, parallel=dataclasses.replace(
                job.parallel, shard_size=infos[0]["layout"].get("shard", 1)))
        keys = ("rank", "dp_rank", "node_ip", "node_id", "pid", "gpu_ids", "backend", "compiled")
        self._enter(State.STARTING, workers=[{k: i.get(k) for k in keys} for i in infos],
                    layout=job.layout.to_dict(), tp_groups=job.layout.tp_groups() if job.layout.tp > 1 else [],
                    **({"fsdp_units": infos[0]["fsdp_units"]} if infos[0].get("fsdp_units") else {}),
                    **({"build": infos[0]["build"]} if infos[0].get("build") else {}),
                    **({"recomputed": infos[0]["recomputed"]} if infos[0].get("recomputed") is not None else {}),
                    **({"checkpoint_format": infos[0]["checkpoint_format"]} if infos[0].get("checkpoint_format") else {}),
                    **({"checkpoint_served": True} if infos[0].get("checkpoint_served") else {}))
        units = infos[0].get("fsdp_units") or {}
        if units.get("found_by") == "none" and job.layout.shard > 1 and not restart:  # sharded, one unit
            self.report.say(f"fsdp units: {units['note']}")
        if job.train.activation_checkpointing is True and job.model.entrypoint and infos[0].get("recomputed") == 0 \
                and not restart:
            self.report.say("activation checkpointing: the model has no blocks to checkpoint (no FSDP units found); "
                            "name them in train.activation_checkpointing")
        if not restart:
            self._say_how_checkpoints_go(infos[0])
        for line in () if restart else startup.build_lines(infos[0].get("build") or {}, loaded=bool(self._load)):
            self.report.say(line)
        for info in infos:
            if info.get("sampler") and not restart:
                self.report.event("sampler", rank=info["rank"], **info["sampler"])
        self.tokens_per_sample = infos[0].get("tokens_per_sample")
        start_step = 0
        if self._load:
            start_step, name = self.checkpoints.load_into(self.group, self._load)  # each worker checks its share
            self.finishing.loaded(start_step)
            self.report.event("restored" if restart else "resumed", checkpoint=name, step=start_step)
        elif job.model.pretrained:  # a fresh start from pretrained weights: each rank reads its slices
            startup.load_pretrained(self.group, job.model.pretrained, self.report, self.run_dir.source)
        self._restore_layout(start_step)
        self.summary.update(world_size=len(infos), backend=infos[0].get("backend"),
                            nodes=sorted({i["node_ip"] for i in infos}), parameters=infos[0].get("parameters"),
                            strategy_history=self.history, switches=self.switches, tuning=self.tuning.rounds,
                            failures=self.recovery.failures, non_finite_steps=self.report.skipped,
                            oom=self.memory.records, resizes=self.elastic.resizes,
                            rollbacks=self.nan_rollback.rollbacks)
        self.summary.setdefault("resumed_from_step", start_step if self._load and not restart else None)
        self.node_sizes = node_sizes(job, infos)
        self._enter(State.TRAINING, from_step=start_step, steps_target=job.train.steps)
        self.report.start_view(start_step)
        self.start_step = start_step
        self._begin_training(start_step)
        return State.TRAINING

    def _train(self) -> State:
        """Train one chunk, to the next step at which something may change (or sooner, where the
        workers stopped for a decision); what happens there."""
        if self.step >= self.job.train.steps:
            return State.FINISHING
        if self._may_grow() and self.step > self._settling:
            self._grow()
        until = self._chunk_end(self.step)
        decision, kept, until = self._train_chunk(until)
        self.step = until
        if self._dropped:
            return self._out_of_memory()
        if self.nan_rollback.due(self.job):  # fault.on_nan rollback: back to a checkpoint, at a lower rate
            self.job, self.step = self.nan_rollback.roll_back(self.job, self.group, until)
            return State.TRAINING
        with at_rest(until):
            self.evals.after_chunk(self.group, until, self.job.train.steps, self.layout)
        tuning_over = self.tuning.chunk_done(until)
        due = self._schedule and self._schedule[0]["step"] == until
        boundary = next_boundary(until, self.job.train.steps, scheduled_layout(self.job, until) if due else None,
                                 decision, judged=self.policy is not None, tuning=self.tuning.active, kept=kept,
                                 tuning_over=tuning_over)
        if self._decided is not None and (boundary.to is None or boundary.reason != decision.name):
            self._record_decision(None)  # not carried out: the run ended, or the schedule came first
        if boundary.stop:
            return State.FINISHING
        if boundary.to is not None:
            self._boundary = boundary
            return State.SWITCHING
        self._tune_after(boundary)
        return State.TRAINING

    def _switching(self) -> State:
        """Carry out the boundary that changes the layout."""
        b, step = self._boundary, self.step
        if b.abandon_tuning:
            self.tuning.abandon(step)  # a new layout is coming: its own round follows
        if self._decided is not None:
            self._record_decision(step)
        self.switch(b.to, step, b.reason, b.evidence)
        if b.scheduled:
            self._schedule.pop(0)
        if b.tell_policy:
            done = self.switches[-1] if self.switches and self.switches[-1]["step"] == step else None
            self.policy.switched(self.layout, step, done["seconds"] if done else None)
        self._tune_after(b)
        return State.TRAINING

    def _recover(self) -> State:
        self.state = State.RECOVERING  # not announced: the failure event says it
        self._failures += 1
        detected = getattr(self._failure, "detected", time.time())
        stats = self.report.stats
        failed_at = stats.last["step"] if stats.last else 0
        self.tuning.reset()
        dropped, self._dropped = self._dropped, []
        why = None
        if self.job.on_node_loss == "elastic" and self.group is not None:
            plan = self.elastic.plan(self._failure, self._failures, self.job, self.layout, dropped, self.micro,
                                     dead=dead_now(self.group))
            if isinstance(plan, Plan):
                try:
                    return self._shrink(plan)
                except WorkerFailed as err:  # lost again while resizing: restart from the checkpoint
                    self._failure, why = err, f"the resize failed: {err.reason}"
            else:
                why = plan
        group, self.group = self.group, None
        old = self.layout
        # raises when the failure is not one a restart can fix
        self.job, self._load = self.recovery.recover(self._failure, self._failures, self.job, group, self.infos,
                                                     failed_at, elastic=why)
        if why is not None:
            self.elastic.fell_back(why, self._load[1]["step"] if self._load else 0, failed_at, old,
                                   self.job.cluster.num_workers, detected)
        self._restart = True
        return State.PLACING

    def _shrink(self, plan: Plan) -> State:
        """Elastic: the survivors form a new group in memory and go on at the step that failed."""
        start, old, err = time.time(), self.layout, self._failure
        lost_nodes = gone_nodes(self.infos, plan.lost, self.group)
        results = self.group.shrink(plan.keep, plan.layout.to_dict(), plan.behind)
        steps = sorted({r["step"] for r in results})
        if steps != [plan.step]:
            raise WorkerFailed(None, f"after the resize the survivors are at steps {steps}, not {plan.step}",
                               kind=WorkerFailed.SILENT)
        self.step = self._settling = plan.step  # the first chunk trains at once: new workers are started later
        self._on_world(plan.layout, [dict(self.infos[r], rank=i) for i, r in enumerate(plan.keep)])
        self.elastic.resized(plan, old, err, self._failures, self.job, time.time() - start, lost_nodes, results,
                             planned=start)
        self._enter(State.TRAINING, from_step=plan.step, steps_target=self.job.train.steps)
        self.tuning.begin(plan.step)
        return State.TRAINING

    def _finish(self) -> State:
        self._enter(State.FINISHING, step=self.step)
        step = self.finishing.run()
        self._enter(State.DONE, step=step)
        self.summary["status"] = "done"
        return State.DONE

    def _failed(self, err: BaseException) -> None:
        interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
        self.summary["status"] = "interrupted" if interrupted else "failed"
        self.summary["error"] = (f"interrupted ({err})" if interrupted and str(err) else
                                 "interrupted by the user" if interrupted else
                                 str(err) if isinstance(err, GearshiftError) else f"{type(err).__name__}: {err}")
        if isinstance(err, WorkerFailed) and err.details:
            self.run_dir.log.write_text(err.details)
        elif not interrupted and not isinstance(err, GearshiftError):
            self.run_dir.log.write_text("".join(traceback.format_exception(err)))
        self._enter(State.FAILED, error=self.summary["error"])

    def _close(self, wall: float) -> None:
        self.report.close_view()
        if self.group is not None:
            self.group.shutdown(polite=self.state is State.DONE)
        self.summary.update(self.report.figures(self.start_step, self.tuning.bucket, wall), **self.evals.figures())
        self.run_dir.write_summary(self.summary)
        self.report.close()

    # ------------------------------------------------------------------ training

    def _restore_layout(self, start_step: int) -> None:
        """The workers start in the job's layout; after a failure the layout and bucket in force
        when they were lost come back."""
        layout = self._start_layout()
        before = self.layout if self._restart else None
        self.layout = layout
        if self._restart:
            self.tuning.bucket = initial_bucket(self.job)
            if before is not None and before != layout and before.world == layout.world:
                self.switch(before, start_step, "restore")
            self.history = [h for h in self.history if h["step"] < start_step]
            self.history.append(self._history_entry(start_step, self.layout))
        else:
            earlier = earlier_history(self.run_dir, start_step) if self.resume else []
            self.history = earlier + [self._history_entry(start_step, layout)]

    def _start_layout(self) -> Layout:
        """The layout the workers were built in: the job's, or where strategy auto started."""
        chosen = (self._start_choice or {}).get("layout")
        return Layout.from_dict(chosen) if chosen else self.job.layout

    def _begin_training(self, start_step: int) -> None:
        job = self.job
        # a resumed run continues in the layout its schedule had in force at the resume point
        resumed_layout = scheduled_layout(job, start_step) if start_step else None
        if resumed_layout is not None and resumed_layout != self.layout:
            self.switch(resumed_layout, start_step, "schedule (resume)")
        self._schedule = [e for e in job.adapt.schedule if e["step"] > start_step]
        auto = job.parallel.strategy == "auto" and job.adapt.enabled and self.tuning.grid is None
        self.policy = self._make_policy() if auto else None
        self._stoppable = self.policy is not None and callable(getattr(self.group, "stop_early", None))
        self.step = start_step
        self.tuning.begin(start_step)

    def _chunk_end(self, step: int) -> int:
        until = self.evals.chunk_end(step, self.job.train.steps)  # evaluation runs where a chunk ends
        if self._schedule:
            until = min(until, self._schedule[0]["step"])
        if self.tuning.active:  # end the chunk where the trial ends
            until = min(until, self.tuning.trial_end)
        elif self.policy is not None and not self._stoppable:  # end the chunk where the policy may decide
            until = min(until, self.policy.next_decision(step))
        if self._may_grow():  # new workers are taken in where a chunk ends
            until = min(until, step + GROW_EVERY)
        return until

    def _may_grow(self) -> bool:
        n = self.job.cluster.num_workers  # a tuning round's trials are timed on one world: not during one
        return (self.job.on_node_loss == "elastic" and n < self.max_workers and hasattr(self.group, "joinable")
                and not self.tuning.active)

    def _grow(self) -> None:
        """Elastic: workers placed since (a node joined, a lost worker's place came back) join
        the run here, with no restart: the state moves onto the larger world."""
        target = grown(self.job, self.layout, self.home, self.group.joinable(), self.max_workers, self.micro)
        if target is None:
            return
        if self.policy is not None:  # strategy auto: a bigger world on a slow link may not pay
            infos = self.infos + self.group.joining(target.world - self.layout.world)
            sizes = node_sizes(dataclasses.replace(self.job, cluster=dataclasses.replace(
                self.job.cluster, num_workers=target.world)), infos)
            if not self.elastic.priced(self.policy, target, sizes, self.step, self.job.adapt.window):
                return
        start, old = time.time(), self.layout
        try:
            results = self.group.grow(target.world - old.world, target.to_dict())
        except WorkerFailed as err:  # the state was moving between worlds: the checkpoint has it whole
            err.growing = f"{target.world - old.world} new worker(s) joined as {target}"
            raise
        self._on_world(target, list(self.group.infos))
        self.elastic.grew(old, target, max(r["seconds"] for r in results), start, results)

    def _on_world(self, layout: Layout, infos: list[dict]) -> None:
        """Elastic: the run goes on as `layout` on the workers of `infos`, from self.step."""
        self.job = dataclasses.replace(self.job, cluster=dataclasses.replace(self.job.cluster,
                                                                             num_workers=layout.world))
        self.infos, self.layout = infos, layout
        self.node_sizes = node_sizes(self.job, infos)
        self.history.append(self._history_entry(self.step, layout))
        self.summary["world_size"] = layout.world
        if self.policy is not None:  # the candidates of the new world
            self.policy = self._make_policy()

    def _train_chunk(self, until: int) -> tuple[Decision | None, bool, int]:
        """Train to `until`. Returns the first switch or revert the policy asked for on the way
        (None: none), whether it kept a switch it had judged (its new layout may be tuned), and
        the step boundary the workers stopped at: `until`, or, when they can stop early, within
        two steps of the step whose record brought the decision."""
        job, report = self.job, self.report
        merger = StepMerger(job.cluster.num_workers, job.train.global_batch_size,
                            {**self.layout.to_dict(), "bucket_cap_mb": self.tuning.bucket}, self.tokens_per_sample)
        pending, kept, reached = None, False, self.step
        stoppable = self._stoppable and not self.tuning.active
        self.checkpoints.new_chunk()
        for rank, batch in self._stream(merger, until, stoppable):
            if "step_failed" in batch:  # this rank dropped its step; its loop has ended
                self._dropped.append(batch["step_failed"])
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
                self.recovery.trained(record, job.cluster.num_workers)
                self.elastic.trained(record, self.layout)
                report.step(record)
                if self.tuning.active:
                    self.tuning.add(record)
                elif self.policy is not None:
                    decision = self.policy.observe(record)
                    if pending is None and decision.name in ("switch", "revert"):
                        pending, self._decided = decision, (decision, record["step"])
                        if stoppable and record["step"] < until:
                            self.group.stop_early()  # carried out where the workers stop
                    elif decision.name != "keep" or decision.evidence:  # a kept switch is news too
                        report.decided(decision, record["step"], record["step"])
                        kept = kept or decision.name == "keep"
            if "profile" in batch:  # train.profile's window ended on this rank
                report.profiled(rank, batch["profile"])
            self.checkpoints.add(batch, job.cluster.num_workers)
        return pending, kept, reached if stoppable or self._dropped else until

    def _stream(self, merger: StepMerger, until: int, stoppable: bool):
        """The workers' reports; where ranks were lost, the steps they never reported are recorded
        over the ranks that did (`partial`) before the failure goes on to RECOVERING."""
        job = self.job
        try:
            yield from self.group.train(until, job.checkpoint.every, last_step=job.train.steps,
                                        **({"stoppable": True} if stoppable else {}))
        except WorkerFailed as err:
            if getattr(err, "lost_ranks", None):
                for record in merger.partial():
                    self.report.step(record)
            raise

    def _out_of_memory(self) -> State:
        """Ranks dropped a step, every one at the same boundary (self.step): out of memory on one of
        them (orchestrator/control/memory.py says what follows), or a collective that lost a peer
        for another reason, which is a worker failure."""
        dropped, self._dropped = self._dropped, []
        if not any(f["kind"].startswith("oom") for f in dropped):
            f = dropped[0]
            raise WorkerFailed(f["rank"], f"a collective lost its peer mid-step: {f['message']}",
                               details=f["message"], kind=WorkerFailed.RAISED)
        if self._decided is not None:  # the move waits: the policy decides again on the setting that fits
            self._record_decision(None)
        action = self.memory.after_step(dropped, self.layout, self.micro, self._oom_candidates(),
                                        device_memory(self.infos))
        self.group.regroup()
        if action.kind == "shard":
            self.switch(action.setting.layout, self.step, "oom")
        self.micro = action.setting.micro_batch
        self.group.call("set_micro_batch", self.micro)
        if self.policy is not None:
            self.policy.switched(self.layout, self.step)
            self.policy.exclude(*self.memory.layouts_not_fitting)
        return State.TRAINING

    def _oom_candidates(self) -> list[Layout]:
        return layout_candidates(self.job, self.node_sizes, sharded=True)

    def _record_decision(self, applied: int | None) -> None:
        """The chunk's switch or revert, with the step it was seen at and the step it was carried
        out at (None: it was not)."""
        (decision, seen), self._decided = self._decided, None
        self.report.decided(decision, seen, applied)

    def _tune_after(self, boundary: Boundary) -> None:
        if boundary.then is Then.REMEMBERED:
            self.tuning.maybe_tune(self.step, only_remembered=True)
        elif boundary.then is Then.TUNE:
            self.tuning.maybe_tune(self.step)

    def _make_policy(self) -> Policy:
        policy = self.policy_factory(self.job, self.layout, self.node_sizes, device_memory(self.infos))
        c = policy.config
        self.report.event("policy", candidates=[layout.to_dict() for layout in policy.candidates],
                          node_sizes=self.node_sizes, threshold=c.threshold, window=c.window, cooldown=c.cooldown,
                          decide=c.decide, **({"start": self._start_choice} if self._start_choice else {}))
        return policy

    # ------------------------------------------------------------------ what the states share

    def switch(self, target: Layout, step: int, reason: str, evidence: dict | None = None,
               bucket: float | None = None) -> None:
        """Carry out a layout change on the running workers, at step boundary `step` (with
        `bucket`, a new bucket_cap_mb at the same time)."""
        old = self.layout
        self._enter(State.SWITCHING, step=step, to=target.to_dict())
        results = self.group.call("reshard", target.to_dict(), bucket)
        failed = [r["failed"] for r in results if r.get("failed")]
        if failed:  # some rank could not allocate the new layout: every rank is on the old one, whole
            self.memory.in_switch(failed, old, target, self.micro)
            if self.policy is not None:
                self.policy.exclude(target)
            self._enter(State.TRAINING, from_step=step, steps_target=self.job.train.steps)
            return
        seconds = max(r["seconds"] for r in results)
        self.layout = target
        if bucket is not None:
            self.tuning.bucket = bucket
        record = {"step": step, "from": old.to_dict(), "to": target.to_dict(), "seconds": seconds, "reason": reason}
        self.switches.append(record)
        self.history.append(self._history_entry(step, target))
        self.report.switched(record, evidence, old, target)
        self._enter(State.TRAINING, from_step=step, steps_target=self.job.train.steps)

    def note_layout(self, step: int) -> None:
        """The layout history gets an entry: the bucket in force changed at `step`."""
        self.history.append(self._history_entry(step, self.layout))

    def _history_entry(self, step: int, layout: Layout) -> dict:
        return {"step": step, **layout.to_dict(), "bucket_cap_mb": self.tuning.bucket}


def scheduled_layout(job: Job, step: int) -> Layout | None:
    """The layout the forced schedule has in force at `step` (None: the schedule says nothing)."""
    entries = [e for e in job.adapt.schedule if e["step"] <= step]
    if not entries:
        return None
    return scheduled(job, entries[-1])


def device_memory(infos: list[dict]) -> int | None:
    """The memory one worker may use, the least over the workers: its GPU's, or on CPU its share
    of the host's (the workers on a node divide it). None when the workers did not say."""
    if not infos or any(not i.get("device_memory") for i in infos):
        return None
    per_node: dict[str, int] = {}
    for i in infos:
        per_node[i.get("node_id") or i.get("node_ip")] = per_node.get(i.get("node_id") or i.get("node_ip"), 0) + 1
    return min(i["device_memory"]["bytes"] // (per_node[i.get("node_id") or i.get("node_ip")]
                                               if i["device_memory"]["shared"] else 1) for i in infos)


def node_sizes(job: Job, infos: list[dict]) -> list[int]:
    """Workers per node in rank order: simulated nodes (inject.nodes) when the job asks for them."""
    w, k = job.cluster.num_workers, job.inject.nodes
    if k > 1:
        return [w // k] * k
    sizes: list[int] = []
    last = None
    for info in infos:
        node = info.get("node_id") or info.get("node_ip")
        if node != last:
            sizes.append(0)
            last = node
        sizes[-1] += 1
    return sizes or [w]
