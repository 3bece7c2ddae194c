"""Errors that end a gearshift command with a one-paragraph message instead of a traceback."""

from __future__ import annotations


class GearshiftError(RuntimeError):
    """A problem the user can act on: the message says what happened and what to do."""


class UsageError(GearshiftError):
    """Wrong arguments (a run dir that is not one, or is taken): exit status 2, nothing started."""


class WorkerFailed(GearshiftError):
    """A worker raised, died or stopped answering. `details` keeps the worker's traceback for the
    run's log; the message stays one paragraph."""

    def __init__(self, rank: int | None, message: str, details: str = "", cause: BaseException | None = None):
        self.rank = rank
        self.details = details
        self.cause = cause
        who = f"worker rank {rank}" if rank is not None else "the workers"
        super().__init__(f"Training failed in {who}: {message}")
