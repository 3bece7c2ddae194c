"""Where a model is cut into pipeline stages, and whether it can be.

The model's repeated blocks (found as FSDP units are, strategies/fsdp.py `find_units`: a Hugging
Face model's `_no_split_modules`, else the entries of the outermost ModuleList at any depth, or
`parallel.fsdp_units`) are split into `pp` runs of consecutive blocks. By default the runs hold
about equal parameters, the code before the first block (an embedding) counted with the first
stage and the code after the last (the final norm, the head) with the last; `parallel.pp_split`
names the first block of every stage after the first instead.

A stage runs the model's own forward (strategies/pipeline/stage.py), so the model needs no
pipeline code of its own, but what crosses a cut must be one tensor: the input of the next
stage's first block. `trace` runs the model once on one real sample and checks that:
- the blocks run in order, each once (the forward runs them as a chain);
- nothing computed in one stage is used in a later one except that tensor (no skip connection
  across a cut). What the code before the first block computes without parameters (positions,
  masks, rotary tables) is computed again by every stage, so it may be used anywhere.
It also notes which stages use each parameter: a parameter used by two (a head tied to the
embedding) is held by both, its gradient summed between them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from gearshift.strategies.layout import LayoutError

PRE = -1  # the position of the code before the first block


class CutError(LayoutError):
    """The model cannot be cut as asked: the message says why and what is allowed."""


@dataclass
class Trace:
    """What one forward on one sample showed: the blocks in the order they ran, how each took
    its hidden state (("arg", 0) or ("kw", name)), the shape each returned, and for each
    parameter (by id) the positions (block indices, PRE) at which an operation read it."""

    blocks: list[str]
    inputs: dict[str, tuple] = field(default_factory=dict)
    out_shapes: dict[str, tuple] = field(default_factory=dict)
    in_shapes: dict[str, tuple] = field(default_factory=dict)
    param_uses: dict[int, set] = field(default_factory=dict)
    # (producer position, consumer position, what) for every tensor read after the block it came from
    crossings: list[tuple[int, int, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Cut:
    """`stages[s]`: the names of the blocks stage s runs, consecutive, in model order."""

    stages: tuple[tuple[str, ...], ...]
    how: str  # "balanced" or "pp_split"
    weights: tuple[int, ...] = ()  # each block's parameters, in model order
    rest: int = 0  # the parameters before the first block and after the last

    @property
    def blocks(self) -> list[str]:
        return [b for stage in self.stages for b in stage]

    def stage_of_block(self) -> dict[str, int]:
        return {b: s for s, stage in enumerate(self.stages) for b in stage}

    def stage_of_position(self, position: int) -> int:
        """The stage that runs `position` (a block index, or PRE: the first)."""
        if position == PRE:
            return 0
        return self.stage_of_block()[self.blocks[position]]

    def describe(self) -> dict:
        return {"how": self.how, "stages": [[s[0], s[-1]] if len(s) > 1 else [s[0]] for s in self.stages],
                "blocks_per_stage": [len(s) for s in self.stages]}

    def weighed(self) -> dict:
        """What a new cut of the same blocks is planned from (orchestrator/policy/stages.py): the
        blocks, their weights, the weight outside them, and each stage's first block index."""
        starts = [0]
        for stage in self.stages[:-1]:
            starts.append(starts[-1] + len(stage))
        return {"blocks": list(self.blocks), "weights": list(self.weights), "rest": self.rest, "starts": starts}


def find_blocks(model: nn.Module, patterns: tuple[str, ...] = ()) -> list[str]:
    """The names of the model's repeated blocks, in model order."""
    from gearshift.strategies.fsdp import find_units

    found, _ = find_units(model, tuple(patterns), outside=False)
    return [n for n, _ in found]


class _Tracker(TorchFunctionMode):
    """Tags every tensor an operation makes with the position it was made at, and notes where
    a tensor made at one position is read at a later one, and where each parameter is read."""

    def __init__(self, params: dict[int, str]):
        super().__init__()
        self.position = PRE
        self.params = params
        self.made: dict[int, tuple[int, torch.Tensor]] = {}  # id -> (position, the tensor: keeps the id taken)
        self.param_uses: dict[int, set] = {}
        self.crossings: list[tuple[int, int, str]] = []
        self.allowed: dict[int, int] = {}  # id of a tensor handed to a block as its hidden state -> that block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        for t in flat:
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) in self.params:
                self.param_uses.setdefault(id(t), set()).add(self.position)
                continue
            made = self.made.get(id(t))
            if made is not None and made[1] is t and made[0] != self.position and self.allowed.get(id(t)) != self.position:
                grad = made[0] != PRE or t.requires_grad
                if grad:
                    self.crossings.append((made[0], self.position, f"{getattr(func, '__name__', func)}"))
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t) not in self.params:
                self.made[id(t)] = (self.position, t)
        return out


def _hidden_of(args: tuple, kwargs: dict) -> tuple[tuple, torch.Tensor | None]:
    """Where a block takes its hidden state: its first positional tensor, else the keyword
    `hidden_states` or `x`, else its only tensor keyword."""
    if args and isinstance(args[0], torch.Tensor):
        return ("arg", 0), args[0]
    for name in ("hidden_states", "x"):
        if isinstance(kwargs.get(name), torch.Tensor):
            return ("kw", name), kwargs[name]
    tensors = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    if len(tensors) == 1:
        return ("kw", tensors[0]), kwargs[tensors[0]]
    return (), None


def trace(model: nn.Module, example: torch.Tensor, blocks: list[str]) -> Trace:
    """Run `model` once on `example` (one sample, real values) and note how its blocks ran.
    Gradients are on for every parameter while it runs (restored after), so that whatever a
    parameter reaches is told apart from what is computed from the input alone."""
    modules = dict(model.named_modules())
    params = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    tracker = _Tracker(params)
    result = Trace(blocks=[])
    errors: list[str] = []

    def pre(name):
        def hook(module, args, kwargs):
            where, hidden = _hidden_of(args, kwargs)
            if hidden is None:
                errors.append(f"block {name} takes no tensor as its hidden state")
                return None
            result.blocks.append(name)
            result.inputs[name] = where
            result.in_shapes[name] = tuple(hidden.shape)
            tracker.position = len(result.blocks) - 1
            tracker.allowed[id(hidden)] = tracker.position
            return None
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            first = tree_flatten(output)[0]
            result.out_shapes[name] = tuple(first[0].shape) if first and isinstance(first[0], torch.Tensor) else ()
            if not isinstance(output, torch.Tensor):
                errors.append(f"block {name} returns {type(output).__name__}, not one tensor")
        return hook

    handles = []
    grads = {id(p): p.requires_grad for p in model.parameters()}
    try:
        for name in blocks:
            handles.append(modules[name].register_forward_pre_hook(pre(name), with_kwargs=True))
            handles.append(modules[name].register_forward_hook(post(name), with_kwargs=True))
        for p in model.parameters():
            p.requires_grad_(True)
        with torch.enable_grad(), tracker:
            model(example)
    finally:
        for h in handles:
            h.remove()
        for p in model.parameters():
            p.requires_grad_(grads[id(p)])
    if errors:
        raise CutError(f"parallel.strategy pipeline: the model cannot be cut: {errors[0]} (a stage hands the next one "
                       "tensor, the next block's input)")
    result.param_uses, result.crossings = tracker.param_uses, tracker.crossings
    if result.blocks != blocks:
        ran = result.blocks[:6]
        raise CutError(f"parallel.strategy pipeline: the model's forward does not run its blocks as a chain, each once "
                       f"in order: the blocks are {_span(blocks)}, the forward ran {ran}{'...' if len(result.blocks) > 6 else ''}")
    return result


def _span(names: list[str]) -> str:
    return f"{names[0]} .. {names[-1]} ({len(names)})" if len(names) > 2 else ", ".join(names)


def check_crossings(cut: Cut, traced: Trace) -> None:
    """CutError where something made in one stage is read in a later one (other than the
    next stage's input, which the trace allowed): a skip connection across a cut."""
    for made, read, what in traced.crossings:
        a, b = cut.stage_of_position(made), cut.stage_of_position(read)
        if b > a:
            where = "before the first block" if made == PRE else f"in {cut.blocks[made]}"
            raise CutError(f"parallel.strategy pipeline: a tensor computed {where} (stage {a}) is read by {what} in "
                           f"{cut.blocks[read]} (stage {b}): a skip connection across the cut; only the input of a "
                           "stage's first block may cross (move the cut with parallel.pp_split, or use another layout)")


def param_counts(model: nn.Module, blocks: list[str]) -> tuple[list[int], int, int]:
    """Parameters of each block, and of everything before (PRE) and after the blocks: the
    weights a balanced cut evens out. A parameter shared by two modules counts once."""
    modules = dict(model.named_modules())
    seen: set[int] = set()
    per_block = []
    for name in blocks:
        n = 0
        for p in modules[name].parameters():
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        per_block.append(n)
    rest = sum(p.numel() for p in model.parameters() if id(p) not in seen)
    return per_block, rest, len(blocks)


def balanced(weights: list[float], pp: int, first_extra: float = 0, last_extra: float = 0,
             speeds: list[float] | None = None) -> list[int]:
    """The first block index of each stage (pp entries, starting with 0) that makes the slowest
    stage fastest: blocks of `weights`, the first stage carrying `first_extra` more and the
    last `last_extra` more, stage k working at `speeds[k]` (weight a second; default all alike)
    (linear partition, by dynamic programming)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: the heaviest stage when the first i blocks make k stages; cut[k][i] where the last begins
    best = [[inf] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 0
    for k in range(1, pp + 1):
        for i in range(k, n - (pp - k) + 1):
            for j in range(k - 1, i):
                load = prefix[i] - prefix[j] + (first_extra if j == 0 else 0) + (last_extra if i == n else 0)
                load = load / speeds[k - 1] if speeds else load
                worst = max(best[k - 1][j], load)
                if worst < best[k][i]:
                    best[k][i], cut[k][i] = worst, j
    starts, i = [], n
    for k in range(pp, 0, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]


def choose(model: nn.Module, blocks: list[str], pp: int, split: tuple[str, ...] = (), per_rank: int = 1) -> Cut:
    """The cut of `blocks` into `pp` x `per_rank` stages (`per_rank` stages a position under an
    interleaved schedule): at the blocks `split` names, else balanced."""
    n = pp * per_rank
    under = f" x {per_rank} stages a rank (an interleaved schedule)" if per_rank > 1 else ""
    if n > len(blocks):
        raise CutError(f"parallel.pp_size: {pp}{under} = {n} stages need at least {n} blocks; the model has "
                       f"{len(blocks)} ({_span(blocks)}); allowed: 1 < pp_size <= {len(blocks) // per_rank}")
    if split:
        if len(split) != n - 1:
            raise CutError(f"parallel.pp_split: {list(split)} names {len(split)} cut(s); pp_size {pp}{under} needs "
                           f"{n - 1}, the first block of every stage after the first")
        starts = [0]
        for name in split:
            hits = [i for i, b in enumerate(blocks) if b == name or fnmatch.fnmatchcase(b, name)]
            if len(hits) != 1:
                raise CutError(f"parallel.pp_split: {name!r} names no block; the blocks are {_span(blocks)}")
            starts.append(hits[0])
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise CutError(f"parallel.pp_split: {list(split)} must name blocks in model order, after the first, "
                           "each stage at least one block")
        how = "pp_split"
    per_block, rest, _ = param_counts(model, blocks)
    if not split:
        # what runs before the first block goes with the first stage, after the last with the last:
        # the split below evens the blocks out around them (half of the rest to each end)
        starts = balanced(per_block, n, rest // 2, rest - rest // 2)
        how = "balanced"
    ends = starts[1:] + [len(blocks)]
    return Cut(tuple(tuple(blocks[a:b]) for a, b in zip(starts, ends)), how, tuple(per_block), rest)
