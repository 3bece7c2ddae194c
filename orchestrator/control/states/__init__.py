"""The controller's states, one object each (orchestrator/control/controller.py runs them).

Each holds the controller, the run's shared context, and `run()` carries its state out and
returns the state that follows (a `State`: the controller keeps one object of each and runs the
one named). What passes from one state to the next (the boundary SWITCHING carries out, the
failure RECOVERING handles, the checkpoint STARTING loads) is left on the controller; what only
one state needs stays on its object. No state imports the controller or another state, but
placing's `device_memory` and `node_sizes` and TRAINING its out-of-memory path (dropped_step.py):
so the states cannot form an import cycle, and the controller imports them all (STARTING begins
TRAINING through the controller's `states`, not by an import).

This module names the states: the `state` events carry their values.
"""

from __future__ import annotations

import enum


class State(enum.Enum):
    PLACING = "placing"
    STARTING = "starting"
    TRAINING = "training"
    SWITCHING = "switching"
    FINISHING = "finishing"
    RECOVERING = "recovering"
    DONE = "done"
    FAILED = "failed"
