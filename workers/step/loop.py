"""StepLoop: the worker's step loop. It runs the steps of a training chunk and streams their
reports back in batches (every flush_s seconds, at each checkpoint, where train.profile's window
ends, at the end), so the controller stays off the hot path; it stops where the ranks agree
(workers/step/stopping.py) and turns a step that ran out of memory, here or on a peer, into a
report of the dropped step."""

from __future__ import annotations

from typing import Iterator

import torch

from gearshift.workers.group import priority
from gearshift.workers.group.heartbeat import ACTIVITY
from gearshift.workers.state import dcp
from gearshift.workers.step import oom
from gearshift.workers.step.nonfinite import non_finite_step
from gearshift.workers.step.pending import PendingSteps
from gearshift.workers.step.profiling import StepProfiler
from gearshift.workers.step.stopping import StopAgreement


class StepLoop:
    def __init__(self, worker):
        self.w = worker
        self.profiler = StepProfiler(worker.config.profile, cuda=worker.config.gpu)  # train.profile's window
        self.async_save = True  # checkpoint.async_save: DCP checkpoints in the loop are written behind the steps

    def train(self, until_step: int, checkpoint_every: int = 0, flush_s: float = 0.5,
              last_step: int | None = None, chunk: int | None = None, async_save: bool = True) -> Iterator[dict]:
        """The chunk's steps and their reports (see TrainWorker.train)."""
        w = self.w
        self.async_save = async_save
        if w.clock:
            w.clock.take()  # nothing timed between steps belongs to the first one
        agreement = (StopAgreement(w.member.flags, lambda: w.member.stop_chunk == chunk) if chunk is not None
                     else None)
        pending = PendingSteps(w.step, w.clock)
        priority.as_parent()  # threads started since (the process groups') take the worker's priority too
        ACTIVITY.progressed()  # the time between chunks is the controller's, not a slow step
        ACTIVITY.set_phase("step")
        try:
            yield from self._loop(until_step, checkpoint_every, flush_s, last_step, agreement, pending)
            with ACTIVITY.phase_of("checkpoint"):
                tail = w.io.writes.take(wait=True)  # the chunk ends with every write of it reported
            if tail:
                yield {"rank": w.rank, "first_step": w.step, "losses": [], **tail}
        except BaseException as err:  # noqa: BLE001 - a peer lost between steps (a checkpoint's collective
            # raises a CheckpointException, a BaseException); anything else is raised again
            if not oom.peer_gone(err):
                raise
            yield {"rank": w.rank, "step_failed": self.step_failed(err)}
        finally:
            ACTIVITY.set_phase("idle")

    def _loop(self, until_step, checkpoint_every, flush_s, last_step, agreement, pending) -> Iterator[dict]:
        w = self.w
        while w.step < until_step:
            try:
                if agreement is not None and agreement.stop_here():
                    agreement = None  # stopped: nothing outstanding on the group
                    break
                self.profiler.before_step(w.step, w.parallel.model)
                loss, data_span, lr, found = w.runner.one_step(w.step)
            except BaseException as err:  # noqa: BLE001 - out of memory here or on a peer; anything else is raised
                if not oom.ran_out(err) and not oom.peer_gone(err):
                    raise
                if pending.losses:
                    yield self._report(pending, False) | self.profiler.take()
                yield {"rank": w.rank, "step_failed": self.step_failed(err)}
                return
            w.step += 1
            ACTIVITY.stepped(w.step)
            pending.add(loss, data_span, lr, found)
            # the run's last step gets its own final save; a chunk's last step (before a possible
            # switch) is checkpointed like any other
            ckpt = checkpoint_every and w.step % checkpoint_every == 0 and w.step < (last_step or until_step)
            if self.profiler.after_step(w.step) or ckpt or pending.age() >= flush_s or w.step == until_step:
                yield self._report(pending, bool(ckpt)) | self.profiler.take()  # the window's trace, once
                # the next step's time starts after the report left: a checkpoint's copy and
                # serialisation is not training time (the controller times checkpoints itself)
                pending = PendingSteps(w.step, w.clock)
        if agreement is not None:
            agreement.close()
        if pending.losses:  # stopped early between flushes
            yield self._report(pending, False) | self.profiler.take()

    def step_failed(self, err: Exception) -> dict:
        """Drop the failed step (nothing of it applied) and say why: out of memory here, or a peer gone."""
        w, runner = self.w, self.w.runner
        ran_out = oom.ran_out(err)
        root = oom.causes(err)[-1]  # what failed under a library's wrapper (a pipeline stage's)
        kind = ("oom_in_update" if runner.updating else "oom") if ran_out else "aborted"
        figures = oom.memory_figures(w.device)  # what was held when it failed
        # a write behind the steps coordinates on a group about to be left: it fails, uncommitted
        w.io.writes.drop()
        runner.updating = False
        if w.optimizer is not None:
            w.optimizer.zero_grad(set_to_none=True)
        oom.leave_group()  # peers blocked in this step's collectives fail now, not at the timeout
        w.member.flags = None
        oom.give_back(w.device)
        return {"kind": kind, "rank": w.rank, "step": w.step + 1, "layout": w.layout.to_dict(),
                "micro_batch": w.micro_batch or w.config.global_batch_size // w.layout.dp,
                "message": f"{type(root).__name__}: {str(root)[:500]}", **figures}

    def _report(self, pending: PendingSteps, checkpoint: bool) -> dict:
        w, runner = self.w, self.w.runner
        report = pending.report(w.rank)
        for bad in pending.skipped_on_device(report["losses"]):  # read with the losses: no sync of its own
            runner.non_finite.append(non_finite_step(bad, torch.tensor(report["losses"][bad - pending.first - 1]),
                                                     None, None, stop=w.config.on_nan == "stop", on_device=True))
        if runner.non_finite:
            report["non_finite"], runner.non_finite = runner.non_finite, []
        if runner.grad_check and runner.grad_check.found:
            report["grad_anomalies"] = runner.grad_check.take()
        if runner.probe and runner.probe.ready:
            report["module_memory"] = runner.probe.take(w.parallel.model, w.optimizer)
        if w.clock:
            w.telemetry.add_timings(report, pending.spans, w.clock.cuda)
        if not checkpoint:
            report.update(w.io.writes.take(wait=False))  # a write behind the steps that has ended
        elif self.async_save and w.io.dcp_root is not None:  # written behind the steps (dcp.Behind.start)
            with ACTIVITY.phase_of("checkpoint"):  # every rank takes part (a barrier, the write's plan)
                report.update(w.io.writes.start(w.parallel.model, w.optimizer, dcp.tmp_folder(
                    w.io.dcp_root, w.step), w.step, w.rank, w.io.extra()))
        else:
            with ACTIVITY.phase_of("checkpoint"):  # a collective when sharded: every rank takes part
                report.update(w.io.checkpoint())
        return report
