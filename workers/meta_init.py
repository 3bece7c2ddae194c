"""Build a model on the meta device and give each rank only its own pieces, with exactly the
initial values a plain single-process build on the CPU gives.

The model's constructor runs once on the meta device (no memory) under a dispatch mode that
records every operation it runs: the allocations, the initialisers (`uniform_`, `normal_`, ...),
the views and in-place edits they make (an embedding's padding row set to zero), the buffers
computed from `arange` (RoPE tables). The model is then laid out (sharded on meta) and its
pieces allocated empty. `materialise` replays the record on the CPU in the same order after the
same seed, so the random generator draws the same numbers for the same tensors as the plain
build does; each parameter or buffer exists whole only from the first operation its final value
depends on to its last, is then cut to this rank's piece (strategies/state.py, shard_like: no
communication, every rank replays) and freed. A value overwritten later (a second initialisation
pass, as in a Hugging Face model's `post_init`) is not kept: its random numbers are drawn into a
scratch tensor only to keep the generator in step. The peak is about the largest tensor, never
the model.

What a model must do: build its tensors inside its constructor with torch operations (what
every `nn.Module` does). A constant made from Python data on the meta device
(`torch.tensor([...])` inside the constructor) has no recorded value; such a model, one that
reads a value while it is built (`.item()`, `.tolist()`), or one whose record cannot be
replayed, is built whole as before (`Recorded.replayable` is False, with the reason).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

# in-place operations that overwrite the whole of what they are given, whatever it held
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
               "geometric_", "cauchy_", "log_normal_"}
_UNFILLED = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach"}
_CPU = torch.device("cpu")


@dataclass(frozen=True)
class _Ref:  # not a NamedTuple: pytree would take a tuple apart
    """A meta tensor as it was when an operation saw it: its storage (views and a parameter made
    from a tensor share one), where in it it lies, and whether it covers all of it. Taken at
    record time, since laying the model out later replaces and frees what it held."""
    key: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    numel: int  # the storage's, in elements
    whole: bool


def _ref(t: torch.Tensor) -> _Ref:
    nbytes = t.untyped_storage().nbytes()
    return _Ref(t.untyped_storage()._cdata, tuple(t.size()), tuple(t.stride()), t.storage_offset(), t.dtype,
                nbytes // t.element_size(), t.storage_offset() == 0 and t.is_contiguous()
                and t.numel() * t.element_size() == nbytes)


def _freeze(tree):
    return tree_map(lambda x: _ref(x) if isinstance(x, torch.Tensor) and x.is_meta else x, tree)


def _refs(tree) -> list[_Ref]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, _Ref)]


@dataclass
class _Op:
    func: Callable
    args: tuple
    kwargs: dict
    out: object
    reads: set = field(default_factory=set)       # storages whose values the op uses
    writes: set = field(default_factory=set)      # storages it changes (mutated arguments)
    creates: set = field(default_factory=set)     # storages it allocates (fresh outputs)
    overwrites: set = field(default_factory=set)  # mutated storages whose old value it ignores
    seeded: bool = False                          # draws from the random generator
    needed: bool = False
    synthetic: bool = False                       # a whole torch.nn.init call, not one aten operation


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.alive: list = []  # every tensor seen, held until the build ends: no storage id is reused
        self.problem: str | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.alive.append((args, kwargs, out))
        if self.problem is None and any(isinstance(x, torch.Tensor) and not x.is_meta for x in tree_flatten(out)[0]):
            self.problem = f"{func} made a tensor off the meta device"
        op = _Op(func, _freeze(args), _freeze(kwargs), _freeze(out))
        mutated = set()
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = op.args[i] if i < len(op.args) else op.kwargs.get(arg.name)
                mutated |= {r.key for r in _refs(value)}
        op.writes = mutated
        in_keys = {r.key for r in _refs((op.args, op.kwargs))}
        op.creates = {r.key for r in _refs(op.out)} - in_keys
        target = op.args[0] if op.args and isinstance(op.args[0], _Ref) else None
        if func._schema.name.split("::")[-1] in _OVERWRITES and target is not None and target.whole:
            op.overwrites = {target.key}
        op.reads = in_keys - op.overwrites
        op.seeded = torch.Tag.nondeterministic_seeded in func.tags
        self.ops.append(op)
        return out


# torch.nn.init's initialisers that return at once for a meta tensor (their sampling depends on
# the values drawn: trunc_normal_ rejects and redraws); recorded as one call each, replayed by
# calling them on the real tensor
_SKIPPED_ON_META = ("trunc_normal_", "orthogonal_", "dirac_", "sparse_")


@contextlib.contextmanager
def _initialisers_recorded(recorder: _Recorder):
    saved = {name: getattr(nn.init, name) for name in _SKIPPED_ON_META}

    def recording(original):
        @functools.wraps(original)
        def call(tensor, *args, **kwargs):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_meta):
                return original(tensor, *args, **kwargs)
            recorder.alive.append(tensor)
            r = _ref(tensor)
            recorder.ops.append(_Op(original, (r, *args), dict(kwargs), r, reads=set() if r.whole else {r.key},
                                    writes={r.key}, overwrites={r.key} if r.whole else set(), seeded=True,
                                    synthetic=True))
            return tensor

        return call

    for name, original in saved.items():
        setattr(nn.init, name, recording(original))
    try:
        yield
    finally:
        for name, original in saved.items():
            setattr(nn.init, name, original)


@dataclass
class Recorded:
    ops: list
    replayable: bool
    reason: str = ""
    finals: dict = field(default_factory=dict)  # name ("buffer:NAME" for a buffer) -> its _Ref as built


def build_recorded(build: Callable[[], object]) -> tuple[object, Recorded]:
    """Run `build()` (returning a model, or (model, plan)) on the meta device, recording what it
    does. Returns build()'s result and the record."""
    recorder = _Recorder()
    with torch.device("meta"), _initialisers_recorded(recorder), recorder:
        result = build()
    model = result[0] if isinstance(result, tuple) else result
    record = _analyse(model, recorder.ops, recorder.problem)
    recorder.alive.clear()
    return result, record


def _analyse(model: nn.Module, ops: list[_Op], problem: str | None) -> Recorded:
    finals = {name: _ref(t) for name, t in _tensors(model).items()}
    if problem is not None:
        return Recorded(ops, False, problem)
    created: set[int] = set()
    for op in ops:
        op.creates -= created
        created |= op.creates
    keys = {r.key for r in finals.values()}
    if keys - created:
        return Recorded(ops, False, "a parameter or buffer was not made by a recorded operation "
                                    "(a constant from Python data, or made off the meta device)")
    # backward: an operation is needed when it changes a storage whose value is used later
    live = set(keys)
    for op in reversed(ops):
        if (op.writes | op.creates) & live:
            op.needed = True
            live -= op.overwrites | op.creates
            live |= op.reads
    if live:  # a value used that no recorded operation made: a constant the meta device dropped
        return Recorded(ops, False, "a value used in the build was not made by a recorded operation "
                                    "(a constant from Python data on the meta device)")
    for name, r in finals.items():  # made and then never written: an initialiser the record did not see
        touching = [op for op in ops if op.needed and r.key in op.writes | op.creates]
        if all(not op.synthetic and op.func._schema.name in _UNFILLED for op in touching):
            return Recorded(ops, False, f"{name} is allocated but never filled by a recorded operation "
                                        "(an initialiser that skips meta tensors, imported before the build?)")
    return Recorded(ops, True, finals=finals)


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer:{n}": b for n, b in model.named_buffers()}}


def _flat(r: _Ref) -> torch.Tensor:
    return torch.empty(r.numel, dtype=r.dtype)


@torch.no_grad()
def materialise(record: Recorded, place: Callable[[str, torch.Tensor], None]) -> int:
    """Replay the record on the CPU (call it right after the seed the plain build starts from);
    `place(name, value)` gets each parameter ("buffer:NAME" for a buffer) of the recorded model
    whole, once, as soon as its value is final, and must copy out what it keeps: the value is
    freed when it returns. Returns the most bytes of whole values the replay held at once."""
    names: dict[int, list[str]] = {}
    for name, r in record.finals.items():
        names.setdefault(r.key, []).append(name)
    last: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        if op.needed:
            for k in op.reads | op.writes | op.creates:
                last[k] = i
    bases: dict[int, torch.Tensor] = {}  # storage -> a flat real tensor over all of it
    peak = 0

    def real(x, into: dict):
        if isinstance(x, torch.device) and x.type == "meta":
            return _CPU  # a factory's device: the replay allocates on the CPU
        if not isinstance(x, _Ref):
            return x
        if x.key not in into:  # a value nothing needed wrote yet: what it held does not matter
            into[x.key] = _flat(x)
        return into[x.key].as_strided(x.size, x.stride, x.offset)

    for i, op in enumerate(record.ops):
        if op.needed:
            result = op.func(*tree_map(lambda x: real(x, bases), op.args), **tree_map(lambda x: real(x, bases), op.kwargs))
            for r, t in zip(tree_flatten(op.out)[0], tree_flatten(result)[0]):
                if isinstance(r, _Ref) and r.key not in bases:  # a fresh storage: over all of it
                    bases[r.key] = t.new_empty(0).set_(t.untyped_storage(), 0, (r.numel,), (1,))
        elif op.seeded:  # drawn only to keep the generator in step with the plain build
            scratch: dict[int, torch.Tensor] = {}
            op.func(*tree_map(lambda x: real(x, scratch), op.args), **tree_map(lambda x: real(x, scratch), op.kwargs))
            del scratch
        peak = max(peak, sum(b.numel() * b.element_size() for b in bases.values()))
        for k in [k for k, at in last.items() if at == i]:
            for name in names.get(k, ()):
                r = record.finals[name]
                place(name, bases[k].as_strided(r.size, r.stride, r.offset))
            bases.pop(k, None)
            del last[k]
    return peak


def fill(model: nn.Module, record: Recorded, device: torch.device) -> None:
    """Allocate the pieces of `model` (the recorded model, laid out on the meta device) on
    `device` and fill each from the replay, one whole tensor at a time. Call it right after the
    seed the plain build starts from; every rank of the layout calls it (no collective runs)."""
    from gearshift.strategies.relayout import _local, _params_keep_identity
    from gearshift.strategies.state import shard_like

    with _params_keep_identity():  # the layout may hold its parameters already (hybrid's averager)
        model.to_empty(device=device)
    targets = _tensors(model)

    def place(name: str, value: torch.Tensor) -> None:
        target = targets.pop(name)
        _local(target).copy_(_local(shard_like(value, target)))

    materialise(record, place)
    if targets:
        raise RuntimeError(f"the build on the meta device left {sorted(targets)[:5]} unfilled")
