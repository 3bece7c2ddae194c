"""`gearshift tune JOB.yaml --param bucket_cap_mb=1,5,10 --param strategy=data,hybrid`.

Offline tuning before a long run: one set of workers trains a short trial of every combination
(warm-up steps discarded, then steps timed), switching layout and bucket size in place between
trials, as a run under `strategy: auto` does. It prints samples/s and comm wait per setting,
marks the best, and writes the job file with the winner filled in.
"""

from __future__ import annotations

import itertools
import os
import pathlib
import sys

from gearshift.orchestrator.errors import GearshiftError, UsageError

PARAMS = {
    "bucket_cap_mb": "gradient bucket size in MB, numbers > 0",
    "strategy": "data, tensor or hybrid",
    "tp_size": "tensor-parallel group size, integers >= 1",
}
DEFAULT_BUCKETS = [1.0, 5.0, 10.0, 25.0, 50.0, 100.0]


def parse_params(items: list[str]) -> dict[str, list]:
    """['bucket_cap_mb=1,5', 'strategy=data,hybrid'] -> {'bucket_cap_mb': [1.0, 5.0], ...}"""
    space: dict[str, list] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or name not in PARAMS or not text.strip():
            raise UsageError(f"--param {item!r}: give NAME=V1,V2,... with NAME one of "
                             f"{', '.join(PARAMS)} (e.g. --param bucket_cap_mb=1,5,10,25)")
        if name in space:
            raise UsageError(f"--param {name} is given twice; list every value once: {name}=V1,V2,...")
        values = []
        for raw in text.split(","):
            raw = raw.strip()
            try:
                if name == "bucket_cap_mb":
                    value = float(raw)
                    ok = 0 < value <= 4096
                elif name == "tp_size":
                    value = int(raw)
                    ok = value >= 1
                else:
                    value, ok = raw, raw in ("data", "tensor", "hybrid")
            except ValueError:
                ok = False
            if not ok:
                raise UsageError(f"--param {name}: {raw!r} is not valid; {name} takes {PARAMS[name]}")
            if value in values:
                raise UsageError(f"--param {name}: {raw!r} is listed twice")
            values.append(value)
        space[name] = values
    space.setdefault("bucket_cap_mb", list(DEFAULT_BUCKETS))
    return space


def check_space(job, space: dict[str, list]) -> None:
    """Every combination must be a layout the job can take: refused here, before anything starts."""
    from gearshift.strategies.layout import Layout, LayoutError

    names = list(space)
    w = job.cluster.num_workers
    for values in itertools.product(*space.values()):
        setting = dict(zip(names, values))
        strategy = setting.get("strategy", "data" if job.parallel.strategy == "auto" else job.parallel.strategy)
        tp = setting.get("tp_size", job.parallel.tp_size)
        if strategy == "hybrid" and tp is None:
            raise UsageError("--param strategy=...hybrid needs a tensor-parallel size: set parallel.tp_size in the "
                             "job or add --param tp_size=K")
        try:
            layout = Layout.for_workers(strategy, w, tp if strategy != "data" else None)
        except LayoutError as err:
            raise UsageError(f"--param setting {setting}: {err}") from None
        if job.train.global_batch_size % layout.dp:
            raise UsageError(f"--param setting {setting}: dp({layout.dp}) must divide train.global_batch_size "
                             f"({job.train.global_batch_size})")


def table(trials: list[dict], names: list[str]) -> str:
    best = max(range(len(trials)), key=lambda i: trials[i]["score"]) if trials else None
    head = "".join(f"{n:>15}" for n in names) + f"{'samples/s':>12}{'comm wait':>11}{'step ms':>9}"
    lines = [head]
    for i, t in enumerate(trials):
        cells = "".join(f"{_cell(t['setting'][n]):>15}" for n in names)
        wait = f"{t['comm_wait_frac']:.1%}" if t.get("comm_wait_frac") is not None else "-"
        step = f"{t['step_time'] * 1000:.1f}" if t.get("step_time") else "-"
        lines.append(f"{cells}{t['score']:>12,.1f}{wait:>11}{step:>9}" + ("   <- best" if i == best else ""))
    return "\n".join(lines)


def _cell(v) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def cmd_tune(args) -> int:
    from gearshift.monitoring.progress import ProgressView
    from gearshift.orchestrator.control.bucket_tuning import BucketTuning, distinct_buckets
    from gearshift.orchestrator.control.controller import Controller
    from gearshift.orchestrator.job import dump_job, load_job
    from gearshift.orchestrator.records.rundir import RunDir
    from gearshift.orchestrator.cluster.worker_group import RayWorkerGroup, check_reachable, embedded_cpus, ray_session

    if args.warmup < 0 or args.steps < 1:
        raise UsageError(f"--warmup {args.warmup} / --steps {args.steps}: warm-up steps >= 0, timed steps >= 1")
    space = parse_params(args.param)
    base = load_job(args.job, args.overrides)  # a bad file fails here
    check_space(base, space)
    n = len(list(itertools.product(*space.values())))
    first = {k: v[0] for k, v in space.items()}
    steps = n * (args.warmup + args.steps)
    strategy = first.get("strategy", "data" if base.parallel.strategy == "auto" else base.parallel.strategy)
    tp = first.get("tp_size", base.parallel.tp_size)
    # the trials run as one job: as many steps as they take, no policy, no checkpoints
    job = load_job(args.job, [*args.overrides, f"train.steps={steps}", "checkpoint.every=0",
                              f"parallel.strategy={strategy}", f"parallel.bucket_cap_mb={first['bucket_cap_mb']}",
                              f"tune.warmup_steps={args.warmup}", f"tune.trial_steps={args.steps}",
                              *([f"parallel.tp_size={tp}"] if tp is not None and strategy != "data" else [])])
    address = args.address or os.environ.get("RAY_ADDRESS") or None
    if address:
        check_reachable(address)
    run = RunDir.create(job, args.run_dir)
    view = ProgressView()
    view.say(f"gearshift tune: {job.name}: {n} setting(s) x ({args.warmup} warm-up + {args.steps} timed steps) on "
             f"{job.cluster.num_workers} worker(s); run dir {run.path}")
    with ray_session(address, num_cpus=embedded_cpus(job)) as session:
        tuning = BucketTuning(grid=space)  # every setting of the space, then the run stops
        def group_factory(j):
            return RayWorkerGroup(j, embedded=session["embedded"],
                                  checkpoint_dir=str(run.checkpoint_root(j.checkpoint, j.base_dir).resolve()))

        controller = Controller(job, run, group_factory, view=view,
                                tuning=tuning)
        controller.run()
    if not tuning.rounds:
        raise GearshiftError(f"the trials ended before the last one was timed; see {run.path}/telemetry.jsonl")
    trials = tuning.rounds[-1]["trials"]
    print(table(trials, list(space)))
    params = controller.summary.get("parameters")
    _, same = distinct_buckets(space["bucket_cap_mb"], params, 1)
    if same:
        print(f"note: the gradients ({params * 4 / 2**20:.2f} MB in fp32) fit one bucket from "
              f"{min(same.values()):g} MB on: {', '.join(f'{v:g}' for v in same)} MB are the same setting as "
              f"{min(same.values()):g}, and their differences are run-to-run noise")
    best = max(trials, key=lambda t: t["score"])["setting"]
    winner = [f"parallel.{k}={v}" for k, v in best.items()]
    tuned = load_job(args.job, [*args.overrides, *winner])
    out = pathlib.Path(args.out) if args.out else pathlib.Path(args.job).with_suffix(".tuned.yaml")
    out.write_text(f"# written by gearshift tune: best of {n} setting(s), "
                   f"{', '.join(f'{k}={_cell(v)}' for k, v in best.items())}\n" + dump_job(tuned))
    print(f"best: {', '.join(f'{k}={_cell(v)}' for k, v in best.items())}; job file with it: {out}", file=sys.stderr)
    return 0
