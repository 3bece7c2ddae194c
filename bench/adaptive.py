"""Adaptive against every fixed layout, on a real two-node cluster with a shaped link (as root).

The testbed (bench/testbed/testbed.py) makes two network namespaces joined by a tbf-shaped veth,
with a Ray node in each; 4 workers, 2 per node. The built-in GPT trains the same number of steps
as static data (4), static hybrid (2 x 2, tensor-parallel inside a node), static tensor (4, over
the link) and auto (starts data, the policy decides), at each fixed link rate and in a scenario
where the rate changes while the job runs (fast -> slow -> fast). Time-to-N-steps runs from the
controller's `training` event to the last step (Ray start-up and model build excluded, equal
for all); samples/s = N x global batch / that time. Static tensor sends activations over the
link on every layer and takes seconds a step when it is slow, so it trains `--tensor-steps`
(20) steps and its time to N is extrapolated.

    sudo python bench/adaptive.py            # rates 1gbit and 40mbit, 200 steps, scenario
    sudo python bench/adaptive.py --quick    # 40mbit only, 60 steps, scenario: under 10 minutes

The last line of output is one JSON object; `auto_vs_best_static_<setting>` divides auto's
samples/s by the best static layout's, `auto_vs_data_<setting>` by static data's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "testbed"))
sys.path.insert(0, str(ROOT))

from testbed import Testbed, parse_scenario  # noqa: E402

LAYOUTS = {
    "data": ["parallel.strategy=data"],
    "hybrid": ["parallel.strategy=hybrid", "parallel.tp_size=2"],
    "tensor": ["parallel.strategy=tensor", "parallel.tp_across_nodes=true"],  # gearshift refuses it otherwise
    "auto": ["parallel.strategy=auto"],
}
BATCH = 32


def run_one(tb: Testbed, layout: str, steps: int, tmp: pathlib.Path, scenario=None, rate: str | None = None,
            extra: list[str] = (), measure_steps: int | None = None) -> dict:
    """One run; with `measure_steps` < steps only that many are trained and the time to `steps`
    is extrapolated from their rate (tensor parallelism over a slow link takes seconds a step)."""
    run_dir = tmp / f"{layout}-{len(list(tmp.iterdir()))}"
    trained = min(steps, measure_steps or steps)
    argv = ["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run_dir),
            "--set", f"train.steps={trained}", "--set", f"train.global_batch_size={BATCH}",
            "--set", "cluster.num_workers=4", "--set", "cluster.cpus_per_worker=0.5",
            "--set", "checkpoint.every=0", "--set", "cluster.placement=pack"]
    for item in [*LAYOUTS[layout], *extra]:
        argv += ["--set", item]
    if rate is not None:
        tb.set_rate(rate)
    done = tb.run_driver(argv, scenario, capture=True)
    if done.returncode != 0:
        raise SystemExit(f"{layout} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r.get("event") == "state" and r.get("state") == "training")
    end = max(r["time"] for r in records if r["type"] == "step")
    switches = [f"{s['step']}:{s['to']['strategy']}" for s in records if s.get("event") == "switch"]
    seconds = (end - start) * steps / trained
    return {"seconds": seconds, "samples_per_s": steps * BATCH / seconds, "switches": switches,
            "steps_trained": trained}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one rate, 60 steps, the scenario: under 10 minutes")
    ap.add_argument("--rates", default=None, help="fixed link rates, comma-separated (tc units)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--scenario", default=None, help="RATE:SECONDS,... (default: fast, slow, fast)")
    ap.add_argument("--tensor-steps", type=int, default=20,
                    help="steps static tensor trains (its time to N steps is extrapolated): over a slow link "
                         "it takes seconds per step")
    args = ap.parse_args()
    rates = (args.rates or ("40mbit" if args.quick else "1gbit,40mbit")).split(",")
    steps = args.steps or (60 if args.quick else 200)
    # the clock starts with the driver, ~10 s of which go to starting workers and building the model
    scenario_text = args.scenario or ("1gbit:15,40mbit:40,1gbit:900" if args.quick else "1gbit:15,40mbit:30,1gbit:900")
    # runs of a few hundred steps: the policy judges windows of 10 steps (the default is 20)
    auto_extra = ["adapt.window=10", "adapt.cooldown=20"]
    settings = [(f"fixed_{r}", r, None) for r in rates] + [("scenario", None, parse_scenario(scenario_text))]
    results: dict[str, dict[str, dict]] = {}
    print(f"GPT (examples/gpt.yaml), 4 workers on 2 nodes (network namespaces), {steps} steps, batch {BATCH}, "
          f"on {platform.machine()} with {os.cpu_count()} cores; scenario {scenario_text}", flush=True)
    with tempfile.TemporaryDirectory(prefix="gs-adaptive-") as tmp, Testbed(rate=rates[0]) as tb:
        tmp = pathlib.Path(tmp)
        for name, rate, scenario in settings:
            results[name] = {}
            for layout in LAYOUTS:
                r = run_one(tb, layout, steps, tmp, scenario, rate, auto_extra if layout == "auto" else [],
                            args.tensor_steps if layout == "tensor" else None)
                results[name][layout] = r
                measured = f"  (time for {steps} extrapolated from {r['steps_trained']})" \
                    if r["steps_trained"] < steps else ""
                print(f"  {name:<16}{layout:<8}{r['seconds']:>8.1f} s{r['samples_per_s']:>9.1f} samples/s  "
                      f"{' '.join(r['switches'])}{measured}", flush=True)
    figures = {}
    print(f"\n{'setting':<16}" + "".join(f"{k:>10}" for k in LAYOUTS) + f"{'auto/best':>11}{'auto/data':>11}")
    for name, per_layout in results.items():
        best = max(per_layout[k]["samples_per_s"] for k in LAYOUTS if k != "auto")
        auto = per_layout["auto"]["samples_per_s"]
        figures[f"auto_vs_best_static_{name}"] = auto / best
        figures[f"auto_vs_data_{name}"] = auto / per_layout["data"]["samples_per_s"]
        print(f"{name:<16}" + "".join(f"{per_layout[k]['samples_per_s']:>10.1f}" for k in LAYOUTS)
              + f"{auto / best:>11.3f}{figures[f'auto_vs_data_{name}']:>11.3f}")
    print(json.dumps({"bench": "adaptive", "steps": steps, "batch": BATCH, "scenario": scenario_text,
                      "results": results, **figures}))


if __name__ == "__main__":
    main()
