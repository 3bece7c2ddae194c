"""Errors that end a gearshift command with a one-paragraph message instead of a traceback."""

from __future__ import annotations

from typing import Callable


class GearshiftError(RuntimeError):
    """A problem the user can act on: the message says what happened and what to do."""


class UsageError(GearshiftError):
    """Wrong arguments (a run dir that is not one, or is taken): exit status 2, nothing started."""


class RunFailed(GearshiftError):
    """A run that started and did not finish: `reason` says why in one paragraph, `run_dir` holds
    what it left (telemetry, checkpoints, gearshift.log with a worker's traceback)."""

    def __init__(self, reason: str, run_dir=None):
        self.reason = reason
        self.run_dir = run_dir
        super().__init__(reason)


class WorkerFailed(GearshiftError):
    """A worker raised, died or stopped answering. `details` keeps the worker's traceback for the
    run's log; the message stays one paragraph."""

    # what went wrong: a process died, a worker stopped answering, or the code a worker ran raised
    DIED, SILENT, RAISED = "died", "silent", "raised"

    def __init__(self, rank: int | None, message: str, details: str = "", cause: BaseException | None = None,
                 kind: str = RAISED):
        self.rank = rank
        self.details = details
        self.cause = cause
        self.cause_text = f"{type(cause).__name__}: {cause}" if cause is not None else ""
        self.kind = kind
        self.reason = message
        # elastic (cluster/stream.py): the ranks counted lost with this failure, and the survivors
        # whose loop raised with the loss (they cannot say where they stopped: they receive the state)
        self.lost_ranks: list[int] = []
        self.raised_ranks: list[int] = []
        who = f"worker rank {rank}" if rank is not None else "the workers"
        super().__init__(f"Training failed in {who}: {message}")

    @property
    def recoverable(self) -> bool:
        """A lost or silent worker, or a collective that timed out or lost its peer, is worth a
        restart from the last checkpoint; an exception in the training code would only repeat."""
        if self.kind in (self.DIED, self.SILENT):
            return True
        text = self.cause_text or self.details
        return any(mark in text for mark in _COMM_FAILURES)

    def scrub(self, text: Callable[[str], str]) -> None:
        """Every text this failure holds passed through `text` (the run's secrets masked: a worker's
        exception may name a storage URL with its password). The cause itself is let go where its
        text held a secret (what `recoverable` reads of it stays, scrubbed)."""
        self.reason, self.details = text(self.reason), text(self.details)
        said = text(self.cause_text)
        if said != self.cause_text:
            self.cause = None
        self.cause_text = said
        self.args = tuple(text(a) if isinstance(a, str) else a for a in self.args)


# what a collective says when a peer is gone or too slow (gloo, NCCL, torch.distributed); NCCL's
# texts are its watchdog's and its result codes' as torch words them (not yet seen on a GPU here)
_COMM_FAILURES = ("DistBackendError", "DistNetworkError", "DistStoreError", "Timed out", "timed out",
                  "Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
                  "ProcessGroupGloo", "gloo", "ProcessGroupNCCL", "Watchdog caught collective operation timeout",
                  "NCCL error", "ncclRemoteError", "ncclSystemError", "remote process exited")
