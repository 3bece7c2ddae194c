"""What the policy's rules measure a window of merged step records by: its samples/s, the spread
of that rate, its means (comm wait, data time), and where its warm-up ends. Pure functions."""

from __future__ import annotations

import math
from statistics import fmean, median


def rate(window: list[dict]) -> float:
    # samples_per_s * step_time_max is the global batch: total samples / total wall time is
    # robust to a few outlier steps, where a mean of rates is not
    time = sum(r["step_time_max"] for r in window)
    return sum(r["samples_per_s"] * r["step_time_max"] for r in window) / time if time > 0 else 0.0


def past_warmup(window: list[dict], factor: float = 1.5, keep: int = 3) -> list[dict]:
    """The window from the first step that is not still warming up: leading steps slower than
    `factor` x the window's median step are left out (a build's first steps: compile, allocator
    and caches), keeping at least `keep` steps."""
    if len(window) <= keep:
        return window
    times = sorted(r["step_time_max"] for r in window)
    med, start = times[len(times) // 2], 0
    while start < len(window) - keep and window[start]["step_time_max"] > factor * med:
        start += 1
    return window[start:]


def rate_error(records: list[dict]) -> float:
    """The standard error of a run of steps' samples/s: the per-step rates' robust spread (1.4826
    x their median absolute deviation) over sqrt(n); 0 with fewer than 3 steps (no spread known)."""
    rates = [r["samples_per_s"] for r in records]
    if len(rates) < 3:
        return 0.0
    mid = median(rates)
    return 1.4826 * median(abs(x - mid) for x in rates) / math.sqrt(len(rates))


def window_means(window: list[dict]) -> dict:
    mean_time = sum(r["step_time_mean"] for r in window)
    return {
        "steps": [window[0]["step"], window[-1]["step"]],
        "comm_wait_frac": fmean(r["comm_wait_frac_mean"] for r in window),
        "comm_wait_s": fmean(r["comm_wait_mean"] for r in window),
        "step_time": sum(r["step_time_max"] for r in window) / len(window),
        "samples_per_s": rate(window),
        # the window's second half: what a switch is judged against, the link as it is now (a
        # window that straddles a change of the link would otherwise flatter the layout left)
        "samples_per_s_recent": rate(window[len(window) // 2:]),
        "data_frac": sum(r["data_time_mean"] for r in window) / mean_time if mean_time > 0 else 0.0,
    }
