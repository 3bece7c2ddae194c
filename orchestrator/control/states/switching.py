"""SWITCHING: the boundary where a training chunk ended changes the layout (the forced schedule,
the policy's switch or revert, a tuning trial's layout), and the controller's `switch` carries
it out on the running workers; the schedule, the policy and the tuning round hear of it."""

from __future__ import annotations

from gearshift.orchestrator.control.states import State


class SwitchingState:
    name = State.SWITCHING

    def __init__(self, ctl):
        self.ctl = ctl

    def run(self) -> State:
        """Carry out the boundary that changes the layout (`ctl.boundary`, TRAINING's)."""
        ctl = self.ctl
        b, step = ctl.boundary, ctl.step
        if b.abandon_tuning:
            ctl.tuning.abandon(step)  # a new layout is coming: its own round follows
        if ctl.decided is not None:
            ctl.record_decision(step)
        ctl.switch(b.to, step, b.reason, b.evidence, bucket=b.bucket)
        if b.scheduled:
            ctl.schedule.pop(0)
        if b.tell_policy:
            done = ctl.switches[-1] if ctl.switches and ctl.switches[-1]["step"] == step else None
            ctl.policy.switched(ctl.layout, step, done["seconds"] if done else None)
        ctl.tune_after(b)
        return State.TRAINING
