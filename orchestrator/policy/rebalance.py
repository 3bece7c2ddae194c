"""Stragglers (adapt.stragglers): a data-parallel replica that computes slower than the others,
found from the step records, and the global batch's shares moved to match the speeds.

Every rank already reports its compute time (the step less its comm wait and data time). Over a
window of steps, replica j's compute time is the median of its slowest rank's (a tensor-parallel
group computes together), and its speed its samples over that time. The shares that would make
every replica compute as long come from a line per replica (`fixed + per_sample x n`, through
the windows before and after the last move) or, with no sound line, from the speeds' proportions,
in whole samples (`balanced`, `proportional`). A rebalance is decided where the predicted cut of
the step's compute beats `min_gain` and the noise of the window's medians, in the whole window
and in each of its halves, so an even run's jitter moves nothing, and a straggler that recovers
gets its samples back by the same rule. Pure: no Ray, no torch.distributed; the controller
carries a `Rebalance` out with `TrainWorker.set_shares` where the workers stop for it
(workers/step/shares.py keeps the update exact), and `gearshift simulate` runs the same rule on
the cost model's records.

Under `drop` a replica that no share can make fast enough is let go instead (`DropRule`): one
slower than `adapt.straggler_drop_ratio` times the fastest in the window and in each of its
halves, or one whose fixed part of the step (the update, per-layer costs a share does not shrink)
holds the step back so that the others alone are predicted faster by past the noise. The
controller carries a `Drop` out through the elastic shrink (orchestrator/control/stragglers.py)
and takes the device back after a hold-out.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Callable, ClassVar

from gearshift.orchestrator.policy.decisions import Report
from gearshift.workers.step.shares import SharesError, even, micro_batches

WINDOW = 10     # steps of compute times a decision is taken over
SETTLE = 2      # steps left out after new shares (the loaders open again at their new slices)
MIN_GAIN = 0.05  # least predicted cut of the step's compute time that moves the shares
MODES = ("rebalance", "drop", "report", "off")
DROP_RATIO = 3.0  # adapt.straggler_drop_ratio's default


@dataclass(frozen=True)
class Rebalance:
    shares: tuple[int, ...]
    evidence: dict
    name: ClassVar[str] = "rebalance"

    def to_dict(self) -> dict:
        return {"decision": self.name, "shares": list(self.shares), "evidence": self.evidence}


@dataclass(frozen=True)
class Drop:
    """Let the replicas `replicas` (ranks `ranks`) go: the others train on."""
    replicas: tuple[int, ...]
    ranks: tuple[int, ...]
    evidence: dict
    name: ClassVar[str] = "drop"

    def to_dict(self) -> dict:
        return {"decision": self.name, "ranks": list(self.ranks), "replicas": list(self.replicas),
                "evidence": self.evidence}


@dataclass
class Replicas:
    """Which ranks compute replica j's share, and where they run (for the record)."""
    dp: int
    ranks: list[list[int]]  # per replica, its ranks (a tensor-parallel group)
    world: int = 0
    where: list[dict] = field(default_factory=list)  # per rank: {"node": ..., "device": ...}

    @classmethod
    def of(cls, layout, infos: list[dict] | None = None) -> Replicas:
        ranks: list[list[int]] = [[] for _ in range(layout.dp)]
        for r in range(layout.dp * layout.tp):
            ranks[layout.dp_rank(r)].append(r)
        where = [{"node": i.get("node_ip") or i.get("node_id"), "host": i.get("hostname"),
                  "device": i.get("device") or (f"gpu {','.join(map(str, i['gpu_ids']))}" if i.get("gpu_ids") else "cpu")}
                 for i in (infos or [])]
        return cls(layout.dp, ranks, layout.dp * layout.tp, where)

    def place(self, j: int) -> dict:
        first = self.ranks[j][0]
        return {"rank": first, **(self.where[first] if first < len(self.where) else {})}


def proportional(speeds: list[float], batch: int, micro_batch: int | None) -> tuple[int, ...]:
    """Whole samples in proportion to `speeds`, adding up to `batch` (largest remainders), each
    at least what the step's micro-batches need (shares.micro_batches)."""
    floor = 1
    while True:
        total = sum(speeds)
        exact = [batch * s / total for s in speeds]
        counts = [max(floor, int(e)) for e in exact]
        while sum(counts) > batch:  # the floors took samples: from the largest
            counts[max(range(len(counts)), key=counts.__getitem__)] -= 1
        order = sorted(range(len(counts)), key=lambda j: exact[j] - int(exact[j]), reverse=True)
        for j in order[:batch - sum(counts)]:
            counts[j] += 1
        try:
            micro_batches(counts, micro_batch)
            return tuple(counts)
        except SharesError:
            floor += 1
            if floor * len(speeds) > batch:
                return even(len(speeds), batch)


def balanced(fits: list[tuple[float, float]], batch: int, micro_batch: int | None) -> tuple[int, ...]:
    """Whole samples that make every replica's compute time alike, each replica's time fitted as
    `fixed + per_sample x n` (two windows at different shares give the line; a step's update and
    per-layer costs are the fixed part, which proportional shares would not see)."""
    inv = sum(1 / c for _, c in fits)
    level = (batch + sum(a / c for a, c in fits)) / inv  # the time every replica reaches
    wanted = [max(0.0, (level - a) / c) for a, c in fits]
    return proportional(wanted, batch, micro_batch)


class Rebalancer:
    """observe(record) -> Rebalance | Report | None, one step record at a time."""

    def __init__(self, mode: str, layout, batch: int, micro_batch: int | None, infos: list[dict] | None = None,
                 window: int = WINDOW, min_gain: float = MIN_GAIN, cooldown: int = 40, drop: DropRule | None = None):
        if mode not in MODES:
            raise ValueError(f"adapt.stragglers = {mode!r}: one of {', '.join(MODES)}")
        self.mode, self.batch, self.micro = mode, batch, micro_batch
        self.drop = drop if mode == "drop" else None
        self.window, self.min_gain, self.cooldown = window, min_gain, cooldown
        self.replicas = Replicas.of(layout, infos)
        self.shares = even(layout.dp, batch)
        self.steps: deque = deque(maxlen=3 * window)  # since the last move, up to three windows
        self.uneven: deque = deque(maxlen=window)  # per step: a replica computed past min_gain longer than another
        self.skip = 0
        self.slow_since: dict[int, int] = {}  # replica -> first step of its run of slowest steps
        self.said: dict[int, int] = {}  # report mode: replica -> step last reported
        self.check: dict | None = None  # the last rebalance, to measure once a window has run on it
        self.before: list[float] | None = None  # per replica, the compute time measured on the shares before
        self.shares_before: tuple[int, ...] | None = None
        self.moved_at = 0  # the step the last move took effect

    def applied(self, decision: Rebalance, step: int) -> None:
        """The workers took `decision`'s shares from step boundary `step` on."""
        self.before, self.shares_before = list(decision.evidence["compute_s"]), self.shares
        self.moved_at = step
        self.shares = decision.shares
        self.steps.clear()
        self.skip = SETTLE
        self.check = {"step": step, **{k: decision.evidence[k] for k in ("predicted_step_s", "measured_step_s")}}

    def observe(self, record: dict) -> Rebalance | Report | None:
        compute = (record.get("ranks") or {}).get("compute_time")
        if not compute or len(compute) < self.replicas.world or record.get("partial"):
            return None
        if self.skip:
            self.skip -= 1
            return None
        per = [max(compute[r] for r in ranks) for ranks in self.replicas.ranks]
        self._note_slowest(per, record["step"])
        self.steps.append((per, record["step_time_max"]))
        # under drop, speeds far apart count too: shares may already even out the compute times
        self.uneven.append(max(per) > (1 + self.min_gain) * min(per) or self.drop is not None and max(
            n / t for n, t in zip(self.shares, per)) >= self.drop.ratio * min(n / t for n, t in zip(self.shares, per)))
        if len(self.steps) < self.window:
            return None
        checked = self._checked(record["step"])
        if checked is not None:
            return checked
        # replicas that computed about as long in most of the last window's steps leave nothing
        # to gain (shares that match the speeds do that): no look at the medians, which over
        # many replicas costs more than a step's record
        if 2 * sum(list(self.uneven)[-self.window:]) < self.window:
            return None
        return self._decide(record["step"])

    def _note_slowest(self, per: list[float], step: int) -> None:
        slowest = max(range(len(per)), key=per.__getitem__)
        others = median([c for j, c in enumerate(per) if j != slowest]) if len(per) > 1 else per[0]
        if per[slowest] > (1 + self.min_gain) * others:
            self.slow_since.setdefault(slowest, step)
        for j in [j for j in self.slow_since if j != slowest or per[slowest] <= (1 + self.min_gain) * others]:
            del self.slow_since[j]

    def _fits(self, times: list[float], step: int | None) -> list[tuple[float, float]]:
        """Per replica (fixed s, s per sample): the line through the window before the last move
        and the steps since, for three windows after the move (`step` None: a speed changed
        since), where every replica's share changed and every line is sound (a fixed part of at
        most its time, a time a sample above zero: a speed that changed between the two windows
        makes one unsound); else through the origin, no fixed part, for all of them alike."""
        origin = [(0.0, t / n) for n, t in zip(self.shares, times)]
        if self.before is None or step is None or step - self.moved_at > 3 * self.window:
            return origin
        lines = []
        for n, t, n0, t0 in zip(self.shares, times, self.shares_before, self.before):
            c = (t - t0) / (n - n0) if n != n0 else 0.0
            if c <= 0 or not 0 <= t - c * n < t:
                return origin
            lines.append((t - c * n, c))
        return lines

    def _checked(self, step: int) -> Report | None:
        """Once a full window has run on new shares: the step measured against the one predicted."""
        if self.check is None:
            return None
        measured = median(t for _, t in self.steps)
        check, self.check = self.check, None
        error = measured / check["predicted_step_s"] - 1 if check["predicted_step_s"] > 0 else 0.0
        return Report("rebalanced", {"applied_step": check["step"], "measured_step_s_before": check["measured_step_s"],
                                     "predicted_step_s": check["predicted_step_s"], "measured_step_s": measured,
                                     "prediction_error": error, "shares": list(self.shares)})

    def _decide(self, step: int) -> Rebalance | Drop | Report | None:
        """The last `window` steps first (a new straggler shows at once); then every step since the
        last move, up to three windows (a small refinement shows once the noise of the medians is
        small enough). Under `drop`, a replica to let go comes before new shares."""
        looks = [list(self.steps)[-self.window:]] + ([list(self.steps)] if len(self.steps) > self.window else [])
        not_dropped = None
        for steps in looks:
            look = self._look(steps, step)
            if look is None:
                continue
            if self.drop is not None:
                gone, said = self.drop.choose(look, self.replicas, self.batch, self.micro)
                if gone is not None:
                    self.steps.clear()
                    said["since_step"] = self.slow_since.get(gone[0], step)
                    return Drop(gone, tuple(said["ranks"]), said)
                not_dropped = not_dropped or said.get("not_dropped")
            found = self._proposal(look)
            if found is not None:
                break
        else:
            return None
        after, evidence = found
        if not_dropped:
            evidence["not_dropped"] = not_dropped
        self.steps.clear()
        if self.mode == "report":
            slow = evidence["replica"]
            if step - self.said.get(slow, -self.cooldown) < self.cooldown:
                return None
            self.said[slow] = step
            return Report("straggler", evidence)
        return Rebalance(after, evidence)

    def _look(self, steps: list, step: int) -> dict | None:
        """What a window of steps says: each replica's median compute time, speed and line, the
        noise of the medians, and the shares that would even the replicas out."""
        cols = list(zip(*(per for per, _ in steps)))
        times = [median(c) for c in cols]
        if min(times) <= 0:
            return None
        # twice the noise of a half-window's median: a replica's spread (interquartile range over
        # median) over the square root of the half-window's steps, the largest over the replicas
        spread = max((quantile(c, 0.75) - quantile(c, 0.25)) / median(c) for c in cols)
        noise = 2 * spread / math.sqrt(len(cols[0]) / 2)
        half = len(steps) // 2
        halves = [[median(c[:half]) for c in cols], [median(c[half:]) for c in cols]]
        # a line through the window before the last move only while the speeds hold: where the
        # halves of this one differ past the noise, a speed changed (a recovery) since
        steady = all(abs(a - b) <= noise * max(a, b) for a, b in zip(*halves))
        fits = self._fits(times, step if steady else None)
        after = balanced(fits, self.batch, self.micro)
        return {"step": step, "times": times, "noise": noise, "halves": halves, "fits": fits, "after": after,
                "speeds": [n / t for n, t in zip(self.shares, times)], "shares": self.shares,
                "predicted_compute": max(a + c * n for n, (a, c) in zip(after, fits)),
                "step_s": median(t for _, t in steps), "window_steps": len(steps)}

    def _proposal(self, look: dict) -> tuple[tuple[int, ...], dict] | None:
        times, halves, after, speeds = look["times"], look["halves"], look["after"], look["speeds"]
        gain = 1 - look["predicted_compute"] / max(times)
        # each half of the window must show the gain on its own: a slow replica stays slow, while
        # jitter that lifts one replica's median in a window seldom does in both of its halves
        least = min(1 - max(t / n * m for t, n, m in zip(h, self.shares, after)) / max(h) for h in halves)
        if after == self.shares or min(gain, least) <= max(self.min_gain, look["noise"]):
            return None
        slow = min(range(len(speeds)), key=speeds.__getitem__)
        # shares that move back towards even once the slow replica is as fast as the others again
        reason = "straggler" if max(speeds) / speeds[slow] > 1 + self.min_gain else "recovered"
        return after, {"reason": reason, **self.replicas.place(slow), "replica": slow,
                       "speed_ratio": max(speeds) / speeds[slow], "since_step": self.slow_since.get(slow, look["step"]),
                       "speeds": speeds, "compute_s": times, "shares_before": list(self.shares),
                       "shares_after": list(after), "noise": look["noise"], "min_gain": self.min_gain,
                       "predicted_gain": gain, "window_steps": look["window_steps"],
                       "measured_step_s": look["step_s"],
                       "predicted_step_s": look["step_s"] - (max(times) - look["predicted_compute"])}


class DropRule:
    """adapt.stragglers drop: which replicas to let go, if any. A replica past `ratio` times
    slower than the fastest (in the window and in each of its halves) goes; so do the slowest
    replicas whose going is predicted to cut the step's compute past the noise against the best
    shares for all (their fixed part of the step holds it back whatever their share). `allowed`
    (ranks -> None, or why they may not go) is the run's own limit: the elastic shrink's."""

    def __init__(self, ratio: float, allowed: Callable[[list[int]], str | None], min_gain: float = MIN_GAIN):
        self.ratio, self.allowed, self.min_gain = ratio, allowed, min_gain

    def choose(self, look: dict, replicas: Replicas, batch: int, micro: int | None) -> tuple[tuple[int, ...] | None, dict]:
        """(the replicas to let go, or None; the evidence: why not, where some would have gone)."""
        speeds, fits = look["speeds"], look["fits"]
        ratio_of = [max(speeds) / s for s in speeds]
        in_halves = [[n / t for n, t in zip(look["shares"], h)] for h in look["halves"]]
        order = sorted(range(len(speeds)), key=speeds.__getitem__)  # the slowest first
        over = tuple(j for j in order if ratio_of[j] >= self.ratio
                     and all(max(hs) / hs[j] >= self.ratio for hs in in_halves))
        candidates = ([("ratio", over)] if over and len(over) < len(speeds) else []) + \
            [("holds", tuple(order[:k])) for k in range(1, len(order))]
        refused = None
        for rule, gone in candidates:
            rest = [fits[j] for j in range(len(speeds)) if j not in gone]
            shares = balanced(rest, batch, micro)
            without = max(a + c * n for n, (a, c) in zip(shares, rest))
            if rule == "holds" and without > look["predicted_compute"] * (1 - max(self.min_gain, look["noise"])):
                continue
            ranks = sorted(r for j in gone for r in replicas.ranks[j])
            evidence = self._evidence(look, replicas, rule, gone, ranks, without)
            why = self.allowed(ranks)
            if why is None:
                return gone, evidence
            refused = refused or f"replica(s) {list(gone)} ({rule}): {why}"
        return None, ({"not_dropped": refused} if refused else {})

    def _evidence(self, look: dict, replicas: Replicas, rule: str, gone: tuple, ranks: list[int],
                  without: float) -> dict:
        speeds, step_s, longest = look["speeds"], look["step_s"], max(look["times"])
        slow = gone[0]
        return {"reason": "straggler", "rule": rule, **replicas.place(slow), "replica": slow, "ranks": ranks,
                "where": [replicas.place(j) for j in gone], "speed_ratio": max(speeds) / speeds[slow],
                "drop_ratio": self.ratio, "speeds": speeds, "compute_s": look["times"],
                "shares_before": list(look["shares"]), "noise": look["noise"], "window_steps": look["window_steps"],
                "measured_step_s": step_s,
                "predicted_step_s": step_s - (longest - without),
                "predicted_step_s_rebalanced": step_s - (longest - look["predicted_compute"])}


def quantile(xs, q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)
