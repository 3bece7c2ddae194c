"""Adaptive against every fixed layout, on a real two-node cluster with a shaped link (as root).

The testbed (bench/testbed/testbed.py) makes two network namespaces joined by a tbf-shaped veth,
with a Ray node in each; 4 workers, 2 per node. The built-in GPT trains the same number of steps
as static data (4), static hybrid (2 x 2, tensor-parallel inside a node), static tensor (4, over
the link) and auto (starts data, the policy decides), at each fixed link rate and in a scenario
where the rate changes at given steps (fast -> slow -> fast; the testbed follows the run's
telemetry), so every layout trains the same steps under the same link.

Time-to-N-steps runs from the controller's `training` event to the last step (Ray start-up and
model build excluded, equal for all); samples/s = N x global batch / that time. Static tensor
sends activations over the link on every layer and takes seconds a step when it is slow, so it
trains `--tensor-steps` steps per rate and its time is extrapolated (in the scenario: each
phase's steps x its step time at that phase's rate).

Auto pays a fixed price to learn what the link allows: at a fast link it tries hybrid once and
reverts (about 8 steps of the slower layout and two switches, ~1 s here). A fixed setting trains
`--steps-per-rate` steps: more at fast rates, where a step takes 70 ms and a few hundred steps
are seconds, so that one-off price is weighed against a run of some length, not against 15 s.

    sudo python bench/adaptive.py            # 1gbit (600 steps), 40mbit (200), scenario (300)
    sudo python bench/adaptive.py --quick    # 40mbit (100 steps), scenario (200): under 10 minutes

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


def parse_rates(text: str) -> list[tuple[str, int]]:
    """'1gbit:600,40mbit:200' -> [('1gbit', 600), ('40mbit', 200)]"""
    out = []
    for part in text.split(","):
        rate, _, steps = part.partition(":")
        if not rate or not steps.isdigit() or int(steps) < 1:
            raise SystemExit(f"--steps-per-rate {text!r}: each part is RATE:STEPS, e.g. 40mbit:200")
        out.append((rate, int(steps)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one rate and a short scenario: under 10 minutes")
    ap.add_argument("--steps-per-rate", default=None, help="fixed settings, RATE:STEPS,... (tc units)")
    ap.add_argument("--scenario", default=None, help="RATE@STEP,... (default: fast, slow, fast)")
    ap.add_argument("--scenario-steps", type=int, default=None)
    ap.add_argument("--tensor-steps", type=int, default=None,
                    help="steps static tensor trains per rate (its time is extrapolated): over a slow link "
                         "it takes seconds per step")
    args = ap.parse_args()
    fixed = parse_rates(args.steps_per_rate or ("40mbit:100" if args.quick else "1gbit:600,40mbit:200"))
    scenario_steps = args.scenario_steps or (200 if args.quick else 300)
    # slow in the middle; fast steps ~1.5x the slow ones, where data's loss over the slow stretch
    # and hybrid's over the fast ones come out about even (so neither static layout has it easy)
    third = scenario_steps * 3 // 10
    scenario_text = args.scenario or f"1gbit@0,40mbit@{third},1gbit@{scenario_steps - third}"
    scenario = parse_scenario(scenario_text)
    if scenario[0].from_step is None:
        raise SystemExit(f"--scenario {scenario_text!r}: give the phases by step (RATE@STEP,...)")
    tensor_steps = args.tensor_steps or (4 if args.quick else 12)
    # runs of a few hundred steps: the policy judges windows of 10 steps (the default is 20)
    auto_extra = ["adapt.window=10", "adapt.cooldown=20"]
    results: dict[str, dict[str, dict]] = {}
    tensor_step_s: dict[str, float] = {}  # rate -> seconds per step of static tensor
    print(f"GPT (examples/gpt.yaml), 4 workers on 2 nodes (network namespaces), batch {BATCH}, on "
          f"{platform.machine()} with {os.cpu_count()} cores; fixed {fixed}; scenario {scenario_text} "
          f"over {scenario_steps} steps", flush=True)

    def show(name: str, layout: str, r: dict, steps: int) -> None:
        note = "" if r["steps_trained"] == steps else f"  (extrapolated from {r['steps_trained']} steps)" \
            if r["steps_trained"] else "  (each phase's steps x its step time at that rate)"
        print(f"  {name:<16}{layout:<8}{r['seconds']:>8.1f} s{r['samples_per_s']:>9.1f} samples/s  "
              f"{' '.join(r['switches'])}{note}", flush=True)

    with tempfile.TemporaryDirectory(prefix="gs-adaptive-") as tmp, Testbed(rate=fixed[0][0]) as tb:
        tmp = pathlib.Path(tmp)
        for rate, steps in fixed:
            name = f"fixed_{rate}"
            results[name] = {}
            for layout in LAYOUTS:
                r = run_one(tb, layout, steps, tmp, None, rate, auto_extra if layout == "auto" else [],
                            tensor_steps if layout == "tensor" else None)
                if layout == "tensor":
                    tensor_step_s[rate] = r["seconds"] / steps
                results[name][layout] = r
                show(name, layout, r, steps)
        for phase in scenario:  # static tensor at each of the scenario's rates
            if phase.rate not in tensor_step_s:
                r = run_one(tb, "tensor", tensor_steps, tmp, None, phase.rate)
                tensor_step_s[phase.rate] = r["seconds"] / tensor_steps
                print(f"  tensor at {phase.rate}: {tensor_step_s[phase.rate]:.3f} s/step", flush=True)
        results["scenario"] = {}
        for layout in LAYOUTS:
            if layout == "tensor":
                bounds = [p.from_step for p in scenario[1:]] + [scenario_steps]
                seconds = sum(tensor_step_s[p.rate] * (min(end, scenario_steps) - min(p.from_step, scenario_steps))
                              for p, end in zip(scenario, bounds))
                r = {"seconds": seconds, "samples_per_s": scenario_steps * BATCH / seconds, "switches": [],
                     "steps_trained": 0, "link_changes": []}
            else:
                r = run_one(tb, layout, scenario_steps, tmp, scenario, None,
                            auto_extra if layout == "auto" else [])
                r["link_changes"] = [f"{rate}@{step}" for rate, _, step in tb.changes]
            results["scenario"][layout] = r
            show("scenario", layout, r, scenario_steps)
            if r["link_changes"]:
                print(f"{'':<26}link changed: {' '.join(r['link_changes'])}", flush=True)
    figures = {}
    print(f"\n{'setting':<16}{'steps':>6}" + "".join(f"{k:>10}" for k in LAYOUTS) + f"{'auto/best':>11}{'auto/data':>11}")
    steps_of = {f"fixed_{rate}": steps for rate, steps in fixed} | {"scenario": scenario_steps}
    for name, per_layout in results.items():
        best = max(per_layout[k]["samples_per_s"] for k in LAYOUTS if k != "auto")
        auto = per_layout["auto"]["samples_per_s"]
        figures[f"auto_vs_best_static_{name}"] = auto / best
        figures[f"auto_vs_data_{name}"] = auto / per_layout["data"]["samples_per_s"]
        print(f"{name:<16}{steps_of[name]:>6}" + "".join(f"{per_layout[k]['samples_per_s']:>10.1f}" for k in LAYOUTS)
              + f"{auto / best:>11.3f}{figures[f'auto_vs_data_{name}']:>11.3f}")
    print(json.dumps({"bench": "adaptive", "steps": steps_of, "batch": BATCH, "scenario": scenario_text,
                      "tensor_step_s": tensor_step_s, "results": results, **figures}))


if __name__ == "__main__":
    main()
