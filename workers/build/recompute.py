"""Activation checkpointing for any model (`train.activation_checkpointing`): the chosen modules
keep only their inputs in forward and run forward again in backward (torch.utils.checkpoint,
non-reentrant, random state preserved, so dropout draws the same), trading compute for the
activation memory of all but one of them at a time.

`true`: the built-in models checkpoint their own blocks; any other model gets its FSDP units
(strategies/fsdp.py, find_units: a Hugging Face model's decoder layers, the blocks of a
ModuleList; parallel.fsdp_units when given). A list: module-name patterns or class names, for
any model. The module's forward is wrapped in place, so parameter names, checkpoints and the
layouts' own hooks (FSDP2's gathers run around forward, and again before the recomputation in
backward) stay as they are; it is applied to the model as built, before it is laid out (after
the tensor-parallel plan is taken from it, before fully_shard, in torchtitan's order).
"""

from __future__ import annotations

import fnmatch
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gearshift.strategies.rows import checkpoint_contexts


def chosen(model: nn.Module, setting, fsdp_units: tuple[str, ...] = (), builtin: bool = False) -> list[str]:
    """The names of the modules to checkpoint (outermost matches only)."""
    if not setting or setting is True and builtin:
        return []  # off, or a built-in model that does it itself
    from gearshift.strategies.fsdp import find_units

    if setting is True:
        return [n for n, _ in find_units(model, fsdp_units)[0]]
    out: list[str] = []
    for name, module in model.named_modules():
        if name and any(fnmatch.fnmatchcase(name, p) or type(module).__name__ == p for p in setting) \
                and not any(name.startswith(o + ".") for o in out):
            out.append(name)
    return out


def apply(model: nn.Module, setting, fsdp_units: tuple[str, ...] = (), builtin: bool = False) -> list[str]:
    """Checkpoint the chosen modules of `model` in place; their names."""
    names = chosen(model, setting, fsdp_units, builtin)
    modules = dict(model.named_modules())
    for name in names:
        _wrap(modules[name])
    return names


def _wrap(module: nn.Module) -> None:
    forward = module.forward

    @functools.wraps(forward)
    def recomputed(*args, **kwargs):
        if module.training and torch.is_grad_enabled():
            # the recomputation draws a sample's dropout masks as the forward did (strategies/rows.py)
            return checkpoint(forward, *args, use_reentrant=False, context_fn=checkpoint_contexts, **kwargs)
        return forward(*args, **kwargs)  # evaluation: nothing is kept for backward anyway

    module.forward = recomputed


def describe_units(model: nn.Module, patterns: tuple[str, ...]) -> dict:
    """The FSDP units the model's build found (strategies.fsdp), for the build's record."""
    from gearshift.strategies.fsdp import describe_units as describe  # FSDP2 is imported only where it is used

    return describe(model, patterns)
