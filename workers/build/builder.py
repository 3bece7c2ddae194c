"""Builder: the worker's model-building part. It makes the model a layout holds (afresh and seeded,
on the meta device and replayed piece by piece, or moved over from the layout in force), with
its optimizer, scaler and comm route, and carries out a switch (`reshard`) on the same processes.

The worker holds what its parts share (rank, device, layout, the laid-out model, optimizer,
scaler); the builder sets them and keeps what only it needs: how the first build went (`info`)
and which modules recompute their forward (`recomputed`)."""

from __future__ import annotations

import contextlib
import functools
import time

import torch

from gearshift import strategies
from gearshift.monitoring.comm import CommClock
from gearshift.strategies.base import SwitchAborted
from gearshift.strategies.layout import Layout
from gearshift.workers.build import components, recompute, shard_init
from gearshift.workers.group.comm import CommRoute
from gearshift.workers.group.simnet import SimulatedNetwork
from gearshift.workers.step import oom, precision, sample_masks, schedules
from gearshift.workers.step.data import GlobalBatches
from gearshift.workers.step.loader import open_data
from gearshift.workers.step.telemetry import WorkerTelemetry


class Builder:
    def __init__(self, worker):
        self.w = worker
        self.info: dict = {"on_meta": False}  # how the first build went (build() reports it)
        self.recomputed: list[str] = []  # the modules train.activation_checkpointing wrapped
        self.warmed = False  # what prepare() makes is there already (regroup.warm)

    def prepare(self) -> None:
        """What a worker needs besides its layout: loss, data, schedule, its telemetry."""
        w, cfg = self.w, self.w.config
        w.loss_fn = components.build_loss(dict(cfg.loss), cfg.search_paths)
        w.dataset = open_data(cfg, "data")  # map-style, or a Ray Dataset streamed by its feeder
        w.batches = GlobalBatches(len(w.dataset), cfg.global_batch_size, cfg.seed)
        w.eval_dataset = open_data(cfg, "eval.data") if cfg.eval_data else None
        w.lr_at = schedules.build(dict(cfg.schedule), cfg.lr, cfg.total_steps, cfg.search_paths)
        w.bucket_cap_mb = cfg.bucket_cap_mb
        strategies.lookup(cfg.strategy, cfg.search_paths)  # a user's own strategy is imported from the job's folder
        if w.telemetry is None:
            w.telemetry = WorkerTelemetry(cfg, w.device)

    def lay_out(self, layout: Layout, move_from: tuple | None = None, rewrap: tuple | None = None,
                gather=None) -> dict:
        """Build the model and lay it out as `layout`, with its optimizer, scaler and comm route:
        afresh (seeded: the same initial weights on every rank, and in a 1-process run), or, in a
        switch, on the meta device with the state moved over from `move_from` (old parallel,
        old optimizer) tensor by tensor, or (`rewrap`: old parallel, old optimizer of a replicated
        layout) the same module and optimizer wrapped again, on a new process group. Returns what
        a move sent (a pipeline cut again: its bytes point to point against a relayout's)."""
        w, cfg = self.w, self.w.config
        w.layout = layout
        w.runner.close_loader()  # its slice of the batch belonged to the old layout's dp
        w.shares = None  # a new layout starts on even shares (the controller's rebalancer starts over)
        # a switch that changes dp keeps the micro-batch: the accumulation count changes instead
        w.runner.set_micro_batch(w.runner.micro_setting)
        torch.manual_seed(cfg.seed)
        model, returned_plan, record = self._model(layout, move_from, rewrap)
        plan = None
        if strategies.lookup(layout.strategy).needs_plan or layout.tp > 1:  # a pipeline's stages may shard too
            plan = components.tp_plan(model, dict(cfg.tp_plan), returned_plan, layout.tp)
        options = strategies.Options(w.device, w.bucket_cap_mb, fp16=cfg.precision == "fp16",
                                     fsdp_units=cfg.fsdp_units, dp_overlap=cfg.dp_overlap,
                                     mixed_precision=cfg.fsdp_mixed_precision, **self._pipeline(layout))
        make_optimizer = lambda groups: components.build_optimizer(groups, dict(cfg.optimizer), w.device)  # noqa: E731
        figures: dict = {}
        if move_from and _recut(move_from[0], layout, gather):  # only the blocks that change position move
            from gearshift.strategies.pipeline import moves

            w.parallel, w.optimizer, moved = moves.recut(*move_from, model, layout, plan, options, make_optimizer,
                                                         agree=w.member.agree)
            figures = {"moved_bytes": moved.sent_bytes, "relayout_bytes": moved.relayout_bytes,
                       "moved_tensors": len(moved.tensors)}
        elif move_from:
            from gearshift.strategies.relayout import relayout  # DTensor and FSDP: only a switch needs them

            if layout.pp > 1 or getattr(move_from[0], "layout", layout).pp > 1:  # the ranks hold different names
                from gearshift.strategies.pipeline.switch import relayout
            w.parallel, w.optimizer = relayout(*move_from, model, layout, plan, options, make_optimizer,
                                               agree=w.member.agree, gather=gather)
        elif rewrap is not None:  # the layout's own tensors on the new group (a pipeline keeps its cut stages)
            w.parallel = rewrap[0].on_new_group(options) or strategies.parallelize(model, layout, plan, options)
            w.optimizer = rewrap[1]
        else:
            if record is None:  # built whole: per_shard makes its values as a sharded layout's ranks do
                self.info.update(shard_init.whole(model, self._build, cfg.model.get("init", "auto"), cfg.seed,
                                                  w.device))
            w.parallel = strategies.parallelize(model, layout, plan, options)
            if record is not None:
                self._materialise(record)
            del record
            w.optimizer = make_optimizer(w.parallel.param_groups())
        w.scaler = w.parallel.make_scaler()
        w.clock = CommClock(w.device) if cfg.telemetry else None
        self.attach_route()
        if cfg.compile and rewrap is None:  # compiled afresh with every layout: a switch recompiles
            w.parallel.compile(dict(cfg.compile))
        return figures

    def _pipeline(self, layout: Layout) -> dict:
        """A pipeline's options: its micro-batches, schedule and cuts, and one sample of the
        job's data to trace the model on (strategies/pipeline/cut.py)."""
        w, cfg = self.w, self.w.config
        if layout.pp == 1:
            return {}
        from gearshift.workers.step.data import load_batch

        pipe = dict(cfg.pipeline)
        # as the job asks: the layout fits it to each pass's rows (the micro-batch in force then)
        return {"pp_microbatches": pipe.get("microbatches"),
                "pp_schedule": pipe.get("schedule", "1f1b"),
                # a stage rebalance's cut (recut) in force, else the job's
                "pp_split": w.pp_split if w.pp_split else tuple(pipe.get("split", ())),
                "example": lambda: load_batch(w.dataset, [0])[0]}

    def _model(self, layout: Layout, move_from: tuple | None, rewrap: tuple | None):
        """(model, the plan its builder returned, the meta build's record or None) for `lay_out`:
        the module in force (rewrap), a first build on meta (a layout of pieces), or a build whole
        on the device (or on meta, to be filled by a switch's relayout)."""
        w, cfg = self.w, self.w.config
        # record: a first build on meta, replayed piece by piece (meta_init.py)
        record, build = None, functools.partial(self._build, layout.pp == 1)
        if rewrap is not None:  # the same module and optimizer under a new wrapper (a new process group)
            return rewrap[0].model, None, None
        if move_from is None and self._shards(layout):
            (model, returned_plan), record = self._on_meta(build)
        else:
            with torch.device("meta") if move_from else contextlib.nullcontext():
                model, returned_plan = build()
            model = model if move_from else model.to(w.device)  # meta: relayout allocates the new pieces
        if cfg.random_per == "sample":  # before any wrapping: the modules' keys are their plain names
            sample_masks.per_sample(model)
        self.recomputed = recompute.apply(model, cfg.activation_checkpointing, cfg.fsdp_units,
                                          builtin=not cfg.model.get("entrypoint") and layout.pp == 1)
        precision.keep_fp32(model, cfg.keep_fp32, w.device.type)
        precision.fp32_when(model, cfg.final_fp32, w.device.type, lambda: precision.final(w.step, cfg))
        return model, returned_plan, record

    def _build(self, own_recompute: bool = True):
        """The job's model and the tensor-parallel plan its builder returns, as the job names them.

        `own_recompute` False (a pipeline): a built-in model does not checkpoint its own blocks for
        train.activation_checkpointing, and recompute.apply wraps the blocks' forwards instead. A
        model's own checkpointing calls a block again in backward, its hooks included, and a stage's
        cut hooks (its received activation, where it stops) are off by then: the recomputed block
        read another input than the forward did (torch's CheckpointError, or a sharded matmul of
        mismatched shapes under pipeline x tp). A wrapped forward runs inside the hooks."""
        cfg = self.w.config
        setting = cfg.activation_checkpointing if own_recompute else False
        return components.build_model_and_plan(dict(cfg.model), cfg.search_paths, setting)

    def _shards(self, layout: Layout) -> bool:
        """Whether `layout` holds pieces of the model (not whole copies) and can be laid out on
        the meta device: then the first build never holds the whole model."""
        return strategies.lookup(layout.strategy).meta_ok and (layout.tp > 1 or layout.shard > 1)

    def _on_meta(self, build):
        """The model on the meta device with the record of its build, or, where the record cannot
        be replayed exactly (workers/build/meta_init.py says when), built whole as before."""
        from gearshift.workers.build.meta_init import build_recorded

        try:
            result, record = build_recorded(build)
            reason = None if record.replayable else record.reason
        except Exception as err:  # noqa: BLE001 - the build reads a value the meta device has not got
            result, record, reason = None, None, f"{type(err).__name__}: {err}"[:300]
        if reason is None:
            self.info = {"on_meta": True}
            return result, record
        self.info = {"on_meta": False, "why": reason}
        torch.manual_seed(self.w.config.seed)
        model, plan = build()
        return (model.to(self.w.device), plan), None

    def _materialise(self, record) -> None:
        """Allocate this rank's pieces and fill them from the record's replay (`exact`: a plain
        build's values) or each from its own rows (`per_shard`, workers/build/shard_init.py), but those
        model.pretrained overwrites before the first step: left empty, not drawn."""
        from gearshift.workers.build import meta_init, pretrained

        w, cfg = self.w, self.w.config
        started = time.perf_counter()
        skip = pretrained.covered(w.parallel.model, cfg.model.get("pretrained"), cfg.search_paths)
        mode, why = shard_init.choose(cfg.model.get("init", "auto"), shard_init.parameters(record))
        torch.manual_seed(cfg.seed)  # the replay draws what the plain build draws
        if mode == "per_shard":
            made = shard_init.fill(w.parallel.model, record, w.device, cfg.seed, skip)
            self.info.update(drawn=made.drawn, drawn_whole=made.whole)
        else:
            meta_init.fill(w.parallel.model, record, w.device, skip)
        self.info.update({"init": mode, "init_why": why, "fill_s": round(time.perf_counter() - started, 3)},
                         **({"from_weights": len(skip)} if skip else {}))

    def attach_route(self) -> None:
        """The layout's collectives timed (the clock) and delayed (the simulated network)."""
        w, cfg = self.w, self.w.config
        net = SimulatedNetwork.for_rank(cfg.comm_delay_ms, cfg.sim_nodes, cfg.sim_link, w.layout, w.rank)
        w.parallel.attach(CommRoute(w.clock, net) if w.clock or net else None)

    def reshard(self, layout: dict, bucket_cap_mb: float | None = None, split: list[str] | None = None) -> dict:
        """A switch (see TrainWorker.reshard): the state moved onto `layout` tensor by tensor, or,
        where the new layout cannot be allocated, the old one in force again, whole. `split`: a
        pipeline's cut (the first block of every stage after the first), else the job's."""
        w = self.w
        start = time.perf_counter()
        split_before, w.pp_split = w.pp_split, tuple(split) if split else None
        w.io.writes.settle()  # the state moves: nothing may still be reading it
        if bucket_cap_mb is not None:
            w.bucket_cap_mb = float(bucket_cap_mb)
        strategies.lookup(layout["strategy"], w.config.search_paths)  # a user's own may not be loaded yet
        target = Layout.from_dict(layout)
        if target.world != w.world:
            raise ValueError(f"reshard to {target}: dp({target.dp}) * tp({target.tp}) != world({w.world})")
        scaler = w.scaler.state_dict()
        old = (w.parallel, w.optimizer)
        before = (w.layout, w.scaler, w.clock)
        w.parallel.detach()
        w.parallel = w.optimizer = None
        try:
            figures = self.lay_out(target, move_from=old)
        except SwitchAborted as err:  # nothing moved: the old layout is whole, and in force again
            w.parallel, w.optimizer = old
            w.layout, w.scaler, w.clock = before
            w.pp_split = split_before
            self.attach_route()
            w.runner.set_micro_batch(w.runner.micro_setting)
            oom.give_back(w.device)
            return {"seconds": time.perf_counter() - start, "layout": w.layout.to_dict(), "step": w.step,
                    "failed": {"kind": "oom", "rank": w.rank, "step": w.step, "during": "switch",
                               "to": target.to_dict(), "own": err.own, "message": str(err)[:500],
                               **oom.memory_figures(w.device)}}
        del old
        if scaler:  # a disabled scaler (no fp16) has no state
            w.scaler.load_state_dict(scaler)
        if w.device.type == "cuda":
            torch.cuda.synchronize(w.device)
        return {"seconds": time.perf_counter() - start, "layout": target.to_dict(), "step": w.step, **figures}


def _recut(old, layout: Layout, gather) -> bool:
    """Whether moving `old` onto `layout` is the same pipeline cut again (strategies/pipeline/moves.py)."""
    if gather is not None or getattr(old, "cut", None) is None:
        return False
    from gearshift.strategies.pipeline import moves

    return moves.applies(old, layout, gather)
