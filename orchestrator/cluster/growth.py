"""Elastic growth: workers started ahead in the slots no rank holds, so that a run can take them
in at a step boundary once they are placed.

A slot is a bundle of a placement group: one the run held for a rank it lost (Ray places the
bundle again when its node is gone and capacity returns; on a live node at once), or one of the
single-bundle groups reserved for `cluster.max_workers` above `num_workers` (placed when the
cluster gains a node, through `ray start --address` or the autoscaler). A worker is started in
each free slot at once; once placed it prepares what it can before it joins (its data, the
modules a relayout uses, a build of the model on the meta device: workers/regroup.warm) and then
answers `node_info`; from then on it is joinable. The
controller asks (`ready`, which never waits) at step boundaries and takes the joinable ones in
(RayWorkerGroup.grow).
"""

from __future__ import annotations

import contextlib
from typing import Any


class Growth:
    def __init__(self):
        self.free: list[tuple] = []            # (placement group, bundle index) with no worker yet
        self.waiting: dict[Any, tuple] = {}    # node_info ref -> (actor, slot): started, not placed yet
        self.joinable: list[tuple] = []        # (actor, slot, node info): placed, answering
        self.reserved: list[Any] = []          # the placement groups of cluster.max_workers' extra slots
        self.on = False

    def reserve(self, job, bundle: dict) -> None:
        """At the start: growth is on under fault.on_node_loss elastic; one single-bundle placement
        group per worker above num_workers (cluster.max_workers), waiting for capacity."""
        from ray.util.placement_group import placement_group

        self.on = job.on_node_loss == "elastic"
        extra = (job.cluster.max_workers or job.cluster.num_workers) - job.cluster.num_workers
        for _ in range(extra if self.on else 0):
            pg = placement_group([bundle])
            self.reserved.append(pg)
            self.free.append((pg, 0))

    def release(self, slots: list[tuple]) -> None:
        """Slots whose ranks are gone or were let go: a new worker may take each."""
        if self.on:
            self.free.extend(slots)

    def ready(self, spawn) -> int:
        """Start a worker in every free slot (`spawn(placement group, bundle index)` starts one),
        and count those placed and answering; never waits."""
        import ray

        for slot in self.free:
            handle = spawn(*slot)
            self.waiting[handle.node_info.remote(True)] = (handle, slot)  # warm: ready to join at once
        self.free = []
        if self.waiting:
            done, _ = ray.wait(list(self.waiting), num_returns=len(self.waiting), timeout=0)
            for ref in done:
                handle, slot = self.waiting.pop(ref)
                try:
                    self.joinable.append((handle, slot, ray.get(ref, timeout=0)))
                except Exception:  # noqa: BLE001 - it died before joining: the slot is free again
                    with contextlib.suppress(Exception):
                        ray.kill(handle, no_restart=True)
                    self.free.append(slot)
        return len(self.joinable)

    def take(self, count: int) -> list[tuple]:
        taken, self.joinable = self.joinable[:count], self.joinable[count:]
        return taken

    def shutdown(self) -> None:
        import ray

        for handle, *_ in [*self.waiting.values(), *self.joinable]:
            with contextlib.suppress(Exception):
                ray.kill(handle, no_restart=True)
        self.waiting, self.joinable, self.free = {}, [], []
        if self.reserved:
            from ray.util.placement_group import remove_placement_group

            for pg in self.reserved:
                with contextlib.suppress(Exception):
                    remove_placement_group(pg)
            self.reserved = []
