"""Hybrid's data-parallel average, overlapped with backward against after it (as root).

On the two-node testbed (bench/testbed/testbed.py: two network namespaces joined by a
tbf-shaped veth, a Ray node in each, 2 workers per node), hybrid(2 x 2) trains the built-in GPT
with its tensor-parallel pairs inside a node and its data-parallel pairs across the shaped link.
"before" averages the data-parallel gradients after backward, one bucket after the other
(`parallel.dp_overlap: false`, what every earlier version did); "after" all-reduces each bucket
asynchronously as soon as backward has produced its gradients (the default). The two alternate,
repeat by repeat, on the same testbed, so the machine's drift hits both alike.

Per run, over the steps after `--warmup`: the median step time (`step_time_max`, the slowest
rank), the median comm wait (mean over ranks) and, for "after", the share of the data-parallel
all-reduces' time that ran behind backward instead of being waited for: `comm_hidden_frac_mean`
in its step records (the averager times each bucket from launch to completion on the host, and
what of that falls outside its wait after backward is hidden).

The run is sized so that backward computes about as long as its gradients take over the link
(the overlap can hide at most the shorter of the two): at 40mbit the built-in GPT (2 layers of
128, about 0.45 M parameters) on 64-token sequences, 256 sequences a step, in buckets of 0.25 MB
(`--bucket-mb`; the job's 25 MB would put this model's gradients in one bucket, which can only
go out once backward is done, as DDP's would).

    sudo python bench/overlap.py                 # 40mbit, 3 repeats of 40 steps each way
    sudo python bench/overlap.py --quick         # 3 repeats of 20 steps: about 8 minutes
    python bench/overlap.py --quick --dry-run    # the runs it would make, their jobs checked (no root needed)

The last line of output is one JSON object: `hybrid_step_after_over_before` (median over
repeats of after's median step time / before's, in the same repeat; `_min`, `_max` its spread),
`hybrid_dp_wait_hidden_frac` (median over the "after" runs of their median hidden share),
`comm_wait_after_over_before`, and the per-repeat figures.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "testbed"))
sys.path.insert(0, str(ROOT))

from testbed import Testbed  # noqa: E402

VARIANTS = {"before": ["parallel.dp_overlap=false"], "after": ["parallel.dp_overlap=true"]}


def driver_argv(variant: str, steps: int, batch: int, run_dir: pathlib.Path, extra: list[str]) -> list[str]:
    """`gearshift` arguments of one run (the testbed adds --address)."""
    argv = ["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run_dir),
            "--set", f"train.steps={steps}", "--set", f"train.global_batch_size={batch}",
            "--set", "cluster.num_workers=4", "--set", "cluster.cpus_per_worker=0.5",
            "--set", "checkpoint.every=0", "--set", "cluster.placement=pack",
            "--set", "parallel.strategy=hybrid", "--set", "parallel.tp_size=2"]
    for item in [*VARIANTS[variant], *extra]:
        argv += ["--set", item]
    return argv


def dry_run(args, steps: int, extra: list[str]) -> None:
    """Every run's `gearshift` arguments, in the bench's order, each variant's job checked as
    `gearshift run` checks it; nothing is brought up."""
    from testbed import check_driver_args

    tb = Testbed(rate=args.rate, dry_run=True)
    root = pathlib.Path(tempfile.gettempdir()) / "gs-overlap-XXXX"
    print(f"testbed: 2 nodes joined at {args.rate}; each run: {shlex.join(tb.driver_command(['ARGS']))}")
    for rep in range(args.repeats):
        for variant in (list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))):
            argv = driver_argv(variant, steps, args.batch, root / f"{variant}-{rep}", extra)
            print(f"repeat {rep + 1} {variant}: {shlex.join(argv)}")
    for variant in VARIANTS:
        argv = driver_argv(variant, steps, args.batch, root / "check", extra)
        print(f"{variant}: the job checked as `gearshift run` checks it, starts as {check_driver_args(argv)}")


def run_one(tb: Testbed, variant: str, steps: int, warmup: int, batch: int, tmp: pathlib.Path,
            extra: list[str]) -> dict:
    run_dir = tmp / f"{variant}-{len(list(tmp.iterdir()))}"
    done = tb.run_driver(driver_argv(variant, steps, batch, run_dir, extra), capture=True)
    if done.returncode != 0:
        raise SystemExit(f"{variant} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    steady = [r for r in records if r["type"] == "step" and r["step"] > warmup]
    if not steady:
        raise SystemExit(f"{variant}: no step records after step {warmup} in {run_dir}")
    hidden = [r["comm_hidden_frac_mean"] for r in steady if r.get("comm_hidden_frac_mean") is not None]
    return {"step_s": statistics.median(r["step_time_max"] for r in steady),
            "comm_wait_s": statistics.median(r["comm_wait_mean"] for r in steady),
            "hidden_s": statistics.median([r["comm_hidden_mean"] for r in steady
                                           if r.get("comm_hidden_mean") is not None] or [0.0]),
            "hidden_frac": statistics.median(hidden) if hidden else None, "steps": len(steady)}


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="20 steps a run: about 8 minutes with 3 repeats")
    ap.add_argument("--rate", default="40mbit", help="the link between the nodes (tc units)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="steps a run (default 40, --quick 20)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of every figure")
    ap.add_argument("--batch", type=int, default=256, help="global batch (sequences of 64 tokens)")
    ap.add_argument("--bucket-mb", type=float, default=0.25, help="parallel.bucket_cap_mb for both variants")
    ap.add_argument("--set", action="append", default=[], dest="extra", help="more job overrides, KEY=VALUE")
    ap.add_argument("--dry-run", action="store_true", help="print every run's gearshift arguments and check each "
                    "variant's job as `gearshift run` would; run nothing (no root needed)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    steps = args.steps or (20 if args.quick else 40)
    if steps <= args.warmup:
        raise SystemExit(f"--steps {steps} must be more than --warmup {args.warmup}")
    extra = [f"parallel.bucket_cap_mb={args.bucket_mb}", *args.extra]
    if args.dry_run:
        return dry_run(args, steps, extra)
    print(f"hybrid(2 x 2) GPT (examples/gpt.yaml), 2 nodes (network namespaces) joined at {args.rate}, batch "
          f"{args.batch}, {steps} steps a run ({args.warmup} warm-up), {args.repeats} repeat(s) interleaved, on "
          f"{platform.machine()} with {os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="gs-overlap-") as tmp, Testbed(rate=args.rate) as tb:
        for rep in range(args.repeats):
            order = list(VARIANTS) if rep % 2 == 0 else list(reversed(VARIANTS))
            for variant in order:
                r = run_one(tb, variant, steps, args.warmup, args.batch, pathlib.Path(tmp), extra)
                runs[variant].append(r)
                frac = f"{r['hidden_frac']:.2f}" if r["hidden_frac"] is not None else "-"
                print(f"  repeat {rep + 1} {variant:6s}: step {r['step_s'] * 1e3:7.1f} ms, comm wait "
                      f"{r['comm_wait_s'] * 1e3:7.1f} ms, hidden {r['hidden_s'] * 1e3:6.1f} ms ({frac})", flush=True)
    ratios = [a["step_s"] / b["step_s"] for a, b in zip(runs["after"], runs["before"])]
    waits = [a["comm_wait_s"] / b["comm_wait_s"] for a, b in zip(runs["after"], runs["before"]) if b["comm_wait_s"] > 0]
    fracs = [r["hidden_frac"] for r in runs["after"] if r["hidden_frac"] is not None]
    s = spread(ratios)
    print()
    print(f"{'':8s} {'step ms (median, min..max)':>30s} {'comm wait ms':>14s}")
    for v in VARIANTS:
        st = spread([r["step_s"] * 1e3 for r in runs[v]])
        print(f"{v:8s} {st['median']:10.1f} ({st['min']:.1f}..{st['max']:.1f}) "
              f"{statistics.median(r['comm_wait_s'] for r in runs[v]) * 1e3:14.1f}")
    print(f"after / before step time: {s['median']:.3f} ({s['min']:.3f}..{s['max']:.3f}); data-parallel all-reduce "
          f"time hidden behind backward: {statistics.median(fracs) if fracs else float('nan'):.2f}")
    print(json.dumps({
        "rate": args.rate, "batch": args.batch, "bucket_cap_mb": args.bucket_mb, "steps": steps, "repeats": args.repeats,
        "hybrid_step_after_over_before": s["median"], "hybrid_step_after_over_before_min": s["min"],
        "hybrid_step_after_over_before_max": s["max"],
        "hybrid_dp_wait_hidden_frac": statistics.median(fracs) if fracs else None,
        "comm_wait_after_over_before": statistics.median(waits) if waits else None,
        "per_repeat": {v: runs[v] for v in VARIANTS},
    }))


if __name__ == "__main__":
    main()
