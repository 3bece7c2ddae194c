"""What every layout hands the worker: a `Parallel` that owns everything that differs between
layouts, so the step loop never asks which layout it runs.

A layout is a `Strategy` in the registry (strategies/__init__.py): its name, how it uses the
workers (`mesh`), and `apply(model, mesh, layout, plan, options) -> Parallel`. The base class
below is right for a model whose parameters are whole on every rank; sharded layouts override
what sharding changes (the norm, the scaler, gathering and loading full state).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn

from gearshift.strategies import state
from gearshift.strategies.layout import GROUPED, REPLICATED, SHARDED, Layout

# How a strategy uses the workers, which decides the (dp, tp) a job's worker count gives it.
REPLICATE = "replicate"  # every worker a replica: dp = workers, tp = 1
SHARD = "shard"          # every worker one shard of one model: dp = 1, tp = workers
GRID = "grid"            # dp replicas of tp shards: tp = parallel.tp_size, dp = workers / tp
PIPE = "pipe"            # pp stages of dp replicas: pp = parallel.pp_size, dp = workers / pp
MESHES = (REPLICATE, SHARD, GRID, PIPE)


@dataclass(frozen=True)
class Options:
    """What the job says about laying out, besides the layout itself."""

    device: torch.device
    bucket_cap_mb: float = 25.0
    fp16: bool = False  # fp16 autocast: gradients are loss-scaled
    fsdp_units: tuple[str, ...] = ()  # parallel.fsdp_units (empty: found, strategies/fsdp.py find_units)
    dp_overlap: bool = True  # hybrid: the data-parallel average overlaps backward (parallel.dp_overlap)
    # FSDP2's (param_dtype, reduce_dtype), "bf16" | "fp32": gathers and compute in the first, the
    # gradients reduced in the second, fp32 master weights; None: everything in fp32
    mixed_precision: tuple[str, str] | None = None
    # pipeline: micro-batches a pass through the stages is cut into, the schedule, the
    # blocks each stage after the first begins at (empty: balanced), and a function giving one
    # sample of input (the model is traced on it once, to check where it can be cut)
    pp_microbatches: int | None = None  # as the job asks (None: its default rule), fitted to each pass's rows
    pp_schedule: str = "1f1b"
    pp_split: tuple[str, ...] = ()
    example: Callable | None = None


class SwitchAborted(RuntimeError):
    """A switch stopped at its commit point, before anything moved: some rank could not allocate
    the new layout (out of memory). `own`: this rank's allocation was the one that failed. The
    old layout is whole; the caller puts it back in force."""

    def __init__(self, message: str, own: bool):
        super().__init__(message)
        self.own = own


class Comm(Protocol):
    """Where communication is timed or slowed down (the worker's comm timing and the simulated
    network). Each is optional; a layout calls what it has collectives for."""

    def ddp_hook(self, default: Callable) -> Callable | None: ...  # wraps DDP's all-reduce hook

    def blocked(self, nbytes: int, dim: str): ...  # a context around one blocking collective on `dim`

    # around a collective whose wait is timed elsewhere (FSDP2 on CUDA: where the compute stream
    # waits for it): counted and delayed by the simulated link, not timed
    def delayed(self, nbytes: int, dim: str): ...

    def functional(self, active: bool) -> None: ...  # DTensor's collectives on the tp dimension

    # an asynchronous collective (hybrid's overlapped dp average): counted at launch, completed
    # later by the simulated link's delay, waited for inside `waiting`, and how long it ran
    # hidden behind compute
    def launched(self, dim: str) -> None: ...

    def delay_s(self, nbytes: int, dim: str) -> float: ...

    def waiting(self): ...  # a context around the wait for collectives launched earlier

    def hidden(self, hidden_s: float, waited_s: float) -> None: ...

    def pipe(self, bubble_s: float, link_s: float) -> None: ...  # a pipeline stage's wait, split


@dataclass(frozen=True)
class Strategy:
    name: str
    mesh: str  # REPLICATE, SHARD or GRID
    apply: Callable[..., "Parallel"]  # (model, mesh, layout, plan, options) -> Parallel
    doc: str = ""
    needs_plan: bool = False  # shards linear layers by a tensor-parallel plan
    # how the data dimension's state may be held: replicated (shard 1), sharded (over all dp
    # ranks) or grouped (hsdp: over parallel.shard_size ranks); see strategies/layout.py
    sharding: tuple = (REPLICATED,)
    # apply works on a model built on the meta device (materialised afterwards with to_empty),
    # so a switch never holds a whole copy; False (DDP, a user's own) gets real, filled tensors
    meta_ok: bool = False

    def __post_init__(self):
        if self.mesh not in MESHES:
            raise ValueError(f"strategy {self.name!r}: mesh {self.mesh!r} is not one of {', '.join(MESHES)}")
        unknown = set(self.sharding) - {REPLICATED, SHARDED, GROUPED}
        if not self.sharding or unknown:
            raise ValueError(f"strategy {self.name!r}: sharding {self.sharding!r} must list some of "
                             f"{REPLICATED}, {SHARDED}, {GROUPED}")


class Parallel:
    """A model laid out on the workers. `module` is what forward is called on (a wrapper, for
    DDP), `model` the model itself (its parameters may be shards)."""

    # whether its gradients are views of storage it keeps from step to step (DDP's buckets): a
    # switch away from it frees them only once the new layout is allocated (strategies/relayout.py)
    grads_in_kept_storage = False

    # True when full state exists only as pieces on several ranks: gathering it is a collective
    # every rank must enter; otherwise rank 0 alone holds all of it.
    gathers_collectively = False
    # how a rank's share of a step runs forward and backward (workers/step/steps.py names the
    # variants); None: at once, or in micro-batches when the share is accumulated
    step_variant: str | None = None

    def __init__(self, module: nn.Module, model: nn.Module, layout: Layout, options: Options, mesh=None):
        self.module, self.model, self.layout, self.options, self.mesh = module, model, layout, options, mesh
        self.comm: Comm | None = None

    # ------------------------------------------------------------ the step

    def param_groups(self) -> list[dict]:
        return [{"params": [p for p in self.model.parameters() if p.requires_grad]}]

    def make_scaler(self):
        """fp16 needs loss scaling; the parameters stay fp32 (autocast computes in fp16 from
        them), so the optimizer always updates fp32 master weights."""
        return torch.amp.GradScaler(self.options.device.type, enabled=self.options.fp16)

    def no_sync(self):
        """Around the backward of a micro-batch that is not the step's last: gradients only
        accumulate (nothing to skip unless the layout syncs inside backward)."""
        return contextlib.nullcontext()

    def after_backward(self) -> None:
        """Gradient sync that does not happen inside backward (none for DDP or whole models)."""

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients, the same on every rank."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)

    def found_inf(self, norm: torch.Tensor | None = None) -> torch.Tensor:
        """1.0 when some gradient of this step is NaN or Inf on any rank, else 0.0: a float tensor
        on the device, the same on every rank, that nothing here reads (a fused optimizer skips
        the update with it on the device). `norm`, the clipping norm, is global already; without
        it, one foreach norm of this rank's gradients, agreed over all ranks where they hold
        different pieces (`gathers_collectively`), by a MAX all-reduce of one number."""
        if norm is not None:
            return (~torch.isfinite(norm)).to(torch.float32).reshape(())
        grads = [g.to_local() if hasattr(g, "to_local") else g
                 for g in (p.grad for p in self.model.parameters()) if g is not None]
        if grads:
            found = (~torch.isfinite(torch.nn.utils.get_total_norm(grads))).to(torch.float32)
        else:
            found = torch.zeros((), dtype=torch.float32, device=self.options.device)
        if self.gathers_collectively:
            import torch.distributed as dist

            if dist.is_initialized() and dist.get_world_size() > 1:
                # a point where the ranks wait for each other: timed as comm wait, as the norm's
                # all-reduce was (a straggler's cost shows here when backward has no collective)
                with self.blocked(found.element_size(), "tp" if self.layout.tp > 1 else "dp"):
                    dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return found

    def compile(self, options: dict) -> None:
        """torch.compile what forward runs on (the DDP wrapper too: its graph breaks at bucket
        boundaries, so the all-reduces still overlap backward). A layout that torch cannot
        compile overrides this with a clear error. `options["backend"]` is torch.compile's:
        inductor, or "aot_eager" (traced, nothing generated) where a test asks for it."""
        backend = options.get("backend", "inductor")
        mode = options.get("mode", "default") if backend == "inductor" else None
        self.module = torch.compile(self.module, backend=backend, mode=mode,
                                    fullgraph=bool(options.get("fullgraph", False)))

    @property
    def compiled(self) -> bool:
        """Whether torch.compile is in force: the wrapper forward runs on, or modules compiled
        in place (`nn.Module.compile`, as fsdp does it per block)."""
        return hasattr(self.module, "_orig_mod") or any(
            getattr(m, "_compiled_call_impl", None) is not None for m in self.model.modules())

    def attach(self, comm: Comm | None) -> None:
        """Route this layout's collectives through `comm` (timing, a simulated link), or stop."""
        self.comm = comm

    def blocked(self, nbytes: int, dim: str):
        return self.comm.blocked(nbytes, dim) if self.comm is not None else contextlib.nullcontext()

    # ------------------------------------------------------------ full state

    def full_state(self, optimizer: torch.optim.Optimizer, rank: int, everywhere: bool = False) -> dict | None:
        """Model and optimizer state as full tensors: on rank 0 (None elsewhere), or on every
        rank with `everywhere` (a switch, where every rank takes its part of it). With
        `gathers_collectively`, every rank must call it at the same point."""
        if not (everywhere or self.gathers_collectively or rank == 0):
            return None
        out = {"model": state.model_state(self.model), "optimizer": state.optimizer_state(optimizer, self.model)}
        return out if everywhere or rank == 0 else None

    def state_tensors(self, optimizer: torch.optim.Optimizer) -> dict:
        """`full_state`'s structure with the tensors not yet gathered (strategies/state.py), for a
        caller that gathers them one at a time; every rank calls it (with `gathers_collectively`,
        every rank then gathers each tensor, in the structure's order)."""
        return state.state_tensors(self.model, optimizer)

    def whole_state(self, optimizer: torch.optim.Optimizer, rank: int) -> state.WholeTensors:
        """The whole state for rank 0 one tensor at a time (the full checkpoint format); every rank
        calls it and exhausts its `tensors()`, in step."""
        return state.WholeTensors(self.state_tensors(optimizer), rank, self.gathers_collectively)

    def load_full_state(self, optimizer: torch.optim.Optimizer, full: dict) -> None:
        """Take this rank's part of full tensors (any layout wrote them)."""
        state.load_model_state(self.model, full["model"])
        state.load_optimizer_state(optimizer, self.model, full["optimizer"])

    def detach(self) -> None:
        """Before the layout goes: stop routing collectives through this one's hooks."""
        self.attach(None)

    @property
    def regroups_in_place(self) -> bool:
        """Whether the same ranks can go on with what each holds now on a new process group (after
        a step dropped for an out-of-memory error): true where nothing held is bound to the old
        group's mesh: whole replicas, and a pipeline's whole stages (`on_new_group`). A layout
        whose pieces are DTensors on the old mesh is relaid out onto the new one instead."""
        return not self.gathers_collectively

    def on_new_group(self, options: Options) -> "Parallel | None":
        """This layout over the tensors it holds, on the new default process group (the same ranks,
        `options` the build's now); None where the layout is simply applied to `model` again (a
        whole model: the caller does that)."""
        return None

    def drop_step(self) -> None:
        """A step broke off mid-forward or mid-backward (a peer lost, out of memory) and its
        group is left: whatever the layout keeps per step is reset (nothing, for most)."""
