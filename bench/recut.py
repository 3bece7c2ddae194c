"""What a recut buys: a pipeline whose second stage computes 4x as long, cut again live against
the same pipeline left as it was.

Two stages of four 512-wide MLP blocks on 2 workers of a local Ray (`gearshift run`), rank 1
slowed by `inject.slow` (factor 4: it sleeps three times its compute after each step). `recut`
runs with `adapt.stragglers: rebalance`, which moves blocks off the slow stage; `static` with
`adapt.stragglers: off`. Both train the same steps on the same batches, interleaved repeat by
repeat. The figure is the median step time (`step_time_max` of the step records) over the steps
from a dozen after the recut to the end, over the static run's median over the same steps, with
its spread over repeats. (tests/test_pipeline_run.py checks that the recut is made, what it
moves, and that the run ends where plain PyTorch does; timing is this bench's.)

    python bench/recut.py              # 3 repeats of 48 steps
    python bench/recut.py --smoke      # 1 repeat of 24 steps: that it runs (CI)

Goal: recut / static <= 0.9. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ["train.global_batch_size=64", "checkpoint.every=0", "train.grad_clip=1.0", "cluster.num_workers=2",
       "model.kwargs={in_features: 784, hidden: 512, out_features: 10, layers: 8}",
       "inject.slow={ranks: [1], factor: 4}", "optimizer.name=sgd", "optimizer.momentum=0.9",
       "optimizer.lr=0.02", "optimizer.weight_decay=0", "parallel.strategy=pipeline", "parallel.pp_size=2"]
VARIANTS = {"recut": ["adapt.stragglers=rebalance"], "static": ["adapt.stragglers=off"]}
SETTLE = 12  # steps after the recut before its step times count (the slow stage's sleep follows a median)


def run(variant: str, steps: int, tmp: pathlib.Path, repeat: int) -> list[dict]:
    """The telemetry records of one run of `variant`."""
    run_dir = tmp / f"{variant}-{repeat}"
    cmd = [sys.executable, "-m", "gearshift", "run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(run_dir)]
    for item in JOB + VARIANTS[variant] + [f"train.steps={steps}"]:
        cmd += ["--set", item]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60 + 10 * steps)
    if done.returncode != 0:
        raise SystemExit(f"{variant} exited {done.returncode}; its output ends:\n{(done.stdout + done.stderr)[-3000:]}")
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def step_times(records: list[dict], first: int) -> list[float]:
    return [r["step_time_max"] for r in records if r["type"] == "step" and r["step"] >= first]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--smoke", action="store_true", help="1 repeat of 24 steps: that it runs")
    args = ap.parse_args()
    repeats, steps = (1, 24) if args.smoke else (args.repeats, args.steps)
    ratios, recuts = [], []
    with tempfile.TemporaryDirectory(prefix="gs-recut-") as tmp:
        for i in range(repeats):
            order = ("recut", "static") if i % 2 == 0 else ("static", "recut")
            got = {v: run(v, steps, pathlib.Path(tmp), i) for v in order}
            made = [r for r in got["recut"] if r.get("event") == "decision" and r["decision"] == "recut"]
            if not made:
                print(f"repeat {i}: no recut was made", flush=True)
                continue
            recuts.append(made[0]["evidence"]["blocks_per_stage_after"])
            first = min(made[0]["applied_step"] + SETTLE, steps - 2)
            recut, static = (statistics.median(step_times(got[v], first)) for v in ("recut", "static"))
            ratios.append(recut / static)
            print(f"repeat {i}: recut at step {made[0]['applied_step']} to {recuts[-1]} blocks; steps {first}.."
                  f"{steps}: recut {recut * 1e3:.1f} ms, static {static * 1e3:.1f} ms, recut/static "
                  f"{ratios[-1]:.3f}", flush=True)
    figure = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)} if ratios else None
    if figure:
        print(f"recut/static step time: {figure['median']:.3f} ({figure['min']:.3f}-{figure['max']:.3f}) over "
              f"{len(ratios)} repeat(s); goal <= 0.9: {'met' if figure['median'] <= 0.9 else 'NOT met'}")
    else:  # the watcher judges measured step times: on a loaded machine its windows may not show the slow stage
        print(f"recut/static step time: none, no recut was made in {repeats} repeat(s) of {steps} steps (the slow "
              "stage never stood out in a window: a loaded machine?); goal <= 0.9: NOT met")
    print(json.dumps({"recut_over_static_step_time": figure, "blocks_per_stage_after": recuts,
                      "repeats": repeats, "steps": steps}))


if __name__ == "__main__":
    main()
