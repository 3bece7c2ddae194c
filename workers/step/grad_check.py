"""Gradient anomalies with a diagnosis (`train.grad_check: {every: N, explode_ratio: R}`).

On every N-th update, after backward (and the layout's gradient averaging) and before clipping
and the optimizer, each parameter's gradient norm is computed: a sum of squares on each rank, one
all-reduce per way of sharding (over the mesh dimensions a DTensor is sharded on; a replicated
gradient needs none), so every rank holds the same whole norms. A parameter whose norm is NaN or
Inf, or more than R times the median of its own earlier checked norms (at least three of them),
is an anomaly. The first one in the model's order is reported, naming the module and the
parameter, with what the evidence supports:

- a weight (of a Linear, a convolution, an embedding): its initial range (the std it had at
  build) and the learning rate in force;
- a bias, or a normalisation's parameter: a normalisation before the layer, or a lower rate;
- under fp16: the loss scale at the last checks (a scale that climbs then crashes points at
  overflowing activations, not at the data);
- a spike that comes with the batch (the step's loss more than twice the median of the checked
  steps' losses): the indices of the batch's samples on this rank.

Every rank computes the same norms; rank 0's report carries the record.
"""

from __future__ import annotations

import collections
import math
import statistics

import torch
import torch.distributed as dist
from torch import nn

HISTORY = 20  # checked norms kept per parameter for the median


class GradCheck:
    def __init__(self, spec: dict, model: nn.Module):
        self.every = int(spec.get("every", 1))
        self.ratio = float(spec.get("explode_ratio", 100.0))
        self.norms: dict[str, collections.deque] = {}
        self.losses: collections.deque = collections.deque(maxlen=HISTORY)
        self.scales: collections.deque = collections.deque(maxlen=5)
        self.init_std = {n: _std(p) for n, p in model.named_parameters()}
        self.found: list[dict] = []

    def due(self, step: int) -> bool:
        return (step + 1) % self.every == 0

    def check(self, step: int, model: nn.Module, loss: torch.Tensor, lr: float, scaler, samples) -> None:
        """Check update `step` (0-based); an anomaly is kept for the next report."""
        norms = param_norms(model)
        scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else None
        if scale:
            norms = {n: v / scale for n, v in norms.items()}
            self.scales.append(scale)
        loss_now = float(loss.detach().float())
        found = None
        for name, value in norms.items():
            past = self.norms.setdefault(name, collections.deque(maxlen=HISTORY))
            median = statistics.median(past) if len(past) >= 3 else None
            if found is None and not math.isfinite(value):
                found = (name, value, median, "nonfinite")
            elif found is None and median and value > self.ratio * median:
                found = (name, value, median, "explode")
            if math.isfinite(value):
                past.append(value)
        loss_median = statistics.median(self.losses) if len(self.losses) >= 3 else None
        if math.isfinite(loss_now):
            self.losses.append(loss_now)
        if found is None:
            return
        name, value, median, kind = found
        module_name, _, param = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        spike = loss_median is not None and (not math.isfinite(loss_now) or loss_now > 2 * loss_median)
        self.found.append({
            "step": step + 1, "kind": kind, "module": module_name or "(model)", "module_type": type(module).__name__,
            "parameter": param, "norm": value if math.isfinite(value) else str(value),
            "median": median, "ratio": (value / median) if median and math.isfinite(value) else None,
            "loss": loss_now if math.isfinite(loss_now) else str(loss_now), "lr": lr,
            "suggestions": suggestions(module, param, lr, self.init_std.get(name), list(self.scales), spike, samples,
                                       loss_now, loss_median),
            "samples": list(samples) if spike else None})

    def take(self) -> list[dict]:
        found, self.found = self.found, []
        return found


def _std(p) -> float | None:
    """The std of this rank's part of a parameter (the whole one, unsharded)."""
    from torch.distributed.tensor import DTensor

    local = p.to_local() if isinstance(p, DTensor) else p
    return float(local.detach().float().std()) if local.numel() > 1 and not local.is_meta else None


def param_norms(model: nn.Module) -> dict[str, float]:
    """Every parameter's whole gradient norm (0 without a gradient), the same on every rank."""
    from torch.distributed.tensor import DTensor

    names, squares, groups = [], [], {}
    for name, p in model.named_parameters():
        g = p.grad
        local = g.to_local() if isinstance(g, DTensor) else g
        names.append(name)
        squares.append(local.detach().float().pow(2).sum() if local is not None else torch.zeros((), device=p.device))
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            if dims:
                groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(len(names) - 1)
    if not names:
        return {}
    vec = torch.stack(squares)
    for mesh, dims, members in groups.values():
        part = vec[members].clone()
        for d in dims:
            dist.all_reduce(part, group=mesh.get_group(d))
        vec[members] = part
    return {n: math.sqrt(v) if math.isfinite(v) else v for n, v in zip(names, vec.tolist())}


_NORMS = (nn.LayerNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.GroupNorm, nn.RMSNorm)


def suggestions(module: nn.Module, param: str, lr: float, init_std, scales: list, spike: bool, samples,
                loss: float, loss_median) -> list[str]:
    out = []
    if isinstance(module, _NORMS):
        out.append(f"a normalisation's {param}: the activations coming into {type(module).__name__} grew; lower the "
                   f"learning rate (now {lr:.3g}) or normalise earlier in the model")
    elif param == "bias":
        out.append(f"a bias: add a normalisation before this layer or lower the learning rate (now {lr:.3g})")
    else:
        init = f" (it started with std {init_std:.3g})" if init_std else ""
        out.append(f"a weight: check its initial range{init}, or lower the learning rate (now {lr:.3g})")
    if scales:
        out.append("under fp16: the loss scale at the last checks was " + ", ".join(f"{s:g}" for s in scales)
                   + " (a scale that climbs and then collapses means overflowing activations, not bad data)")
    if spike:
        out.append(f"the loss jumped with this batch ({loss:.4g} against a median of {loss_median:.4g}): look at its "
                   f"samples {list(samples)[:16]}{' ...' if len(list(samples)) > 16 else ''} "
                   "(gearshift inspect data JOB --step N)")
    return out
