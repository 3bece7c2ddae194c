"""How a pipeline stage is laid out over its ranks beyond the cut, as torchtitan composes pp x dp x
tp on one device mesh (pp, dp, tp):

- tensor parallelism inside the stage (parallel.tp_size): the tensor-parallel plan's layers that
  this rank's stages hold are sharded over the stage's tp group, Megatron style
  (strategies/tensor.py), so the activation a stage sends on is whole (replicated over its tp
  group): each tp rank sends its copy to the same tp rank of the next stage;
- then, with parallel.dp_shard, FSDP2 over the stage's replicas: each block its own unit, then
  the stage (StageModule) the root over what is left (embedding, final norm, head), so that
  torch's PipelineStage drives it as an FSDP module: gradients accumulate unsharded over the
  step's micro-batches and are reduce-scattered once, after the schedule; parameters are
  gathered at a block's first forward and kept until then (not gathered again for every
  micro-batch).

What it rests on: gloo on CPU, torch 2.13 (tests/test_pipeline_compose.py)."""

from __future__ import annotations

from torch import nn

from gearshift.strategies import tp_plan as plans
from gearshift.strategies.base import Options
from gearshift.strategies.pipeline import cut as cuts


class StageLayout:
    """`plan` (module name -> colwise | rowwise, resolved on the whole model) over `mesh["tp"]`
    where tp > 1; FSDP2 over `mesh["dp"]` where `shard`."""

    def __init__(self, mesh, tp: int, plan: dict[str, str] | None, shard: bool, options: Options):
        self.tp_mesh, self.plan = (mesh["tp"], dict(plan or {})) if tp > 1 else (None, {})
        self.fsdp = None
        if shard:
            from torch.distributed.fsdp import fully_shard

            from gearshift.strategies import fsdp

            self.fully_shard = fully_shard
            self.fsdp = {"mesh": mesh["dp"], "reshard_after_forward": False,
                         "mp_policy": fsdp.policy(options.mixed_precision)}
            self.gloo = fsdp._on_gloo(mesh["dp"])

    def blocks(self, model: nn.Module, names: list[str]) -> None:
        """This rank's blocks `names` (and whatever else of the plan it holds) laid out."""
        if self.tp_mesh is not None:
            self._tensor_parallel(model)
        if self.fsdp is not None:
            for name in names:
                self._shard(model.get_submodule(name))

    def stages(self, model: nn.Module, wrappers: list[nn.Module]) -> None:
        """The root (after the cut points are hooked): FSDP2 over what the blocks left. One stage
        a rank: the stage itself (StageModule), which torch's PipelineStage then drives as an
        FSDP module (one reduce-scatter after the schedule). Two (an interleaved schedule): the
        model object both stages run, so that what they share is sharded once; the schedule then
        drives them as plain modules and each block reduce-scatters its gradients after every
        micro-batch's backward, accumulating them sharded (correct, with more traffic)."""
        if self.fsdp is None:
            return
        if len(wrappers) == 1:
            self._shard(wrappers[0])
        else:
            self._shard(model)

    def _tensor_parallel(self, model: nn.Module) -> None:
        from torch.distributed.tensor.parallel import parallelize_module

        from gearshift.strategies.tensor import _STYLES

        modules = dict(model.named_modules())
        held = {name: style for name, style in self.plan.items()  # another stage's block is gone, its head a stand-in
                if name in modules and isinstance(getattr(modules[name], "weight", None), nn.Parameter)}
        if held:
            parallelize_module(model, self.tp_mesh, {name: _STYLES[style]() for name, style in held.items()})

    def _shard(self, module: nn.Module) -> None:
        self.fully_shard(module, **self.fsdp)
        if self.gloo:  # sum, then FSDP2 divides by the replicas: nothing rests on gloo's AVG
            module.set_force_sum_reduction_for_comms(True)


def resolve_plan(model: nn.Module, plan: dict[str, str] | None, tp: int, held_by: dict[int, set]) -> dict[str, str]:
    """The plan's layers on the whole model (plans.resolve's errors name the pattern), none of
    them holding a parameter two stages share (a head tied to the embedding: its stages would
    hold it in different pieces)."""
    if tp == 1:
        return {}
    resolved = plans.resolve(model, plan or {}, tp)
    for name in resolved:
        for pname, p in model.get_submodule(name).named_parameters(recurse=False):
            if len(held_by.get(id(p), ())) > 1:
                raise cuts.CutError(f"parallel.tp_plan shards {name}.{pname}, which stages {sorted(held_by[id(p)])} "
                                    "hold together (a tied weight); leave it out of the plan: it stays whole")
    return resolved


__all__ = ["StageLayout", "resolve_plan"]
