"""`fault.on_nan: rollback`: after `nan_patience` non-finite steps within WINDOW steps, the run goes
back to the newest checkpoint before the first of them and goes on from there at
`rollback_lr_factor` times the learning rate.

Each non-finite step is skipped as under `skip` (its update is not applied); at the end of the
chunk in which the count is reached, the workers load the checkpoint in place (no restart), the
run's job takes the lowered rate (so a later restart after a failure keeps it), every worker's
schedule is rebuilt at that rate, and training goes on from the checkpoint's step. The run from
there is the one a user would get by resuming that checkpoint by hand with that rate. A
`rollback` record says from which step to which checkpoint, the rates, and the non-finite steps
that caused it. No checkpoint before the first of them stops the run, saying so.
"""

from __future__ import annotations

import dataclasses

from gearshift.orchestrator.errors import GearshiftError
from gearshift.orchestrator.control.checkpoints import load_into
from gearshift.workers.state import checkpoint

WINDOW = 100  # steps: non-finite steps farther apart than this do not add up


class NanRollback:
    def __init__(self, report, checkpoints):
        self.report, self.root = report, checkpoints
        self.seen = 0  # report.skipped entries already counted
        self.window: list[int] = []
        self.rollbacks: list[dict] = []

    def due(self, job) -> bool:
        if job.fault.on_nan != "rollback":
            return False
        for bad in self.report.skipped[self.seen:]:
            self.window.append(int(bad["step"]))
        self.seen = len(self.report.skipped)
        if self.window:
            self.window = [s for s in self.window if s > self.window[-1] - WINDOW]
        return len(self.window) >= job.fault.nan_patience

    def roll_back(self, job, group, step: int):
        """Load the newest checkpoint before the window's first bad step into `group`, lower the
        rate; returns (the job with the lowered rate, the checkpoint's step)."""
        first = min(self.window)
        found = None
        for path in reversed(checkpoint.list_checkpoints(self.root)):
            at = int(path.name.split("_")[1])
            if at >= first:
                continue
            try:
                found = (path, checkpoint.load(path, whole=False))
                break
            except Exception:  # noqa: BLE001 - a checkpoint that does not verify is passed over, as on restart
                continue
        bad = sorted(self.window)
        if found is None:
            self.report.event("rollback", step=step, bad_steps=bad, checkpoint=None, action="stop")
            raise GearshiftError(f"fault.on_nan rollback: {len(bad)} non-finite steps ({', '.join(map(str, bad))}) "
                                 f"and no checkpoint before step {first} to go back to (checkpoint.every "
                                 f"{job.checkpoint.every}, keep {job.checkpoint.keep}); the run stops here")
        path, state = found
        lr = job.optimizer.lr * job.fault.rollback_lr_factor
        restored, name = load_into(group, self.root, (path.name, state), self.report, before=first)
        path = path.with_name(name)
        group.call("set_lr", lr)
        job = dataclasses.replace(job, optimizer=dataclasses.replace(job.optimizer, lr=lr))
        record = {"step": step, "to_step": restored, "checkpoint": path.name, "bad_steps": bad,
                  "lr": lr, "previous_lr": lr / job.fault.rollback_lr_factor, "rollbacks": len(self.rollbacks) + 1}
        self.rollbacks.append(record)
        self.report.event("rollback", **record, action=f"back to {path.name}, learning rate {lr:.3g}")
        self.report.say(f"step {step}: {len(bad)} non-finite steps ({', '.join(map(str, bad))}) -> rolled back to "
                        f"{path.name} (step {restored}), learning rate {record['previous_lr']:.3g} -> {lr:.3g} "
                        "(fault.on_nan = rollback)")
        self.window = []
        return job, restored
