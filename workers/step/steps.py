"""The step's variants: how one rank's share of a step is run forward and backward. A layout
chooses its step the way it chooses its wrapping (`Parallel.step_variant`, strategies/base.py); a layout
that names none gets `plain` when the share is computed at once and `accumulated` when it is taken
in micro-batches. Each variant takes the runner (workers/step/runner.py: the loss under autocast,
the scaler, the layout) and the rank's batch, and returns the step's mean loss, detached, with
the gradients in place for the update."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch


def plain(runner, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One forward and backward over the whole share."""
    loss = runner.forward_loss(x, y)
    runner.w.scaler.scale(loss).backward()
    return loss.detach()


def accumulated(runner, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The share in equal micro-batches, gradients accumulating; data parallelism syncs them once,
    in the last micro-batch's backward (the layout's no_sync before it)."""
    w = runner.w
    n = w.accumulation
    total = torch.zeros((), device=w.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(n), y.chunk(n))):
        with w.parallel.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss = runner.forward_loss(xm, ym) / n  # equal micro-batches: the mean of means
            w.scaler.scale(loss).backward()
        total += loss.detach().float()
    return total


STEPS: dict[str, Callable] = {"plain": plain, "accumulated": accumulated}


def choose(parallel, accumulation: int) -> Callable:
    """The variant for `parallel` (its own, if its layout names one) at `accumulation` micro-batches."""
    own = getattr(parallel, "step_variant", None)
    if own is None:
        return accumulated if accumulation > 1 else plain
    if own not in STEPS:
        raise ValueError(f"{type(parallel).__name__}.step_variant is {own!r}: the step variants are {sorted(STEPS)}")
    return STEPS[own]
