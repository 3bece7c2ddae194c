"""RECOVERING: a worker was lost in any other state. Under `fault.on_node_loss: elastic` the
survivors form a new group in memory and go on at the step that failed (orchestrator/control/
elastic.py plans it); otherwise, or where that cannot be done, the group is torn down and the run
restarts from a checkpoint (orchestrator/control/recovery.py), or gives up. Not announced as a
`state` event: the failure's `failure` event says it."""

from __future__ import annotations

import time

from gearshift.orchestrator.control.elastic import Plan, dead_now, gone_nodes
from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.errors import WorkerFailed


class RecoveringState:
    """`failures`: the failures of the run so far, this one included (fault.max_failures counts
    them)."""

    name = State.RECOVERING

    def __init__(self, ctl):
        self.ctl = ctl
        self.failures = 0

    def run(self) -> State:
        """Recover from `ctl.failure`: TRAINING on the survivors, or PLACING a restart's workers."""
        ctl = self.ctl
        ctl.state = State.RECOVERING  # not announced: the failure event says it
        self.failures += 1
        detected = getattr(ctl.failure, "detected", time.time())
        stats = ctl.report.stats
        failed_at = stats.last["step"] if stats.last else 0
        ctl.tuning.reset()
        dropped, ctl.dropped = ctl.dropped, []
        why = None
        if ctl.job.on_node_loss == "elastic" and ctl.group is not None:
            plan = ctl.elastic.plan(ctl.failure, self.failures, ctl.job, ctl.layout, dropped, ctl.micro,
                                    dead=dead_now(ctl.group))
            if isinstance(plan, Plan):
                try:
                    return self._shrink(plan)
                except WorkerFailed as err:  # lost again while resizing: restart from the checkpoint
                    ctl.failure, why = err, f"the resize failed: {err.reason}"
            else:
                why = plan
        group, ctl.group = ctl.group, None
        old = ctl.layout
        # raises when the failure is not one a restart can fix
        ctl.job, ctl.load = ctl.recovery.recover(ctl.failure, self.failures, ctl.job, group, ctl.infos,
                                                 failed_at, elastic=why)
        if why is not None:
            ctl.elastic.fell_back(why, ctl.load[1]["step"] if ctl.load else 0, failed_at, old,
                                  ctl.job.cluster.num_workers, detected)
        ctl.restart = True
        return State.PLACING

    def _shrink(self, plan: Plan) -> State:
        """Elastic: the survivors form a new group in memory and go on at the step that failed."""
        ctl = self.ctl
        start, old, err = time.time(), ctl.layout, ctl.failure
        lost_nodes = gone_nodes(ctl.infos, plan.lost, ctl.group)
        results = ctl.group.shrink(plan.keep, plan.layout.to_dict(), plan.behind)
        steps = sorted({r["step"] for r in results})
        if steps != [plan.step]:
            raise WorkerFailed(None, f"after the resize the survivors are at steps {steps}, not {plan.step}",
                               kind=WorkerFailed.SILENT)
        ctl.step = ctl.settling = plan.step  # the first chunk trains at once: new workers are started later
        ctl.on_world(plan.layout, [dict(ctl.infos[r], rank=i) for i, r in enumerate(plan.keep)])
        ctl.elastic.resized(plan, old, err, self.failures, ctl.job, time.time() - start, lost_nodes, results,
                            planned=start)
        ctl.enter(State.TRAINING, from_step=plan.step, steps_target=ctl.job.train.steps)
        ctl.tuning.begin(plan.step)
        return State.TRAINING
