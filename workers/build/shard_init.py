"""`model.init: per_shard`: each rank initialises only the pieces it holds, with the distributions
the model's constructor uses, and the values are the same for the same seed whatever the layout
(data, tensor, fsdp, hsdp, any number of ranks) and from run to run; they are not a plain build's
values (`exact`, workers/build/meta_init.py, replays the whole model's random draws on every rank to
give those).

The record of the constructor's build (workers/build/meta_init.py) says, for each parameter and buffer,
the operations its final value depends on (`normal_`, a padding row's `zero_`, a `trunc_normal_`
call). Each parameter is cut along its first dimension into blocks of whole rows fixed by its
shape alone (at most `BLOCK_ELEMENTS` elements, at least `MIN_BLOCKS` blocks where it has the rows),
and each block is made on its
own: the random generator seeded from (train.seed, the parameter's name, the block's index), the
operations run on the block's rows only (an operation on rows outside the block is skipped). A
rank makes the blocks holding its rows and cuts its piece from them: under fsdp(N) each rank
draws about 1/N of the model. Operations that are not elementwise over rows (a QR for
`orthogonal_`, a value computed from another tensor, a RoPE table from `arange`), are replayed on
the whole tensor with the generator seeded from (seed, name) on every rank that holds a piece of
it: still the same across layouts, drawn whole (`Made.whole` names them).

This is gearshift's own scheme, not DTensor's random-number offsets (torch's
OffsetBasedRNGTracker supports CUDA-like devices only): values made on a GPU worker are drawn on
its CPU and copied over. Checked on gloo/CPU only.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten

from gearshift.workers.build import meta_init
from gearshift.workers.build.meta_init import Recorded, _Op, _Ref

BLOCK_ELEMENTS = 1 << 16  # a block's most elements
MIN_BLOCKS = 64  # a tensor of enough rows has at least this many blocks: a rank draws little beyond its rows
# in-place operations that act on each element alone (their other arguments are numbers)
_ELEMENTWISE = meta_init._OVERWRITES - {"copy_"} | {
    "mul_", "add_", "sub_", "div_", "clamp_", "clamp_min_", "clamp_max_", "erfinv_", "sqrt_", "exp_", "log_",
    "neg_", "abs_", "tanh_", "sigmoid_", "fmod_", "remainder_", "floor_", "ceil_", "round_", "sign_", "trunc_"}
# factories whose values are the same for any shape: run as the in-place operation on the block
_FACTORIES = {"empty": None, "empty_strided": None, "zeros": ("zero_",), "ones": ("fill_", 1.0),
              "rand": ("uniform_", 0.0, 1.0), "randn": ("normal_", 0.0, 1.0), "full": ("fill_",)}


def seed_of(seed: int, name: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class Made:
    """What a per_shard fill made on this rank: elements of random numbers drawn, blocks made, and
    the tensors made whole (their initialisation is not elementwise over rows)."""
    drawn: int = 0
    blocks: int = 0
    whole: list = field(default_factory=list)


def _short(op: _Op) -> str:
    return "trunc_normal_" if op.synthetic else op.func._schema.name.split("::")[-1]


def _contiguous(r: _Ref) -> bool:
    expected, step = [], 1
    for n in reversed(r.size):
        expected.insert(0, step)
        step *= n
    return all(n == 1 or s == e for n, s, e in zip(r.size, r.stride, expected))


class _Chain:
    """The operations one parameter's (or buffer's) final value depends on, and how to make any
    range of its rows from them."""

    def __init__(self, record: Recorded, name: str, seed: int):
        self.final = record.finals[name]
        self.name, self.seed = name, seed
        self.ops = [record.ops[i] for i in sorted(meta_init._needed(record.ops, {self.final.key})[0])]
        size = self.final.size
        self.rows = size[0] if size else 1
        self.row = math.prod(size[1:]) if size else 1
        self.per_block = max(1, min(BLOCK_ELEMENTS // max(1, self.row), -(-self.rows // MIN_BLOCKS)))
        self.by_rows = self.final.whole and self.rows > 0 and all(self._blockable(op) for op in self.ops)

    def _blockable(self, op: _Op) -> bool:
        name, leaves = _short(op), tree_flatten((op.args, op.kwargs, op.out))[0]
        refs = [x for x in leaves if isinstance(x, _Ref)]
        if any(isinstance(x, torch.Tensor) for x in leaves) or not refs:
            return False  # a constant from Python data has the whole tensor's shape
        if name not in _ELEMENTWISE and name != "trunc_normal_" and name not in _FACTORIES:
            return False
        first = refs[0]
        return all(r.key == self.final.key and (r.offset, math.prod(r.size)) == (first.offset, math.prod(first.size))
                   and self._aligned(r) for r in refs)

    def _aligned(self, r: _Ref) -> bool:
        """Whether `r` is a run of whole rows: (k, *row shape), one row, or flat."""
        n = math.prod(r.size)
        shapes = (tuple(r.size[1:]) == tuple(self.final.size[1:]), tuple(r.size) == tuple(self.final.size[1:]),
                  len(r.size) == 1)
        return _contiguous(r) and r.offset % self.row == 0 and n % self.row == 0 and any(shapes)

    def make(self, lo: int, hi: int, made: Made, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [lo, hi) of the value, whole along the other dimensions (into `out`, contiguous,
        on the CPU, where given: a block inside the rows is made in place there)."""
        if not self.by_rows:
            if self.name not in made.whole:
                made.whole.append(self.name)
            value = self._whole(made)[lo:hi] if self.final.size else self._whole(made)
            return value if out is None else out.copy_(value.reshape(out.shape))
        rows = torch.empty((hi - lo, *self.final.size[1:]), dtype=self.final.dtype) if out is None \
            else out.view(hi - lo, *self.final.size[1:])
        for block in range(lo // self.per_block, (hi - 1) // self.per_block + 1):
            b0, b1 = block * self.per_block, min(self.rows, (block + 1) * self.per_block)
            if lo <= b0 and b1 <= hi:  # made where it stays
                self._block(block, b0, b1, made, rows[b0 - lo:b1 - lo].view(-1))
                continue
            value = self._block(block, b0, b1, made)
            start, stop = max(lo, b0), min(hi, b1)
            rows[start - lo:stop - lo] = value[start - b0:stop - b0]
        return rows if self.final.size else rows.reshape(())

    def _block(self, block: int, b0: int, b1: int, made: Made, base: torch.Tensor | None = None) -> torch.Tensor:
        torch.default_generator.manual_seed(seed_of(self.seed, self.name, block))
        base = torch.empty((b1 - b0) * self.row, dtype=self.final.dtype) if base is None else base
        lo, hi = b0 * self.row, b1 * self.row
        for op in self.ops:
            ref = next(x for x in tree_flatten((op.args, op.out))[0] if isinstance(x, _Ref))
            start, stop = max(ref.offset, lo), min(ref.offset + math.prod(ref.size), hi)
            if start >= stop:
                continue  # rows of another block
            view = base[start - lo:stop - lo].view(self._shape(ref, stop - start))
            name = _short(op)
            if name in _FACTORIES:
                if _FACTORIES[name]:  # full's value is its second argument
                    getattr(view, _FACTORIES[name][0])(*(_FACTORIES[name][1:] or op.args[1:2]))
            else:
                op.func(*[_resolved(x, view) for x in op.args],
                        **{k: _resolved(v, view) for k, v in op.kwargs.items()})
            made.drawn += view.numel() if op.seeded or name in ("rand", "randn") else 0
        made.blocks += 1
        return base.view(b1 - b0, *self.final.size[1:])

    def _shape(self, ref: _Ref, n: int) -> tuple:
        if n == math.prod(ref.size):
            return tuple(ref.size)
        return (n,) if len(ref.size) == 1 else (n // self.row, *self.final.size[1:])

    def _whole(self, made: Made) -> torch.Tensor:
        torch.default_generator.manual_seed(seed_of(self.seed, self.name, -1))
        bases: dict = {}
        for op in self.ops:
            meta_init.run(op, bases, _whole_arg)
            if op.seeded:
                made.drawn += sum(math.prod(r.size) for r in tree_flatten(op.out)[0] if isinstance(r, _Ref))
        f = self.final
        return bases[f.key].as_strided(f.size, f.stride, f.offset)


def _resolved(x, view: torch.Tensor):
    if isinstance(x, _Ref):
        return view
    if isinstance(x, torch.Generator):
        return torch.default_generator  # seeded per block: the constructor's own generator is not used
    return x


def _whole_arg(x, bases: dict):
    return torch.default_generator if isinstance(x, torch.Generator) else meta_init.real(x, bases)


def _rows(target: torch.Tensor, rows: int) -> tuple[tuple[int, int], list | None]:
    """The rows of `target`'s full value this rank holds, and the cut of those rows that is its
    piece ([(dim, start, length)], or None: cut it as the layout does, from all rows)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(target, DTensor):
        return (0, rows), []
    if any(type(p) not in (Shard, Replicate) for p in target.placements):
        return (0, rows), None  # a strided shard (fsdp over tensor parallel): cut by DTensor itself
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if not target.shape:
        return (0, 1), []
    cuts = [(d, offset[d], shape[d]) for d in range(1, len(shape)) if shape[d] != target.shape[d]]
    return (offset[0], offset[0] + shape[0]), cuts


@torch.no_grad()
def fill(model: torch.nn.Module, record: Recorded, device: torch.device, seed: int,
         skip: set[str] = frozenset()) -> Made:
    """Allocate `model`'s pieces where it is laid out on the meta device, then fill each
    parameter and buffer this rank holds from its rows (a model already allocated, a whole copy,
    is filled in place). Those named in `skip` (pretrained weights) are left as they are. The
    random generator is left seeded with `seed`, whatever the layout."""
    from gearshift.strategies.relayout import _local
    from gearshift.strategies.state import shard_like

    targets, made = meta_init.allocate(model, device), Made()
    canonical: dict[int, str] = {}  # a storage held under several names (tied) is made once, by its first
    for name, ref in record.finals.items():
        canonical.setdefault(ref.key, name)
    chains: dict[str, _Chain] = {}
    for name, target in targets.items():
        if name in skip:
            continue
        first = canonical[record.finals[name].key]
        chain = chains.setdefault(first, _Chain(record, first, seed))
        (lo, hi), cuts = _rows(target, chain.rows)
        if hi <= lo:
            continue
        if cuts is None:  # all rows, cut by the layout
            _local(target).copy_(_local(shard_like(chain.make(0, chain.rows, made), target)))
            continue
        local = _local(target)
        if not cuts and local.device.type == "cpu" and local.is_contiguous() and local.dtype == chain.final.dtype:
            chain.make(lo, hi, made, out=local)  # this rank's rows, made in place
            continue
        value = chain.make(lo, hi, made)
        for dim, start, length in cuts:
            value = value.narrow(dim, start, length)
        local.copy_(value)
    torch.manual_seed(seed)
    return made


AUTO_PER_SHARD = 10 ** 9  # parameters from which `auto` makes each rank initialise its pieces only


def choose(asked: str, parameters: int) -> tuple[str, str]:
    """model.init in force for a model of `parameters` and why (said in the run's start line)."""
    if asked != "auto":
        return asked, "asked"
    mode = "per_shard" if parameters >= AUTO_PER_SHARD else "exact"
    size = f"{parameters / 1e6:,.0f}M" if parameters >= 10 ** 6 else f"{parameters:,}"
    return mode, f"auto: {size} parameters, {'>=' if mode == 'per_shard' else '<'} {AUTO_PER_SHARD / 1e9:g}B"


def parameters(record: Recorded) -> int:
    return sum(math.prod(r.size) for name, r in record.finals.items() if not name.startswith("buffer:"))


def whole(model: torch.nn.Module, build, asked: str, seed: int, device: torch.device) -> dict:
    """For a model built whole (a replicated layout, or a build the record cannot replay): under
    per_shard, its values made again as a sharded layout's ranks make theirs, so that the run
    starts the same whatever its layout. Returns what the worker reports of it."""
    mode, why = choose(asked, sum(p.numel() for p in model.parameters()))
    if mode == "exact":
        return {"init": mode, "init_why": why}
    started, state = time.perf_counter(), torch.default_generator.get_state()
    try:
        _, record = meta_init.build_recorded(build)  # on fake tensors: nothing drawn, nothing held
        reason = None if record.replayable else record.reason
    except Exception as err:  # noqa: BLE001 - the build reads a value a fake tensor has not got
        reason = f"{type(err).__name__}: {err}"[:300]
    torch.default_generator.set_state(state)
    if reason is not None:  # the plain build's values stand
        return {"init": "exact", "init_why": f"per_shard asked ({why}), but the build cannot be recorded: {reason}"}
    made = fill(model, record, device, seed)
    return {"init": mode, "init_why": why, "drawn": made.drawn, "drawn_whole": made.whole,
            "fill_s": round(time.perf_counter() - started, 3)}
