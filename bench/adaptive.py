"""Adaptive against every fixed layout, on a real two-node cluster with a shaped link (as root).

The testbed (bench/testbed/testbed.py) makes two network namespaces joined by a tbf-shaped veth,
with a Ray node in each; 4 workers, 2 per node. Each node runs on a core of its own (a cgroup
cpuset, bench/testbed/cores.py), as each node of a real cluster has its own devices: a rank that
waits (a pipeline stage in its bubble, a rank blocked on the link) leaves its core idle instead of
lending it to the other node (`--shared-cores`: both nodes on both cores, as before). The built-in GPT trains the same number of steps
as static data (4), static hybrid (2 x 2, tensor-parallel inside a node), static tensor (4, over
the link), static pipeline (2 stages, one a node, 2 replicas each: only the activations at the cut
cross the link) and auto (starts data, the policy decides, pipelines among its candidates), at
each fixed link rate and in a scenario
where the rate changes at given steps (fast -> slow -> fast; the testbed follows the run's
telemetry), so every layout trains the same steps under the same link.

Time-to-N-steps runs from the controller's `training` event to the last step (Ray start-up and
model build excluded, equal for all); samples/s = N x global batch / that time. Static tensor
sends activations over the link on every layer and takes seconds a step when it is slow, so it
trains `--tensor-steps` steps per rate and its time is extrapolated (in the scenario: each
phase's steps x its step time at that phase's rate). It is measured once per rate, not once per
repeat: it is never the best layout here, and it only enters the ratios as a candidate for
"best static".

Auto decides by prediction (orchestrator/online.py fits the cost model to the run's own steps):
at a fast link it holds on data, since hybrid's tensor-parallel cost is not known until it has
run and the gain predicted for it is smaller than that doubt; at a slow link it moves to hybrid
after the run's first 5 steps. A fixed setting trains `--steps-per-rate` steps: more at fast
rates, where a step takes 70 ms and a few hundred steps are seconds, so the start (5 steps of
data, a switch) is weighed against a run of some length, not against 15 s.

`--repeats N` runs every (setting, layout) N times, interleaved: repeat 1 of data, hybrid and
auto of a setting, then repeat 2 of each, ..., so that the machine's drift hits every layout
alike. Per setting and layout the table gives the median samples/s and the spread (min..max)
over the repeats; the ratios are taken within a repeat (auto / best static of that same repeat)
and then summarized as median, min and max.

    sudo python bench/adaptive.py                 # 1gbit (600 steps), 40mbit (200), scenario (300)
    sudo python bench/adaptive.py --quick         # 1gbit (300 steps), 40mbit (100), scenario (200): ~10 min
    sudo python bench/adaptive.py --quick --repeats 3    # medians of 3 interleaved repeats, ~3x as long

The last line of output is one JSON object. Per setting (`fixed_<rate>`, `scenario`):
`auto_vs_best_static_<setting>` is the median over repeats of auto's samples/s / the best static
layout's samples/s in that repeat (`..._min`, `..._max` its spread), `auto_vs_data_<setting>`
the same against static data; `reverted_switches_<setting>` is the most reverts the policy made
in one auto run (a `decision` event in the run's telemetry.jsonl whose `decision` is `revert`;
the goal is at most 1 a run), `reverted_switches_per_repeat_<setting>` lists them per repeat
and `auto_switches_<setting>` lists each auto run's switches (`step:strategy`) per repeat;
`reaction_steps_<setting>` is the largest `applied_step - seen_step` over the auto runs' decisions
(the goal is at most 2) and `auto_moves_<setting>` each auto run's switches and reverts with the
step seen, the step carried out and the evidence's figures. `auto_vs_oracle_scenario` is an
oracle's time over auto's in the scenario, per repeat and then median/min/max: the oracle runs each
phase on that phase's best static layout, as the static runs of the same repeat measured it (phase
times from their step records' end times), and switches for free; it is the ceiling of
adaptivity (the goal is >= 0.95), and `oracle_vs_best_static_scenario` says how far above the best
static layout that ceiling lies on this machine.
"""

from __future__ import annotations

import argparse
import dataclasses
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

from testbed import Testbed, parse_scenario  # noqa: E402

from gearshift.strategies.pipeline import bubble  # noqa: E402

LAYOUTS = {
    "data": ["parallel.strategy=data"],
    "hybrid": ["parallel.strategy=hybrid", "parallel.tp_size=2"],
    "tensor": ["parallel.strategy=tensor", "parallel.tp_across_nodes=true"],  # gearshift refuses it otherwise
    "pipeline": ["parallel.strategy=pipeline", "parallel.pp_size=2"],  # a stage a node: activations on the link
    "auto": ["parallel.strategy=auto"],
}
STATIC = [k for k in LAYOUTS if k != "auto"]
BATCH = 32
PP, MICROBATCHES = 2, 4  # static pipeline: 2 replicas of 16 samples, the default micro-batches (<= 2 x pp, dividing 16)


def driver_argv(layout: str, steps: int, run_dir: pathlib.Path, extra: list[str] = ()) -> list[str]:
    """`gearshift` arguments of one run (the testbed adds --address)."""
    argv = ["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run_dir),
            "--set", f"train.steps={steps}", "--set", f"train.global_batch_size={BATCH}",
            "--set", "cluster.num_workers=4", "--set", "cluster.cpus_per_worker=0.5",
            "--set", "checkpoint.every=0", "--set", "cluster.placement=pack"]
    for item in [*LAYOUTS[layout], *extra]:
        argv += ["--set", item]
    return argv


def run_one(tb: Testbed, layout: str, steps: int, tmp: pathlib.Path, scenario=None, rate: str | None = None,
            extra: list[str] = (), measure_steps: int | None = None) -> dict:
    """One run; with `measure_steps` < steps only that many are trained and the time to `steps`
    is extrapolated from their rate (tensor parallelism over a slow link takes seconds a step)."""
    run_dir = tmp / f"{layout}-{len(list(tmp.iterdir()))}"
    trained = min(steps, measure_steps or steps)
    argv = driver_argv(layout, trained, run_dir, extra)
    if rate is not None:
        tb.set_rate(rate)
    done = tb.run_driver(argv, scenario, capture=True)
    if done.returncode != 0:
        raise SystemExit(f"{layout} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    start = next(r["time"] for r in records if r.get("event") == "state" and r.get("state") == "training")
    end = max(r["time"] for r in records if r["type"] == "step")
    switches = [f"{s['step']}:{s['to']['strategy']}" for s in records if s.get("event") == "switch"]
    # the policy's reverts: decision events (orchestrator/reporting.py, Reporter.decided) named "revert"
    reverts = [r["step"] for r in records
               if r["type"] == "event" and r.get("event") == "decision" and r.get("decision") == "revert"]
    seconds = (end - start) * steps / trained
    # every switch and revert the policy decided: where it was seen, where it was carried out, and
    # the figures it was decided on
    keys = ("reason", "comm_wait_frac", "samples_per_s_before", "samples_per_s_after", "noise_samples_per_s",
            "predicted_step_s", "measured_step_s")
    moves = [{"decision": r["decision"], "to": r.get("to", {}).get("strategy"), "seen_step": r.get("seen_step"),
              "applied_step": r.get("applied_step"),
              **{k: r["evidence"][k] for k in keys if isinstance(r.get("evidence", {}).get(k), (int, float, str))}}
             for r in records if r.get("event") == "decision" and r.get("decision") in ("switch", "revert")]
    lags = [m["applied_step"] - m["seen_step"] for m in moves if m["applied_step"] is not None]
    ends = {r["step"]: r["ended_at"] for r in records if r["type"] == "step"}
    # strategy auto's start choice (the workers' probe, over nodes) happens before the training
    # state, outside the time above: its own stage of the startup event
    stages = next((r["stages"] for r in records if r.get("event") == "startup"), [])
    start_layout_s = next((s["took"] for s in stages if s["stage"] == "start_layout"), 0.0)
    # the pipeline's bubble (a stage idle for lack of work) as a share of the step, past the first 3 steps
    bubbles = [r["bubble_frac_mean"] for r in records
               if r["type"] == "step" and r["step"] > 3 and isinstance(r.get("bubble_frac_mean"), (int, float))]
    return {"bubble_frac": statistics.median(bubbles) if bubbles else None, "seconds": seconds, "samples_per_s": steps * BATCH / seconds, "switches": switches,
            "reverts": reverts, "steps_trained": trained, "moves": moves, "reaction_steps": max(lags, default=0),
            "start": start, "step_ends": ends, "start_layout_s": start_layout_s}


def phase_seconds(run: dict, bounds: list[tuple[int, int]]) -> list[float] | None:
    """A run's wall time in each phase (first step, last step), from its step records' end times
    (the first phase from the start of training). None: a step is missing."""
    ends, out = run.get("step_ends") or {}, []
    for first, last in bounds:
        before = run["start"] if first <= 1 else ends.get(first - 1)
        if before is None or last not in ends:
            return None
        out.append(ends[last] - before)
    return out


def parse_rates(text: str) -> list[tuple[str, int]]:
    """'1gbit:600,40mbit:200' -> [('1gbit', 600), ('40mbit', 200)]"""
    out = []
    for part in text.split(","):
        rate, _, steps = part.partition(":")
        if not rate or not steps.isdigit() or int(steps) < 1:
            raise SystemExit(f"--steps-per-rate {text!r}: each part is RATE:STEPS, e.g. 40mbit:200")
        out.append((rate, int(steps)))
    return out


def phase_leads(oracle: list[dict], bounds) -> list[dict]:
    """Per phase of the scenario: its best static layout and that layout's lead over the runner-up
    (runner-up's time / best's time), median over repeats."""
    out = []
    for j, _ in enumerate(bounds):
        bests, leads, runners = [], [], []
        for o in oracle:
            ranked = sorted(o["per_phase_s"], key=lambda k: o["per_phase_s"][k][j])
            bests.append(ranked[0])
            runners.append(ranked[1])
            leads.append(o["per_phase_s"][ranked[1]][j] / o["per_phase_s"][ranked[0]][j])
        out.append({"best": statistics.mode(bests), "same_every_repeat": len(set(bests)) == 1,
                    "runner_up": statistics.mode(runners), "lead": statistics.median(leads)})
    return out


def bubble_figures(results: dict) -> dict:
    """Static pipeline's measured bubble share per setting, beside the schedule's own share."""
    out = {}
    for name, per_layout in results.items():
        measured = [r["bubble_frac"] for r in per_layout.get("pipeline", []) if r.get("bubble_frac") is not None]
        if measured:
            out[name] = {"measured": statistics.median(measured), "per_repeat": measured,
                         "schedule": bubble(PP, MICROBATCHES, "1f1b")}
    return out


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


AUTO_EXTRA = ["adapt.window=10", "adapt.cooldown=20"]  # runs of a few hundred steps: windows of 10 (default 20)


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a bench run measures: fixed settings (rate, steps), the scenario, repeats."""
    fixed: list[tuple[str, int]]
    scenario_text: str
    scenario: list
    scenario_steps: int
    tensor_steps: int
    repeats: int
    own_cores: bool

    def bounds(self) -> list[tuple[int, int]]:
        """(first, last) step of each phase of the scenario."""
        ends = [q.from_step for q in self.scenario[1:]] + [self.scenario_steps]
        return [(p.from_step + 1, min(end, self.scenario_steps)) for p, end in zip(self.scenario, ends)]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="a shorter fast and slow setting and a shorter scenario: about 10 minutes a repeat")
    ap.add_argument("--steps-per-rate", default=None, help="fixed settings, RATE:STEPS,... (tc units)")
    ap.add_argument("--scenario", default=None, help="RATE@STEP,... (default: fast, slow, fast)")
    ap.add_argument("--scenario-steps", type=int, default=None)
    ap.add_argument("--tensor-steps", type=int, default=None,
                    help="steps static tensor trains per rate (its time is extrapolated): over a slow link "
                         "it takes seconds per step")
    ap.add_argument("--shared-cores", action="store_true",
                    help="both nodes' processes on every core (by default each node has cores of its own, "
                         "as real nodes have their own devices: a rank's idle time is not lent to the other node)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs of every (setting, layout), interleaved across layouts (static tensor: once per rate)")
    ap.add_argument("--dry-run", action="store_true", help="print every run's gearshift arguments and check each "
                    "layout's job as `gearshift run` would; run nothing (no root needed)")
    args = ap.parse_args()
    if args.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    return args


def plan_of(args: argparse.Namespace) -> Plan:
    fixed = parse_rates(args.steps_per_rate or ("1gbit:300,40mbit:100" if args.quick else "1gbit:600,40mbit:200"))
    scenario_steps = args.scenario_steps or (200 if args.quick else 300)
    # slow in the middle; fast steps ~1.5x the slow ones, where data's loss over the slow stretch
    # and hybrid's over the fast ones come out about even (so neither static layout has it easy)
    third = scenario_steps * 3 // 10
    scenario_text = args.scenario or f"1gbit@0,40mbit@{third},1gbit@{scenario_steps - third}"
    scenario = parse_scenario(scenario_text)
    if scenario[0].from_step is None:
        raise SystemExit(f"--scenario {scenario_text!r}: give the phases by step (RATE@STEP,...)")
    return Plan(fixed, scenario_text, scenario, scenario_steps, args.tensor_steps or (4 if args.quick else 12),
                args.repeats, not args.shared_cores)


def dry_run(plan: Plan) -> None:
    """Every run's `gearshift` arguments, in the order the bench makes them; each layout's job
    checked as `gearshift run` checks it. Nothing is brought up."""
    from testbed import check_driver_args

    tb = Testbed(rate=plan.fixed[0][0], own_cores=plan.own_cores, dry_run=True)
    root = pathlib.Path(tempfile.gettempdir()) / "gs-adaptive-XXXX"
    runs = []
    for rate, steps in plan.fixed:
        for rep in range(plan.repeats):
            runs += [(f"fixed_{rate} #{rep + 1} {layout}", rate, layout, plan.tensor_steps if layout == "tensor" else steps)
                     for layout in LAYOUTS if layout != "tensor" or not rep]  # static tensor: once per rate
    runs += [(f"tensor at {p.rate}", p.rate, "tensor", plan.tensor_steps) for p in plan.scenario
             if p.rate not in dict(plan.fixed)]
    runs += [(f"scenario #{rep + 1} {layout} (the link: {plan.scenario_text})", None, layout, plan.scenario_steps)
             for rep in range(plan.repeats) for layout in LAYOUTS if layout != "tensor"]
    print(f"testbed: 2 nodes ({'own cores' if plan.own_cores else 'shared cores'}), the link first at "
          f"{plan.fixed[0][0]}; each run: {shlex.join(tb.driver_command(['ARGS']))}", flush=True)
    for i, (name, rate, layout, steps) in enumerate(runs):
        argv = driver_argv(layout, steps, root / f"{layout}-{i}", AUTO_EXTRA if layout == "auto" else [])
        print(f"{name}{f' (link {rate})' if rate else ''}: {shlex.join(argv)}")
    for layout in LAYOUTS:  # a setting the job checks refuse fails here, not an hour into a run as root
        argv = driver_argv(layout, 5, root / "check", AUTO_EXTRA if layout == "auto" else [])
        print(f"{layout}: the job checked as `gearshift run` checks it, starts as {check_driver_args(argv)}")
    print(f"{len(runs)} runs")


def main() -> None:
    args = parse_args()
    plan = plan_of(args)
    if args.dry_run:
        return dry_run(plan)
    print(f"GPT (examples/gpt.yaml), 4 workers on 2 nodes (network namespaces), batch {BATCH}, on "
          f"{platform.machine()} with {os.cpu_count()} cores; fixed {plan.fixed}; scenario {plan.scenario_text} "
          f"over {plan.scenario_steps} steps; {plan.repeats} repeat(s), interleaved", flush=True)
    results, tensor_step_s = measure(plan)
    report(plan, results, tensor_step_s)


def show(name: str, layout: str, r: dict, steps: int, rep: int) -> None:
    note = "" if r["steps_trained"] == steps else f"  (extrapolated from {r['steps_trained']} steps)" \
        if r["steps_trained"] else "  (each phase's steps x its step time at that rate)"
    reverts = f"  reverts at {r['reverts']}" if r.get("reverts") else ""
    if r.get("start_layout_s"):
        reverts += f"  (start chosen in {r['start_layout_s']:.2f} s before training)"
    print(f"  {name:<16}#{rep + 1:<3}{layout:<8}{r['seconds']:>8.1f} s{r['samples_per_s']:>9.1f} samples/s  "
          f"{' '.join(r['switches'])}{reverts}{note}", flush=True)


def measure(plan: Plan) -> tuple[dict[str, dict[str, list[dict]]], dict[str, float]]:
    """Every run on the testbed: setting -> layout -> one result per repeat (static tensor: one,
    reused by every repeat); and static tensor's seconds a step per rate."""
    results: dict[str, dict[str, list[dict]]] = {}
    tensor_step_s: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="gs-adaptive-") as tmp, \
            Testbed(rate=plan.fixed[0][0], own_cores=plan.own_cores) as tb:
        print(f"cores: {tb.cores.describe() if tb.cores else 'shared by both nodes'}", flush=True)
        tmp = pathlib.Path(tmp)
        for rate, steps in plan.fixed:
            name = f"fixed_{rate}"
            results[name] = {layout: [] for layout in LAYOUTS}
            for rep in range(plan.repeats):
                for layout in LAYOUTS:
                    if layout == "tensor" and rep:
                        continue  # measured once per rate
                    r = run_one(tb, layout, steps, tmp, None, rate, AUTO_EXTRA if layout == "auto" else [],
                                plan.tensor_steps if layout == "tensor" else None)
                    if layout == "tensor":
                        tensor_step_s[rate] = r["seconds"] / steps
                    results[name][layout].append(r)
                    show(name, layout, r, steps, rep)
        results["scenario"] = scenario_runs(plan, tb, tmp, tensor_step_s)
    return results, tensor_step_s


def scenario_runs(plan: Plan, tb: Testbed, tmp: pathlib.Path, tensor_step_s: dict[str, float]) -> dict:
    for phase in plan.scenario:  # static tensor at each of the scenario's rates
        if phase.rate not in tensor_step_s:
            r = run_one(tb, "tensor", plan.tensor_steps, tmp, None, phase.rate)
            tensor_step_s[phase.rate] = r["seconds"] / plan.tensor_steps
            print(f"  tensor at {phase.rate}: {tensor_step_s[phase.rate]:.3f} s/step", flush=True)
    out: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    bounds = [p.from_step for p in plan.scenario[1:]] + [plan.scenario_steps]
    seconds = sum(tensor_step_s[p.rate] * (min(end, plan.scenario_steps) - min(p.from_step, plan.scenario_steps))
                  for p, end in zip(plan.scenario, bounds))
    out["tensor"].append({"seconds": seconds, "samples_per_s": plan.scenario_steps * BATCH / seconds, "switches": [],
                          "reverts": [], "steps_trained": 0, "link_changes": []})
    show("scenario", "tensor", out["tensor"][0], plan.scenario_steps, 0)
    for rep in range(plan.repeats):
        for layout in LAYOUTS:
            if layout == "tensor":
                continue
            r = run_one(tb, layout, plan.scenario_steps, tmp, plan.scenario, None,
                        AUTO_EXTRA if layout == "auto" else [])
            r["link_changes"] = [f"{rate}@{step}" for rate, _, step in tb.changes]
            out[layout].append(r)
            show("scenario", layout, r, plan.scenario_steps, rep)
            print(f"{'':<30}link changed: {' '.join(r['link_changes'])}", flush=True)
    return out


def sps(per_layout: dict, layout: str, rep: int) -> float:
    runs = per_layout[layout]
    return runs[min(rep, len(runs) - 1)]["samples_per_s"]  # static tensor: its one measurement


def cell(s: dict, fmt: str, repeats: int) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}..{s['max']:{fmt}}]" if repeats > 1 else f"{s['median']:{fmt}}"


def setting_figures(plan: Plan, results: dict, figures: dict) -> dict[str, dict]:
    """Per setting: the table's row printed, its figures into `figures`; the summary per setting."""
    repeats, summary = plan.repeats, {}
    steps_of = {f"fixed_{rate}": steps for rate, steps in plan.fixed} | {"scenario": plan.scenario_steps}
    print(f"\nsamples/s, median [min..max] over {repeats} repeat(s); ratios taken within a repeat")
    print(f"{'setting':<16}{'steps':>6}" + "".join(f"{k:>24}" for k in LAYOUTS)
          + f"{'auto/best':>22}{'auto/data':>22}{'reverts':>9}")
    for name, per_layout in results.items():
        vs_best = [sps(per_layout, "auto", i) / max(sps(per_layout, k, i) for k in STATIC) for i in range(repeats)]
        vs_data = [sps(per_layout, "auto", i) / sps(per_layout, "data", i) for i in range(repeats)]
        best_static = [max(STATIC, key=lambda k: sps(per_layout, k, i)) for i in range(repeats)]
        reverts = [len(r["reverts"]) for r in per_layout["auto"]]
        summary[name] = {k: spread([r["samples_per_s"] for r in per_layout[k]]) for k in LAYOUTS}
        summary[name]["best_static_per_repeat"] = best_static
        for key, values in (("auto_vs_best_static", vs_best), ("auto_vs_data", vs_data)):
            s = spread(values)
            figures[f"{key}_{name}"] = s["median"]
            figures[f"{key}_{name}_min"] = s["min"]
            figures[f"{key}_{name}_max"] = s["max"]
            figures[f"{key}_{name}_per_repeat"] = values
        # the start choice counted in auto's time, as a user waits for it
        counted = [steps_of[name] * BATCH / (r["seconds"] + r.get("start_layout_s", 0.0)) for r in per_layout["auto"]]
        figures[f"auto_start_layout_s_{name}"] = [r.get("start_layout_s", 0.0) for r in per_layout["auto"]]
        figures[f"auto_vs_best_static_{name}_start_counted"] = spread(
            [counted[i] / max(sps(per_layout, k, i) for k in STATIC) for i in range(repeats)])["median"]
        figures[f"reaction_steps_{name}"] = max(r["reaction_steps"] for r in per_layout["auto"])
        figures[f"auto_moves_{name}"] = [r["moves"] for r in per_layout["auto"]]
        figures[f"reverted_switches_{name}"] = max(reverts)
        figures[f"reverted_switches_per_repeat_{name}"] = reverts
        figures[f"auto_switches_{name}"] = [r["switches"] for r in per_layout["auto"]]
        print(f"{name:<16}{steps_of[name]:>6}"
              + "".join(f"{cell(summary[name][k], '.1f', repeats):>24}" for k in LAYOUTS)
              + f"{cell(spread(vs_best), '.3f', repeats):>22}{cell(spread(vs_data), '.3f', repeats):>22}"
              f"{max(reverts):>9}")
    print("(static tensor: measured once per rate from a few steps, extrapolated; reverts: the most in one auto run)")
    return summary


def oracle_figures(plan: Plan, results: dict, tensor_step_s: dict[str, float], figures: dict) -> None:
    """The ceiling of adaptivity: each phase of the scenario on that phase's best static layout, as
    measured in the same repeat (static tensor: its step time at the phase's rate), switching for free."""
    bounds = plan.bounds()
    oracle, vs_oracle = [], []
    for i in range(plan.repeats):
        per_phase = {k: phase_seconds(results["scenario"][k][i], bounds) for k in STATIC if k != "tensor"}
        per_phase["tensor"] = [tensor_step_s[p.rate] * (last - first + 1)
                               for p, (first, last) in zip(plan.scenario, bounds)]
        if any(v is None for v in per_phase.values()):
            continue
        best = [min(per_phase, key=lambda k: per_phase[k][j]) for j in range(len(bounds))]
        seconds = sum(per_phase[k][j] for j, k in enumerate(best))
        oracle.append({"seconds": seconds, "phases": [f"{first}-{last}:{k}" for (first, last), k in zip(bounds, best)],
                       "per_phase_s": per_phase})
        vs_oracle.append(seconds / results["scenario"]["auto"][i]["seconds"])
    if not vs_oracle:
        return
    s = spread(vs_oracle)
    figures.update(auto_vs_oracle_scenario=s["median"], auto_vs_oracle_scenario_min=s["min"],
                   auto_vs_oracle_scenario_max=s["max"], auto_vs_oracle_scenario_per_repeat=vs_oracle,
                   oracle_scenario=oracle,
                   oracle_vs_best_static_scenario=statistics.median(
                       min(runs[min(i, len(runs) - 1)]["seconds"] for k, runs in results["scenario"].items()
                           if k in STATIC) / o["seconds"] for i, o in enumerate(oracle)))
    print(f"scenario: auto / oracle {s['median']:.3f} [{s['min']:.3f}..{s['max']:.3f}] (the oracle runs each phase "
          f"on its best static layout and switches for free: {oracle[0]['phases']}); the oracle is "
          f"{figures['oracle_vs_best_static_scenario']:.3f}x the best static layout")
    figures["phase_leads_scenario"] = phase_leads(oracle, bounds)
    for (first, last), lead in zip(bounds, figures["phase_leads_scenario"]):
        print(f"  steps {first}-{last}: best {lead['best']} in every repeat? {lead['same_every_repeat']}; "
              f"its lead over the runner-up {lead['runner_up']}: {lead['lead']:.3f}x (median over repeats)")


def report(plan: Plan, results: dict, tensor_step_s: dict[str, float]) -> None:
    figures: dict = {}
    summary = setting_figures(plan, results, figures)
    oracle_figures(plan, results, tensor_step_s, figures)
    figures["pipeline_bubble"] = bubble_figures(results)
    for name, b in figures["pipeline_bubble"].items():
        print(f"{name}: static pipeline's bubble {b['measured']:.3f} of the step (median over repeats and steps); "
              f"the schedule's own share (pp - 1) / (m + pp - 1) = {b['schedule']:.3f} "
              f"(pp {PP}, m {MICROBATCHES}, 1F1B)")
    for name in results:
        print(f"{name}: reaction_steps {figures[f'reaction_steps_{name}']} (the most steps from the record that "
              f"brought a decision to the boundary it was carried out at)")
    for name, per_layout in results.items():
        for i, r in enumerate(per_layout["auto"]):
            print(f"  auto {name} #{i + 1}: switches {' '.join(r['switches']) or '-'}; reverts at "
                  f"{r['reverts'] or '-'}")
            for m in r["moves"]:
                figs = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in m.items()
                                 if k not in ("decision", "to", "seen_step", "applied_step"))
                print(f"      {m['decision']} -> {m['to']} seen at step {m['seen_step']}, carried out at "
                      f"{m['applied_step']}: {figs}")
    steps_of = {f"fixed_{rate}": steps for rate, steps in plan.fixed} | {"scenario": plan.scenario_steps}
    print(json.dumps({"bench": "adaptive", "steps": steps_of, "batch": BATCH, "scenario": plan.scenario_text,
                      "repeats": plan.repeats, "tensor_step_s": tensor_step_s, "summary": summary,
                      "results": {name: {k: [{f: v for f, v in r.items() if f not in ("step_ends", "start")} for r in runs]
                                         for k, runs in per.items()} for name, per in results.items()},
                      **figures}))


if __name__ == "__main__":
    main()
