"""FINISHING, then DONE: the run's end (the final checkpoint, the last evaluation and final.pt:
orchestrator/control/finishing.py, whose `Finishing` the controller keeps for the run, since it
remembers the checkpoint a restart loaded). A worker lost here is RECOVERING's like anywhere else."""

from __future__ import annotations

from gearshift.orchestrator.control.states import State


class FinishingState:
    name = State.FINISHING

    def __init__(self, ctl):
        self.ctl = ctl

    def run(self) -> State:
        ctl = self.ctl
        ctl.enter(State.FINISHING, step=ctl.step)
        step = ctl.finishing.run()
        ctl.enter(State.DONE, step=step)
        ctl.summary["status"] = "done"
        return State.DONE
