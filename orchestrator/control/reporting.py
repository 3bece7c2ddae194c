"""What a run reports, and where it goes: step records merged over ranks (`StepMerger`), running
figures for the summary (`RunStats`), and `Reporter`, which writes records and events to
telemetry.jsonl and to the observers (the /metrics endpoint, the job log) and says the lines a
person reads on the terminal.

The controller decides; this module only writes down what was decided and measured, so that the
wording of a record or a line lives in one place.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import statistics
import time

from gearshift.monitoring.progress import ProgressView
from gearshift.monitoring.telemetry import JsonlSink, LogEcho
from gearshift.orchestrator.errors import GearshiftError
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.records.rundir import RunDir
from gearshift.orchestrator.control.startup import STARTUP
from gearshift.workers.state import checkpoint

log = logging.getLogger("gearshift")


class StepMerger:
    """Collects per-rank reports and releases a step, aggregated over ranks, once every rank has
    reported it. `context` (strategy, dp, tp, bucket_cap_mb) is stamped on every record."""

    _PER_STEP = ("losses", "step_times", "data_times", "comm_waits", "comm_calls", "step_ends", "lrs", "comm_hidden",
                 "pipe_waits")

    def __init__(self, world: int, global_batch: int, context: dict, tokens_per_sample: int | None = None):
        self.world = world
        self.global_batch = global_batch
        self.context = dict(context)
        # each rank's samples of a step: its replica's share (context["shares"]: a straggler's
        # rebalance, one count per replica; else even); a tensor-parallel group's ranks share one
        dp, tp = context.get("dp", world), context.get("tp", 1)
        replica = context.get("shares") or [global_batch / dp] * dp
        self.rank_share = [replica[(r % (dp * tp)) // tp] for r in range(world)]
        self.tokens_per_sample = tokens_per_sample
        self.peak_mem: dict[int, int] = {}
        self._pending: dict[int, dict[int, tuple]] = {}

    def add(self, rank: int, report: dict) -> list[dict]:
        if report.get("peak_mem_bytes") is not None:
            self.peak_mem[rank] = report["peak_mem_bytes"]
        n = len(report["losses"])
        columns = [report.get(k) or [None] * n for k in self._PER_STEP]
        done = []
        for i, values in enumerate(zip(*columns, strict=True)):
            step = report["first_step"] + i + 1  # steps are counted as completed optimizer steps
            ranks = self._pending.setdefault(step, {})
            ranks[rank] = values
            if len(ranks) == self.world:
                del self._pending[step]
                done.append(self._merge(step, [ranks[r] for r in range(self.world)]))
        return sorted(done, key=lambda r: r["step"])

    def partial(self) -> list[dict]:
        """The steps some rank never reported (it was lost), merged over the ranks that did; each
        record's `partial` lists them (its loss is over their shares of the batch alone)."""
        out = []
        for step in sorted(self._pending):
            ranks = self._pending.pop(step)
            out.append({**self._merge(step, [ranks[r] for r in sorted(ranks)]), "partial": sorted(ranks)})
        return out

    def _merge(self, step: int, per_rank: list[tuple]) -> dict:
        losses, times, data, waits, calls, ends, lrs, hidden, pipe = (list(c) for c in zip(*per_rank))
        slowest = max(range(len(per_rank)), key=lambda r: times[r])
        rate = self.global_batch / times[slowest] if times[slowest] > 0 else 0.0
        timed = all(w is not None for w in waits)  # telemetry off: only loss and step time
        fracs = [min(1.0, w / t) if t > 0 else 0.0 for w, t in zip(waits, times)] if timed else None
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return {
            "type": "step", "time": time.time(), "step": step, **self.context, "ended_at": ends[0],
            # every rank's loss is its share's mean weighted by its share of the global batch (even:
            # by one), so the mean of the ranks' losses is the loss over the whole global batch
            "loss": mean(losses), "lr": lrs[0],  # every rank steps with the same learning rate
            "step_time_max": times[slowest], "step_time_mean": mean(times), "slowest_rank": slowest,
            "data_time_mean": mean(data) if timed else None, "data_time_max": max(data) if timed else None,
            "compute_time_mean": mean([t - w - d for t, w, d in zip(times, waits, data)]) if timed else None,
            "comm_wait_mean": mean(waits) if timed else None, "comm_wait_max": max(waits) if timed else None,
            "comm_wait_frac_mean": mean(fracs) if timed else None, "comm_wait_frac_max": max(fracs) if timed else None,
            "comm_calls": max(calls) if timed else 0,
            **_hidden(hidden if timed else [None]), **_pipe(pipe if timed else [None], times),
            "samples_per_s": rate,
            "tokens_per_s": rate * self.tokens_per_sample if self.tokens_per_sample else None,
            "peak_mem_bytes": max(self.peak_mem.values()) if self.peak_mem else None,
            "ranks": {"step_time": times, "data_time": data if timed else None,
                      "compute_time": [t - w - d for t, w, d in zip(times, waits, data)] if timed else None,
                      "comm_wait": waits if timed else None, "comm_wait_frac": fracs,
                      "samples_per_s": [n / t if t > 0 else 0.0 for n, t in zip(self.rank_share, times)],
                      "share": self.rank_share[:len(times)],
                      # samples a second of the rank's own compute: what tells a straggler (adapt.stragglers)
                      "speed": [n / (t - w - d) if t - w - d > 0 else None
                                for n, t, w, d in zip(self.rank_share, times, waits, data)] if timed else None,
                      **({"bubble": [b for b, _ in pipe], "link_wait": [l for _, l in pipe]}
                         if timed and all(x is not None for x in pipe) else {})},
        }


def _hidden(per_rank: list) -> dict:
    """Where a layout measured it (hybrid's overlapped average): seconds its all-reduces ran behind
    backward, and their share of those all-reduces' time (hidden / (hidden + waited for))."""
    if any(h is None for h in per_rank):
        return {"comm_hidden_mean": None, "comm_hidden_frac_mean": None}
    fracs = [h / (h + w) if h + w > 0 else 0.0 for h, w in per_rank]
    return {"comm_hidden_mean": sum(h for h, _ in per_rank) / len(per_rank),
            "comm_hidden_frac_mean": sum(fracs) / len(fracs)}


def _pipe(per_rank: list, times: list) -> dict:
    """Where a pipeline measured it: the share of the step each stage waited for lack of work
    (the bubble) and on the link (its transfers), mean over ranks; null elsewhere."""
    if not per_rank or any(p is None for p in per_rank):
        return {"bubble_frac_mean": None, "link_wait_frac_mean": None}
    fracs = [(b / t, l / t) if t > 0 else (0.0, 0.0) for (b, l), t in zip(per_rank, times)]
    return {"bubble_frac_mean": sum(b for b, _ in fracs) / len(fracs),
            "link_wait_frac_mean": sum(l for _, l in fracs) / len(fracs)}


class RunStats:
    """Running figures of a run in constant memory, however many steps it has."""

    WARMUP = 10  # the first steps pay for allocator warm-up and lazy init: not steady state

    def __init__(self, window: int = 50):
        self.first: dict | None = None
        self.last: dict | None = None
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.recent_wait: collections.deque = collections.deque(maxlen=20)
        self.recent_pipe: collections.deque = collections.deque(maxlen=20)  # a pipeline's (bubble, link) shares
        self.steady_steps = 0
        self.steady_time = 0.0
        self.steady_wait = 0.0  # comm wait (mean over ranks) summed over the steady steps
        self.steady_mean_time = 0.0  # step time (mean over ranks), the same
        self.timed = True

    def add(self, record: dict) -> None:
        self.first = self.first or record
        self.last = record
        self.recent.append(record["step_time_max"])
        if record.get("comm_wait_frac_mean") is not None:
            self.recent_wait.append(record["comm_wait_frac_mean"])
        if record.get("bubble_frac_mean") is not None:
            self.recent_pipe.append((record["bubble_frac_mean"], record["link_wait_frac_mean"]))
        if record["step"] - self.first["step"] >= self.WARMUP:
            self.steady_steps += 1
            self.steady_time += record["step_time_max"]
            self.steady_mean_time += record["step_time_mean"]
            if record.get("comm_wait_mean") is None:
                self.timed = False
            else:
                self.steady_wait += record["comm_wait_mean"]

    def recent_rate(self, global_batch: int, window: int = 20) -> float:
        times = list(self.recent)[-window:]
        return len(times) * global_batch / sum(times) if times and sum(times) > 0 else 0.0

    def recent_comm_wait(self) -> float | None:
        return sum(self.recent_wait) / len(self.recent_wait) if self.recent_wait else None

    def recent_pipe_wait(self) -> tuple[float, float] | None:
        """A pipeline's recent (bubble, link) shares of the step, None under other layouts."""
        if not self.recent_pipe:
            return None
        n = len(self.recent_pipe)
        return sum(b for b, _ in self.recent_pipe) / n, sum(l for _, l in self.recent_pipe) / n

    def summary(self, global_batch: int) -> dict:
        steps, time_s = self.steady_steps, self.steady_time
        if not steps:  # a run shorter than the warm-up: report what there is
            steps, time_s = len(self.recent), sum(self.recent)
        return {
            "final_loss": self.last["loss"] if self.last else None,
            "first_loss": self.first["loss"] if self.first else None,
            "samples_per_s": steps * global_batch / time_s if time_s > 0 else None,
            "median_step_time_s": statistics.median(self.recent) if self.recent else None,
            # the share of the steady-state step time spent waiting on collectives
            "comm_wait_frac": self.steady_wait / self.steady_mean_time if self.timed and self.steady_steps
            and self.steady_mean_time > 0 else None,
            **({"bubble_frac": pipe[0], "link_wait_frac": pipe[1]} if (pipe := self.recent_pipe_wait()) else {}),
        }


def describe(decision) -> str:
    """One line for the terminal: what the policy decided and on what evidence."""
    ev = decision.evidence or {}
    parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items()
             if not isinstance(v, (dict, list))]
    target = getattr(decision, "to", None)
    name = getattr(decision, "kind", None) or decision.name  # a report says what it found
    head = f"{name} -> {target}" if target is not None else name
    if name == "input_bound":  # the knob that helps: loader processes read the next batches during the step
        head += ": raise data.loader.workers (and data.loader.prefetch) to read batches ahead"
    if ev.get("reason") == "memory_pressure":
        said = (f"peak memory {ev['peak_mem_bytes'] / 2**30:.3g} GiB is {ev['peak_share']:.0%} of the device's "
                f"{ev['device_memory_bytes'] / 2**30:.3g} GiB (> adapt.memory_threshold {ev['memory_threshold']:g})")
        if target is not None:
            said += (f"; predicted to need {ev['predicted_bytes'] / 2**30:.3g} GiB a rank against "
                     f"{ev['predicted_bytes_now'] / 2**30:.3g} GiB now")
        else:
            said += "; no layout predicted to need less is left"
        return head + ": " + said
    if ev.get("predictions"):
        return head + ": " + predicted_text(ev, target)
    if name in ("grow", "no_grow"):
        return f"{name} -> {layout_text(ev['to'])}: " + grow_text(ev)
    if name in ("rebalance", "straggler") and "shares_after" in ev:
        return f"{name}: " + shares_text(ev, moved=name == "rebalance")
    if name == "drop":
        return "drop: " + drop_text(decision.to_dict().get("ranks"), ev)
    if "blocks_per_stage_after" in ev:  # a pipeline's slow stage: recut, or said (report)
        return f"{name}: " + recut_text(ev, moved=name == "recut")
    if ev.get("predicted_step_s") is not None and ev.get("measured_step_s") is not None:
        parts = [f"measured {ev['measured_step_s'] * 1e3:.4g} ms a step, predicted {ev['predicted_step_s'] * 1e3:.4g}"
                 f" ({ev['prediction_error']:+.0%})"] + parts
    return head + (f" ({', '.join(parts[:6])})" if parts else "")


def shares_text(ev: dict, moved: bool) -> str:
    """adapt.stragglers in a line: who is slow, by how much, and the shares (moved, or only said)."""
    where = f"rank {ev['rank']}" + (f" on {ev['node']}" if ev.get("node") else "")
    said = (f"replica {ev['replica']} ({where}) computes {ev['speed_ratio']:.2f}x slower than the fastest since step "
            f"{ev['since_step']}" if ev.get("reason") != "recovered" else
            f"the replicas compute about as fast again (fastest / slowest {ev['speed_ratio']:.2f})")
    return (f"{said}; shares {ev['shares_before']} -> {ev['shares_after']}"
            f"{'' if moved else ' would'} predicted to cut the step {ev['measured_step_s'] * 1e3:.4g} -> "
            f"{ev['predicted_step_s'] * 1e3:.4g} ms (noise {ev['noise']:.0%})")


def recut_text(ev: dict, moved: bool) -> str:
    """A pipeline's stage rebalance in a line: the slow position, and the blocks a stage."""
    where = f"rank {ev['rank']}" + (f" on {ev['node']}" if ev.get("node") else "")
    said = (f"pipeline position {ev['position']} ({where}) computes {ev['speed_ratio']:.2f}x slower a parameter "
            f"than the fastest" if ev["reason"] == "straggler" else "the stages' speeds changed")
    return (f"{said}; blocks a stage {ev['blocks_per_stage_before']} -> {ev['blocks_per_stage_after']}"
            f"{'' if moved else ' would'} predicted to cut the step {ev['measured_step_s'] * 1e3:.4g} -> "
            f"{ev['predicted_step_s'] * 1e3:.4g} ms (noise {ev['noise']:.0%})"
            + (f" - not carried out: {ev['not_carried_out']}" if ev.get("not_carried_out") else ""))


def drop_text(ranks, ev: dict) -> str:
    """adapt.stragglers drop in a line: who goes, why, and what the step is predicted to be."""
    where = f"rank(s) {ranks}" + (f" on {ev['node']}" if ev.get("node") else "")
    why = (f"{ev['speed_ratio']:.2f}x slower than the fastest (adapt.straggler_drop_ratio {ev['drop_ratio']:g})"
           if ev.get("rule") == "ratio" else
           f"{ev['speed_ratio']:.2f}x slower, and no share of the batch makes it fast enough")
    out = (f"{where} {why} since step {ev.get('since_step')}: let go; the step predicted "
           f"{ev['measured_step_s'] * 1e3:.4g} -> {ev['predicted_step_s'] * 1e3:.4g} ms "
           f"(rebalanced instead: {ev['predicted_step_s_rebalanced'] * 1e3:.4g} ms)")
    if ev.get("held_out_steps"):
        out += f"; held out {ev['held_out_steps']} steps, then taken back to be judged again"
    return out + (f" - not carried out: {ev['not_dropped']}" if ev.get("not_dropped") else "")


def grow_text(ev: dict) -> str:
    """A grow priced by the cost model, in a line: the two predictions and what it was weighed on."""
    now, grown, left = ev["now"], ev["grown"], ev["steps_left"]
    said = (f"predicted {grown['step_s'] * 1e3:.4g} ms a step (+-{grown['error']:.0%}) on nodes of "
            f"{ev['node_sizes']} against {now['step_s'] * 1e3:.4g} ms now; gain {ev['gain_s_per_step'] * left:.3g} s "
            f"over {left} steps {'>' if ev['pays'] else 'does not pay'} "
            f"(1 + {ev['switch_margin']:g}) x the grow's {ev['grow_cost_s']:.3g} s")
    if not ev["link_measured"]:
        said += "; the link between nodes is not measured yet: taken as no faster than the node's own"
    return said


def predicted_text(ev: dict, target) -> str:
    """A decision by prediction in a line: why, what was predicted, and what the move was weighed on."""
    now, *others = ev["predictions"]
    why = {"comm_wait": f"comm wait {ev['comm_wait_frac']:.0%} of the step",
           "link_changed": f"the comm wait changed ({ev['comm_wait_s'] * 1e3:.4g} ms a step)",
           }.get(ev["reason"], "a review")
    best = min(others, key=lambda e: e["step_s"] * (1 + e["error"]), default=None)
    said = f"{why}; now {now['step_s'] * 1e3:.4g} ms a step"
    if best is not None:
        said += (f", best elsewhere {layout_text(best['layout'])} predicted {best['step_s'] * 1e3:.4g} ms "
                 f"(+-{best['error']:.0%}{', measured before' if best['measured_before'] else ''})")
    gain = ev["gain_s_per_step"] * ev["steps_left"]
    verb = ">" if target is not None else "does not pay"
    return (said + f"; gain {gain:.3g} s over {ev['steps_left']} steps {verb} "
            f"(1 + {ev['switch_margin']:g}) x switch {ev['switch_cost_s']:.3g} s")


def layout_text(d: dict) -> str:
    return f"{d['strategy']} {d['dp']}x{d['tp']}" + (f" shard {d['shard']}" if d.get("shard", 1) > 1 else "")


def setting_text(setting: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items())


class Reporter:
    """Where a run's records go: telemetry.jsonl first, then each observer (the /metrics endpoint,
    the job log); and the terminal view, when there is one. Keeps the running figures."""

    def __init__(self, job: Job, run: RunDir, view: ProgressView | None = None):
        self.job = job  # its name, telemetry settings and global batch: none of them change mid-run
        self.view = view
        self._view_started = False
        self.sink = JsonlSink(run.telemetry)
        self.stats = RunStats()
        self.observers: list = []
        self.metrics = None
        self.skipped: list[dict] = []  # steps whose loss or gradient norm was not finite
        self.profile_dir = run.profile
        self.run_path = run.path
        self.trackers: list = []  # MLflow, TensorBoard (orchestrator/tracking.py): observers too

    # ------------------------------------------------------------------ where records go

    def emit(self, record: dict) -> None:
        self.sink.write(record)
        for observer in list(self.observers):
            try:
                observer.observe(record)
            except Exception as err:  # a broken scrape endpoint or log pipe must not end the training
                log.warning("telemetry to %s stopped: %s", type(observer).__name__, err)
                self.observers.remove(observer)

    def event(self, name: str, **fields) -> None:
        self.emit({"type": "event", "event": name, **fields})

    def say(self, text: str) -> None:
        if self.view:
            self.view.say(text)

    def open(self) -> None:
        """Start the observers the job asks for (a port in use is the user's to fix, before training)."""
        tel = self.job.telemetry
        if tel.metrics_port is not None:
            from gearshift.monitoring.metrics import MetricsEndpoint

            try:
                self.metrics = MetricsEndpoint(self.job.name, tel.metrics_host, tel.metrics_port)
            except OSError as err:
                raise GearshiftError(f"telemetry.metrics_port = {tel.metrics_port}: {err}. Choose another port, "
                                     "or 0 for any free one.") from None
            self.observers.append(self.metrics)
            self.say(f"metrics: {self.metrics.url}")
        if os.environ.get("GEARSHIFT_TELEMETRY_LOG") == "1":  # a submitted job: `watch JOB_ID` reads the log
            self.observers.append(LogEcho())
        if self.metrics:
            self.event("metrics", url=self.metrics.url)
        from gearshift.orchestrator.records import tracking

        self.trackers = tracking.start(self.job, self.run_path, self)
        self.observers.extend(self.trackers)

    def start_view(self, start_step: int) -> None:
        """Once a run: a restart after a failure goes on in the view the first start opened (or opens
        it, when the first start failed before training)."""
        if self.view and not self._view_started:
            self._view_started = True
            train = self.job.train
            self.view.start(train.steps, train.global_batch_size, start_step, train.log_every)

    def close_view(self) -> None:
        if self.view:
            self.view.close()

    def close(self) -> None:
        if self.trackers:  # before the sink closes: what a tracker did not take is said in the telemetry
            from gearshift.orchestrator.records import tracking

            try:
                tracking.finish(self.trackers, self.job.tracking.close_timeout_s, self)
            except Exception as err:  # never hide how the run ended
                log.warning("tracking: could not close the trackers: %s", err)
        self.sink.close()
        for observer in self.observers:
            with contextlib.suppress(Exception):  # never hide how the run ended
                if hasattr(observer, "close"):
                    observer.close()

    # ------------------------------------------------------------------ what happened

    def step(self, record: dict) -> None:
        """A merged step: into the running figures, the telemetry and the progress line."""
        self.stats.add(record)
        if not STARTUP.reported and record.get("ended_at"):
            self._startup(record["ended_at"])
        self.emit(record)
        if self.view:
            self.view.update(record["step"], record["loss"], self.stats.recent_rate(self.job.train.global_batch_size),
                             self.stats.recent_comm_wait(), self.stats.recent_pipe_wait())

    def _startup(self, first_step_end: float) -> None:
        """The path to the first step, once a run (orchestrator/startup.py)."""
        STARTUP.mark("first_step", at=first_step_end)
        STARTUP.reported = True
        if STARTUP.marks.get("imports") is not None:  # started by the CLI, not a test's own controller
            self.event("startup", stages=STARTUP.stages(), seconds=STARTUP.stages()[-1]["at"])
            self.say(STARTUP.text())

    def samples(self, samples) -> None:
        for sample in samples:
            self.emit({"type": "sample", **sample})

    def non_finite(self, bad: dict) -> None:
        self.skipped.append(bad)
        self.event("non_finite", **bad, action="skipped the batch; the update was not applied")
        norm = "" if bad.get("grad_norm") is None else f", gradient norm {bad['grad_norm']:.4g}"
        where = (f"first non-finite output in {bad['layer']}" if not bad.get("checked")
                 else "a gradient not finite (checked on the device)")
        self.say(f"step {bad['step']}: loss {bad['loss']:.4g}{norm}: {where}; update not applied, batch skipped "
                 "(fault.on_nan = skip)")

    def grad_anomaly(self, found: dict) -> None:
        """train.grad_check found a gradient NaN/Inf or exploding: the record, and one line each."""
        self.event("grad_anomaly", **found)
        what = (f"not finite ({found['norm']})" if found["kind"] == "nonfinite" else
                f"{found['norm']:.4g}, {found['ratio']:.0f}x its median {found['median']:.4g}")
        self.say(f"step {found['step']}: gradient anomaly in {found['module']} ({found['module_type']}).{found['parameter']}"
                 f": norm {what}")
        for hint in found["suggestions"]:
            self.say(f"  - {hint}")

    def decided(self, decision, step: int, applied: int | None = None) -> None:
        """A decision, seen in the record of `step` and carried out at step boundary `applied`
        (a keep or a report takes effect where it is seen; None: a move that was not carried out)."""
        data = decision.to_dict()
        name = data.get("kind") if decision.name == "report" else decision.name
        self.event("decision", step=step, decision=name, seen_step=step, applied_step=applied,
                   **{k: v for k, v in data.items() if k not in ("name", "kind", "decision")})
        moved = decision.name in ("switch", "revert")
        later = (f" (carried out at step {applied})" if moved and applied is not None and applied != step else
                 " (not carried out)" if moved and applied is None else "")
        self.say(f"step {step}: {describe(decision)}{later}")

    def switched(self, record: dict, evidence: dict | None, old, new) -> None:
        self.event("switch", **record, **({"evidence": evidence} if evidence else {}))
        self.say(f"step {record['step']}: switched {old} -> {new} in {record['seconds']:.2f} s ({record['reason']})")

    def profiled(self, rank: int, profile: dict) -> None:
        """train.profile: a rank's trace and tables came back in its report (the worker may be on
        another machine); written whole or not at all, then announced."""
        self.profile_dir.mkdir(parents=True, exist_ok=True)
        trace, table = self.profile_dir / f"rank{rank}.trace.json", self.profile_dir / f"rank{rank}.txt"
        checkpoint.write_file_atomic(trace, profile["trace"].encode("utf-8"))
        checkpoint.write_file_atomic(table, profile["table"].encode("utf-8"))
        self.event("profile", rank=rank, trace=str(trace), table=str(table), steps=list(profile["steps"]))
        self.say(f"profile: rank {rank}, updates {profile['steps'][0]}..{profile['steps'][1]} -> {trace}")

    def evaluated(self, record: dict) -> None:
        self.emit(record)
        ppl = f", perplexity {record['perplexity']:.4g}" if record.get("perplexity") is not None else ""
        self.say(f"step {record['step']}: eval loss {record['loss']:.4f}{ppl} over {record['samples']} held-out "
                 f"samples ({record['seconds']:.2f} s)")

    def figures(self, start_step: int, bucket: float, wall: float) -> dict:
        """The summary's figures (a run that trained no step is done up to where it started)."""
        stats = self.stats
        return {"steps_done": stats.last["step"] if stats.last else start_step, "bucket_cap_mb": bucket,
                **stats.summary(self.job.train.global_batch_size), "wall_time_s": wall}
