"""The controller: an explicit state machine that places the workers, streams their reports,
writes checkpoints and the run's outputs, and tears everything down whatever happens.

    PLACING -> STARTING -> TRAINING <-> SWITCHING
                 \\            \\-> DONE
                  \\------------\\-> FAILED

Training runs in chunks that end where a layout may change: at the forced schedule's steps,
and under `strategy: auto` at the steps where the policy may decide (`next_decision`): its
decisions are carried out at once, on the same workers (`reshard`), all ranks at the same step boundary.

The worker-group class is injected, so tests can drive the controller without Ray.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import json
import logging
import re
import statistics
import time
import traceback
from typing import Callable

from monitoring.progress import ProgressView
from monitoring.telemetry import JsonlSink, LogEcho
from orchestrator.errors import GearshiftError, WorkerFailed
from orchestrator.job import Job
from orchestrator.rundir import RunDir
from orchestrator.tuner import Tuner
from workers import checkpoint

log = logging.getLogger("gearshift")


class State(enum.Enum):
    PLACING = "placing"
    STARTING = "starting"
    TRAINING = "training"
    SWITCHING = "switching"
    DONE = "done"
    FAILED = "failed"


class StepMerger:
    """Collects per-rank reports and releases a step, aggregated over ranks, once every rank has
    reported it. `context` (strategy, dp, tp, bucket_cap_mb) is stamped on every record."""

    _PER_STEP = ("losses", "step_times", "data_times", "comm_waits", "comm_calls", "step_ends")

    def __init__(self, world: int, global_batch: int, context: dict, tokens_per_sample: int | None = None):
        self.world = world
        self.global_batch = global_batch
        self.context = dict(context)
        self.local_batch = global_batch / context.get("dp", world)
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

    def _merge(self, step: int, per_rank: list[tuple]) -> dict:
        losses, times, data, waits, calls, ends = (list(c) for c in zip(*per_rank))
        slowest = max(range(self.world), key=lambda r: times[r])
        rate = self.global_batch / times[slowest] if times[slowest] > 0 else 0.0
        timed = all(w is not None for w in waits)  # telemetry off: only loss and step time
        fracs = [min(1.0, w / t) if t > 0 else 0.0 for w, t in zip(waits, times)] if timed else None
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return {
            "type": "step", "time": time.time(), "step": step, **self.context, "ended_at": ends[0],
            # every rank holds an equal share of the global batch, so the mean of the ranks'
            # mean losses is the loss over the whole global batch
            "loss": mean(losses),
            "step_time_max": times[slowest], "step_time_mean": mean(times), "slowest_rank": slowest,
            "data_time_mean": mean(data) if timed else None, "data_time_max": max(data) if timed else None,
            "compute_time_mean": mean([t - w - d for t, w, d in zip(times, waits, data)]) if timed else None,
            "comm_wait_mean": mean(waits) if timed else None, "comm_wait_max": max(waits) if timed else None,
            "comm_wait_frac_mean": mean(fracs) if timed else None, "comm_wait_frac_max": max(fracs) if timed else None,
            "comm_calls": max(calls) if timed else 0,
            "samples_per_s": rate,
            "tokens_per_s": rate * self.tokens_per_sample if self.tokens_per_sample else None,
            "peak_mem_bytes": max(self.peak_mem.values()) if self.peak_mem else None,
            "ranks": {"step_time": times, "data_time": data if timed else None,
                      "compute_time": [t - w - d for t, w, d in zip(times, waits, data)] if timed else None,
                      "comm_wait": waits if timed else None, "comm_wait_frac": fracs,
                      "samples_per_s": [self.local_batch / t if t > 0 else 0.0 for t in times]},
        }


class RunStats:
    """Running figures of a run in constant memory, however many steps it has."""

    WARMUP = 10  # the first steps pay for allocator warm-up and lazy init: not steady state

    def __init__(self, window: int = 50):
        self.first: dict | None = None
        self.last: dict | None = None
        self.recent: collections.deque = collections.deque(maxlen=window)
        self.recent_wait: collections.deque = collections.deque(maxlen=20)
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
        }


def _layout_text(layout) -> str:
    return f"{layout.strategy} dp={layout.dp} tp={layout.tp}"


def _describe(decision) -> str:
    """One line for the terminal: what the policy decided and on what evidence."""
    ev = decision.evidence or {}
    parts = [f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in ev.items()
             if not isinstance(v, (dict, list))]
    target = getattr(decision, "to", None)
    name = getattr(decision, "kind", None) or decision.name  # a report says what it found
    head = f"{name} -> {_layout_text(target)}" if target is not None else name
    return head + (f" ({', '.join(parts[:6])})" if parts else "")


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


# how Ray says an actor went down with its node (a killed worker process reads "worker process has died")
_NODE_DIED = re.compile(r"node (has )?died|node is dead|NODE_DIED|NodeDied", re.IGNORECASE)


def _setting_text(setting: dict) -> str:
    return " ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in setting.items())


class TuneRound:
    """One tuning round in progress: which trial, from which step its timed steps count, and
    the step records that fall in them."""

    def __init__(self, tuner: Tuner, step: int, layout):
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


class Controller:
    def __init__(self, job: Job, run: RunDir, group_factory: Callable[[Job], object],
                 resume: tuple[str, dict] | None = None, view: ProgressView | None = None):
        self.job = job
        self.run_dir = run
        self.group_factory = group_factory
        self.resume = resume  # (checkpoint name, state) to continue from
        self.view = view
        self.state = State.PLACING
        self.sink = JsonlSink(run.telemetry)
        self.stats = RunStats()
        # where records go besides telemetry.jsonl: the /metrics endpoint, the job log
        self.observers: list = []
        self.metrics = None
        self.layout = job.layout  # the layout in force now
        self.history: list[dict] = []
        self.switches: list[dict] = []
        self.node_sizes: list[int] = [job.cluster.num_workers]
        self.policy = None
        # bucket_cap_mb in force; with auto, tuning rounds set it (a round per layout, remembered)
        self.bucket = job.tune.start if job.parallel.bucket_cap_mb == "auto" else job.parallel.bucket_cap_mb
        self.tuning: TuneRound | None = None
        self.tuned: dict = {}       # layout -> the bucket_cap_mb its round chose
        self.tune_rounds: list[dict] = []
        self._tune_wanted = False   # the policy kept a switch: tune the new layout at the chunk's end
        self.tune_grid: dict | None = None  # `gearshift tune`: every setting of this space, then stop
        self.failures: list[dict] = []   # worker or node failures recovered from
        self.skipped: list[dict] = []    # steps whose loss or gradient norm was not finite
        self._recovering: dict | None = None  # the failure whose restart has not trained a step yet
        self.group = None
        self.infos: list[dict] = []
        self.summary: dict = {}

    def _emit(self, record: dict) -> None:
        self.sink.write(record)
        for observer in list(self.observers):
            try:
                observer.observe(record)
            except Exception as err:  # a broken scrape endpoint or log pipe must not end the training
                log.warning("telemetry to %s stopped: %s", type(observer).__name__, err)
                self.observers.remove(observer)

    def _event(self, name: str, **fields) -> None:
        self._emit({"type": "event", "event": name, **fields})

    def _enter(self, state: State, **fields) -> None:
        self.state = state
        self._event("state", state=state.value, **fields)

    def _start_observers(self) -> None:
        import os

        tel = self.job.telemetry
        if tel.metrics_port is not None:
            from monitoring.metrics import MetricsEndpoint

            try:
                self.metrics = MetricsEndpoint(self.job.name, tel.metrics_host, tel.metrics_port)
            except OSError as err:
                raise GearshiftError(f"telemetry.metrics_port = {tel.metrics_port}: {err}. Choose another port, "
                                     "or 0 for any free one.") from None
            self.observers.append(self.metrics)
            if self.view:
                self.view.say(f"metrics: {self.metrics.url}")
        if os.environ.get("GEARSHIFT_TELEMETRY_LOG") == "1":  # a submitted job: `watch JOB_ID` reads the log
            self.observers.append(LogEcho())

    def run(self) -> dict:
        job = self.job
        t0 = time.time()
        start_step = 0
        self.group = None
        summary = {"job": job.name, "fingerprint": job.fingerprint(), "run_dir": str(self.run_dir.path),
                   "steps_target": job.train.steps}
        self.summary = summary
        try:
            self.run_dir.write_driver()
            self._start_observers()
            if self.metrics:
                self._event("metrics", url=self.metrics.url)
            resume, failures = self.resume, 0
            while True:
                try:
                    start_step = self._start(resume, restart=failures > 0)
                    self._train(self.group, start_step)
                    break
                except WorkerFailed as err:
                    failures += 1
                    resume = self._recover(err, failures)  # raises when it is not to be recovered
            final_state = self.group.call("state")[0]  # every rank takes part in gathering shards
            self._save_checkpoint(final_state)
            checkpoint.write_file_atomic(self.run_dir.final, checkpoint.torch_bytes(final_state["model"]))
            self._enter(State.DONE, step=final_state["step"])
            summary["status"] = "done"
        except BaseException as err:  # whatever ends the run, the run dir says so
            interrupted = isinstance(err, (KeyboardInterrupt, SystemExit))
            summary["status"] = "interrupted" if interrupted else "failed"
            summary["error"] = (f"interrupted ({err})" if interrupted and str(err) else
                                "interrupted by the user" if interrupted else
                                str(err) if isinstance(err, GearshiftError) else f"{type(err).__name__}: {err}")
            if isinstance(err, WorkerFailed) and err.details:
                self.run_dir.log.write_text(err.details)
            elif not interrupted and not isinstance(err, GearshiftError):
                self.run_dir.log.write_text("".join(traceback.format_exception(err)))
            self._enter(State.FAILED, error=summary["error"])
            raise
        finally:
            if self.view:
                self.view.close()
            if self.group is not None:
                self.group.shutdown(polite=self.state is State.DONE)
            summary.update(self._figures(start_step, time.time() - t0))
            self.run_dir.write_summary(summary)
            self.sink.close()
            for observer in self.observers:
                with contextlib.suppress(Exception):  # never hide how the run ended
                    if hasattr(observer, "close"):
                        observer.close()
        return summary

    def _start(self, resume: tuple[str, dict] | None, restart: bool = False) -> int:
        """Place and start a worker group for self.job, restore `resume` into it; the step it is at."""
        job, summary = self.job, self.summary
        self._enter(State.PLACING, workers=job.cluster.num_workers, placement=job.cluster.placement)
        self.group = group = self.group_factory(job)
        infos = group.start()
        keys = ("rank", "dp_rank", "node_ip", "node_id", "pid", "gpu_ids", "backend")
        layout = job.layout
        self._enter(State.STARTING, workers=[{k: i.get(k) for k in keys} for i in infos],
                    layout=layout.to_dict(),
                    tp_groups=layout.tp_groups() if layout.tp > 1 else [])
        for info in infos:
            if info.get("sampler") and not restart:
                self._event("sampler", rank=info["rank"], **info["sampler"])
        self.tokens_per_sample = infos[0].get("tokens_per_sample")
        self.infos = infos
        start_step = 0
        if resume:
            name, state = resume
            ref = group.put(state)
            start_step = group.call("load", ref)[0]
            self._event("restored" if restart else "resumed", checkpoint=name, step=start_step)
        before = self.layout if restart else None
        self.layout = layout
        if restart:  # the layout and bucket in force when the workers were lost come back
            self.bucket = job.tune.start if job.parallel.bucket_cap_mb == "auto" else job.parallel.bucket_cap_mb
            if before is not None and before != layout and before.world == layout.world:
                self._switch(group, before, start_step, "restore")
            self.history = [h for h in self.history if h["step"] < start_step]
            self.history.append(self._history_entry(start_step, self.layout))
        else:
            self.history = self._earlier_history(start_step) + [self._history_entry(start_step, layout)]
        summary.update(world_size=len(infos), backend=infos[0].get("backend"),
                       nodes=sorted({i["node_ip"] for i in infos}), parameters=infos[0].get("parameters"),
                       strategy_history=self.history, switches=self.switches, tuning=self.tune_rounds,
                       failures=self.failures, non_finite_steps=self.skipped)
        summary.setdefault("resumed_from_step", start_step if resume and not restart else None)
        self.node_sizes = self._node_sizes(infos)
        self._enter(State.TRAINING, from_step=start_step, steps_target=job.train.steps)
        if self.view and not restart:
            self.view.start(job.train.steps, job.train.global_batch_size, start_step, job.train.log_every)
        return start_step

    def _recover(self, err: WorkerFailed, failures: int) -> tuple[str, dict] | None:
        """After a lost, silent or disconnected worker: tear the group down (no survivor is left
        blocked in a collective: every actor is killed), pick what to continue on, and return the
        latest checkpoint that verifies (None: from the start). Raises `err` when the failure is
        not one a restart can fix, or the job's fault.max_failures is used up."""
        job, f = self.job, self.job.fault
        detected = time.time()
        failed_at = self.stats.last["step"] if self.stats.last else 0
        self.tuning, self._tune_wanted = None, False
        group, self.group = self.group, None
        dead: dict[int, str] = {}
        if group is not None:
            if err.recoverable and hasattr(group, "dead_ranks"):
                # the first error may come from a survivor ("connection reset"): who is really gone?
                with contextlib.suppress(Exception):
                    dead = group.dead_ranks()
            group.shutdown(polite=False)
        if not err.recoverable or (f.max_failures != -1 and failures > f.max_failures):
            if err.recoverable:
                self._event("failure", step=failed_at, rank=err.rank, kind=err.kind, error=err.reason,
                            failures=failures, max_failures=f.max_failures, action="stop")
            raise err
        lost = self._lost_nodes(err, dead)
        found = checkpoint.load_latest(self.run_dir.checkpoints)
        restore_step = found[1]["step"] if found else 0
        action = f"restart from step {restore_step}" + (f" ({found[0].name})" if found else " (no checkpoint yet)")
        if lost:
            job, how = self._after_node_loss(job, lost)
            action += f"; {how}"
        self.job = job
        self._event("failure", step=failed_at, rank=err.rank, kind=err.kind, error=err.reason, failures=failures,
                    max_failures=f.max_failures, lost_nodes=lost, dead_ranks=sorted(dead), action=action,
                    steps_to_recompute=max(0, failed_at - restore_step))
        self.failures.append({"step": failed_at, "detected": detected, "kind": err.kind, "rank": err.rank,
                              "restored_step": restore_step, "lost_nodes": lost})
        self._recovering = self.failures[-1]
        if self.view:
            self.view.say(f"step {failed_at}: {err} -> {action} (failure {failures} of "
                          f"{'unlimited' if f.max_failures == -1 else f.max_failures})")
        return (found[0].name, found[1]) if found else None

    def _lost_nodes(self, err: WorkerFailed, dead: dict[int, str]) -> list[str]:
        """Nodes that held workers of the failed group and are gone, as Ray sees them. Ray marks a
        node dead after its health checks fail, some seconds after its processes went: wait for
        that a while when a worker's death is put down to its node, briefly otherwise."""
        held = {i.get("node_id"): i.get("node_ip") for i in self.infos if i.get("node_id")}
        if not held or (err.kind != WorkerFailed.DIED and not dead):
            return []
        try:
            import ray

            said = " ".join([err.details or "", *dead.values()])
            patience = 30.0 if _NODE_DIED.search(said) else 2.0
            deadline = time.monotonic() + patience
            while True:
                alive = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
                gone = [f"{ip} ({nid[:8]})" for nid, ip in held.items() if nid not in alive]
                if gone or time.monotonic() > deadline:
                    return gone
                time.sleep(0.5)
        except Exception:  # no Ray (a test's fake group), or it cannot say: treat it as a worker loss
            return []

    def _after_node_loss(self, job: Job, lost: list[str]) -> tuple[Job, str]:
        """fault.on_node_loss: wait for a replacement (placement waits up to replacement_timeout_s),
        or shrink to the workers that fit what is left."""
        f = job.fault
        if f.on_node_loss == "wait":
            cluster = dataclasses.replace(job.cluster, placement_timeout_s=max(f.replacement_timeout_s, 1.0))
            return (dataclasses.replace(job, cluster=cluster),
                    f"node {', '.join(lost)} lost: waiting up to {f.replacement_timeout_s:g} s for a replacement "
                    f"(fault.on_node_loss = wait)")
        import ray

        from orchestrator.worker_group import worker_bundle
        from strategies.layout import Layout, LayoutError

        # what the nodes still alive hold, worker by worker (our own group is gone, so its share counts)
        bundle = worker_bundle(job)
        free = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        fit = sum(min(int(r.get(k, 0) // v) for k, v in bundle.items() if v > 0) for r in free)
        batch, n = job.train.global_batch_size, min(fit, job.cluster.num_workers)
        while n > 0 and batch % n:
            n -= 1
        if n < 1:
            raise GearshiftError(f"node {', '.join(lost)} was lost and what is left cannot hold one worker of "
                                 f"{bundle} (free: {free}); fault.on_node_loss = shrink has nothing to shrink to")
        parallel = job.parallel
        try:
            Layout.for_workers(job.layout.strategy, n, job.parallel.tp_size)
        except LayoutError:  # a tensor-parallel size the fewer workers cannot hold: data parallel
            parallel = dataclasses.replace(parallel, strategy="data", tp_size=None)
        job = dataclasses.replace(job, cluster=dataclasses.replace(job.cluster, num_workers=n), parallel=parallel)
        return job, (f"node {', '.join(lost)} lost: continuing on {n} worker(s) (fault.on_node_loss = shrink; the "
                     f"global batch stays {batch})")

    def _earlier_history(self, start_step: int) -> list[dict]:
        """A resumed run keeps the layouts its earlier legs used before the resume point."""
        if not self.resume or not self.run_dir.summary.is_file():
            return []
        try:
            old = json.loads(self.run_dir.summary.read_text()).get("strategy_history", [])
        except ValueError:
            return []
        return [h for h in old if h.get("step", 0) < start_step]

    def _history_entry(self, step: int, layout) -> dict:
        return {"step": step, **layout.to_dict(),
                "bucket_cap_mb": self.bucket}

    def _node_sizes(self, infos: list[dict]) -> list[int]:
        """Workers per node in rank order: simulated nodes (inject.nodes) when the job asks for them."""
        w, k = self.job.cluster.num_workers, self.job.inject.nodes
        if k > 1:
            return [w // k] * k
        sizes: list[int] = []
        last = None
        for info in infos:
            node = info.get("node_id") or info.get("node_ip")
            if node != last:
                sizes.append(0)
                last = node
            sizes[-1] += 1
        return sizes or [w]

    def _merger(self) -> StepMerger:
        job, layout = self.job, self.layout
        context = {**layout.to_dict(), "bucket_cap_mb": self.bucket}
        return StepMerger(job.cluster.num_workers, job.train.global_batch_size, context,
                          getattr(self, "tokens_per_sample", None))

    def _scheduled_layout(self, step: int):
        """The layout the forced schedule has in force at `step` (None: the schedule says nothing)."""
        from strategies.layout import Layout

        entries = [e for e in self.job.adapt.schedule if e["step"] <= step]
        if not entries:
            return None
        e = entries[-1]
        return Layout.for_workers(e["strategy"], self.job.cluster.num_workers, e["tp_size"])

    def _make_policy(self):
        from orchestrator.policy import AdaptConfig, Policy, candidate_layouts

        from workers import components
        from workers.components import ComponentError

        job, a = self.job, self.job.adapt

        def shardable(tp: int) -> bool:  # a model that cannot be split tp ways is not a candidate
            try:
                components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, tp, [job.base_dir])
                return True
            except ComponentError:
                return False

        config = AdaptConfig(threshold=a.threshold, window=a.window, cooldown=a.cooldown)
        candidates = candidate_layouts(job.cluster.num_workers, self.node_sizes, tp_ok=shardable)
        self._event("policy", candidates=[c.to_dict() for c in candidates],
                    node_sizes=self.node_sizes, threshold=a.threshold, window=a.window, cooldown=a.cooldown)
        return Policy(config, candidates, self.layout)

    def _train(self, group, start_step: int) -> None:
        job = self.job
        total, step = job.train.steps, start_step
        # a resumed run continues in the layout its schedule had in force at the resume point
        resumed_layout = self._scheduled_layout(start_step) if start_step else None
        if resumed_layout is not None and resumed_layout != self.layout:
            self._switch(group, resumed_layout, step, "schedule (resume)")
        schedule = [e for e in job.adapt.schedule if e["step"] > start_step]
        auto = job.parallel.strategy == "auto" and job.adapt.enabled and self.tune_grid is None
        self.policy = self._make_policy() if auto else None
        self._train_start = start_step
        if self.tune_grid is not None:
            self._start_tuning(group, step, Tuner(self.tune_grid, mode="grid"), "grid")
        else:
            self._maybe_tune(group, step)
        while step < total:
            until = total
            if schedule:
                until = min(until, schedule[0]["step"])
            if self.tuning is not None:  # end the chunk where the trial ends
                until = min(until, self.tuning.trial_end)
            elif self.policy is not None:  # end the chunk where the policy may decide
                until = min(until, self.policy.next_decision(step))
            pending = self._train_chunk(group, until)
            step = until
            if self.tuning is not None and step >= self.tuning.trial_end:
                self._tune_trial_done(group, step)
                if self.tune_grid is not None and self.tuning is None:
                    break  # `gearshift tune`: every setting has been tried
            if step >= total:
                break
            switched = False
            if self.tuning is not None and (schedule and schedule[0]["step"] == step or pending is not None):
                self._abandon_tuning(step)  # a new layout is coming: its own round follows
            if schedule and schedule[0]["step"] == step:
                self._switch(group, self._scheduled_layout(step), step, "schedule")
                schedule.pop(0)
                switched = True
            elif pending is not None:
                self._switch(group, pending.to, step, pending.name, pending.evidence)
                switched = True
            if self.policy is not None and (pending is not None or self.switches and self.switches[-1]["step"] == step):
                self.policy.switched(self.layout, step)
            if switched and pending is not None and pending.name == "revert":
                self._maybe_tune(group, step, only_remembered=True)  # back on a layout tuned before
            elif switched and (pending is None or self.policy is None):
                self._maybe_tune(group, step)  # a forced switch: nothing judges it, tune at once
            elif self._tune_wanted:
                self._maybe_tune(group, step)  # the policy kept its switch: tune the layout it kept
            self._tune_wanted = False

    def _train_chunk(self, group, until: int):
        """Train to `until`; the first switch or revert the policy asks for on the way, if any."""
        job = self.job
        merger = self._merger()
        pending = None
        for rank, report in group.train(until, job.checkpoint.every, last_step=job.train.steps):
            for sample in report.get("samples", ()):
                self._emit({"type": "sample", **sample})
            if rank == 0:  # every rank saw the same bad step (their gradient norms agree)
                for bad in report.get("non_finite", ()):
                    self.skipped.append(bad)
                    self._event("non_finite", **bad, action="skipped the batch; the update was not applied")
                    if self.view:
                        self.view.say(f"step {bad['step']}: loss {bad['loss']:.4g}, gradient norm "
                                      f"{bad['grad_norm']:.4g}: first non-finite output in {bad['layer']}; "
                                      "update not applied, batch skipped (fault.on_nan = skip)")
            for record in merger.add(rank, report):
                if self._recovering is not None:
                    self._recovered(record)
                self.stats.add(record)
                self._emit(record)
                if self.view:
                    self.view.update(record["step"], record["loss"], self.stats.recent_rate(job.train.global_batch_size),
                                     self.stats.recent_comm_wait())
                if self.tuning is not None:
                    self.tuning.add(record)
                elif self.policy is not None:
                    decision = self.policy.observe(record)
                    if decision.name != "keep" or decision.evidence:  # a kept switch is news too
                        self._decided(decision, record["step"])
                        if pending is None and decision.name in ("switch", "revert"):
                            pending = decision
                        if decision.name == "keep":
                            self._tune_wanted = True
            if "checkpoint" in report:
                self._save_checkpoint(report["checkpoint"])
        return pending

    # ------------------------------------------------------------------ bucket_cap_mb tuning

    def _maybe_tune(self, group, step: int, only_remembered: bool = False) -> None:
        """With bucket_cap_mb auto: a round on the layout now in force (none for a layout with no
        data-parallel all-reduce), or the value a round on this layout chose before."""
        job = self.job
        if job.parallel.bucket_cap_mb != "auto" or self.layout.dp == 1 or step >= job.train.steps:
            return
        if self.layout in self.tuned:
            self._apply_bucket(group, self.tuned[self.layout], step)
            return
        if only_remembered:
            return
        values, same = distinct_buckets(job.tune.bucket_values, self.summary.get("parameters"), self.layout.tp)
        start = min(values, key=lambda v: abs(v - min(self.bucket, values[-1])))
        tuner = Tuner({"bucket_cap_mb": values}, start={"bucket_cap_mb": start}, mode="search",
                      max_trials=job.tune.max_trials)
        self._start_tuning(group, step, tuner, "search", same_as=same)

    def _start_tuning(self, group, step: int, tuner: Tuner, mode: str, same_as: dict | None = None) -> None:
        self.tuning = TuneRound(tuner, step, self.layout)
        self._event("tune_start", step=step, mode=mode, space=tuner.space, pinned=tuner.pinned, same_as=same_as or {},
                    layout=self.layout.to_dict(),
                    warmup_steps=self.job.tune.warmup_steps, trial_steps=self.job.tune.trial_steps,
                    max_trials=tuner.max_trials)
        self._next_trial(group, step)

    def _next_trial(self, group, step: int) -> None:
        round_, t = self.tuning, self.job.tune
        setting = round_.tuner.next()
        if setting is None:
            self._finish_tuning(group, step)
            return
        changed = self._apply_setting(group, setting, step)
        # a changed setting warms up first, as do the run's first steps; a value already in
        # force on warm workers is timed at once
        warm = not changed and step != self._train_start
        round_.begin(step, 0 if warm else t.warmup_steps, t.trial_steps, setting)

    def _tune_trial_done(self, group, step: int) -> None:
        round_ = self.tuning
        score, evidence = round_.score(self.job.train.global_batch_size)
        trial = round_.tuner.report(score, **evidence)
        self._event("tune_trial", step=step, **trial.to_dict())
        if self.view:
            wait = evidence["comm_wait_frac"]
            self.view.say(f"step {step}: tune trial {_setting_text(trial.setting)}: {score:,.1f} samples/s"
                          + (f", comm wait {wait:.0%}" if wait is not None else ""))
        self._next_trial(group, step)

    def _finish_tuning(self, group, step: int) -> None:
        round_, self.tuning = self.tuning, None
        best = round_.tuner.best()
        trials = [t.to_dict() for t in round_.tuner.trials]
        entry = {"step": step, "started": round_.started, "mode": "grid" if self.tune_grid is not None else "search",
                 "layout": round_.layout.to_dict(),
                 "best": best.to_dict() if best else None, "trials": trials}
        self.tune_rounds.append(entry)
        self._event("tuned", **entry)
        if self.tune_grid is not None or best is None:
            return
        self.tuned[self.layout] = best.setting["bucket_cap_mb"]
        if self.view:
            self.view.say(f"step {step}: tuned bucket_cap_mb = {best.setting['bucket_cap_mb']:g} on "
                          f"{_layout_text(self.layout)} ({best.score:,.1f} samples/s, {len(trials)} trials)")
        self._apply_bucket(group, best.setting["bucket_cap_mb"], step)
        if self.policy is not None:
            self.policy.resume_at(step)

    def _abandon_tuning(self, step: int) -> None:
        round_, self.tuning = self.tuning, None
        self._event("tune_abandoned", step=step, started=round_.started,
                    trials=[t.to_dict() for t in round_.tuner.trials])

    def _apply_setting(self, group, setting: dict, step: int) -> bool:
        """Put a tuning setting in force: a layout (grid tuning) and a bucket size. True if it changed anything."""
        from strategies.layout import Layout

        layout = self.layout
        if "strategy" in setting:
            layout = Layout.for_workers(setting["strategy"], self.job.cluster.num_workers,
                                        setting.get("tp_size", self.job.parallel.tp_size)
                                        if setting["strategy"] != "data" else None)
        bucket = setting.get("bucket_cap_mb", self.bucket)
        if layout == self.layout and bucket == self.bucket:
            return False
        if layout != self.layout:
            self._switch(group, layout, step, "tune", bucket=bucket)
        else:
            self._apply_bucket(group, bucket, step)
        return True

    def _apply_bucket(self, group, bucket: float, step: int) -> None:
        if bucket == self.bucket:
            return
        results = group.call("reshard", self.layout.to_dict(), bucket)
        old, self.bucket = self.bucket, bucket
        self.history.append(self._history_entry(step, self.layout))
        self._event("bucket", step=step, bucket_cap_mb=bucket, previous=old,
                    seconds=max(r["seconds"] for r in results))

    def _recovered(self, record: dict) -> None:
        f, self._recovering = self._recovering, None
        f["seconds_to_training"] = time.time() - f["detected"]
        f["steps_recomputed"] = max(0, f["step"] - f["restored_step"])
        self._event("recovered", step=record["step"], restored_step=f["restored_step"],
                    seconds_since_detected=f["seconds_to_training"], steps_recomputed=f["steps_recomputed"],
                    world_size=self.job.cluster.num_workers)
        if self.view:
            self.view.say(f"step {record['step']}: training again {f['seconds_to_training']:.1f} s after the failure "
                          f"was detected ({f['steps_recomputed']} step(s) to compute again)")

    def _decided(self, decision, step: int) -> None:
        data = decision.to_dict()
        name = data.get("kind") if decision.name == "report" else decision.name
        self._event("decision", step=step, decision=name, **{k: v for k, v in data.items() if k not in ("name", "kind", "decision")})
        if self.view:
            self.view.say(f"step {step}: {_describe(decision)}")

    def _switch(self, group, target, step: int, reason: str, evidence: dict | None = None,
                bucket: float | None = None) -> None:
        """Carry out a layout change on the running workers, at step boundary `step`."""
        old = self.layout
        self._enter(State.SWITCHING, step=step, to=target.to_dict())
        results = group.call("reshard", target.to_dict(), bucket)
        seconds = max(r["seconds"] for r in results)
        self.layout = target
        if bucket is not None:
            self.bucket = bucket
        record = {"step": step, "from": old.to_dict(),
                  "to": target.to_dict(), "seconds": seconds,
                  "reason": reason}
        self.switches.append(record)
        self.history.append(self._history_entry(step, target))
        self._event("switch", **record, **({"evidence": evidence} if evidence else {}))
        if self.view:
            self.view.say(f"step {step}: switched {_layout_text(old)} -> {_layout_text(target)} in {seconds:.2f} s "
                          f"({reason})")
        self._enter(State.TRAINING, from_step=step, steps_target=self.job.train.steps)

    def _save_checkpoint(self, state: dict) -> None:
        path = checkpoint.save(self.run_dir.checkpoints, state["step"], state, self.job.checkpoint.keep,
                               meta={"fingerprint": self.job.fingerprint()})
        self._event("checkpoint", step=state["step"], path=str(path))

    def _figures(self, start_step: int, wall: float) -> dict:
        return {"steps_done": self.stats.last["step"] if self.stats.last else start_step, "bucket_cap_mb": self.bucket,
                **self.stats.summary(self.job.train.global_batch_size), "wall_time_s": wall}
