"""The cost model fitted to a run from its own step records, so the policy can predict a layout
before it moves there; and a change-point detector for the per-step comm wait.

Pure logic, like the policy: step records in, predictions out.

What is fitted, and from what (`OnlineModel.update`, called with the records of one layout under
one link):

- the device rate: from the compute time of the first replicated tp=1 layout that runs (data
  parallel), as `calibration.calibrate` does: its FLOPs a step over its slowest rank's compute;
- the link that changes (between nodes; inside the node on a one-node run): its bandwidth is the
  one with which `costmodel.predict` gives the current layout's measured comm wait (less the
  layout's own offset, below). Refitted at every decision, so it follows the link as it changes;
- each layout that has run: its measured compute (tensor parallelism's added work included) and
  its comm-wait offset: the wait it measured beyond what the link model gives it at the link as
  it was just before the switch (tensor-parallel collectives inside a node, the ranks' skew);
- the switch cost: the measured duration of the run's switches (2 steps of the layout left
  until one has been measured);
- the prediction error: each move's measured step against its prediction.

A layout that has not run is predicted from the model: the fitted device rate, the link as fitted,
and its tensor-parallel collectives on the link inside a node as the prior hardware has it. A live
run knows nothing of that link (the priors are free collectives and no added work), so such a
prediction is a bound rather than an estimate; it carries `unseen_error` instead of the error
measured so far (see `error`).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace
from statistics import median

from gearshift.orchestrator.policy import costmodel
from gearshift.orchestrator.policy import calibration
from gearshift.orchestrator.policy.costmodel import Hardware, Link, ModelShape
from gearshift.strategies.layout import Layout

FREE = 1e15  # bytes/s: a link whose transfers cost nothing (calibration._solve's upper bound)


@dataclass
class Seen:
    """What a layout measured in this run."""

    compute_s: float   # median compute of its slowest rank
    offset_s: float    # comm wait beyond the link model's, at the link it was fitted at
    steps: int         # records it was fitted from


@dataclass(frozen=True)
class Estimate:
    layout: Layout
    step_s: float
    compute_s: float
    wait_s: float
    seen: bool
    error: float       # relative error assumed of this prediction

    @property
    def pessimistic_s(self) -> float:
        return self.step_s * (1 + self.error)

    def to_dict(self) -> dict:
        return {"layout": self.layout.to_dict(), "step_s": self.step_s, "compute_s": self.compute_s,
                "wait_s": self.wait_s, "measured_before": self.seen, "error": self.error}


def _steady(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("compute_time_mean") is not None and r.get("comm_wait_mean") is not None]


class OnlineModel:
    def __init__(self, model: ModelShape, global_batch: int, node_sizes: list[int], prior: Hardware | None = None,
                 predict_error: float = 0.05, unseen_error: float = 0.25, switch_steps: float = 2.0,
                 pp_microbatches: int | None = None, pp_schedule: str = "1f1b"):
        # nodes of unequal size: as many devices as the run has, spread evenly (tp never leaves a node)
        nodes, per_node = len(node_sizes), math.ceil(sum(node_sizes) / len(node_sizes))
        # a spec that says what the link inside a node is makes tensor parallelism's collectives predictable
        self.tp_known = prior is not None
        if prior is None:
            free = Link(FREE, 0.0)
            prior = Hardware(nodes=nodes, per_node=per_node, flops=1e12, intra=free, inter=free, name="online")
        else:
            prior = replace(prior, nodes=nodes, per_node=per_node)
        self.model, self.global_batch, self.hw = model, global_batch, prior
        self.pp_microbatches = pp_microbatches  # parallel.pp_microbatches (None: each pipeline's default)
        self.pp_schedule = pp_schedule  # parallel.pp_schedule: the one a pipeline candidate would run
        self.predict_error, self.unseen_error, self.switch_steps = predict_error, unseen_error, switch_steps
        self.seen: dict[Layout, Seen] = {}
        self.rate_from: Layout | None = None  # the layout the device rate was fitted from
        self.link_fitted = False
        self.link_bound = False               # the fitted link is only the slowest the waits allow
        self.link_before_drop: tuple[float, Layout] | None = None  # the link before it last dropped, fitted on
        self.link_assumed: float | None = None  # the link taken as that, since it came back (`recovered`)
        self.last_fit: tuple[Layout, float, float] | None = None  # (layout, its wait, its step) the link was fitted on
        self.rest_s = 0.0                     # step time beyond compute and wait (data loading, skew)
        self.bucket_cap_mb = 25.0
        self.errors: list[float] = []          # measured / predicted - 1 of each checked move
        self.switch_s: list[float] = []
        self._entered: set[Layout] = set()     # layouts switched to whose first records are still to come

    # ------------------------------------------------------------------ fitting

    @property
    def varying(self) -> str:
        """The link that the fitted bandwidth stands for: between nodes, or on one node the node's own."""
        return "inter" if self.hw.nodes > 1 else "intra"

    @property
    def bandwidth(self) -> float:
        return getattr(self.hw, self.varying).bandwidth

    def _at(self, bandwidth: float) -> Hardware:
        link = getattr(self.hw, self.varying)
        return replace(self.hw, **{self.varying: Link(bandwidth, link.latency)})

    def entered(self, layout: Layout) -> None:
        """The run switched to `layout`: its next records measure it at the link fitted before."""
        self._entered.add(layout)

    def update(self, layout: Layout, records: list[dict]) -> None:
        """Fit from records of `layout`, all under one link (a window, or the steps since a change)."""
        rs = _steady(records)
        if not rs:
            return
        compute = median(calibration.slowest_compute(r) for r in rs)
        wait = median(calibration.transfer_wait(r) for r in rs)
        step = median(r["step_time_max"] for r in rs)
        self.rest_s = max(0.0, step - compute - wait)
        self.bucket_cap_mb = rs[-1].get("bucket_cap_mb") or self.bucket_cap_mb
        base = layout.tp == 1 and layout.shard == 1 and layout.pp == 1
        if compute > 0 and (self.rate_from is None or layout == self.rate_from or (base and self.rate_from.tp > 1)):
            self.hw = replace(self.hw, flops=self._work(layout) / compute)
            self.rate_from = layout
        known = self.seen.get(layout)
        if layout in self._entered or known is None:
            # new here: the link is as it was just before the switch; what the model does not
            # explain of this layout's wait is its own (collectives inside a node, skew). The
            # model's wait is the least the layout waits: less measured is noise in the link's
            # estimate, which an offset below 0 would carry into every later fit of the link
            offset = max(0.0, wait - self._wait(layout, self.bandwidth)) if self.link_fitted else 0.0
            self.seen[layout] = Seen(compute, offset, len(rs))
            self._entered.discard(layout)
            if self.link_fitted:
                return
        else:
            self.seen[layout] = Seen(compute, known.offset_s, known.steps + len(rs))
        self._fit_link(layout, wait, compute)
        self.last_fit = (layout, wait, step)

    def _fit_link(self, layout: Layout, wait: float, compute: float) -> None:
        target = wait - self.seen[layout].offset_s
        # a wait at the model's floor (the transfers all hidden behind compute, or latency alone)
        # does not show the link: take the slowest link that still leaves it there (+1 % of compute)
        floor = self._wait(layout, FREE) + 0.01 * compute
        self.link_bound = target <= floor  # the wait does not show the link: the fit is its slowest
        target = max(target, floor)
        fitted, self.link_fitted = calibration._solve(lambda bw: self._wait(layout, bw), target), True
        assumed, by = self.link_assumed, (self.link_before_drop or (None, None))[1]
        if assumed is not None and fitted < assumed and (self.link_bound or self._shows(layout, assumed) < self._shows(by, assumed)):
            return  # the link taken as it was since it came back (`recovered`): this layout's waits cannot tell
        self.hw, self.link_assumed = self._at(fitted), None

    def dropped(self) -> None:
        """The link just got slower (a change point up in the wait), before the steps since are
        fitted: the link as fitted until now, and the layout it was fitted on, kept for
        `recovered` (unless the waits did not show it)."""
        if self.link_fitted and not self.link_bound and self.last_fit is not None:
            self.link_before_drop = (self.bandwidth, self.last_fit[0])

    def recovered(self, layout: Layout) -> float | None:
        """The link just got faster (a change point down in the wait), and `layout`'s steps since
        were fitted. A layout that sends little across the link (a pipeline's activations,
        transfers hidden behind compute) shows it poorly: its wait barely changes between a fast
        link and a faster one, and the bubbles and skew it also holds read as a slower link. Such a
        fit would price every layout that sends more across the link at that floor for good. So
        where `layout` shows the link less than the layout that measured it before it dropped (a
        halving of that link adds less to its wait), or its fit is only a bound, the link is taken
        as it was before it dropped. A move on that assumption is judged by measurement like any
        other, and reverted if the link did not come back. Returns the bandwidth assumed, or None."""
        if self.link_before_drop is None or self.last_fit is None or self.last_fit[0] != layout:
            return None
        before, shown_by = self.link_before_drop
        if before <= self.bandwidth:
            return None
        if not self.link_bound and self._shows(layout, before) >= self._shows(shown_by, before):
            return None  # this layout's waits show the link at least as well: its fit stands
        self.hw, self.link_assumed = self._at(before), before
        # what the link no longer explains of this layout's wait is its own, as for a layout new here
        wait, seen = self.last_fit[1], self.seen[layout]
        self.seen[layout] = Seen(seen.compute_s, max(0.0, wait - self._wait(layout, before)), seen.steps)
        return before

    def _shows(self, layout: Layout, bandwidth: float) -> float:
        """Seconds of wait a halving of the link from `bandwidth` adds to `layout`'s step."""
        return self._wait(layout, bandwidth / 2) - self._wait(layout, bandwidth)

    def _work(self, layout: Layout) -> float:
        """FLOPs a step on one rank of `layout`, tensor parallelism's added work left out (a
        pipeline's stage: its share of the blocks, the head whole on the last)."""
        m = self.model
        split = layout.tp * layout.pp
        return m.flops_per_sample * self.global_batch / layout.dp * ((1 - m.tp_replicated) / split + m.tp_replicated)

    def _predict(self, layout: Layout, bandwidth: float) -> costmodel.Prediction:
        if layout.pp > 1:
            from gearshift.orchestrator.policy import pipeline_cost

            return pipeline_cost.predict(self.model, self._at(bandwidth), self.global_batch, layout.pp, layout.dp,
                                         self.pp_microbatches, self.pp_schedule, layout.tp)
        return costmodel.predict(self.model, self._at(bandwidth), self.global_batch, layout.dp, layout.tp,
                                 self.bucket_cap_mb, shard=layout.shard)

    def _wait(self, layout: Layout, bandwidth: float) -> float:
        return self._predict(layout, bandwidth).exposed_wait_s

    def switched(self, seconds: float | None) -> None:
        if seconds is not None and seconds >= 0 and math.isfinite(seconds):
            self.switch_s.append(seconds)

    def check(self, estimate: Estimate, measured_step_s: float) -> float:
        """A move's measured step against its prediction: the relative error, kept."""
        err = measured_step_s / estimate.step_s - 1 if estimate.step_s > 0 else 0.0
        self.errors.append(err)
        return err

    # ------------------------------------------------------------------ predicting

    def error(self, layout: Layout) -> float:
        """The relative error assumed of a prediction for `layout`: the larger of `predict_error`
        and the errors measured so far (their median size) for a layout that has run, or whose
        costs the model knows (replicated tp=1, or any layout given a spec of the hardware);
        `unseen_error` for one whose tensor-parallel or sharding costs nothing here has measured."""
        if self.link_assumed is not None and layout == self.link_before_drop[1]:
            return self.predict_error  # the link taken as this layout measured it: its prediction is its own step
        if layout in self.seen or self.tp_known or (layout.tp == 1 and layout.shard == 1 and layout.pp == 1):
            measured = median(abs(e) for e in self.errors[-5:]) if self.errors else 0.0
            return max(self.predict_error, measured)
        return self.unseen_error

    def predict(self, layout: Layout) -> Estimate:
        pred = self._predict(layout, self.bandwidth)
        seen = self.seen.get(layout)
        compute = seen.compute_s if seen else pred.compute_s
        wait = max(0.0, pred.exposed_wait_s + (seen.offset_s if seen else 0.0))
        return Estimate(layout, compute + wait + self.rest_s, compute, wait, seen is not None, self.error(layout))

    def on(self, node_sizes: list[int], link: float | None = None) -> tuple["OnlineModel", bool]:
        """The model fitted so far on another world (a run about to grow or shrink): the same device
        rate, step overhead and links, the nodes as `node_sizes` has them. And whether the link the
        new world's collectives cross is one this run measured: one that spans nodes where the run
        has run on one node only is taken as no faster than the node's own link (fitted), a bound.
        `link`: the fitted link's bandwidth taken as this instead."""
        nodes, per_node = len(node_sizes), math.ceil(sum(node_sizes) / len(node_sizes))
        other = copy.copy(self)
        other.hw = replace(self._at(link) if link is not None else self.hw, nodes=nodes, per_node=per_node)
        measured = self.hw.nodes > 1 or nodes == 1
        if not measured:
            intra = self.hw.intra
            other.hw = replace(other.hw, inter=Link(min(self.hw.inter.bandwidth, intra.bandwidth),
                                                    max(self.hw.inter.latency, intra.latency)))
        return other, measured

    def switch_cost(self, step_s: float) -> float:
        """Seconds a switch costs: the run's measured switches (median), or `switch_steps` steps."""
        return median(self.switch_s) if self.switch_s else self.switch_steps * step_s

    def state(self) -> dict:
        return {"device_tflops": self.hw.flops / 1e12, f"{self.varying}_link_gb_s": self.bandwidth / 1e9,
                "rate_from": self.rate_from.to_dict() if self.rate_from else None,
                "measured": [{"layout": k.to_dict(), "compute_s": v.compute_s, "offset_s": v.offset_s}
                             for k, v in self.seen.items()],
                "errors": list(self.errors), "switch_s": list(self.switch_s),
                **({"link_hidden": True} if self.link_bound else {}),
                **({"link_assumed_gb_s": self.link_assumed / 1e9} if self.link_assumed is not None else {})}


class ChangePoint:
    """A lasting change in the per-step comm wait: the last `steps` steps all beyond `factor` x
    the level so far (the median of the steps since the last change), on the same side, and by
    more than `floor` of the step time. Detected `steps` steps after the change; one slow step
    (a hiccup) is not a change. After a change the level is measured again from its steps."""

    def __init__(self, factor: float = 1.5, steps: int = 3, floor: float = 0.05, min_level: int = 5,
                 keep: int = 50):
        self.factor, self.steps, self.floor, self.min_level, self.keep = factor, steps, floor, min_level, keep
        self.level: list[float] = []
        self.recent: list[tuple[float, float]] = []  # (wait, step time) of the last `steps` steps

    def reset(self) -> None:
        self.level, self.recent = [], []

    def add(self, wait_s: float, step_s: float) -> str | None:
        """'up' or 'down' when the step just added completes a change; None otherwise."""
        self.recent.append((wait_s, step_s))
        if len(self.recent) > self.steps:
            self.level.append(self.recent.pop(0)[0])
            del self.level[:-self.keep]
        if len(self.level) < self.min_level or len(self.recent) < self.steps:
            return None
        ref = median(self.level)
        waits = [w for w, _ in self.recent]
        floor = self.floor * median(s for _, s in self.recent)
        up = all(w > ref * self.factor and w - ref > floor for w in waits)
        down = all(w * self.factor < ref and ref - w > floor for w in waits)
        if not (up or down):
            return None
        self.level, self.recent = waits, []  # the new level, measured from its own steps
        return "up" if up else "down"
