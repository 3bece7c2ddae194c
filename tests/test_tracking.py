"""Experiment tracking (orchestrator/tracking.py) with the real parts: a real `mlflow server`
process on 127.0.0.1, read back through MlflowClient; TensorBoard event files read back with
TensorBoard's own reader; a server killed mid-run; a URI that does not answer at the start."""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.records import tracking
from gearshift.orchestrator.job import JobError, job_from_dict

ROOT = pathlib.Path(__file__).resolve().parents[1]
MLP = ROOT / "examples/mlp.yaml"
BASE = ["train.steps=12", "train.global_batch_size=32", "checkpoint.every=0"]

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MlflowServer:
    """`mlflow server` on a free port, in its own process group so that stopping it by its pid
    also stops the uvicorn process it starts."""

    def __init__(self, root: pathlib.Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(root / "server.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--artifacts-destination", str(root / "artifacts")],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        start = time.monotonic()
        deadline = start + 120
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2):
                    self.start_s = time.monotonic() - start
                    return
            except OSError:
                assert self.proc.poll() is None, (root / "server.log").read_text()[-2000:]
                time.sleep(0.5)
        self.stop()
        raise AssertionError("mlflow server did not answer within 120 s")

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)  # the group started above: the server and its uvicorn
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self.log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One mlflow server for the file's tests (its start is the cost: 20-50 s of a 2-core
    machine), made again where a test killed it; every one started is stopped at the end."""
    started: list[MlflowServer] = []

    def live() -> MlflowServer:
        if not started or started[-1].proc.poll() is not None:
            started.append(MlflowServer(tmp_path_factory.mktemp("mlflow")))
        return started[-1]

    try:
        yield live
    finally:
        for srv in started:
            srv.stop()


@pytest.fixture
def server(servers, monkeypatch):
    """The live server, and how long a request to it may take: gearshift's 5 s suits a server that
    answers, not this one on a 2-core machine running the suite beside it (a request once timed
    out, the run's one try at its end too, and the run stayed RUNNING there). The bound follows
    the server's own start, its heaviest work (sqlite's migrations): twice that, 30 to 60 s.
    A dead server's refusal comes at once whatever the bound."""
    srv = servers()
    srv.request_s = min(60, max(30, round(2 * srv.start_s)))  # the run's end waits 4x: within the test's 300 s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", str(srv.request_s))
    return srv


def run(run_dir, *overrides) -> int:
    args = ["run", str(MLP), "--run-dir", str(run_dir)]
    for o in [*BASE, *overrides]:
        args += ["--set", o]
    return cli.main(args)


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def tracking_events(run_dir) -> list[dict]:
    return [r for r in records(run_dir) if r.get("event") == "tracking"]


@pytest.fixture
def pumps_left_running(monkeypatch) -> list[bool]:
    """Wraps tracking.finish: for each tracker at the end of a run, whether its thread was still
    running when the run stopped waiting for it (True: the run waited out its close timeout)."""
    alive: list[bool] = []
    real = tracking.finish

    def recording(pumps, timeout_s, report):
        try:
            return real(pumps, timeout_s, report)
        finally:
            alive.extend(pump.thread.is_alive() for pump in pumps)

    monkeypatch.setattr(tracking, "finish", recording)
    return alive


def returns_within(call, timeout_s: float, what: str):
    """Run `call` on a thread of its own; its result, or a failed test if it has not returned
    after `timeout_s` (`what` says what that would mean)."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(value=call()), daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"{what} (still waiting after {timeout_s:g} s)"
    assert "value" in box, "the call raised (see the thread's exception above)"
    return box["value"]


# ---------------------------------------------------------------------- bad input, no Ray


def test_unknown_tracking_keys_are_rejected():
    with pytest.raises(JobError, match=r"tracking.tensorbord .*Did you mean 'tracking.tensorboard'"):
        job_from_dict({"model": "mlp", "tracking": {"tensorbord": True}})
    with pytest.raises(JobError, match=r"tracking.mlflow.uri .*takes tracking_uri, experiment"):
        job_from_dict({"model": "mlp", "tracking": {"mlflow": {"uri": "sqlite:///x.db"}}})
    with pytest.raises(JobError, match=r"tracking.mlflow = 3"):
        job_from_dict({"model": "mlp", "tracking": {"mlflow": 3}})
    job = job_from_dict({"model": "mlp", "tracking": {"mlflow": True}})
    assert job.tracking.mlflow == {"tracking_uri": None, "experiment": "gearshift"}
    # where a run is reported is not what it computes
    assert job.fingerprint() == job_from_dict({"model": "mlp"}).fingerprint()


def test_tracking_without_the_package_is_exit_2_before_anything_starts(tmp_path, monkeypatch, capsys):
    real = tracking.importlib.util.find_spec
    monkeypatch.setattr(tracking.importlib.util, "find_spec", lambda name: None if name == "mlflow" else real(name))
    assert run(tmp_path / "run", "tracking.mlflow=true") == 2
    err = capsys.readouterr().err
    assert "pip install 'gearshift[tracking]'" in err and "tracking.mlflow" in err
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------- the pump, no Ray


class FlakySink:
    name = "flaky"

    def __init__(self, fail_first=0, block: threading.Event | None = None):
        self.fail_first, self.block, self.got, self.finished = fail_first, block, [], False
        self.sending = threading.Event()  # set once a send has begun

    def connect(self):
        pass

    def send(self, batch):
        self.sending.set()
        if self.block is not None:
            self.block.wait()
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("tracker down")
        self.got += batch

    def finish(self):
        self.finished = True


def test_pump_retries_until_the_tracker_takes_the_records(monkeypatch):
    monkeypatch.setattr(tracking, "MAX_BACKOFF_S", 0.05)
    sink = FlakySink(fail_first=2)
    pump = tracking.Pump(sink, capacity=100, interval_s=0.01).start()
    for i in range(50):
        pump.observe({"type": "step", "step": i})
    time.sleep(0.5)
    out = pump.close(5)
    assert [r["step"] for r in sink.got] == list(range(50)) and sink.finished
    assert out == {"tracker": "flaky", "sent": 50, "unsent": 0, "dropped": 0, "artifacts": True, "error": None}


def test_a_slow_tracker_drops_the_oldest_and_close_waits_a_bounded_time():
    # The tracker is stuck in a send until the end of the test, so anything that waited for it
    # would never return. The close gets 0.5 s; its bound is 20 times that and under the close's
    # own default (30 s), so a close that waited for the tracker, or took the default, fails.
    close_s = 0.5
    assert 20 * close_s < inspect.signature(tracking.Pump.close).parameters["timeout_s"].default
    block = threading.Event()
    sink = FlakySink(block=block)
    pump = tracking.Pump(sink, capacity=100, interval_s=0.01).start()
    try:
        pump.observe({"type": "step", "step": 0})
        assert sink.sending.wait(30), "the pump never sent"  # the thread is now stuck in send, holding step 0

        def observe_all():
            for i in range(1, 1001):
                pump.observe({"type": "step", "step": i})

        returns_within(observe_all, 30, "observing waited for the tracker")
        out = returns_within(lambda: pump.close(close_s), 20 * close_s, "close waited for the tracker")
        assert pump.thread.is_alive()  # close gave up on the tracker, which still holds step 0
    finally:
        block.set()
    assert out["dropped"] == 900 and out["unsent"] == 100 and not out["artifacts"]
    assert [r["step"] for r in pump.queue] == list(range(901, 1001))  # the newest are kept


def test_sqlite_needs_no_server(tmp_path):
    """The embedded default: a local sqlite database, artifacts beside it."""
    job = job_from_dict({"model": "mlp", "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{tmp_path / 'm.db'}"}}})
    run_dir = tmp_path / "runs" / "r"
    run_dir.mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"status": "done"}))
    sink = tracking.MlflowSink(job, run_dir)
    pump = tracking.Pump(sink, capacity=100, interval_s=0.01).start()
    for step in range(1, 6):
        pump.observe({"type": "step", "time": time.time(), "step": step, "loss": 1.0 / step, "lr": 0.1})
    assert pump.close(60)["artifacts"]
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'm.db'}")
    got = client.get_run(sink.run_id)
    assert got.info.status == "FINISHED" and got.data.params["optimizer.lr"] == "0.001"
    assert [(m.step, m.value) for m in client.get_metric_history(sink.run_id, "loss")] == \
        [(s, 1.0 / s) for s in range(1, 6)]
    assert (tmp_path / "mlartifacts").is_dir()


# ---------------------------------------------------------------------- real runs, on Ray


def test_a_run_logged_to_a_real_mlflow_server_and_tensorboard(local_workers, tmp_path, server):
    run_dir = tmp_path / "run"
    # the end's wait covers a few requests at their bound (the batches, the artifacts, the status)
    uri = (f'{{mlflow: {{tracking_uri: "{server.url}", experiment: test}}, tensorboard: true, '
           f'close_timeout_s: {4 * server.request_s}}}')
    assert run(run_dir, f"tracking={uri}", "eval.every=5", "eval.data=synthetic_digits", "eval.batches=2",
               "adapt.schedule=[{step: 6, strategy: tensor}]", "parallel.strategy=data") == 0
    recs = records(run_dir)
    losses = {r["step"]: r["loss"] for r in recs if r["type"] == "step"}
    evals = {r["step"]: r["loss"] for r in recs if r["type"] == "eval"}
    assert len(losses) == 12 and set(evals) == {5, 10, 12}

    client = mlflow.MlflowClient(server.url)
    run_id = json.loads((run_dir / "tracking.json").read_text())["run_id"]
    got = client.get_run(run_id)
    fingerprint = json.loads((run_dir / "summary.json").read_text())["fingerprint"]
    assert got.info.run_name == f"mlp-{fingerprint}" and got.info.status == "FINISHED"
    assert got.data.params["optimizer.lr"] == "0.001" and got.data.params["train.steps"] == "12"
    history = client.get_metric_history(run_id, "loss")
    assert {m.step: m.value for m in history} == pytest.approx(losses) and len(history) == 12
    assert {m.step: m.value for m in client.get_metric_history(run_id, "eval_loss")} == pytest.approx(evals)
    assert len(client.get_metric_history(run_id, "samples_per_s")) == 12
    assert got.data.tags["gearshift.switch.6"].startswith("data 2x1 -> tensor 1x2")
    names = {a.path for a in client.list_artifacts(run_id)} | {a.path for a in client.list_artifacts(run_id, "report")}
    assert {"summary.json", "final.pt", "switches.json", "report/loss.png"} <= names
    assert any(e["status"] == "done" and e["tracker"] == "mlflow" for e in tracking_events(run_dir))

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    assert {"loss", "lr", "samples_per_s", "comm_wait_frac", "eval_loss"} <= set(acc.Tags()["scalars"])
    assert {e.step: e.value for e in acc.Scalars("loss")} == pytest.approx(losses, rel=1e-6)  # float32 on disk
    assert {e.step: e.value for e in acc.Scalars("eval_loss")} == pytest.approx(evals, rel=1e-6)


def test_the_server_killed_mid_run_does_not_stop_the_run(local_workers, tmp_path, server, caplog,
                                                          pumps_left_running):
    run_dir = tmp_path / "run"

    def kill_at_first_step():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            path = run_dir / "telemetry.jsonl"
            if path.exists() and '"type": "step"' in path.read_text():
                server.stop(signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_at_first_step, daemon=True)
    killer.start()
    assert run(run_dir, f'tracking.mlflow={{tracking_uri: "{server.url}"}}', "train.steps=30",
               "inject.comm_delay_ms=20") == 0
    killer.join(10)
    assert server.proc.poll() is not None  # it was killed while the run went on
    # The end of the run gave the dead server its one try and had its answer: it did not wait
    # out the close timeout (nor, then, anything longer) for a tracker that is gone.
    assert pumps_left_running == [False]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
    end = [e for e in tracking_events(run_dir) if e.get("status") in ("done", "incomplete")]
    assert end[0]["status"] == "incomplete" and not end[0]["artifacts"] and end[0]["error"]
    assert any("tracking: mlflow" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_an_unreachable_uri_at_the_start_is_a_warning_and_the_run_goes_on(local_workers, tmp_path, caplog,
                                                                          pumps_left_running):
    run_dir = tmp_path / "run"
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    assert run(run_dir, f'tracking.mlflow={{tracking_uri: "{url}"}}', "train.steps=5") == 0
    events = tracking_events(run_dir)
    # "unreachable", not "connecting": the start had the refusal rather than waiting out
    # CONNECT_WAIT_S; and the end had its one try's answer rather than waiting out the close timeout.
    assert events[0]["status"] == "unreachable" and events[0]["uri"] == url and events[0]["error"]
    assert pumps_left_running == [False]
    assert events[-1]["status"] == "incomplete" and events[-1]["unsent"] > 0
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("unreachable" in w and "training goes on" in w for w in warned)
    assert any("not sent" in w for w in warned)
