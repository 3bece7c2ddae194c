"""gearshift.orchestrator.cluster.jobs_api: address resolution, the submission it builds, clean errors.

Everything but the last test runs without Ray; the last one (marked `ray`) starts a
local Ray with its dashboard and submits through the real Job Submission API.
"""

import asyncio
import dataclasses
import http.server
import io
import json
import os
import select
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import requests
from ray.job_submission import JobStatus

from conftest import free_port
from gearshift.orchestrator.cluster import jobs_api
from gearshift.orchestrator.cluster import jobs_client
from gearshift.orchestrator.cluster.jobs_api import JobsApiError, build_submission
from gearshift.orchestrator.cluster.jobs_client import resolve_address

REPO = Path(__file__).resolve().parents[1]
# A training job submitted here logs a line each step (train.log_every: 1); its longest silence
# is its start: the head's job process imports torch and gearshift, joins the cluster and starts
# the workers (the whole submit test takes 18 s on a quiet 2-core machine). A job silent for
# 120 s has stopped moving, however loaded the machine.
JOB_QUIET_S = 120


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("name: Tiny MLP\ntrain:\n  steps: 3\n")
    return path


# ----------------------------------------------------------------------- addresses


@pytest.mark.parametrize(
    "given, url",
    [
        ("http://10.0.0.5:8265", "http://10.0.0.5:8265"),
        ("https://ray.example.com/dash/", "https://ray.example.com/dash"),
        ("10.0.0.5:8265", "http://10.0.0.5:8265"),
        ("head-node:8265", "http://head-node:8265"),
        ("[::1]:8265", "http://[::1]:8265"),
    ],
)
def test_explicit_address(given, url):
    assert resolve_address(given, environ={}) == url


@pytest.mark.parametrize("given", ["ray://10.0.0.5:10001", "auto", "10.0.0.5", "host:99999", "ftp://x:1"])
def test_bad_explicit_address_names_value_and_allowed_forms(given):
    with pytest.raises(JobsApiError, match="http://HOST:PORT") as info:
        resolve_address(given, environ={})
    assert repr(given) in str(info.value)


def test_explicit_address_beats_environment():
    env = {"RAY_JOB_ADDRESS": "http://a:1", "RAY_ADDRESS": "http://b:2"}
    assert resolve_address("http://c:3", environ=env) == "http://c:3"


def test_environment_order_and_skipping():
    assert resolve_address(None, {"RAY_JOB_ADDRESS": "a:1", "RAY_ADDRESS": "b:2"}) == "http://a:1"
    assert resolve_address(None, {"RAY_API_SERVER_ADDRESS": "http://s:8265", "RAY_ADDRESS": "b:2"}) == "http://s:8265"
    # ray.init() values in RAY_ADDRESS are not job API addresses: skip them.
    assert resolve_address(None, {"RAY_JOB_ADDRESS": "", "RAY_ADDRESS": "b:2"}) == "http://b:2"


def test_bad_gearshift_address_variable_is_an_error_not_a_skip():
    with pytest.raises(JobsApiError, match="RAY_JOB_ADDRESS='ray://h:10001'"):
        resolve_address(None, {"RAY_JOB_ADDRESS": "ray://h:10001", "RAY_ADDRESS": "b:2"})


def test_no_usable_address_is_a_clear_error():
    with pytest.raises(JobsApiError, match="--address") as info:
        resolve_address(None, {"RAY_ADDRESS": "auto"})
    assert "RAY_ADDRESS='auto'" in str(info.value)
    with pytest.raises(JobsApiError, match="no Ray job address"):
        resolve_address(None, {})


# ---------------------------------------------------------------------- submission


def test_runtime_env_ships_working_dir_and_gearshift(job_file):
    sub = build_submission(job_file)
    env = sub.runtime_env
    assert env["working_dir"] == str(job_file.parent)
    assert set(env["excludes"]) >= {".venv", "runs", ".git", "__pycache__"}
    # The packages this process imports, so the cluster runs the client's gearshift.
    # One py_module, `gearshift`, with its four parts inside (an editable checkout keeps them
    # beside gearshift/, so they are put together in a copy).
    [shipped] = map(Path, env["py_modules"])
    assert shipped.name == "gearshift" and (shipped / "__init__.py").is_file()
    for part in ("orchestrator", "workers", "strategies", "monitoring"):
        assert (shipped / part / "__init__.py").read_bytes() == (REPO / part / "__init__.py").read_bytes()
    assert (shipped / "orchestrator" / "job" / "load.py").is_file()
    assert not list(shipped.rglob("__pycache__"))
    assert build_submission(job_file).runtime_env["py_modules"] == [str(shipped)]  # staged once per content
    assert "pip" not in env
    assert build_submission(job_file, pip=["einops==0.8.0"]).runtime_env["pip"] == ["einops==0.8.0"]
    # run dirs must outlive Ray's temporary copy of the working dir
    assert env["env_vars"] == {"GEARSHIFT_RUNS_ROOT": "~/gearshift-runs", "GEARSHIFT_TELEMETRY_LOG": "1"}
    # a run dir of the user's choosing: no runs root, but telemetry still goes into the log for watch
    assert build_submission(job_file, run_dir="/data/runs/x").runtime_env["env_vars"] == {"GEARSHIFT_TELEMETRY_LOG": "1"}


def test_staged_copies_of_old_contents_are_pruned(job_file):
    [shipped] = map(Path, build_submission(job_file).runtime_env["py_modules"])
    cache = shipped.parent.parent
    stale = cache / "0123456789abcdef"
    (stale / "gearshift").mkdir(parents=True, exist_ok=True)
    fresh = cache / "fedcba9876543210"
    (fresh / "gearshift").mkdir(parents=True, exist_ok=True)
    hour_ago = time.time() - 2 * 3600
    os.utime(stale, (hour_ago, hour_ago))
    os.utime(shipped.parent, (hour_ago, hour_ago))  # the one in use is kept however old
    jobs_api._prune_staged(cache, keep=shipped.parent)
    assert not stale.exists() and fresh.is_dir() and shipped.is_dir()
    shutil.rmtree(fresh)


def test_runs_root_comes_from_the_environment(monkeypatch, tmp_path):
    from gearshift.orchestrator.records.rundir import runs_root

    monkeypatch.delenv("GEARSHIFT_RUNS_ROOT", raising=False)
    assert runs_root() == "runs" and runs_root("elsewhere") == "elsewhere"
    monkeypatch.setenv("GEARSHIFT_RUNS_ROOT", "~/gearshift-runs")
    assert runs_root() == str(Path.home() / "gearshift-runs")


def test_entrypoint_runs_the_job_file_with_quoted_overrides(job_file):
    overrides = ["train.steps=5", "model.name=it's a model", "optim.lr=1e-3;rm -rf /"]
    sub = build_submission(job_file, overrides, run_dir="/data/runs/x y")
    argv = shlex.split(sub.entrypoint)
    assert argv[:5] == ["python", "-m", "gearshift", "run", "job.yaml"]
    assert argv[5:] == [
        "--set", "train.steps=5",
        "--set", "model.name=it's a model",
        "--set", "optim.lr=1e-3;rm -rf /",
        "--run-dir", "/data/runs/x y",
    ]
    assert "--run-dir" not in build_submission(job_file).entrypoint
    assert build_submission(job_file, python="/opt/py/bin/python").entrypoint.startswith("/opt/py/bin/python -m")


def test_a_credential_in_clear_never_reaches_the_entrypoint(job_file):
    from gearshift.orchestrator.job import JobError

    with pytest.raises(JobError, match=r"^cluster\.env\.HF_TOKEN = '\*\*\*' .*hidden") as err:
        build_submission(job_file, ["train.steps=5", "cluster.env.HF_TOKEN=hf_planted-value"])
    assert "hf_planted" not in str(err.value)
    sub = build_submission(job_file, ["cluster.env.HF_TOKEN=${HF_TOKEN}"])  # the head reads it
    assert shlex.split(sub.entrypoint)[5:] == ["--set", "cluster.env.HF_TOKEN=${HF_TOKEN}"]


def test_submission_id_and_metadata(job_file, tmp_path):
    a, b = build_submission(job_file), build_submission(job_file)
    assert a.metadata == {"gearshift_job": "Tiny MLP"}
    assert a.submission_id.startswith("gearshift-tiny-mlp-")
    assert a.submission_id != b.submission_id
    nameless = tmp_path / "sweep_7.yaml"
    nameless.write_text("train: {steps: 1}\n")
    assert build_submission(nameless).submission_id.startswith("gearshift-sweep-7-")


@pytest.mark.parametrize("bad", ["train.steps", "=5", "train..steps=5", "9lives=1"])
def test_bad_override_is_rejected(job_file, bad):
    with pytest.raises(JobsApiError, match="KEY=VALUE") as info:
        build_submission(job_file, [bad])
    assert repr(bad) in str(info.value)


def test_missing_or_unparsable_job_file(tmp_path):
    with pytest.raises(JobsApiError, match="does not exist"):
        build_submission(tmp_path / "nope.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [1, 2\n")
    with pytest.raises(JobsApiError, match="cannot read job file"):
        build_submission(broken)


def test_shorten():
    assert jobs_api.shorten("a  b\nc") == "a b c"
    assert jobs_api.shorten("x" * 100, width=10) == "xxxxxxx..."


# -------------------------------------------------------------- failures, no cluster


def _bounded(call, timeout_s):
    """Run `call` on a thread of its own and wait for it at most `timeout_s`; return what it
    returned, raise what it raised, and fail the test if it is still running after that."""
    box = {}

    def target():
        try:
            box["value"] = call()
        except BaseException as exc:  # handed back to the test's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="bounded-call", daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert not thread.is_alive(), f"still waiting after {timeout_s:g} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def _count_connections(monkeypatch) -> list:
    """Record every TCP connection requests (through urllib3) opens: (host, port) each."""
    from urllib3.util import connection

    opened, real = [], connection.create_connection

    def counting(address, *args, **kwargs):
        opened.append(address)
        return real(address, *args, **kwargs)

    monkeypatch.setattr(connection, "create_connection", counting)
    return opened


def test_nothing_listening_is_a_clean_error_and_quick(job_file, monkeypatch):
    # Quick because a refused connection is reported as it is: one connection tried, no
    # retries (urllib3's or gearshift's own) and no waiting on a timeout.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    opened = _count_connections(monkeypatch)
    with pytest.raises(JobsApiError) as info:
        jobs_api.submit(job_file, url)
    assert opened == [("127.0.0.1", port)], opened
    message = str(info.value)
    assert url in message and "connection refused" in message and "8265" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_silent_server_times_out(monkeypatch):
    # Accepts connections (the kernel does, via the backlog) but never answers. Every request
    # must carry the configured timeouts (1 s here), not the defaults (5 s and 60 s); the wait
    # for the call is bounded at a third of the default read timeout, many times the configured
    # one, so a request sent without the configured timeout fails here rather than hanging.
    default_read_s = jobs_client.HTTP_TIMEOUT_S[1]
    configured = (1.0, 1.0)
    bound_s = default_read_s / 3
    assert bound_s >= 10 * sum(configured)
    monkeypatch.setattr(jobs_client, "HTTP_TIMEOUT_S", configured)
    sent, send = [], requests.adapters.HTTPAdapter.send

    def recording(adapter, request, *args, **kwargs):
        sent.append(kwargs.get("timeout"))
        return send(adapter, request, *args, **kwargs)

    monkeypatch.setattr(requests.adapters.HTTPAdapter, "send", recording)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(JobsApiError, match=r"no answer in time \(timeouts: connect 1 s, read 1 s\)"):
            _bounded(lambda: jobs_api.status(url), bound_s)
    assert sent and all(timeout == configured for timeout in sent), sent


class _FakeHead(http.server.BaseHTTPRequestHandler):
    routes: dict = {}

    def do_GET(self):
        code, body = self.routes.get(self.path, (404, "not found"))
        data = body.encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_head():
    """An HTTP server answering GETs from a {path: (code, body)} table."""
    routes = {}
    handler = type("Handler", (_FakeHead,), {"routes": routes})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", routes
    server.shutdown()
    server.server_close()


def test_token_required_but_missing(fake_head, monkeypatch):
    url, routes = fake_head
    routes["/api/authentication_mode"] = (200, json.dumps({"authentication_mode": "token"}))
    monkeypatch.setattr(jobs_client, "_load_token_header", lambda: {})
    with pytest.raises(JobsApiError, match="ray get-auth-token") as info:
        jobs_api.stop(url, "gearshift-x-123456")
    assert url in str(info.value)


class _AgentLateClient:
    """Stands in for the Ray client: the first ``late`` submissions find no job agent."""

    def __init__(self, late, error_text="No available agent to submit job, please try again later."):
        self.late, self.error_text, self.calls = late, error_text, 0

    def submit_job(self, *, submission_id, **_):
        self.calls += 1
        if self.calls <= self.late:
            raise jobs_api._HttpStatusError(500, self.error_text)
        return submission_id


@pytest.mark.parametrize("late, succeeds", [(0, True), (2, True), (3, False)])
def test_submit_retries_while_the_head_has_no_agent(job_file, monkeypatch, late, succeeds):
    client = _AgentLateClient(late)
    monkeypatch.setattr(jobs_api, "_connect", lambda address: (client, "http://head:8265"))
    sub = build_submission(job_file)
    if succeeds:
        assert jobs_api.send_submission("head:8265", sub) == sub.submission_id
    else:
        with pytest.raises(JobsApiError, match="No available agent.*try again in a few seconds"):
            jobs_api.send_submission("head:8265", sub)
    assert client.calls == min(late + 1, jobs_api.SUBMIT_ATTEMPTS)


def test_other_server_errors_are_not_retried(job_file, monkeypatch):
    traceback_body = 'Traceback (most recent call last):\n  File "x.py", line 1\nKeyError: \'boom\'\n'
    client = _AgentLateClient(late=5, error_text=traceback_body)
    monkeypatch.setattr(jobs_api, "_connect", lambda address: (client, "http://head:8265"))
    with pytest.raises(JobsApiError, match=r"failed: HTTP 500: KeyError: 'boom'\.") as info:
        jobs_api.send_submission("head:8265", build_submission(job_file))
    assert client.calls == 1 and "Traceback" not in str(info.value)


class _QuietStreamClient:
    """A job whose log stream says one thing, then nothing, and never closes."""

    def __init__(self, status_after_quiet):
        self.status_after_quiet = status_after_quiet

    def get_job_info(self, job_id):
        return None

    async def tail_job_logs(self, job_id):
        yield "step 1\n"
        await asyncio.Event().wait()  # forever, like a websocket to a vanished head

    def get_job_status(self, job_id):
        if isinstance(self.status_after_quiet, Exception):
            raise self.status_after_quiet
        return self.status_after_quiet


@pytest.mark.parametrize(
    "after_quiet, error",
    [
        (JobStatus.SUCCEEDED, None),
        (requests.ConnectionError("[Errno 111] Connection refused"), "cannot use the Ray job API"),
    ],
)
def test_follow_does_not_hang_on_a_silent_stream(monkeypatch, after_quiet, error):
    # The stream never ends, so following ends only by the idle check. The wait for it is
    # bounded at 50 times the configured check (0.2 s) and under the default one (30 s): a
    # follow that never checked, or checked after the default instead, fails here.
    idle_s = 0.2
    bound_s = 50 * idle_s
    assert bound_s < jobs_api.FOLLOW_IDLE_CHECK_S
    monkeypatch.setattr(jobs_api, "FOLLOW_IDLE_CHECK_S", idle_s)
    monkeypatch.setattr(jobs_api, "_connect", lambda address: (_QuietStreamClient(after_quiet), "http://head:8265"))
    out = io.StringIO()

    def follow():
        jobs_api.logs("head:8265", "j", follow=True, out=out)

    if error is None:
        _bounded(follow, bound_s)
    else:
        with pytest.raises(JobsApiError, match=error):
            _bounded(follow, bound_s)
    assert out.getvalue() == "step 1\n"


def test_not_a_dashboard(fake_head):
    url, routes = fake_head
    routes["/api/authentication_mode"] = (200, "<html>hello</html>")
    with pytest.raises(JobsApiError, match="Ray dashboard on the head node"):
        jobs_api.status(url)


# -------------------------------------------------------------- end to end, real Ray

PROBE = """\
import pathlib, gearshift.orchestrator.cluster.jobs_api
here = pathlib.Path(".")
print("PROBE", (here / "marker.txt").read_text().strip(),
      "shipped-from=" + str(pathlib.Path(gearshift.orchestrator.cluster.jobs_api.__file__).resolve()),
      "runs-excluded=" + str(not (here / "runs").exists()))
"""

# Runs in a fresh process: no RAY_AUTH_MODE=token there, unlike this one after ray.init().
FOLLOWER = """\
import os, sys
from gearshift.orchestrator.cluster import jobs_api
url, job_id = sys.argv[1:]
jobs_api.logs(url, job_id, follow=True)  # returns when the test sends SIGINT
print("stopped-running-job", jobs_api.stop(url, job_id), flush=True)
os.environ["RAY_AUTH_TOKEN"] = "not-the-token"
from ray._raylet import AuthenticationTokenLoader
AuthenticationTokenLoader.instance().reset_cache()
try:
    jobs_api.status(url)
except jobs_api.JobsApiError as exc:
    print("wrong-token", exc)
"""


def read_until(stream, text, timeout_s) -> str:
    """Read a pipe until ``text`` appears; raw reads, so no line sits unseen in a buffer."""
    deadline = time.monotonic() + timeout_s
    seen = b""
    while time.monotonic() < deadline and text.encode() not in seen:
        ready, _, _ = select.select([stream], [], [], 0.5)
        chunk = os.read(stream.fileno(), 65536) if ready else b""
        if ready and not chunk:
            break  # the process closed its stdout
        seen += chunk
    assert text.encode() in seen, f"{text!r} not seen within {timeout_s} s; got {seen!r}"
    return seen.decode()


@pytest.fixture
def ray_dashboard():
    """A one-node Ray with its dashboard, started in this process; yields the job API URL.

    ray.cluster_utils.Cluster rather than ray.init(): ray.init() cannot move the node's
    dashboard agent off port 52365, and with any other Ray on this host (parallel test
    runs) that agent fails to bind, and every submission then fails with "No available
    agent to submit job".
    """
    pytest.importorskip("ray")
    from ray._private.authentication.authentication_token_setup import (
        _enable_token_auth,
        ensure_token_if_auth_enabled,
    )
    from ray._private.utils import write_ray_address
    from ray.cluster_utils import Cluster

    saved = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    # What ray.init() does for a new local cluster since Ray 2.59: token auth on, with
    # the token in ~/.ray/auth_token (created if missing). The head's processes inherit it.
    _enable_token_auth()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    # A Ray temporary folder of its own, holding this cluster's address: Ray's job supervisor tells
    # a job's driver the address in the head's temporary folder (its ray_current_cluster file,
    # which `ray start` writes and a Cluster does not), else any GCS it finds running on the
    # machine. In the shared /tmp/ray that is whichever Ray started last here (a parallel test's),
    # so a job would join that one, whose nodes cannot find this cluster's packages. Short: Ray's
    # sockets live below it.
    temp_dir = tempfile.mkdtemp(prefix="gs-ray-", dir="/tmp")
    cluster = Cluster(
        initialize_head=True,
        head_node_args=dict(
            num_cpus=2,
            include_dashboard=True,
            dashboard_port=free_port(),
            dashboard_agent_listen_port=free_port(),
            temp_dir=temp_dir,
        ),
    )
    write_ray_address(cluster.address, temp_dir)
    try:
        yield f"http://{cluster.webui_url}"
    finally:
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")  # inside Ray's tail_job_logs
def test_submit_wait_logs_stop_status_against_real_ray(ray_dashboard, tmp_path):
    url = ray_dashboard
    marker = uuid.uuid4().hex
    work = tmp_path / "work"
    (work / "runs").mkdir(parents=True)
    (work / "runs" / "old.jsonl").write_text("{}\n")
    (work / "marker.txt").write_text(marker)
    (work / "probe.py").write_text(PROBE)
    (work / "job.yaml").write_text("name: probe\n")

    # The real runtime_env; only the command differs (`gearshift run` would train).
    # sys.executable: the job's shell has the PATH of whoever started Ray, where `python`
    # need not be this virtualenv's.
    sub = build_submission(work / "job.yaml")
    sub = dataclasses.replace(sub, entrypoint=f"{shlex.quote(sys.executable)} probe.py")
    job_id = jobs_api.send_submission(url, sub)
    assert job_id == sub.submission_id

    final = jobs_api.wait(url, job_id, timeout_s=60, poll_s=0.5)
    out = io.StringIO()
    jobs_api.logs(url, job_id, out=out)
    assert final == "SUCCEEDED", out.getvalue()
    (line,) = [ln for ln in out.getvalue().splitlines() if ln.startswith("PROBE")]
    _, seen_marker, shipped_from, excluded = line.split()
    assert seen_marker == marker  # working_dir travelled
    # py_modules travelled: the job imported Ray's unpacked copy, not this checkout.
    assert not shipped_from.removeprefix("shipped-from=").startswith(str(REPO))
    assert excluded == "runs-excluded=True"

    followed = io.StringIO()
    jobs_api.logs(url, job_id, follow=True, out=followed)
    assert marker in followed.getvalue()

    assert jobs_api.stop(url, job_id) is False  # already finished: nothing to stop

    table = io.StringIO()
    from rich.console import Console

    jobs = jobs_api.status(url, console=Console(file=table, width=200))
    assert job_id in [j.submission_id for j in jobs] and job_id in table.getvalue()
    (one,) = jobs_api.status(url, job_id, console=Console(file=io.StringIO()))
    assert one.metadata == {"gearshift_job": "probe"}

    for call in (jobs_api.status, jobs_api.stop, jobs_api.logs):
        with pytest.raises(JobsApiError, match="no job with id 'no-such-job'"):
            call(url, "no-such-job")
    with pytest.raises(JobsApiError, match="no job with id 'no-such-job'"):
        jobs_api.logs(url, "no-such-job", follow=True)

    # A running job, followed from a fresh process without RAY_AUTH_MODE=token (the
    # head's token must come from ~/.ray/auth_token), then Ctrl-C, stop, a wrong token.
    sleeper = dataclasses.replace(
        sub,
        submission_id=sub.submission_id + "-sleeper",
        entrypoint=shlex.join([sys.executable, "-c", "print('started'); import time; time.sleep(120)"]),
    )
    sleeper_id = jobs_api.send_submission(url, sleeper)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env["PYTHONPATH"] = str(REPO)
    stderr_path = tmp_path / "follower.err"
    with open(stderr_path, "w") as stderr:
        follower = subprocess.Popen(
            [sys.executable, "-c", FOLLOWER, url, sleeper_id],
            env=env, stdout=subprocess.PIPE, stderr=stderr,
        )
        try:
            rest = read_until(follower.stdout, "started", timeout_s=30)
            # running and silent since 'started': a wait bounded by the job's own output ends
            # after quiet_s, long before its timeout_s (the sleeper sleeps 120 s)
            with pytest.raises(JobsApiError, match=f"{sleeper_id} is still RUNNING and has logged nothing for 2 s"):
                jobs_api.wait(url, sleeper_id, timeout_s=100, poll_s=0.2, quiet_s=2)
            follower.send_signal(signal.SIGINT)
            rest += follower.communicate(timeout=30)[0].decode()
        finally:
            follower.kill()
    errors = stderr_path.read_text()
    assert follower.returncode == 0, errors
    assert "Traceback" not in errors and "stopped following" in errors, errors
    assert "stopped-running-job True" in rest, rest + errors
    assert f"wrong-token the Ray cluster at {url} rejected the request" in rest, rest + errors
    assert jobs_api.wait(url, sleeper_id, timeout_s=30, poll_s=0.5) == "STOPPED"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.smoke
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")
def test_gearshift_submit_trains_a_real_job_on_the_cluster(ray_dashboard, tmp_path, capsys):
    """`gearshift submit` through the CLI: the job file's folder travels, the head runs
    `gearshift run` as a Ray job that joins the cluster, trains and writes its run dir."""
    from gearshift.orchestrator.commands import cli

    work = tmp_path / "work"
    work.mkdir()
    (work / "job.yaml").write_text(
        "name: tiny\nmodel: {name: mlp, kwargs: {hidden: 32}}\ndata: {name: synthetic_digits, kwargs: {size: 256}}\n"
        "train: {steps: 5, global_batch_size: 16, log_every: 1}\ncluster: {num_workers: 2}\n")
    run_dir = tmp_path / "on-the-head"  # the head is this machine, so its files can be checked here
    assert cli.main(["submit", str(work / "job.yaml"), "--address", ray_dashboard, "--python", sys.executable,
                     "--set", "train.steps=6", "--run-dir", str(run_dir)]) == 0
    job_id = capsys.readouterr().out.strip()
    assert job_id.startswith("gearshift-tiny-")
    # the job logs a line a step; before its first it imports and joins the cluster
    final = jobs_api.wait(ray_dashboard, job_id, timeout_s=900, poll_s=0.5, quiet_s=JOB_QUIET_S)
    out = io.StringIO()
    jobs_api.logs(ray_dashboard, job_id, out=out)
    assert final == "SUCCEEDED", out.getvalue()
    assert "step 6/6" in out.getvalue() and "done: 6 steps" in out.getvalue()
    assert "@gearshift-telemetry" not in out.getvalue(), "logs shows the telemetry lines meant for watch"
    assert json.loads((run_dir / "summary.json").read_text())["steps_done"] == 6
    # `watch JOB_ID` follows the same run through the job log, from another machine's view
    capsys.readouterr()
    assert cli.main(["watch", job_id, "--address", ray_dashboard]) == 0
    shown = capsys.readouterr().out
    assert "done" in shown and "6/6" in shown and "data dp=2" in shown, shown
    assert (run_dir / "final.pt").is_file()
    assert cli.main(["status", job_id, "--address", ray_dashboard]) == 0
    assert "SUCCEEDED" in capsys.readouterr().out
    # the same job through the Python API: its Result as the head's driver reported it
    import gearshift

    sub = gearshift.Submission(job_id, ray_dashboard)
    assert sub.status() == "SUCCEEDED" and "done: 6 steps" in sub.logs()
    result = sub.wait(timeout_s=30)
    assert result.steps == 6 and result.run_dir == run_dir.resolve() and result.model_path.is_file()
    assert result.final_loss == json.loads((run_dir / "summary.json").read_text())["final_loss"]
    assert sub.stop() is False


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:ssl=None is deprecated:DeprecationWarning")
def test_gearshift_submit_streams_a_ray_dataset_built_on_the_cluster(ray_dashboard, tmp_path, capsys):
    """data.ray_dataset through `gearshift submit`: the function travels with the job's folder
    and runs on the cluster (in the feeder the head's driver starts), not on this client."""
    import shutil

    from gearshift.orchestrator.commands import cli

    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(Path(__file__).parent / "fixtures" / "streamed.py", work / "streamed.py")
    (work / "job.yaml").write_text(
        "name: streamed\nmodel: {entrypoint: 'streamed:model'}\n"
        "data: {ray_dataset: 'streamed:ray_style', kwargs: {size: 64}, input: x, target: label}\n"
        "train: {steps: 4, global_batch_size: 16, log_every: 1}\ncheckpoint: {every: 0}\n"
        "cluster: {num_workers: 2, cpus_per_worker: 0.5}\n")  # the head's 2 CPUs: 1 left for Ray Data
    run_dir = tmp_path / "on-the-head"
    assert cli.main(["submit", str(work / "job.yaml"), "--address", ray_dashboard, "--python", sys.executable,
                     "--run-dir", str(run_dir)]) == 0
    job_id = capsys.readouterr().out.strip()
    final = jobs_api.wait(ray_dashboard, job_id, timeout_s=900, poll_s=0.5, quiet_s=JOB_QUIET_S)
    out = io.StringIO()
    jobs_api.logs(ray_dashboard, job_id, out=out)
    assert final == "SUCCEEDED", out.getvalue()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_done"] == 4 and summary["status"] == "done"
