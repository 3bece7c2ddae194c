"""The controller: an explicit state machine that places the workers, streams their reports,
writes checkpoints and the run's outputs, and tears everything down whatever happens.

    PLACING -> STARTING -> TRAINING <-> SWITCHING
       ^                      |  ^  \\-> FINISHING -> DONE
       |                      v  |     (elastic: the survivors go on in memory, orchestrator/control/elastic.py)
       \\------------- RECOVERING        (a worker lost in PLACING, STARTING, SWITCHING or FINISHING too)

    any state -> FAILED                 (an error no restart fixes, fault.max_failures used up, Ctrl-C)

Each state is its own small object, in orchestrator/control/states/ (a file each: placing,
starting, training, switching, recovering, finishing, and dropped_step, the out-of-memory path
TRAINING takes). `run()` is a loop over `_step()`, which runs one state's object and returns the
state that follows. Training runs in chunks that end where something may change: at the forced
schedule's steps, where a bucket-tuning trial ends, and at each eval step (eval.every;
orchestrator/control/evaluation.py evaluates there, on all ranks, before anything else happens at
that boundary). Under `strategy: auto` a switch or revert ends its chunk early: the workers stop
for it within two steps of the step whose record brought it (`WorkerGroup.stop_early`; a group
that cannot has its chunks end where the policy may decide, `next_decision`). A step dropped for
an out-of-memory error on any rank ends the chunk too: the workers form a new process group and
go on at that step with less (orchestrator/control/memory.py). At each chunk's end
`next_boundary` (orchestrator/control/boundary.py) says what happens there, and the controller
carries it out, on the same workers (`reshard`), all ranks at the same step boundary. A worker
failure in any state but RECOVERING goes to RECOVERING (orchestrator/control/recovery.py), which
restarts from a checkpoint or gives up.

Every state entered is announced as a `state` event, except RECOVERING, which its `failure`
event announces (readers know placing, starting, training, switching, finishing, done and failed).
FINISHING (orchestrator/control/finishing.py) writes the final checkpoint and final.pt: a worker
lost there is recovered from like anywhere else.

The controller itself is the run's shared context: the job, the run dir, the worker group, the
layout, policy and micro-batch in force, the step, the records so far, and what one state hands
the next (the boundary SWITCHING carries out, the failure RECOVERING handles, the checkpoint
STARTING loads). What the states share is here too: entering a state (`enter`), carrying out a
layout change (`switch`), a new policy (`make_policy`), a resized world (`on_world`).

What is injected, so that tests can swap it: the worker group (`group_factory`, a
`WorkerGroup`), the policy (`policy_factory`), and the bucket-tuning driver (`tuning`; `gearshift
tune` hands in one with a grid). `gearshift replay` hands in the original's decisions (`script`,
orchestrator/control/script.py): they are carried out at their steps and no new one is taken. Records and terminal lines go through `Reporter`
(orchestrator/control/reporting.py). The group the factory makes is held in a `ScrubbedGroup`
(orchestrator/cluster/scrubbed.py): what its workers send comes in with the run's secrets masked.
"""

from __future__ import annotations

import dataclasses
import time
import traceback
from typing import Callable

from gearshift.monitoring.progress import ProgressView
from gearshift.orchestrator.control.boundary import Boundary, Then
from gearshift.orchestrator.control.bucket_tuning import BucketTuning
from gearshift.orchestrator.control.checkpoints import Checkpoints
from gearshift.orchestrator.control.elastic import Elastic
from gearshift.orchestrator.control.evaluation import Evaluation
from gearshift.orchestrator.control.finishing import Finishing
from gearshift.orchestrator.control.memory import OutOfMemory
from gearshift.orchestrator.control.recovery import Recovery
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.orchestrator.control.rollback import NanRollback
from gearshift.orchestrator.control.script import Script
from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.control.stragglers import Stragglers
from gearshift.orchestrator.control.states.finishing import FinishingState
from gearshift.orchestrator.control.states.placing import PlacingState, device_memory, node_sizes
from gearshift.orchestrator.control.states.recovering import RecoveringState
from gearshift.orchestrator.control.states.starting import StartingState
from gearshift.orchestrator.control.states.switching import SwitchingState
from gearshift.orchestrator.control.states.training import TrainingState, scheduled_layout
from gearshift.orchestrator.cluster.scrubbed import ScrubbedGroup
from gearshift.orchestrator.cluster.worker_group import WorkerGroup
from gearshift.orchestrator.errors import GearshiftError, WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.job.secrets import Scrubber
from gearshift.orchestrator.policy.adaptive import Decision, Policy
from gearshift.orchestrator.policy.for_job import job_policy
from gearshift.orchestrator.records.rundir import RunDir
from gearshift.strategies.layout import Layout

# the names callers have always imported from here, wherever they live now
__all__ = ["Controller", "PolicyFactory", "State", "device_memory", "job_policy", "node_sizes", "scheduled_layout"]

PolicyFactory = Callable[[Job, Layout, list[int], "int | None"], Policy]  # the last: device memory (bytes)


class Controller:
    def __init__(self, job: Job, run: RunDir, group_factory: Callable[[Job], WorkerGroup],
                 resume: tuple[str, dict] | None = None, view: ProgressView | None = None,
                 policy_factory: PolicyFactory = job_policy, tuning: BucketTuning | None = None,
                 script: Script | None = None):
        self.job = job
        self.script = script  # a replay's decisions, carried out instead of new ones (control/script.py)
        self.run_dir = run
        # whatever a worker says reaches the driver through its group: scrubbed there of the run's
        # secrets, before anything of it is written, printed or raised (cluster/scrubbed.py)
        self.scrub = Scrubber(job.secret_values())
        self.group_factory = lambda j: ScrubbedGroup(group_factory(j), self.scrub)
        self.policy_factory = policy_factory
        self.resume = resume  # (checkpoint name, state) to continue from
        self.report = Reporter(job, run, view)
        self.checkpoint_root = run.checkpoint_root(job.checkpoint, job.base_dir)  # checkpoint.path, or the run dir's
        self.recovery = Recovery(self.report, self.checkpoint_root)
        self.nan_rollback = NanRollback(self.report, self.checkpoint_root)
        self.elastic = Elastic(self.report)
        self.home = job.layout  # elastic: the layout a run grows back to at its own size
        self.max_workers = job.cluster.max_workers or job.cluster.num_workers
        self.settling = -1  # elastic: the step of the last shrink (no worker is started before its first chunk)
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
        self.load = resume    # what STARTING loads into the workers: the resume point, or a recovery's checkpoint
        self.restart = False  # STARTING after a failure: the workers are restored, not resumed
        self.failure: WorkerFailed | None = None  # what RECOVERING recovers from
        self.schedule: list[dict] = []  # forced switches still ahead
        self.boundary: Boundary | None = None  # the boundary SWITCHING carries out
        self.start_choice: dict | None = None  # strategy auto: where it started, and every layout's prediction
        self.decided: tuple[Decision, int] | None = None  # the chunk's switch or revert, and the step it was seen
        self.stragglers = Stragglers(self)  # adapt.stragglers: the replicas' shares of the global batch
        self.dropped: list[dict] = []  # the chunk's step that ranks dropped (out of memory here or on a peer)
        self.states = {s.name: s for s in (PlacingState(self), StartingState(self), TrainingState(self),
                                           SwitchingState(self), RecoveringState(self), FinishingState(self))}

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
            return self.states[state].run()
        try:
            return self.states[state].run()
        except WorkerFailed as err:
            self.failure = err
            return State.RECOVERING

    def enter(self, state: State, **fields) -> None:
        self.state = state
        self.report.event("state", state=state.value, **fields)

    def _failed(self, err: BaseException) -> None:
        # the driver's own errors too: fsspec names a storage URL with its password here as well
        self.scrub.error(err)
        interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
        self.summary["status"] = "interrupted" if interrupted else "failed"
        self.summary["error"] = self.scrub.text(f"interrupted ({err})" if interrupted and str(err) else
                                                "interrupted by the user" if interrupted else
                                                str(err) if isinstance(err, GearshiftError) else
                                                f"{type(err).__name__}: {err}")
        if isinstance(err, WorkerFailed) and err.details:
            self.run_dir.log.write_text(err.details)
        elif not interrupted and not isinstance(err, GearshiftError):
            self.run_dir.log.write_text(self.scrub.text("".join(traceback.format_exception(err))))
        self.enter(State.FAILED, error=self.summary["error"])

    def _close(self, wall: float) -> None:
        self.report.close_view()
        if self.group is not None:
            self.group.shutdown(polite=self.state is State.DONE)
        self.summary.update(self.report.figures(self.start_step, self.tuning.bucket, wall), **self.evals.figures())
        self.run_dir.write_summary(self.summary)
        self.report.close()

    # ------------------------------------------------------------------ what the states share

    def switch(self, target: Layout, step: int, reason: str, evidence: dict | None = None,
               bucket: float | None = None) -> None:
        """Carry out a layout change on the running workers, at step boundary `step` (with
        `bucket`, a new bucket_cap_mb at the same time)."""
        old = self.layout
        self.enter(State.SWITCHING, step=step, to=target.to_dict())
        results = self.group.call("reshard", target.to_dict(), bucket)
        failed = [r["failed"] for r in results if r.get("failed")]
        if failed:  # some rank could not allocate the new layout: every rank is on the old one, whole
            self.memory.in_switch(failed, old, target, self.micro)
            if self.policy is not None:
                self.policy.exclude(target)
            self.stragglers.start_over()  # every rank was laid out again, on even shares
            self.enter(State.TRAINING, from_step=step, steps_target=self.job.train.steps)
            return
        seconds = max(r["seconds"] for r in results)
        self.layout = target
        self.stragglers.start_over()
        if bucket is not None:
            self.tuning.bucket = bucket
        record = {"step": step, "from": old.to_dict(), "to": target.to_dict(), "seconds": seconds, "reason": reason,
                  **({"bucket_cap_mb": bucket} if bucket is not None else {})}
        self.switches.append(record)
        self.history.append(self.history_entry(step, target))
        self.report.switched(record, evidence, old, target)
        self.enter(State.TRAINING, from_step=step, steps_target=self.job.train.steps)

    def note_layout(self, step: int) -> None:
        """The layout history gets an entry: the bucket in force changed at `step` (the workers were
        laid out again, on even shares)."""
        self.history.append(self.history_entry(step, self.layout))
        self.stragglers.start_over()

    def history_entry(self, step: int, layout: Layout) -> dict:
        return {"step": step, **layout.to_dict(), "bucket_cap_mb": self.tuning.bucket}

    def on_world(self, layout: Layout, infos: list[dict]) -> None:
        """Elastic: the run goes on as `layout` on the workers of `infos`, from self.step."""
        # the mode resolved on the run's own world stays: on the smaller one it would read as
        # shrink where min_workers is reached, and growth back to that world would stop
        job = self.job
        self.job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, num_workers=layout.world),
                                       fault=dataclasses.replace(job.fault, on_node_loss=job.on_node_loss))
        self.infos, self.layout = infos, layout
        self.node_sizes = node_sizes(self.job, infos)
        self.history.append(self.history_entry(self.step, layout))
        self.summary["world_size"] = layout.world
        self.stragglers.start_over()
        if self.policy is not None:  # the candidates of the new world
            self.policy = self.make_policy()

    def make_policy(self) -> Policy:
        policy = self.policy_factory(self.job, self.layout, self.node_sizes, device_memory(self.infos))
        c = policy.config
        self.report.event("policy", candidates=[layout.to_dict() for layout in policy.candidates],
                          node_sizes=self.node_sizes, threshold=c.threshold, window=c.window, cooldown=c.cooldown,
                          decide=c.decide, **({"start": self.start_choice} if self.start_choice else {}))
        return policy

    def record_decision(self, applied: int | None) -> None:
        """The chunk's switch or revert, with the step it was seen at and the step it was carried
        out at (None: it was not)."""
        (decision, seen), self.decided = self.decided, None
        self.report.decided(decision, seen, applied)

    def tune_after(self, boundary: Boundary) -> None:
        if boundary.then is Then.REMEMBERED:
            self.tuning.maybe_tune(self.step, only_remembered=True)
        elif boundary.then is Then.TUNE:
            self.tuning.maybe_tune(self.step)
