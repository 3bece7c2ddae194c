"""Dropout masks per sample (`train.random_per: sample`, the default): the mask a `nn.Dropout`
draws for a sample is a function of (the job's seed, the step, the sample's place in the step's
global batch, the module's name, the element), never of the process that computes it. So a
sample's masks are the same under every layout, whatever the replicas' shares, the micro-batch
or the pipeline's micro-batches, and a run switched from one layout to another mid-way equals one
that never switched. torch's dropout draws from a generator per process instead: gearshift seeds one
stream per data replica and pipeline position (`train.random_per: replica`, Layout.seed_stream),
which keeps a fixed layout exact but draws other masks after a switch, a rebalance or a halved
micro-batch.

How: the build swaps each `nn.Dropout` (exactly that class, p > 0) for a `SampleDropout` holding
a key made from its qualified name (`per_sample`). The step gives each forward the global-batch
places of the rows it computes (strategies/rows.py, a context: the step variants of
workers/step/steps.py, and the pipeline's stages through a `rows` tensor the schedule splits with
the micro-batches). The mask is a counter-based hash of (key, seed, step, place, element),
computed in int64 tensor arithmetic on the input's device (integer arithmetic does not round, so a
GPU should draw the CPU's mask; this has run on CPU only). A recomputation in backward
(activation checkpointing) runs in the rows it ran in forward (rows.checkpoint_contexts). A
map-style dataset's augmentation follows the sample through its own seed (loader.sample_seed).

Outside a step (a plain forward in training mode, the non-finite step's search), the module is
torch's dropout. Not covered: functional dropout (F.dropout, scaled_dot_product_attention's
dropout_p), Dropout1d/2d/3d and AlphaDropout, and a dataset that reads its batch at once
(get_batch); they draw from the replica's stream. A dropout whose input is sharded (a DTensor with
a Shard placement) is refused. A module called twice on the same rows in one forward draws the
same mask both times.
"""

from __future__ import annotations

import sys
import zlib

import torch
from torch import nn

from gearshift.strategies.rows import Rows, current

_M32 = 0xFFFFFFFF
# odd multipliers below 2**31: a product of a 32-bit value and one stays below 2**63, so the
# int64 arithmetic never overflows on any device
_C1, _C2, _GOLD = 0x7FEB352D, 0x1B873593, 0x1E3779B9
CHUNK = 1 << 22  # elements hashed at once: 2 x 32 MiB of int64 scratch at most, however wide a row


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two xorshift-multiply rounds, as lowbias32) of values in
    [0, 2**32), elementwise, in place on `x`."""
    for c in (_C1, _C2):
        x.bitwise_xor_(x >> 16).mul_(c).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 15)


def _mix_int(x: int) -> int:
    """`_mix` of one value, in Python: the same numbers without a tensor (a device copy) per call."""
    for c in (_C1, _C2):
        x = ((x ^ (x >> 16)) * c) & _M32
    return x ^ (x >> 15)


def keep_mask(key: int, r: Rows, row_shape: tuple[int, ...], p: float, device: torch.device) -> torch.Tensor:
    """Which elements survive: (rows, *row_shape) booleans, each True with probability 1 - p,
    a function of (key, seed, step, place, element index) alone. The hash runs on blocks of at
    most CHUNK elements (rows by columns, so a row wider than CHUNK is cut too), each with two int64
    temporaries of that size: a large dropped tensor (attention weights) costs its boolean mask
    and a bounded scratch, not 16 bytes an element."""
    head = _mix_int(_mix_int((key ^ r.seed) & _M32) ^ (r.step & _M32))
    per_row = _mix(_mix(r.places.to(device) ^ head))  # (rows,)
    width = 1
    for n in row_shape:
        width *= n
    threshold = int(p * 2**32)
    keep = torch.empty((len(r.places), width), dtype=torch.bool, device=device)
    cols = max(1, min(width, CHUNK))
    rows_at_once = max(1, CHUNK // cols)
    for c in range(0, width, cols):
        per_element = _mix(torch.arange(c, min(c + cols, width), dtype=torch.int64, device=device)
                           .mul_(_GOLD).bitwise_and_(_M32))
        for a in range(0, len(r.places), rows_at_once):
            # uniform in [0, 2**32) per element
            block = _mix(per_row[a:a + rows_at_once, None] ^ per_element[None, :])
            keep[a:a + rows_at_once, c:c + cols] = block >= threshold
    return keep.view(len(r.places), *row_shape)


class SampleDropout(nn.Dropout):
    """nn.Dropout whose mask of each sample follows the sample (module docstring)."""

    def __init__(self, p: float, inplace: bool, key: int, name: str):
        super().__init__(p, inplace)
        self.key, self.name = key, name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = current() if self.training and self.p > 0 else None
        if r is None:
            if self.training and self.p > 0 and torch._C._current_graph_task_id() != -1:
                raise RuntimeError(
                    f"dropout {self.name!r} ran again in backward outside its step's rows: the model calls "
                    "torch.utils.checkpoint itself; use train.activation_checkpointing instead, or "
                    "train.random_per: replica")
            return super().forward(x)
        local = _local(x, self.name)
        if local.shape[0] != len(r.places):
            raise RuntimeError(f"dropout {self.name!r}: input of {local.shape[0]} rows in a forward of "
                               f"{len(r.places)} samples; train.random_per: sample needs the batch first")
        keep = keep_mask(self.key, r, tuple(local.shape[1:]), self.p, local.device)
        scale = 1.0 / (1.0 - self.p) if self.p < 1 else 0.0  # p = 1 drops everything, as torch's does
        out = local * (keep.to(local.dtype) * scale)
        if local is x:
            return out
        from torch.distributed.tensor import DTensor

        return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False)


def _local(x: torch.Tensor, name: str) -> torch.Tensor:
    """The tensor whose elements the mask covers: a replicated DTensor's local copy."""
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist: nothing to import
        return x
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(x, DTensor):
        if not all(isinstance(pl, Replicate) for pl in x.placements):
            raise RuntimeError(f"dropout {name!r} on a sharded input ({x.placements}): train.random_per: sample "
                               "draws whole rows; use train.random_per: replica")
        return x.to_local()
    return x


def per_sample(model: nn.Module) -> list[str]:
    """Swap each nn.Dropout of `model` (p > 0; not its subclasses) for a SampleDropout keyed by its
    qualified name, in place; the names swapped."""
    swapped = []
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout and child.p > 0:
                full = f"{name}.{child_name}" if name else child_name
                setattr(module, child_name, SampleDropout(child.p, child.inplace, zlib.crc32(full.encode()), full))
                swapped.append(full)
    return swapped
