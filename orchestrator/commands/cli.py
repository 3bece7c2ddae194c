"""`gearshift`: run a job here, or submit it to a Ray cluster and follow it there.

Every user mistake ends in one paragraph on stderr and a non-zero exit status, never a traceback:
2 for a bad job file or arguments, 1 for a run that failed, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import logging
import os
import pathlib
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable

from gearshift.orchestrator.errors import GearshiftError, UsageError
from gearshift.orchestrator.job import JobError
from gearshift.orchestrator.control.startup import STARTUP  # noqa: F401  (first: its clock starts with the process)

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gearshift", description="Distributed PyTorch training on Ray.")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    # one helper per group of commands keeps each short; the order here is the order of --help
    _add_run_commands(sub)
    _add_watch_command(sub)
    _add_planning_commands(sub)
    _add_report_and_status(sub)
    from gearshift.orchestrator.commands.runs import add_parsers as _add_runs_commands

    _add_runs_commands(sub)
    from gearshift.orchestrator.commands.export import add_parser as _add_export_command

    _add_export_command(sub)
    from gearshift.orchestrator.commands.serve import add_parser as _add_serve_command

    _add_serve_command(sub)
    from gearshift.orchestrator.commands import inspect, inspect_memory

    inspect_memory.add_parser(inspect.add_parser(sub))
    _add_schema_command(sub)
    return p


def _add_run_commands(sub) -> None:
    """run, submit, and logs/stop for a submitted job."""
    run = sub.add_parser("run", help="train a job on a local (embedded) or existing Ray cluster")
    run.add_argument("job", nargs="?", help="the job file (YAML); optional with --resume RUN_DIR")
    run.add_argument("--address", help="join this Ray cluster (default: RAY_ADDRESS, else start one here)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a job key, e.g. --set train.steps=50 (value parsed as YAML); repeatable")
    run.add_argument("--run-dir", help="where the run's files go (default: runs/<name>-<fingerprint>-<time>)")
    run.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN_DIR",
                     help="continue from the latest checkpoint of RUN_DIR (or of --run-dir, or of the newest "
                          "earlier run of the same job under runs/)")

    check = sub.add_parser("check", help="every check `run` makes, the resolved job, its first layout and the "
                                         "predicted memory and step time per layout; nothing is started")
    check.add_argument("job", help="the job file (YAML)")
    check.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    check.add_argument("--cluster", metavar="SPEC", help="predict on this hardware (a `plan --cluster` preset or "
                                                         "file; default: the job's devices on one node)")

    submit = sub.add_parser("submit", help="submit a job to a Ray cluster through its Job Submission API")
    submit.add_argument("job", help="the job file (YAML); its folder travels with it as the working dir")
    submit.add_argument("--address", help="the head's dashboard, e.g. http://HEAD:8265 (default: RAY_JOB_ADDRESS, else RAY_ADDRESS)")
    submit.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--run-dir", help="run directory on the cluster (default as for run)")
    submit.add_argument("--pip", action="append", default=[], metavar="REQUIREMENT",
                        help="an extra package Ray installs for this job (repeatable; slow on first use: "
                             "prefer the cluster's image)")
    submit.add_argument("--python", default="python",
                        help="the interpreter the head runs the job with (default: `python` on the head's PATH)")

    for name, text in (("logs", "print a submitted job's logs"), ("stop", "stop a submitted job")):
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("job_id")
        cmd.add_argument("--address")
        if name == "logs":
            cmd.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")


def _add_watch_command(sub) -> None:
    """watch: the live view of a run."""
    watch = sub.add_parser("watch", help="live view of a run: per-worker utilisation, comm wait, throughput")
    watch.add_argument("target", nargs="?", help="a run dir, or a submitted job's id (default: the newest run "
                                                 "under runs/)")
    watch.add_argument("--address", help="for a job id: the head's dashboard, as for `gearshift logs`")
    watch.add_argument("--replay", action="store_true",
                       help="for a finished run: play it back step by step instead of showing the end state")
    watch.add_argument("--speed", type=float, default=20.0, help="replay speed, times real time (default 20)")
    watch.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="stop watching a live run after S seconds without a new record")


def _add_planning_commands(sub) -> None:
    """tune, plan, simulate: choosing settings before (or instead of) training."""
    tune = sub.add_parser("tune", help="time a short trial of each setting (bucket_cap_mb, strategy) and write "
                                       "a job file with the best")
    tune.add_argument("job", help="the job file (YAML)")
    tune.add_argument("--param", action="append", default=[], metavar="NAME=V1,V2,...",
                      help="values to try: bucket_cap_mb=1,5,10,25,50,100 (the default), strategy=data,hybrid, "
                           "tp_size=2,4; repeatable, every combination is tried")
    tune.add_argument("--warmup", type=int, default=5, metavar="N", help="steps discarded after each change (5)")
    tune.add_argument("--steps", type=int, default=20, metavar="N", help="steps timed per setting (20)")
    tune.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    tune.add_argument("--address", help="join this Ray cluster (default: RAY_ADDRESS, else start one here)")
    tune.add_argument("--run-dir", help="where the trials' telemetry goes (default as for run)")
    tune.add_argument("--out", help="the tuned job file (default: JOB.tuned.yaml next to the job file)")

    plan = sub.add_parser("plan", help="predicted step time per layout and bucket size on given hardware")
    plan.add_argument("job", help="the job file (YAML)")
    plan.add_argument("--cluster", required=True, metavar="SPEC",
                      help="a preset (h100-ib400, a100-ib200, v100-dgx2h) or a YAML file: {nodes, per_node, "
                           "tflops, intra_gb_s, inter_gb_s, intra_latency_us, inter_latency_us} or {preset, nodes}")
    plan.add_argument("--nodes", type=int, help="resize the cluster to this many nodes")
    plan.add_argument("--global-batch", type=int, help="the global batch to plan for (default: the job's)")
    plan.add_argument("--json", action="store_true", help="print every layout and bucket size as one JSON object")
    plan.add_argument("--device-memory", type=float, metavar="GIB",
                      help="memory of one device in GiB (an \"80 GB\" A100: 80), in place of the cluster's")
    plan.add_argument("--calibrate", action="append", default=[], metavar="RUN_DIR",
                      help="take the device rate and link figures from a run of this model (its "
                           "telemetry.jsonl): a data run, then optionally a tensor run on one node; repeatable")
    plan.add_argument("--slow", action="append", default=[], metavar="RANKS@SPEED",
                      help="ranks computing at a share of full speed, e.g. 8-15@0.5 (ranks 8 to 15 at half speed); "
                           "each layout priced on even shares and rebalanced to the speeds; repeatable")
    plan.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")

    sim = sub.add_parser("simulate", help="the adaptive policy on simulated hardware over a scenario, against "
                                          "every static layout")
    sim.add_argument("job", help="the job file (YAML)")
    sim.add_argument("--cluster", required=True, metavar="SPEC", help="as for plan")
    sim.add_argument("--scenario", required=True, metavar="FILE",
                     help="YAML: {steps: N, inter_link: [{step: S, factor: F}, ...]}")
    sim.add_argument("--nodes", type=int)
    sim.add_argument("--global-batch", type=int)
    sim.add_argument("--calibrate", action="append", default=[], metavar="RUN_DIR", help="as for plan")
    sim.add_argument("--json", action="store_true",
                     help="print the result as one JSON object (auto_vs_oracle, auto_vs_best_static, decisions, ...)")
    sim.add_argument("--no-pipelines", dest="pipelines", action="store_false",
                     help="leave the pipelines (a stage of whole nodes each) out of the layouts and the policy's "
                          "candidates")
    sim.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")


def _add_report_and_status(sub) -> None:
    """report on a run; status of submitted jobs."""
    report = sub.add_parser("report", help="plots (PNG) and a text summary of a run")
    report.add_argument("run_dir")
    report.add_argument("--out", help="where the PNGs go (default: RUN_DIR/report)")

    status = sub.add_parser("status", help="list submitted jobs, or show one")
    status.add_argument("job_id", nargs="?")
    status.add_argument("--address")


def _add_schema_command(sub) -> None:
    schema = sub.add_parser("schema", help="print the job file's JSON Schema, for editors (yaml-language-server)")
    schema.add_argument("--output", metavar="FILE", help="write it to FILE (atomically) instead of stdout")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command is None:
        _parser().print_help()
        return EXIT_BAD_INPUT
    # `gearshift stop` (through Ray) and schedulers send SIGTERM: clean up as for Ctrl-C
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return _dispatch(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    pass


def _terminated(signum, frame):
    raise Terminated("SIGTERM")


def _schema(args) -> int:
    from gearshift.orchestrator.job.schema import cmd_schema

    return cmd_schema(args)


def _simulate(args) -> int:
    from gearshift.orchestrator.policy.simulate import cmd_simulate

    return cmd_simulate(args)


def _plan(args) -> int:
    from gearshift.orchestrator.commands.plan import cmd_plan

    return cmd_plan(args)


def _tune(args) -> int:
    from gearshift.orchestrator.commands.tune import cmd_tune

    return cmd_tune(args)


def _export(args) -> int:
    from gearshift.orchestrator.commands.export import cmd_export

    return cmd_export(args)


def _inspect(args) -> int:
    from gearshift.orchestrator.commands import inspect, inspect_memory

    if args.inspect_command == "memory":
        return inspect_memory.cmd_inspect_memory(args)
    return inspect.cmd_inspect(args)


def _serve(args) -> int:
    from gearshift.orchestrator.commands.serve import cmd_serve

    return cmd_serve(args)


def _runs(args) -> int:
    from gearshift.orchestrator.commands import runs as runs_command

    return runs_command.cmd_runs(args) if args.command == "runs" else runs_command.cmd_replay(args)


def _telemetry(args) -> int:
    from gearshift.monitoring.telemetry import TelemetryError

    try:
        return cmd_watch(args) if args.command == "watch" else cmd_report(args)
    except TelemetryError as err:
        raise UsageError(str(err)) from None


def _dispatch(args) -> int:
    """Run the command; a user's mistake, a failed run, Ctrl-C and a bug in gearshift each end in
    one paragraph and their own exit code."""
    try:
        return COMMANDS[args.command](args)
    except (JobError, UsageError) as err:
        print(f"gearshift: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except GearshiftError as err:
        print(f"gearshift: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as err:
        why = f" by {err}" if isinstance(err, Terminated) else ""
        print(f"gearshift: interrupted{why}; workers and Ray stopped.", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # the reader went away (`| head`): nothing more to say, and nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:  # a bug in gearshift, not a user mistake: short here, whole in a file
        path = pathlib.Path(tempfile.gettempdir()) / f"gearshift-error-{os.getpid()}.log"
        path.write_text("".join(traceback.format_exception(err)))
        print(f"gearshift: unexpected {type(err).__name__}: {err}. This is a bug in gearshift; the traceback "
              f"is in {path}.", file=sys.stderr)
        return EXIT_FAILED


def cmd_jobs(args) -> int:
    """submit, logs, stop, status: the commands that talk to Ray's Job Submission API."""
    from gearshift import api
    from gearshift.orchestrator.cluster import jobs_api

    try:
        if args.command == "submit":
            sub = api.submit(args.job, address=args.address, overrides=args.overrides, run_dir=args.run_dir,
                             pip=args.pip, python=args.python)
            print(sub.id)
            print(f"Follow it with: gearshift logs {sub.id} --follow", file=sys.stderr)
        elif args.command == "logs":
            jobs_api.logs(args.address, args.job_id, follow=args.follow)
        elif args.command == "stop":
            jobs_api.stop(args.address, args.job_id)
        elif args.command == "status":
            jobs_api.status(args.address, args.job_id)
    except jobs_api.JobsApiError as err:
        raise GearshiftError(str(err)) from None
    return 0


def cmd_run(args) -> int:
    from gearshift import api

    api.run(args.job, overrides=args.overrides, run_dir=args.run_dir, address=args.address, resume=args.resume,
            progress=True)
    return 0


def cmd_check(args) -> int:
    from gearshift import api

    print(api.check(args.job, overrides=args.overrides, cluster=args.cluster).text())
    return 0


def cmd_report(args) -> int:
    from gearshift.monitoring import report

    result = report.make_report(args.run_dir, args.out)
    print(result.summary_text)
    paths = list(result.paths) + _inspected_data(pathlib.Path(args.run_dir), args.out)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0


def _inspected_data(run_dir: pathlib.Path, out: str | None) -> list:
    """With data.inspect: true, the batch rank 0 trained at step 1, drawn beside the plots."""
    import yaml

    try:
        raw = yaml.safe_load((run_dir / "job.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return []
    if not isinstance(raw, dict) or not (raw.get("data") or {}).get("inspect"):
        return []
    from gearshift.orchestrator.commands import inspect
    from gearshift.orchestrator.job import load_job

    target = pathlib.Path(out) if out else run_dir / "report"
    lines: list[str] = []
    try:
        target.mkdir(parents=True, exist_ok=True)
        inspect.draw(load_job(run_dir / "job.yaml"), 1, 0, 16, target / "data-step1.png", lines.append)
    except (JobError, UsageError, OSError, ValueError) as err:
        print(f"gearshift: data.inspect: the batch could not be drawn here ({err})", file=sys.stderr)
        return []
    print("data at step 1 (rank 0):\n  " + "\n  ".join(lines))
    return [target / "data-step1.png"]


def cmd_watch(args) -> int:
    from rich.console import Console

    from gearshift.monitoring import watch

    console = Console()
    target = args.target
    if target is None or pathlib.Path(target).exists():
        from gearshift.orchestrator.records.rundir import RunDir

        path = pathlib.Path(target) if target else _newest_run()
        run = RunDir(path if path.is_dir() else path.parent)
        records = watch.follow_file(path / "telemetry.jsonl" if path.is_dir() else path, idle_timeout_s=args.timeout,
                                    alive=lambda: run.driver_alive() is not False)
        code = watch.watch(records, console, replay_speed=args.speed if args.replay else None, title=str(path))
        if run.driver_alive() is False and not _ended(run):
            print(f"gearshift: the process that ran {run.path} is gone and recorded no end: it was killed. "
                  f"Continue it with `gearshift run --resume {run.path}`.", file=sys.stderr)
            return EXIT_FAILED
        return code
    from gearshift.orchestrator.cluster import jobs_api

    try:
        lines = jobs_api.iter_log_lines(args.address, target, timeout_s=args.timeout)
        return watch.watch(watch.records_from_log_lines(lines), console,
                           replay_speed=args.speed if args.replay else None, title=target)
    except jobs_api.JobsApiError as err:
        raise GearshiftError(str(err)) from None


def _ended(run) -> bool:
    """Whether the run's summary says it finished, failed or was interrupted (not killed)."""
    import json

    try:
        return json.loads(run.summary.read_text()).get("status") in ("done", "failed", "interrupted")
    except (OSError, ValueError):
        return False


def _newest_run() -> pathlib.Path:
    from gearshift.orchestrator.records.rundir import runs_root

    root = pathlib.Path(runs_root())
    runs = sorted((p for p in root.glob("*") if (p / "telemetry.jsonl").is_file()),
                  key=lambda p: p.stat().st_mtime) if root.is_dir() else []
    if not runs:
        raise UsageError(f"no runs under {root}/ to watch; name a run dir or a job id: gearshift watch RUN_DIR")
    return runs[-1]


# Each command's function, importing what it needs only when it runs (`gearshift run` loads no
# serving code). The parser offers these names alone (a test holds the two equal); a name missing
# here is a KeyError, never a fall-through to another command.
COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "run": cmd_run, "check": cmd_check, "schema": _schema, "simulate": _simulate, "plan": _plan,
    "tune": _tune, "export": _export, "inspect": _inspect, "serve": _serve, "runs": _runs, "replay": _runs,
    "watch": _telemetry, "report": _telemetry,
    "submit": cmd_jobs, "logs": cmd_jobs, "stop": cmd_jobs, "status": cmd_jobs,
}


if __name__ == "__main__":
    sys.exit(main())
