"""What gearshift costs next to the tools users would otherwise run: torchrun + DDP, Ray Train.

The same model (the built-in GPT of examples/gpt.yaml), global batch, world size (2), backend
(gloo on CPU), optimizer and batches, trained three ways, alternating, `--repeats` times:

- gearshift: `gearshift run` (it starts an embedded Ray; data parallel, telemetry on);
- gearshift_joined: the same, joining a Ray head that is already up (`--address`), as on a
  cluster: the time to first step without starting Ray;
- torchrun: `torchrun --nproc-per-node 2` running a plain DDP loop (this file, `--as ddp`);
- Ray Train: `TorchTrainer` (Ray Train v2, RAY_TRAIN_V2_ENABLED=1) with the same loop
  (`--as raytrain`; needs `pip install "ray[train]"`).

The plain loop is what a user would write: DDP(model), AdamW, one thread per process like
gearshift's workers, the batch of each step read from the same dataset. Each run is timed from
the command's start (a subprocess, like a user's shell) to rank 0's end of each step
(wall clock), and to the command's exit:

- steady samples/s: (N - W) x batch / (end of step N - end of step W), W = `--warmup`;
- first step: seconds from the command's start to the end of step 1;
- wall: seconds from the command's start to its exit.

    python bench/overhead.py            # 3 repeats of 300 steps
    python bench/overhead.py --quick    # 1 repeat of 120 steps
    python bench/overhead.py --smoke    # gearshift and torchrun, 1 repeat of 8 steps: that it runs (CI)
    python bench/overhead.py --skip raytrain,gearshift_joined --compare before=../old

`--compare NAME=CHECKOUT` adds `gearshift@NAME`: the same run from another checkout of gearshift
(before a change; run in that folder with its own .venv), alternating with the rest.
Every gearshift run also reports each process's peak resident memory (the driver's, and the
largest of its workers'), polled every 0.2 s over the command's process tree (bench/ingest.py's
Watcher); `ratio_gearshift_vs_gearshift@NAME` and `peak_rss_*_gearshift_over_gearshift@NAME`
compare it with the other checkout.

The last line is one JSON object with `ratio_gearshift_vs_torchrun` and
`ratio_gearshift_vs_raytrain` (steady samples/s, higher is better for gearshift), and
`first_step_gearshift_over_torchrun` / `first_step_raytrain_over_gearshift` (time ratios).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
JOB = ROOT / "examples" / "gpt.yaml"
WORLD = 2


# ----------------------------------------------------------------------------- the plain loop

def plain_loop(rank: int, world: int, steps: int, batch: int, out: str | None) -> None:
    """DDP over gloo on the job's model and batches; rank 0 writes its step end times to `out`."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from gearshift.orchestrator.job import load_job
    from gearshift.workers.build import components
    from gearshift.workers.step.data import GlobalBatches, load_batch

    torch.set_num_threads(1)
    job = load_job(JOB, [f"train.global_batch_size={batch}"])
    spec = job.to_dict()
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], [job.base_dir])
    dataset = components.build_dataset(spec["data"], spec["model"], [job.base_dir])
    loss_fn = components.build_loss(spec["loss"], [job.base_dir])
    assert dist.is_initialized(), "torchrun or Ray Train sets up the process group"
    ddp = DistributedDataParallel(model, bucket_cap_mb=job.parallel.bucket_cap_mb)
    opt = components.build_optimizer(ddp.parameters(), spec["optimizer"])  # the job's AdamW, as gearshift builds it
    order = GlobalBatches(len(dataset), batch, job.train.seed)
    ends = []
    for step in range(steps):
        x, y = load_batch(dataset, order.shard(step, rank, world))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()
        if job.train.grad_clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), job.train.grad_clip)
        opt.step()
        ends.append(time.time())
    if rank == 0 and out:
        pathlib.Path(out).write_text(json.dumps({"step_ends": ends, "loss": loss.item()}))


def as_ddp(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        plain_loop(dist.get_rank(), dist.get_world_size(), args.steps, args.batch, args.out)
    finally:
        dist.destroy_process_group()


def as_raytrain(args) -> None:
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, logging_level="WARNING")
    try:
        def loop(config):
            import ray.train
            import torch.distributed as dist

            ctx = ray.train.get_context()
            assert dist.is_initialized()
            plain_loop(ctx.get_world_rank(), ctx.get_world_size(), config["steps"], config["batch"],
                       config["out"])

        trainer = TorchTrainer(loop, train_loop_config={"steps": args.steps, "batch": args.batch, "out": args.out},
                               scaling_config=ScalingConfig(num_workers=WORLD, use_gpu=False,
                                                            resources_per_worker={"CPU": 1}),
                               torch_config=TorchConfig(backend="gloo"),
                               run_config=RunConfig(storage_path=args.storage, name="overhead"))
        trainer.fit()
    finally:
        ray.shutdown()


# ----------------------------------------------------------------------------- the three runs

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd: list[str], env: dict | None = None, timeout_s: float = 900,
          peaks: dict | None = None, cwd: pathlib.Path = ROOT) -> tuple[float, float, str]:
    """(wall-clock start, seconds to exit, stderr tail) of a command, run like a user's shell would.
    With `peaks`, the peak resident bytes of the command's processes go there by role (driver, worker)."""
    from bench.ingest import Watcher

    start = time.time()
    proc = subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    watcher = Watcher(proc.pid) if peaks is not None else None
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=60)
    finally:
        if watcher is not None:
            watcher.stop()
    if proc.returncode != 0:
        raise SystemExit(f"{cmd[:4]} failed ({proc.returncode}):\n{err[-3000:]}")
    if watcher is not None:
        for role in ("driver", "worker"):
            peaks[role] = max((rss for r, rss, _, _ in watcher.peaks.values() if r == role), default=0)
    return start, time.time() - start, err[-2000:]


def figures(start: float, wall: float, ends: list[float], batch: int, warmup: int) -> dict:
    n = len(ends)
    return {"samples_per_s": (n - warmup) * batch / (ends[-1] - ends[warmup - 1]),
            "first_step_s": ends[0] - start, "wall_s": wall, "steps": n}


def run_gearshift(steps: int, batch: int, warmup: int, tmp: pathlib.Path, address: str | None = None,
                  checkout: pathlib.Path | None = None) -> dict:
    run_dir = tmp / f"gearshift-{time.monotonic_ns()}"
    peaks: dict[str, int] = {}
    python = str(checkout / ".venv" / "bin" / "python") if checkout else sys.executable
    start, wall, _ = timed([python, "-m", "gearshift", "run", str(JOB), "--run-dir", str(run_dir),
                            "--set", f"cluster.num_workers={WORLD}", "--set", f"train.steps={steps}",
                            "--set", f"train.global_batch_size={batch}", "--set", "checkpoint.every=0",
                            "--set", "parallel.strategy=data", "--set", "telemetry.enabled=true",
                            *(["--address", address] if address else [])],
                           env={"RAY_AUTH_MODE": "token"} if address else None, peaks=peaks,
                           cwd=checkout or ROOT)
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    ends = [r["ended_at"] for r in sorted((r for r in records if r["type"] == "step"), key=lambda r: r["step"])]
    return {**figures(start, wall, ends, batch, warmup), "peak_rss_driver": peaks["driver"],
            "peak_rss_worker": peaks["worker"]}


class RunningRay:
    """A Ray head kept up by a helper process (started and stopped by its pid), for gearshift
    joining an existing cluster with --address, as on a real one: no Ray start in its time."""

    SCRIPT = ("import ray, signal, sys; ray.init(address='local', num_cpus=int(sys.argv[1]), include_dashboard=False,"
              " logging_level='WARNING'); print(ray.get_runtime_context().gcs_address, flush=True); "
              "signal.sigwait({signal.SIGTERM, signal.SIGINT}); ray.shutdown()")

    def __enter__(self) -> str:
        self.proc = subprocess.Popen([sys.executable, "-c", self.SCRIPT, str(os.cpu_count())], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
                                     env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
        self.address = self.proc.stdout.readline().strip()
        if not self.address:
            raise SystemExit("the helper Ray head did not start")
        return self.address

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


def run_gearshift_joined(steps: int, batch: int, warmup: int, tmp: pathlib.Path) -> dict:
    # the head is up only for this run (its start is not timed): idle Ray processes must not
    # take CPU from the other systems' runs on a 2-core machine
    with RunningRay() as address:
        return run_gearshift(steps, batch, warmup, tmp, address=address)


def run_torchrun(steps: int, batch: int, warmup: int, tmp: pathlib.Path) -> dict:
    out = tmp / f"ddp-{time.monotonic_ns()}.json"
    start, wall, _ = timed([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={WORLD}",
                            f"--master-port={free_port()}", str(pathlib.Path(__file__)), "--as", "ddp",
                            "--steps", str(steps), "--batch", str(batch), "--out", str(out)],
                           env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
    return figures(start, wall, json.loads(out.read_text())["step_ends"], batch, warmup)


def run_raytrain(steps: int, batch: int, warmup: int, tmp: pathlib.Path) -> dict:
    out = tmp / f"raytrain-{time.monotonic_ns()}.json"
    start, wall, _ = timed([sys.executable, str(pathlib.Path(__file__)), "--as", "raytrain", "--steps", str(steps),
                            "--batch", str(batch), "--out", str(out), "--storage", str(tmp / "raytrain-storage")],
                           env={"RAY_TRAIN_V2_ENABLED": "1", "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"})
    return figures(start, wall, json.loads(out.read_text())["step_ends"], batch, warmup)


SYSTEMS = {"gearshift": run_gearshift, "gearshift_joined": run_gearshift_joined, "torchrun": run_torchrun,
           "raytrain": run_raytrain}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat of 120 steps")
    ap.add_argument("--smoke", action="store_true", help="gearshift and torchrun only, one repeat of 8 steps (3 of "
                    "warm-up): that the bench runs (Ray Train needs the bench extra)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=20, help="steps left out of the steady rate")
    ap.add_argument("--skip", default="", help="systems to leave out, comma-separated (e.g. raytrain)")
    ap.add_argument("--compare", action="append", default=[], metavar="NAME=CHECKOUT",
                    help="also run gearshift from another checkout (with its .venv) as gearshift@NAME")
    ap.add_argument("--as", dest="role", choices=["ddp", "raytrain"], help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--storage", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.role == "ddp":
        return as_ddp(args)
    if args.role == "raytrain":
        return as_raytrain(args)
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    steps = args.steps or (8 if args.smoke else 120 if args.quick else 300)
    if args.smoke:
        args.warmup = min(args.warmup, 3)
    skip = args.skip.split(",") + (["raytrain", "gearshift_joined"] if args.smoke else [])
    systems = [s for s in SYSTEMS if s not in skip]
    for spec in args.compare:
        name, sep, folder = spec.partition("=")
        checkout = pathlib.Path(folder).resolve()
        if not sep or not name or not (checkout / ".venv" / "bin" / "python").exists():
            raise SystemExit(f"--compare {spec!r}: give NAME=CHECKOUT, a checkout of gearshift with its .venv")
        SYSTEMS[f"gearshift@{name}"] = (lambda s, b, w, t, c=checkout: run_gearshift(s, b, w, t, checkout=c))
        systems.append(f"gearshift@{name}")
    print(f"GPT (examples/gpt.yaml), {WORLD} workers, gloo on CPU, batch {args.batch}, {steps} steps "
          f"(steady rate after {args.warmup}), {repeats} repeat(s), alternating; {platform.machine()} with "
          f"{os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    with tempfile.TemporaryDirectory(prefix="gs-overhead-") as tmp:
        tmp = pathlib.Path(tmp)
        for r in range(repeats):
            order = systems[r % len(systems):] + systems[:r % len(systems)]  # rotate who goes first
            for name in order:
                result = SYSTEMS[name](steps, args.batch, args.warmup, tmp)
                runs[name].append(result)
                print(f"  repeat {r + 1} {name:<10}{result['samples_per_s']:>9.1f} samples/s  first step "
                      f"{result['first_step_s']:>5.2f} s  wall {result['wall_s']:>6.2f} s", flush=True)
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("samples_per_s", "first_step_s", "wall_s",
                                                                   "peak_rss_driver", "peak_rss_worker") if k in rs[0]}
           for name, rs in runs.items()}
    show_table(runs)
    ratios = ratios_of(runs, med)
    for k, v in ratios.items():
        if not k.endswith(("_min", "_max", "_median_of_repeats")):
            lo, hi = ratios.get(f"{k}_min"), ratios.get(f"{k}_max")
            spread = f"  [{lo:.3f}..{hi:.3f} over repeats]" if lo is not None else ""
            print(f"{k:<40}{v:.3f}{spread}")
    print(json.dumps({"bench": "overhead", "world": WORLD, "batch": args.batch, "steps": steps, "repeats": repeats,
                      "medians": med, "runs": runs, **ratios}))


def show_table(runs: dict[str, list[dict]]) -> None:
    """Per system: samples/s, first step and wall, then peak resident memory (medians [min..max])."""
    print(f"\n{'':<18}{'samples/s':>20}{'first step s':>22}{'wall s':>22}   (medians [min..max])")
    for name, rs in runs.items():
        cells = []
        for key, fmt in (("samples_per_s", ".1f"), ("first_step_s", ".2f"), ("wall_s", ".2f")):
            vals = [x[key] for x in rs]
            cells.append(f"{statistics.median(vals):{fmt}} [{min(vals):{fmt}}..{max(vals):{fmt}}]")
        print(f"{name:<18}{cells[0]:>20}{cells[1]:>22}{cells[2]:>22}")
    print(f"\n{'peak resident MiB':<18}{'driver':>20}{'largest worker':>22}   (medians [min..max])")
    for name, rs in runs.items():
        if "peak_rss_driver" in rs[0]:
            cells = [f"{statistics.median(v) / 2**20:.0f} [{min(v) / 2**20:.0f}..{max(v) / 2**20:.0f}]"
                     for v in ([x[k] for x in rs] for k in ("peak_rss_driver", "peak_rss_worker"))]
            print(f"{name:<18}{cells[0]:>20}{cells[1]:>22}")


def ratios_of(runs: dict[str, list[dict]], med: dict[str, dict]) -> dict:
    """gearshift against each other system, per repeat (min, max, median of repeats) and of the medians."""
    ratios = {}
    # per-repeat ratios (the systems of one repeat ran back to back): their min..max is the spread
    def per_repeat(a: str, b: str, key: str, invert: bool = False) -> list[float]:
        return sorted((y[key] / x[key]) if invert else (x[key] / y[key]) for x, y in zip(runs[a], runs[b]))

    for a, b, key, name, inv in (("gearshift", "torchrun", "samples_per_s", "ratio_gearshift_vs_torchrun", False),
                                 ("gearshift", "torchrun", "first_step_s", "first_step_gearshift_over_torchrun", False),
                                 ("gearshift", "torchrun", "wall_s", "wall_gearshift_over_torchrun", False),
                                 ("gearshift", "raytrain", "samples_per_s", "ratio_gearshift_vs_raytrain", False),
                                 ("gearshift", "raytrain", "first_step_s", "first_step_raytrain_over_gearshift", True),
                                 ("gearshift", "raytrain", "wall_s", "wall_raytrain_over_gearshift", True)):
        if a in runs and b in runs:
            r = per_repeat(a, b, key, inv)
            ratios[f"{name}_min"], ratios[f"{name}_max"] = r[0], r[-1]
            ratios[f"{name}_median_of_repeats"] = statistics.median(r)
    # this checkout against another (--compare): per-repeat ratios, their median and spread
    for other in (s for s in runs if s.startswith("gearshift@") and "gearshift" in runs):
        for key, name in (("samples_per_s", f"ratio_gearshift_vs_{other}"),
                          ("peak_rss_driver", f"peak_rss_driver_gearshift_over_{other}"),
                          ("peak_rss_worker", f"peak_rss_worker_gearshift_over_{other}")):
            r = per_repeat("gearshift", other, key)
            ratios[name] = statistics.median(r)
            ratios[f"{name}_min"], ratios[f"{name}_max"] = r[0], r[-1]
            ratios[f"{name}_median_of_repeats"] = statistics.median(r)
    g = med.get("gearshift")
    if g and "torchrun" in med:
        ratios["ratio_gearshift_vs_torchrun"] = g["samples_per_s"] / med["torchrun"]["samples_per_s"]
        ratios["first_step_gearshift_over_torchrun"] = g["first_step_s"] / med["torchrun"]["first_step_s"]
        ratios["wall_gearshift_over_torchrun"] = g["wall_s"] / med["torchrun"]["wall_s"]
    if "gearshift_joined" in med and "torchrun" in med:
        ratios["first_step_gearshift_joined_over_torchrun"] = (med["gearshift_joined"]["first_step_s"]
                                                               / med["torchrun"]["first_step_s"])
    if g and "raytrain" in med:
        ratios["ratio_gearshift_vs_raytrain"] = g["samples_per_s"] / med["raytrain"]["samples_per_s"]
        ratios["first_step_raytrain_over_gearshift"] = med["raytrain"]["first_step_s"] / g["first_step_s"]
        ratios["wall_raytrain_over_gearshift"] = med["raytrain"]["wall_s"] / g["wall_s"]
    return ratios


if __name__ == "__main__":
    main()
