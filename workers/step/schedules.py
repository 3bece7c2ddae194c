"""Learning-rate schedules: the learning rate of the s-th update (1-based) of a run of T updates.

The rate is a function of the step alone, so its position survives checkpoints, resume,
switches and recovery with nothing to save: a restored worker is at step s, so at lr(s).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from gearshift.workers.build.components import ComponentError, _on_path, resolve


def builtin(name: str, step: int, total: int, base_lr: float, warmup: int, min_ratio: float) -> float:
    """constant, linear or warmup_cosine: lr * s / W for s <= W, then flat, or decaying linearly
    or along a half cosine to min_ratio * lr at s = T."""
    if warmup and step <= warmup:
        return base_lr * step / warmup
    if name == "constant" or total <= warmup:
        return base_lr
    done = min(1.0, (step - warmup) / (total - warmup))
    if name == "linear":
        return base_lr * (1.0 - (1.0 - min_ratio) * done)
    if name == "warmup_cosine":
        return base_lr * (min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * done)))
    raise ValueError(f"unknown schedule {name!r}")


def check_user_schedule(entrypoint: str, base_lr: float, total: int, search_paths: Iterable[str]) -> None:
    """A user's schedule resolves, and gives a finite, non-negative rate at the first and last step."""
    fn = resolve("optimizer.schedule.name", entrypoint, search_paths)
    for step in (1, total):
        try:
            with _on_path(search_paths):
                lr = fn(step, total, base_lr)
        except Exception as err:
            raise ComponentError("optimizer.schedule.name", entrypoint,
                                 f"calling it with (step={step}, total_steps={total}, base_lr={base_lr:g}) failed: "
                                 f"{type(err).__name__}: {err}") from None
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr < 0:
            raise ComponentError("optimizer.schedule.name", entrypoint,
                                 f"must return a finite learning rate >= 0; at step {step} it returned {lr!r}")


def build(spec: dict, base_lr: float, total: int, search_paths: Iterable[str] = ()) -> Callable[[int], float]:
    """lr(step) for the job's `optimizer.schedule`."""
    name, warmup, min_ratio = spec["name"], spec["warmup_steps"], spec["min_lr_ratio"]
    if ":" in name:
        fn = resolve("optimizer.schedule.name", name, search_paths)
        return lambda step: float(fn(step, total, base_lr))
    builtin(name, 1, total, base_lr, warmup, min_ratio)  # an unknown name fails here, not mid-run
    return lambda step: builtin(name, step, total, base_lr, warmup, min_ratio)
