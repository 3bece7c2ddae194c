"""One pipeline stage made from the whole model, in place: the model's own forward runs, on
every stage, with the blocks of the other stages and the parameters this stage does not hold
taken out.

- A block of another stage is replaced by `Skip`, which holds nothing and hands its input on.
- A parameter this stage does not hold (an embedding, on a stage after the first; a head, on a
  stage before the last) becomes a zero buffer of its shape that takes no memory (one element,
  expanded): the code before the first block still runs on every stage, computing again what
  needs no parameter (positions, masks, rotary tables), and what the zeros make is replaced
  where the stage begins.
- Where the stage begins (a stage after the first), its first block's hidden state is replaced
  by the activation received from the stage before; where it ends (a stage before the last), the
  next stage's first block's input is returned: the forward stops there.

Names stay the whole model's (`blocks.4.attn.q.weight`), so checkpoints, `model.pretrained` and
export see the model they always saw, each stage holding its part of it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from gearshift.strategies import rows as sample_rows
from gearshift.strategies.pipeline.cut import PRE, Cut, Trace


class _Cut(Exception):  # noqa: N818 - control flow, not an error: the stage's forward ends here
    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


class Skip(nn.Module):
    """A block another stage runs: hands its hidden state on (zeros where the block changes
    its shape), holding nothing."""

    def __init__(self, where: tuple, in_shape: tuple, out_shape: tuple):
        super().__init__()
        self.where, self.same = where, tuple(in_shape) == tuple(out_shape)
        self.last = tuple(out_shape[-1:])

    def forward(self, *args, **kwargs):
        hidden = args[self.where[1]] if self.where[0] == "arg" else kwargs[self.where[1]]
        if self.same:
            return hidden
        return hidden.new_zeros(tuple(hidden.shape[:-1]) + self.last)


@dataclass
class StageInfo:
    stages: list[int]        # the stages this rank holds (one; several under an interleaved schedule)
    held: list[str]          # the names of the parameters this rank holds
    ties: dict[str, tuple]   # a held parameter that other stages hold too -> the stages that hold it
    stand_ins: tuple = ()    # the buffers that stand in for parameters other stages hold

    def restore_stand_ins(self, model: nn.Module) -> None:
        """After `to_empty` (which gives every buffer storage of its own): the stand-ins back
        to one zero element each."""
        for name in self.stand_ins:
            parent, _, leaf = name.rpartition(".")
            module = model.get_submodule(parent) if parent else model
            b = getattr(module, leaf)
            module.register_buffer(leaf, _stand_in(b.shape, b.dtype, b.device), persistent=False)


def _stand_in(shape, dtype, device) -> torch.Tensor:
    return torch.zeros((), dtype=dtype, device=device).expand(shape)


def holders(cut: Cut, traced: Trace, model: nn.Module) -> dict[int, set]:
    """For each parameter (by id), the stages that hold it: those whose part of the forward
    reads it (the code before the first block counts as the first stage's); a parameter the
    forward never read, the first stage."""
    out = {}
    for p in model.parameters():
        uses = traced.param_uses.get(id(p), set())
        out[id(p)] = {cut.stage_of_position(pos) for pos in uses} or {0}
    return out


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class StageModule(nn.Module):
    """What one stage's PipelineStage runs: `model` (the whole model with the stages this rank
    does not hold taken out) from the step's input on the first stage, from the received
    activation on the others. A rank that holds several stages (an interleaved schedule) has one
    StageModule per stage over the same model; `active` says which of them is running, so that
    the blocks and cut points of the others stay out of its way."""

    def __init__(self, model: nn.Module, stage: int, stages: int, active: list):
        super().__init__()
        self.model, self.stage, self.stages = model, stage, stages
        self.active = active  # [the StageModule running now, or None], shared by the rank's stages
        self.received: torch.Tensor | None = None
        self.own: list[nn.Parameter] = []  # the parameters this stage's part of the forward reads

    def parameters(self, recurse: bool = True):
        """This stage's own parameters (what a schedule's weight pass and gradient scaling walk),
        not those of the rank's other stages."""
        return iter(self.own)

    def forward(self, *args, inputs: torch.Tensor | None = None, rows: torch.Tensor | None = None):
        if self.stage == 0:
            x, self.received = args[0], None
        else:
            x, self.received = inputs, args[0]
        self.active[0] = self
        outer = sample_rows.current()  # the pass's rows; `rows`: this micro-batch's places among them
        try:
            with sample_rows.within(outer.narrowed(rows) if outer is not None and rows is not None else outer):
                return self.model(x)
        except _Cut as cut:
            return cut.hidden
        finally:
            self.received = None
            self.active[0] = None


def make_stage(model: nn.Module, cut: Cut, traced: Trace, mine: list[int],
               shard=None) -> tuple[list[StageModule], StageInfo]:
    """Turn `model` (whole, on this rank) into the stages `mine` of `cut`, in place: one
    StageModule per stage, all over the one model. `shard`, if given (a StageLayout), lays the
    stage out over its ranks (tensor-parallel shards, FSDP2 over its replicas):
    `shard.blocks(model, names)` before the cut points are hooked, so that a stage's received
    activation replaces its first block's input before FSDP2's hooks see it, and
    `shard.stages(model, wrappers)` after (the rest of the stage, the root)."""
    held_by = holders(cut, traced, model)
    stages = len(cut.stages)
    blocks = {name for s in mine for name in cut.stages[s]}
    # the parameters of the other stages' blocks go with the blocks
    for name in cut.blocks:
        if name not in blocks:
            _set(model, name, Skip(traced.inputs[name], traced.in_shapes[name], traced.out_shapes[name]))
    # parameters outside the blocks that no stage of this rank holds: zero buffers of their shape
    stand_ins = []
    for mname, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            if not held_by[id(p)] & set(mine):
                delattr(module, pname)
                module.register_buffer(pname, _stand_in(p.shape, p.dtype, p.device), persistent=False)
                stand_ins.append(f"{mname}.{pname}" if mname else pname)
    by_name = {n: held_by[id(p)] for n, p in model.named_parameters()}  # sharding makes new parameter objects
    if shard is not None:
        shard.blocks(model, [name for s in mine for name in cut.stages[s]])
    active: list = [None]
    wrappers = [StageModule(model, s, stages, active) for s in mine]
    modules = dict(model.named_modules())
    for wrapper in wrappers:
        _hook_stage(wrapper, cut, traced, modules, several=len(mine) > 1)
    if shard is not None:
        shard.stages(model, wrappers)
    for wrapper in wrappers:  # after the layout: sharding makes new parameter objects
        wrapper.own = [p for n, p in model.named_parameters() if wrapper.stage in by_name[n]]
    ties = {n: tuple(sorted(stages_)) for n, stages_ in by_name.items() if len(stages_) > 1}
    return wrappers, StageInfo(list(mine), list(by_name), ties, tuple(stand_ins))


def _hook_stage(wrapper: StageModule, cut: Cut, traced: Trace, modules: dict, several: bool) -> None:
    """Where `wrapper`'s stage begins (its first block's input: the received activation) and ends
    (the next stage's first block: the forward stops); with several stages on the rank, its blocks
    hand their input on while another of the rank's stages runs."""
    stage, stages = wrapper.stage, wrapper.stages
    if stage > 0:
        first = cut.stages[stage][0]
        modules[first].register_forward_pre_hook(_receive(wrapper, traced.inputs[first]), with_kwargs=True, prepend=True)
    if stage < stages - 1:
        following = cut.stages[stage + 1][0]
        modules[following].register_forward_pre_hook(_stop(wrapper, traced.inputs[following]), with_kwargs=True)
    if several:
        for name in cut.stages[stage]:
            skip = Skip(traced.inputs[name], traced.in_shapes[name], traced.out_shapes[name])
            _gate(modules[name], wrapper, skip)


def _gate(block: nn.Module, wrapper: StageModule, skip: Skip) -> None:
    """`block` runs while its own stage (or no stage) is active, and is skipped while another is.
    Its own forward stays reachable as `block.ungated_forward` (what `compile_blocks` compiles)."""
    block.ungated_forward = block.forward

    def gated(*args, **kwargs):
        running = wrapper.active[0]
        if running is not None and running is not wrapper:
            return skip(*args, **kwargs)
        return block.ungated_forward(*args, **kwargs)
    block.forward = gated


def compile_blocks(model: nn.Module, names: list[str], compile_fn) -> int:
    """Each of the blocks `names` (this rank's) gets its own forward compiled in place by
    `compile_fn`, as FSDP's units are: the cut points' hooks (a stage's received activation,
    where it stops) and the gate between a rank's stages stay outside the graphs. Returns how
    many blocks were compiled."""
    for name in names:
        block = model.get_submodule(name)
        if hasattr(block, "ungated_forward"):
            block.ungated_forward = compile_fn(block.ungated_forward)
        else:
            block.forward = compile_fn(block.forward)
        block.compiled_in_stage = True
    return len(names)


def _receive(wrapper: StageModule, where: tuple):
    def hook(module, args, kwargs):
        if wrapper.active[0] is not wrapper or wrapper.received is None:
            return None
        if where[0] == "arg":
            args = args[:where[1]] + (wrapper.received,) + args[where[1] + 1:]
        else:
            kwargs = {**kwargs, where[1]: wrapper.received}
        return args, kwargs
    return hook


def _stop(wrapper: StageModule, where: tuple):
    def hook(module, args, kwargs):
        if wrapper.active[0] is not wrapper:
            return None
        raise _Cut(args[where[1]] if where[0] == "arg" else kwargs[where[1]])
    return hook


__all__ = ["PRE", "Skip", "StageInfo", "StageModule", "compile_blocks", "holders", "make_stage"]
