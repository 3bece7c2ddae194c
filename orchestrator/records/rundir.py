"""The run directory: `runs/<name>-<fingerprint>-<timestamp>/` with the resolved job, telemetry,
checkpoints, `summary.json` and `final.pt`."""

from __future__ import annotations

import json
import os
import pathlib
import time

import yaml

from gearshift.orchestrator.errors import GearshiftError, UsageError
from gearshift.orchestrator.job import Job, JobError, apply_overrides, credentials, dump_job, job_from_dict, secrets
from gearshift.workers.state import checkpoint

# Keys that may differ between a run and its resume: they change how long or how often,
# not what the trajectory is.
_RESUMABLE = {("name",), ("train", "steps"), ("train", "log_every"), ("checkpoint", "every"), ("checkpoint", "keep"),
              ("checkpoint", "keep_best"),
              ("train", "activation_checkpointing")}
# Keys whose whole subtree may differ: profiling watches steps and changes nothing in them.
_RESUMABLE_PREFIXES = {("train", "profile")}
# Whole sections that may change too: global batches do not depend on the worker count, and
# checkpoints hold full tensors, so any layout continues what any other started.
# Evaluation reads the model and changes nothing in it: it may change on resume too.
_RESUMABLE_SECTIONS = {"cluster", "parallel", "telemetry", "inject", "adapt", "tune", "fault", "eval",
                      "tracking"}


def runs_root(root: str | None = None) -> str:
    """Where new run dirs go: `root`, else $GEARSHIFT_RUNS_ROOT, else ./runs."""
    return os.path.expanduser(root or os.environ.get("GEARSHIFT_RUNS_ROOT") or "runs")


class RunDir:
    def __init__(self, path: pathlib.Path):
        self.path = pathlib.Path(path)

    job_file = property(lambda self: self.path / "job.yaml")
    checkpoints = property(lambda self: self.path / "checkpoints")
    telemetry = property(lambda self: self.path / "telemetry.jsonl")
    summary = property(lambda self: self.path / "summary.json")
    final = property(lambda self: self.path / "final.pt")
    profile = property(lambda self: self.path / "profile")  # train.profile's traces and tables, per rank
    log = property(lambda self: self.path / "gearshift.log")
    meta = property(lambda self: self.path / "run.json")  # what job.yaml cannot say: where the job came from
    driver = property(lambda self: self.path / "driver.json")  # which process is running it now
    source = property(lambda self: self.path / "source.json")  # versions and module hashes it ran with

    def checkpoint_root(self, section=None, base_dir: str | None = None):
        """Where this run's checkpoints are: `<checkpoint.path>/<run dir name>/` when the job names
        a place (a shared folder, or an object store as a RemotePath), else checkpoints/ here.
        `section`: the job's checkpoint section (a CheckpointSpec or its mapping); default: the
        run's own job.yaml."""
        from gearshift.workers.state import storage

        if section is None:
            try:
                section = (yaml.safe_load(self.job_file.read_text()) or {}).get("checkpoint") or {}
            except (OSError, yaml.YAMLError, AttributeError):
                section = {}
            if isinstance(section, dict):  # job.yaml keeps ${VAR}s, not their values: read them again
                section = secrets.expand({"checkpoint": section})[0]["checkpoint"]
        get = section.get if isinstance(section, dict) else lambda k, d=None: getattr(section, k, d)
        place = get("path")
        if not place:
            return self.checkpoints
        if storage.is_url(place):
            return storage.location(place, dict(get("storage_options") or {})) / self.path.name
        if base_dir is None:
            try:
                base_dir = json.loads(self.meta.read_text()).get("base_dir", ".")
            except (OSError, ValueError, AttributeError):
                base_dir = "."
        return pathlib.Path(base_dir).joinpath(pathlib.Path(place).expanduser()) / self.path.name

    def write_driver(self) -> None:
        """Record the process driving the run, so `gearshift watch` can tell a killed run from a slow one."""
        import socket

        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        checkpoint.write_file_atomic(self.driver, json.dumps(info).encode())

    def driver_alive(self) -> bool | None:
        """False when the recorded driver ran on this host and is gone; None when that cannot be told."""
        import socket

        try:
            info = json.loads(self.driver.read_text())
        except (OSError, ValueError):
            return None
        if info.get("host") != socket.gethostname():
            return None
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            return False
        except (PermissionError, KeyError, ValueError, TypeError):
            return None
        return True

    @classmethod
    def create(cls, job: Job, explicit: str | None = None, root: str | None = None) -> "RunDir":
        if explicit:
            path = pathlib.Path(explicit)
            if (path / "job.yaml").exists():
                raise UsageError(f"--run-dir {path} already holds a run. Continue it with "
                                     f"`gearshift run --resume {path}`, or choose another directory.")
        else:
            root = runs_root(root)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = pathlib.Path(root) / f"{job.name}-{job.fingerprint()}-{stamp}"
            n = 1
            while path.exists():  # two runs started within the same second
                n += 1
                path = pathlib.Path(root) / f"{job.name}-{job.fingerprint()}-{stamp}-{n}"
        path.mkdir(parents=True, exist_ok=True)
        run = cls(path)
        run.checkpoints.mkdir(exist_ok=True)  # before the workers start: they check they can see it
        run.checkpoint_root(job.checkpoint, job.base_dir).mkdir(parents=True, exist_ok=True)
        checkpoint.write_file_atomic(run.job_file, dump_job(job).encode())
        meta = {"base_dir": job.base_dir, "fingerprint": job.fingerprint(), "name": job.name, "created": time.time()}
        checkpoint.write_file_atomic(run.meta, json.dumps(meta, indent=2).encode())
        from gearshift.orchestrator.records import provenance

        provenance.write(run.source, job)
        return run

    def written_job(self) -> dict:
        """job.yaml as written (references unread, credentials masked): what a job is compared with."""
        raw = self._read_job_file()
        return raw if isinstance(raw, dict) else {}

    def load_job(self, overrides=None) -> Job:
        """The run's job again: its `${VAR}`s read from the environment here, `overrides` (as
        `--set`) applied first, so that they may give back a credential job.yaml masks."""
        raw = self._read_job_file()
        base_dir = json.loads(self.meta.read_text()).get("base_dir", ".") if self.meta.is_file() else "."
        try:
            return job_from_dict(apply_overrides(raw, overrides), base_dir=base_dir)
        except JobError as err:
            err.source = str(self.job_file)
            err.args = (err.message(),)
            raise

    def _read_job_file(self) -> dict:
        if not self.job_file.is_file():
            raise UsageError(f"{self.path} is not a gearshift run directory (no job.yaml in it).")
        try:
            raw = yaml.safe_load(self.job_file.read_text())
        except (OSError, yaml.YAMLError) as err:
            raise UsageError(f"{self.job_file} is unreadable ({str(err).splitlines()[0]}); the run directory "
                             "is damaged. Resume with the original job file: gearshift run JOB.yaml --resume "
                             f"--run-dir {self.path}") from None
        if not isinstance(raw, dict):
            raise UsageError(f"{self.job_file} does not hold a job mapping; the run directory is damaged.")
        return raw

    def write_summary(self, summary: dict) -> None:
        checkpoint.write_file_atomic(self.summary, json.dumps(summary, indent=2, default=str).encode())


def _flatten(d: dict, prefix=()) -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix[-1:] == ("kwargs",) and k != "kwargs":
            out.update(_flatten(v, prefix + (k,)))
        else:
            out[prefix + (k,)] = v
    return out


def resume_conflicts(saved: Job | dict, new: Job | dict) -> list[str]:
    """Fields where `new` would change the trajectory of the run it resumes. Compared as written
    (a run's job.yaml, or Job.written()): `${VAR}` as typed, credentials left out (a rotated key
    changes no trajectory, and a mask is not a value to compare)."""
    a, b = (_flatten(credentials.without(j.written() if isinstance(j, Job) else j)) for j in (saved, new))
    return [".".join(map(str, k)) + f": {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b), key=str)
            if k not in _RESUMABLE and k[0] not in _RESUMABLE_SECTIONS and k[:2] not in _RESUMABLE_PREFIXES
            and a.get(k) != b.get(k)]


def find_resumable(job: Job, root: str | None = None) -> RunDir | None:
    """The newest run under `root` that this job can continue."""
    root = runs_root(root)
    candidates = sorted(pathlib.Path(root).glob(f"{job.name}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for path in candidates:
        run = RunDir(path)
        try:
            if run.job_file.is_file() and not resume_conflicts(run.written_job(), job):
                return run
        except (JobError, GearshiftError):
            continue
    return None


def earlier_history(run: RunDir, start_step: int) -> list[dict]:
    """A resumed run keeps the layouts its earlier legs used before the resume point."""
    if not run.summary.is_file():
        return []
    try:
        old = json.loads(run.summary.read_text()).get("strategy_history", [])
    except ValueError:
        return []
    return [h for h in old if h.get("step", 0) < start_step]
