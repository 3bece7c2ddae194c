"""TrainWorker: one per device. It owns the model replica, runs its own step loop, and streams
batched step reports back; the controller stays off the hot path.

The class is plain Python; the orchestrator wraps it with `ray.remote` and placement options.
It receives the resolved job as plain data (the same mapping as the run dir's `job.yaml`).
"""

from __future__ import annotations

import datetime
import os
import resource
import socket
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

import strategies
import strategies.grads
import strategies.state
from strategies.layout import Layout
from monitoring.comm import CommClock, time_functional_collectives
from workers import components
from workers.data import GlobalBatches, load_batch

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.device.type != "cpu" else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def step_seed(seed: int, step: int, rank: int) -> int:
    """RNG state is a function of (seed, step, rank): a resumed run draws what the original drew."""
    return (seed * 1_000_003 + step * 10_007 + rank) % (2**63 - 1)


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm was NaN or Inf, and the job says to stop (fault.on_nan)."""


class TrainWorker:
    def __init__(self, job: dict, search_paths: list[str], cpus: float = 1.0):
        self.job = job
        self.search_paths = list(search_paths)
        torch.set_num_threads(max(1, int(cpus)))
        self.rank = 0
        self.world = 1
        self.step = 0
        self.parallel = None
        self.clock: CommClock | None = None  # per-step comm timing; None when telemetry is off
        self.sampler = None  # the device-sampling thread
        self.gpu_ids: list[str] = []
        self.node_ip = "127.0.0.1"
        self.ray_metrics = None
        self.non_finite: list[dict] = []  # skipped steps not yet reported
        self._current = -1  # the step being computed (0-based), for the test-only fault injections

    # ---------------------------------------------------------------- placement and rendezvous

    def node_info(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        gpus = ctx.get_accelerator_ids().get("GPU", [])
        self.gpu_ids = [str(g) for g in gpus] if self.job["cluster"]["gpus_per_worker"] > 0 else []
        self.node_ip = ray.util.get_node_ip_address()
        return {"node_ip": self.node_ip, "node_id": ctx.get_node_id(), "pid": os.getpid(),
                "hostname": socket.gethostname(), "gpu_ids": list(gpus)}

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def setup(self, rank: int, world: int, master_addr: str, master_port: int, timeout_s: float) -> str:
        self.rank, self.world = rank, world
        # The job, not the host, decides: a CPU job on a GPU node must not touch GPUs that Ray
        # never reserved for it (Ray leaves CUDA_VISIBLE_DEVICES alone when num_gpus is 0).
        if self.job["cluster"]["gpus_per_worker"] > 0:
            if not torch.cuda.is_available():
                raise RuntimeError("cluster.gpus_per_worker is 1 but this worker sees no CUDA device "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
            # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU, so it is always cuda:0 here
            self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            backend = "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        return backend

    # ---------------------------------------------------------------- model, optimizer, data

    def build(self) -> dict:
        job = self.job
        train, par = job["train"], job["parallel"]
        self.loss_fn = components.build_loss(job["loss"], self.search_paths)
        self.dataset = components.build_dataset(job["data"], job["model"], self.search_paths)
        self.batches = GlobalBatches(len(self.dataset), train["global_batch_size"], train["seed"])
        self.autocast_dtype = _DTYPES[train["precision"]]
        strategy = "data" if par["strategy"] == "auto" else par["strategy"]  # auto starts data parallel
        # auto: tuned while training (the controller reshards with each trial's value)
        self.bucket_cap_mb = job["tune"]["start"] if par["bucket_cap_mb"] == "auto" else par["bucket_cap_mb"]
        self._lay_out(Layout.for_workers(strategy, self.world, par.get("tp_size")))
        self.step = 0
        n_params = sum(p.numel() for p in self.parallel.model.parameters())  # a DTensor counts its global size
        return {"parameters": n_params, "dataset_len": len(self.dataset), "dp_rank": self.layout.dp_rank(self.rank),
                "layout": self.layout.to_dict(),
                "tokens_per_sample": self._tokens_per_sample(), "sampler": self._start_sampler()}

    def _lay_out(self, layout: Layout) -> None:
        """Build the model afresh (seeded: the same initial weights on every rank, and in a
        1-process run) and lay it out as `layout`, with its optimizer, scaler and comm timing."""
        job = self.job
        train, par = job["train"], job["parallel"]
        self.layout = layout
        torch.manual_seed(train["seed"])
        model, returned_plan = components.build_model_and_plan(job["model"], self.search_paths,
                                                               train.get("activation_checkpointing", False))
        model = model.to(self.device)
        plan = components.tp_plan(model, par.get("tp_plan"), returned_plan, layout.tp) if layout.strategy != "data" else None
        self.parallel = strategies.parallelize(model, layout, self.device, self.bucket_cap_mb, plan)
        self.optimizer = components.build_optimizer(strategies.param_groups(self.parallel.model), job["optimizer"])
        # fp16 needs loss scaling; the parameters stay fp32 (autocast computes in fp16 from them),
        # so the optimizer always updates fp32 master weights. With shards, ranks see different
        # gradients, so whether any overflowed must be agreed over all ranks before stepping.
        fp16 = train["precision"] == "fp16"
        if layout.strategy != "data":
            self.scaler = strategies.grads.sharded_grad_scaler(self.device.type, fp16)
        else:
            self.scaler = torch.amp.GradScaler(self.device.type, enabled=fp16)
        self._instrument()
        self._inject_nan()

    def _inject_nan(self) -> None:
        """Test-only (inject.nan_at_step): that step, a module's output turns NaN."""
        inject = self.job["inject"]
        if not inject.get("nan_at_step"):
            return
        modules = dict(self.parallel.model.named_modules())
        name = inject.get("nan_module") or next(n for n, m in modules.items() if n and not list(m.children()))
        if name not in modules:
            raise ValueError(f"inject.nan_module = {name!r} is not a module of the model; it has "
                             f"{', '.join(n for n in modules if n)}")
        at = inject["nan_at_step"] - 1

        def poison(module, args, output):
            return output * float("nan") if self._current == at else None

        modules[name].register_forward_hook(poison)

    def reshard(self, kind: str, tp: int, bucket_cap_mb: float | None = None) -> dict:
        """Switch: move the live model and optimizer state to another layout (or the same one
        with another `bucket_cap_mb`), in memory, on the same processes. Every rank gathers the
        full tensors (a collective), builds the new layout and keeps its own shard; step, data
        position and random state carry over (the data order and the per-step seeds are
        functions of the step). All ranks call it at the same step boundary."""
        start = time.perf_counter()
        if isinstance(kind, dict):  # TEMPORARY shim until the worker's reshard(layout: dict, bucket) merges
            bucket_cap_mb, kind, tp = tp, kind["strategy"], kind["tp"]
        if bucket_cap_mb is not None:
            self.bucket_cap_mb = float(bucket_cap_mb)
        target = Layout.for_workers(kind, self.world, tp if kind != "data" else None)
        state = {"model": strategies.state.model_state(self.parallel.model),
                 "optimizer": strategies.state.optimizer_state(self.optimizer, self.parallel.model),
                 "scaler": self.scaler.state_dict(), "step": self.step}
        gathered = time.perf_counter()
        self.parallel = self.optimizer = None  # the old layout's buffers go before the new ones come
        self._lay_out(target)
        self.load(state)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        end = time.perf_counter()
        return {"seconds": end - start, "gather_s": gathered - start, "rebuild_s": end - gathered,
                "layout": target.to_dict(), "step": self.step}

    def _tokens_per_sample(self) -> int | None:
        """Targets that are sequences of integer ids (a language model's next tokens) count as
        tokens; other targets (a class, a regression value) do not."""
        target = self.dataset[0][1]
        if isinstance(target, torch.Tensor) and target.dim() >= 1 and not target.is_floating_point():
            return int(target.numel())
        return None

    # ---------------------------------------------------------------- telemetry

    def _instrument(self) -> None:
        """Hook comm timing into the layout just built, with the test knobs: a fixed delay per
        collective, and a simulated slow link that delays the collectives of a group whose ranks
        span simulated nodes."""
        tel, inject = self.job["telemetry"], self.job["inject"]
        slow = inject["comm_delay_ms"] or inject.get("link")
        self.clock = CommClock(self.device, inject["comm_delay_ms"]) if tel["enabled"] or slow else None
        if self.clock is not None and inject.get("link"):
            per_node = self.world // inject["nodes"]
            node = [r // per_node for r in range(self.world)]
            layout, me = self.layout, self.rank
            tp_group = layout.tp_groups()[layout.dp_rank(me)]
            dp_group = [d * layout.tp + me % layout.tp for d in range(layout.dp)]
            self.clock.simulate_link(inject["link"]["mb_per_s"], inject["link"]["latency_ms"],
                                     tp_slow=len({node[r] for r in tp_group}) > 1,
                                     dp_slow=len({node[r] for r in dp_group}) > 1)
        time_functional_collectives(self.clock if self.layout.strategy != "data" else None)
        if self.clock is None:
            return
        if self.layout.strategy == "data":
            ddp = self.parallel.module
            ddp.register_comm_hook(ddp.process_group, self.clock.ddp_hook)
        elif isinstance(self.parallel.after_backward, strategies.grads.GradAverager):
            self.parallel.after_backward.timer = self.clock.dp_blocked

    def _start_sampler(self) -> dict | None:
        """Device sampling on a background thread; what it reads and why, for the telemetry."""
        tel = self.job["telemetry"]
        if not tel["enabled"] or self.sampler is not None:
            return None
        from monitoring.devices import SamplerThread, make_sampler

        sampler, reason = make_sampler(self.gpu_ids)
        self.sampler = SamplerThread(sampler, tel["sample_period_s"])
        self.sampler.start()
        if tel["ray_metrics"]:
            from monitoring.metrics import RayMetrics

            self.ray_metrics = RayMetrics.create(self.job["name"], self.rank)
        return {"source": sampler.source, "reason": reason}

    def _peak_memory(self) -> int | None:
        """Peak memory since the last report: device memory on GPU; on CPU the process's peak
        resident set (Linux reports ru_maxrss in KiB), which only grows."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return int(peak)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def state(self) -> dict | None:
        """Full (unsharded) model, optimizer and scaler state on CPU, on rank 0; None elsewhere.
        With shards this is a collective: every rank must call it at the same step."""
        if self.layout.strategy == "data" and self.rank != 0:
            return None
        model = strategies.state.model_state(self.parallel.model)
        optim = strategies.state.optimizer_state(self.optimizer, self.parallel.model)
        if self.rank != 0:
            return None
        return to_cpu({"model": model, "optimizer": optim, "scaler": self.scaler.state_dict(), "step": self.step})

    def load(self, state: dict) -> int:
        strategies.state.load_model_state(self.parallel.model, state["model"])
        strategies.state.load_optimizer_state(self.optimizer, self.parallel.model, state["optimizer"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.step = int(state["step"])
        return self.step

    # ---------------------------------------------------------------- the step loop

    def _one_step(self, step: int) -> tuple[torch.Tensor, tuple | None]:
        train = self.job["train"]
        layout = self.layout
        self._current = step
        inject = self.job["inject"]
        if inject.get("hang_at_step") == step + 1 and inject.get("hang_rank") == self.rank:
            while True:  # test-only: a rank stuck inside a step; the others block in its collectives
                time.sleep(3600)
        # Seed before the batch is loaded: a dataset's random augmentation draws from it too.
        # One stream per data-parallel replica: the ranks of a tensor-parallel group hold one
        # replica between them, so they must draw the same dropout masks and augmentations.
        # The generators are seeded directly: torch.manual_seed costs ~70 us a call on CPU.
        seed = step_seed(train["seed"], step, layout.dp_rank(self.rank))
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.default_generators[self.device.index].manual_seed(seed)
        clock = self.clock
        data_start = clock.mark() if clock else None
        # every rank of a tensor-parallel group works on its data-parallel replica's slice
        x, y = load_batch(self.dataset, self.batches.shard(step, layout.dp_rank(self.rank), layout.dp))
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        data_span = (data_start, clock.mark()) if clock else None
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            loss = self.loss_fn(self.parallel.module(x), y)
        self.scaler.scale(loss).backward()
        if clock:
            clock.after_backward()
        if self.parallel.after_backward is not None:
            self.parallel.after_backward()
        norm = None
        if train["grad_clip"]:
            self.scaler.unscale_(self.optimizer)
            params = self.parallel.model.parameters()
            if layout.strategy == "data":
                norm = torch.nn.utils.clip_grad_norm_(params, train["grad_clip"])
            else:
                norm = strategies.grads.clip_grad_norm(params, train["grad_clip"], self.parallel.tp_group,
                                                       clock.tp_blocked if clock else None)
        if not self.scaler.is_enabled():  # fp16's scaler skips steps with inf gradients itself
            if norm is None:
                norm = self._grad_norm()
            # the norm is the same on every rank (gradients are all-reduced, or their norm is), so
            # every rank takes the same decision; a non-finite loss makes non-finite gradients
            if not (torch.isfinite(norm) and torch.isfinite(loss)):
                self._non_finite(step, x, loss, norm)
                return loss.detach(), data_span
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach(), data_span

    def _grad_norm(self) -> torch.Tensor:
        params = [p for p in self.parallel.model.parameters() if p.grad is not None]
        if self.layout.strategy == "data":
            return torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        return strategies.grads.grad_norm(params, self.parallel.tp_group,
                                          self.clock.tp_blocked if self.clock else None)

    def _non_finite(self, step: int, x: torch.Tensor, loss: torch.Tensor, norm: torch.Tensor) -> None:
        """A step whose loss or gradient norm is NaN or Inf: its update is not applied (the state
        stays as the last good step left it) and the batch is skipped, or the run stops."""
        self.optimizer.zero_grad(set_to_none=True)
        layer = self._first_non_finite_module(step, x)
        found = {"step": step + 1, "loss": float(loss.detach()), "grad_norm": float(norm), "layer": layer}
        if self.job["fault"]["on_nan"] == "stop":
            raise NonFiniteStep(f"step {step + 1}: loss {found['loss']}, gradient norm {found['grad_norm']}; the "
                                f"first non-finite output was {layer or 'not found in a forward pass'} "
                                f"(fault.on_nan = stop)")
        self.non_finite.append(found)

    def _first_non_finite_module(self, step: int, x: torch.Tensor) -> str | None:
        """Run the step's forward again with a hook on every module; the first (in call order)
        whose output holds a NaN or Inf. Only after a bad step, so it costs nothing otherwise.
        Every rank runs it (they all saw the same norm), so a sharded forward's collectives match."""
        from torch.distributed.tensor import DTensor

        model, found = self.parallel.model, []
        names = {m: n for n, m in model.named_modules()}

        def check(module, args, output):
            if found:
                return
            for t in output if isinstance(output, (tuple, list)) else (output,):
                if isinstance(t, DTensor):
                    t = t.to_local()
                if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                    found.append(names.get(module) or type(module).__name__)
                    return

        hooks = [m.register_forward_hook(check) for m in model.modules() if m is not model]
        try:
            torch.default_generator.manual_seed(step_seed(self.job["train"]["seed"], step,
                                                          self.layout.dp_rank(self.rank)))
            with torch.no_grad(), torch.autocast(self.device.type, dtype=self.autocast_dtype,
                                                 enabled=self.autocast_dtype is not None):
                model(x)
        finally:
            for h in hooks:
                h.remove()
        return found[0] if found else None

    def train(self, until_step: int, checkpoint_every: int = 0, flush_s: float = 0.5,
              last_step: int | None = None) -> Iterator[dict]:
        """Run steps up to `until_step`, yielding batches of per-step reports.

        A batch is yielded every `flush_s` seconds, at each checkpoint step (rank 0 attaches the
        state) and at the end. Losses stay on the device until a flush, so a step never waits
        on a device-to-host copy just to be reported.
        """
        losses, times, ends, spans = [], [], [], []
        first = self.step
        clock = self.clock
        if clock:
            clock.take()  # nothing timed between steps belongs to the first one
        last_flush = time.perf_counter()
        t_prev = last_flush
        step_start = clock.mark() if clock else None
        while self.step < until_step:
            step = self.step
            loss, data_span = self._one_step(step)
            losses.append(loss)
            self.step = step + 1
            now = time.perf_counter()
            times.append(now - t_prev)
            ends.append(time.time())  # wall clock: steps line up across processes and tools
            t_prev = now
            if clock:
                step_end = clock.mark()
                spans.append(((step_start, step_end), data_span, clock.take()))
                step_start = step_end
            # the run's last step gets its own final save; a chunk's last step (before a possible
            # switch) is checkpointed like any other
            ckpt = checkpoint_every and self.step % checkpoint_every == 0 and self.step < (last_step or until_step)
            if ckpt or now - last_flush >= flush_s or self.step == until_step:
                report = {"rank": self.rank, "first_step": first, "losses": torch.stack(losses).float().tolist(),
                          "step_times": times, "step_ends": ends}
                if self.non_finite:
                    report["non_finite"], self.non_finite = self.non_finite, []
                if clock:
                    self._add_timings(report, spans)
                if ckpt:
                    state = self.state()  # a collective when sharded: every rank takes part
                    if state is not None:
                        report["checkpoint"] = state
                yield report
                losses, times, ends, spans = [], [], [], []
                first = self.step
                # the next step's time starts after the report left: a checkpoint's copy and
                # serialisation is not training time (the controller times checkpoints itself)
                last_flush = t_prev = time.perf_counter()
                step_start = clock.mark() if clock else None

    def _add_timings(self, report: dict, spans: list) -> None:
        """Per-step data time, comm wait and collective count, device samples and peak memory.
        On CUDA this is where the step's events are read, once per report, not per step."""
        seconds = CommClock.resolve
        if self.clock.cuda:  # device time, not the host's (which runs ahead of the device)
            spans[-1][0][1].synchronize()  # every event of the report is on this stream, before it
            report["step_times"] = [a.elapsed_time(b) / 1000.0 for (a, b), _, _ in spans]
        report["data_times"] = [b - a if not self.clock.cuda else a.elapsed_time(b) / 1000.0
                                for _, (a, b), _ in spans]
        report["comm_waits"] = [seconds(wait) for _, _, (wait, _) in spans]
        report["comm_calls"] = [calls for _, _, (_, calls) in spans]
        report["peak_mem_bytes"] = self._peak_memory()
        if self.sampler is not None:
            report["samples"] = [dict(s, rank=self.rank, node_ip=self.node_ip) for s in self.sampler.drain()]
        if self.ray_metrics is not None:
            self.ray_metrics.update(report)

    def shutdown(self) -> None:
        time_functional_collectives(None)  # this worker's clock must not outlive it
        if self.sampler is not None:
            self.sampler.stop()
            self.sampler = None
        if dist.is_initialized():
            dist.destroy_process_group()
