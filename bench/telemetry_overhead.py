"""What telemetry costs the step loop: steps/s with telemetry on and off, side by side.

One group of plain gloo processes (workers.local_group, no Ray: nothing else competes for the
two cores) trains the job in alternating blocks with `telemetry.enabled` on (DDP comm hook or
functional-collective timing, per-step data/comm marks, device sampling every second, reports
with timings) and off (DDP's built-in all-reduce, no sampler): on, off, off, on, ... The
workers rebuild the model between blocks, in the same processes, so that a process's own
quirks (where its memory landed, which core it got) weigh on both alike. Each block's steps/s
is its steps over its wall time; the ratio on/off is taken per pair of neighbouring blocks,
then the median.

    python bench/telemetry_overhead.py            # 16 pairs of 300-step blocks per case
    python bench/telemetry_overhead.py --quick    # 4 pairs of 100 steps: a smoke check

Goal: on/off >= 0.99. The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {  # name -> (job mapping, workers)
    "mlp-data-x2": ({"model": "mlp", "parallel": {"strategy": "data"}}, 2),
    "gpt-data-x2": ({"model": {"name": "gpt", "kwargs": {"block_size": 32, "n_layer": 2, "n_embd": 64}},
                     "data": "chars", "parallel": {"strategy": "data"}}, 2),
    "gpt-tensor-x2": ({"model": {"name": "gpt", "kwargs": {"block_size": 32, "n_layer": 2, "n_embd": 64}},
                       "data": "chars", "parallel": {"strategy": "tensor"}}, 2),
}


def job_for(spec: dict, workers: int, telemetry: bool, steps: int) -> dict:
    from orchestrator.job import job_from_dict

    raw = {**spec, "train": {"steps": steps, "global_batch_size": 32},
           "cluster": {"num_workers": workers},
           "telemetry": {"enabled": telemetry, "ray_metrics": False}}
    return job_from_dict(raw, base_dir=str(ROOT)).to_dict()


def set_telemetry(worker, enabled: bool) -> None:
    """Runs in each worker process: rebuild the model with telemetry on or off."""
    worker.job["telemetry"]["enabled"] = enabled
    if not enabled and worker.sampler is not None:
        worker.sampler.stop()
        worker.sampler = None
    worker.build()


def run_case(name: str, pairs: int, steps: int) -> dict:
    from workers.local_group import LocalGroup

    spec, workers = CASES[name]
    group = LocalGroup(job_for(spec, workers, True, steps), workers, [str(ROOT)])
    try:
        def rate(enabled: bool) -> float:
            group.apply(set_telemetry, enabled)
            start = time.perf_counter()
            group.call("train", steps, 0)
            return steps / (time.perf_counter() - start)

        rate(True), rate(False)  # warm-up: first-call imports, allocator
        ratios, on_rates, off_rates = [], [], []
        for i in range(pairs):
            order = (True, False) if i % 2 == 0 else (False, True)  # ABBA: drift favours neither
            rates = {enabled: rate(enabled) for enabled in order}
            on_rates.append(rates[True])
            off_rates.append(rates[False])
            ratios.append(rates[True] / rates[False])
    finally:
        group.close()
    return {"steps_per_s_on": statistics.median(on_rates), "steps_per_s_off": statistics.median(off_rates),
            "on_vs_off": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 pairs of 100-step blocks per case")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per block")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases")
    args = ap.parse_args()
    pairs = args.pairs or (4 if args.quick else 16)
    steps = args.steps or (100 if args.quick else 300)
    results = {}
    print(f"telemetry on vs off, {pairs} block pairs x {steps} steps, on {platform.machine()} "
          f"with {os.cpu_count()} cores", flush=True)
    print(f"{'case':<16}{'on steps/s':>12}{'off steps/s':>13}{'on/off':>9}{'range':>16}", flush=True)
    for name in args.case or list(CASES):
        r = run_case(name, pairs, steps)
        results[name] = r
        print(f"{name:<16}{r['steps_per_s_on']:>12.1f}{r['steps_per_s_off']:>13.1f}{r['on_vs_off']:>9.4f}"
              f"{r['ratio_min']:>8.3f}-{r['ratio_max']:.3f}", flush=True)
    worst = min(r["on_vs_off"] for r in results.values())
    print(f"worst case on/off = {worst:.4f} (goal >= 0.99)")
    print(json.dumps({"bench": "telemetry_overhead", "pairs": pairs, "steps_per_block": steps,
                      "cases": results, "worst_telemetry_on_vs_off_steps_per_s": worst}))


if __name__ == "__main__":
    main()
