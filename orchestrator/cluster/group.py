"""What the controller asks of a group of workers: the interface `RayWorkerGroup`
(orchestrator/cluster/worker_group.py) implements and tests swap for their own."""

from __future__ import annotations

from typing import Any, Iterator, Protocol, runtime_checkable


@runtime_checkable
class WorkerGroup(Protocol):
    """What the controller asks of a group of workers, one per rank. `call` runs a TrainWorker
    method on every rank (the controller switches layouts with
    `call("reshard", layout.to_dict(), bucket_cap_mb_or_None)`); `train` streams
    (rank, report) pairs until every rank reached `until_step`. A failure anywhere is a
    `WorkerFailed`."""

    def start(self) -> list[dict]:
        """Place and start the workers, build the model; one info dict per rank, in rank order."""

    def call(self, method: str, *args) -> list:
        """`method(*args)` on every rank; the results in rank order."""

    def put(self, value: Any) -> Any:
        """A reference to `value` that `call` can hand to every rank without copying it per rank."""

    def train(self, until_step: int, checkpoint_every: int, last_step: int | None = None,
              stoppable: bool = False) -> Iterator[tuple[int, dict]]:
        """Every rank's step loop to `until_step`, as (rank, report) pairs as they arrive.
        `stoppable`: each step is reported as it ends, and `stop_early` may end the loop sooner,
        every rank at the same step boundary."""

    def stop_early(self) -> None:
        """Ask the workers to end the `stoppable` step loop in progress soon (within two steps of
        the one being trained when they hear of it); returns at once. A group that cannot does not
        define it, and the controller ends its chunks where the policy may decide instead."""

    def regroup(self) -> None:
        """After a step that ran out of memory: every worker leaves its broken process group and
        joins a new one with the same ranks, keeping its state (TrainWorker.rejoin)."""

    def shrink(self, keep: list[int], layout: dict, behind: list[int] = ()) -> list[dict]:
        """Elastic: ranks were lost mid-step and the survivors' loops have ended. Go on with the
        workers of ranks `keep` (new rank i is keep[i]; the others are stopped) on a new process
        group, the state they hold moved onto `layout` (TrainWorker.rejoin); their results. Those
        in `behind` stopped a step short of the others and receive the state."""

    def joinable(self) -> int:
        """Elastic: how many new workers are placed and could join now; returns at once. A group
        that cannot grow does not define it."""

    def joining(self, count: int) -> list[dict]:
        """Elastic: the node info of the first `count` joinable workers (where they would run)."""

    def grow(self, count: int, layout: dict) -> list[dict]:
        """Elastic: `count` joinable workers join as the last ranks, on a new process group with
        every worker, the state moved onto `layout` (the newcomers receive their pieces)."""

    def dead_ranks(self) -> dict[int, str]:
        """After a failure: the ranks whose worker is gone, with the reason given for each."""

    def alive_node_ids(self) -> set[str]:
        """The ids of the cluster's nodes that are alive now (none known: an empty set)."""

    def alive_node_resources(self) -> list[dict[str, float]]:
        """What each alive node holds in all (e.g. {"CPU": 8, "GPU": 4}), node by node."""

    def shutdown(self, polite: bool = True) -> None:
        """Stop every worker and release what the group holds; never raises."""
