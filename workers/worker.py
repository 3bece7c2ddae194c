"""TrainWorker: one per device. It owns the model replica, runs its own step loop, and streams
batched step reports back; the controller stays off the hot path.

The class is plain Python; the orchestrator wraps it with `ray.remote` and placement options.
It receives a typed `WorkerConfig`. The actor is a thin shell over its parts: the group part
(workers/group/member.py: placement, the process group, the commit point's agreement), the build
part (workers/build/builder.py: the model laid out, a switch), the step part
(workers/step/runner.py: one step; workers/step/loop.py: the loop and its reports) and the state
part (workers/state/state_io.py: checkpoints, loads, final.pt). It holds what they share: rank
and world, device, the step, the layout in force, the laid-out model (`parallel`), optimizer,
scaler, comm clock, data and schedule. Whatever differs between layouts is the business of the
`Parallel` that `strategies.parallelize` returns: the loop never asks which layout it runs.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.distributed as dist

from gearshift import strategies
from gearshift.monitoring.comm import CommClock
from gearshift.strategies.layout import Layout
from gearshift.workers.build import recompute
from gearshift.workers.build.builder import Builder
from gearshift.workers.config import WorkerConfig
from gearshift.workers.group import regroup, rendezvous
from gearshift.workers.group.comm import CommRoute
from gearshift.workers.group.heartbeat import ACTIVITY, in_phase
from gearshift.workers.group.member import Member
from gearshift.workers.state import storage
from gearshift.workers.state.checkpoint import to_cpu
from gearshift.workers.state.state_io import StateIO
from gearshift.workers.step.data import tokens_per_sample
from gearshift.workers.step.loader import step_seed
from gearshift.workers.step.loop import StepLoop
from gearshift.workers.step.nonfinite import NonFiniteStep
from gearshift.workers.step.outbox import ReportOutbox
from gearshift.workers.step.runner import StepRunner
from gearshift.workers.step.telemetry import WorkerTelemetry

__all__ = ["NonFiniteStep", "TrainWorker", "WorkerConfig", "step_seed", "to_cpu"]


class TrainWorker:
    def __init__(self, config: WorkerConfig, cpus: float = 1.0):
        self.config = config
        torch.set_num_threads(max(1, int(cpus)))
        self.rank, self.world, self.step = 0, 1, 0
        self.device = torch.device("cpu")
        self.layout: Layout | None = None
        self.parallel: strategies.Parallel | None = None
        self.optimizer = self.scaler = None
        self.clock: CommClock | None = None  # per-step comm timing; None when telemetry is off
        self.telemetry: WorkerTelemetry | None = None
        self.micro_batch = config.micro_batch_size  # samples computed at once; halved after an OOM (None: the share)
        self.accumulation = 1  # micro-batches a step (set_micro_batch)
        self.shares: tuple[int, ...] | None = None  # each replica's samples of a step (None: even; set_shares)
        self.pp_split: tuple[str, ...] | None = None  # a pipeline's cut from a stage rebalance (recut), else the job's
        self.member = Member(self)  # the group part (first: it sets the process's priority)
        self.runner = StepRunner(self)  # the step part
        self.loop = StepLoop(self)
        self.builder = Builder(self)  # the build part
        self.io = StateIO(self)  # the state part
        self.outbox = ReportOutbox()  # the step loop's reports, for the controller's polls

    # ---------------------------------------------------------------- placement and rendezvous

    def node_info(self, warm: bool = False) -> dict:
        """Where this worker runs; `warm`: it is to join a running group (regroup.warm)."""
        return self.member.node_info(warm)

    def use_devices(self, visible: str, index: int) -> bool:
        """See every GPU the job holds on this node (`visible`, for CUDA_VISIBLE_DEVICES) and train
        on the `index`-th of them (orchestrator/cluster/devices.py), so NCCL can use NVLink and
        P2P between them. Only before CUDA starts in this process; otherwise nothing changes (each
        worker keeps its one GPU as cuda:0) and False says so."""
        return self.member.use_devices(visible, index)

    def free_port(self) -> int:
        return rendezvous.free_port()

    def setup(self, rank: int, world: int, master_addr: str, master_port: int, timeout_s: float) -> str:
        self.rank, self.world = rank, world
        with ACTIVITY.phase_of("rendezvous"):
            return self.member.join(master_addr, master_port, timeout_s)

    def heartbeat(self) -> dict:
        """What this worker is doing: {rank, step, phase, phase_s, since_step_s, in_collective_s}
        (workers/group/heartbeat.py). Runs on the control thread, so a step, a compile or a checkpoint
        that keeps the training thread busy does not hold it up."""
        return ACTIVITY.beat(self.rank)

    def device_memory(self) -> dict:
        """This worker's device memory (free plus its own, before the model is built): strategy
        auto starts in a layout that fits it."""
        return rendezvous.device_memory(self.device)

    def probe(self) -> dict:
        """This worker's matmul rate and the timings of all-reduces over the world, every rank at
        once, before the model is built: strategy auto's start by prediction (workers/group/probe.py)."""
        from gearshift.workers.group import probe
        from gearshift.workers.group.simnet import SimulatedNetwork

        cfg = self.config
        net = SimulatedNetwork.for_rank(cfg.comm_delay_ms, cfg.sim_nodes, cfg.sim_link, Layout("data", self.world, 1), self.rank)
        with ACTIVITY.phase_of("probe"):
            return probe.probe(net, device=self.device)

    def request_stop(self, chunk: int) -> None:
        """The controller wants training chunk `chunk` to end early (a decision to carry out): the
        ranks agree on the boundary (workers/step/stopping.py). Runs on a thread of its own while
        `train` runs; a request for a chunk that has already ended is ignored."""
        self.member.stop_chunk = chunk

    @in_phase("rejoin")
    def rejoin(self, master_addr: str, master_port: int, timeout_s: float, rank: int | None = None,
               world: int | None = None, layout: dict | None = None, old_ranks: list | None = None,
               joining: dict | None = None) -> dict:
        """Leave the process group and form a new one, the state kept in place (after a step that failed
        somewhere); with `rank`, `world`, `layout` and `old_ranks`, onto another number of workers
        (elastic), a new worker passing the holders' description as `joining` (workers/group/regroup.py)."""
        return regroup.rejoin(self, master_addr, master_port, timeout_s, rank, world, layout, old_ranks, joining)

    def describe(self) -> dict:  # the state this rank holds, as a joining worker needs to know it
        return regroup.describe(self)

    # ---------------------------------------------------------------- model, optimizer, data

    def build(self, layout: dict | None = None) -> dict:
        """Build the model, data and optimizer in `layout` (default: the job's; the driver
        passes one when the placement decides it, e.g. hsdp's group of a node's workers)."""
        with ACTIVITY.phase_of("build"):
            return self._build(layout)

    def _build(self, layout: dict | None) -> dict:
        cfg = self.config
        self.builder.prepare()
        self.builder.lay_out(Layout.from_dict(layout) if layout else
                             Layout.for_workers(cfg.strategy, self.world, cfg.tp_size, cfg.shard_size, cfg.dp_shard,
                                                cfg.pipeline.get("pp_size")))
        self.step = 0
        self.io.locate()
        self.runner.built()
        n_params = sum(p.numel() for p in self.parallel.model.parameters())  # a DTensor counts its global size
        return {"parameters": n_params, "dataset_len": len(self.dataset), "dp_rank": self.layout.dp_rank(self.rank),
                "layout": self.layout.to_dict(), "tokens_per_sample": tokens_per_sample(self.dataset),
                "compiled": self.parallel.compiled,
                "fsdp_units": recompute.describe_units(self.parallel.model, cfg.fsdp_units),
                "build": self.builder.info,
                "recomputed": len(self.builder.recomputed),
                "checkpoint_format": "dcp" if self.io.dcp_root else "full",
                "checkpoint_served": storage.is_served(self.io.dcp_root),
                "checkpoint_unreached": self.io.unreached,
                "device_memory": rendezvous.device_memory(self.device),
                "sampler": self.telemetry.start(self.rank, self.member.node_ip, self.member.gpu_ids)}

    def set_micro_batch(self, micro_batch: int | None) -> int:
        """This rank's share of a step `micro_batch` samples at a time (None: all); the accumulation."""
        return self.runner.set_micro_batch(micro_batch)

    def set_shares(self, shares: list[int] | None) -> dict:
        """Each data-parallel replica's samples of a step, from the next step on (None: even): a
        straggler's rebalance (workers/step/shares.py). Every rank gets the same list at the same
        step boundary; a new layout or group starts even again."""
        return self.runner.set_shares(shares)

    def set_lr(self, lr: float) -> None:
        """The schedule from here on, at base rate `lr` (fault.on_nan rollback lowers it)."""
        from gearshift.workers.step import schedules

        self.lr_at = schedules.build(dict(self.config.schedule), lr, self.config.total_steps, self.config.search_paths)

    @in_phase("switch")
    def reshard(self, layout: dict, bucket_cap_mb: float | None = None) -> dict:
        """Switch: move the live model and optimizer state to another layout (or the same one
        with another `bucket_cap_mb`), in memory, on the same processes, tensor by tensor (a
        full tensor exists only while it moves, and only if the old layout shards it), so no
        rank ever holds a whole unsharded model and optimizer besides its own state. Step, data
        position and random state carry over (the data order and the per-step seeds are
        functions of the step). All ranks call it at the same step boundary; where the new layout
        cannot be allocated, the old one stays in force and the result says so ("failed")."""
        return self.builder.reshard(layout, bucket_cap_mb)

    def pipeline_cut(self) -> dict | None:
        """Under a pipeline: its blocks, their weights and where each stage begins (None: no
        pipeline). What a stage rebalance plans a new cut from (orchestrator/policy/stages.py)."""
        cut = getattr(self.parallel, "cut", None)
        return cut.weighed() if cut is not None and self.layout.pp > 1 else None

    def recut(self, split: list[str]) -> dict:
        """A stage rebalance: the same pipeline cut again with `split` (the first block of every
        stage after the first), the state moved between the stages as in a switch (all ranks at
        the same step boundary). Any later switch takes the job's own cut again."""
        out = self.builder.reshard(self.layout.to_dict(), None, split)
        cut = getattr(self.parallel, "cut", None)
        return {**out, **({"cut": cut.describe()} if cut is not None else {})}

    # ---------------------------------------------------------------- state

    def state(self) -> dict | None:
        """Full (unsharded) model, optimizer and scaler state on CPU, on rank 0; None elsewhere.
        With shards this is a collective: every rank must call it at the same step."""
        return self.io.state()

    @in_phase("checkpoint")
    def checkpoint(self) -> dict:
        """This rank's part of a checkpoint of the current step, written before it returns (all ranks
        call it together, after any write behind the steps): the digests of the DCP shards it wrote;
        or (full format) from rank 0 the digest of the state.pt it wrote as the ranks gathered the
        state a tensor at a time, or, where rank 0 reaches no place to write it, the whole state."""
        return self.io.checkpoint()

    @in_phase("load")
    def load_pretrained(self) -> dict:
        """Read model.pretrained's weights into the model as laid out, this rank's pieces only
        (all ranks call it together, before the first step); {"tensors", "bytes", "seconds"}."""
        return self.io.load_pretrained()

    @in_phase("load")
    def load(self, state: dict) -> int:
        """Continue from a checkpoint: {"dcp": folder, "files": digests} (each rank checks its share
        of the files, then reads its pieces), {"full": file} (each rank maps the file on its node
        and takes its pieces) or full tensors."""
        return self.io.load(state)

    @in_phase("checkpoint")
    def write_final(self, folder: str, target: str, token: str) -> dict:
        """final.pt out of the committed checkpoint `folder`, by rank 0 on its own node where it
        sees the run's folder (workers/state/state_io.py); {"written": bool}."""
        return self.io.write_final(folder, target, token)

    # ---------------------------------------------------------------- the step loop

    @in_phase("evaluate")
    def evaluate(self, max_batches: int | None = None) -> dict:
        """Mean loss over the held-out data (eval.data) under the layout in force; all ranks call
        it at the same step boundary (workers/step/evaluation.py says how the data is split)."""
        return self.runner.evaluate(max_batches)

    def train(self, until_step: int, checkpoint_every: int = 0, flush_s: float = 0.5,
              last_step: int | None = None, chunk: int | None = None, async_save: bool = True) -> Iterator[dict]:
        """Run steps up to `until_step`, yielding batches of per-step reports.

        A batch is yielded every `flush_s` seconds, at each checkpoint step (rank 0 attaches the
        state), where train.profile's window ends (its trace attached) and at the end. Losses stay
        on the device until a flush, so a step never waits on a device-to-host copy to be reported.
        With `chunk`, the controller may end it early (`request_stop(chunk)`): every rank stops at
        the same step boundary, the one they agree on (workers/step/stopping.py). With `async_save`, a DCP
        checkpoint is written behind the steps, its part reported once written, at the end at the latest.
        """
        yield from self.loop.train(until_step, checkpoint_every, flush_s, last_step, chunk, async_save)

    def run_train(self, call: int, *args) -> None:
        """`train(*args)` as one plain call (the controller's, numbered `call`): its reports go to
        the outbox as they are made, for `take_reports` (workers/step/outbox.py); its failure is
        this call's, raised once every report before it is in the outbox."""
        self.outbox.run(call, self.train(*args))

    def take_reports(self, call: int, wait_s: float) -> tuple[list[dict], bool]:
        """The reports of `run_train` call `call` made since the last take, and whether it has
        ended, waiting up to `wait_s` for one. Runs on a thread of its own while `run_train` runs."""
        return self.outbox.take(call, wait_s)

    def shutdown(self) -> None:
        self.io.writes.settle()
        self.runner.close_loader()
        if self.parallel is not None:
            self.parallel.detach()  # this worker's clock must not outlive it
        CommRoute.off()
        if self.telemetry is not None:
            self.telemetry.stop()
        if dist.is_initialized():
            from gearshift.strategies import mesh

            mesh.forget()  # the meshes' groups go with the default group
            dist.destroy_process_group()
