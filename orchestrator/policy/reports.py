"""Rules 2 and 3 of the adaptive policy (adaptive.py's doc): what no switch mends, said and not
acted on. A run bound by its input (rule 2) or waiting on one slow rank (rule 3) would show a high
comm wait that a larger tp does not cut; each is reported instead, once per `cooldown` steps."""

from __future__ import annotations

from collections import Counter
from statistics import fmean, median

from gearshift.orchestrator.policy.decisions import KEEP, AdaptConfig, Decision, Report
from gearshift.orchestrator.policy.standing import Standing


class Said:
    """The reports a rule has made: the same one again (kind and rank) within `cooldown` steps is
    a Keep, as repeating it every window is noise."""

    def __init__(self, cooldown: int):
        self.cooldown, self.last = cooldown, {}  # (kind, rank) -> step of the last report

    def report(self, kind: str, rank: int | None, evidence: dict, step: int) -> Decision:
        last = self.last.get((kind, rank))
        if last is not None and step - last < self.cooldown:
            return KEEP  # said already; repeating every window is noise
        self.last[(kind, rank)] = step
        return Report(kind, evidence)


class InputBound:
    """Time in data loading above `input_bound_frac` of the step: Report("input_bound")."""

    def __init__(self, config: AdaptConfig):
        self.config, self.said = config, Said(config.cooldown)

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        c = self.config
        if means["data_frac"] <= c.input_bound_frac:
            return None
        return self.said.report("input_bound", None, {**means, "input_bound_frac": c.input_bound_frac}, step)


def find_straggler(window: list[dict], c: AdaptConfig) -> dict | None:
    """The rank that, in most steps, computes > straggler_ratio x the others while they wait on it."""
    hits: Counter = Counter()
    ratios: dict[int, list[float]] = {}
    for r in window:
        comp, frac = r["ranks"].get("compute_time"), r["ranks"].get("comm_wait_frac")
        if not comp or not frac or len(comp) < 2:
            continue
        slow = max(range(len(comp)), key=comp.__getitem__)
        others, waits = comp[:slow] + comp[slow + 1:], frac[:slow] + frac[slow + 1:]
        ratio = comp[slow] / median(others) if median(others) > 0 else float("inf")
        # the others' wait is high and the slow rank's low: they wait for it, not for the network
        if ratio > c.straggler_ratio and fmean(waits) > c.threshold and frac[slow] < fmean(waits) / 2:
            hits[slow] += 1
            ratios.setdefault(slow, []).append(ratio)
    if not hits:
        return None
    rank, n = hits.most_common(1)[0]
    if n <= len(window) / 2:
        return None
    return {"rank": rank, "steps_flagged": n, "compute_ratio": fmean(ratios[rank])}


class Straggler:
    """One rank computing much longer while the others wait on it: Report("straggler"), per rank."""

    def __init__(self, config: AdaptConfig):
        self.config, self.said = config, Said(config.cooldown)

    def __call__(self, st: Standing, window: list[dict], means: dict, step: int) -> Decision | None:
        c = self.config
        slow = find_straggler(window, c)
        if slow is None:
            return None
        evidence = {**means, **slow, "straggler_ratio": c.straggler_ratio}
        return self.said.report("straggler", slow["rank"], evidence, step)
