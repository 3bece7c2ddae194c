"""TrainWorker: one per device. It owns the model replica, runs its own step loop, and streams
batched step reports back; the controller stays off the hot path.

The class is plain Python; the orchestrator wraps it with `ray.remote` and placement options.
It receives a typed `WorkerConfig`. Whatever differs between layouts is the business of the
`Parallel` that `strategies.parallelize` returns: the loop never asks which layout it runs.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Iterator

import torch
import torch.distributed as dist

from gearshift import strategies
from gearshift.monitoring.comm import CommClock
from gearshift.strategies.base import SwitchAborted
from gearshift.strategies.layout import Layout
from gearshift.workers.build import components, recompute, shard_init
from gearshift.workers.group import priority, regroup, rendezvous
from gearshift.workers.state import dcp, full_format, storage
from gearshift.workers.step import oom, precision, schedules
from gearshift.workers.group.comm import CommRoute
from gearshift.workers.state.checkpoint import to_cpu
from gearshift.workers.config import WorkerConfig
from gearshift.workers.step.data import GlobalBatches, tokens_per_sample
from gearshift.workers.step.evaluation import held_out_loss
from gearshift.workers.step.grad_check import GradCheck
from gearshift.workers.group.heartbeat import ACTIVITY, in_phase
from gearshift.workers.step.module_memory import ModuleMemory
from gearshift.workers.step.loader import StepLoader, open_data, open_loader, seed_generators, step_seed
from gearshift.workers.step.nonfinite import NonFiniteStep, first_non_finite_module, non_finite_step
from gearshift.workers.step.pending import PendingSteps, skips_on_device
from gearshift.workers.step.profiling import StepProfiler
from gearshift.workers.group.simnet import SimulatedNetwork
from gearshift.workers.state.state_io import StateIO
from gearshift.workers.step.stopping import StopAgreement, flag_group
from gearshift.workers.step.telemetry import WorkerTelemetry

__all__ = ["NonFiniteStep", "TrainWorker", "WorkerConfig", "step_seed", "to_cpu"]

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class TrainWorker:
    def __init__(self, config: WorkerConfig, cpus: float = 1.0):
        self.config = config
        torch.set_num_threads(max(1, int(cpus)))
        self.priority = priority.as_parent()  # Ray's workers run 15 nice levels below it (workers/group/priority.py)
        self.rank, self.world, self.step = 0, 1, 0
        self.device = torch.device("cpu")
        self.parallel: strategies.Parallel | None = None
        self.clock: CommClock | None = None  # per-step comm timing; None when telemetry is off
        self.telemetry: WorkerTelemetry | None = None
        self.gpu_ids, self.node_ip = [], "127.0.0.1"
        self.non_finite: list[dict] = []  # skipped steps not yet reported
        self.grad_check: GradCheck | None = None  # train.grad_check
        self.probe: ModuleMemory | None = None  # rank 0's memory by module, on its first update
        self.loader: StepLoader | None = None
        self.profiler = StepProfiler(config.profile, cuda=config.gpu)  # train.profile's window
        self.flags = None      # the stop agreement's process group (workers/step/stopping.py)
        self.micro_batch = config.micro_batch_size  # samples computed at once; halved after an OOM (None: the share)
        self.updating = False  # inside the optimizer's step: an OOM there leaves the update half applied
        self.stop_chunk = -1   # the chunk the controller asked to stop early (request_stop)
        self.build_info: dict = {"on_meta": False}  # how the first build went (build() reports it)
        self.recomputed: list[str] = []  # the modules train.activation_checkpointing wrapped
        self.device_index: int | None = None  # this worker's GPU among the node's shared ones (use_devices)
        self.async_save = True  # checkpoint.async_save: DCP checkpoints in the loop are written behind the steps
        self.writes = dcp.Behind()  # that checkpoint, while it is written (one at a time)
        self.io = StateIO(self)  # checkpoints, loads, pretrained weights, final.pt (workers/state/state_io.py)

    # ---------------------------------------------------------------- placement and rendezvous

    def node_info(self, warm: bool = False) -> dict:
        """Where this worker runs; `warm`: it is to join a running group (regroup.warm)."""
        regroup.warm(self) if warm else None
        info = rendezvous.node_info()
        info["nice"] = self.priority
        self.gpu_ids = [str(g) for g in info["gpu_ids"]] if self.config.gpu else []
        self.node_ip = info["node_ip"]
        return info

    def use_devices(self, visible: str, index: int) -> bool:
        """See every GPU the job holds on this node (`visible`, for CUDA_VISIBLE_DEVICES) and train
        on the `index`-th of them (orchestrator/cluster/devices.py), so NCCL can use NVLink and
        P2P between them. Only before CUDA starts in this process; otherwise nothing changes (each
        worker keeps its one GPU as cuda:0) and False says so."""
        if torch.cuda.is_initialized():
            return False
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.device_index = index
        return True

    def free_port(self) -> int:
        return rendezvous.free_port()

    def setup(self, rank: int, world: int, master_addr: str, master_port: int, timeout_s: float) -> str:
        self.rank, self.world = rank, world
        with ACTIVITY.phase_of("rendezvous"):
            backend = self._join(master_addr, master_port, timeout_s)
        return backend

    def heartbeat(self) -> dict:
        """What this worker is doing: {rank, step, phase, phase_s, since_step_s, in_collective_s}
        (workers/group/heartbeat.py). Runs on the control thread, so a step, a compile or a checkpoint
        that keeps the training thread busy does not hold it up."""
        return ACTIVITY.beat(self.rank)

    def device_memory(self) -> dict:
        """This worker's device memory (free plus its own, before the model is built): strategy
        auto starts in a layout that fits it."""
        return rendezvous.device_memory(self.device)

    def _join(self, master_addr: str, master_port: int, timeout_s: float) -> str:
        joined = {}

        def make_groups():
            self.writes.group = None  # gone with the groups it was made beside; made again at the next save
            index = {"device_index": self.device_index} if self.device_index is not None else {}
            joined["device"], joined["backend"] = rendezvous.join(self.rank, self.world, master_addr, master_port,
                                                                  timeout_s, self.config.gpu, **index)
            self.flags = flag_group(self.world)

        rendezvous.opened_by(make_groups)
        self.device = joined["device"]
        return joined["backend"]

    def request_stop(self, chunk: int) -> None:
        """The controller wants training chunk `chunk` to end early (a decision to carry out): the
        ranks agree on the boundary (workers/step/stopping.py). Runs on a thread of its own while
        `train` runs; a request for a chunk that has already ended is ignored."""
        self.stop_chunk = chunk

    # ---------------------------------------------------------------- model, optimizer, data

    def build(self, layout: dict | None = None) -> dict:
        """Build the model, data and optimizer in `layout` (default: the job's; the driver
        passes one when the placement decides it, e.g. hsdp's group of a node's workers)."""
        with ACTIVITY.phase_of("build"):
            return self._build(layout)

    def _build(self, layout: dict | None) -> dict:
        cfg = self.config
        self._prepare()
        self._lay_out(Layout.from_dict(layout) if layout else
                      Layout.for_workers(cfg.strategy, self.world, cfg.tp_size, cfg.shard_size, cfg.dp_shard))
        self.step = 0
        self._checkpoints()
        self.grad_check = GradCheck(dict(cfg.grad_check), self.parallel.model) if cfg.grad_check else None
        self.probe = ModuleMemory() if self.rank == 0 and not cfg.compile else None
        n_params = sum(p.numel() for p in self.parallel.model.parameters())  # a DTensor counts its global size
        return {"parameters": n_params, "dataset_len": len(self.dataset), "dp_rank": self.layout.dp_rank(self.rank),
                "layout": self.layout.to_dict(), "tokens_per_sample": tokens_per_sample(self.dataset),
                "compiled": self.parallel.compiled,
                "fsdp_units": recompute.describe_units(self.parallel.model, cfg.fsdp_units),
                "build": self.build_info,
                "recomputed": len(self.recomputed),
                "checkpoint_format": "dcp" if self.dcp_root else "full",
                "checkpoint_served": storage.is_served(self.dcp_root),
                "device_memory": rendezvous.device_memory(self.device),
                "sampler": self.telemetry.start(self.rank, self.node_ip, self.gpu_ids)}

    def _prepare(self) -> None:
        """What a worker needs besides its layout: loss, data, schedule, where checkpoints go."""
        cfg = self.config
        paths = cfg.search_paths
        self.loss_fn = components.build_loss(dict(cfg.loss), paths)
        self.dataset = open_data(cfg, "data")  # map-style, or a Ray Dataset streamed by its feeder
        self.batches = GlobalBatches(len(self.dataset), cfg.global_batch_size, cfg.seed)
        self.eval_dataset = open_data(cfg, "eval.data") if cfg.eval_data else None
        self.autocast_dtype = _DTYPES[cfg.precision]
        self.lr_at = schedules.build(dict(cfg.schedule), cfg.lr, cfg.total_steps, paths)
        self.bucket_cap_mb = cfg.bucket_cap_mb
        strategies.lookup(cfg.strategy, paths)  # a user's own strategy is imported from the job's folder
        if self.telemetry is None:
            self.telemetry = WorkerTelemetry(cfg, self.device)

    def _checkpoints(self) -> None:
        """Where checkpoints go (a collective) and where rank 0 writes the full format's state.pt."""
        cfg = self.config
        self.dcp_root = dcp.root_for(cfg.checkpoint_dir, cfg.checkpoint_format, self.device, cfg.checkpoint_options,
                                     served=cfg.checkpoint_server, unshared=cfg.unshared_storage)
        self.full_place = None if self.dcp_root is not None or self.rank != 0 else full_format.place(
            cfg.checkpoint_dir, cfg.checkpoint_server, cfg.checkpoint_options, cfg.unshared_storage)

    def set_micro_batch(self, micro_batch: int | None) -> int:
        """This rank's share of a step `micro_batch` samples at a time (None: all); the accumulation."""
        share = self.config.global_batch_size // self.layout.dp
        self.micro_batch = micro_batch if micro_batch and micro_batch < share else None
        self.accumulation = share // self.micro_batch if self.micro_batch else 1
        return self.accumulation

    def set_lr(self, lr: float) -> None:
        """The schedule from here on, at base rate `lr` (fault.on_nan rollback lowers it)."""
        self.lr_at = schedules.build(dict(self.config.schedule), lr, self.config.total_steps, self.config.search_paths)

    def _lay_out(self, layout: Layout, move_from: tuple | None = None, rewrap: tuple | None = None,
                 gather=None) -> None:
        """Build the model and lay it out as `layout`, with its optimizer, scaler and comm route:
        afresh (seeded: the same initial weights on every rank, and in a 1-process run), or, in a
        switch, on the meta device with the state moved over from `move_from` (old parallel,
        old optimizer) tensor by tensor, or (`rewrap`: old parallel, old optimizer of a replicated
        layout) the same module and optimizer wrapped again, on a new process group."""
        cfg = self.config
        self.layout = layout
        self._close_loader()  # its slice of the batch belonged to the old layout's dp
        # a switch that changes dp keeps the micro-batch: the accumulation count changes instead
        self.set_micro_batch(self.micro_batch)
        torch.manual_seed(cfg.seed)
        record = None  # a first build on the meta device, to be replayed piece by piece (workers/build/meta_init.py)
        build = lambda: components.build_model_and_plan(dict(cfg.model), cfg.search_paths,  # noqa: E731
                                                        cfg.activation_checkpointing)
        if rewrap is not None:  # the same module and optimizer under a new wrapper (a new process group)
            model, returned_plan = rewrap[0].model, None
        elif move_from is None and self._shards(layout):
            (model, returned_plan), record = self._build_on_meta(build)
        else:
            with torch.device("meta") if move_from else contextlib.nullcontext():
                model, returned_plan = build()
            model = model if move_from else model.to(self.device)  # meta: relayout allocates the new pieces
        if rewrap is None:
            self.recomputed = recompute.apply(model, cfg.activation_checkpointing, cfg.fsdp_units,
                                              builtin=not cfg.model.get("entrypoint"))
            precision.keep_fp32(model, cfg.keep_fp32, self.device.type)
            precision.fp32_when(model, cfg.final_fp32, self.device.type, lambda: precision.final(self.step, cfg))
        plan = None
        if strategies.lookup(layout.strategy).needs_plan:
            plan = components.tp_plan(model, dict(cfg.tp_plan), returned_plan, layout.tp)
        options = strategies.Options(self.device, self.bucket_cap_mb, fp16=cfg.precision == "fp16",
                                     fsdp_units=cfg.fsdp_units, dp_overlap=cfg.dp_overlap,
                                     mixed_precision=cfg.fsdp_mixed_precision)
        make_optimizer = lambda groups: components.build_optimizer(groups, dict(cfg.optimizer), self.device)  # noqa: E731
        if move_from:
            from gearshift.strategies.relayout import relayout  # DTensor and FSDP: only a switch needs them

            self.parallel, self.optimizer = relayout(*move_from, model, layout, plan, options, make_optimizer,
                                                     agree=self._agree, gather=gather)
        elif rewrap is not None:
            self.parallel, self.optimizer = strategies.parallelize(model, layout, plan, options), rewrap[1]
        else:
            if record is None:  # built whole: per_shard makes its values as a sharded layout's ranks do
                self.build_info.update(shard_init.whole(model, build, cfg.model.get("init", "auto"), cfg.seed,
                                                        self.device))
            self.parallel = strategies.parallelize(model, layout, plan, options)
            if record is not None:
                self._materialise(record)
            del record
            self.optimizer = make_optimizer(self.parallel.param_groups())
        self.scaler = self.parallel.make_scaler()
        self.clock = CommClock(self.device) if cfg.telemetry else None
        self._attach_route()
        if cfg.compile and rewrap is None:  # compiled afresh with every layout: a switch recompiles
            self.parallel.compile(dict(cfg.compile))

    def _shards(self, layout: Layout) -> bool:
        """Whether `layout` holds pieces of the model (not whole copies) and can be laid out on
        the meta device: then the first build never holds the whole model."""
        return strategies.lookup(layout.strategy).meta_ok and (layout.tp > 1 or layout.shard > 1)

    def _build_on_meta(self, build):
        """The model on the meta device with the record of its build, or, where the record cannot
        be replayed exactly (workers/build/meta_init.py says when), built whole as before."""
        from gearshift.workers.build.meta_init import build_recorded

        try:
            result, record = build_recorded(build)
            reason = None if record.replayable else record.reason
        except Exception as err:  # noqa: BLE001 - the build reads a value the meta device has not got
            result, record, reason = None, None, f"{type(err).__name__}: {err}"[:300]
        if reason is None:
            self.build_info = {"on_meta": True}
            return result, record
        self.build_info = {"on_meta": False, "why": reason}
        torch.manual_seed(self.config.seed)
        model, plan = build()
        return (model.to(self.device), plan), None

    def _materialise(self, record) -> None:
        """Allocate this rank's pieces and fill them from the record's replay (`exact`: a plain
        build's values) or each from its own rows (`per_shard`, workers/build/shard_init.py), but those
        model.pretrained overwrites before the first step: left empty, not drawn."""
        from gearshift.workers.build import meta_init, pretrained

        started = time.perf_counter()
        skip = pretrained.covered(self.parallel.model, self.config.model.get("pretrained"), self.config.search_paths)
        mode, why = shard_init.choose(self.config.model.get("init", "auto"), shard_init.parameters(record))
        torch.manual_seed(self.config.seed)  # the replay draws what the plain build draws
        if mode == "per_shard":
            made = shard_init.fill(self.parallel.model, record, self.device, self.config.seed, skip)
            self.build_info.update(drawn=made.drawn, drawn_whole=made.whole)
        else:
            meta_init.fill(self.parallel.model, record, self.device, skip)
        self.build_info.update({"init": mode, "init_why": why, "fill_s": round(time.perf_counter() - started, 3)},
                               **({"from_weights": len(skip)} if skip else {}))

    def _attach_route(self) -> None:
        cfg = self.config
        net = SimulatedNetwork.for_rank(cfg.comm_delay_ms, cfg.sim_nodes, cfg.sim_link, self.layout, self.rank)
        self.parallel.attach(CommRoute(self.clock, net) if self.clock or net else None)

    def _agree(self, ok: bool) -> bool:
        """Whether every rank says `ok` (a switch's commit point); all ranks call it together."""
        if self.flags is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        with ACTIVITY.collective():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.flags)
        return bool(flag.item())

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

    @in_phase("switch")
    def reshard(self, layout: dict, bucket_cap_mb: float | None = None) -> dict:
        """Switch: move the live model and optimizer state to another layout (or the same one
        with another `bucket_cap_mb`), in memory, on the same processes, tensor by tensor (a
        full tensor exists only while it moves, and only if the old layout shards it), so no
        rank ever holds a whole unsharded model and optimizer besides its own state. Step, data
        position and random state carry over (the data order and the per-step seeds are
        functions of the step). All ranks call it at the same step boundary."""
        start = time.perf_counter()
        self.writes.settle()  # the state moves: nothing may still be reading it
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = float(bucket_cap_mb)
        strategies.lookup(layout["strategy"], self.config.search_paths)  # a user's own may not be loaded yet
        target = Layout.from_dict(layout)
        if target.world != self.world:
            raise ValueError(f"reshard to {target}: dp({target.dp}) * tp({target.tp}) != world({self.world})")
        scaler = self.scaler.state_dict()
        old = (self.parallel, self.optimizer)
        before = (self.layout, self.scaler, self.clock)
        self.parallel.detach()
        self.parallel = self.optimizer = None
        try:
            self._lay_out(target, move_from=old)
        except SwitchAborted as err:  # nothing moved: the old layout is whole, and in force again
            self.parallel, self.optimizer = old
            self.layout, self.scaler, self.clock = before
            self._attach_route()
            self.set_micro_batch(self.micro_batch)
            oom.give_back(self.device)
            return {"seconds": time.perf_counter() - start, "layout": self.layout.to_dict(), "step": self.step,
                    "failed": {"kind": "oom", "rank": self.rank, "step": self.step, "during": "switch",
                               "to": target.to_dict(), "own": err.own, "message": str(err)[:500],
                               **oom.memory_figures(self.device)}}
        del old
        if scaler:  # a disabled scaler (no fp16) has no state
            self.scaler.load_state_dict(scaler)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return {"seconds": time.perf_counter() - start, "layout": target.to_dict(), "step": self.step}

    def state(self) -> dict | None:
        """Full (unsharded) model, optimizer and scaler state on CPU, on rank 0; None elsewhere.
        With shards this is a collective: every rank must call it at the same step."""
        full = self.parallel.full_state(self.optimizer, self.rank)
        if full is None:
            return None
        return to_cpu({**full, "scaler": self.scaler.state_dict(), "step": self.step})

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

    def _seed(self, step: int) -> None:
        # one stream per data-parallel replica: a tensor-parallel group draws the same masks and augmentations
        seed_generators(step_seed(self.config.seed, step, self.layout.dp_rank(self.rank)), self.device)

    def _autocast(self):
        """Autocast to the job's dtype, after the fp32 warm-up steps (precision phases)."""
        if self.autocast_dtype is None:  # fp32: a disabled autocast still costs ~0.1 ms a step to enter
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype,
                              enabled=precision.autocast_on(self.step, self.config))

    def _forward_loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.loss_fn(self.parallel.module(x), y)

    def _batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's slice of global step `step` (every rank of a tensor-parallel group works
        on its data-parallel replica's slice), from a loader started where the run is."""
        if self.loader is None or self.loader.next_step != step:
            self._close_loader()
            self.loader = open_loader(self.config, self.dataset, self.batches, step, self.layout.dp_rank(self.rank),
                                      self.layout.dp, self.device)
        return self.loader.next()

    def _close_loader(self) -> None:
        if self.loader is not None:
            self.loader.close()
            self.loader = None

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward over the step's micro-batches; the mean loss. Gradients
        accumulate; data parallelism syncs them once, in the last micro-batch's backward."""
        n = self.accumulation
        if n == 1:
            loss = self._forward_loss(x, y)
            self.scaler.scale(loss).backward()
            return loss.detach()
        total = torch.zeros((), device=self.device)
        for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
            with self.parallel.no_sync() if i < n - 1 else contextlib.nullcontext():
                loss = self._forward_loss(xm, ym) / n  # equal micro-batches: the mean of means
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        return total

    def _one_step(self, step: int) -> tuple[torch.Tensor, tuple | None, float, torch.Tensor | None]:
        """One optimizer step: (loss, data span, lr, the found-inf flag a fused optimizer skipped on,
        else None). Nothing waits for the device: norms only for clipping; the flag is read later."""
        clip, clock = self.config.grad_clip, self.clock
        data_start = clock.mark() if clock else None
        x, y = self._batch(step)  # seeded by the step before loading: augmentation draws the same anywhere
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        data_span = (data_start, clock.mark()) if clock else None
        self._seed(step)  # dropout draws the same whichever process loaded the batch
        self.optimizer.zero_grad(set_to_none=True)
        with self.probe.watching(self.parallel.model) if self.probe else contextlib.nullcontext():
            loss = self._backward(x, y)
        if clock:
            clock.after_backward()
        self.parallel.after_backward()
        if self.grad_check and self.grad_check.due(step):  # per-parameter norms, before clipping
            self.grad_check.check(step, self.parallel.model, loss, self.lr_at(step + 1), self.scaler,
                                  self.batches.shard(step, self.layout.dp_rank(self.rank), self.layout.dp))
        norm = None
        if clip:
            self.scaler.unscale_(self.optimizer)
            norm = self.parallel.clip_grad_norm(clip)
        lr = self.lr_at(step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        found = None
        if not self.scaler.is_enabled():  # fp16's scaler finds inf gradients and skips the step itself
            # the same on every rank (the clipping norm is global, or the layout agrees on it), so
            # every rank takes the same decision; a non-finite loss makes non-finite gradients
            found = self.parallel.found_inf(norm)
            if not skips_on_device(self.optimizer):  # the loop and foreach kernels take no flag: the host reads it
                if found.item():
                    self._non_finite(step, x, loss, norm if norm is not None else self.parallel.grad_norm())
                    return loss, data_span, lr, None
                found = None
        self.updating = True
        if found is not None:  # what GradScaler hands a fused optimizer: it skips the update if found
            self.optimizer.grad_scale, self.optimizer.found_inf = None, found
        try:
            self.scaler.step(self.optimizer)
        finally:
            if found is not None:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        self.scaler.update()
        self.updating = False
        return loss, data_span, lr, found

    @in_phase("evaluate")
    def evaluate(self, max_batches: int | None = None) -> dict:
        """Mean loss over the held-out data (eval.data) under the layout in force; all ranks call
        it at the same step boundary (workers/step/evaluation.py says how the data is split)."""
        if self.eval_dataset is None:
            raise RuntimeError("evaluate: this job has no eval.data (eval.every is 0)")
        return held_out_loss(self.eval_dataset, self._forward_loss, self.parallel.module, self.device,
                             self.config.global_batch_size, self.layout, self.rank, self.world, max_batches,
                             micro_batch=self.micro_batch)

    def _non_finite(self, step: int, x: torch.Tensor, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """A step whose loss or gradient norm is NaN or Inf: its update is not applied (the state
        stays as the last good step left it) and the batch is skipped, or the run stops."""
        self.optimizer.zero_grad(set_to_none=True)

        def forward():
            self._seed(step)
            with self._autocast():
                self.parallel.model(x)

        self.non_finite.append(non_finite_step(step, loss, norm, first_non_finite_module(self.parallel.model, forward),
                                               stop=self.config.on_nan == "stop"))

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
        self.async_save = async_save
        clock = self.clock
        if clock:
            clock.take()  # nothing timed between steps belongs to the first one
        agreement = (StopAgreement(self.flags, lambda: self.stop_chunk == chunk) if chunk is not None else None)
        pending = PendingSteps(self.step, clock)
        priority.as_parent()  # threads started since (the process groups') take the worker's priority too
        ACTIVITY.progressed()  # the time between chunks is the controller's, not a slow step
        ACTIVITY.set_phase("step")
        try:
            yield from self._loop(until_step, checkpoint_every, flush_s, last_step, agreement, pending)
            with ACTIVITY.phase_of("checkpoint"):
                tail = self.writes.take(wait=True)  # the chunk ends with every write of it reported
            if tail:
                yield {"rank": self.rank, "first_step": self.step, "losses": [], **tail}
        except Exception as err:  # noqa: BLE001 - a peer lost between steps (a checkpoint's collective)
            if not oom.peer_gone(err):
                raise
            yield {"rank": self.rank, "step_failed": self._step_failed(err)}
        finally:
            ACTIVITY.set_phase("idle")

    def _loop(self, until_step, checkpoint_every, flush_s, last_step, agreement, pending) -> Iterator[dict]:
        clock = self.clock
        while self.step < until_step:
            try:
                if agreement is not None and agreement.stop_here():
                    agreement = None  # stopped: nothing outstanding on the group
                    break
                self.profiler.before_step(self.step, self.parallel.model)
                loss, data_span, lr, found = self._one_step(self.step)
            except Exception as err:  # noqa: BLE001 - out of memory here or on a peer; anything else is raised
                if not isinstance(err, torch.OutOfMemoryError) and not oom.peer_gone(err):
                    raise
                if pending.losses:
                    yield self._report(pending, False) | self.profiler.take()
                yield {"rank": self.rank, "step_failed": self._step_failed(err)}
                return
            self.step += 1
            ACTIVITY.stepped(self.step)
            pending.add(loss, data_span, lr, found)
            # the run's last step gets its own final save; a chunk's last step (before a possible
            # switch) is checkpointed like any other
            ckpt = checkpoint_every and self.step % checkpoint_every == 0 and self.step < (last_step or until_step)
            if self.profiler.after_step(self.step) or ckpt or pending.age() >= flush_s or self.step == until_step:
                yield self._report(pending, bool(ckpt)) | self.profiler.take()  # the window's trace, once
                # the next step's time starts after the report left: a checkpoint's copy and
                # serialisation is not training time (the controller times checkpoints itself)
                pending = PendingSteps(self.step, clock)
        if agreement is not None:
            agreement.close()
        if pending.losses:  # stopped early between flushes
            yield self._report(pending, False) | self.profiler.take()

    def _step_failed(self, err: Exception) -> dict:
        """Drop the failed step (nothing of it applied) and say why: out of memory here, or a peer gone."""
        ran_out = isinstance(err, torch.OutOfMemoryError)
        kind = ("oom_in_update" if self.updating else "oom") if ran_out else "aborted"
        figures = oom.memory_figures(self.device)  # what was held when it failed
        # a write behind the steps coordinates on a group about to be left: it fails, uncommitted
        self.writes.drop()
        self.updating = False
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        oom.leave_group()  # peers blocked in this step's collectives fail now, not at the timeout
        self.flags = None
        oom.give_back(self.device)
        return {"kind": kind, "rank": self.rank, "step": self.step + 1, "layout": self.layout.to_dict(),
                "micro_batch": self.micro_batch or self.config.global_batch_size // self.layout.dp,
                "message": f"{type(err).__name__}: {str(err)[:500]}", **figures}

    def _report(self, pending: PendingSteps, checkpoint: bool) -> dict:
        report = pending.report(self.rank)
        for bad in pending.skipped_on_device(report["losses"]):  # read with the losses: no sync of its own
            self.non_finite.append(non_finite_step(bad, torch.tensor(report["losses"][bad - pending.first]),
                                                   None, None, stop=self.config.on_nan == "stop", on_device=True))
        if self.non_finite:
            report["non_finite"], self.non_finite = self.non_finite, []
        if self.grad_check and self.grad_check.found:
            report["grad_anomalies"] = self.grad_check.take()
        if self.probe and self.probe.ready:
            report["module_memory"] = self.probe.take(self.parallel.model, self.optimizer)
        if self.clock:
            self.telemetry.add_timings(report, pending.spans, self.clock.cuda)
        if not checkpoint:
            report.update(self.writes.take(wait=False))  # a write behind the steps that has ended
        elif self.async_save and self.dcp_root is not None:  # written behind the steps (dcp.Behind.start)
            with ACTIVITY.phase_of("checkpoint"):  # every rank takes part (a barrier, the write's plan)
                report.update(self.writes.start(self.parallel.model, self.optimizer, dcp.tmp_folder(
                    self.dcp_root, self.step), self.step, self.rank, self.io.extra()))
        else:
            report.update(self.checkpoint())  # a collective when sharded: every rank takes part
        return report

    def shutdown(self) -> None:
        self.writes.settle()
        self._close_loader()
        if self.parallel is not None:
            self.parallel.detach()  # this worker's clock must not outlive it
        CommRoute.off()
        if self.telemetry is not None:
            self.telemetry.stop()
        if dist.is_initialized():
            from gearshift.strategies import mesh

            mesh.forget()  # the meshes' groups go with the default group
            dist.destroy_process_group()

