"""gearshift's Python API: load, check, run and submit jobs from a script or a notebook.

The `gearshift` command is a thin layer over these functions. Mistakes in a job raise `JobError`
(with `field`, `value`, `allowed` and the one-line message the command prints) before anything
starts; a run that starts and does not finish raises `RunFailed` with the reason and its run dir.
Nothing is printed unless asked (`progress=True` shows what the command shows).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import sys
from typing import Any, Mapping, Sequence, TextIO, Union

from gearshift.orchestrator.errors import GearshiftError, RunFailed, UsageError, WorkerFailed
from gearshift.orchestrator.job import Job, JobError

JobLike = Union[str, os.PathLike, Mapping[str, Any], Job]
Overrides = Union[Mapping[str, Any], Sequence[str], None]  # {"train.steps": 4} or ["train.steps=4"]

# the line a submitted run's driver ends its log with, for Submission.wait (a telemetry line:
# `gearshift logs` leaves it out, as it does the others)
RESULT_EVENT = "result"


@dataclasses.dataclass(frozen=True)
class Result:
    """What a finished run left: its directory, the steps it reached, the last and the best
    held-out loss, the whole of summary.json, and the trained weights (final.pt)."""

    run_dir: pathlib.Path
    steps: int
    final_loss: float | None
    best_eval_loss: float | None
    summary: dict
    model_path: pathlib.Path | None

    @classmethod
    def from_summary(cls, run_dir: str | os.PathLike, summary: Mapping[str, Any]) -> "Result":
        run_dir = pathlib.Path(run_dir)
        final = run_dir / "final.pt"
        return cls(run_dir=run_dir, steps=int(summary.get("steps_done") or 0), final_loss=summary.get("final_loss"),
                   best_eval_loss=summary.get("best_eval_loss"), summary=dict(summary),
                   # checkpoint.final may leave it out (summary "final": null); an older summary says nothing
                   model_path=final if summary.get("status") == "done" and summary.get("final", "") is not None
                   else None)

    @classmethod
    def read(cls, run_dir: str | os.PathLike) -> "Result":
        """The Result of a run from its directory (summary.json)."""
        run_dir = pathlib.Path(run_dir)
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError) as err:
            raise UsageError(f"{run_dir}: no readable summary.json ({err}): not a finished run") from None
        return cls.from_summary(run_dir, summary)


def load_job(job: JobLike, overrides: Overrides = None) -> Job:
    """A checked `Job` from a job file's path, a mapping with the job file's keys (entry points
    looked up in the current directory) or a `Job`; `overrides` as {"train.steps": 4} (values as
    they are) or ["train.steps=4"] (values parsed as YAML, as `--set`). Raises JobError."""
    from gearshift.orchestrator.job import apply_overrides, job_from_dict
    from gearshift.orchestrator.job import load_job as load_file

    if isinstance(job, Job):  # rebuilt from its form as typed, so its ${VAR}s are read (and kept) again
        return job_from_dict(apply_overrides(job.source_dict(), overrides), job.base_dir, job.name) if overrides \
            else job
    if isinstance(job, Mapping):
        return job_from_dict(apply_overrides(dict(job), overrides), os.getcwd())
    if isinstance(job, (str, os.PathLike)):
        return load_file(job, overrides)
    raise JobError("job", job, "must be a job file's path, a mapping of job fields or a gearshift.Job")


# ------------------------------------------------------------------------------ check


@dataclasses.dataclass(frozen=True)
class Check:
    """What `run` would start with: the resolved job, its first layout and the plan's
    predictions per layout (memory a rank and step time on `cluster`)."""

    job: Job
    layout: Any  # gearshift.strategies.Layout
    cluster: str
    rows: list[dict]
    notes: list[str]

    def __repr__(self) -> str:
        fitting = sum(1 for r in self.rows if r["fits"])
        return (f"<Check {self.job.name} ({self.job.fingerprint()}): every check passed; starts as {self.layout}; "
                f"{len(self.rows)} layouts predicted on {self.cluster}, {fitting} fit; .text() for the table>")

    def __str__(self) -> str:
        return self.text()

    def text(self) -> str:
        from gearshift.orchestrator.job import dump_job

        out = [f"job {self.job.name} ({self.job.fingerprint()}): every check passed; nothing was started.", "",
               dump_job(self.job).rstrip(), "", f"starts as: {self.layout}", "",
               f"predicted per layout on {self.cluster}:"]
        width = max([16] + [len(r["layout"]) + 1 for r in self.rows])
        out.append(f"{'layout':<{width}}{'GiB/rank':>10}{'fits':>6}{'step ms':>10}{'comm wait':>11}{'samples/s':>12}")
        for r in self.rows:
            out.append(f"{r['layout']:<{width}}{r['memory_gib']:>10.2f}{'yes' if r['fits'] else 'no':>6}"
                       f"{r['step_ms']:>10.3g}{r['comm_wait_frac']:>11.1%}{r['samples_per_s']:>12,.0f}")
        return "\n".join(out + self.notes)


def check(job: JobLike, *, overrides: Overrides = None, cluster: str | None = None) -> Check:
    """Every check `run` makes before it starts anything (the job, its components, layouts and
    sizes, the tracking packages it asks for), then the starting layout and the plan's table.
    `cluster` is a `gearshift plan --cluster` preset or spec file; by default the job's devices
    as one node of h100-ib400's kind (the step times are then a ranking, not a forecast)."""
    from gearshift.orchestrator.commands.plan import layout_key, layout_memory, load_cluster
    from gearshift.orchestrator.policy import costmodel, pipeline_cost
    from gearshift.orchestrator.policy import job_shape
    from gearshift.orchestrator.policy import hardware
    from gearshift.orchestrator.records.tracking import check_installed

    job = load_job(job, overrides)
    check_installed(job)
    n = job.cluster.num_workers
    if cluster is None:
        base = hardware.PRESETS["h100-ib400"]
        hw = costmodel.replace(base, nodes=1, per_node=n, name=f"{n} device(s) of h100-ib400's kind on one node")
    else:
        hw = load_cluster(cluster)
    model = job_shape.shape_of_job(job)
    batch = job.train.global_batch_size
    preds = pipeline_cost.plan(model, hw, batch)
    memory = layout_memory(job, model, hw, batch, preds)
    best: dict = {}
    for p in preds:  # the fastest bucket size of each layout
        best.setdefault(layout_key(p), p)
    rows = [{"layout": f"{p.label} {p.dp}x{p.tp}", "strategy": p.strategy, "dp": p.dp, "tp": p.tp, "shard": p.shard,
             "pp": p.pp,
             "memory_gib": memory[key][0]["total"] / costmodel.GiB, "fits": memory[key][1],
             "step_ms": p.step_s * 1e3, "comm_wait_frac": p.comm_wait_frac, "samples_per_s": p.samples_per_s}
            for key, p in sorted(best.items(), key=lambda kv: kv[1].step_s)]
    notes = []
    if model.activations is None:
        notes.append("note: this model's activations are not modelled (only the built-in GPT's and MLP's are): "
                     "GiB/rank counts parameters, gradients, optimizer state and overhead only")
    return Check(job=job, layout=job.layout, cluster=hw.name or "the cluster", rows=rows, notes=notes)


# -------------------------------------------------------------------------------- run


def run(job: JobLike | None = None, *, overrides: Overrides = None, run_dir: str | os.PathLike | None = None,
        address: str | None = None, resume: str | os.PathLike | bool | None = None,
        progress: bool = False) -> Result:
    """Train `job` on the Ray cluster at `address` (default: RAY_ADDRESS, else an embedded Ray
    started and stopped here; a Ray this process already joined is used and left up). `resume`:
    a run dir to continue from its last checkpoint (then `job` may be None), or True for the
    newest earlier run of the same job. Returns the `Result`; raises JobError for a bad job and
    RunFailed for a run that started and did not finish."""
    from gearshift.orchestrator.control.startup import STARTUP

    STARTUP.begin()
    STARTUP.mark("imports")
    job, run_at, resume_state, notes = _resolve(job, overrides, run_dir, resume)
    STARTUP.mark("job")
    view = _view(progress)
    for note in notes:
        view.say(f"gearshift: {note}")
    return train(job, run_at, resume_state, address=address, run_dir=run_dir, view=view)


def _fsdp_precision_note(job: Job) -> str | None:
    """Why FSDP2 keeps fp32 gathers under a bf16 job, where a layout that FSDP2 shards may run."""
    from gearshift.workers.config import fsdp_mixed_precision

    sharded = job.parallel.strategy in ("fsdp", "hsdp", "auto") or job.parallel.dp_shard or any(
        e.get("strategy") in ("fsdp", "hsdp") or e.get("dp_shard") for e in job.adapt.schedule or ())
    return fsdp_mixed_precision(job.train.precision)[1] if sharded else None


def _view(progress: bool, stream: TextIO | None = None):
    from gearshift.monitoring.progress import ProgressView

    return ProgressView(stream=stream) if progress else ProgressView(quiet=True)


def _resolve(job, overrides, run_dir, resume):
    """(job, run dir to continue or None, checkpoint (name, state) to resume from or None, notes);
    everything checked before anything starts."""
    from gearshift.orchestrator.records.rundir import RunDir, find_resumable, resume_conflicts, runs_root
    from gearshift.workers.state import checkpoint

    resume_dir = resume if isinstance(resume, (str, os.PathLike)) else None
    if job is None and resume_dir is None:
        raise UsageError("run needs a job: gearshift run JOB.yaml (or gearshift run --resume RUN_DIR)")
    if job is None:
        run = RunDir(resume_dir)
        job = run.load_job(overrides)  # its ${VAR}s read here again; a masked credential given by --set
        saved = run.written_job()
    else:
        job = load_job(job, overrides)
        run = None
        if resume:
            path = resume_dir or run_dir
            run = RunDir(path) if path else find_resumable(job)
            if run is None:
                raise UsageError(f"--resume: no earlier run of job {job.name!r} with this configuration "
                                 f"under {runs_root()}/. Name one with --resume RUN_DIR.")
        saved = run.written_job() if run else None  # compared as written: it need not load here
    if run is None:
        return job, None, None, []
    conflicts = resume_conflicts(saved, job)
    if conflicts:
        raise JobError("--resume", str(run.path), "the job differs from the run it would continue in "
                       "fields that change the result: " + "; ".join(conflicts),
                       "Only train.steps, train.log_every, train.activation_checkpointing, train.profile, "
                       "checkpoint.*, eval.*, telemetry.*, inject.*, adapt.*, tune.*, cluster.* and parallel.* "
                       "may change on resume.")
    root = run.checkpoint_root(job.checkpoint, job.base_dir)
    found = checkpoint.load_latest(root, whole=False)  # the workers read it, each its pieces
    if found is None:
        return job, run, None, [f"no usable checkpoint in {root}; starting from step 0."]
    return job, run, (found[0].name, found[1]), []


def train(job: Job, run, resume, *, address: str | None = None, run_dir: str | os.PathLike | None = None,
          view=None, script=None) -> Result:
    """Train a checked `job` in `run` (None: a new run dir, at `run_dir` if given) from `resume`
    ((checkpoint name, state), or None: from step 0). `gearshift replay` comes here too, with the
    original's decisions (`script`, orchestrator/control/script.py) to carry out at their steps."""
    from gearshift.orchestrator.cluster.worker_group import check_reachable
    from gearshift.orchestrator.control.controller import Controller
    from gearshift.orchestrator.job import dump_job
    from gearshift.orchestrator.records.rundir import RunDir
    from gearshift.orchestrator.records.tracking import check_installed
    from gearshift.workers.state.checkpoint import write_file_atomic

    view = view if view is not None else _view(False)
    check_installed(job)  # tracking asked for, its package missing: before a run dir or Ray
    if resume and resume[1]["step"] >= job.train.steps:
        from gearshift.orchestrator.control.checkpoints import Checkpoints, final_wanted

        if not run.final.exists() and final_wanted(job.checkpoint.final, _parameters(run)):
            # stopped between its last checkpoint and final.pt
            Checkpoints(job, run.checkpoint_root(job.checkpoint, job.base_dir), None).write_final(
                resume[1]["step"], run.final, verify=True)
        view.say(f"gearshift: {run.path} is already at step {resume[1]['step']} of {job.train.steps}; "
                 f"raise train.steps to train further (--set train.steps=N).")
        return _finished(run.path)
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_reachable(address)  # before a run dir exists for a run that cannot start
    if run is None:
        run = RunDir.create(job, run_dir)
    else:
        write_file_atomic(run.job_file, dump_job(job).encode())  # e.g. the new train.steps
    run.write_driver()  # before Ray starts: `watch` must not take a resumed run for a killed one
    resuming_at = f", resuming at step {resume[1]['step']}" if resume else ""
    view.say(f"gearshift: {job.name} ({job.fingerprint()}): {job.cluster.num_workers} worker(s), "
             f"strategy {job.parallel.strategy}, {job.train.steps} steps{resuming_at}; run dir {run.path}")
    note = _fsdp_precision_note(job)
    if note:
        view.say(f"gearshift: note: {note}")
    try:
        with GROUPS(job, run, address) as group_factory:
            summary = Controller(job, run, group_factory, resume=resume, view=view, script=script).run()
    except WorkerFailed as err:
        raise RunFailed(f"{err}.{_where_to_continue(run)}", run.path) from None
    except UsageError:
        raise
    except GearshiftError as err:
        raise RunFailed(str(err), run.path) from None
    rate = summary.get("samples_per_s")
    view.say(f"done: {summary['steps_done']} steps in {summary['wall_time_s']:.1f} s, loss "
             f"{summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
             f"{rate:,.0f} samples/s. Outputs in {run.path}/ ({'final.pt, ' if run.final.is_file() else ''}"
             "summary.json, telemetry.jsonl)"
             if rate else f"done: outputs in {run.path}/")
    return _finished(run.path)


@contextlib.contextmanager
def ray_groups(job: Job, run, address: str | None):
    """The run's worker groups on Ray (joined at `address`, else embedded): a factory job ->
    RayWorkerGroup, valid inside the `with`."""
    from gearshift.orchestrator.cluster.worker_group import RayWorkerGroup, embedded_cpus, ray_session

    with ray_session(address, num_cpus=embedded_cpus(job)) as session:
        def group_factory(j):
            return RayWorkerGroup(j, embedded=session["embedded"],
                                  checkpoint_dir=str(run.checkpoint_root(j.checkpoint, j.base_dir).resolve()))

        yield group_factory


# Where train() gets its worker groups: (job, run, address) -> a context manager giving a factory
# job -> WorkerGroup (orchestrator/cluster/group.py). The tests whose subject is training swap it
# for a group of plain processes (tests/process_workers.py).
GROUPS = ray_groups


def _parameters(run) -> int | None:
    """The model's parameter count as the run's summary recorded it (None: not known)."""
    try:
        return json.loads(run.summary.read_text()).get("parameters")
    except (OSError, ValueError):
        return None


def _finished(run_dir: pathlib.Path) -> Result:
    result = Result.read(run_dir)
    if os.environ.get("GEARSHIFT_TELEMETRY_LOG"):  # a submitted run: its log says where it ended
        from gearshift.monitoring.telemetry import LOG_PREFIX

        record = {"type": "event", "event": RESULT_EVENT, "run_dir": str(run_dir.resolve()),
                  "summary": result.summary}
        sys.stdout.write(LOG_PREFIX + json.dumps(record, default=str) + "\n")
        sys.stdout.flush()
    return result


def _where_to_continue(run) -> str:
    from gearshift.workers.state import checkpoint

    text = f" Details: {run.log}." if run.log.exists() else ""
    try:
        found = checkpoint.list_checkpoints(run.checkpoint_root())
    except Exception:  # noqa: BLE001 - an object store out of reach: the message only loses its hint
        found = []
    if found:
        text += f" The last checkpoint is {found[-1].name}: continue with `gearshift run --resume {run.path}`."
    return text


# ----------------------------------------------------------------------------- submit


class Submission:
    """A job submitted to a Ray cluster through its Job Submission API (`submit`)."""

    def __init__(self, job_id: str, address: str | None):
        self.id = job_id
        self.address = address

    def __repr__(self) -> str:
        return f"Submission({self.id!r}, address={self.address!r})"

    def status(self) -> str:
        """PENDING, RUNNING, SUCCEEDED, FAILED or STOPPED."""
        from gearshift.orchestrator.cluster import jobs_api

        with _jobs_errors(jobs_api):
            return jobs_api.job_status(self.address, self.id).value

    def logs(self, follow: bool = False, out: TextIO | None = None) -> str:
        """The job's log so far (telemetry lines left out); with `follow`, until the job ends,
        also written to `out` as it comes when one is given."""
        from gearshift.orchestrator.cluster import jobs_api

        text = io.StringIO()
        sink = text if out is None else _Tee(text, out)
        with _jobs_errors(jobs_api):
            jobs_api.logs(self.address, self.id, follow=follow, out=sink)
        return text.getvalue()

    def wait(self, timeout_s: float) -> Result:
        """Wait for the job to end; its Result as the head's driver reported it (run_dir and
        model_path are paths on the head). RunFailed when it failed or was stopped."""
        from gearshift.monitoring.watch import records_from_log_lines
        from gearshift.orchestrator.cluster import jobs_api

        with _jobs_errors(jobs_api):
            state = jobs_api.wait(self.address, self.id, timeout_s)
            lines = jobs_api.log_text(self.address, self.id).splitlines()
        results = [r for r in records_from_log_lines(lines) if r.get("event") == RESULT_EVENT]
        if state.value == "SUCCEEDED" and results:
            return Result.from_summary(results[-1]["run_dir"], results[-1]["summary"])
        said = [ln for ln in lines if ln.startswith("gearshift: ")]
        reason = said[-1].removeprefix("gearshift: ") if said else f"job {self.id} ended {state.value}"
        raise RunFailed(reason, results[-1]["run_dir"] if results else None)

    def stop(self) -> bool:
        """Ask the job to stop; True if it was running."""
        from gearshift.orchestrator.cluster import jobs_api

        with _jobs_errors(jobs_api):
            return jobs_api.stop(self.address, self.id)


class _Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text: str) -> None:
        for s in self.streams:
            s.write(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


class _jobs_errors:
    """JobsApiError (nothing listening, a bad token, an unknown id) as a GearshiftError."""

    def __init__(self, jobs_api):
        self.error = jobs_api.JobsApiError

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if err is not None and isinstance(err, self.error):
            raise GearshiftError(str(err)) from None
        return False


def submit(job: str | os.PathLike, *, address: str | None = None, overrides: Overrides = None,
           run_dir: str | None = None, pip: Sequence[str] = (), python: str = "python") -> Submission:
    """Check the job file here, then submit it to the cluster whose dashboard is at `address`
    (default: RAY_JOB_ADDRESS, else RAY_ADDRESS): its folder travels as the working dir, this
    gearshift as a py_module. `run_dir` is a path on the head (default ~/gearshift-runs/...).
    `overrides` travel as typed on the Ray job's command line, which the cluster shows to anyone:
    a credential there must be a `${VAR}` reference, which the head reads from its environment
    (as it does the job file's); one in clear is a JobError naming the field, never the value."""
    from gearshift.orchestrator.cluster import jobs_api
    from gearshift.orchestrator.job import override_pairs

    if not isinstance(job, (str, os.PathLike)):
        raise JobError("job", type(job).__name__, "submit takes a job file's path: its folder travels to the "
                       "cluster as the working dir")
    checked = load_job(job, overrides)  # a bad file fails here, not on the cluster
    sets = [f"{'.'.join(parts)}={json.dumps(value)}" for parts, value in override_pairs(overrides)]
    with _jobs_errors(jobs_api):
        job_id = jobs_api.submit(pathlib.Path(job), address, sets, run_dir, pip=pip, python=python,
                                 job_name=checked.name)
    return Submission(job_id, address)
