"""Whether the record of a build initialised each parameter the way the model's own
initialisation does: the check that catches a constructor the recorder saw run differently from
a plain build (workers/build/meta_init.py).

A transformers model initialises its weights in `post_init` (`init_weights`), after its layers
were built with torch's defaults; transformers skips that pass where it sees the meta device, and
a record that missed it would replay torch's defaults instead. So the model's own `_init_weights`
is run once more over the recorded (fake) model, module by module as `post_init` walks them (a
nested transformers model with its own), and what it does to each parameter, from the last
operation that overwrites it whole on, must be what the record's last operations on it are.
Where a user's build changes a parameter after the constructor, the two differ too; then the
model is built whole, which is right if slow, and the reason names the parameter.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable

import torch
from torch import nn


def own_initialisation(model: nn.Module) -> Callable[[], None] | None:
    """A function that runs every transformers model's `_init_weights` in `model` over its
    modules in `post_init`'s order, or None where `model` holds no transformers model."""
    utils = sys.modules.get("transformers.modeling_utils")  # never imported here for a model without it
    pretrained = getattr(utils, "PreTrainedModel", None)
    if pretrained is None:
        return None
    roots, inside = [], set()
    for module in model.modules():  # pre-order: an outer transformers model before its parts
        if id(module) in inside:
            continue
        if isinstance(module, pretrained):
            roots.append(module)
            inside |= {id(m) for m in module.modules()}
    if not roots:
        return None

    def walk(module: nn.Module, owner: nn.Module) -> None:
        for child in module.children():
            walk(child, child if isinstance(child, pretrained) else owner)
        owner._init_weights(module)

    def run() -> None:
        init = sys.modules.get("transformers.initialization")
        guard = getattr(init, "guard_torch_init_functions", None)
        with torch.no_grad(), guard() if guard else contextlib.nullcontext():
            for root in roots:
                walk(root, root)

    return run


def _signature(op) -> tuple:
    name = op.func._schema.name if hasattr(op.func, "_schema") else op.func.__name__
    leaves = []
    for x in torch.utils._pytree.tree_flatten((op.args, op.kwargs))[0]:
        if hasattr(x, "key") and hasattr(x, "stride"):  # a tensor as the op saw it: its place, not its storage
            leaves.append((x.size, x.stride, x.offset))
        elif isinstance(x, (bool, int, float, str, torch.dtype)) or x is None:
            leaves.append(x)
    return name, tuple(leaves)


def _tails(ops, needed_only: bool) -> dict[int, list]:
    """Per storage, the signatures of the operations that write it, from the last one that makes
    or overwrites it whole on (a storage only ever written in part is left out)."""
    tails: dict[int, list] = {}
    for op in ops:
        if needed_only and not op.needed:
            continue
        for key in op.writes | op.creates:
            if key in op.overwrites or key in op.creates:
                tails[key] = [_signature(op)]
            elif key in tails:
                tails[key].append(_signature(op))
    return tails


def differs(model: nn.Module, record, probe: Callable[[Callable[[], None]], list]) -> str:
    """Why the record's initialisation of `model` is not its own (empty: it is, or the model has
    no initialisation pass of its own to compare with). `probe(run)` returns the operations
    `run()` makes on the recorded model."""
    run = own_initialisation(model)
    if run is None:
        return ""
    try:
        expected = _tails(probe(run), needed_only=False)
    except Exception as err:  # noqa: BLE001 - an _init_weights that cannot run twice: nothing to compare
        return f"its _init_weights could not be run over the recorded model to check it ({type(err).__name__}: {err})"[:300]
    recorded = _tails(record.ops, needed_only=True)
    for name, ref in record.finals.items():
        want = expected.get(ref.key)
        if want is not None and recorded.get(ref.key) != want:
            got = recorded.get(ref.key) or [("nothing", ())]
            return (f"{name}: the model's own _init_weights sets it with {want[0][0]} but the recorded build "
                    f"left it from {got[0][0]} (a constructor that runs differently unrecorded, or a change "
                    f"after it)")
    return ""
