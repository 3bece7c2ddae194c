"""The step's variants: how one rank's share of a step is run forward and backward. A layout
chooses its step the way it chooses its wrapping (`Parallel.step_variant`, strategies/base.py); a layout
that names none gets `plain` when the share is computed at once and `accumulated` when it is taken
in micro-batches. Each variant takes the runner (workers/step/runner.py: the loss under autocast,
the scaler, the layout), the rank's batch and its rows' places for dropout (strategies/rows.Rows, or
None), and returns the step's mean loss, detached, with
the gradients in place for the update."""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from gearshift.strategies.rows import Rows


def plain(runner, x: torch.Tensor, y: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
    """One forward and backward over the whole share."""
    loss = runner.forward_loss(x, y, rows)
    runner.w.scaler.scale(loss).backward()
    return loss.detach()


def accumulated(runner, x: torch.Tensor, y: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
    """The share in equal micro-batches, gradients accumulating; data parallelism syncs them once,
    in the last micro-batch's backward (the layout's no_sync before it)."""
    w = runner.w
    n = w.accumulation
    total = torch.zeros((), device=w.device)
    for i, (xm, ym, rm) in enumerate(zip(x.chunk(n), y.chunk(n), _split(rows, n, even=True))):
        with w.parallel.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss = runner.forward_loss(xm, ym, rm) / n  # equal micro-batches: the mean of means
            w.scaler.scale(loss).backward()
        total += loss.detach().float()
    return total


def uneven(runner, x: torch.Tensor, y: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
    """An uneven share (a straggler's rebalance, workers/step/shares.py) in the step's
    micro-batches, as many on every rank (a sharded layout's collectives pair up), of nearly equal
    sizes. Each micro-batch's mean loss is weighted by its samples x dp / the global batch, so the
    replicas' average of the gradients is the global batch's mean; the loss returned is weighted
    alike, so the mean over the ranks is the global batch's loss."""
    w = runner.w
    n = w.accumulation
    per_sample = w.layout.dp / w.config.global_batch_size
    total = torch.zeros((), device=w.device)
    for i, (xm, ym, rm) in enumerate(zip(x.tensor_split(n), y.tensor_split(n), _split(rows, n, even=False))):
        with w.parallel.no_sync() if i < n - 1 else contextlib.nullcontext():
            loss = runner.forward_loss(xm, ym, rm) * (len(xm) * per_sample)
            w.scaler.scale(loss).backward()
        total += loss.detach().float()
    return total


def pipelined(runner, x: torch.Tensor, y: torch.Tensor, rows: Rows | None = None) -> torch.Tensor:
    """The share through the pipeline's stages (strategies/pipeline/parallel.py), in the layout's
    micro-batches, once per accumulation micro-batch: each pass's mean loss is weighted by its
    part of the share's rows, so the gradients are the share's mean. The loss, the last stage's,
    on every stage."""
    w = runner.w
    n, par = w.accumulation, w.parallel
    loss_fn, scaler = w.loss_fn, (w.scaler if w.scaler.is_enabled() else None)
    if scaler is not None:  # fp16: the last stage scales its losses; every rank's scaler starts alike
        scaler.scale(torch.zeros((), device=w.device))
        loss_fn = lambda out, target: scaler.scale(w.loss_fn(out, target))  # noqa: E731
    total = None
    with runner.autocast():
        for xm, ym, rm in zip(x.chunk(n), y.chunk(n), _split(rows, n, even=True)):
            got = par.run(xm, ym, loss_fn, len(xm) / len(x), rm)
            if got is not None:
                total = got if total is None else total + got
    loss = par.share_loss(total)
    return loss / scaler.get_scale() if scaler is not None else loss


def _split(rows: Rows | None, n: int, even: bool) -> list:
    """The dropout rows of each micro-batch (workers/step/sample_masks.py), cut as the inputs are."""
    return [None] * n if rows is None else rows.split(n, even)


STEPS: dict[str, Callable] = {"plain": plain, "accumulated": accumulated, "uneven": uneven, "pipelined": pipelined}


def choose(parallel, accumulation: int, uneven: bool = False) -> Callable:
    """The variant for `parallel` (its own, if its layout names one) at `accumulation` micro-batches,
    `uneven` where the replicas' shares differ (set_shares refuses them to a layout with its own)."""
    own = getattr(parallel, "step_variant", None)
    if own is None:
        return STEPS["uneven"] if uneven else accumulated if accumulation > 1 else plain
    if own not in STEPS:
        raise ValueError(f"{type(parallel).__name__}.step_variant is {own!r}: the step variants are {sorted(STEPS)}")
    return STEPS[own]
