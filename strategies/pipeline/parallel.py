"""Pipeline parallelism on a (pp, dp) mesh: the model cut into `pp` stages of consecutive blocks
(strategies/pipeline/cut.py), each rank holding one stage of one pipeline replica, the step's
share cut into micro-batches that flow through the stages under a schedule of
`torch.distributed.pipelining` (GPipe, 1F1B). Only a stage's boundary activation (and its
gradient) crosses between stages; replicas of the same stage average their gradients over the
dp dimension after the schedule, and a parameter two stages hold (a tied head) has its
gradient summed between them.

Ranks are stage-major (rank = position * dp + replica): the workers of one node hold one
position of the pipeline, so a slow link between nodes carries activations only. Under an
interleaved schedule each position holds `stages_per_rank` (2) stages, the model cut into
pp x 2 (position p holds stages p and p + pp: the loop order `torch.distributed.pipelining`'s
multi-stage schedules expect), which cuts the bubble by that factor for one more activation
crossing per micro-batch; `interleaved_zb` (torch's ScheduleInterleavedZeroBubble) also runs
the backward of the weights apart from that of the inputs, to fill the bubble with it.

What this rests on: gloo on CPU, torch 2.13 (every schedule in SCHEDULES, the tests in CI with
a timeout). It has not run on NCCL."""

from __future__ import annotations

import contextlib
import time
import weakref

import torch
import torch.distributed as dist
from torch import nn

from gearshift.strategies import rows as sample_rows
from gearshift.strategies import state
from gearshift.strategies.pipeline.gather import StreamedGather
from gearshift.strategies.state import _is_dtensor
from gearshift.strategies.base import Options, Parallel
from gearshift.strategies.layout import Layout
from gearshift.strategies.pipeline import cut as cuts
from gearshift.strategies.pipeline import stages_per_rank
from gearshift.strategies.pipeline.grads import StageGrads
from gearshift.strategies.pipeline.stage_layout import StageLayout, resolve_plan
from gearshift.strategies.pipeline.stage import StageInfo, StageModule, compile_blocks, holders, make_stage

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]  # offered on gloo (tests/test_pipeline.py runs each with a timeout)


def _schedule_class(name: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.distributed.pipelining import ScheduleInterleavedZeroBubble

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
            "interleaved_zb": ScheduleInterleavedZeroBubble}[name]


class PipelineParallel(Parallel):
    """One position of one pipeline replica: its stage (several under an interleaved schedule).
    `views` are the stages' StageModules (`module` the first), `model` the whole model's object
    with the other positions' stages taken out (its names are the whole model's)."""

    gathers_collectively = True
    step_variant = "pipelined"

    def __init__(self, views: list[StageModule], info: StageInfo, cut: cuts.Cut, layout: Layout, options: Options,
                 mesh, tie_stages: tuple):
        super().__init__(views[0], views[0].model, layout, options, mesh)
        self.views, self.info, self.cut = views, info, cut
        self.mine, self.stages = info.stages, len(cut.stages)  # this position's stages; all stages
        self.position = layout.stage_of(dist.get_rank())
        self.pp_group, self.dp_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.sharded = layout.shard > 1  # the stage sharded over its replicas by FSDP2 (parallel.dp_shard)
        self.tie_stages = tie_stages  # the stages holding each parameter of the whole model, where several do
        self.grads = StageGrads(self, positions_holding(info.ties, layout.pp), tie_groups(tie_stages, layout))
        self._pipe = None
        self._loss = None

    @property
    def regroups_in_place(self) -> bool:
        # whole stages are plain tensors: the stage modules go on as they are on a new group (sharded
        # or tensor-parallel stages are DTensors on the old mesh: relaid out)
        return not self.sharded and self.layout.tp == 1

    def on_new_group(self, options: Options) -> "PipelineParallel":
        """The same stages (the same modules and tensors, the cut unchanged) on the new default
        process group: a new mesh and tie groups, schedules made afresh on the next step."""
        from gearshift.strategies.mesh import device_mesh

        if not self.regroups_in_place:
            raise RuntimeError(f"{self.layout}: sharded stages are relaid out on a new group, not kept")
        mesh = device_mesh(options.device.type, (self.layout.pp, self.layout.dp, self.layout.tp), ("pp", "dp", "tp"))
        return PipelineParallel(self.views, self.info, self.cut, self.layout, options, mesh, self.tie_stages)

    # ------------------------------------------------------------ the step

    def pipe(self, shape: tuple):
        """The stage and its schedule for inputs of `shape`, made on the first step of that
        shape: a stage learns its micro-batches' shapes and dtypes once, on its first step, and
        reads a later one of another size wrongly (torch 2.13), so a new share size (after an
        out-of-memory step halved it) gets a new stage, and so does a step under autocast after
        one without (a precision phase's end: the activations crossing change dtype)."""
        key = (shape, torch.is_autocast_enabled(self.options.device.type))
        micro = self.microbatches(shape[0])
        if self._pipe is not None and self._pipe[2] != key:
            self._pipe = None
        if self._pipe is None:
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(v, v.stage, self.stages, self.options.device, group=self.pp_group)
                      for v in self.views]
            schedule = _schedule_class(self.options.pp_schedule)(
                stages if stages_per_rank(self.options.pp_schedule) > 1 else stages[0], micro,
                loss_fn=lambda out, target: self._loss(out, target), scale_grads=False)
            self._pipe = (stages, schedule, key)
        return self._pipe[:2]

    def microbatches(self, rows: int) -> int:
        """The micro-batches a pass of `rows` samples is cut into: the job's parallel.pp_microbatches
        (or its default) fitted to the rows the step's micro-batch setting gives now, so that a
        share halved after an out-of-memory step is still cut evenly."""
        from gearshift.strategies.pipeline import fitted

        return fitted(rows, self.layout.pp, self.options.pp_microbatches, self.options.pp_schedule)

    def run(self, x: torch.Tensor, y: torch.Tensor, loss_fn, scale: float, rows=None) -> torch.Tensor | None:
        """Forward and backward of `x` through the pipeline in its micro-batches (`microbatches`),
        the mean of their losses multiplied by `scale` (each micro-batch's loss by `scale` over
        their count); the gradients accumulate. `rows` (strategies/rows.Rows, or None): the
        places of x's rows for dropout, cut with the micro-batches for every stage. The sum of
        the scaled losses on the last stage, None on the others."""
        _, schedule = self.pipe(tuple(x.shape))
        each = scale / self.microbatches(x.shape[0])
        self._loss = lambda out, target: loss_fn(out, target) * each
        losses: list = []
        try:
            with self._timed_p2p(), sample_rows.within(rows):
                self._step(schedule, x, y, losses, rows)
        finally:
            self._loss = None
        return torch.stack([l.detach().float() for l in losses]).sum() if losses else None

    def _step(self, schedule, x, y, losses: list, rows=None) -> None:
        """The first stage takes the micro-batches as its input, the last the targets; every
        stage after the first gets the step's input as `inputs` (what runs before the first block
        is computed again on every stage), and every stage the rows' places (`rows`), which the
        schedule cuts with the micro-batches as it cuts the inputs."""
        args = (x,) if 0 in self.mine else ()
        kwargs = {"inputs": x} if any(s > 0 for s in self.mine) else {}
        if rows is not None:
            kwargs["rows"] = rows.places
        if self.stages - 1 in self.mine:
            kwargs["target"] = y
        schedule.step(*args, losses=losses, return_outputs=False, **kwargs)

    @contextlib.contextmanager
    def _timed_p2p(self):
        """The schedule's waits for a peer's activations or gradients, through this layout's
        comm route: timed as comm wait, delayed by the simulated link, and split into the time
        idle before the data came (the bubble) and the link's (its simulated delay; on a real
        link no clock shared between nodes tells the transfer apart, so it counts as bubble).
        A send's wait is timed too (as bubble): gloo's send of a message returns only once the peer
        takes it, so a stage whose next stage is slow waits there, not in compute.""" 
        route = self.comm
        if route is None:
            yield
            return
        from torch.distributed.pipelining import schedules

        batch, wait = schedules._batch_p2p, schedules._wait_batch_p2p
        receiving: dict[int, int] = {}

        def batched(ops, desc=None):
            works = batch(ops, desc)
            receiving[id(works)] = sum(op.tensor.numel() * op.tensor.element_size() for op in ops
                                       if op.op is dist.irecv)
            return works

        def waited(works):
            nbytes = receiving.pop(id(works), 0)
            if not nbytes:  # sends only: the peer's readiness, no bytes of the link's own
                started = time.perf_counter()
                with route.idle():
                    out = wait(works)
                route.pipe(time.perf_counter() - started, 0.0)
                return out
            started = time.perf_counter()
            with route.blocked(nbytes, "pp"):
                wait(works)
            link = route.delay_s(nbytes, "pp")
            route.pipe(max(0.0, time.perf_counter() - started - link), link)
            return None

        schedules._batch_p2p, schedules._wait_batch_p2p = batched, waited
        try:
            yield
        finally:
            schedules._batch_p2p, schedules._wait_batch_p2p = batch, wait

    def evaluate(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> torch.Tensor | None:
        """The loss of `x` forward through the stages, one stage after the other (no schedule:
        any batch size, each activation's shape sent ahead of it); the last stage's, None on the
        others. Every position of this replica calls it with the same batch; a position's stages
        run in order, each after the stage before it (on the position before) sent its output."""
        out = None
        for view in self.views:
            s = view.stage
            out = view(x) if s == 0 else view(self._receive(self._peer(s - 1)), inputs=x)
            if s < self.stages - 1:
                self._send(out, self._peer(s + 1))
        self.at_rest()
        return loss_fn(out, y) if self.stages - 1 in self.mine else None

    def at_rest(self) -> None:
        """Sharded stages: the shards back in place of the gathered parameters (a forward without
        backward, evaluation, leaves them gathered; state is read and matched by name)."""
        if self.sharded:
            from torch.distributed.fsdp import FSDPModule

            for m in [*self.views, *self.model.modules()]:
                if isinstance(m, FSDPModule):
                    m.reshard()

    def _peer(self, stage: int) -> int:
        """The global rank of this replica's position that holds `stage`."""
        return dist.get_global_rank(self.pp_group, stage % self.layout.pp)

    def _send(self, t: torch.Tensor, peer: int) -> None:
        # the header on the group's device too: NCCL sends device tensors only
        device = self.options.device
        head = torch.tensor([_DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int64, device=device)
        with self.blocked(t.numel() * t.element_size(), "pp"):
            dist.send(torch.tensor([head.numel()], dtype=torch.int64, device=device), peer, group=self.pp_group)
            dist.send(head, peer, group=self.pp_group)
            dist.send(t.contiguous(), peer, group=self.pp_group)

    def _receive(self, peer: int) -> torch.Tensor:
        size = torch.zeros(1, dtype=torch.int64, device=self.options.device)
        with self.blocked(0, "pp"):
            dist.recv(size, peer, group=self.pp_group)
            head = torch.zeros(int(size), dtype=torch.int64, device=self.options.device)
            dist.recv(head, peer, group=self.pp_group)
            head = head.tolist()  # one read of the device
            dtype, ndim = _DTYPES[head[0]], head[1]
            out = torch.empty(head[2:2 + ndim], dtype=dtype, device=self.options.device)
            dist.recv(out, peer, group=self.pp_group)
        return out

    def share_loss(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The last stage's loss, on every stage of this replica (one number, broadcast)."""
        out = loss if loss is not None else torch.zeros((), device=self.options.device)
        out = out.to(torch.float32).reshape(())
        if self.layout.pp > 1:
            last = self._peer(self.stages - 1)
            with self.blocked(out.element_size(), "pp"):
                dist.broadcast(out, src=last, group=self.pp_group)
        return out

    def after_backward(self) -> None:
        self.grads.after_backward()

    def grad_norm(self) -> torch.Tensor:
        return self.grads.norm()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        return self.grads.clip(max_norm)

    def param_groups(self) -> list[dict]:
        """The sharded parameters (DTensors: tensor-parallel shards, or FSDP2's over the replicas)
        apart from the rest: a multi-tensor update cannot mix them."""
        if not self.sharded and self.layout.tp == 1:
            return super().param_groups()
        groups: dict[bool, list] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                groups.setdefault(_is_dtensor(p), []).append(p)
        return [{"params": g} for g in groups.values()]

    def make_scaler(self):
        """fp16's loss scaling: the last stage's loss scaled, so every stage's gradients are;
        every rank unscales its own and all agree whether any overflowed (the step is skipped,
        or taken, everywhere)."""
        from gearshift.strategies.grads import sharded_grad_scaler

        return sharded_grad_scaler(self.options.device.type, self.options.fp16)

    def compile(self, options: dict) -> None:
        """Each block of this rank's stages compiled in place (stage.compile_blocks): the
        embedding and head before and after the blocks run eager, as FSDP's do outside its units."""
        if self.options.pp_schedule == "interleaved_zb":  # the job check says so first
            raise NotImplementedError("pp_schedule interleaved_zb splits the backward, which compiled blocks do not allow")
        backend = options.get("backend", "inductor")  # "aot_eager": traced, nothing generated (tests)
        mode = options.get("mode", "default") if backend == "inductor" else None
        fullgraph = bool(options.get("fullgraph", False))
        names = [name for s in self.mine for name in self.cut.stages[s]]
        compile_blocks(self.model, names, lambda fn: torch.compile(fn, backend=backend, mode=mode, fullgraph=fullgraph))
        self._pipe = None  # stages made afresh over the compiled blocks

    @property
    def compiled(self) -> bool:
        return any(getattr(m, "compiled_in_stage", False) for m in self.model.modules())

    # ------------------------------------------------------------ full state

    def full_state(self, optimizer, rank: int, everywhere: bool = False) -> dict | None:
        """The whole model's state: each stage's part (from the first replica's first tp rank)
        gathered onto rank 0, or onto every rank with `everywhere`."""
        self.at_rest()
        part = None
        if self.sharded or self.layout.dp_rank(rank) == 0:  # sharded: every replica takes part in the gathers
            part = {"model": state.model_state(self.model), "optimizer": state.optimizer_state(optimizer, self.model)}
            part = part if self.layout.dp_rank(rank) == 0 and rank % self.layout.tp == 0 else None
        parts = [None] * dist.get_world_size()
        if everywhere:
            dist.all_gather_object(parts, part)
        else:
            dist.gather_object(part, parts if rank == 0 else None, dst=0)
            if rank != 0:
                return None
        out = {"model": {}, "optimizer": {"state": {}, "hyperparameters": {}}}
        for p in parts:
            if p is None:
                continue
            out["model"].update(p["model"])
            out["optimizer"]["state"].update(p["optimizer"]["state"])
            out["optimizer"]["hyperparameters"] = p["optimizer"]["hyperparameters"]
        return out

    def whole_state(self, optimizer, rank: int) -> StreamedGather:
        """The whole state streamed to rank 0 a tensor at a time, each from the owner of its
        position (strategies/pipeline/gather.py), never the stages' parts pickled at once."""
        self.at_rest()
        layout = self.layout
        owner = {}
        for r in range(layout.world):  # a position's owner: its rank in replica 0, tp rank 0
            if layout.dp_rank(r) == 0 and r % layout.tp == 0:
                owner.setdefault(layout.stage_of(r), r)
        return StreamedGather(state.state_tensors(self.model, optimizer), rank, dist.get_world_size(),
                              lambda r: owner[layout.stage_of(r)], self.options.device)

    def load_full_state(self, optimizer, full: dict) -> None:
        self.at_rest()
        own = set(self.model.state_dict())
        state.load_model_state(self.model, {k: v for k, v in full["model"].items() if k in own})
        state.load_optimizer_state(optimizer, self.model, full["optimizer"])

    def attach(self, comm) -> None:
        if self.layout.tp > 1 and self.comm is not None and comm is None:
            self.comm.functional(False)
        super().attach(comm)
        if self.layout.tp > 1 and comm is not None:
            comm.functional(True)  # DTensor's collectives are the stage's tp traffic

    def detach(self) -> None:
        super().detach()
        self._pipe = None


def positions_holding(ties: dict[str, tuple], pp: int) -> dict[str, tuple]:
    """For each parameter several stages hold, the positions holding them (stage s is at
    position s % pp), where those are more than one (two stages at one position share it)."""
    out = {name: tuple(sorted({s % pp for s in stages})) for name, stages in ties.items()}
    return {name: positions for name, positions in out.items() if len(positions) > 1}


def tie_groups(tie_stages, layout: Layout) -> dict[tuple, object]:
    """For each set of positions that hold a parameter together, a group of those positions'
    ranks of each replica and tp rank (every rank makes every group, in one order); this rank's
    group of each."""
    from gearshift.strategies.mesh import MAKE_GROUPS, group_timeout

    sets = sorted({tuple(sorted({s % layout.pp for s in stages})) for stages in tie_stages})
    sets = [s for s in sets if len(s) > 1]
    mine = {}
    rank, world = dist.get_rank(), dist.distributed_c10d._get_default_group()
    for key in [k for k, (made_on, _) in _TIES.items() if made_on() is not world]:  # made on a group that is gone
        del _TIES[key]
    for stages in sets:
        for slot in range(layout.dp * layout.tp):  # a replica's tp rank: rank = position * dp * tp + slot
            ranks = tuple(s * layout.dp * layout.tp + slot for s in stages)
            if ranks not in _TIES:  # made once per default group: a switch back reuses it
                made = []
                MAKE_GROUPS[0](lambda ranks=ranks: made.append(dist.new_group(list(ranks), timeout=group_timeout())))
                _TIES[ranks] = (weakref.ref(world), made[0])
            if rank in ranks:
                mine[stages] = _TIES[ranks][1]
    return mine


# ranks -> (the default group it was made on, held weakly; the group of stages holding a parameter
# together). Not keyed by the default group's id(): a new default group may be given a freed one's
# id, and would then be handed the old group's tie groups, destroyed with it ("Could not resolve the
# process group registered under the name ...", seen in a process that made a second default group)
_TIES: dict[tuple, tuple] = {}


def apply(model: nn.Module, mesh, layout: Layout, plan, options: Options) -> PipelineParallel:
    """Cut `model` (whole on this rank, the same initial values on every rank) into layout.pp
    stages and keep this rank's; the example input (Options.example) is traced once."""
    from gearshift.strategies.mesh import device_mesh

    if options.example is None:
        raise cuts.CutError("parallel.strategy pipeline needs an example input to trace the model (Options.example)")
    blocks = cuts.find_blocks(model, options.fsdp_units)
    if not blocks:
        raise cuts.CutError("parallel.strategy pipeline: no repeated blocks found to cut the model at (name them with "
                            "parallel.fsdp_units, e.g. model.layers.*)")
    per_rank = stages_per_rank(options.pp_schedule)
    chosen = cuts.choose(model, blocks, layout.pp, tuple(options.pp_split), per_rank)
    device = next(model.parameters()).device  # meta in a switch: traced on the meta device
    traced = cuts.trace(model, options.example().to(device), chosen.blocks)
    cuts.check_crossings(chosen, traced)
    held_by = holders(chosen, traced, model)
    resolved = resolve_plan(model, plan, layout.tp, held_by)
    mesh = device_mesh(options.device.type, (layout.pp, layout.dp, layout.tp), ("pp", "dp", "tp"))
    position = layout.stage_of(dist.get_rank())
    if layout.shard > 1 and options.pp_schedule == "interleaved_zb":  # the job's check says so first
        raise cuts.CutError("parallel.dp_shard runs under pp_schedule gpipe, 1f1b or interleaved_1f1b, not "
                            "interleaved_zb (tried: its weights' backward run apart from the inputs' leaves the weights wrong)")
    shard = None
    if layout.shard > 1 or layout.tp > 1:
        shard = StageLayout(mesh, layout.tp, resolved, layout.shard > 1, options)
    views, info = make_stage(model, chosen, traced, [position + i * layout.pp for i in range(per_rank)], shard)
    tie_stages = tuple(sorted({tuple(sorted(stages)) for stages in held_by.values() if len(stages) > 1}))
    return PipelineParallel(views, info, chosen, layout, options, mesh, tie_stages)


__all__ = ["SCHEDULES", "PipelineParallel", "apply", "positions_holding", "tie_groups"]
