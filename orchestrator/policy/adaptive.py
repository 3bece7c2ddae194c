"""The adaptive policy: watches merged step records and decides when to shift layouts.

Pure logic, no Ray and no torch.distributed: the controller feeds it every step record in
order (`observe`) and carries out what it returns; it tells the policy when a switch has
really happened (`switched`). Each decision carries the evidence that led to it.

Deciding by prediction (with an online model, `decide: predict`; orchestrator/online.py fits it
from the records): rules 1-3 below hold as they are; then
  P1. a change point in the per-step comm wait (`change_steps` steps beyond `change_factor` x its
      level, either way) is a decision at once, on the steps since the change; so is a window with
      the comm-wait fraction above `threshold` (outside the cooldown), and any window while a
      layout with less tensor parallelism exists (a review: the link may have got better);
  P2. every candidate that fits and is not held back is predicted (at each tp the least sharded
      that fits), each with its error (`OnlineModel.error`) counted against it; the best is
      switched to when its gain over the steps left pays (1 + `switch_margin`) x the switch's
      cost; otherwise Report("hold"), once per layout and link, with every prediction;
  P3. the move is judged as in rule 1, and its measured step checked against its prediction;
      `max_misses` predicted moves reverted in a row and the policy decides by trial (rules 4-6)
      for the rest of the run, saying so in the revert's evidence. A change point lifts every block.

Deciding by trial (`decide: trial`, no model, or after the fallback): rules evaluated once per
full window of steps on the current layout (after `settle`):
  1. after a switch, the first window judges it against the second half of the window that
     led to it: throughput not better -> Revert, and the layout is not retried for
     `retry_after` steps (doubled with each further revert of it). A trial that is clearly worse is cut short:
     after `early_check` steps, samples/s below (1 - `early_loss`) x before reverts at once;
  2. time in data loading above `input_bound_frac` -> Report("input_bound"), no switch;
  3. one rank computing much longer while the others wait on it -> Report("straggler"), no switch;
  4. mean comm-wait fraction above `threshold`, outside the cooldown -> Switch to the next
     candidate that is not blocked;
  5. (4 again) a reverted layout is not retried for `retry_after` steps, unless the wait has
     since grown past 1.5x the wait that first sent the policy there: the network got worse;
  6. the network got better: on a layout the policy moved to and kept, the comm wait in seconds
     fell below half of what it was when the layout was kept -> Switch back to the previous
     candidate, judged like any switch; once that is kept, the layout left is held back like a
     reverted one (rule 5), so the policy does not go straight back to it. Seconds, not the
     fraction: a layout whose own collectives (tensor parallelism inside a node) keep a high
     fraction still shows a faster link as a shorter wait. A steady network never triggers it.

Memory (`fits`, optional): a layout predicted not to fit the devices is never switched to; the
decision's evidence lists the candidates skipped for it (`skipped`: predicted bytes against the
device's). Sharded state (fsdp, hsdp, hybrid with dp_shard) moves more bytes than replicated state
at the same tp and only saves memory, so a move for comm wait goes to a larger tp, taking there the
least sharded layout that fits; without `fits` that is always the replicated one.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from statistics import fmean, median
from typing import ClassVar

from gearshift.orchestrator.policy.online import ChangePoint, Estimate, OnlineModel
from gearshift.strategies.layout import Layout

# null when telemetry is off: without them there is nothing to judge
TIMING_FIELDS = ("comm_wait_frac_mean", "comm_wait_mean", "data_time_mean", "compute_time_mean")


@dataclass(frozen=True)
class AdaptConfig:
    threshold: float = 0.15        # comm-wait fraction of the step that calls for a switch
    window: int = 20               # steps per evaluation
    cooldown: int = 40             # steps after a switch/revert before the next switch (and between repeated reports)
    settle: int = 3                # steps ignored after a switch: the first steps on a new layout pay warm-up
    retry_after: int = 400         # steps a reverted layout is not tried again
    early_check: int = 5           # steps into a trial (after settle) at which a clear loss reverts at once
    early_loss: float = 0.2        # "clear": samples/s below (1 - early_loss) x before
    min_gain: float = 0.0          # a switch is kept unless after < before * (1 + min_gain) - noise
    noise_sigmas: float = 2.0      # "noise": this many standard errors of the two rates' difference
    memory_threshold: float = 0.92  # peak memory / device memory in a window that calls for a lighter layout
    straggler_ratio: float = 1.5   # slow rank's compute time / median of the others
    input_bound_frac: float = 0.3  # data time / step time
    # deciding by prediction (with an online cost model; see the module's doc)
    decide: str = "predict"        # "predict", or "trial": try the next candidate and judge it
    predict_error: float = 0.05    # least relative error assumed of a prediction (more when moves measured more)
    unseen_error: float = 0.25     # relative error of a layout whose tp or sharding costs the run has not measured
    switch_margin: float = 1.0     # a move's predicted gain over the remaining steps must pay (1 + this) x its cost
    max_misses: int = 2            # predicted moves reverted in a row before the policy decides by trial
    change_factor: float = 1.5     # a change point: per-step comm wait beyond this factor of its level...
    change_steps: int = 3          # ...for this many steps in a row


@dataclass(frozen=True)
class Keep:
    evidence: dict = field(default_factory=dict)  # empty for "nothing to do"; set when a switch was judged and kept
    name: ClassVar[str] = "keep"

    def to_dict(self) -> dict:
        return {"decision": self.name, "evidence": self.evidence}


@dataclass(frozen=True)
class Switch:
    to: Layout
    evidence: dict
    name: ClassVar[str] = "switch"

    def to_dict(self) -> dict:
        return {"decision": self.name, "to": self.to.to_dict(), "evidence": self.evidence}


@dataclass(frozen=True)
class Revert:
    to: Layout
    evidence: dict
    name: ClassVar[str] = "revert"

    def to_dict(self) -> dict:
        return {"decision": self.name, "to": self.to.to_dict(), "evidence": self.evidence}


@dataclass(frozen=True)
class Report:
    kind: str  # "straggler" or "input_bound"
    evidence: dict
    name: ClassVar[str] = "report"

    def to_dict(self) -> dict:
        return {"decision": self.name, "kind": self.kind, "evidence": self.evidence}


Decision = Keep | Switch | Revert | Report
KEEP = Keep()


def candidate_layouts(world: int, node_sizes: list[int], tp_ok: Callable[[int], bool] = lambda tp: True,
                      sharded: bool = True) -> list[Layout]:
    """Layouts to try in order, data first, then ever larger node-local tensor-parallel groups;
    at each tp the replicated layout first, then (`sharded`) the same tp with sharded state.

    Ranks are contiguous per node and a tp group is tp consecutive ranks, so a tp that divides
    every node's size keeps every group inside one node: only the dp all-reduce (smaller by tp)
    crosses nodes. A tp that does not would put tensor-parallel collectives, the chattiest
    ones, on the slow link, so it is never offered. `tp_ok` lets the caller drop sizes the
    model cannot shard (heads, hidden size).

    Sharded state, least sharded first (more sharding: less memory, more traffic): at tp 1, hsdp
    with a node's workers as its shard group (two nodes or more, of equal size >= 2: a group
    must be one node, so its all-gathers stay on the fast link), then fsdp over all workers; at
    each hybrid tp, the hybrid with dp_shard. Strategies are named, not looked up: a caller
    keeps those its workers can run.
    """
    if sum(node_sizes) != world or min(node_sizes, default=0) < 1:
        raise ValueError(f"sum(node_sizes={node_sizes}) != world({world}) or a node has no worker")
    out = [Layout("data", world, 1)]
    if sharded and world > 1:
        if len(node_sizes) >= 2 and len(set(node_sizes)) == 1 and node_sizes[0] >= 2:
            out.append(Layout("hsdp", world, 1, node_sizes[0]))
        out.append(Layout("fsdp", world, 1, world))
    for tp in range(2, world + 1):
        if all(n % tp == 0 for n in node_sizes) and tp_ok(tp):
            # tp == world divides every node only when there is one node: that is plain tensor
            if tp == world:
                out.append(Layout("tensor", 1, tp))
                continue
            out.append(Layout("hybrid", world // tp, tp))
            if sharded:
                out.append(Layout("hybrid", world // tp, tp, world // tp))
    return out


Fits = Callable[[Layout], "tuple[bool, dict]"]  # layout -> (fits the devices, evidence: predicted and available bytes)


def _rate(window: list[dict]) -> float:
    # samples_per_s * step_time_max is the global batch: total samples / total wall time is
    # robust to a few outlier steps, where a mean of rates is not
    time = sum(r["step_time_max"] for r in window)
    return sum(r["samples_per_s"] * r["step_time_max"] for r in window) / time if time > 0 else 0.0


@dataclass(frozen=True)
class Trial:
    """A switch under judgement: the layout left, and its latest steps at the link as it was
    (`rate`: their samples/s, or the decision's figure when the policy had no steps of its own)."""
    layout: Layout
    before: list[dict]
    rate: float

    def steps(self) -> list[int] | None:
        return [self.before[0]["step"], self.before[-1]["step"]] if self.before else None


def _past_warmup(window: list[dict], factor: float = 1.5, keep: int = 3) -> list[dict]:
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
        "samples_per_s": _rate(window),
        # the window's second half: what a switch is judged against, the link as it is now (a
        # window that straddles a change of the link would otherwise flatter the layout left)
        "samples_per_s_recent": _rate(window[len(window) // 2:]),
        "data_frac": sum(r["data_time_mean"] for r in window) / mean_time if mean_time > 0 else 0.0,
    }


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


class PassedOver:
    """What the evidence says of a candidate that does not fit the devices; None when it fits
    (or memory is not judged). A prediction from the layout alone: the same every time, cached."""

    def __init__(self, fits: Fits | None):
        self.fits, self.cache = fits, {}

    def __call__(self, layout: Layout) -> dict | None:
        if self.fits is None:
            return None
        if layout not in self.cache:
            ok, said = self.fits(layout)
            self.cache[layout] = None if ok else {"layout": layout.to_dict(), **said}
        return self.cache[layout]


class Policy:
    def __init__(self, config: AdaptConfig, candidates: list[Layout], current: Layout, fits: Fits | None = None,
                 model: OnlineModel | None = None, total_steps: int | None = None,
                 memory: tuple[Callable[[Layout], float], int] | None = None):
        self.config = config
        self.memory = memory                   # (predicted bytes a rank needs under a layout, device bytes)
        self.model = model                     # the online cost model; None: decide by trial
        self.predicting = model is not None and config.decide == "predict"
        self.total_steps = total_steps         # None: a move is weighed over retry_after steps
        self._change = ChangePoint(config.change_factor, config.change_steps)
        self._recent: list[dict] = []          # the current layout's latest records (a change point's evidence)
        self._estimate: Estimate | None = None  # the prediction of the move on trial
        self._misses = 0                       # predicted moves reverted in a row
        self._held, self._first = False, True  # said that no move pays (this layout and link); no window judged yet
        self.candidates, self.current, self.fits = list(candidates), current, fits  # fits None: memory not judged
        self._passed_over = PassedOver(fits)
        self._skipped: list[dict] = []         # candidates the last move passed over for memory
        self.history: list[dict] = []          # every decision that is not a bare Keep, with its step
        self._window: list[dict] = []
        self._pending: Switch | Revert | None = None  # handed out, not yet carried out
        self._since: int | None = None         # step the current layout took over; None: from the start
        self._trial: Trial | None = None     # the switch being judged
        self._blocked: dict[Layout, int] = {}  # reverted layout -> first step it may be tried again
        # the comm-wait fraction that sent the policy to a layout later reverted (1.5x it lifts the block)
        self._blocked_wait: dict[Layout, float] = {}
        self._reported: dict[tuple, int] = {}  # (kind, rank) -> step of the last report
        self._reverts: Counter = Counter()     # layout -> reverts since it was last kept
        self._kept_wait: float | None = None  # comm wait (s per step) when the current layout was judged and kept
        self._trial_back = False               # the switch on trial is a step back (rule 6)
        self._rebase = False                   # measure _kept_wait again on the next window (resume_at)
        self._trial_wait: float | None = None  # comm-wait fraction of the window that led to the switch on trial

    def observe(self, record: dict) -> Decision:
        step = record["step"]
        if self._pending is not None or not self._on_current(record):
            return KEEP  # the switch is not done yet, or a late record from the old layout
        if any(record.get(f) is None for f in TIMING_FIELDS):
            return KEEP
        if self._since is not None and step <= self._since + self.config.settle:
            return KEEP
        self._window.append(record)
        self._recent = (self._recent + [record])[-self.config.window:]
        if self.predicting:
            decision = self._watch_link(record, step)
        else:  # deciding by trial: a change of the link only bounds what a trial is judged against
            decision = None
            if self._change.add(record["comm_wait_mean"], record["step_time_max"]) is not None:
                self._recent = self._recent[-self.config.change_steps:]
        if decision is not None:
            if not isinstance(decision, Keep):
                self.history.append({"step": step, **decision.to_dict()})
            return decision
        if self._early_look():
            decision = self._early(self._window, step)
            if decision is None:
                return KEEP
            self._window = []
        elif len(self._window) < self._size():
            return KEEP
        else:
            window, self._window, self._first = self._window, [], False
            decision = self._decide(window, step)
        if not isinstance(decision, Keep) or decision.evidence:
            self.history.append({"step": step, **decision.to_dict()})
        return decision

    def next_decision(self, step: int) -> int:
        """The first step after `step` at which a decision may come, with every record up to `step`
        observed: the controller ends its chunks there, so a decision is carried out on its step."""
        c = self.config
        need = (c.early_check if self._trial is not None and len(self._window) < c.early_check < c.window
                else self._size()) - len(self._window)
        begin = step if self._since is None else max(step, self._since + c.settle)
        return max(step + 1, begin + need)

    def switched(self, to: Layout, step: int, seconds: float | None = None) -> None:
        """The controller has carried out a switch (or revert, or a forced one) at `step`, in
        `seconds` (the online model learns a switch's cost from it). Call it with the layout in
        force: if a switch failed and the old layout stays, that one; the pending decision is cleared."""
        pending, self._pending = self._pending, None
        judged = isinstance(pending, Switch) and pending.to == to
        if judged and pending.evidence.get("reason") == "memory_pressure":
            judged, left = False, self.current  # kept whatever its speed: the layout left was near its memory
            self.candidates = [c for c in self.candidates if c != left]
        if self.model is not None and to != self.current:
            self.model.entered(to)
            self.model.switched(seconds)
        self._estimate = self._estimate if judged and "predicted_step_s" in pending.evidence else None
        self._change.reset()
        # judged against the old layout's latest steps at the link as it is (observe stops adding
        # records once a decision is out, so these are the steps the decision saw)
        before = self._recent or None
        self._recent, self._held = [], False
        self._trial = Trial(self.current, before if before else [], pending.evidence["samples_per_s_recent"]
                            if not before else _rate(before)) if judged else None
        self._trial_wait = pending.evidence.get("comm_wait_frac") if judged else None
        self._trial_back = judged and pending.evidence.get("reason") == "comm_wait_fell"
        self.current, self._since, self._window = to, step, []
        self._kept_wait, self._rebase = None, False

    def exclude(self, *layouts: Layout) -> None:
        """Never move to these again in this run: they ran out of memory."""
        self.candidates = [c for c in self.candidates if c not in layouts]

    def resume_at(self, step: int) -> None:
        """Records up to `step` were not the policy's to judge (a tuning round changed
        bucket_cap_mb under the current layout): count windows afresh from there, and measure
        again the comm wait the layout was kept at, now with the new setting."""
        self._window, self._since = [], step
        self._rebase = self._kept_wait is not None

    def state(self) -> dict:
        return {
            "current": self.current.to_dict(),
            "pending": self._pending.to_dict() if self._pending else None,
            "since": self._since, "window_fill": len(self._window),
            "trial": {"from": self._trial.layout.to_dict(), "samples_per_s_before": self._trial.rate,
                      "steps_before": self._trial.steps()} if self._trial else None,
            "blocked": [{"layout": k.to_dict(), "until": v} for k, v in self._blocked.items()],
            "skipped": list(self._skipped), "history": list(self.history),
            "deciding_by": "prediction" if self.predicting else "trial", "missed_in_a_row": self._misses,
            "model": self.model.state() if self.model is not None else None,
        }

    def _on_current(self, r: dict) -> bool:
        c = self.current
        same = (r["strategy"], r["dp"], r["tp"], r.get("shard") or 1) == (c.strategy, c.dp, c.tp, c.shard)
        return same and (self._since is None or r["step"] > self._since)

    def _decide(self, window: list[dict], step: int) -> Decision:
        c, means = self.config, window_means(window)
        if self._trial is not None:
            return self._judge(means, step, window)
        if self._rebase:
            self._rebase, self._kept_wait = False, means["comm_wait_s"]
            return KEEP
        if means["data_frac"] > c.input_bound_frac:
            return self._report("input_bound", None, {**means, "input_bound_frac": c.input_bound_frac}, step)
        slow = find_straggler(window, c)
        if slow is not None:
            return self._report("straggler", slow["rank"],
                                {**means, **slow, "straggler_ratio": c.straggler_ratio}, step)
        cooling = self._since is not None and step < self._since + c.cooldown
        pressure = None if cooling else self._memory_pressure(window, step)
        if pressure is not None:
            return pressure
        if self.predicting:
            self.model.update(self.current, window)
            over = means["comm_wait_frac"] > c.threshold
            if cooling or not (over or any(x.tp < self.current.tp for x in self.candidates)):
                return KEEP
            return self._predictive(means, step, "comm_wait" if over else "review")
        back, skipped = (None, []) if cooling else self._previous_candidate(means, step)
        if back is not None:
            self._pending = Switch(back, {"reason": "comm_wait_fell", **means, "threshold": c.threshold,
                                          "comm_wait_s_when_kept": self._kept_wait, "window": c.window,
                                          "from": self.current.to_dict(), "candidate": back.to_dict(),
                                          **({"skipped": skipped} if skipped else {})})
            return self._pending
        if cooling or means["comm_wait_frac"] <= c.threshold:
            return KEEP
        to, self._skipped = self._next_candidate(step, means["comm_wait_frac"])
        if to is None:
            return KEEP  # everything further is blocked, does not fit, or there is nothing further: stay put
        self._pending = Switch(to, {"reason": "comm_wait", **means, "threshold": c.threshold,
                                    "window": c.window, "from": self.current.to_dict(),
                                    "candidate": to.to_dict(), **({"skipped": self._skipped} if self._skipped else {})})
        return self._pending

    def _memory_pressure(self, window: list[dict], step: int) -> Decision | None:
        """A rank's peak memory in the window past `memory_threshold` of its device's: a move, before
        an OOM, to the candidate predicted to need less that needs the most among those (the least
        change). Not judged on speed afterwards: the layout left is not gone back to."""
        if self.memory is None:
            return None
        need, device = self.memory
        peaks = [r.get("peak_mem_bytes") for r in window if r.get("peak_mem_bytes") is not None]
        if not device or not peaks or max(peaks) <= self.config.memory_threshold * device:
            return None
        now = need(self.current)
        lighter = [(need(x), x) for x in self.candidates if x != self.current and self._blocked.get(x, step) <= step]
        lighter = [(b, x) for b, x in lighter if b < now]
        evidence = {"reason": "memory_pressure", "peak_mem_bytes": max(peaks), "device_memory_bytes": device,
                    "memory_threshold": self.config.memory_threshold, "peak_share": max(peaks) / device,
                    "steps": [window[0]["step"], window[-1]["step"]], "from": self.current.to_dict(),
                    "predicted_bytes_now": now,
                    "lighter": [{"layout": x.to_dict(), "bytes": b} for b, x in sorted(lighter, key=lambda o: -o[0])]}
        if not lighter:
            return self._report("memory_pressure", None, evidence, step)
        b, to = max(lighter, key=lambda o: o[0])
        self._pending = Switch(to, {**evidence, "candidate": to.to_dict(), "predicted_bytes": b})
        return self._pending

    def _watch_link(self, record: dict, step: int) -> Decision | None:
        """Every step: a change point in the comm wait (the link changed, either way) is a decision
        now, on the steps since the change, rather than at the window's end. During a trial it
        ends the judgement without counting against the move: the steps before the switch were
        measured at another link, so they say nothing of this one."""
        c = self.config
        if self._change.add(record["comm_wait_mean"], record["step_time_max"]) is None:
            return None
        since = self._recent[-c.change_steps:]
        before = window_means(self._recent[:-c.change_steps]) if len(self._recent) > c.change_steps else None
        self._recent = list(since)  # the steps at the link as it is now
        restarted = None
        if self._trial is not None:
            trial, self._trial, self._estimate = self._trial, None, None
            restarted = {"reason": "judgement restarted: the link changed during it", "from": trial.layout.to_dict(),
                         "layout": self.current.to_dict(), "samples_per_s_before": trial.rate,
                         "steps_before": trial.steps(), "steps_judged": [self._window[0]["step"], step]}
            self.history.append({"step": step, **Keep(restarted).to_dict()})
        self.model.update(self.current, since)
        self._window, self._held = [], False  # windows count afresh under the new link
        self._blocked.clear()  # what was reverted under the old link is predicted afresh
        means = {**window_means(since), "comm_wait_s_before": before["comm_wait_s"] if before else None}
        decision = self._predictive(means, step, "link_changed")
        if restarted is not None and isinstance(decision, Switch):
            decision.evidence["judgement_restarted"] = restarted
        return decision

    def _predictive(self, means: dict, step: int, reason: str) -> Decision:
        """Predict every candidate that fits and is not held back; move to the best when its gain,
        with its error counted against it, pays the switch over the steps left by a margin."""
        c, model = self.config, self.model
        now = model.predict(self.current)
        options, skipped, settled = [], [], {self.current.tp}
        for layout in self.candidates:  # at each tp its least sharded layout that fits (see the module's doc)
            passed = None if layout.tp in settled else self._passed_over(layout)
            if passed is not None:
                skipped.append(passed)
            elif layout.tp not in settled:
                settled.add(layout.tp)
                if self._blocked.get(layout, step) <= step:
                    options.append(model.predict(layout))
        best = min(options, key=lambda e: e.pessimistic_s, default=None)
        left = self.total_steps - step if self.total_steps is not None else c.retry_after
        gain, cost = now.step_s - best.pessimistic_s if best else 0.0, model.switch_cost(now.step_s)
        evidence = {"reason": reason, **means, "threshold": c.threshold, "from": self.current.to_dict(),
                    "predictions": [now.to_dict()] + [e.to_dict() for e in options], "gain_s_per_step": gain,
                    "steps_left": left, "switch_cost_s": cost, "switch_margin": c.switch_margin,
                    "model": model.state(), **({"skipped": skipped} if skipped else {})}
        if best is not None and gain > 0 and gain * left > cost * (1 + c.switch_margin):
            self._estimate = best
            self._pending = Switch(best.layout, {**evidence, "candidate": best.layout.to_dict(),
                                                 "predicted_step_s": best.step_s})
            return self._pending
        if reason == "review" or self._held:
            return KEEP
        self._held = True  # said once per layout and link: no move pays
        return Report("hold", evidence)

    def _size(self) -> int:
        """Steps a window takes; the run's first, by prediction, `early_check` (a prediction needs fewer)."""
        first = self.predicting and self._first and self._since is None
        return self.config.early_check if first else self.config.window

    def _early_look(self) -> bool:
        c = self.config
        return self._trial is not None and len(self._window) == c.early_check < c.window

    def _early(self, window: list[dict], step: int) -> Decision | None:
        """A trial's first `early_check` steps: a clear loss, beyond the noise, is reverted now;
        anything else waits for the full window."""
        after = _past_warmup(window)
        noise = self._noise(after)
        if _rate(after) >= self._trial.rate * (1 - self.config.early_loss) - noise:
            return None
        return self._judge(window_means(window), step, window, early=True)

    def _noise(self, after: list[dict], trial: Trial | None = None) -> float:
        """How much slower than before a trial may measure and still be noise: `noise_sigmas` x
        the standard error of the difference of the two rates. A side with too few steps to show
        a spread borrows the other's relative one."""
        trial = trial or self._trial
        rate_after, rate_before = _rate(after), trial.rate
        se_after, se_before = rate_error(after), rate_error(trial.before)
        if not se_before and rate_after > 0:
            se_before = se_after / rate_after * rate_before
        if not se_after and rate_before > 0:
            se_after = se_before / rate_before * rate_after
        return self.config.noise_sigmas * math.sqrt(se_after ** 2 + se_before ** 2)

    def _judge(self, means: dict, step: int, window: list[dict], early: bool = False) -> Decision:
        trial, self._trial = self._trial, None
        before_layout, before, c = trial.layout, trial.rate, self.config
        judged = _past_warmup(window)  # the new layout's first steps after its build are not its pace
        after, noise = _rate(judged), self._noise(judged, trial)
        evidence = {**means, "samples_per_s_before": before, "samples_per_s_after": after,
                    "noise_samples_per_s": noise, "noise_sigmas": c.noise_sigmas,
                    "steps_before": trial.steps(), "steps_judged": [judged[0]["step"], judged[-1]["step"]],
                    "warmup_steps_left_out": len(window) - len(judged),
                    "min_gain": c.min_gain, "from": before_layout.to_dict(),
                    "layout": self.current.to_dict()}
        if self.model is not None:  # the layout's first steps: its compute and own wait, measured
            self.model.update(self.current, window)
        estimate, self._estimate = self._estimate, None
        if estimate is not None:
            evidence.update(predicted_step_s=estimate.step_s, measured_step_s=means["step_time"],
                            prediction_error=self.model.check(estimate, means["step_time"]))
        if after > before * (1 + c.min_gain) - noise:  # slower by less than the noise: not evidence
            self._misses = 0 if estimate is not None else self._misses
            self._kept_wait = means["comm_wait_s"]
            self._reverts[self.current] = 0
            if self._trial_back:  # back where the network allows: hold the layout left back (rule 6)
                self._blocked[before_layout] = step + c.retry_after
                self._blocked_wait[before_layout] = means["comm_wait_frac"]
            return Keep({"reason": "kept", **evidence})
        # block the layout that did not help so the next slow window does not try it again at once
        # each revert of the same layout doubles its block: a layout that keeps losing is explored ever less
        self._reverts[self.current] += 1
        block = c.retry_after * 2 ** (self._reverts[self.current] - 1)
        self._blocked[self.current] = step + block
        self._blocked_wait[self.current] = self._trial_wait if self._trial_wait is not None else 1.0
        if early:
            evidence["early_loss"] = c.early_loss
            evidence["reason"] = (f"samples/s after {after:.4g} < before {before:.4g} x (1 - {c.early_loss}) "
                                  f"- noise {noise:.3g} in the first {means['steps'][1] - means['steps'][0] + 1} "
                                  f"steps; not retried before step {step + block}")
        else:
            evidence["reason"] = (f"samples/s after {after:.4g} < before {before:.4g} x (1 + {c.min_gain}) - noise "
                                  f"{noise:.3g}; not retried before step {step + block}")
        if estimate is not None:
            self._misses += 1
            if self._misses >= c.max_misses and self.predicting:
                self.predicting = False
                evidence["fallback"] = "trial"
                evidence["reason"] += (f"; {self._misses} predicted moves in a row reverted: the policy decides by "
                                       "trial from here on")
        self._pending = Revert(before_layout, evidence)
        return self._pending

    def _next_candidate(self, step: int, wait: float = 0.0) -> tuple[Layout | None, list[dict]]:
        """The layout to move to for comm wait, and the candidates passed over as not fitting.
        Only a larger tp cuts the traffic, so a tp is settled by its least sharded layout that
        fits: when that one is blocked, its more sharded twins (more traffic) are not tried."""
        if self.current in self.candidates:
            later = self.candidates[self.candidates.index(self.current) + 1:]
        else:  # a layout forced by hand: only larger tp groups lie further on
            later = [layout for layout in self.candidates if layout.tp > self.current.tp]
        settled, skipped = {self.current.tp}, []
        for layout in later:
            if layout.tp in settled:
                continue
            passed = self._passed_over(layout)
            if passed is not None:
                skipped.append(passed)
                continue
            settled.add(layout.tp)
            if self._blocked.get(layout, step) <= step or wait > 1.5 * self._blocked_wait.get(layout, 1.0):
                return layout, skipped
        return None, skipped

    def _previous_candidate(self, means: dict, step: int) -> tuple[Layout | None, list[dict]]:
        """The layout before this one (the least sharded that fits at the next smaller tp), once the
        wait that drove the move here has gone; and the candidates passed over as not fitting."""
        if self._kept_wait is None or means["comm_wait_s"] >= 0.5 * self._kept_wait:
            return None, []
        if self.current not in self.candidates:
            return None, []
        earlier = [c for c in self.candidates[:self.candidates.index(self.current)] if c.tp < self.current.tp]
        if not earlier:
            return None, []
        skipped = []
        for back in (c for c in earlier if c.tp == earlier[-1].tp):
            passed = self._passed_over(back)
            if passed is None:
                return (back if self._blocked.get(back, step) <= step else None), skipped
            skipped.append(passed)
        return None, skipped

    def _report(self, kind: str, rank: int | None, evidence: dict, step: int) -> Decision:
        last = self._reported.get((kind, rank))
        if last is not None and step - last < self.config.cooldown:
            return KEEP  # said already; repeating every window is noise
        self._reported[(kind, rank)] = step
        return Report(kind, evidence)
