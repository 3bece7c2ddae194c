"""How exactly telemetry's comm wait measures a known delay, and a straggler, side by side.

One group of plain gloo processes (bench/local_group.py, no Ray) per case trains the built-in MLP
with one gradient bucket (the whole delay falls after backward, none hides behind it), in blocks
that alternate without and with `inject.comm_delay_ms` (ABBA), and reads each rank's per-step
comm wait, collectives a step and step time. Printed per case and rank: the rise of the median
wait over the expected rise (delay x collectives a step; 1.0 is exact) and the rise of the step
time over the same. Then the straggler case: rank 1 computes `lag` longer each step (a sleep in
its loss), and rank 0's median wait should rise by about `lag` while rank 1's stays near zero;
printed: rank 0's rise / lag and rank 1's wait / lag. And a lone worker's wait over its step
(a 1-rank all-reduce through gloo: about nothing).

The tests make the structural claims (the delay adds no collective, each wait lies within its
step: tests/test_telemetry.py); how much of a delay the wait shows is a figure, and lives here
(part of a delay can overlap other work: DDP's hook sleeps on gloo's thread while backward ends).

    python bench/comm_wait.py             # 6 pairs of 25-step blocks per case
    python bench/comm_wait.py --quick     # 2 pairs
    python bench/comm_wait.py --smoke     # data only, 1 pair of 8-step blocks: that it runs (CI)

Goal (what the tests asserted before they moved here): every ratio within 0.75..1.25, rank 1's
wait under 0.25 of the lag, a lone worker's wait under 10 % of its step. The last line of
output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {  # name -> (workers, parallel section)
    "data": (2, {"strategy": "data"}),
    "tensor": (2, {"strategy": "tensor"}),
    "hybrid": (4, {"strategy": "hybrid", "tp_size": 2}),
}
DELAY_MS = 20.0
LAG_S = 0.02


def job(world: int, parallel: dict, delay_ms: float, steps: int) -> dict:
    from gearshift.orchestrator.job import job_from_dict

    return job_from_dict({
        "model": "mlp", "train": {"steps": steps, "global_batch_size": 64}, "cluster": {"num_workers": world},
        "parallel": {"bucket_cap_mb": 100, **parallel}, "inject": {"comm_delay_ms": delay_ms},
        "telemetry": {"ray_metrics": False, "sample_period_s": 0.5},
    }).to_dict()


def medians(reports, warmup: int) -> list[dict]:
    out = []
    for per_rank in reports:
        flat = {k: [v for r in per_rank for v in r[k]][warmup:] for k in ("comm_waits", "comm_calls", "step_times")}
        out.append({"wait": statistics.median(flat["comm_waits"]), "calls": statistics.median(flat["comm_calls"]),
                    "step": statistics.median(flat["step_times"])})
    return out


def block(world: int, parallel: dict, delay_ms: float, steps: int, warmup: int) -> list[dict]:
    from bench.local_group import LocalGroup

    with LocalGroup(job(world, parallel, delay_ms, steps), world, search_paths=[str(ROOT)]) as group:
        return medians(group.call("train", steps, 0, 1000.0), warmup)


def delay_case(name: str, pairs: int, steps: int, warmup: int) -> dict:
    world, parallel = CASES[name]
    rises: dict[int, list] = {rank: [] for rank in range(world)}
    for i in range(pairs):
        order = (0.0, DELAY_MS) if i % 2 == 0 else (DELAY_MS, 0.0)
        got = {delay: block(world, parallel, delay, steps, warmup) for delay in order}
        for rank, (base, slow) in enumerate(zip(got[0.0], got[DELAY_MS])):
            expected = DELAY_MS / 1000 * slow["calls"]
            rises[rank].append(((slow["wait"] - base["wait"]) / expected, (slow["step"] - base["step"]) / expected))
    out = {}
    for rank, pairs_of in rises.items():
        wait = statistics.median(r[0] for r in pairs_of)
        step = statistics.median(r[1] for r in pairs_of)
        spread = max(r[0] for r in pairs_of) - min(r[0] for r in pairs_of)
        print(f"{name:7s} rank {rank}: wait rise / expected {wait:.3f} (spread {spread:.3f}), "
              f"step rise / expected {step:.3f}", flush=True)
        out[f"{name}_rank{rank}_wait_rise_over_expected"] = round(wait, 4)
        out[f"{name}_rank{rank}_step_rise_over_expected"] = round(step, 4)
    return out


def slow_rank(worker, rank: int, seconds: float) -> None:
    """Runs in each worker process: rank `rank` computes `seconds` longer every step."""
    if worker.rank == rank:
        loss_fn = getattr(worker, "_plain_loss", worker.loss_fn)
        worker._plain_loss = loss_fn
        worker.loss_fn = loss_fn if seconds == 0 else (lambda out, target: (time.sleep(seconds), loss_fn(out, target))[1])


def straggler_case(strategy: str, pairs: int, steps: int, warmup: int) -> dict:
    from bench.local_group import LocalGroup

    spec = job(2, {"strategy": strategy}, 0.0, steps * 2 * pairs)
    rank0, rank1 = [], []
    with LocalGroup(spec, 2, search_paths=[str(ROOT)]) as group:
        done = 0
        for i in range(pairs):
            waits = {}
            for lag in ((0.0, LAG_S) if i % 2 == 0 else (LAG_S, 0.0)):
                group.apply(slow_rank, 1, lag)
                done += steps
                waits[lag] = medians(group.call("train", done, 0, 1000.0), warmup)
            rank0.append((waits[LAG_S][0]["wait"] - waits[0.0][0]["wait"]) / LAG_S)
            rank1.append(waits[LAG_S][1]["wait"] / LAG_S)
    a, b = statistics.median(rank0), statistics.median(rank1)
    print(f"straggler {strategy:7s}: rank 0's wait rise / lag {a:.3f}, rank 1's wait / lag {b:.3f}", flush=True)
    return {f"straggler_{strategy}_rank0_rise_over_lag": round(a, 4),
            f"straggler_{strategy}_rank1_wait_over_lag": round(b, 4)}


def lone_case(steps: int, warmup: int) -> dict:
    [rank0] = block(1, {"strategy": "data"}, 0.0, steps, warmup)
    share = rank0["wait"] / rank0["step"]
    print(f"one worker: wait / step {share:.4f} ({rank0['wait'] * 1e3:.2f} ms of {rank0['step'] * 1e3:.2f} ms)",
          flush=True)
    return {"lone_wait_over_step": round(share, 5)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 pairs of blocks per case")
    ap.add_argument("--smoke", action="store_true", help="data only, 1 pair of 8-step blocks: that it runs (CI)")
    args = ap.parse_args()
    pairs, steps, warmup = (1, 8, 3) if args.smoke else (2, 25, 5) if args.quick else (6, 25, 5)
    names = ["data"] if args.smoke else list(CASES)
    figures = {"bench": "comm_wait", "pairs": pairs, "steps_per_block": steps, "delay_ms": DELAY_MS, "lag_s": LAG_S}
    for name in names:
        figures.update(delay_case(name, pairs, steps, warmup))
    for strategy in (["data"] if args.smoke else ["data", "tensor"]):
        figures.update(straggler_case(strategy, pairs, steps, warmup))
    figures.update(lone_case(steps, warmup))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
