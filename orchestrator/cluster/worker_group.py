"""Placing the workers on Ray (started or joined by ray_start.py), and talking to them.

`WorkerGroup` is what the controller drives, and `RayWorkerGroup` the real one: one placement
group with a bundle per worker, one TrainWorker actor per bundle, ranks ordered by node, and a
gloo/nccl rendezvous on rank 0's node. The controller never touches Ray directly (its questions
about nodes go through the group too), so tests can hand it another group class.

RayWorkerGroup is a composition of its parts, each in a module of its own, as Ray Train's worker
group is: where the workers run (placement.py), calls into them and what their failures mean
(calls.py), the step loop's stream with its heartbeats (stream.py), and who is in the group
(membership.py: regroup, shrink, grow, the dead ranks and alive nodes). The ranks they share
(calls.Ranks) are the group's; what it does itself is the start's order and the shutdown.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.startup import STARTUP
from gearshift.orchestrator.cluster.calls import Calls, Ranks, get
from gearshift.orchestrator.cluster.group import WorkerGroup  # noqa: F401 (the interface, re-exported)
from gearshift.orchestrator.cluster.membership import Membership
from gearshift.orchestrator.cluster.placement import (  # noqa: F401 (embedded_cpus, with_env: re-exported)
    Placement, embedded_cpus, streams_data, with_env, worker_bundle)
from gearshift.orchestrator.cluster.ray_start import check_reachable, ray_session, start_ray  # noqa: F401 (re-exported)
from gearshift.orchestrator.cluster.stream import TrainStream


class RayWorkerGroup:
    def __init__(self, job: Job, embedded: bool, checkpoint_dir: str | None = None):
        self.job = job
        self.ranks = Ranks()
        self.placement = Placement(job, embedded, checkpoint_dir)
        self.calls = Calls(job, self.ranks)
        self.membership = Membership(job, self.ranks, self.calls)
        self.stream: TrainStream | None = None  # the step loop in progress, or the last
        self.chunk = 0  # the number of the stoppable step loop in progress (stop_early names it)
        # strategy auto: the controller sets choose_layout, and the start builds the layout it
        # chooses from the devices' free memory
        self.choose_layout: Callable[[list[dict]], Any] | None = None
        self.start_layout = None

    @property
    def workers(self) -> list[Any]:
        """The actor handles, index = rank."""
        return self.ranks.workers

    @workers.setter
    def workers(self, workers: list[Any]) -> None:
        self.ranks.workers = workers

    @property
    def infos(self) -> list[dict]:
        """What each rank told of itself, index = rank (the controller reads it after a grow)."""
        return self.ranks.infos

    @infos.setter
    def infos(self, infos: list[dict]) -> None:
        self.ranks.infos = infos

    # ---------------------------------------------------------------- start

    def start(self) -> list[dict]:
        job, ranks = self.job, self.ranks
        self.placement.place()
        ranks.workers = self.placement.spawn_all()  # held before they answer, so a shutdown kills them
        infos = get([h.node_info.remote() for h in ranks.workers], "start")
        STARTUP.mark("workers")
        self.placement.by_node(ranks, infos)
        self.membership.growth.reserve(job, worker_bundle(job))
        self._check_tp_groups_are_node_local()
        self.placement.share_devices(ranks)
        self.placement.serve_checkpoints(ranks.infos)
        backends = self._rendezvous()
        STARTUP.mark("rendezvous")
        if self.choose_layout is not None:
            memories = get([w.device_memory.remote() for w in ranks.workers], "rendezvous")
            for info, memory in zip(ranks.infos, memories, strict=True):
                info["device_memory"] = memory
            self.start_layout = self.choose_layout(ranks.infos)
            STARTUP.mark("start_layout")  # strategy auto: the memory model, and over nodes the probe
        builds = self.call("build", self.placement.layout(ranks.infos, self.start_layout).to_dict())
        STARTUP.mark("build")
        for rank, (info, backend, built) in enumerate(zip(ranks.infos, backends, builds, strict=True)):
            info.update(rank=rank, backend=backend, **built)
        return ranks.infos

    def _rendezvous(self) -> list[str]:
        """Every worker joins the process group on rank 0's node; each one's backend."""
        master_addr, port = self.calls.rendezvous()
        world, timeout = len(self.workers), self.job.fault.collective_timeout_s
        return get([w.setup.remote(r, world, master_addr, port, timeout) for r, w in enumerate(self.workers)],
                   "rendezvous")

    def _check_tp_groups_are_node_local(self) -> None:
        self.placement.check_tp_groups_are_node_local(self.infos)

    # ---------------------------------------------------------------- calls

    @property
    def call_timeout_s(self) -> float:
        return self.calls.timeout_s

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        return self.calls.every(method, *args, timeout=timeout)

    def put(self, value: Any) -> Any:
        import ray

        return ray.put(value)

    def train(self, until_step: int, checkpoint_every: int, stall_timeout_s: float | None = None,
              last_step: int | None = None, stoppable: bool = False) -> Iterator[tuple[int, dict]]:
        """Stream (rank, report) pairs from every worker's step loop until all have finished.

        While no report comes in, the workers are asked for heartbeats (liveness.py says when and
        how a verdict is reached): a worker that answers is alive however long its step takes. One
        that answers nothing for `stall_timeout_s` (default: the collective timeout plus a margin),
        or waits inside one collective that long, or a group that finishes no step for
        fault.progress_timeout_s, is a failure (stream.py)."""
        self.chunk += 1
        self.stream = TrainStream(self.job, self.ranks, self.membership.new_stream(), self.chunk)
        yield from self.stream.reports(until_step, checkpoint_every, stall_timeout_s, last_step,
                                       self.chunk if stoppable else None)

    def stop_early(self) -> None:
        for w in self.workers:  # every rank hears it; the first to act on it is enough
            w.request_stop.options(concurrency_group="control").remote(self.chunk)

    # ---------------------------------------------------------------- membership

    def regroup(self) -> None:
        self.membership.regroup()

    def shrink(self, keep: list[int], layout: dict, behind: list[int] = ()) -> list[dict]:
        return self.membership.shrink(keep, layout, behind)

    def joinable(self) -> int:
        return self.membership.joinable(self.placement.spawn)

    def joining(self, count: int) -> list[dict]:
        return self.membership.joining(count)

    def grow(self, count: int, layout: dict) -> list[dict]:
        return self.membership.grow(count, layout)

    def dead_ranks(self, timeout_s: float = 3.0) -> dict[int, str]:
        return self.membership.dead_ranks(timeout_s)

    def alive_node_ids(self) -> set[str]:
        return self.membership.alive_node_ids()

    def alive_node_resources(self) -> list[dict[str, float]]:
        return self.membership.alive_node_resources()

    # ---------------------------------------------------------------- stop

    def shutdown(self, polite: bool = True) -> None:
        """Stop every actor by handle and release the placement group; never raises.

        `polite` first lets each worker leave its process group (bounded). After a failure a
        survivor may be blocked in a collective and would not answer, so it is killed at once."""
        import ray

        if self.stream is not None:
            self.stream.drop()
        self.membership.shutdown()
        if self.workers:
            if polite:
                with contextlib.suppress(Exception):
                    ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            for w in self.workers:
                with contextlib.suppress(Exception):
                    ray.kill(w, no_restart=True)
            self.workers = []
        self.placement.release()
