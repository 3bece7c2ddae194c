"""A step whose loss or gradient norm is NaN or Inf: find where it first went wrong."""

from __future__ import annotations

import torch
from torch import nn


class NonFiniteStep(RuntimeError):
    """A step's loss or gradient norm was NaN or Inf, and the job says to stop (fault.on_nan)."""


def first_non_finite_module(model: nn.Module, forward) -> str | None:
    """Run `forward()` (the step's forward again, same seed) with a hook on every module; the
    first module (in call order) whose output holds a NaN or Inf. Only after a bad step, so it
    costs nothing otherwise. Every rank runs it (they all saw the same norm), so a sharded
    forward's collectives match."""
    from torch.distributed.tensor import DTensor

    found: list[str] = []
    names = {m: n for n, m in model.named_modules()}

    def check(module, args, output):
        if found:
            return
        for t in output if isinstance(output, (tuple, list)) else (output,):
            if isinstance(t, DTensor):
                t = t.to_local()
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
                found.append(names.get(module) or type(module).__name__)
                return

    hooks = [m.register_forward_hook(check) for m in model.modules() if m is not model]
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else None


def non_finite_step(step: int, loss: torch.Tensor, norm: torch.Tensor | None, layer: str | None, stop: bool,
                    on_device: bool = False) -> dict:
    """The record of a skipped step, or NonFiniteStep when the job says to stop (fault.on_nan).
    `on_device`: the device skipped the update itself (a fused optimizer took the step's found-inf
    flag), and the flag was read with the step's report: `step` is then the step counted from 1,
    the gradient norm was not computed and no forward pass looked for the layer."""
    number = step if on_device else step + 1
    found = {"step": number, "loss": float(loss.detach()), "grad_norm": None if norm is None else float(norm),
             "layer": layer}
    if on_device:
        found["checked"] = "on the device (optimizer.fused): the first non-finite layer is not looked for"
    if stop:
        where = layer or ("not looked for (the step was checked on the device)" if on_device
                          else "not found in a forward pass")
        raise NonFiniteStep(f"step {number}: loss {found['loss']}, gradient norm {found['grad_norm']}; the "
                            f"first non-finite output was {where} (fault.on_nan = stop)")
    return found
