"""Build a model without memory and give each rank only its own pieces, with exactly the
initial values a plain single-process build on the CPU gives.

The model's constructor runs once under torch's FakeTensorMode (tensors with shapes, dtypes and
a device, and no data), under a dispatch mode that records every operation it runs: the
allocations, the initialisers (`uniform_`, `normal_`, ...), the views and in-place edits they
make (an embedding's padding row set to zero), the buffers computed from `arange` (RoPE tables),
constants made from Python data. A fake tensor says it is on the CPU, so the constructor takes
the path it takes in a plain build: code that skips work on the meta device (a Hugging Face
model's `init_weights`, torch's `orthogonal_`) runs as it does on the CPU. Afterwards the model's
tensors are swapped for meta tensors of the same shapes, it is laid out (sharded on meta) and its
pieces allocated empty. `materialise` replays the record on the CPU in the same order after the
same seed, so the random generator draws the same numbers for the same tensors as the plain
build does (a constructor that reseeds, or draws from its own generator, is replayed with the
generator states it had); each parameter or buffer exists whole only from the first operation its
final value depends on to its last, is then cut to this rank's piece (strategies/state.py,
shard_like: no communication, every rank replays) and freed. A value overwritten later (a second
initialisation pass, as in a Hugging Face model's `post_init`) is not kept: its random numbers are
drawn into a scratch tensor only to keep the generator in step. The peak is about the largest
tensor, never the model.

Checked before anything is laid out (`Recorded.replayable` False, with the reason, and the model
built whole): a parameter or buffer that no recorded operation filled (an initialiser the record
did not see), a value used that no recorded operation made, and, for a transformers model, a
parameter whose recorded last initialisation is not what the model's own `_init_weights` does
(workers/build/init_check.py). A constructor that reads a value while it is built (`.item()`,
`.tolist()` of a computed tensor, a rejection loop) cannot be recorded and is built whole too.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from gearshift.workers.build import init_check

# in-place operations that overwrite the whole of what they are given, whatever it held
_OVERWRITES = {"uniform_", "normal_", "fill_", "zero_", "copy_", "random_", "bernoulli_", "exponential_",
               "geometric_", "cauchy_", "log_normal_"}
_UNFILLED = {"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::detach"}
_CPU = torch.device("cpu")


def _fake(x) -> bool:
    return isinstance(x, FakeTensor)


@dataclass(frozen=True)
class _Ref:  # not a NamedTuple: pytree would take a tuple apart
    """A fake tensor as it was when an operation saw it: its storage (views and a parameter made
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
    return tree_map(lambda x: _ref(x) if _fake(x) else x, tree)


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
    rng: tuple | None = None                      # (generator, state) to set before it: the build reseeded


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[_Op] = []
        self.alive: list = []  # every tensor seen, held until the build ends: no storage id is reused
        self.problem: str | None = None
        self.rng = _RngStates()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.alive.append((args, kwargs, out))
        if self.problem is None and any(isinstance(x, torch.Tensor) and not _fake(x) for x in tree_flatten(out)[0]):
            self.problem = f"{func} made a tensor with data while the model was recorded"
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
        self.add(op)
        return out

    def add(self, op: _Op) -> None:
        if op.seeded:
            op.rng = self.rng.changed((op.args, op.kwargs))
        self.ops.append(op)


class _RngStates:
    """The random generators' states as the build left them before each draw. Recording draws
    nothing, so a state changes only where the constructor set it (`torch.manual_seed`,
    `set_rng_state`, its own `torch.Generator`): those states are set again before the same
    draws in the replay."""

    def __init__(self):
        self.last = {id(torch.default_generator): torch.default_generator.get_state()}
        self.held: list = []  # the generators named, kept alive so that their ids stay theirs

    def changed(self, tree) -> tuple | None:
        """(generator, state) when the draw with these arguments finds its generator not where
        the last draw from it (or, for the default one, the build's start) left it."""
        generator = next((x for x in tree_flatten(tree)[0] if isinstance(x, torch.Generator)), torch.default_generator)
        with _disable_current_modes():  # compared as the real tensors they are, not recorded
            state = generator.get_state()
            last = self.last.get(id(generator))
            if last is not None and torch.equal(last, state):
                return None
        self.last[id(generator)] = state
        self.held.append(generator)
        return generator, state


@contextlib.contextmanager
def _trunc_normal_recorded(recorder: _Recorder):
    """torch's truncated normal rejects and redraws until every value lies in its bounds, which
    reads the values drawn: recorded as one call, replayed by calling it on the real tensor.
    Patched where `nn.init.trunc_normal_` looks it up at each call, so that every reference to
    `trunc_normal_` goes through it (transformers keeps its own, taken at import)."""
    holder, name = (nn.init, "_no_grad_trunc_normal_") if hasattr(nn.init, "_no_grad_trunc_normal_") \
        else (nn.init, "trunc_normal_")
    original = getattr(holder, name)

    @functools.wraps(original)
    def call(tensor, *args, **kwargs):
        if not _fake(tensor):
            return original(tensor, *args, **kwargs)
        recorder.alive.append(tensor)
        r = _ref(tensor)
        recorder.add(_Op(original, (r, *args), dict(kwargs), r, reads=set() if r.whole else {r.key},
                         writes={r.key}, overwrites={r.key} if r.whole else set(), seeded=True, synthetic=True))
        return tensor

    setattr(holder, name, call)
    try:
        yield
    finally:
        setattr(holder, name, original)


@dataclass
class Recorded:
    ops: list
    replayable: bool
    reason: str = ""
    finals: dict = field(default_factory=dict)  # name ("buffer:NAME" for a buffer) -> its _Ref as built
    rng_after: torch.Tensor | None = None  # the default generator's state the build left, where it set one


def build_recorded(build: Callable[[], object]) -> tuple[object, Recorded]:
    """Run `build()` (returning a model, or (model, plan)) on fake tensors, recording what it
    does. Returns build()'s result, its tensors on the meta device, and the record."""
    recorder = _Recorder()
    with FakeTensorMode() as fake, _trunc_normal_recorded(recorder), recorder:
        result = build()
    model = result[0] if isinstance(result, tuple) else result
    record = _analyse(model, recorder.ops, recorder.problem)
    if record.replayable:
        record.reason = init_check.differs(model, record, lambda run: _recorded_ops(fake, run))
        record.replayable = not record.reason
    after = recorder.rng.changed(())  # set after the last draw: the state a plain build ends in
    record.rng_after = after[1] if after else None
    _to_meta(model)
    recorder.alive.clear()
    return result, record


def _recorded_ops(fake: FakeTensorMode, run: Callable[[], None]) -> list[_Op]:
    """The operations `run()` makes on the recorded (still fake) model."""
    probe = _Recorder()
    with fake, _trunc_normal_recorded(probe), probe:
        run()
    return probe.ops


def _to_meta(model: nn.Module) -> None:
    """Swap the model's fake tensors for meta tensors of the same shapes: what the layouts and
    `fill` work on. A parameter held by several modules (tied) stays one parameter."""
    made: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            empty = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
            made[id(t)] = nn.Parameter(empty, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else empty
        return made[id(t)]

    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if _fake(t):
                    table[name] = meta(t)
        for name, value in list(vars(module).items()):  # a tensor kept as a plain attribute
            if _fake(value):
                object.__setattr__(module, name, meta(value))


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
                                    "(made before the build, or outside torch)")
    needed, live = _needed(ops, keys)
    for i in needed:
        ops[i].needed = True
    if live:  # a value used that no recorded operation made
        return Recorded(ops, False, "a value used in the build was not made by a recorded operation "
                                    "(a tensor made before the build)")
    filled = set()  # storages some needed operation writes values into (not only allocates)
    for op in ops:
        if op.needed and (op.synthetic or op.func._schema.name not in _UNFILLED):
            filled |= op.writes | op.creates
    for name, r in finals.items():  # made and then never written: an initialiser the record did not see
        if r.key not in filled:
            return Recorded(ops, False, f"{name} is allocated but never filled by a recorded operation "
                                        "(left empty by its constructor, or filled by code the record does not see)")
    return Recorded(ops, True, finals=finals)


def _needed(ops: list[_Op], keys: set[int]) -> tuple[set[int], set[int]]:
    """The operations (by index) the final values of storages `keys` depend on, going backward:
    one is needed when it changes a storage whose value is used later; and the storages used
    that no operation made."""
    live, needed = set(keys), set()
    for i in range(len(ops) - 1, -1, -1):
        op = ops[i]
        if (op.writes | op.creates) & live:
            needed.add(i)
            live -= op.overwrites | op.creates
            live |= op.reads
    return needed, live


def _tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer:{n}": b for n, b in model.named_buffers()}}


def _flat(r: _Ref) -> torch.Tensor:
    return torch.empty(r.numel, dtype=r.dtype)


def real(x, into: dict):
    """The real tensor a recorded argument stands for: a view of its storage's flat tensor in
    `into` (allocated empty where nothing needed wrote it yet: what it held does not matter)."""
    if isinstance(x, torch.device) and x.type == "meta":
        return _CPU  # a factory's device: the replay allocates on the CPU
    if isinstance(x, torch.Tensor):
        return x.clone()  # a constant from Python data (the record's own, never to be changed)
    if not isinstance(x, _Ref):
        return x
    if x.key not in into:
        into[x.key] = _flat(x)
    return into[x.key].as_strided(x.size, x.stride, x.offset)


def run(op: _Op, bases: dict, arg: Callable = real):
    """Run a recorded operation on the real tensors of `bases` (`arg(x, bases)` turns each
    argument into one); a storage it makes is kept in `bases`, over all of it."""
    result = op.func(*tree_map(lambda x: arg(x, bases), op.args), **tree_map(lambda x: arg(x, bases), op.kwargs))
    for r, t in zip(tree_flatten(op.out)[0], tree_flatten(result)[0]):
        if isinstance(r, _Ref) and r.key not in bases:  # a fresh storage: over all of it
            bases[r.key] = t.new_empty(0).set_(t.untyped_storage(), 0, (r.numel,), (1,))
    return result


@torch.no_grad()
def materialise(record: Recorded, place: Callable[[str, torch.Tensor], None], skip: set[str] = frozenset()) -> int:
    """Replay the record on the CPU (call it right after the seed the plain build starts from);
    `place(name, value)` gets each parameter ("buffer:NAME" for a buffer) of the recorded model
    whole, once, as soon as its value is final, and must copy out what it keeps: the value is
    freed when it returns. The tensors named in `skip` (filled from elsewhere afterwards:
    pretrained weights) are not made at all, their random numbers not drawn, unless a value kept
    draws after them (then only into scratch, to keep the generator in step). Returns the most
    bytes of whole values the replay held at once."""
    names: dict[int, list[str]] = {}
    for name, r in record.finals.items():
        if name not in skip:
            names.setdefault(r.key, []).append(name)
    needed, drawn = {i for i, op in enumerate(record.ops) if op.needed}, len(record.ops)
    if skip:  # draws after the last kept one keep nothing in step: not made
        needed = _needed(record.ops, set(names))[0]
        drawn = max((i for i in needed if record.ops[i].seeded), default=-1)
    last: dict[int, int] = {}
    for i, op in enumerate(record.ops):
        if i in needed:
            for k in op.reads | op.writes | op.creates:
                last[k] = i
    bases: dict[int, torch.Tensor] = {}  # storage -> a flat real tensor over all of it
    peak = 0
    for i, op in enumerate(record.ops):
        if op.rng is not None:  # the constructor set this generator's state here
            op.rng[0].set_state(op.rng[1])
        if i in needed:
            run(op, bases)
        elif op.seeded and i < drawn:  # drawn only to keep the generator in step with the plain build
            run(op, {})
        peak = max(peak, sum(b.numel() * b.element_size() for b in bases.values()))
        for k in [k for k, at in last.items() if at == i]:
            for name in names.get(k, ()):
                r = record.finals[name]
                place(name, bases[k].as_strided(r.size, r.stride, r.offset))
            bases.pop(k, None)
            del last[k]
    if record.rng_after is not None:
        torch.default_generator.set_state(record.rng_after)
    return peak


def fill(model: nn.Module, record: Recorded, device: torch.device, skip: set[str] = frozenset()) -> None:
    """Allocate the pieces of `model` (the recorded model, laid out on the meta device) on
    `device` and fill each from the replay, one whole tensor at a time, but those named in `skip`
    (left empty for pretrained weights to fill). Call it right after the seed the plain build
    starts from; every rank of the layout calls it (no collective runs)."""
    from gearshift.strategies.relayout import _local
    from gearshift.strategies.state import shard_like

    targets = allocate(model, device)

    def place(name: str, value: torch.Tensor) -> None:
        target = targets.pop(name)
        _local(target).copy_(_local(shard_like(value, target)))

    materialise(record, place, skip)
    for name in skip:
        targets.pop(name, None)
    if targets:
        raise RuntimeError(f"the build on the meta device left {sorted(targets)[:5]} unfilled")


def allocate(model: nn.Module, device: torch.device) -> dict[str, torch.Tensor]:
    """Allocate the pieces of `model` (laid out on the meta device) empty on `device`; returns its
    parameters and buffers ("buffer:NAME") by name. A model already allocated is left as it is."""
    from gearshift.strategies.relayout import _local, _params_keep_identity

    if any(_local(t).is_meta for t in _tensors(model).values()):
        with _params_keep_identity():  # the layout may hold its parameters already (hybrid's averager)
            model.to_empty(device=device)
    return _tensors(model)
