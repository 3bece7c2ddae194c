"""Stragglers under a pipeline (adapt.stragglers): a stage that computes slower than the others
holds every micro-batch back, so its blocks are moved to the faster stages at the next boundary
(Malleus's move), the same state moved between the stages as in a switch.

Every rank reports its compute time (its step less its comm wait, which under a pipeline holds
its bubble and its link wait, and its data time). Over a window of steps, position p's time is
the median of its slowest rank's (the pipeline's replicas and tensor-parallel ranks of a stage
compute together). Its speed is the weight its stages hold (their blocks' parameters, the code
before the first block and after the last counted half each to the first and the last stage, as
the balanced cut counts them) over that time. The new cut is the one whose slowest stage is
fastest at those speeds (strategies/pipeline/cut.py `balanced`), taken where the predicted cut of
the slowest position's time beats `min_gain` and the noise of the medians, in the window and in
each of its halves, and where it pays as a grow or a switch must: the step's predicted gain over
the steps left beats (1 + margin) x what a recut costs. A recut moves only the blocks that change
position (strategies/pipeline/moves.py), so its cost is priced by what moves: the weight of those
blocks (their parameters, whose bytes and optimizer state cross the link) at the seconds per unit
of weight the run's recuts took, measured; two steps before any is measured. The speeds are per parameter: a stage whose blocks compute more per parameter
reads as slower and gets fewer blocks, which is the same move. Pure: the controller carries a
`Recut` out with `TrainWorker.recut` where the workers stop for it.

What was measured beats what is modelled: each cut the run was on keeps the step measured on it,
and no move goes back to a cut whose step was no faster than the one in force now, while the
positions' speeds (against the fastest's) on the cut in force stay within a quarter of what
they were in its first window. A stage whose slowness is a share of its device (a noisy
neighbour, a CPU quota) computes at full speed again once it has less work than its share:
priced per parameter it would look fast and get its blocks back, and lose them again a window
later. Once a speed moves further on the cut in force (a device recovered, or slowed), what the
other cuts measured is forgotten.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import ClassVar

from gearshift.orchestrator.policy.decisions import AdaptConfig, Report
from gearshift.orchestrator.policy.rebalance import MIN_GAIN, SETTLE, WINDOW, quantile
from gearshift.strategies.pipeline.cut import balanced


@dataclass(frozen=True)
class Recut:
    """The pipeline cut again at `split` (the first block of every stage after the first)."""
    split: tuple[str, ...]
    starts: tuple[int, ...]
    evidence: dict
    name: ClassVar[str] = "recut"

    def to_dict(self) -> dict:
        return {"decision": self.name, "split": list(self.split), "evidence": self.evidence}


RECOVERED = 0.25  # a position's speed against the fastest's, moved by this share: the devices changed


class StageBalancer:
    """observe(step record) -> Recut | Report | None, one record at a time. `cut`: what
    TrainWorker.pipeline_cut says (blocks, weights, rest, starts)."""

    def __init__(self, mode: str, layout, cut: dict, infos: list[dict] | None = None, window: int = WINDOW,
                 min_gain: float = MIN_GAIN, cooldown: int = 40, total_steps: int | None = None,
                 margin: float = AdaptConfig.switch_margin):
        self.mode, self.window, self.min_gain, self.cooldown = mode, window, min_gain, cooldown
        self.total_steps, self.margin = total_steps, margin  # a recut's gain over the steps left pays its cost
        self.recuts_s: list[float] = []  # what the run's recuts took, measured (TrainWorker.recut's seconds)
        self.recut_rates: list[float] = []  # those seconds per unit of the weight each moved
        self.pp = layout.pp
        self.ranks = [[r for r in range(layout.world) if layout.stage_of(r) == p] for p in range(self.pp)]
        self.where = [{"rank": rs[0], "node": (infos or [{}] * layout.world)[rs[0]].get("node_ip")}
                      for rs in self.ranks]
        self.blocks, self.weights, self.rest = list(cut["blocks"]), list(cut["weights"]), cut["rest"]
        self.starts = tuple(cut["starts"])
        self.steps: deque = deque(maxlen=window)
        self.skip = 0
        self.said = -cooldown
        self.check: dict | None = None
        self.measured: dict[tuple, float] = {}  # cut -> the median step measured on it
        self.history: list[list[tuple[float, float]]] = [[] for _ in range(self.pp)]  # position -> (load, speed)
        self.arrived: list[float] | None = None  # the speeds of the first window on the cut in force
        self.unallocated: set[tuple] = set()  # cuts some rank could not allocate: never proposed again

    def loads(self, starts) -> list[float]:
        """Each position's weight under the cut `starts` (a position runs stages p, p + pp, ...)."""
        ends = list(starts[1:]) + [len(self.blocks)]
        per_stage = [sum(self.weights[a:b]) for a, b in zip(starts, ends)]
        per_stage[0] += self.rest // 2
        per_stage[-1] += self.rest - self.rest // 2
        out = [0.0] * self.pp
        for k, w in enumerate(per_stage):
            out[k % self.pp] += w
        return out

    def applied(self, decision: Recut, step: int) -> None:
        if decision.evidence.get("seconds") is not None:
            self.recuts_s.append(decision.evidence["seconds"])
            moved = decision.evidence.get("moved_weight") or 0
            if moved > 0:
                self.recut_rates.append(decision.evidence["seconds"] / moved)
        self.starts = decision.starts
        self.arrived = None
        self.steps.clear()
        self.skip = SETTLE
        self.check = {"step": step, "predicted_step_s": decision.evidence["predicted_step_s"],
                      "measured_step_s": decision.evidence["measured_step_s"]}

    def not_allocated(self, decision: Recut) -> None:
        """The recut `decision` ran out of memory on some rank (the old cut is in force, whole):
        that cut is not proposed again in this run; the window starts over."""
        self.unallocated.add(tuple(decision.starts))
        self.steps.clear()

    def observe(self, record: dict) -> Recut | Report | None:
        compute = (record.get("ranks") or {}).get("compute_time")
        if not compute or len(compute) < sum(map(len, self.ranks)) or record.get("partial"):
            return None
        if self.skip:
            self.skip -= 1
            return None
        self.steps.append(([max(compute[r] for r in rs) for rs in self.ranks], record["step_time_max"]))
        if len(self.steps) < self.window:
            return None
        steps, self.steps = list(self.steps), deque(maxlen=self.window)
        self._remember(steps)
        if self.check is not None:
            check, self.check = self.check, None
            measured = median(t for _, t in steps)
            return Report("recut_checked", {"applied_step": check["step"],
                                            "measured_step_s_before": check["measured_step_s"],
                                            "predicted_step_s": check["predicted_step_s"], "measured_step_s": measured,
                                            "prediction_error": measured / check["predicted_step_s"] - 1,
                                            "blocks_per_stage": _sizes(self.starts, len(self.blocks))})
        return self._decide(steps, record["step"])

    def _remember(self, steps: list) -> None:
        """The window's step on the cut in force; what other cuts measured is forgotten once a
        position's speed on this cut moved past the noise since its first window here."""
        cols = list(zip(*(per for per, _ in steps)))
        speeds = [w / median(c) if median(c) > 0 else 0.0 for w, c in zip(self.loads(self.starts), cols)]
        # the positions' speeds against the fastest's: a drift of the whole machine moves none
        shares = [v / max(speeds) for v in speeds] if max(speeds) > 0 else speeds
        if self.arrived is None:
            self.arrived = shares
        elif any(abs(v - a) > RECOVERED * a for v, a in zip(shares, self.arrived)):
            self.measured, self.arrived = {}, shares
            self.history = [[] for _ in range(self.pp)]
        self.measured[self.starts] = median(t for _, t in steps)
        for p, (load, v) in enumerate(zip(self.loads(self.starts), speeds)):
            self.history[p].append((load, v))

    def _cautious(self, loads: list[float], speeds: list[float]) -> list[float]:
        """Per position, how many times its time at `loads` is taken to be what its speed now
        gives: it computes no faster than it was measured to with as much work or less (a share
        of a device runs at full speed below its share and at the share's pace above it)."""
        return [speeds[p] / min([speeds[p]] + [v for seen, v in self.history[p] if seen <= load * (1 + 1e-9)])
                for p, load in enumerate(loads)]

    def _decide(self, steps: list, step: int) -> Recut | Report | None:
        cols = list(zip(*(per for per, _ in steps)))
        times = [median(c) for c in cols]
        if min(times) <= 0:
            return None
        spread = max((quantile(c, 0.75) - quantile(c, 0.25)) / median(c) for c in cols)
        noise = 2 * spread / math.sqrt(len(steps) / 2)
        loads = self.loads(self.starts)
        speeds = [w / t for w, t in zip(loads, times)]
        n = len(self.starts)
        starts = tuple(balanced(self.weights, n, self.rest // 2, self.rest - self.rest // 2,
                                speeds=[speeds[k % self.pp] for k in range(n)]))
        if starts == self.starts or starts in self.unallocated:
            return None
        before = self.measured.get(starts)
        if before is not None and before >= self.measured[self.starts] * (1 - self.min_gain):
            return None  # measured on that cut, and no faster: the model's speeds are not the devices'

        slower = self._cautious(self.loads(starts), speeds)
        after = [w / v * f for w, v, f in zip(self.loads(starts), speeds, slower)]
        half = len(steps) // 2
        gains = [1 - max(w / (lw / t) * f for w, lw, t, f in zip(self.loads(starts), loads, h, slower)) / max(h)
                 for h in ([median(c[:half]) for c in cols], [median(c[half:]) for c in cols])]
        gain = 1 - max(after) / max(times)
        if min(gain, *gains) <= max(self.min_gain, noise):
            return None
        step_s = median(t for _, t in steps)
        slow = min(range(self.pp), key=speeds.__getitem__)
        # a pipeline's step runs at its slowest position's pace: the step scales with it
        evidence = {"reason": "straggler" if max(speeds) / speeds[slow] > 1 + self.min_gain + noise else "balance",
                    **self.where[slow], "position": slow, "speed_ratio": max(speeds) / speeds[slow],
                    "speeds": speeds, "compute_s": times, "blocks_per_stage_before": _sizes(self.starts, len(self.blocks)),
                    "blocks_per_stage_after": _sizes(starts, len(self.blocks)), "predicted_gain": gain, "noise": noise,
                    "measured_step_s": step_s, "predicted_step_s": step_s * max(after) / max(times),
                    "window_steps": len(steps)}
        if self.mode == "report":
            if step - self.said < self.cooldown:
                return None
            self.said = step
            return Report("straggler", evidence)
        price = self._price(step_s, evidence["predicted_step_s"], step, self.moved_weight(starts))
        if not price["pays"]:
            return None
        return Recut(tuple(self.blocks[i] for i in starts[1:]), starts, {**evidence, **price})

    def moved_weight(self, starts) -> float:
        """The weight of the blocks whose position differs between the cut in force and `starts`:
        what a recut to `starts` sends (a block's parameters and their optimizer state)."""
        return sum(w for w, a, b in zip(self.weights, _positions(self.starts, len(self.blocks), self.pp),
                                        _positions(starts, len(self.blocks), self.pp)) if a != b)

    def _price(self, step_s: float, predicted_s: float, step: int, moved: float) -> dict:
        """Whether a recut predicted to take the step from `step_s` to `predicted_s` pays, as a grow
        or a switch is priced: its gain a step over the steps left must pay (1 + margin) x what a
        recut costs: the `moved` weight at the seconds per weight the run's recuts took (their
        median), else two steps, a switch's price before any is measured. Without a known end
        (total_steps None) every gain pays."""
        gain = step_s - predicted_s
        measured = bool(self.recut_rates)
        cost = median(self.recut_rates) * moved if measured else 2 * step_s
        left = None if self.total_steps is None else self.total_steps - step
        pays = gain > 0 and (left is None or gain * left > cost * (1 + self.margin))
        return {"pays": pays, "gain_s_per_step": gain, "steps_left": left, "recut_cost_s": cost,
                "recut_cost_measured": measured, "moved_weight": moved,
                "total_weight": sum(self.weights), "switch_margin": self.margin}


def _positions(starts, n: int, pp: int) -> list[int]:
    """Each block's position (the rank of the pipeline that runs it) under the cut `starts`: stage
    k runs on position k % pp."""
    ends = list(starts[1:]) + [n]
    return [k % pp for k, (a, b) in enumerate(zip(starts, ends)) for _ in range(a, b)]


def _sizes(starts, n: int) -> list[int]:
    return [b - a for a, b in zip(starts, list(starts[1:]) + [n])]
