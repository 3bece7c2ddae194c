"""The path from `gearshift run` to the first step, stage by stage, over repeats.

    python bench/startup.py               # 3 repeats
    python bench/startup.py --repeats 5
    python bench/startup.py --smoke       # 1 repeat: that it runs (CI)

Each run is `gearshift run examples/gpt.yaml` (2 workers, 5 steps) in a subprocess, with an
embedded Ray; the stages come from the run's `startup` event (orchestrator/startup.py: seconds
since the command's process started: imports, job checked, Ray up, placement, worker processes
up, rendezvous, model built, first step). A variant is an environment to run under, given as
NAME:VAR=VALUE,VAR=VALUE with --variant (repeatable), interleaved with the others; without any,
one variant, the plain command. The last line is JSON: per variant and stage, the median and
min..max.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "gpt.yaml"
VARIANTS = {"default": {}}
STAGES = ("imports", "job", "ray", "placement", "workers", "rendezvous", "build", "first_step")


def run_once(env: dict, tmp: pathlib.Path) -> dict:
    run_dir = tmp / f"run-{time.monotonic_ns()}"
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "gearshift", "run", str(JOB), "--run-dir", str(run_dir),
                           "--set", "cluster.num_workers=2", "--set", "train.steps=5", "--set", "checkpoint.every=0"],
                          cwd=ROOT, env={**os.environ, "RAY_ADDRESS": "", **env}, capture_output=True, text=True,
                          timeout=600)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"gearshift run failed ({done.returncode}):\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    [startup] = [r for r in records if r.get("event") == "startup"]
    at = {s["stage"]: s["at"] for s in startup["stages"]}
    took = {s["stage"]: s["took"] for s in startup["stages"]}
    return {"at": at, "took": took, "first_step_s": startup["seconds"], "wall_s": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="NAME:VAR=VALUE,VAR=VALUE")
    ap.add_argument("--smoke", action="store_true", help="1 repeat: that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        args.repeats = 1
    for spec in args.variant:
        name, _, env = spec.partition(":")
        VARIANTS[name] = dict(kv.split("=", 1) for kv in env.split(",") if kv)
    if args.variant:
        VARIANTS.pop("default")
    names = list(VARIANTS)
    print(f"gearshift run examples/gpt.yaml, 2 workers, 5 steps; {args.repeats} repeat(s), interleaved; "
          f"{platform.machine()} with {os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="gs-startup-") as tmp:
        for r in range(args.repeats):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                got = run_once(VARIANTS[name], pathlib.Path(tmp))
                runs[name].append(got)
                print(f"  repeat {r + 1} {name:<8} first step {got['first_step_s']:5.2f} s  wall {got['wall_s']:5.2f} s  "
                      + "  ".join(f"{s} {got['took'].get(s, float('nan')):.2f}" for s in STAGES), flush=True)
    out = {}
    print(f"\n{'stage (s it took)':<18}" + "".join(f"{n:>22}" for n in names) + "   (medians [min..max])")
    for stage in STAGES + ("first_step_s", "wall_s"):
        row, out[stage] = [], {}
        for n in names:
            vals = [x["took"].get(stage) if stage in STAGES else x[stage] for x in runs[n]]
            vals = [v for v in vals if v is not None]
            if not vals:
                row.append(f"{'-':>22}")
                continue
            m = statistics.median(vals)
            out[stage][n] = {"median": m, "min": min(vals), "max": max(vals)}
            row.append(f"{f'{m:.2f} [{min(vals):.2f}..{max(vals):.2f}]':>22}")
        print(f"{stage:<18}" + "".join(row))
    print(json.dumps({"bench": "startup", "repeats": args.repeats, "machine": platform.machine(),
                      "cpus": os.cpu_count(), "stages": out}))


if __name__ == "__main__":
    main()
