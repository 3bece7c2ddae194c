"""Experiment tracking: the run's records, fed to MLflow and TensorBoard from the controller.

`start(job, run, report)` hands the Reporter one observer per tracker the job asks for
(`tracking.mlflow`, `tracking.tensorboard`). Each is a `Pump`: `observe` only appends the record
to a bounded queue (the oldest are dropped, and counted, when a tracker falls that far behind),
and one background thread per tracker turns what has queued into batched calls. Nothing here runs
on the workers, and nothing here can stop or slow the controller: a tracker that is down at the
start or goes down later costs a warning, a `tracking` event, retries with backoff, and at the end
a line saying what was not sent. The run directory holds everything anyway (telemetry.jsonl,
summary.json, final.pt); a tracker is a copy for people to browse and compare.

MLflow gets one run per gearshift run (named NAME-FINGERPRINT; a resumed run continues its MLflow
run), the job as job.yaml writes it (`${VAR}` as typed, credentials masked) flattened as
parameters (`optimizer.lr`), per-step metrics with the step
number, decisions and switches as tags and as JSON tables, and at the end summary.json, job.yaml,
the report's PNGs and final.pt as artifacts. TensorBoard gets the same scalars in
RUN_DIR/tensorboard/, so `tensorboard --logdir runs/` shows every run.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import math
import os
import pathlib
import threading
import time

from gearshift.orchestrator.errors import GearshiftError, UsageError
from gearshift.orchestrator.job import credentials

log = logging.getLogger("gearshift")

# step-record field -> metric name; eval records give eval_loss and eval_perplexity
STEP_METRICS = {"loss": "loss", "lr": "lr", "samples_per_s": "samples_per_s", "tokens_per_s": "tokens_per_s",
                "comm_wait_frac_mean": "comm_wait_frac", "step_time_max": "step_time_s"}
EVAL_METRICS = {"loss": "eval_loss", "perplexity": "eval_perplexity"}
CONNECT_WAIT_S = 15.0  # how long the start waits to hear whether a tracker answers (sqlite creates its tables)
MAX_BACKOFF_S = 30.0
# MLflow's HTTP client retries a dead server for minutes by default; the pump retries itself
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}


def check_installed(job) -> None:
    """A job that asks for a tracker whose package is missing: exit 2 before anything starts."""
    missing = [pkg for pkg, wanted in (("mlflow", job.tracking.mlflow), ("tensorboard", job.tracking.tensorboard))
               if wanted and importlib.util.find_spec(pkg) is None]
    if missing:
        keys = " and ".join(f"tracking.{m}" for m in missing)
        raise UsageError(f"{keys} needs the {' and '.join(missing)} package{'s' if len(missing) > 1 else ''}, which "
                         f"this Python does not have. Install it with `pip install 'gearshift[tracking]'`, or "
                         f"drop {keys} from the job (--set tracking.{missing[0]}="
                         f"{'null' if missing[0] == 'mlflow' else 'false'}).")


def metrics_of(record: dict) -> list[tuple[str, float, int]]:
    """(name, value, step) for the numbers of a step or eval record that are worth a chart."""
    names = STEP_METRICS if record.get("type") == "step" else EVAL_METRICS if record.get("type") == "eval" else {}
    out = []
    for field, name in names.items():
        value = record.get(field)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((name, float(value), int(record["step"])))
    return out


def event_text(record: dict) -> str | None:
    """A decision or a switch in one line (a tag value, a TensorBoard text); None for other events."""
    if record.get("event") == "switch":
        return f"{_layout(record.get('from'))} -> {_layout(record.get('to'))} ({record.get('reason')}, " \
               f"{record.get('seconds', 0):.2f} s)"
    if record.get("event") == "decision":
        to = f" -> {_layout(record['to'])}" if record.get("to") else ""
        return f"{record.get('decision')}{to}"
    return None


def _layout(d) -> str:
    return f"{d.get('strategy')} {d.get('dp')}x{d.get('tp')}" if isinstance(d, dict) else str(d)


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    """The resolved job as MLflow parameters: `optimizer.lr` -> "0.001"."""
    out = {}
    for key, value in d.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else str(value)
    return out


class Pump:
    """A bounded queue of records and the thread that feeds them to one tracker (a sink with
    `connect()`, `send(records)` and `finish()`), in batches, retrying with backoff."""

    def __init__(self, sink, capacity: int, interval_s: float = 1.0):
        self.sink = sink
        self.name = sink.name
        self.capacity = capacity
        self.interval_s = interval_s
        self.queue: collections.deque = collections.deque()
        self.lock = threading.Lock()
        self.wake = threading.Event()  # close() cuts a wait short
        self.attempted = threading.Event()  # the first connection attempt is over
        self.connected = False
        self.closing = False
        self.finished = False
        self.sent = self.dropped = self.failures = 0
        self.error: str | None = None
        self.thread = threading.Thread(target=self._serve, name=f"gearshift-{self.name}", daemon=True)

    def start(self) -> "Pump":
        self.thread.start()
        return self

    def observe(self, record: dict) -> None:
        if self.closing:
            return
        with self.lock:
            if len(self.queue) >= self.capacity:
                self.queue.popleft()
                self.dropped += 1
            self.queue.append(record)

    def close(self, timeout_s: float = 30.0) -> dict:
        """Send what is queued and the artifacts, waiting at most `timeout_s`; what was not sent."""
        if not self.closing:
            self.closing = True
            self.wake.set()
            self.thread.join(timeout_s)
        return self.outcome()

    def outcome(self) -> dict:
        with self.lock:
            unsent = len(self.queue)
        return {"tracker": self.name, "sent": self.sent, "unsent": unsent, "dropped": self.dropped,
                "artifacts": self.finished, "error": self.error}

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        backoff = min(1.0, MAX_BACKOFF_S)
        while True:
            ok = self._attempt()
            if ok and self.closing and not self.queue:
                self.finished = self._run(self.sink.finish)
                return
            if not ok and self.closing:  # down at the end: one try was all it gets
                return
            if ok:
                backoff = min(1.0, MAX_BACKOFF_S)
                self.wake.wait(self.interval_s)
            else:
                self.wake.wait(backoff)
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _attempt(self) -> bool:
        """Connect if need be, then send what has queued; False when the tracker did not take it."""
        if not self.connected:
            self.connected = self._run(self.sink.connect)
            self.attempted.set()
            if not self.connected:
                return False
        while True:
            with self.lock:
                batch = [self.queue.popleft() for _ in range(min(len(self.queue), 500))]
            if not batch:
                return True
            if not self._run(self.sink.send, batch):
                with self.lock:  # back to the front, as far as there is room
                    room = max(0, self.capacity - len(self.queue))
                    self.dropped += len(batch) - min(room, len(batch))
                    self.queue.extendleft(reversed(batch[len(batch) - min(room, len(batch)):]))
                return False
            self.sent += len(batch)

    def _run(self, fn, *args) -> bool:
        try:
            fn(*args)
        except Exception as err:  # whatever a tracker raises, training goes on
            self.failures += 1
            first = self.error is None
            said = credentials.scrub(str(err).splitlines()[0]) if str(err) else ""  # a URL may carry a password
            self.error = f"{type(err).__name__}: {said}"[:300]
            if first or self.failures % 20 == 0:
                log.warning("tracking: %s: %s (retrying with backoff; training goes on)", self.name, self.error)
            return False
        self.error = None
        return True


class MlflowSink:
    """One MLflow run per gearshift run, through `MlflowClient` (no global state of mlflow's)."""

    name = "mlflow"

    def __init__(self, job, run_dir: pathlib.Path):
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        self.job = job
        self.run_dir = pathlib.Path(run_dir)
        cfg = job.tracking.mlflow
        self.uri = cfg["tracking_uri"] or os.environ.get("MLFLOW_TRACKING_URI") or \
            f"sqlite:///{(self.run_dir.parent / 'mlflow.db').resolve()}"
        self.experiment = cfg["experiment"]
        self.shown_uri = credentials.mask_url(self.uri)  # what is said and written: no password in it
        self.client = None
        self.run_id: str | None = None
        self.tables: dict[str, list] = {"decisions": [], "switches": []}
        self._params_logged = False

    def connect(self) -> None:
        from mlflow import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            location = None
            if self.uri.startswith("sqlite:///"):  # artifacts beside the database, not in the current folder
                location = (pathlib.Path(self.uri[len("sqlite:///"):]).parent / "mlartifacts").resolve().as_uri()
            exp_id = client.create_experiment(self.experiment, artifact_location=location)
        else:
            exp_id = found.experiment_id
        self.run_id = self._resume(client) or client.create_run(
            exp_id, run_name=f"{self.job.name}-{self.job.fingerprint()}",
            tags={"gearshift.run_dir": str(self.run_dir.resolve()), "gearshift.fingerprint": self.job.fingerprint(),
                  "gearshift.job": self.job.name}).info.run_id
        self._remember()
        self.client = client
        if not self._params_logged:
            self._log_params()

    def _resume(self, client) -> str | None:
        """A resumed gearshift run continues the MLflow run it started, where that run is known."""
        try:
            known = json.loads((self.run_dir / "tracking.json").read_text())
        except (OSError, ValueError):
            return None
        if known.get("uri") != self.shown_uri or not known.get("run_id"):
            return None
        client.update_run(known["run_id"], status="RUNNING")
        return known["run_id"]

    def _remember(self) -> None:
        (self.run_dir / "tracking.json").write_text(json.dumps({"uri": self.shown_uri, "run_id": self.run_id}))

    def _log_params(self) -> None:
        from mlflow.entities import Param

        # as job.yaml holds it: a credential or a value read for ${VAR} is never a parameter
        params = [Param(k, v[:6000]) for k, v in sorted(flatten(self.job.written()).items())]
        for i in range(0, len(params), 100):  # log_batch takes at most 100 parameters
            self.client.log_batch(self.run_id, params=params[i:i + 100], synchronous=True)
        self._params_logged = True

    def send(self, records: list[dict]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics, tags, rows = [], [], []
        for record in records:
            ms = int(record.get("time", time.time()) * 1000)
            metrics += [Metric(name, value, ms, step) for name, value, step in metrics_of(record)]
            text = event_text(record) if record.get("type") == "event" else None
            if text is not None:
                rows.append(record)
                tags.append(RunTag(f"gearshift.{record['event']}.{record.get('step')}", text[:5000]))
        for i in range(0, len(metrics), 1000):  # log_batch takes at most 1000 metrics, 100 tags
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000], synchronous=True)
        for i in range(0, len(tags), 100):
            self.client.log_batch(self.run_id, tags=tags[i:i + 100], synchronous=True)
        for record in rows:  # once sent: a retried batch is not counted twice
            self.tables["switches" if record["event"] == "switch" else "decisions"].append(record)

    def finish(self) -> None:
        """The artifacts, the tables, and the run's end status (from summary.json)."""
        status = "FINISHED"
        summary = self.run_dir / "summary.json"
        if summary.is_file():
            state = json.loads(summary.read_text()).get("status")
            status = {"done": "FINISHED", "interrupted": "KILLED"}.get(state, "FAILED")
            self.client.log_artifact(self.run_id, str(summary))
        for name in ("job.yaml", "final.pt"):
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))
        for name, rows in self.tables.items():
            if rows:
                self.client.log_dict(self.run_id, rows, f"{name}.json")
        for png in self._report_pngs():
            self.client.log_artifact(self.run_id, str(png), "report")
        self.client.set_terminated(self.run_id, status)

    def _report_pngs(self) -> list[pathlib.Path]:
        from gearshift.monitoring import report
        from gearshift.monitoring.telemetry import TelemetryError

        if not (self.run_dir / "telemetry.jsonl").is_file():
            return []
        try:
            return [pathlib.Path(p) for p in report.make_report(self.run_dir).paths]
        except (TelemetryError, OSError, ValueError) as err:  # a run with no steps has nothing to plot
            log.warning("tracking: mlflow: no report plots (%s)", err)
            return []


class TensorboardSink:
    """Event files in RUN_DIR/tensorboard/, through torch's SummaryWriter."""

    name = "tensorboard"

    def __init__(self, job, run_dir: pathlib.Path):
        self.log_dir = pathlib.Path(run_dir) / "tensorboard"
        self.writer = None

    def connect(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def send(self, records: list[dict]) -> None:
        for record in records:
            for name, value, step in metrics_of(record):
                self.writer.add_scalar(name, value, step, walltime=record.get("time"))
            text = event_text(record) if record.get("type") == "event" else None
            if text is not None:
                self.writer.add_text(record["event"], text, record.get("step") or 0, walltime=record.get("time"))
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


SINKS = {"mlflow": MlflowSink, "tensorboard": TensorboardSink}


def start(job, run_dir: pathlib.Path, report) -> list[Pump]:
    """The job's trackers, started; a tracker that does not answer is a warning and a `tracking`
    event, and training goes on (the pump keeps trying, and buffers meanwhile)."""
    wanted = [name for name in SINKS if getattr(job.tracking, name)]
    if not wanted:
        return []
    try:
        check_installed(job)
    except UsageError as err:  # `gearshift run` checked before anything started; tune and the API get here
        raise GearshiftError(str(err)) from None
    pumps = [Pump(SINKS[name](job, run_dir), job.tracking.buffer).start() for name in wanted]
    deadline = time.monotonic() + CONNECT_WAIT_S
    for pump in pumps:
        pump.attempted.wait(max(0.0, deadline - time.monotonic()))
        where = getattr(pump.sink, "shown_uri", None) or str(getattr(pump.sink, "log_dir", ""))
        if pump.connected:
            run_id = {"run_id": pump.sink.run_id} if getattr(pump.sink, "run_id", None) else {}
            report.event("tracking", tracker=pump.name, status="started", uri=where, **run_id)
            report.say(f"tracking: {pump.name} -> {where}")
            continue
        status = "unreachable" if pump.attempted.is_set() else "connecting"
        why = pump.error or f"no answer within {CONNECT_WAIT_S:g} s"
        report.event("tracking", tracker=pump.name, status=status, uri=where, error=why)
        log.warning("tracking: %s at %s is %s (%s); training goes on, records are buffered (up to %d) and "
                    "retried, and the end of the run says what was not sent", pump.name, where,
                    "unreachable" if status == "unreachable" else "not answering yet", why, job.tracking.buffer)
    return pumps


def finish(pumps: list[Pump], timeout_s: float, report) -> list[dict]:
    """End of run: each tracker gets what is queued and the artifacts, within `timeout_s` in all;
    what could not be sent is said on the terminal and in a `tracking` event."""
    deadline = time.monotonic() + timeout_s
    outcomes = [pump.close(max(0.0, deadline - time.monotonic())) for pump in pumps]
    for out in outcomes:
        lost = out["unsent"] + out["dropped"]
        status = "done" if not lost and out["artifacts"] else "incomplete"
        report.event("tracking", status=status, **out)
        if status == "incomplete":
            what = [f"{out['unsent']} record(s) not sent" if out["unsent"] else "",
                    f"{out['dropped']} dropped from a full buffer" if out["dropped"] else "",
                    "" if out["artifacts"] else "the artifacts and end status not sent"]
            log.warning("tracking: %s: %s%s. The run directory holds everything (telemetry.jsonl, summary.json, "
                        "final.pt).", out["tracker"], "; ".join(w for w in what if w),
                        f" (last error: {out['error']})" if out["error"] else "")
    return outcomes
