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
    stage: int
    held: list[str]          # the names of the parameters this stage holds
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
    """What the stage's PipelineStage runs: `model` (the whole model with the other stages taken
    out) from the step's input on the first stage, from the received activation on the others."""

    def __init__(self, model: nn.Module, stage: int, stages: int):
        super().__init__()
        self.model, self.stage, self.stages = model, stage, stages
        self.received: torch.Tensor | None = None

    def forward(self, *args, inputs: torch.Tensor | None = None):
        if self.stage == 0:
            x, self.received = args[0], None
        else:
            x, self.received = inputs, args[0]
        try:
            return self.model(x)
        except _Cut as cut:
            return cut.hidden
        finally:
            self.received = None


def make_stage(model: nn.Module, cut: Cut, traced: Trace, stage: int) -> tuple[StageModule, StageInfo]:
    """Turn `model` (whole, on this rank) into stage `stage` of `cut`, in place."""
    held_by = holders(cut, traced, model)
    stages = len(cut.stages)
    mine = set(cut.stages[stage])
    # the parameters of the other stages' blocks go with the blocks
    for name in cut.blocks:
        if name not in mine:
            _set(model, name, Skip(traced.inputs[name], traced.in_shapes[name], traced.out_shapes[name]))
    # parameters outside the blocks that another stage holds: zero buffers of their shape
    stand_ins = []
    for mname, module in list(model.named_modules()):
        for pname, p in list(module.named_parameters(recurse=False)):
            if stage not in held_by[id(p)]:
                delattr(module, pname)
                module.register_buffer(pname, _stand_in(p.shape, p.dtype, p.device), persistent=False)
                stand_ins.append(f"{mname}.{pname}" if mname else pname)
    wrapper = StageModule(model, stage, stages)
    modules = dict(model.named_modules())
    if stage > 0:
        first = cut.stages[stage][0]
        modules[first].register_forward_pre_hook(_receive(wrapper, traced.inputs[first]), with_kwargs=True)
    if stage < stages - 1:
        following = cut.stages[stage + 1][0]
        modules[following].register_forward_pre_hook(_stop(traced.inputs[following]), with_kwargs=True)
    names = {id(p): n for n, p in model.named_parameters()}
    ties = {names[id(p)]: tuple(sorted(held_by[id(p)])) for p in model.parameters() if len(held_by[id(p)]) > 1}
    return wrapper, StageInfo(stage, list(names.values()), ties, tuple(stand_ins))


def _receive(wrapper: StageModule, where: tuple):
    def hook(module, args, kwargs):
        if wrapper.received is None:
            return None
        if where[0] == "arg":
            args = args[:where[1]] + (wrapper.received,) + args[where[1] + 1:]
        else:
            kwargs = {**kwargs, where[1]: wrapper.received}
        return args, kwargs
    return hook


def _stop(where: tuple):
    def hook(module, args, kwargs):
        raise _Cut(args[where[1]] if where[0] == "arg" else kwargs[where[1]])
    return hook


__all__ = ["PRE", "Skip", "StageInfo", "StageModule", "holders", "make_stage"]
