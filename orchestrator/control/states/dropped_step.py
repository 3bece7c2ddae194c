"""The out-of-memory path, taken from TRAINING where a chunk ended because ranks dropped a step,
every one at the same boundary: out of memory on one of them (orchestrator/control/memory.py says
what follows: the workers form a new process group and go on at that step with less), or a
collective that lost a peer for another reason, which is a worker failure (RECOVERING's)."""

from __future__ import annotations

from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.control.states.placing import device_memory
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.policy.for_job import layout_candidates
from gearshift.strategies.layout import Layout


class DroppedStep:
    def __init__(self, ctl):
        self.ctl = ctl

    def run(self) -> State:
        ctl = self.ctl
        dropped, ctl.dropped = ctl.dropped, []
        if not any(f["kind"].startswith("oom") for f in dropped):
            f = dropped[0]
            raise WorkerFailed(f["rank"], f"a collective lost its peer mid-step: {f['message']}",
                               details=f["message"], kind=WorkerFailed.RAISED)
        if ctl.decided is not None:  # the move waits: the policy decides again on the setting that fits
            ctl.record_decision(None)
        action = ctl.memory.after_step(dropped, ctl.layout, ctl.micro, self.candidates(), device_memory(ctl.infos))
        ctl.group.regroup()
        if action.kind == "shard":
            ctl.switch(action.setting.layout, ctl.step, "oom")
        ctl.micro = action.setting.micro_batch
        ctl.group.call("set_micro_batch", ctl.micro)
        ctl.stragglers.start_over()  # the new group's workers are on even shares
        if ctl.policy is not None:
            ctl.policy.switched(ctl.layout, ctl.step)
            ctl.policy.exclude(*ctl.memory.layouts_not_fitting)
        return State.TRAINING

    def candidates(self) -> list[Layout]:
        """The layouts a step that ran out of memory may move to: every sharded one of the world."""
        return layout_candidates(self.ctl.job, self.ctl.node_sizes, sharded=True)
