"""Out of memory, survived (`train.on_oom: adapt`, the default) or reported (`fail`).

A step that ran out of memory on any rank is dropped on every rank (workers/step/oom.py): nothing of
it is applied and it is not counted. The controller forms a new process group on the same
workers and goes on at the same step with a setting that needs less memory:

  1. more accumulation: half the micro-batch (the largest divisor of the rank's share of the
     global batch at or below half of it), down to 1 sample a rank. The update is the same
     (equal micro-batches: the mean of their means is the batch's mean), so the run stays equal
     to a plain one;
  2. then a layout the memory model (costmodel.memory) predicts needs less than the one in force,
     the one needing most among those (the least change: least traffic added), at the job's
     micro-batch again (a more sharded layout frees parameter and optimizer memory);
  3. with no way left, the same setting again (memory can be fragmented or taken by another
     process for a while), three times in all; then the run stops, telling all of it.

Every setting that ran out of memory (layout and micro-batch) is marked as not fitting and never
chosen again in the run, by this module or by the adaptive policy. An OOM while switching (some
rank could not allocate the new layout) leaves every rank on the old layout, whole
(strategies/relayout.py's commit point); the layout it was going to is marked as not fitting.
Each OOM is an `oom` record: the rank, the step, what was allocated and reserved, the action.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from gearshift.orchestrator.errors import GearshiftError
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.strategies.layout import Layout

RETRIES = 3  # OOMs at one setting, with no other way left, before the run stops


@dataclass(frozen=True)
class Setting:
    layout: Layout
    micro_batch: int  # samples a rank computes at once

    def __str__(self) -> str:
        return f"{self.layout}, micro-batch {self.micro_batch}"


@dataclass(frozen=True)
class Action:
    kind: str                     # "accumulate", "shard", "retry" or "stay" (an OOM while switching)
    setting: Setting              # what training goes on with
    why: str

    def to_dict(self) -> dict:
        return {"action": self.kind, "to_layout": self.setting.layout.to_dict(),
                "to_micro_batch": self.setting.micro_batch, "why": self.why}


def gib(n: float | None) -> str:
    return "?" if n is None else f"{n / 2**30:.2f} GiB"


def halve(share: int, micro: int) -> int | None:
    """The largest micro-batch that divides `share` and is at most half of `micro` (None: 1 already)."""
    for m in range(micro // 2, 0, -1):
        if share % m == 0:
            return m
    return None


class OutOfMemory:
    def __init__(self, job: Job, report: Reporter):
        self.job, self.report = job, report
        self.not_fitting: set[Setting] = set()
        self.layouts_not_fitting: set[Layout] = set()  # layouts no micro-batch made fit
        self.count: Counter = Counter()  # OOMs per setting
        self.records: list[dict] = []    # the summary's `oom`
        self._shape = None

    def share(self, layout: Layout) -> int:
        return self.job.train.global_batch_size // layout.dp

    def setting(self, layout: Layout, micro: int | None) -> Setting:
        return Setting(layout, micro or self.share(layout))

    # ---------------------------------------------------------------- in a step

    def after_step(self, failures: list[dict], layout: Layout, micro: int | None, candidates: list[Layout],
                   memory_bytes: int | None) -> Action:
        """Ranks dropped a step; what to go on with. Raises GearshiftError when the job says to fail,
        when an update was half applied, or when no way is left."""
        ooms = [f for f in failures if f["kind"] in ("oom", "oom_in_update")]
        first = min(ooms, key=lambda f: f["rank"])
        now = self.setting(layout, micro)
        self.count[now] += 1
        if self.job.train.on_oom == "fail":
            self._stop(first, now, "train.on_oom is fail. Set it to adapt to let gearshift go on with more "
                                   "accumulation or a more sharded layout, or lower train.micro_batch_size")
        if any(f["kind"] == "oom_in_update" for f in ooms):
            self._stop(first, now, "it struck inside the optimizer's update, which was half applied and cannot be "
                                   "taken back. Lower train.micro_batch_size or choose a more sharded layout")
        self.not_fitting.add(now)
        action = self._next(now, candidates, memory_bytes)
        if action is None:
            self._stop(first, now, f"no setting needing less memory is left (micro-batch {now.micro_batch}, no "
                                   f"layout predicted to need less that has not run out of memory already), and "
                                   f"{self.count[now]} tries at this one ran out of memory")
        self._record(ooms, now, action, during="step")
        return action

    def _next(self, now: Setting, candidates: list[Layout], memory_bytes: int | None) -> Action | None:
        smaller = halve(self.share(now.layout), now.micro_batch)
        if smaller is not None:
            return Action("accumulate", Setting(now.layout, smaller),
                          f"micro-batch {now.micro_batch} -> {smaller}: accumulation {self.share(now.layout) // smaller}")
        self.layouts_not_fitting.add(now.layout)
        target = self.lighter_layout(now.layout, candidates, memory_bytes)
        if target is not None:
            to = self.setting(target["layout"], self.job.train.micro_batch_size)
            return Action("shard", to, f"{now.layout} does not fit even 1 sample a rank; {target['layout']} is "
                                       f"predicted to need {gib(target['bytes'])} a rank against "
                                       f"{gib(target['now_bytes'])}")
        if self.count[now] < RETRIES:
            return Action("retry", now, f"try {self.count[now] + 1} of {RETRIES}: nothing needing less is left")
        return None

    def lighter_layout(self, layout: Layout, candidates: list[Layout], memory_bytes: int | None) -> dict | None:
        """The candidate predicted to need less memory than `layout` (and to fit `memory_bytes`,
        when known) that needs the most among those, and has not run out of memory; None: none."""
        from gearshift.orchestrator.policy import costmodel
        from gearshift.orchestrator.policy import job_shape

        if self._shape is None:
            self._shape = job_shape.shape_of_job(self.job)
        settings = job_shape.memory_settings(self.job)

        def need(lay: Layout) -> float:
            return costmodel.memory(self._shape, lay.dp, lay.tp, lay.shard, global_batch=self.job.train.global_batch_size,
                                    **settings)["total"]

        now = need(layout)
        options = [(need(c), c) for c in candidates if c != layout and c not in self.layouts_not_fitting]
        options = [(b, c) for b, c in options if b < now and (memory_bytes is None or b <= memory_bytes)]
        if not options:
            return None
        b, c = max(options, key=lambda o: o[0])
        return {"layout": c, "bytes": b, "now_bytes": now}

    # ---------------------------------------------------------------- in a switch

    def in_switch(self, failed: list[dict], layout: Layout, target: Layout, micro: int | None) -> Action:
        """A switch stopped at its commit point: every rank is on `layout` still."""
        now = self.setting(layout, micro)
        ooms = [f for f in failed if f.get("own")] or failed
        if self.job.train.on_oom == "fail":
            self._stop(ooms[0], self.setting(target, micro), "train.on_oom is fail")
        self.not_fitting.add(self.setting(target, micro))
        self.layouts_not_fitting.add(target)
        action = Action("stay", now, f"the switch to {target} could not allocate it; every rank stays on {layout}")
        self._record(ooms, self.setting(target, micro), action, during="switch")
        return action

    # ---------------------------------------------------------------- what it says

    def _record(self, ooms: list[dict], at: Setting, action: Action, during: str) -> None:
        for f in sorted(ooms, key=lambda o: o["rank"]):
            record = {"rank": f["rank"], "step": f["step"], "during": during, "layout": at.layout.to_dict(),
                      "micro_batch": at.micro_batch, "allocated_bytes": f.get("allocated_bytes"),
                      "reserved_bytes": f.get("reserved_bytes"), "free_bytes": f.get("free_bytes"),
                      "total_bytes": f.get("total_bytes"), "error": f.get("message"), **action.to_dict()}
            self.report.event("oom", **record)
            self.records.append(record)
        ooms = sorted(ooms, key=lambda o: o["rank"])
        f = ooms[0]
        ranks = ", ".join(str(o["rank"]) for o in ooms)
        self.report.say(f"step {f['step']}: out of memory on rank {ranks} ({during}; {gib(f.get('allocated_bytes'))} "
                        f"allocated, {gib(f.get('reserved_bytes'))} reserved) at {at} -> {action.kind}: {action.why}")

    def _stop(self, f: dict, at: Setting, why: str) -> None:
        record = {"rank": f["rank"], "step": f["step"], "layout": at.layout.to_dict(), "micro_batch": at.micro_batch,
                  "allocated_bytes": f.get("allocated_bytes"), "reserved_bytes": f.get("reserved_bytes"),
                  "free_bytes": f.get("free_bytes"), "total_bytes": f.get("total_bytes"),
                  "error": f.get("message"), "action": "stop", "why": why}
        self.report.event("oom", **record)
        self.records.append(record)
        tried = "; ".join(f"{s}: {n} OOM(s)" for s, n in self.count.items())
        raise GearshiftError(
            f"Out of memory at step {f['step']} on rank {f['rank']}: {gib(f.get('allocated_bytes'))} allocated, "
            f"{gib(f.get('reserved_bytes'))} reserved, {gib(f.get('free_bytes'))} free of {gib(f.get('total_bytes'))}, "
            f"under {at} ({f.get('message', '').splitlines()[0] if f.get('message') else 'no message'}). "
            f"The run stops because {why}. Settings tried: {tried}. Its checkpoints are in the run directory.")
