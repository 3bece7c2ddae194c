"""Mixed-precision phases: the first `fp32_warmup_steps` updates in fp32, then autocast to bf16
or fp16, with the modules named by `keep_fp32` (embeddings, norms: where reduced precision hurts
most) computing in fp32 throughout; and the last `fp32_final_steps` updates in fp32 again, the
whole model or (with `final_fp32`) the modules named there, such as the head."""

from __future__ import annotations

import fnmatch
import functools
from typing import Iterable

import torch
from torch import nn

from gearshift.workers.build.components import ComponentError, model_for_checks


def matching(model: nn.Module, patterns: Iterable[str]) -> dict[str, list[str]]:
    """pattern -> the module names it matches (shell-style, `*` matches across dots)."""
    names = [n for n, _ in model.named_modules() if n]
    return {p: [n for n in names if fnmatch.fnmatchcase(n, p)] for p in patterns}


def check_patterns(model_spec: dict, patterns: list[str], search_paths: Iterable[str] = (),
                   field: str = "keep_fp32") -> None:
    """Every pattern matches a module of the model (built on the meta device: no memory)."""
    model, _ = model_for_checks(model_spec, search_paths)
    for pattern, names in matching(model, patterns).items():
        if not names:
            some = [n for n, _ in model.named_modules() if n][:20]
            raise ComponentError(f"train.precision.{field}", pattern, "matches no module of the model; modules are: "
                                 + ", ".join(some) + (" ..." if len(some) == 20 else ""))


def keep_fp32(model: nn.Module, patterns: Iterable[str], device_type: str) -> list[str]:
    """Make the matching modules compute in fp32 under autocast (their floating inputs are cast
    up; integer inputs such as token ids pass as they are). Returns the names kept."""
    kept = sorted({n for names in matching(model, patterns).values() for n in names})
    modules = dict(model.named_modules())
    for name in kept:
        module = modules[name]
        module.forward = _in_fp32(module.forward, device_type)
    return kept


def final(step: int, cfg) -> bool:
    """Whether update `step` (0-based) is one of the last fp32_final_steps of the run."""
    return bool(cfg.fp32_final_steps) and step >= cfg.total_steps - cfg.fp32_final_steps


def autocast_on(step: int, cfg) -> bool:
    """Autocast for update `step`: after the fp32 warm-up, and not in a final fp32 phase that
    covers the whole model."""
    return step >= cfg.fp32_warmup_steps and not (final(step, cfg) and not cfg.final_fp32)


def fp32_when(model: nn.Module, patterns: Iterable[str], device_type: str, active) -> list[str]:
    """Make the matching modules compute in fp32 under autocast while `active()` is true (the
    final fp32 phase). Returns the names switched."""
    named = sorted({n for names in matching(model, patterns).values() for n in names})
    modules = dict(model.named_modules())
    for name in named:
        module = modules[name]
        module.forward = _in_fp32_if(module.forward, _in_fp32(module.forward, device_type), active)
    return named


def _in_fp32_if(forward, in_fp32, active):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        return (in_fp32 if active() else forward)(*args, **kwargs)

    return run


def _in_fp32(forward, device_type: str):
    @functools.wraps(forward)
    def run(*args, **kwargs):
        up = lambda t: t.float() if isinstance(t, torch.Tensor) and t.is_floating_point() else t  # noqa: E731
        with torch.autocast(device_type, enabled=False):
            return forward(*(up(a) for a in args), **{k: up(v) for k, v in kwargs.items()})

    return run
