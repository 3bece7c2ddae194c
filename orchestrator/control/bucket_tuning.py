"""Tuning `bucket_cap_mb` while training: the driver that runs a `Tuner`'s trials on the live
workers, one step range each, and puts the winner in force.

With `parallel.bucket_cap_mb: auto` every layout with a data-parallel all-reduce gets one round
(`search`), the first time it is in force; its winner is remembered, and a layout the run comes
back to gets it again without a new round. `gearshift tune` hands in a grid instead: every
setting of it (bucket sizes, and layouts) is timed once, and the run stops after the last.

The controller ends its training chunks where a trial ends (`trial_end`) and calls `chunk_done`
there; the rest is this module's. The tuner itself (orchestrator/tuner.py) only proposes
settings and keeps scores.
"""

from __future__ import annotations

from gearshift.orchestrator.job import Job, scheduled
from gearshift.orchestrator.control.reporting import setting_text
from gearshift.orchestrator.policy.tuner import Tuner
from gearshift.strategies.layout import Layout


def distinct_buckets(values: list[float], parameters: int | None, tp: int = 1) -> tuple[list[float], dict]:
    """Bucket sizes that bucket a rank's gradients differently. Every size at or above the
    gradients' size (fp32, this rank's tp shard) puts them all in one bucket: only the smallest
    such is worth a trial. Returns (the values to try, {value left out: the one it equals})."""
    values = sorted(values)
    if not parameters:
        return values, {}
    grad_mb = parameters * 4 / max(1, tp) / 2**20
    whole = [v for v in values if v >= grad_mb]
    if len(whole) < 2:
        return values, {}
    return [v for v in values if v < grad_mb] + whole[:1], {v: whole[0] for v in whole[1:]}


def initial_bucket(job: Job) -> float:
    """The bucket_cap_mb a (re)started group begins with: the job's, or with auto the tuning start."""
    return job.tune.start if job.parallel.bucket_cap_mb == "auto" else job.parallel.bucket_cap_mb


class TuneRound:
    """One tuning round in progress: which trial, from which step its timed steps count, and
    the step records that fall in them."""

    def __init__(self, tuner: Tuner, step: int, layout: Layout):
        self.tuner, self.started, self.layout = tuner, step, layout
        self.first = self.trial_end = step
        self.records: list[dict] = []

    def begin(self, step: int, warmup: int, steps: int, setting: dict) -> None:
        self.first, self.trial_end, self.setting, self.records = step + warmup + 1, step + warmup + steps, setting, []

    def add(self, record: dict) -> None:
        if self.first <= record["step"] <= self.trial_end:
            self.records.append(record)

    def score(self, global_batch: int) -> tuple[float, dict]:
        """Samples/s over the timed steps (total samples / total time), and the evidence."""
        rs = self.records
        time = sum(r["step_time_max"] for r in rs)
        waits = [r["comm_wait_frac_mean"] for r in rs if r.get("comm_wait_frac_mean") is not None]
        return (len(rs) * global_batch / time if time > 0 else 0.0,
                {"steps": [self.first, self.trial_end], "step_time": time / len(rs) if rs else None,
                 "comm_wait_frac": sum(waits) / len(waits) if waits else None})


class BucketTuning:
    """The bucket_cap_mb in force, the rounds that chose it, and the round in progress.

    `grid` (from `gearshift tune`): time every setting of this space, then stop the run; None
    (a run): tune by search when the job's bucket_cap_mb is auto. The controller attaches itself
    (`attach`): a trial that changes the layout is a switch, which is the controller's to make.
    Of the controller it reads `job`, `layout`, `group`, `report`, `summary` (the parameter
    count) and `policy` (told to count afresh after a round), and calls `switch` and
    `note_layout`."""

    def __init__(self, grid: dict[str, list] | None = None):
        self.grid = grid
        self.round: TuneRound | None = None
        self.tuned: dict[Layout, float] = {}  # layout -> the bucket_cap_mb its round chose
        self.rounds: list[dict] = []          # every finished round, for the summary and `gearshift tune`
        self.bucket: float | None = None      # bucket_cap_mb in force
        self.ctl = None  # the controller that runs the trials, from attach() (it imports this module)
        self._train_start = 0

    def attach(self, controller) -> None:
        self.ctl = controller
        self.bucket = initial_bucket(controller.job)

    @property
    def active(self) -> bool:
        return self.round is not None

    @property
    def trial_end(self) -> int:
        return self.round.trial_end

    def begin(self, step: int) -> None:
        """Training (re)starts at `step`: the grid's round, or a round on the layout in force."""
        self._train_start = step
        if self.grid is not None:
            self._start(step, Tuner(self.grid, mode="grid"), "grid")
        else:
            self.maybe_tune(step)

    def add(self, record: dict) -> None:
        self.round.add(record)

    def chunk_done(self, step: int) -> bool:
        """A chunk ended at `step`: score the trial that ends here and begin the next. True when
        that was the grid's last setting: `gearshift tune` has tried every one."""
        if self.round is None or step < self.round.trial_end:
            return False
        self._trial_done(step)
        return self.grid is not None and self.round is None

    def reset(self) -> None:
        """The workers are gone (a failure): the round in progress goes with them."""
        self.round = None

    def maybe_tune(self, step: int, only_remembered: bool = False) -> None:
        """With bucket_cap_mb auto: a round on the layout now in force (none for a layout with no
        data-parallel all-reduce), or the value a round on this layout chose before."""
        job, layout = self.ctl.job, self.ctl.layout
        if job.parallel.bucket_cap_mb != "auto" or layout.dp == 1 or step >= job.train.steps:
            return
        if getattr(self.ctl, "script", None) is not None:  # a replay: the original's buckets, at their steps
            return
        if layout in self.tuned:
            self.apply_bucket(self.tuned[layout], step)
            return
        if only_remembered:
            return
        values, same = distinct_buckets(job.tune.bucket_values, self.ctl.summary.get("parameters"), layout.tp)
        start = min(values, key=lambda v: abs(v - min(self.bucket, values[-1])))
        tuner = Tuner({"bucket_cap_mb": values}, start={"bucket_cap_mb": start}, mode="search",
                      max_trials=job.tune.max_trials)
        self._start(step, tuner, "search", same_as=same)

    def abandon(self, step: int) -> None:
        """A new layout is coming: this round stops (the new layout gets its own)."""
        round_, self.round = self.round, None
        self.ctl.report.event("tune_abandoned", step=step, started=round_.started,
                              trials=[t.to_dict() for t in round_.tuner.trials])

    def apply_bucket(self, bucket: float, step: int) -> None:
        """Put `bucket` in force under the layout in force (a reshard onto the same layout)."""
        if bucket == self.bucket:
            return
        ctl = self.ctl
        results = ctl.group.call("reshard", ctl.layout.to_dict(), bucket)
        old, self.bucket = self.bucket, bucket
        ctl.note_layout(step)
        ctl.report.event("bucket", step=step, bucket_cap_mb=bucket, previous=old,
                         seconds=max(r["seconds"] for r in results))

    # ------------------------------------------------------------------ a round's course

    def _start(self, step: int, tuner: Tuner, mode: str, same_as: dict | None = None) -> None:
        ctl = self.ctl
        self.round = TuneRound(tuner, step, ctl.layout)
        ctl.report.event("tune_start", step=step, mode=mode, space=tuner.space, pinned=tuner.pinned,
                         same_as=same_as or {}, layout=ctl.layout.to_dict(),
                         warmup_steps=ctl.job.tune.warmup_steps, trial_steps=ctl.job.tune.trial_steps,
                         max_trials=tuner.max_trials)
        self._next_trial(step)

    def _next_trial(self, step: int) -> None:
        round_, t = self.round, self.ctl.job.tune
        setting = round_.tuner.next()
        if setting is None:
            self._finish(step)
            return
        changed = self._apply_setting(setting, step)
        # a changed setting warms up first, as do the run's first steps; a value already in
        # force on warm workers is timed at once
        warm = not changed and step != self._train_start
        round_.begin(step, 0 if warm else t.warmup_steps, t.trial_steps, setting)

    def _trial_done(self, step: int) -> None:
        round_, report = self.round, self.ctl.report
        score, evidence = round_.score(self.ctl.job.train.global_batch_size)
        trial = round_.tuner.report(score, **evidence)
        report.event("tune_trial", step=step, **trial.to_dict())
        wait = evidence["comm_wait_frac"]
        report.say(f"step {step}: tune trial {setting_text(trial.setting)}: {score:,.1f} samples/s"
                   + (f", comm wait {wait:.0%}" if wait is not None else ""))
        self._next_trial(step)

    def _finish(self, step: int) -> None:
        ctl = self.ctl
        round_, self.round = self.round, None
        best = round_.tuner.best()
        trials = [t.to_dict() for t in round_.tuner.trials]
        entry = {"step": step, "started": round_.started, "mode": "grid" if self.grid is not None else "search",
                 "layout": round_.layout.to_dict(),
                 "best": best.to_dict() if best else None, "trials": trials}
        self.rounds.append(entry)
        ctl.report.event("tuned", **entry)
        if self.grid is not None or best is None:
            return
        self.tuned[ctl.layout] = best.setting["bucket_cap_mb"]
        ctl.report.say(f"step {step}: tuned bucket_cap_mb = {best.setting['bucket_cap_mb']:g} on "
                       f"{ctl.layout} ({best.score:,.1f} samples/s, {len(trials)} trials)")
        self.apply_bucket(best.setting["bucket_cap_mb"], step)
        if ctl.policy is not None:
            ctl.policy.resume_at(step)

    def _apply_setting(self, setting: dict, step: int) -> bool:
        """Put a trial's setting in force: a layout (grid tuning) and a bucket size. True if it
        changed anything."""
        ctl = self.ctl
        layout = ctl.layout
        if "strategy" in setting:
            tp = setting.get("tp_size", ctl.job.parallel.tp_size) if setting["strategy"] != "data" else None
            layout = scheduled(ctl.job, {"strategy": setting["strategy"], "tp_size": tp,
                                         "shard_size": setting.get("shard_size"), "dp_shard": setting.get("dp_shard")})
        bucket = setting.get("bucket_cap_mb", self.bucket)
        if layout == ctl.layout and bucket == self.bucket:
            return False
        if layout != ctl.layout:
            ctl.switch(layout, step, "tune", bucket=bucket)
        else:
            self.apply_bucket(bucket, step)
        return True
