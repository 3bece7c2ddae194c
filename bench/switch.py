"""What a switch costs: the time to move the live GPT between two layouts, against one step.

Four workers on plain gloo processes (bench/local_group.py, no Ray) train the built-in GPT and
switch through every ordered pair of data(4), hybrid(2x2) and tensor(4), in a cycle that comes
back where it started. Before each switch the current layout trains a few steps (their median
step time is the yardstick); the switch time is the slowest rank's `reshard`: gathering the
full model and Adam state, building the new layout, loading its shards.

    python bench/switch.py            # 3 cycles, GPT n_embd 128
    python bench/switch.py --quick    # 1 cycle
    python bench/switch.py --smoke    # 1 cycle of 2 steps before each switch: that it runs (CI)
    python bench/switch.py --n-embd 256 --n-layer 4

The last line of output is one JSON object with every figure: `switch_over_step_A_to_B` is the
switch time divided by A's median step time.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {"data": ("data", 1), "hybrid": ("hybrid", 2), "tensor": ("tensor", 4)}
CYCLE = ["data", "hybrid", "tensor", "data", "tensor", "hybrid", "data"]  # all six ordered pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one cycle, fewer steps")
    ap.add_argument("--smoke", action="store_true", help="one cycle, 2 steps before each switch: that it runs")
    ap.add_argument("--cycles", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps trained before each switch")
    ap.add_argument("--n-embd", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=2)
    args = ap.parse_args()
    cycles = args.cycles or (1 if args.quick or args.smoke else 3)
    steps = args.steps or (2 if args.smoke else 4 if args.quick else 8)

    from gearshift.orchestrator.job import job_from_dict
    from gearshift.strategies.layout import Layout
    from bench.local_group import LocalGroup

    job = job_from_dict({"model": {"name": "gpt", "kwargs": {"n_embd": args.n_embd, "n_layer": args.n_layer,
                                                             "n_head": 4, "block_size": 64}},
                         "data": "chars", "optimizer": {"name": "adam"},
                         "train": {"steps": 100000, "global_batch_size": 16},
                         "cluster": {"num_workers": 4}, "telemetry": {"ray_metrics": False}},
                        base_dir=str(ROOT)).to_dict()
    switch_s: dict[tuple[str, str], list[float]] = {}
    step_s: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    with LocalGroup(job, 4, [str(ROOT)], cpus=0.5) as group:
        params = group.infos[0]["parameters"]
        print(f"GPT with {params:,} parameters, 4 workers, {cycles} cycle(s) of 6 switches, {steps} steps "
              f"before each, on {platform.machine()} with {os.cpu_count()} cores", flush=True)
        step = 0
        for _ in range(cycles):
            for here, there in zip(CYCLE, CYCLE[1:]):
                step += steps
                reports = group.call("train", step, 0, 1000.0)
                times = [max(ts) for ts in zip(*[[t for r in rr for t in r["step_times"]] for rr in reports])]
                step_s[here].append(statistics.median(times[1:]))  # the first step after a switch warms up
                strategy, tp = LAYOUTS[there]
                results = group.call("reshard", Layout.for_workers(strategy, 4, tp).to_dict())
                switch_s.setdefault((here, there), []).append(max(r["seconds"] for r in results))
    figures = {}
    print(f"{'from':<8}{'to':<8}{'switch ms':>11}{'step ms':>10}{'switch/step':>13}")
    for (a, b), values in switch_s.items():
        sw, st = statistics.median(values), statistics.median(step_s[a])
        figures[f"switch_over_step_{a}_to_{b}"] = sw / st
        figures[f"switch_s_{a}_to_{b}"] = sw
        print(f"{a:<8}{b:<8}{sw * 1e3:>11.1f}{st * 1e3:>10.1f}{sw / st:>13.2f}", flush=True)
    figures.update({f"step_s_{k}": statistics.median(v) for k, v in step_s.items() if v})
    print(json.dumps({"bench": "switch", "parameters": params, "cycles": cycles, **figures}))


if __name__ == "__main__":
    main()
