"""Calls into the workers, and what their failures mean.

Every call waits within a timeout, so a hung worker ends as a failure and not as a hung run, and
every Ray error becomes a `WorkerFailed` the controller can act on: workers that did not answer
(silent), a process that is gone (died), or code that raised (the user's exception kept).
`Ranks` is whom the calls go to: the group's workers in rank order, as placement.py orders them
and membership.py changes them. RayWorkerGroup (worker_group.py) holds one of each; the step
loop's stream (stream.py) is a call of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job

# How long one call into the workers may take before it counts as hung. Generous: the first
# call into a fresh actor imports torch and builds the model.
CALL_TIMEOUT_S = 300.0
CALL_MARGIN_S = 30.0   # a call that runs collectives may take the collective timeout plus this


@dataclass
class Ranks:
    """The group's workers, index = rank: the actor handles, what each told of itself (its
    node_info, then its rank, backend and what its build gave), and the (placement group, bundle
    index) each runs in. Shared by the group's parts: a shrink or a grow changes it for all."""

    workers: list[Any] = field(default_factory=list)
    infos: list[dict] = field(default_factory=list)
    slots: list[tuple] = field(default_factory=list)


def get(refs: list, what: str, timeout: float = CALL_TIMEOUT_S) -> list:
    """The results of `refs`, calls of `what`, waited for at most `timeout`; any failure as a
    WorkerFailed of no one rank (the call went to many)."""
    import ray

    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise WorkerFailed(None, f"workers did not answer '{what}' within {timeout:g} s",
                           kind=WorkerFailed.SILENT) from None
    except ray.exceptions.RayActorError as err:
        raise WorkerFailed(None, f"a worker process died during '{what}' (killed, crashed, out of memory "
                                 "or its node was lost)", details=str(err), kind=WorkerFailed.DIED) from None
    except ray.exceptions.RayError as err:  # a task error, or one whose exception could not be rebuilt
        raise task_failure(err, None) from None


def died(rank: int, info: dict, err) -> WorkerFailed:
    """Rank `rank`'s process is gone (`info`: its node_info, to say which process on which node)."""
    return WorkerFailed(rank, f"its process (pid {info['pid']} on {info['node_ip']}) died: killed, crashed, out "
                              "of memory or its node was lost", details=str(err), kind=WorkerFailed.DIED)


def task_failure(err, rank: int | None) -> WorkerFailed:
    """A worker raised: keep the user's exception type and message, and its traceback for the log."""
    cause = getattr(err, "cause", None)
    if cause is not None and not isinstance(cause, BaseException):
        cause = None
    text = f"{type(cause).__name__}: {cause}" if cause is not None else _first_meaningful_line(str(err))
    # str(err) carries the remote traceback; the cause's own traceback does not survive the trip
    return WorkerFailed(rank, text, details=str(err), cause=cause)


def _first_meaningful_line(text: str) -> str:
    """Ray's error texts start with its own framing; the user's exception is the last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "unknown error"


class Calls:
    """A TrainWorker method on every rank of `ranks`, within the timeouts the job's fault section
    sets."""

    def __init__(self, job: Job, ranks: Ranks):
        self.job, self.ranks = job, ranks

    @property
    def timeout_s(self) -> float:
        """A call that runs collectives (build, reshard, state) ends within the collective timeout,
        or with the collective's error; past that and a margin, the worker is silent."""
        return self.job.fault.collective_timeout_s + CALL_MARGIN_S

    def every(self, method: str, *args, timeout: float | None = None) -> list:
        """`method(*args)` on every rank; the results in rank order. The first build may take
        longer than a collective (it imports torch and builds the model)."""
        return get([getattr(w, method).remote(*args) for w in self.ranks.workers], method,
                   timeout or max(self.timeout_s, CALL_TIMEOUT_S if method == "build" else 0))

    def rendezvous(self) -> tuple[str, int]:
        """Where the workers meet to form a process group: a free port on rank 0's node."""
        port = get([self.ranks.workers[0].free_port.remote()], "rendezvous")[0]
        return self.ranks.infos[0]["node_ip"], port
