"""Fully sharded data parallelism with torch's FSDP2 (`fully_shard`): parameters, gradients and
optimizer state are split over the data-parallel ranks; each block's parameters are
all-gathered just before its forward and backward and its gradients reduce-scattered after.

Three layouts use it:
- `fsdp`: a 1-D mesh ("dp",) over every worker (layout.shard = dp).
- `hsdp`: a 2-D mesh ("replicate", "shard"): sharded inside groups of layout.shard consecutive
  ranks, replicated across groups (FSDP2's HSDP: reduce-scatter in the group, then all-reduce
  across groups).
- `hybrid` with parallel.dp_shard: tensor parallel over mesh["tp"] first, then fully sharded over
  mesh["dp"] (torchtitan's 2-D layout; FSDP2 stacks a strided shard on top of the tp shard).

Mixed precision (Options.mixed_precision, from train.precision bf16 and parallel.reduce_dtype):
FSDP2's MixedPrecisionPolicy gathers the parameters in bf16 for forward and backward, keeps the
sharded fp32 parameters as the optimizer's master weights and reduces the gradients in fp32 (or
bf16). On gloo, which has no AVG reduction, FSDP2 sums and divides afterwards
(set_force_sum_reduction_for_comms); NCCL averages in the collective.

Comm wait (`attach`), what this rank's compute waits for:
- CPU, gloo: FSDP2 runs its collectives synchronously on the training thread, so our custom
  all-gather and reduce-scatter objects time each inside `comm.blocked(nbytes, "dp")`: the span is
  exactly the time compute is blocked. hsdp's all-reduce across groups is issued by FSDP2 itself;
  it is timed from the end of the reduce-scatter to FSDP2's all-reduce hook, which runs right after
  it (with groups of one rank there is no reduce-scatter to start from: only the simulated delay
  and the count are recorded).
- CUDA: FSDP2 issues them on streams of its own, and a prefetched all-gather overlaps compute by
  design, so a span around the launch says nothing of what compute waited. There the wait is
  timed where the compute stream waits on each collective's event (strategies/stream_waits.py:
  two timing events on the compute stream around its wait, from the all-gather's copy-out to the
  reduces' waits at the end of backward); the custom collectives only count and delay (the
  simulated network). Where torch lacks what that needs, the host-side spans stay, with a logged
  note. This CUDA path has not been run on a GPU yet.
"""

from __future__ import annotations

import contextlib
import fnmatch

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.tensor import DTensor

from gearshift.strategies import grads, stream_waits, tensor
from gearshift.strategies.base import Options, Parallel
from gearshift.strategies.layout import Layout
from gearshift.strategies.mesh import device_mesh

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _class_name(module: nn.Module) -> str:
    """The module's own class name: fully_shard swaps a module's class for a subclass named
    FSDP<name>, so a unit is still found by its name once sharded."""
    cls = type(module)
    if isinstance(module, FSDPModule):
        cls = next((c for c in cls.__mro__[1:] if not issubclass(c, FSDPModule)), cls)
    return cls.__name__


def find_units(model: nn.Module, patterns: tuple[str, ...] | list[str] = (), outside: bool = False
               ) -> tuple[list[tuple[str, nn.Module]], str]:
    """The modules sharded as FSDP units of their own, outermost first in model order, with how
    they were found:
    - "patterns": `parallel.fsdp_units`, each a module-name pattern (shell-style, `*` matches
      across dots: "model.layers.*") or a module class name ("LlamaDecoderLayer");
    - "no_split_modules": a Hugging Face model's `_no_split_modules` (its decoder layers);
    - "blocks": the entries of the outermost containers (ModuleList, ModuleDict, Sequential) at
      any depth below the root whose entries hold parameters (a transformer's blocks, at
      `transformer.h` or `model.layers`; an MLP's hidden layers);
    - "none": nothing found; the root is the only unit and keeps every parameter gathered all step.
    A match inside one already taken is not a unit of its own; modules without parameters are skipped.
    With `outside` (what is sharded), found blocks are joined by the large modules outside them,
    as torchtitan shards a transformer's embedding and output head: see _large_outside."""
    named = [(n, m) for n, m in model.named_modules() if n]
    if patterns:
        hits = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) or _class_name(m) == p for p in patterns)]
        return _outermost(hits), "patterns"
    no_split = set()
    for m in model.modules():
        no_split.update(getattr(m, "_no_split_modules", None) or ())
    if no_split:
        hits = _outermost([(n, m) for n, m in named if _class_name(m) in no_split])
        if hits:
            return (_large_outside(model, hits) if outside else hits), "no_split_modules"
    hits = []
    for n, m in named:
        if isinstance(m, _CONTAINERS) and not any(n.startswith(h + ".") for h, _ in hits):
            hits += [(f"{n}.{c}", child) for c, child in m.named_children() if _has_params(child)]
    hits = _outermost(hits)
    if not hits:
        return [], "none"
    return (_large_outside(model, hits) if outside else hits), "blocks"


def _large_outside(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """The blocks, and in model order with them the modules outside every block that hold, as
    their own parameters, at least half a block's (an embedding table, an output head): sharded
    as units of their own, they are gathered only while they compute instead of staying gathered
    with the root the whole step. A module sharing a parameter with another (a head tied to the
    embedding) stays in the root: FSDP cannot give one parameter to two units."""
    largest = max(sum(p.numel() for p in m.parameters()) for _, m in blocks)
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    taken = [n for n, _ in blocks]
    extra = []
    for name, module in model.named_modules():
        if not name or any(name == t or name.startswith(t + ".") or t.startswith(name + ".") for t in taken):
            continue
        own = list(module.parameters(recurse=False))
        if own and sum(p.numel() for p in own) * 2 >= largest and all(owners[id(p)] == 1 for p in own):
            extra.append(name)
    if not extra:
        return blocks
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    modules = dict(model.named_modules())
    return sorted(blocks + [(n, modules[n]) for n in extra], key=lambda nm: order[nm[0]])


def _outermost(hits: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    out: list[tuple[str, nn.Module]] = []
    for name, module in hits:
        if _has_params(module) and not any(name.startswith(o + ".") for o, _ in out):
            out.append((name, module))
    return out


def _units(model: nn.Module, patterns: tuple[str, ...] | list[str] = ()) -> list[nn.Module]:
    return [m for _, m in find_units(model, patterns, outside=True)[0]]


def describe_units(model: nn.Module, patterns: tuple[str, ...] | list[str] = ()) -> dict:
    """What the startup record says of the FSDP units: how they were found, how many, the first
    few names (and, when none were found, that the root alone is one), and, for a model FSDP2
    has sharded, the mixed precision it holds (held_precision)."""
    units, how = find_units(model, patterns, outside=True)
    names = [n for n, _ in units]
    out = {"found_by": how, "count": len(names), "first": names[:3]}
    held = held_precision(model)
    if held is not None:
        out["mixed_precision"] = held
    if how == "none":
        out["note"] = ("no repeated blocks found: under fsdp, hsdp or hybrid dp_shard the whole model is one unit, "
                       "every parameter gathered for the whole step; name the blocks with parallel.fsdp_units")
    return out


_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def policy(mixed_precision: tuple[str, str] | None) -> MixedPrecisionPolicy:
    """FSDP2's policy for Options.mixed_precision, (param_dtype, reduce_dtype) by name; None:
    parameters gathered and gradients reduced in their own dtype (fp32)."""
    if mixed_precision is None:
        return MixedPrecisionPolicy()
    bad = [d for d in mixed_precision if d not in _DTYPES]
    if len(mixed_precision) != 2 or bad:
        raise ValueError(f"mixed_precision {mixed_precision!r}: must be (param_dtype, reduce_dtype), each one of "
                         + ", ".join(_DTYPES))
    return MixedPrecisionPolicy(param_dtype=_DTYPES[mixed_precision[0]], reduce_dtype=_DTYPES[mixed_precision[1]])


def _on_gloo(mesh: DeviceMesh) -> bool:
    return any(dist.get_backend(mesh.get_group(i)) == "gloo" for i in range(mesh.ndim))


def shard(model: nn.Module, mesh: DeviceMesh, patterns: tuple[str, ...] | list[str] = (),
          mixed_precision: tuple[str, str] | None = None) -> nn.Module:
    """fully_shard every unit, then the root, in place (torchtitan's order), all with the same
    mixed-precision policy. A unit frees its gathered parameters after forward (gathered again
    for backward) except the last, whose backward comes right away; the root's stay gathered
    from forward into backward."""
    mp_policy = policy(mixed_precision)
    units = _units(model, patterns)
    for i, unit in enumerate(units):
        fully_shard(unit, mesh=mesh, reshard_after_forward=i < len(units) - 1, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    if _on_gloo(mesh):
        # sum, then divide by the dp size (FSDP2's fallback for a backend without AVG), so
        # nothing rests on gloo's AVG; NCCL averages inside the collective. FSDP2 keeps the
        # setting per unit: set on the root alone, it would not reach the others.
        for module in _fsdp_modules(model):
            module.set_force_sum_reduction_for_comms(True)
    return model


def held_precision(model: nn.Module) -> dict | None:
    """The mixed precision FSDP2 holds for `model`'s units, read back from its state: the dtype
    names (None: the parameter's own), whether reductions are forced to sums, and how many
    units; None when `model` is not sharded by FSDP2."""
    seen = set()
    for module in _fsdp_modules(model):
        for group in module._get_fsdp_state()._fsdp_param_groups:
            p = group.mp_policy
            seen.add((str(p.param_dtype).removeprefix("torch.") if p.param_dtype else None,
                      str(p.reduce_dtype).removeprefix("torch.") if p.reduce_dtype else None,
                      bool(group.force_sum_reduction_for_comms)))
    if not seen:
        return None
    if len(seen) > 1:
        return {"mixed": sorted(seen, key=str)}
    param, reduce, force_sum = seen.pop()
    return {"param_dtype": param, "reduce_dtype": reduce, "force_sum": force_sum}


def _fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


class _Timed:
    """FSDP2's all-gather / reduce-scatter, run through the layout's span for one collective
    (`FSDPParallel.collective`): timed on CPU, counted and delayed on CUDA."""

    def __init__(self, parallel: "FSDPParallel"):
        self.parallel = parallel


class _TimedAllGather(_Timed, DefaultAllGather):
    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        with self.parallel.collective(output_tensor.numel() * output_tensor.element_size()):
            return super().__call__(output_tensor, input_tensor, group, async_op=False)


class _TimedReduceScatter(_Timed, DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        with self.parallel.collective(input_tensor.numel() * input_tensor.element_size()):
            work = super().__call__(output_tensor, input_tensor, group, op, async_op=False)
        if self.parallel.all_reduces and self.parallel.waits is None:
            # FSDP2 all-reduces the output across groups next; its hook closes this span
            self.parallel.open_all_reduce(output_tensor.numel() * output_tensor.element_size())
        return work


class FSDPParallel(Parallel):
    """A model laid out by `fully_shard` (fsdp, hsdp, or hybrid with dp_shard): every parameter
    is a DTensor shard, so norms, the scaler and full state are collectives."""

    gathers_collectively = True

    def __init__(self, model: nn.Module, layout: Layout, options: Options, mesh: DeviceMesh):
        super().__init__(model, model, layout, options, mesh)
        self._all_reduce = contextlib.ExitStack()
        self._all_reduce_open = False
        # hsdp: FSDP2 all-reduces each reduce-scatter's output across the replica groups
        self.all_reduces = mesh.mesh_dim_names == ("replicate", "shard")
        self._stream_waits = stream_waits.for_root(model, options.device)

    @property
    def waits(self):
        """The compute stream's waits on FSDP2's collectives, where they are timed (CUDA), else None."""
        w = self._stream_waits
        return w if w is not None and w.active else None

    def collective(self, nbytes: int):
        """Around one collective FSDP2 issues: the blocked span on CPU; on CUDA, where the wait is
        timed on the compute stream, only its count and the simulated link's delay."""
        if self.waits is None:
            return self.blocked(nbytes, "dp")
        delayed = getattr(self.comm, "delayed", None) if self.comm is not None else None
        return delayed(nbytes, "dp") if delayed is not None else contextlib.nullcontext()

    def param_groups(self) -> list[dict]:
        """One group per mesh: with tp, tensor-parallel shards live on the (dp, tp) mesh and the
        rest on dp alone, and a multi-tensor update cannot mix DTensors of different meshes."""
        groups: dict[tuple, list] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                key = (p.device_mesh.mesh_dim_names, p.device_mesh.ndim) if isinstance(p, DTensor) else ()
                groups.setdefault(key, []).append(p)
        return [{"params": g} for g in groups.values()]

    @contextlib.contextmanager
    def no_sync(self):
        """Gradients accumulate unsharded on each rank; the step's last micro-batch reduces them."""
        self.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def make_scaler(self):
        # ranks hold different gradient shards: they agree whether any overflowed
        return grads.sharded_grad_scaler(self.options.device.type, self.options.fp16)

    def grad_norm(self) -> torch.Tensor:
        return grads.mesh_grad_norm(self.model.parameters(), self._timer)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return grads.mesh_clip_grad_norm(self.model.parameters(), max_norm, self._timer)

    def _timer(self, nbytes: int, dim_name: str):
        return self.blocked(nbytes, "tp" if dim_name == "tp" else "dp")

    def compile(self, options: dict) -> None:
        """Each unit's forward compiled in place (FSDP2's hooks stay outside the graphs, as
        torchtitan does it), so the gathers still run per unit."""
        backend = options.get("backend", "inductor")  # "aot_eager": traced, nothing generated (tests)
        mode = options.get("mode", "default") if backend == "inductor" else None
        for unit in _units(self.model, self.options.fsdp_units) or [self.model]:  # no units: the root, hooks and all
            unit.compile(backend=backend, mode=mode, fullgraph=bool(options.get("fullgraph", False)))

    # ------------------------------------------------------------ full state

    def full_state(self, optimizer, rank: int, everywhere: bool = False) -> dict | None:
        self.at_rest()
        return super().full_state(optimizer, rank, everywhere)

    def state_tensors(self, optimizer) -> dict:
        self.at_rest()
        return super().state_tensors(optimizer)

    def load_full_state(self, optimizer, full: dict) -> None:
        self.at_rest()
        super().load_full_state(optimizer, full)

    def at_rest(self) -> None:
        """Shards back in place of gathered parameters: a forward without backward (evaluation)
        leaves units built with reshard_after_forward=False gathered, and optimizer state is
        matched to parameters by name."""
        for module in _fsdp_modules(self.model):
            module.reshard()

    # ------------------------------------------------------------ comm timing

    def open_all_reduce(self, nbytes: int) -> None:
        self._all_reduce.close()  # a span left open (none expected) must not swallow the next
        self._all_reduce.enter_context(self.blocked(nbytes, "dp"))
        self._all_reduce_open = True

    def _all_reduce_done(self, output: torch.Tensor) -> None:
        if self.waits is not None:  # CUDA: counted and delayed here, its wait timed on the compute stream
            with self.collective(output.numel() * output.element_size()):
                return
        if not self._all_reduce_open:
            # groups of one rank: FSDP2 skips the reduce-scatter that opens the span, so only
            # the simulated link's delay and the call count are recorded, not the all-reduce
            with self.blocked(output.numel() * output.element_size(), "dp"):
                pass
        self._all_reduce.close()
        self._all_reduce_open = False

    def attach(self, comm) -> None:
        if self.comm is not None and comm is None and self.layout.tp > 1:
            self.comm.functional(False)
        super().attach(comm)
        timed = comm is not None
        for module in _fsdp_modules(self.model):
            module.set_custom_all_gather(_TimedAllGather(self) if timed else DefaultAllGather())
            module.set_custom_reduce_scatter(_TimedReduceScatter(self) if timed else DefaultReduceScatter())
            # only hsdp needs the hook (it ends the all-reduce's span); elsewhere FSDP2 would
            # run it after every reduce-scatter for nothing
            module.set_all_reduce_hook(self._all_reduce_done if timed and self.all_reduces else None)
        if self._stream_waits is not None:
            self._stream_waits.comm = comm
        if timed and self.layout.tp > 1:
            comm.functional(True)  # DTensor's collectives are the tp traffic

    def detach(self) -> None:
        super().detach()
        self._all_reduce.close()
        self._all_reduce_open = False

    def drop_step(self) -> None:
        """FSDP2's per-step state after a step broke off: units left gathered, mid-forward or
        mid-backward, with reductions in flight. The root's reset_iter_state (torch >= 2.13) puts
        every unit back to its shards, the step's gradients discarded, so the parameters found
        by name are again the shards the optimizer holds. A layout that has run no forward yet
        (a worker joined or lost at the run's first boundary) has nothing to reset, and torch's
        reset before FSDP2's lazy initialisation fails (torch 2.13: the comm context it reads is
        made there), so it is left alone."""
        self._all_reduce.close()
        self._all_reduce_open = False
        if isinstance(self.model, FSDPModule) and hasattr(self.model, "reset_iter_state"):
            state = getattr(self.model, "_get_fsdp_state", lambda: None)()
            if state is not None and getattr(state, "_is_root", True) is None:  # never ran a forward
                return
            self.model.reset_iter_state()


def mesh_for(layout: Layout, device: torch.device) -> DeviceMesh:
    """fsdp: ("dp",) over every worker; hsdp: ("replicate", "shard") with groups of layout.shard
    consecutive ranks (an hsdp whose one group spans every rank is plain fsdp)."""
    if layout.replicas == 1:
        return device_mesh(device.type, (layout.dp,), ("dp",))
    return device_mesh(device.type, (layout.replicas, layout.shard), ("replicate", "shard"))


def apply(model: nn.Module, mesh: DeviceMesh | None, layout: Layout, plan, options: Options) -> FSDPParallel:
    """Shard `model` (on the device, or on meta to be materialised with `to_empty`) as
    `layout` (fsdp or hsdp); builds its own mesh when `mesh` is None."""
    mesh = mesh if mesh is not None else mesh_for(layout, options.device)
    shard(model, mesh, options.fsdp_units, options.mixed_precision)
    return FSDPParallel(model, layout, options, mesh)


def apply_2d(model: nn.Module, mesh: DeviceMesh, layout: Layout, plan: dict[str, str],
             options: Options) -> FSDPParallel:
    """Tensor parallel over mesh["tp"], then fully sharded over mesh["dp"] (hybrid dp_shard)."""
    tensor.shard(model, mesh["tp"], plan)
    shard(model, mesh["dp"], options.fsdp_units, options.mixed_precision)
    return FSDPParallel(model, layout, options, mesh)
