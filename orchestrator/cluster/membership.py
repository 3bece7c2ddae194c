"""Who is in the group, and the process group they form after a start.

After a step that ran out of memory every worker joins a new process group on the same ranks
(regroup). Under fault.on_node_loss elastic the survivors of a loss go on, renumbered, on a new one
(shrink), and new workers are taken in as the last ranks (grow, from growth.py's joinable ones);
either way the state moves onto the new layout (TrainWorker.rejoin). After a failure: which ranks
are gone (lost.py's dead_ranks, with the ranks the last stream counted lost) and which of the
cluster's nodes are alive. RayWorkerGroup (worker_group.py) holds one Membership over its `Ranks`.
"""

from __future__ import annotations

import contextlib

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.cluster.calls import Calls, Ranks, get
from gearshift.orchestrator.cluster.growth import Growth
from gearshift.orchestrator.cluster.lost import dead_ranks


class Membership:
    def __init__(self, job: Job, ranks: Ranks, calls: Calls):
        self.job, self.ranks, self.calls = job, ranks, calls
        self.growth = Growth()  # elastic: workers waiting to join, in the slots no rank holds
        self.lost: dict[int, WorkerFailed] = {}  # elastic: ranks lost in the step loop in progress, or the last

    def new_stream(self) -> dict[int, WorkerFailed]:
        """An empty account of lost ranks for the step loop about to start (its stream fills it)."""
        self.lost = {}
        return self.lost

    def regroup(self) -> None:
        master_addr, port = self.calls.rendezvous()
        get([w.rejoin.remote(master_addr, port, self.job.fault.collective_timeout_s) for w in self.ranks.workers],
            "rejoin", self.calls.timeout_s)

    def shrink(self, keep: list[int], layout: dict, behind: list[int] = ()) -> list[dict]:
        """Elastic: go on with the workers of ranks `keep` (in that order: new rank i is keep[i]),
        the others killed, on a new process group in `layout`; each survivor's rejoin result.
        The ranks in `behind` stopped a step short: they receive the state as new workers do."""
        import ray

        ranks = self.ranks
        joining = get([ranks.workers[keep[0]].describe.remote()], "describe")[0] if behind else None
        for rank, w in enumerate(ranks.workers):
            if rank not in keep:
                with contextlib.suppress(Exception):
                    ray.kill(w, no_restart=True)
        self.growth.release([ranks.slots[r] for r in range(len(ranks.workers)) if r not in keep])
        ranks.workers, ranks.infos = [ranks.workers[r] for r in keep], [dict(ranks.infos[r], rank=i)
                                                                        for i, r in enumerate(keep)]
        ranks.slots = [ranks.slots[r] for r in keep]
        old_ranks = [None if r in behind else r for r in keep]
        return self._rejoin(layout, old_ranks, joining)

    def joinable(self, spawn) -> int:
        """Elastic: how many new workers are placed and could join now (returns at once);
        `spawn(placement group, bundle index)` starts one in a free slot."""
        return self.growth.ready(spawn)

    def joining(self, count: int) -> list[dict]:
        return [info for _, _, info in self.growth.joinable[:count]]

    def grow(self, count: int, layout: dict) -> list[dict]:
        """Elastic: `count` of the joinable workers join as the last ranks; every worker forms a
        new process group and the state moves onto `layout`, the newcomers receiving their
        pieces (TrainWorker.rejoin). Each worker's result."""
        ranks = self.ranks
        joining = get([ranks.workers[0].describe.remote()], "describe")[0]
        new = self.growth.take(count)
        old_world = len(ranks.workers)
        infos = get([h.node_info.remote() for h, *_ in new], "start")
        ranks.workers += [h for h, *_ in new]
        ranks.slots += [slot for _, slot, _ in new]
        ranks.infos += [dict(info, rank=old_world + i) for i, info in enumerate(infos)]
        return self._rejoin(layout, list(range(old_world)) + [None] * count, joining)

    def _rejoin(self, layout: dict, old_ranks: list, joining: dict | None) -> list[dict]:
        """Every worker on a new group of them all in `layout`; a rank whose old rank is None
        receives its state, described by `joining`."""
        self.lost = {}  # the ranks are renumbered: the last stream's losses are accounted for
        master_addr, port = self.calls.rendezvous()
        t, world = self.job.fault.collective_timeout_s, len(self.ranks.workers)
        return get([w.rejoin.remote(master_addr, port, t, i, world, layout, old_ranks,
                                    joining if old_ranks[i] is None else None)
                    for i, w in enumerate(self.ranks.workers)], "rejoin", self.calls.timeout_s)

    def dead_ranks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Ranks whose actor is gone (those the last stream counted lost, and any Ray says is dead
        now), with the reason given for each (lost.dead_ranks)."""
        known = {r: e.reason for r, e in self.lost.items()}
        return dead_ranks(self.ranks.workers, known, timeout_s)

    @staticmethod
    def alive_node_ids() -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    @staticmethod
    def alive_node_resources() -> list[dict[str, float]]:
        """Each alive node's total resources, not what is free now: called after the group is
        shut down, when its own share is free again."""
        import ray

        return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]

    def shutdown(self) -> None:
        """Stop the workers waiting to join and free the slots reserved for growth; never raises."""
        self.growth.shutdown()
