"""Placing the workers on Ray (started or joined by ray_start.py), and talking to them.

`WorkerGroup` is what the controller drives, and `RayWorkerGroup` the real one: one placement
group with a bundle per worker, one TrainWorker actor per bundle, ranks ordered by node, and a
gloo/nccl rendezvous on rank 0's node. The controller never touches Ray directly (its questions
about nodes go through the group too), so tests can hand it another group class.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Iterator

from gearshift.orchestrator.errors import GearshiftError, WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.startup import STARTUP
from gearshift.orchestrator.cluster.devices import share_devices
from gearshift.orchestrator.cluster.group import WorkerGroup  # noqa: F401 (the interface, re-exported)
from gearshift.orchestrator.cluster.growth import Growth
from gearshift.orchestrator.cluster.liveness import Liveness
from gearshift.orchestrator.cluster.lost import LossProbe, dead_ranks
from gearshift.orchestrator.cluster.ray_start import check_reachable, ray_session, start_ray  # noqa: F401 (re-exported)

log = logging.getLogger("gearshift")

# How long one call into the workers may take before it counts as hung. Generous: the first
# call into a fresh actor imports torch and builds the model.
CALL_TIMEOUT_S = 300.0
CALL_MARGIN_S = 30.0   # a call that runs collectives may take the collective timeout plus this
STALL_MARGIN_S = 5.0   # no report nor heartbeat, or one collective, for the collective timeout plus this: stuck


def streams_data(job: Job) -> bool:
    """Whether the job reads a Ray Dataset (data or eval.data)."""
    data, ev = job.data, job.eval.data
    return bool(data.ray_dataset or data.read or (job.eval.every and isinstance(ev, dict) and (
        ev.get("ray_dataset") or ev.get("read"))))


def embedded_cpus(job: Job) -> int:
    """The CPUs an embedded Ray offers: this machine's, and with a streamed dataset enough more
    that Ray Data's read tasks (1 CPU each) can run beside workers that reserve every core. The
    tasks share the cores with the workers, as any reading in the step loop would."""
    cores = os.cpu_count() or 1
    if not streams_data(job):
        return cores
    return max(cores, int(-(-job.cluster.num_workers * job.cluster.cpus_per_worker // 1)) + 2)


def worker_bundle(job: Job) -> dict[str, float]:
    bundle = {"CPU": job.cluster.cpus_per_worker}
    if job.cluster.gpus_per_worker:
        bundle["GPU"] = job.cluster.gpus_per_worker
    return bundle


def with_env(options: dict, env: dict[str, str]) -> dict:
    """Actor `options` whose runtime_env also sets `env` (cluster.env) in the worker's process:
    Ray sets runtime_env's env_vars before the process starts, so they are there before torch,
    NCCL or any process group reads them. Variables already in `options` stay unless the job names
    them too; the job-level runtime_env's env_vars Ray merges in itself."""
    if not env:
        return options
    runtime_env = dict(options.get("runtime_env") or {})
    runtime_env["env_vars"] = {**(runtime_env.get("env_vars") or {}), **env}
    return {**options, "runtime_env": runtime_env}


def _fits(job: Job, resources: dict[str, float]) -> str | None:
    """Why the cluster's total resources cannot hold the job, or None."""
    need = {k: v * job.cluster.num_workers for k, v in worker_bundle(job).items()}
    short = [f"{k} {need[k]:g} needed, {resources.get(k, 0):g} in the cluster" for k in need
             if resources.get(k, 0) + 1e-9 < need[k]]
    return "; ".join(short) or None


class RayWorkerGroup:
    def __init__(self, job: Job, embedded: bool, checkpoint_dir: str | None = None):
        self.job = job
        self.checkpoint_dir = str(checkpoint_dir) if checkpoint_dir else None  # where ranks write DCP shards
        self.embedded = embedded  # an embedded cluster cannot grow, so a shortfall is final at once
        self.pg = None
        self.workers: list[Any] = []  # actor handles, index = rank
        self.infos: list[dict] = []
        self.feeders: list[Any] = []  # the streamed datasets' feeder actors
        self.data_info: dict[str, dict] = {}  # what each feeder found: rows, columns, shapes
        self.chunk = 0  # the number of the stoppable step loop in progress (stop_early names it)
        self.file_server = None  # serves checkpoint_dir to workers on other nodes (workers/state/fileserver.py)
        self.file_server_name = None  # named anew at each start (a killed actor's name is freed late)
        self._lost: dict = {}  # elastic: ranks lost in the step loop in progress
        self.slots: list[tuple] = []  # (placement group, bundle index) of each rank's worker
        self.growth = Growth()  # elastic: workers waiting to join, in the slots no rank holds

    # ---------------------------------------------------------------- start

    def start(self) -> list[dict]:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from gearshift.workers.worker import WorkerConfig

        job = self.job
        short = _fits(job, ray.cluster_resources())
        if short and self.embedded:
            raise GearshiftError(
                f"cluster.num_workers = {job.cluster.num_workers} does not fit this machine's Ray cluster: "
                f"{short}. Use fewer workers (--set cluster.num_workers=N), lower cluster.cpus_per_worker, "
                f"or join a bigger cluster with --address.")
        feeders = self._start_feeders()  # a dataset that cannot be read fails here, before any worker
        strategy = {"pack": "PACK", "spread": "SPREAD"}[job.cluster.placement]
        self.pg = placement_group([worker_bundle(job)] * job.cluster.num_workers, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=job.cluster.placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            self.pg = None
            raise GearshiftError(
                f"The cluster could not place {job.cluster.num_workers} workers of {worker_bundle(job)} "
                f"({job.cluster.placement}) within cluster.placement_timeout_s = {job.cluster.placement_timeout_s:g} s"
                f"{': ' + short if short else ''}. Available now: {ray.available_resources()}.") from None

        STARTUP.mark("placement")
        self._name_file_server()
        self._config = WorkerConfig.from_job(job.to_dict(), [job.base_dir], self.checkpoint_dir, feeders,
                                             self.file_server_name)
        handles = [self._spawn(self.pg, i) for i in range(job.cluster.num_workers)]
        self.workers = handles
        infos = self._get([h.node_info.remote() for h in handles], "start")
        STARTUP.mark("workers")
        # ranks grouped by node (stable within a node): the ranks on one node are contiguous,
        # which later lets tensor-parallel groups stay on the fast local link
        order = sorted(range(len(handles)), key=lambda i: (infos[i]["node_ip"], infos[i]["node_id"], i))
        self.workers = [handles[i] for i in order]
        self.infos = [infos[i] for i in order]
        self.slots = [(self.pg, i) for i in order]
        self.growth.reserve(job, worker_bundle(job))
        self._check_tp_groups_are_node_local()
        self._share_devices()
        self._serve_checkpoints()

        master_addr = self.infos[0]["node_ip"]
        port = self._get([self.workers[0].free_port.remote()], "rendezvous")[0]
        world = len(self.workers)
        backends = self._get([w.setup.remote(r, world, master_addr, port, job.fault.collective_timeout_s)
                              for r, w in enumerate(self.workers)], "rendezvous")
        STARTUP.mark("rendezvous")
        choose = getattr(self, "choose_layout", None)
        if choose is not None:  # strategy auto: the layout is chosen from the devices' free memory
            memories = self._get([w.device_memory.remote() for w in self.workers], "rendezvous")
            for info, memory in zip(self.infos, memories, strict=True):
                info["device_memory"] = memory
            self.start_layout = choose(self.infos)
        builds = self.call("build", self._layout().to_dict())
        STARTUP.mark("build")
        for rank, (info, backend, built) in enumerate(zip(self.infos, backends, builds, strict=True)):
            info.update(rank=rank, backend=backend, **built)
        return self.infos

    def _spawn(self, pg, index: int):
        """A TrainWorker actor in bundle `index` of placement group `pg`. Its `request_stop` and
        `heartbeat` run on a thread of their own while `train` runs (workers/step/stopping.py)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from gearshift.workers.worker import TrainWorker

        job = self.job
        actor_cls = ray.remote(concurrency_groups={"control": 1})(TrainWorker)
        return actor_cls.options(**with_env(dict(
            num_cpus=job.cluster.cpus_per_worker, num_gpus=job.cluster.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            max_restarts=0, max_concurrency=1,
        ), job.cluster.env)).remote(self._config, job.cluster.cpus_per_worker)

    def _share_devices(self) -> None:
        """Let the workers of each node see all of the node's GPUs the job holds, each on its own
        (devices.py); a CPU job, or a worker that cannot, keeps what Ray gave it."""
        if not self.job.cluster.gpus_per_worker:
            return
        shares = share_devices(self.infos)
        used = self._get([w.use_devices.remote(s.visible, s.index) for w, s in zip(self.workers, shares, strict=True)],
                         "start")
        for info, share, ok in zip(self.infos, shares, used, strict=True):
            if ok:
                info.update(cuda_visible_devices=share.visible, device_index=share.index)

    def _name_file_server(self) -> None:
        """A name for this start's file server (started only if needed, by _serve_checkpoints), and
        the mark by which a worker tells the driver's checkpoints folder from one of the same name."""
        import uuid

        from gearshift.workers.state import fileserver

        if self.checkpoint_dir and "://" not in self.checkpoint_dir:
            self.file_server_name = f"gearshift-files-{uuid.uuid4().hex[:12]}"
            fileserver.write_mark(self.checkpoint_dir, self.file_server_name)

    def _serve_checkpoints(self) -> None:
        """When a worker runs on another node than the driver (or inject.unshared_storage), start the
        FileServer on the driver's node, through which such workers write and read the run's
        checkpoints folder by pieces (workers/state/fileserver.py), instead of gathering the whole state."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from gearshift.workers.state import fileserver

        here = ray.get_runtime_context().get_node_id()
        away = any(info["node_id"] != here for info in self.infos)
        if not self.file_server_name or not (away or self.job.inject.unshared_storage):
            return
        self.file_server = ray.remote(fileserver.FileServer).options(
            name=self.file_server_name, num_cpus=0, max_concurrency=fileserver.IN_FLIGHT, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(self.checkpoint_dir)
        self._get([self.file_server.mark.remote(self.file_server_name)], "start")

    def _start_feeders(self) -> dict[str, str]:
        """One feeder actor per streamed dataset (data, eval.data), named for the workers to find;
        its dataset is built and checked (columns, rows) now, so bad data is a job error."""
        import uuid

        import ray

        from gearshift.orchestrator.job import JobError
        from gearshift.workers.step import streaming

        job, spec = self.job, self.job.to_dict()
        wanted = {"data": spec["data"]}
        if job.eval.every and spec["eval"]["data"]:
            wanted["eval.data"] = spec["eval"]["data"]
        wanted = {k: v for k, v in wanted.items() if streaming.is_streamed(v)}
        if not wanted:
            return {}
        free = ray.cluster_resources().get("CPU", 0) - job.cluster.num_workers * job.cluster.cpus_per_worker
        if free < 1 - 1e-9:
            raise GearshiftError(
                f"Ray Data reads {', '.join(wanted)} in tasks of 1 CPU each, but the workers reserve "
                f"{job.cluster.num_workers} x {job.cluster.cpus_per_worker:g} of the cluster's "
                f"{ray.cluster_resources().get('CPU', 0):g} CPUs. Leave at least one CPU free: fewer workers, a "
                "lower cluster.cpus_per_worker, or a bigger cluster.")
        names = {}
        ahead = job.data.loader.prefetch + 4
        for field, data in wanted.items():
            name = f"gearshift-{field.replace('.', '-')}-{uuid.uuid4().hex[:12]}"
            handle = streaming.start_feeder(data, [job.base_dir], job.train.global_batch_size, job.train.seed,
                                            cycle=field == "data", ahead=ahead, name=name, field=field)
            self.feeders.append(handle)
            try:
                info = ray.get(handle.describe.remote(), timeout=streaming.TAKE_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise GearshiftError(f"{field}: the dataset was not ready within {streaming.TAKE_TIMEOUT_S:g} s "
                                     "(counting its rows and reading its schema)") from None
            if "error" in info:
                e = info["error"]
                raise JobError(e["field"], e["value"], e["allowed"], e["hint"])
            self.data_info[field] = info
            names[field] = name
        return names

    def _layout(self):
        """The job's layout, with hsdp's default group (parallel.shard_size unset, no simulated
        nodes) taken from the placement: the workers every node holds."""
        import math
        import dataclasses

        job = self.job
        if getattr(self, "start_layout", None) is not None:
            return self.start_layout
        if job.layout.strategy != "hsdp" or job.parallel.shard_size is not None or job.inject.nodes > 1:
            return job.layout
        sizes: dict[str, int] = {}
        for info in self.infos:
            sizes[info["node_id"]] = sizes.get(info["node_id"], 0) + 1
        return dataclasses.replace(job.layout, shard=math.gcd(*sizes.values()))

    def _check_tp_groups_are_node_local(self) -> None:
        """Tensor parallelism talks on every layer; across nodes it would run on the slow link."""
        layout = self.job.layout
        for group in layout.tp_groups() if layout.tp > 1 else []:
            nodes = {self.infos[r]["node_id"] for r in group}
            if len(nodes) > 1 and self.job.parallel.tp_across_nodes:
                log.warning("tensor-parallel group %s spans %d nodes (parallel.tp_across_nodes is on): its "
                            "collectives run over the link between nodes", group, len(nodes))
            elif len(nodes) > 1:
                per_node: dict[str, int] = {}
                for info in self.infos:
                    per_node[info["node_ip"] + "/" + info["node_id"][:8]] = per_node.get(
                        info["node_ip"] + "/" + info["node_id"][:8], 0) + 1
                raise GearshiftError(
                    f"tensor-parallel group of ranks {group} would span {len(nodes)} nodes: the cluster placed "
                    f"{per_node} workers per node, and tp_size({layout.tp}) does not divide each node's count. "
                    f"Use cluster.placement=pack, a tp_size that divides the workers per node, or strategy data "
                    f"(or parallel.tp_across_nodes: true to run it anyway, slowly).")

    # ---------------------------------------------------------------- calls

    def _get(self, refs: list, what: str, timeout: float = CALL_TIMEOUT_S) -> list:
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
            raise _task_failure(err, None) from None

    @property
    def call_timeout_s(self) -> float:
        """A call that runs collectives (build, reshard, state) ends within the collective timeout,
        or with the collective's error; past that and a margin, the worker is silent."""
        return self.job.fault.collective_timeout_s + CALL_MARGIN_S

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        return self._get([getattr(w, method).remote(*args) for w in self.workers], method,
                         timeout or max(self.call_timeout_s, CALL_TIMEOUT_S if method == "build" else 0))

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
        fault.progress_timeout_s, is a failure."""
        import ray

        fault = self.job.fault
        stall_timeout_s = stall_timeout_s or fault.collective_timeout_s + STALL_MARGIN_S
        # elastic: a rank that dies does not end the stream at once; the survivors' loops end
        # first (their collectives lose it), each reporting where it stopped
        lost: dict[int, WorkerFailed] = {}
        self._lost = lost
        self.chunk += 1
        chunk, flush_s = (self.chunk, 0.0) if stoppable else (None, 0.5)  # stoppable: every step reported as it ends
        gens = {w.train.remote(until_step, checkpoint_every, flush_s, last_step, chunk,
                                  self.job.checkpoint.async_save): rank
                for rank, w in enumerate(self.workers)}
        watch = Liveness(len(self.workers), stall_timeout_s, fault.progress_timeout_s, time.monotonic())
        probe = LossProbe(self.workers, self.infos) if self.job.on_node_loss == "elastic" else None
        # heartbeat calls in flight -> rank (one per rank at a time); kept on the group so that
        # shutdown drops them while Ray is still up (an ObjectRef freed after ray.shutdown, at the
        # interpreter's exit, can crash the process)
        beats: dict[Any, int] = {}
        self._beats = beats
        while gens:
            ready, _ = ray.wait(list(gens), num_returns=1, timeout=0.1 if probe and probe.probing else 1.0)
            for rank in probe.gone(gens.values()) if probe else ():  # its peers lost it; it answers nothing
                lost[rank] = WorkerFailed(rank, probe.why(rank), kind=WorkerFailed.DIED)
                lost[rank].detected = probe.detected
                del gens[next(g for g, r in gens.items() if r == rank)]
                watch.finished(rank, time.monotonic())
            ready = [g for g in ready if g in gens]
            if not ready:
                self._hear(beats, watch)
                hung = watch.verdict(time.monotonic())
                if hung is not None:
                    raise WorkerFailed(hung.rank, hung.reason, kind=WorkerFailed.SILENT)
                continue
            for gen in ready:
                rank = gens[gen]
                try:
                    ref = next(gen)
                except StopIteration:
                    del gens[gen]
                    watch.finished(rank, time.monotonic())
                    continue
                try:
                    report = ray.get(ref, timeout=CALL_TIMEOUT_S)
                except ray.exceptions.GetTimeoutError:
                    raise WorkerFailed(rank, f"its report did not arrive within {CALL_TIMEOUT_S:g} s",
                                       kind=WorkerFailed.SILENT) from None
                except ray.exceptions.RayActorError as err:
                    if self.job.on_node_loss != "elastic":
                        raise self._died(rank, err) from None
                    lost[rank] = self._died(rank, err)
                    lost[rank].detected = time.time()
                    del gens[gen]
                    watch.finished(rank, time.monotonic())
                    continue
                except ray.exceptions.RayError as err:
                    raise _task_failure(err, rank) from None
                watch.reported(rank, time.monotonic())
                if probe and "step_failed" in report:
                    probe.step_dropped(rank)
                yield rank, report
        if lost:
            err = lost[min(lost)]
            err.lost_ranks = sorted(lost)
            raise err

    def _hear(self, beats: dict, watch: Liveness) -> None:
        """Take the heartbeats that have come back, and ask again where the watch says so. A
        worker still answering its last one is not asked twice, so a frozen one is not buried
        in calls."""
        import ray

        if beats:
            done, _ = ray.wait(list(beats), num_returns=len(beats), timeout=0)
            for ref in done:
                rank = beats.pop(ref)
                if rank in self._lost:
                    continue  # dead, and accounted for (elastic)
                try:
                    watch.answered(rank, ray.get(ref, timeout=0), time.monotonic())
                except ray.exceptions.RayActorError as err:
                    raise self._died(rank, err) from None
                except ray.exceptions.RayError as err:  # an answer that could not be read tells nothing
                    log.debug("heartbeat of rank %d: %s", rank, err)
        if watch.should_poll(time.monotonic()):
            waiting = set(beats.values())
            for rank, w in enumerate(self.workers):
                if rank not in waiting and rank not in self._lost:
                    beats[w.heartbeat.options(concurrency_group="control").remote()] = rank

    def _died(self, rank: int, err) -> WorkerFailed:
        info = self.infos[rank]
        return WorkerFailed(rank, f"its process (pid {info['pid']} on {info['node_ip']}) died: killed, crashed, out "
                                  "of memory or its node was lost", details=str(err), kind=WorkerFailed.DIED)

    def regroup(self) -> None:
        master_addr = self.infos[0]["node_ip"]
        port = self._get([self.workers[0].free_port.remote()], "rendezvous")[0]
        self._get([w.rejoin.remote(master_addr, port, self.job.fault.collective_timeout_s) for w in self.workers],
                  "rejoin", self.call_timeout_s)

    def shrink(self, keep: list[int], layout: dict, behind: list[int] = ()) -> list[dict]:
        """Elastic: go on with the workers of ranks `keep` (in that order: new rank i is keep[i]),
        the others killed, on a new process group in `layout`; each survivor's rejoin result.
        The ranks in `behind` stopped a step short: they receive the state as new workers do."""
        import ray

        joining = self._get([self.workers[keep[0]].describe.remote()], "describe")[0] if behind else None
        for rank, w in enumerate(self.workers):
            if rank not in keep:
                with contextlib.suppress(Exception):
                    ray.kill(w, no_restart=True)
        self.growth.release([self.slots[r] for r in range(len(self.workers)) if r not in keep])
        self.workers, self.infos = [self.workers[r] for r in keep], [dict(self.infos[r], rank=i)
                                                                     for i, r in enumerate(keep)]
        self.slots = [self.slots[r] for r in keep]
        old_ranks = [None if r in behind else r for r in keep]
        return self._rejoin(layout, old_ranks, joining)

    def joinable(self) -> int:
        """Elastic: how many new workers are placed and could join now (returns at once)."""
        return self.growth.ready(self)

    def joining(self, count: int) -> list[dict]:
        return [info for _, _, info in self.growth.joinable[:count]]

    def grow(self, count: int, layout: dict) -> list[dict]:
        """Elastic: `count` of the joinable workers join as the last ranks; every worker forms a
        new process group and the state moves onto `layout`, the newcomers receiving their
        pieces (TrainWorker.rejoin). Each worker's result."""
        joining = self._get([self.workers[0].describe.remote()], "describe")[0]
        new = self.growth.take(count)
        old_world = len(self.workers)
        infos = self._get([h.node_info.remote() for h, *_ in new], "start")
        self.workers += [h for h, *_ in new]
        self.slots += [slot for _, slot, _ in new]
        self.infos += [dict(info, rank=old_world + i) for i, info in enumerate(infos)]
        return self._rejoin(layout, list(range(old_world)) + [None] * count, joining)

    def _rejoin(self, layout: dict, old_ranks: list, joining: dict | None) -> list[dict]:
        """Every worker on a new group of them all in `layout`; a rank whose old rank is None
        receives its state, described by `joining`."""
        self._lost = {}  # the ranks are renumbered: the last stream's losses are accounted for
        master_addr = self.infos[0]["node_ip"]
        port = self._get([self.workers[0].free_port.remote()], "rendezvous")[0]
        t, world = self.job.fault.collective_timeout_s, len(self.workers)
        return self._get([w.rejoin.remote(master_addr, port, t, i, world, layout, old_ranks,
                                          joining if old_ranks[i] is None else None)
                          for i, w in enumerate(self.workers)], "rejoin", self.call_timeout_s)

    def stop_early(self) -> None:
        for w in self.workers:  # every rank hears it; the first to act on it is enough
            w.request_stop.options(concurrency_group="control").remote(self.chunk)

    def dead_ranks(self, timeout_s: float = 3.0) -> dict[int, str]:
        """Ranks whose actor is gone (those the last stream counted lost, and any Ray says is dead
        now), with the reason given for each (lost.dead_ranks)."""
        known = {r: e.reason for r, e in (getattr(self, "_lost", None) or {}).items()}
        return dead_ranks(self.workers, known, timeout_s)

    # ---------------------------------------------------------------- the cluster's nodes

    def alive_node_ids(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def alive_node_resources(self) -> list[dict[str, float]]:
        """Each alive node's total resources, not what is free now: called after this group is
        shut down, when its own share is free again."""
        import ray

        return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]

    # ---------------------------------------------------------------- stop

    def shutdown(self, polite: bool = True) -> None:
        """Stop every actor by handle and release the placement group; never raises.

        `polite` first lets each worker leave its process group (bounded). After a failure a
        survivor may be blocked in a collective and would not answer, so it is killed at once."""
        import ray

        getattr(self, "_beats", {}).clear()
        self.growth.shutdown()
        if self.workers:
            if polite:
                with contextlib.suppress(Exception):
                    ray.get([w.shutdown.remote() for w in self.workers], timeout=10)
            for w in self.workers:
                with contextlib.suppress(Exception):
                    ray.kill(w, no_restart=True)
            self.workers = []
        for f in self.feeders + ([self.file_server] if self.file_server is not None else []):
            with contextlib.suppress(Exception):
                ray.kill(f, no_restart=True)
        self.feeders, self.file_server = [], None
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None


def _task_failure(err, rank: int | None) -> WorkerFailed:
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
