"""Submit gearshift jobs to a remote Ray cluster and follow them.

A thin layer over Ray's Job Submission API (``ray.job_submission.JobSubmissionClient``,
HTTP on the head's dashboard port, 8265 by default) behind ``gearshift submit / logs /
stop / status``. What it adds to the plain client:

* the job file's directory travels as the ``working_dir`` and gearshift's own four
  packages as ``py_modules``, so the cluster runs the client's version of gearshift;
* overrides travel on the job's command line, which ``ray job list``, the dashboard and the
  head's process table show: one that carries a credential in clear is refused (a JobError
  naming the field, never the value); a credential goes as a ``${VAR}`` reference, read from
  the head's environment when the job loads there, as a reference in the job file is;
* the address comes from the argument, else ``RAY_JOB_ADDRESS`` / ``RAY_API_SERVER_ADDRESS``
  / ``RAY_ADDRESS`` (an explicit argument wins: the plain client lets the environment
  override it);
* every request has a timeout, and every failure a user can cause (nothing listening,
  wrong port, bad token, unknown job id) becomes one ``JobsApiError`` whose message says
  what to check, never a traceback.

Token auth (Ray >= 2.52; ``ray.init()`` turns it on by default for the local cluster it
starts since 2.59): ``JobSubmissionClient`` attaches the token only when *this* process
runs with ``RAY_AUTH_MODE=token``, so a fresh CLI gets HTTP 401 from such a head. We ask
the head's public ``/api/authentication_mode`` endpoint first and, when it says "token",
send the token Ray's own loader finds (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, or
``~/.ray/auth_token``), so ``RAY_AUTH_MODE`` need not be set on the client.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import re
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, TextIO

import yaml
from ray.job_submission import JobDetails, JobStatus

from gearshift.monitoring.telemetry import LOG_PREFIX
from gearshift.orchestrator.job.load import parse_overrides
from gearshift.orchestrator.job.secrets import refuse_in_clear

from gearshift.orchestrator.cluster.jobs_client import JobsApiError, _Client, _HttpStatusError, _connect, _translate_errors


# How long `logs --follow` waits for output before checking, over plain HTTP with a
# timeout, that the head is still there: a websocket to a vanished head can stay open
# without ever delivering anything.
FOLLOW_IDLE_CHECK_S = 30.0


# Submissions tried when the head has no job agent yet; the head waits 10 s per try.
SUBMIT_ATTEMPTS = 3


GEARSHIFT_PACKAGES = ("orchestrator", "workers", "strategies", "monitoring")


WORKING_DIR_EXCLUDES = (".venv", "runs", ".git", "__pycache__")


@dataclasses.dataclass(frozen=True)
class Submission:
    """Everything Ray needs to start one gearshift job; built without touching the network."""

    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]


def build_submission(
    job_path: Path,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
    *,
    pip: Sequence[str] = (),
    python: str = "python",
    job_name: str | None = None,
) -> Submission:
    """Build the entrypoint and runtime_env that run ``job_path`` on the cluster.

    ``overrides`` are ``a.b=value`` strings passed on as ``--set`` (a credential among them
    only as a ``${VAR}`` reference: one in clear is a JobError); ``run_dir`` is a path on
    the head, where the job's driver runs. ``pip`` lists extra requirements Ray installs in
    a per-job virtualenv (slow on first use: prefer installing them in the cluster's
    image). ``python`` is the interpreter the head runs the job with: the job's shell gets
    the PATH of whoever ran `ray start`, so plain ``python`` is right on cluster.yaml nodes
    but not where Ray runs from an unactivated virtualenv (give its full path there).
    ``job_name`` defaults to the job file's ``name`` field, else its file stem; it names
    the submission.
    """
    job_path = Path(job_path).resolve()
    if not job_path.is_file():
        raise JobsApiError(f"job file {str(job_path)!r} does not exist or is not a file.")
    for item in overrides:
        _check_override(item)
    # the entrypoint is shown to whoever can see the cluster (`ray job list`, the dashboard, the
    # head's process table): a credential goes there as its ${VAR}, which the head reads
    refuse_in_clear(parse_overrides(list(overrides)))
    name = job_name or _job_name_from_file(job_path)
    return Submission(
        submission_id=_submission_id(name),
        entrypoint=_entrypoint(python, job_path.name, overrides, run_dir),
        runtime_env=_runtime_env(job_path.parent, pip, run_dir),
        metadata={"gearshift_job": name},
    )


def _check_override(item: str) -> None:
    key, sep, _ = item.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][\w-]*(\.[\w-]+)*", key):
        raise JobsApiError(
            f"override {item!r} must look like KEY=VALUE with a dotted KEY, e.g. "
            "train.steps=100 or model.name=gpt2."
        )


def _job_name_from_file(job_path: Path) -> str:
    try:
        spec = yaml.safe_load(job_path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        # Fail here, before anything is uploaded, rather than in the cluster's log.
        raise JobsApiError(f"cannot read job file {str(job_path)!r}: {exc}") from None
    name = spec.get("name") if isinstance(spec, dict) else None
    return name if isinstance(name, str) and name.strip() else job_path.stem


def _submission_id(name: str) -> str:
    # Ray names the driver's log file after the id; keep it to a file-name-safe alphabet.
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")[:40] or "job"
    return f"gearshift-{slug}-{secrets.token_hex(3)}"


def _entrypoint(python: str, job_file: str, overrides: Sequence[str], run_dir: str | None) -> str:
    # No --address: inside a Ray job RAY_ADDRESS is set, so `run` joins this cluster.
    argv = [python, "-m", "gearshift", "run", job_file]
    for item in overrides:
        argv += ["--set", item]
    if run_dir is not None:
        argv += ["--run-dir", run_dir]
    return shlex.join(argv)


# Where a submitted job's run dirs go on the head when --run-dir is not given. The job runs
# inside Ray's temporary copy of the working dir, which Ray deletes later: a relative runs/
# there would be lost.
SUBMITTED_RUNS_ROOT = "~/gearshift-runs"


def _runtime_env(working_dir: Path, pip: Sequence[str], run_dir: str | None = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "working_dir": str(working_dir),
        "py_modules": [str(p) for p in gearshift_package_dirs()],
        "excludes": list(WORKING_DIR_EXCLUDES),
    }
    # the driver also prints telemetry into the job log, which `gearshift watch JOB_ID` follows
    env["env_vars"] = {"GEARSHIFT_TELEMETRY_LOG": "1"}
    if run_dir is None:
        env["env_vars"]["GEARSHIFT_RUNS_ROOT"] = SUBMITTED_RUNS_ROOT
    if pip:
        env["pip"] = list(pip)
    return env


def gearshift_package_dirs() -> list[Path]:
    """One directory named `gearshift` holding the whole package this process imports, for Ray
    to send as a py_module: the installed package itself, or (an editable checkout, where
    orchestrator/ and the rest sit beside gearshift/) a copy put together once per content
    under the temporary directory."""
    found = {}
    for name in ("gearshift", *(f"gearshift.{p}" for p in GEARSHIFT_PACKAGES)):
        # find_spec gives the package's __file__ without running its __init__, which may
        # import torch: seconds we need not spend to submit.
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise JobsApiError(
                f"package {name!r} is not importable here; install gearshift "
                "(`pip install -e .` in the checkout) before submitting."
            )
        found[name] = Path(spec.origin).parent
    top = found.pop("gearshift")
    if all(path == top / name.split(".")[1] for name, path in found.items()):
        return [top]
    return [_staged_package(top, found)]


def _staged_package(top: Path, parts: Mapping[str, Path]) -> Path:
    sources = {".": top, **{name.split(".")[1]: path for name, path in parts.items()}}
    files = sorted((str(Path(rel) / f.relative_to(root)), f) for rel, root in sources.items()
                   for f in root.rglob("*")
                   if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc")
    digest = hashlib.sha256()
    for rel, f in files:
        st = f.stat()
        digest.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    cache = Path(tempfile.gettempdir()) / f"gearshift-submit-{os.getuid()}"
    target = cache / digest.hexdigest()[:16] / "gearshift"
    if target.is_dir():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=cache))
    try:
        for rel, f in files:
            dest = stage / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dest)
        target.parent.mkdir(exist_ok=True)
        with contextlib.suppress(OSError):  # another submit staged the same content meanwhile
            stage.rename(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    _prune_staged(cache, keep=target.parent)
    return target


def _prune_staged(cache: Path, keep: Path, older_than_s: float = 3600.0) -> None:
    """Copies of other contents (an edited checkout makes one per edit) go once an hour old."""
    now = time.time()
    for old in cache.iterdir():
        with contextlib.suppress(OSError):
            if old != keep and now - old.stat().st_mtime > older_than_s:
                shutil.rmtree(old, ignore_errors=True)


def submit(
    job_path: Path,
    address: str | None = None,
    overrides: Sequence[str] = (),
    run_dir: str | None = None,
    *,
    pip: Sequence[str] = (),
    python: str = "python",
    job_name: str | None = None,
) -> str:
    """Submit ``job_path`` to the cluster at ``address``; return the submission id."""
    submission = build_submission(
        job_path, overrides, run_dir, pip=pip, python=python, job_name=job_name
    )
    return send_submission(address, submission)


def send_submission(address: str | None, submission: Submission) -> str:
    """Upload the submission's packages and start it; return the submission id."""
    client, url = _connect(address)
    with _translate_errors(url):
        attempt = 1
        while True:
            try:
                return client.submit_job(
                    entrypoint=submission.entrypoint,
                    submission_id=submission.submission_id,
                    runtime_env=submission.runtime_env,
                    metadata=submission.metadata,
                )
            except _HttpStatusError as exc:
                # A head that has just started answers HTTP before its node agent, which
                # runs the job, has registered; the head waits 10 s for it and then
                # gives up. Nothing was started, so asking again is safe (and the
                # packages, already uploaded, are not sent twice).
                if attempt >= SUBMIT_ATTEMPTS or "No available agent" not in str(exc):
                    raise
                attempt += 1


class _WithoutTelemetry:
    """A writer that drops the telemetry lines a submitted driver prints for `gearshift watch`."""

    def __init__(self, out: TextIO):
        self.out = out
        self._partial = ""

    def write(self, text: str) -> None:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        kept = [line for line in lines if not line.startswith(LOG_PREFIX)]
        if kept:
            self.out.write("\n".join(kept) + "\n")

    def flush(self) -> None:
        if self._partial and not self._partial.startswith(LOG_PREFIX[: len(self._partial)]):
            self.out.write(self._partial)
            self._partial = ""
        self.out.flush()


def iter_log_lines(address: str | None, job_id: str, timeout_s: float | None = None) -> Iterator[str]:
    """The job's log line by line, following it until the job ends (for `gearshift watch`)."""
    import queue
    import threading

    client, url = _connect(address)
    with _translate_errors(url, job_id):
        client.get_job_info(job_id)  # an unknown id fails here
    lines: queue.Queue = queue.Queue()
    failure: list[BaseException] = []

    class _Lines:
        partial = ""

        def write(self, text: str) -> None:
            parts = (self.partial + text).split("\n")
            self.partial = parts.pop()
            for line in parts:
                lines.put(line)

        def flush(self) -> None:
            pass

    def follow() -> None:
        try:
            with _translate_errors(url, job_id):
                asyncio.run(_follow(client, job_id, _Lines()))
        except BaseException as err:  # handed to the reading thread
            failure.append(err)
        finally:
            lines.put(None)

    threading.Thread(target=follow, name="gearshift-log-follow", daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            return
        if line is None:
            if failure:
                raise failure[0]
            return
        yield line


def logs(address: str | None, job_id: str, follow: bool = False, out: TextIO | None = None) -> None:
    """Write the job's log so far to ``out``; with ``follow``, keep writing until it ends.
    Telemetry lines (for `gearshift watch`) are left out.

    Ctrl-C while following stops following, not the job.
    """
    out = _WithoutTelemetry(sys.stdout if out is None else out)
    client, url = _connect(address)
    with _translate_errors(url, job_id):
        if not follow:
            out.write(client.get_job_logs(job_id))
            out.flush()
            return
        client.get_job_info(job_id)  # an unknown id fails here, with a timeout
        try:
            asyncio.run(_follow(client, job_id, out))
        except KeyboardInterrupt:
            print(
                f"\nstopped following {job_id}; the job keeps running "
                f"(`gearshift stop {job_id}` stops it).",
                file=sys.stderr,
            )


def log_text(address: str | None, job_id: str) -> str:
    """The job's whole log so far, telemetry lines included."""
    client, url = _connect(address)
    with _translate_errors(url, job_id):
        return client.get_job_logs(job_id)


def job_status(address: str | None, job_id: str) -> JobStatus:
    client, url = _connect(address)
    with _translate_errors(url, job_id):
        return client.get_job_status(job_id)


def stop(address: str | None, job_id: str) -> bool:
    """Ask the job to stop; True if it was running, False if it had already ended."""
    client, url = _connect(address)
    with _translate_errors(url, job_id):
        return client.stop_job(job_id)


def wait(address: str | None, job_id: str, timeout_s: float, poll_s: float = 1.0,
         quiet_s: float | None = None) -> JobStatus:
    """Poll until the job ends; return its final status, or raise after ``timeout_s``.

    With ``quiet_s``, also raise once the job's log has not grown for that long: a bound
    derived from the job's own progress (a job that writes a line per step) rather than from a
    guess at its total time, which a loaded cluster stretches."""
    client, url = _connect(address)
    start = time.monotonic()
    deadline, said, heard = start + timeout_s, -1, start
    with _translate_errors(url, job_id):
        while True:
            state = client.get_job_status(job_id)
            if state.is_terminal():
                return state
            now = time.monotonic()
            if quiet_s is not None:
                size = len(client.get_job_logs(job_id))
                if size != said:
                    said, heard = size, now
                elif now - heard > quiet_s:
                    raise JobsApiError(
                        f"job {job_id} is still {state.value} and has logged nothing for {quiet_s:g} s; "
                        f"`gearshift logs --follow {job_id}` shows what it is doing."
                    )
            if now > deadline:
                raise JobsApiError(
                    f"job {job_id} is still {state.value} after {timeout_s:g} s; "
                    f"`gearshift logs --follow {job_id}` shows what it is doing."
                )
            time.sleep(poll_s)


def status(address: str | None, job_id: str | None = None, console: Any = None) -> list[JobDetails]:
    """Print one job's status and message, or a table of all jobs; return what was shown."""
    from rich.console import Console  # imported here: only printing needs rich

    console = Console(highlight=False) if console is None else console
    client, url = _connect(address)
    with _translate_errors(url, job_id):
        jobs = [client.get_job_info(job_id)] if job_id else client.list_jobs()
    if job_id:
        _print_one(console, jobs[0])
    else:
        _print_table(console, sorted(jobs, key=lambda j: j.start_time or 0))
    return jobs


def _print_one(console: Any, job: JobDetails) -> None:
    # markup=False: a job's message is free text and may hold [brackets] rich would eat.
    times = f"started {_when(job.start_time)}, ended {_when(job.end_time)}"
    console.print(f"{_job_label(job)}: {job.status.value}  ({times})", markup=False)
    if job.message:
        console.print(job.message, markup=False)


def _print_table(console: Any, jobs: Sequence[JobDetails]) -> None:
    from rich import box
    from rich.table import Table
    from rich.text import Text

    # Ids are copied into the next command and the short columns are read at a glance,
    # so those keep their width; name and entrypoint get what is left, cut with "...".
    table = Table(title=f"{len(jobs)} job(s)", box=box.SIMPLE_HEAD, show_edge=False)
    table.add_column("id", no_wrap=True, min_width=max((len(_job_label(j)) for j in jobs), default=2))
    table.add_column("name", no_wrap=True, overflow="ellipsis", max_width=24)
    table.add_column("status", no_wrap=True, min_width=9)
    table.add_column("start", no_wrap=True, min_width=11)
    table.add_column("end", no_wrap=True, min_width=11)
    table.add_column("entrypoint", no_wrap=True, overflow="ellipsis")
    for job in jobs:
        cells = (
            _job_label(job),
            (job.metadata or {}).get("gearshift_job", ""),
            job.status.value,
            _when(job.start_time, "%m-%d %H:%M"),
            _when(job.end_time, "%m-%d %H:%M"),
            shorten(job.entrypoint or ""),
        )
        table.add_row(*(Text(c) for c in cells))  # Text: cells are data, not markup
    console.print(table)


def _job_label(job: JobDetails) -> str:
    # Drivers started with ray.init() are listed too; they have no submission id.
    return job.submission_id or job.job_id or "?"


def _when(millis: int | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    if not millis:
        return "-"
    return datetime.fromtimestamp(millis / 1000).strftime(fmt)


def shorten(text: str, width: int = 60) -> str:
    """Cut ``text`` to ``width`` characters, marking the cut with '...'."""
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


async def _follow(client: _Client, job_id: str, out: TextIO) -> None:
    stream = client.tail_job_logs(job_id)
    loop = asyncio.get_running_loop()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(stream.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=FOLLOW_IDLE_CHECK_S)
            if not done:
                # Quiet is normal for a training job; only a dead head or an ended job
                # (whose stream somehow stayed open) is a reason to stop waiting.
                state = await loop.run_in_executor(None, client.get_job_status, job_id)
                if state.is_terminal():
                    return
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            pending = None
            out.write(chunk)
            out.flush()
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                await pending
        await stream.aclose()

