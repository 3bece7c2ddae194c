"""Where the workers run, and what runs beside them.

One placement group with a bundle per worker (cluster.placement packs or spreads them), one
TrainWorker actor per bundle, and the ranks ordered by node so that the ranks of a node are
contiguous; each node's GPUs that the job holds shared among its workers (devices.py); the file
server through which workers on other nodes reach the driver's checkpoints folder; a feeder actor
per streamed dataset. A cluster that cannot hold the job is told so before anything waits on it.
RayWorkerGroup (worker_group.py) holds one Placement; what it asks of the workers it spawns goes
through calls.py.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

from gearshift.orchestrator.errors import GearshiftError
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.startup import STARTUP
from gearshift.orchestrator.cluster.calls import Ranks, get
from gearshift.orchestrator.cluster.devices import share_devices

log = logging.getLogger("gearshift")


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


class Placement:
    """What a start holds on the cluster besides the ranks themselves: the placement group, the
    feeders, the file server, and the config its workers are made with (a grown worker too)."""

    def __init__(self, job: Job, embedded: bool, checkpoint_dir: str | None = None):
        self.job = job
        self.checkpoint_dir = str(checkpoint_dir) if checkpoint_dir else None  # where ranks write DCP shards
        self.embedded = embedded  # an embedded cluster cannot grow, so a shortfall is final at once
        self.pg = None
        self.feeders: list[Any] = []  # the streamed datasets' feeder actors
        self.data_info: dict[str, dict] = {}  # what each feeder found: rows, columns, shapes
        self.file_server = None  # serves checkpoint_dir to workers on other nodes (workers/state/fileserver.py)
        self.file_server_name = None  # named anew at each start (a killed actor's name is freed late)
        self.config = None  # the WorkerConfig every worker of this start is made with

    def place(self) -> None:
        """Hold a bundle per worker: the cluster's room checked, the feeders started (a dataset that
        cannot be read fails here, before any worker), the placement group waited for within
        cluster.placement_timeout_s."""
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
        feeders = self._start_feeders()
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
        self.config = WorkerConfig.from_job(job.to_dict(), [job.base_dir], self.checkpoint_dir, feeders,
                                            self.file_server_name)

    def spawn_all(self) -> list:
        """A worker in every bundle of the placement group, in bundle order."""
        return [self.spawn(self.pg, i) for i in range(self.job.cluster.num_workers)]

    def spawn(self, pg, index: int):
        """A TrainWorker actor in bundle `index` of placement group `pg`. Its `request_stop` and
        `heartbeat` run on a thread of their own while `train` runs (workers/step/stopping.py),
        and `take_reports` on another (a long poll must not hold a heartbeat up)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from gearshift.workers.worker import TrainWorker

        job = self.job
        actor_cls = ray.remote(concurrency_groups={"control": 1, "reports": 1})(TrainWorker)
        return actor_cls.options(**with_env(dict(
            num_cpus=job.cluster.cpus_per_worker, num_gpus=job.cluster.gpus_per_worker,
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=index),
            max_restarts=0, max_concurrency=1,
        ), job.cluster.env)).remote(self.config, job.cluster.cpus_per_worker)

    def by_node(self, ranks: Ranks, infos: list[dict]) -> None:
        """Number the spawned workers (`ranks.workers`, bundle order, with their `infos`) grouped by
        node, stable within a node: the ranks on one node are contiguous, which lets
        tensor-parallel groups stay on the fast local link."""
        handles = ranks.workers
        order = sorted(range(len(handles)), key=lambda i: (infos[i]["node_ip"], infos[i]["node_id"], i))
        ranks.workers = [handles[i] for i in order]
        ranks.infos = [infos[i] for i in order]
        ranks.slots = [(self.pg, i) for i in order]

    def share_devices(self, ranks: Ranks) -> None:
        """Let the workers of each node see all of the node's GPUs the job holds, each on its own
        (devices.py); a CPU job, or a worker that cannot, keeps what Ray gave it."""
        if not self.job.cluster.gpus_per_worker:
            return
        shares = share_devices(ranks.infos)
        used = get([w.use_devices.remote(s.visible, s.index) for w, s in zip(ranks.workers, shares, strict=True)],
                   "start")
        for info, share, ok in zip(ranks.infos, shares, used, strict=True):
            if ok:
                info.update(cuda_visible_devices=share.visible, device_index=share.index)

    def _name_file_server(self) -> None:
        """A name for this start's file server (started only if needed, by serve_checkpoints), and
        the mark by which a worker tells the driver's checkpoints folder from one of the same name."""
        import uuid

        from gearshift.workers.state import fileserver

        if self.checkpoint_dir and "://" not in self.checkpoint_dir:
            self.file_server_name = f"gearshift-files-{uuid.uuid4().hex[:12]}"
            fileserver.write_mark(self.checkpoint_dir, self.file_server_name)

    def serve_checkpoints(self, infos: list[dict]) -> None:
        """When a worker runs on another node than the driver (or inject.unshared_storage), start the
        FileServer on the driver's node, through which such workers write and read the run's
        checkpoints folder by pieces (workers/state/fileserver.py), instead of gathering the whole state."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from gearshift.workers.state import fileserver

        here = ray.get_runtime_context().get_node_id()
        away = any(info["node_id"] != here for info in infos)
        if not self.file_server_name or not (away or self.job.inject.unshared_storage):
            return
        self.file_server = ray.remote(fileserver.FileServer).options(
            name=self.file_server_name, num_cpus=0, max_concurrency=fileserver.IN_FLIGHT, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=here, soft=False),
        ).remote(self.checkpoint_dir)
        get([self.file_server.mark.remote(self.file_server_name)], "start")

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

    def layout(self, infos: list[dict], chosen=None):
        """The layout to build: `chosen` at the start (strategy auto), else the job's, with hsdp's
        default group (parallel.shard_size unset, no simulated nodes) taken from the placement:
        the workers every node holds."""
        import math
        import dataclasses

        job = self.job
        if chosen is not None:
            return chosen
        if job.layout.strategy != "hsdp" or job.parallel.shard_size is not None or job.inject.nodes > 1:
            return job.layout
        sizes: dict[str, int] = {}
        for info in infos:
            sizes[info["node_id"]] = sizes.get(info["node_id"], 0) + 1
        return dataclasses.replace(job.layout, shard=math.gcd(*sizes.values()))

    def check_tp_groups_are_node_local(self, infos: list[dict]) -> None:
        """Tensor parallelism talks on every layer; across nodes it would run on the slow link."""
        layout = self.job.layout
        for group in layout.tp_groups() if layout.tp > 1 else []:
            nodes = {infos[r]["node_id"] for r in group}
            if len(nodes) > 1 and self.job.parallel.tp_across_nodes:
                log.warning("tensor-parallel group %s spans %d nodes (parallel.tp_across_nodes is on): its "
                            "collectives run over the link between nodes", group, len(nodes))
            elif len(nodes) > 1:
                per_node: dict[str, int] = {}
                for info in infos:
                    per_node[info["node_ip"] + "/" + info["node_id"][:8]] = per_node.get(
                        info["node_ip"] + "/" + info["node_id"][:8], 0) + 1
                raise GearshiftError(
                    f"tensor-parallel group of ranks {group} would span {len(nodes)} nodes: the cluster placed "
                    f"{per_node} workers per node, and tp_size({layout.tp}) does not divide each node's count. "
                    f"Use cluster.placement=pack, a tp_size that divides the workers per node, or strategy data "
                    f"(or parallel.tp_across_nodes: true to run it anyway, slowly).")

    def release(self) -> None:
        """Stop the feeders and the file server and free the placement group; never raises."""
        import ray

        for f in self.feeders + ([self.file_server] if self.file_server is not None else []):
            with contextlib.suppress(Exception):
                ray.kill(f, no_restart=True)
        self.feeders, self.file_server = [], None
        if self.pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.pg)
            self.pg = None
