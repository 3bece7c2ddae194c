"""How a model is laid out on the workers, looked up by name in one registry.

Every layout has one entry, `apply(model, mesh, layout, plan, options) -> Parallel`, and the
`Parallel` it returns owns what differs between layouts (the wrapped model, gradient sync, the
global norm and clipping, the fp16 scaler, full state, where comm timing attaches). Adding a
layout is one new file plus one entry in `STRATEGIES`; a user's own layout is a `Strategy`
object named in the job as "module:name" (or `register`ed in-process). Strategies import
neither the orchestrator nor the workers. A switch between layouts moves the live state one
tensor at a time with `gearshift.strategies.relayout.relayout`.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterable

import torch
from torch import nn

from gearshift.strategies.base import GRID, MESHES, PIPE, REPLICATE, SHARD, Options, Parallel, Strategy
from gearshift.strategies.layout import GROUPED, REPLICATED, SHARDED, Layout, LayoutError
from gearshift.strategies.registry import STRATEGIES, register
from gearshift.strategies.tp_plan import PlanError

__all__ = ["GRID", "MESHES", "PIPE", "REPLICATE", "SHARD", "STRATEGIES", "Layout", "LayoutError", "Options", "Parallel",
           "PlanError", "Strategy", "builtin_names", "lookup", "parallelize", "register"]


def _apply_of(module: str):
    """The built-in `strategies.<module>.apply`, imported on the first call: the sharded layouts
    pull in torch.distributed.tensor (0.7 s of CPU), which a data-parallel run never needs, in
    every worker and in the driver that checks the job."""
    def apply(model, mesh, layout, plan, options):
        return importlib.import_module(f"gearshift.strategies.{module}").apply(model, mesh, layout, plan, options)

    apply.__qualname__ = f"gearshift.strategies.{module}.apply"
    return apply


STRATEGIES.update({
    "data": Strategy("data", REPLICATE, _apply_of("data"), "DDP: whole replicas, gradients all-reduced in buckets"),
    "tensor": Strategy("tensor", SHARD, _apply_of("tensor"), "Megatron-style column/row shards over every worker",
                       needs_plan=True, meta_ok=True),
    "hybrid": Strategy("hybrid", GRID, _apply_of("hybrid"), "tensor shards inside a group, data parallel across groups "
                       "(or fully sharded across them, parallel.dp_shard)", needs_plan=True,
                       sharding=(REPLICATED, SHARDED), meta_ok=True),
    "fsdp": Strategy("fsdp", REPLICATE, _apply_of("fsdp"), "FSDP2: parameters, gradients and optimizer state sharded "
                     "over every worker", sharding=(SHARDED,), meta_ok=True),
    "hsdp": Strategy("hsdp", REPLICATE, _apply_of("fsdp"), "FSDP2 HSDP: sharded inside groups of parallel.shard_size "
                     "workers, replicated across groups", sharding=(GROUPED, SHARDED, REPLICATED), meta_ok=True),
    "pipeline": Strategy("pipeline", PIPE, _apply_of("pipeline.parallel"), "the model cut into parallel.pp_size stages "
                         "of consecutive blocks, micro-batches flowing through them (GPipe, 1F1B); data parallel "
                         "across pipeline replicas (or each stage's blocks sharded across them, parallel.dp_shard)",
                         sharding=(REPLICATED, SHARDED)),
})
_BUILTIN = tuple(STRATEGIES)


def builtin_names() -> tuple[str, ...]:
    return _BUILTIN


@contextlib.contextmanager
def _on_path(paths: Iterable[str]):
    added = [p for p in paths if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def lookup(name: str, search_paths: Iterable[str] = ()) -> Strategy:
    """The strategy called `name`: a registered one, or "module:attr" naming a `Strategy`
    object (imported from `search_paths` first, then the Python path, and registered)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    if ":" not in name:
        raise LayoutError(f"unknown strategy {name!r}; available: {', '.join(STRATEGIES)}, or \"module:name\" "
                          "naming your own strategies.Strategy")
    module_name, attr = name.split(":", 1)
    with _on_path(search_paths):
        try:
            module = importlib.import_module(module_name)
        except ImportError as err:
            raise LayoutError(f"strategy {name!r}: importing {module_name!r} failed: {err}") from None
    found = getattr(module, attr, None)
    if not isinstance(found, Strategy):
        raise LayoutError(f"strategy {name!r}: {module_name}.{attr} is {type(found).__name__}, "
                          "not a strategies.Strategy")
    return register(found, name)


def parallelize(model: nn.Module, layout: Layout, plan: dict[str, str] | None, options: Options) -> Parallel:
    """Lay `model` (already on the device, the same initial weights on every rank) out as
    `layout` over the default process group (on the mesh of its shape that an earlier layout
    made, if any: strategies/mesh.py)."""
    strategy = lookup(layout.strategy)
    mesh = None
    if strategy.mesh not in (REPLICATE, PIPE):  # a pipeline makes its own (pp, dp) mesh
        from gearshift.strategies.mesh import device_mesh

        mesh = device_mesh(options.device.type, (layout.dp, layout.tp), ("dp", "tp"))
    return strategy.apply(model, mesh, layout, plan, options)


def default_options(device: str = "cpu", **kw) -> Options:
    return Options(torch.device(device), **kw)
