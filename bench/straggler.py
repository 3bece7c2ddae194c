"""A slow node: static layouts, straggler rebalancing and auto, on the two-node testbed (as root).

The testbed (bench/testbed/testbed.py) makes two network namespaces joined by a 1 Gbit/s veth,
with a Ray node in each, each node on a core of its own (`own_cores`, bench/testbed/cores.py);
4 workers, 2 per node (ranks 0-1 on the head's node, 2-3 on the other). A slow node is node 1
held to a share of its core's time (cgroup `cpu.cfs_quota_us`, `--slow-node` of the testbed):
its two ranks compute at that share of their speed, as a node with slower devices would.

The built-in GPT (the adaptive bench's job) trains the same steps under each variant:

    data             static data, adapt.stragglers=off: every rank waits on the slowest one
    hsdp             static hsdp (sharded inside a node, replicated across), adapt.stragglers=off
    data+rebalance   static data, adapt.stragglers=rebalance: the batch shared out by the ranks' speeds
    auto             parallel.strategy=auto, adapt.stragglers=rebalance
    pipeline         (not by default) a pipeline of a stage a node, 8 GPT blocks, adapt.stragglers=off
    pipeline+recut   (not by default) the same with adapt.stragglers=rebalance: a slow stage's blocks move

in three settings:

    slow       node 1 at --share (0.5) of its core from the start
    quiet      no slow node: what rebalancing costs where there is nothing to rebalance; every
               `decision` record whose `decision` is `rebalance` is a false positive
    scenario   node 1 at full speed, at half from step 60, at full again from step 140, over 200
               steps (--quick: half from 40 to 100, over 140); the testbed follows the run's
               telemetry, so every variant trains the same steps under the same node

Samples/s of a run is as bench/adaptive.py measures it: N steps x the global batch over the time
from the controller's `training` event to the last step record (Ray start-up and the model build
excluded, equal for all). The ideal is every rank busy all the time: the sum of the ranks' speeds,
taken from the static data run of the same setting and repeat: rank r's speed is its samples per
step (global batch / dp) over the median, across steady steps, of its compute time (the step
records' `ranks.compute_time`: step time minus comm wait minus data time); steady means past the
first 10 steps of the run and past the first 3 after each change of the node's share. In the
scenario the ideal is taken per phase (each phase's steps at that phase's summed speed), the
phases as they landed in that run: the testbed changes the share when the telemetry shows the
step, a few steps behind the workers, so a phase starts at the first step that ended after the
change (the step records' `ended_at`). That ideal leaves out communication altogether; the
`ideal_with_comm` adds to each step the comm and data time of a rank that waited on no other
(per step the smallest step time minus compute time over the ranks, median over steady steps):
every rank computing or communicating, none waiting for another.

`--repeats N` runs every (setting, variant) N times, interleaved (repeat 1 of every variant of a
setting, then repeat 2, ...); ratios are taken within a repeat and summarized as median, min and
max. `--dry-run` prints every run's `gearshift` arguments and slow node without running anything.

    sudo .venv/bin/python bench/straggler.py                   # slow (300 steps), quiet (300), scenario (200)
    sudo .venv/bin/python bench/straggler.py --quick           # 150, 150, 140 steps: ~8 min a repeat
    sudo .venv/bin/python bench/straggler.py --quick --repeats 3
    .venv/bin/python bench/straggler.py --quick --dry-run      # the runs it would make (no root needed)

Goals: slow: auto / static data >= 1.25 and auto / ideal >= 0.9; quiet: auto / static data and
data+rebalance / static data >= 0.98; scenario: auto ahead of every static layout in every repeat.

The last line of output is one JSON object. Per setting (`slow`, `quiet`, `scenario`):
`auto_vs_static_data_<setting>`, `auto_vs_static_hsdp_<setting>`, `rebalance_vs_static_data_<setting>`
(data+rebalance / static data), `recut_vs_static_pipeline_<setting>` (where the pipeline variants ran), `auto_vs_ideal_<setting>` and `auto_vs_ideal_with_comm_<setting>`
(with `rebalance_vs_...` and `static_data_vs_...` beside them), each {median, min, max, per_repeat};
`samples_per_s_<setting>`: per variant, the same summary of samples/s;
`rebalances_<setting>`: per variant, the rebalance decisions of each repeat's run;
`peak_mem_bytes_<setting>`: per variant, the largest `peak_mem_bytes` of its runs' step records
(where they carry it); `auto_ahead_scenario`: per repeat, whether auto beat every static layout;
`goals`: each goal with its figure and whether it was met.
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

from testbed import SharePhase, Testbed, TestbedError, parse_slow_node  # noqa: E402

BATCH = 32
RATE = "1gbit"
DEEP = "model.kwargs={vocab_size: 128, block_size: 64, n_layer: 8, n_head: 4, n_embd: 128}"
# `off` quoted: --set values are parsed as YAML, where a bare off is the boolean false
VARIANTS = {
    "data": ["parallel.strategy=data", "adapt.stragglers='off'"],
    "hsdp": ["parallel.strategy=hsdp", "adapt.stragglers='off'"],
    "data+rebalance": ["parallel.strategy=data", "adapt.stragglers=rebalance"],
    "auto": ["parallel.strategy=auto", "adapt.stragglers=rebalance"],
    # a pipeline of a stage a node (ranks 0-1, 2-3): a deeper GPT, so that blocks can move between them
    "pipeline": ["parallel.strategy=pipeline", "parallel.pp_size=2", "adapt.stragglers='off'", DEEP],
    "pipeline+recut": ["parallel.strategy=pipeline", "parallel.pp_size=2", "adapt.stragglers=rebalance", DEEP],
}
DEFAULT_VARIANTS = ("data", "hsdp", "data+rebalance", "auto")
STATIC = ("data", "hsdp")
# runs of a few hundred steps: the policy judges windows of 10 steps (as bench/adaptive.py's auto);
# every variant gets the same, so strategy and adapt.stragglers are all that differ
ADAPT = ["adapt.window=10", "adapt.cooldown=20"]
WARMUP, TRANSITION = 10, 3  # steps left out of the ideal's medians: the run's first, and after a change of share
SETTINGS = ("slow", "quiet", "scenario")


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    steps: int
    slow_node: str | None  # the testbed's --slow-node: SHARE or SHARE@STEP,...; None: no slow node

    def phases(self) -> list[SharePhase] | None:
        return parse_slow_node(self.slow_node) if self.slow_node else None

    def planned_starts(self) -> list[int]:
        """The first step of each phase of the node's share, as planned (one phase without a slow node)."""
        later = [p.from_step + 1 for p in self.phases() or [] if 0 < p.from_step < self.steps]
        return [1, *later]


def settings_of(args: argparse.Namespace) -> list[Setting]:
    steps = args.steps or (150 if args.quick else 300)
    scenario_steps = args.scenario_steps or (140 if args.quick else 200)
    scenario = args.scenario or ("1.0@0,0.5@40,1.0@100" if args.quick else "1.0@0,0.5@60,1.0@140")
    if not all("@" in part for part in scenario.split(",")):
        raise SystemExit(f"--scenario {scenario!r}: give every phase by step (SHARE@STEP,...)")
    if not 0 < args.share <= 1:
        raise SystemExit(f"--share {args.share:g}: the slow node's share of its core is in (0, 1]")
    out = {"slow": Setting("slow", steps, f"{args.share:g}"), "quiet": Setting("quiet", steps, None),
           "scenario": Setting("scenario", scenario_steps, scenario)}
    chosen = [s.strip() for s in args.settings.split(",")]
    unknown = [s for s in chosen if s not in out]
    if unknown or not chosen:
        raise SystemExit(f"--settings {args.settings!r}: a comma-separated subset of {','.join(SETTINGS)}")
    for name in chosen:
        out[name].phases()  # SystemExit on a bad --share or --scenario before anything starts
    return [out[name] for name in chosen]


def variants_of(text: str) -> list[str]:
    chosen = [v.strip() for v in text.split(",")]
    if not chosen or any(v not in VARIANTS for v in chosen):
        raise SystemExit(f"--variants {text!r}: a comma-separated subset of {','.join(VARIANTS)}")
    return chosen


def driver_argv(variant: str, steps: int, run_dir: pathlib.Path, stragglers_field: bool = True) -> list[str]:
    """`gearshift` arguments of one run (bench/adaptive.py's job, the variant's layout)."""
    argv = ["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run_dir),
            "--set", f"train.steps={steps}", "--set", f"train.global_batch_size={BATCH}",
            "--set", "cluster.num_workers=4", "--set", "cluster.cpus_per_worker=0.5",
            "--set", "checkpoint.every=0", "--set", "cluster.placement=pack"]
    for item in [*VARIANTS[variant], *ADAPT]:
        if stragglers_field or not item.startswith("adapt.stragglers="):
            argv += ["--set", item]
    return argv


def read_run(run_dir: pathlib.Path, steps: int) -> dict:
    """A run's figures from its telemetry.jsonl: time and samples/s as bench/adaptive.py takes them,
    each step's end and per-rank times (for the ideal), its decisions, its peak memory."""
    lines = (run_dir / "telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    start = next(r["time"] for r in records if r.get("event") == "state" and r.get("state") == "training")
    step_records = [r for r in records if r["type"] == "step"]
    end = max(r["time"] for r in step_records)
    decisions = [r for r in records if r["type"] == "event" and r.get("event") == "decision"]
    # what the policy did (not its keeps and holds): switches, reverts, rebalances with their shares
    moves = [{"decision": r["decision"], "seen_step": r.get("seen_step", r.get("step")),
              "applied_step": r.get("applied_step"), "to": (r.get("to") or {}).get("strategy"),
              "shares": r.get("shares"), "speed_ratio": (r.get("evidence") or {}).get("speed_ratio")}
             for r in decisions if r.get("decision") not in (None, "keep", "hold")]
    peaks = [r["peak_mem_bytes"] for r in step_records if isinstance(r.get("peak_mem_bytes"), (int, float))]
    return {"seconds": end - start, "samples_per_s": steps * BATCH / (end - start),
            "rebalances": sum(1 for r in records if r.get("decision") in ("rebalance", "recut", "drop")),
            "switches": [f"{r['step']}:{r['to']['strategy']}" for r in records if r.get("event") == "switch"],
            "moves": moves, "peak_mem_bytes": max(peaks) if peaks else None,
            "ends": {r["step"]: r.get("ended_at") for r in step_records},
            "ranks": {r["step"]: ((r.get("ranks") or {}).get("compute_time"), r["ranks"].get("step_time"), r["dp"])
                      for r in step_records if isinstance(r.get("ranks"), dict)}}


def landed_starts(run: dict, setting: Setting, changes: list, started_at: float) -> list[int]:
    """The first step of each phase of the node's share as it landed in this run: the first step
    that ended after the share changed (the testbed follows the telemetry, a few steps behind the
    workers); the planned steps where the records carry no end times."""
    ends = sorted((s, t) for s, t in run["ends"].items() if t is not None)
    if not ends:
        return setting.planned_starts()
    starts = [1]
    for _, seconds, _ in changes:
        landed = next((s for s, t in ends if t >= started_at + seconds), None)
        if seconds > 0 and landed is not None and landed > starts[-1]:
            starts.append(landed)
    return starts


def ideal_samples_per_s(run: dict, steps: int) -> tuple[float, float] | None:
    """Every rank busy all the time: per phase of the node's share, the sum over ranks of (global
    batch / dp) / the rank's median compute time over the phase's steady steps; over the run, its
    steps x the global batch over the time the phases take at those speeds. Second, the same with
    each step's unavoidable rest added (the smallest step time minus compute time over the ranks,
    the comm and data time of a rank that waited on no other; median over the steady steps). None:
    the records carry no per-rank compute time."""
    starts = run["phase_starts"]
    seconds = with_rest = 0.0
    for first, after in zip(starts, [*starts[1:], steps + 1]):
        timed = [s for s in range(first, after) if s in run["ranks"] and run["ranks"][s][0] and run["ranks"][s][1]]
        if not timed:
            return None
        skip = WARMUP if first == 1 else TRANSITION
        steady = [s for s in timed if s >= first + skip] or timed
        dp = run["ranks"][steady[0]][2]
        per_rank = zip(*(run["ranks"][s][0] for s in steady))
        speed = sum((BATCH / dp) / statistics.median(times) for times in per_rank)
        rest = statistics.median(min(t - c for c, t in zip(*run["ranks"][s][:2])) for s in steady)
        seconds += (after - first) * BATCH / speed
        with_rest += (after - first) * (BATCH / speed + rest)
    return steps * BATCH / seconds, steps * BATCH / with_rest


def run_one(tb: Testbed, setting: Setting, variant: str, rep: int, root: pathlib.Path,
            stragglers_field: bool) -> dict:
    run_dir = root / f"{setting.name}-{variant.replace('+', '-')}-{rep + 1}"
    argv = driver_argv(variant, setting.steps, run_dir, stragglers_field)
    done = tb.run_driver(argv, capture=True, slow_node=setting.phases(), timeout_s=600 + 5 * setting.steps)
    if done.returncode != 0:
        raise SystemExit(f"{setting.name} {variant} #{rep + 1} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    run = read_run(run_dir, setting.steps)
    run["phase_starts"] = landed_starts(run, setting, tb.share_changes, tb.started_at)
    run["share_changes"] = [f"{share:g}@{step or 0}" for share, _, step in tb.share_changes]
    if variant == "data":
        ideal = ideal_samples_per_s(run, setting.steps)
        run["ideal_samples_per_s"], run["ideal_with_comm_samples_per_s"] = ideal or (None, None)
    return run


def show(setting: Setting, variant: str, rep: int, r: dict) -> None:
    moves = " ".join(f"{m['decision']}@{m['seen_step']}" + (f"->{m['to']}" if m["to"] else "")
                     + (f"->{m['shares']}" if m["shares"] else "") for m in r["moves"])
    ideal = (f"  ideal {r['ideal_samples_per_s']:.1f} (with comm {r['ideal_with_comm_samples_per_s']:.1f})"
             if r.get("ideal_samples_per_s") else "")
    share = f"  node 1 at {' '.join(r['share_changes'])}" if r["share_changes"] else ""
    if len(r["phase_starts"]) > 1:  # the steps the telemetry showed at each change, then where it landed
        share += f" (landed from steps {','.join(map(str, r['phase_starts']))})"
    print(f"  {setting.name:<10}#{rep + 1:<3}{variant:<16}{r['seconds']:>8.1f} s{r['samples_per_s']:>9.1f} samples/s"
          f"  rebalances {r['rebalances']}{ideal}{share}  {moves}", flush=True)


def dry_run(settings: list[Setting], variants: list[str], repeats: int, stragglers_field: bool) -> None:
    root = pathlib.Path(tempfile.gettempdir()) / "gs-straggler-XXXX"
    print(f"testbed: own cores, link {RATE}; each run: python -m gearshift ARGS --address HEAD", flush=True)
    for setting in settings:
        for rep in range(repeats):
            for variant in variants:
                argv = driver_argv(variant, setting.steps, root / f"{setting.name}-{variant.replace('+', '-')}-"
                                   f"{rep + 1}", stragglers_field)
                slow = f"--slow-node {setting.slow_node}" if setting.slow_node else "no slow node"
                print(f"{setting.name} #{rep + 1} {variant} ({slow}): {shlex.join(argv)}")


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "per_repeat": values}


def cell(s: dict, fmt: str, repeats: int) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}..{s['max']:{fmt}}]" if repeats > 1 else f"{s['median']:{fmt}}"


def ratios(runs: dict[str, list[dict]], repeats: int) -> dict[str, list[float]]:
    """Per-repeat ratios of one setting (those whose variants ran)."""
    sps = {v: [r["samples_per_s"] for r in rs] for v, rs in runs.items()}
    out = {}
    for key, top, bottom in (("auto_vs_static_data", "auto", "data"), ("auto_vs_static_hsdp", "auto", "hsdp"),
                             ("rebalance_vs_static_data", "data+rebalance", "data"),
                             ("recut_vs_static_pipeline", "pipeline+recut", "pipeline")):
        if top in sps and bottom in sps:
            out[key] = [sps[top][i] / sps[bottom][i] for i in range(repeats)]
    for kind in ("ideal", "ideal_with_comm"):
        ideals = [r.get(f"{kind}_samples_per_s") for r in runs.get("data", [])]
        if not ideals or not all(ideals):
            continue
        for variant, key in (("auto", f"auto_vs_{kind}"), ("data+rebalance", f"rebalance_vs_{kind}"),
                             ("data", f"static_data_vs_{kind}")):
            if variant in sps:
                out[key] = [sps[variant][i] / ideals[i] for i in range(repeats)]
    return out


def summarize(results: dict[str, dict[str, list[dict]]], repeats: int) -> dict:
    """The table for people and the figures for the JSON line."""
    figures: dict = {}
    names = ("auto_vs_static_data", "auto_vs_static_hsdp", "rebalance_vs_static_data", "auto_vs_ideal",
             "auto_vs_ideal_with_comm", "recut_vs_static_pipeline")
    print(f"\nsamples/s, median [min..max] over {repeats} repeat(s)")
    variants = list(next(iter(results.values())))
    print(f"{'setting':<10}" + "".join(f"{v:>24}" for v in variants))
    per_setting = {}
    for name, runs in results.items():
        per_setting[name] = ratios(runs, repeats)
        print(f"{name:<10}" + "".join(f"{cell(spread([r['samples_per_s'] for r in runs[v]]), '.1f', repeats):>24}"
                                      for v in variants))
        figures[f"samples_per_s_{name}"] = {v: spread([r["samples_per_s"] for r in rs]) for v, rs in runs.items()}
        figures[f"rebalances_{name}"] = {v: [r["rebalances"] for r in rs] for v, rs in runs.items()}
        peaks = {v: max(p) for v, rs in runs.items() if (p := [r["peak_mem_bytes"] for r in rs if r["peak_mem_bytes"]])}
        if peaks:
            figures[f"peak_mem_bytes_{name}"] = peaks
    print(f"\nratios, median [min..max] over {repeats} repeat(s), each taken within a repeat "
          "(ideal: the sum of the ranks' speeds in the static data run; with_comm: plus the comm time of a "
          "rank that waits on no other)")
    print(f"{'setting':<10}" + "".join(f"{n:>28}" for n in names))
    for name, per in per_setting.items():
        print(f"{name:<10}" + "".join(f"{cell(spread(per[n]), '.3f', repeats) if n in per else '-':>28}"
                                      for n in names))
        for key, values in per.items():
            figures[f"{key}_{name}"] = spread(values)
    return figures


def verdicts(results: dict, figures: dict, repeats: int) -> dict:
    """Each goal that the settings run can judge: its figure (a median over repeats) and whether it was met."""
    goals = {}
    for key, goal in (("auto_vs_static_data_slow", 1.25), ("auto_vs_ideal_slow", 0.9),
                      ("auto_vs_static_data_quiet", 0.98), ("rebalance_vs_static_data_quiet", 0.98)):
        if key in figures:
            goals[key] = {"value": figures[key]["median"], "goal": f">= {goal}", "met": figures[key]["median"] >= goal}
    runs = results.get("scenario", {})
    if "auto" in runs and any(v in runs for v in STATIC):
        ahead = [all(runs["auto"][i]["samples_per_s"] > runs[v][i]["samples_per_s"] for v in STATIC if v in runs)
                 for i in range(repeats)]
        figures["auto_ahead_scenario"] = ahead
        goals["auto_ahead_scenario"] = {"value": ahead, "goal": "every repeat", "met": all(ahead)}
        for i, a in enumerate(ahead):
            shown = ", ".join(f"{v} {runs[v][i]['samples_per_s']:.1f}" for v in STATIC if v in runs)
            print(f"scenario #{i + 1}: auto {runs['auto'][i]['samples_per_s']:.1f} samples/s against {shown}: "
                  f"{'ahead of' if a else 'NOT ahead of'} every static layout")
    for name in results:
        if f"rebalances_{name}" in figures:
            counts = figures[f"rebalances_{name}"]
            print(f"{name}: rebalance decisions per run: "
                  + ", ".join(f"{v} {c}" for v, c in counts.items())
                  + ("  (false positives: no node is slow)" if name == "quiet" else ""))
    for key, g in goals.items():
        value = g["value"] if isinstance(g["value"], list) else f"{g['value']:.3f}"
        print(f"goal {key} {g['goal']}: {value} {'met' if g['met'] else 'NOT met'}")
    return goals


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter runs (150, 150, 140 steps): ~8 minutes a repeat")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every (setting, variant), interleaved")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"a subset of {','.join(SETTINGS)}")
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                    help=f"a subset of {','.join(VARIANTS)} (default: {','.join(DEFAULT_VARIANTS)})")
    ap.add_argument("--steps", type=int, default=None, help="steps of the slow and quiet settings")
    ap.add_argument("--share", type=float, default=0.5, help="the slow node's share of its core (slow setting)")
    ap.add_argument("--batch", type=int, default=BATCH, help=f"the global batch (default {BATCH}: a step that "
                    "computes 8 samples a rank, a third of it waiting on the link at 1 Gbit/s)")
    ap.add_argument("--scenario", default=None, help="the scenario's slow node, SHARE@STEP,... "
                                                     "(default 1.0@0,0.5@60,1.0@140; --quick 1.0@0,0.5@40,1.0@100)")
    ap.add_argument("--scenario-steps", type=int, default=None, help="steps of the scenario (default 200; --quick 140)")
    ap.add_argument("--keep", metavar="DIR", default=None, help="keep the runs' directories under DIR")
    ap.add_argument("--dry-run", action="store_true", help="print every run's gearshift arguments; run nothing")
    ap.add_argument("--no-stragglers-field", action="store_true",
                    help="leave adapt.stragglers out of the runs (a gearshift without the field: the rebalance "
                         "variants then run as their static layouts do); for smoke tests of the bench itself")
    args = ap.parse_args(argv)
    if args.repeats < 1 or (args.steps is not None and args.steps < WARMUP + 5):
        raise SystemExit(f"--repeats: at least 1; --steps: at least {WARMUP + 5}")
    return args


def main(argv: list[str] | None = None) -> None:
    global BATCH
    args = parse_args(argv)
    BATCH = args.batch
    settings, variants = settings_of(args), variants_of(args.variants)
    field = not args.no_stragglers_field
    if args.dry_run:
        return dry_run(settings, variants, args.repeats, field)
    if os.geteuid() != 0:
        raise SystemExit("bench/straggler.py runs on the testbed, which makes network namespaces and cgroups: run it "
                         "as root (sudo .venv/bin/python bench/straggler.py ...), or --dry-run to see its runs")
    print(f"GPT (examples/gpt.yaml), 4 workers on 2 nodes (network namespaces, a core each, link {RATE}), batch "
          f"{BATCH}, on {platform.machine()} with {os.cpu_count()} cores; "
          + "; ".join(f"{s.name} {s.steps} steps ({'node 1 at ' + s.slow_node if s.slow_node else 'no slow node'})"
                      for s in settings) + f"; {args.repeats} repeat(s), interleaved", flush=True)
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="gs-straggler-") as tmp:
        root = pathlib.Path(args.keep or tmp)
        root.mkdir(parents=True, exist_ok=True)
        try:
            with Testbed(rate=RATE, own_cores=True) as tb:
                print(f"cores: {tb.cores.describe()}", flush=True)
                for setting in settings:
                    results[setting.name] = {v: [] for v in variants}
                    for rep in range(args.repeats):
                        for variant in variants:
                            r = run_one(tb, setting, variant, rep, root, field)
                            results[setting.name][variant].append(r)
                            show(setting, variant, rep, r)
        except TestbedError as e:  # already taken down; the message names the step
            raise SystemExit(str(e)) from None
    figures = summarize(results, args.repeats)
    figures["goals"] = verdicts(results, figures, args.repeats)
    print(json.dumps({"bench": "straggler", "batch": BATCH, "rate": RATE, "repeats": args.repeats,
                      "settings": {s.name: {"steps": s.steps, "slow_node": s.slow_node} for s in settings},
                      "stragglers_field": field, **figures,
                      "results": {name: {v: [{k: x for k, x in r.items() if k not in ("ranks", "ends")} for r in rs]
                                         for v, rs in per.items()} for name, per in results.items()}}))


if __name__ == "__main__":
    main()
