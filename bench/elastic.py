"""What losing a node costs, and what taking in a node that joins costs: the survivors going on
in memory (elastic) against a restart from the checkpoint, on the same job, the same cluster and
the same loss; and a run growing in memory onto a node added mid-run.

Each run starts a Ray cluster on this machine (`ray.cluster_utils.Cluster`, 2 CPUs a node) and
trains the built-in GPT of examples/gpt.yaml. Variants, interleaved in each repeat:

- data, elastic:   data(4) on two nodes (two workers each, placement pack), cluster.min_workers 1;
                   the second node is removed (its raylet and its workers killed, as a machine
                   that fails) once step `--lose-at` has trained: the two survivors go on in
                   memory as data(2);
- data, restart:   the same with fault.on_node_loss shrink: every worker restarted, from the
                   newest checkpoint (checkpoint.every), on the 2 workers left;
- data, grow:      data(2) on the head alone, cluster.max_workers 4; a node joins (`ray start
                   --address`) once step `--lose-at` has trained: its two workers are started
                   and taken in at a step boundary, data(4), no restart;
- hybrid, elastic / restart / grow: the same under hybrid(2x2) (the lost node held a whole
                   data-parallel replica, so the survivors hold both tensor-parallel slices:
                   hybrid(1x2)); the grow from hybrid(1x2) to hybrid(2x2).

Figures per run, from the run's own records:

- back_s: seconds from the loss (the end of the last step every rank finished) until the step
  that failed has trained again on the smaller world (the cost of the loss: detection, regroup
  or restart, and the steps computed again);
- first_step_s: seconds from the loss to the first step trained after it;
- step_s: the median step time before the loss or the join; back_s / step_s is
  `shrink_s_over_step_s`;
- steps_redone: steps computed twice;
- grow: grow_s, the seconds the run stood still for the newcomers (from the step boundary where
  they were taken in to the end of the first step on the larger world; the run trains on while
  the node registers and its workers start), over step_s: `grow_s_over_step_s`; ready_s, from the
  node's `ray start` to that first step; the phases of the regroup.

    python bench/elastic.py            # 3 repeats
    python bench/elastic.py --quick    # 1 repeat, fewer steps
    python bench/elastic.py --smoke    # data, elastic, 40 steps, the node lost after step 6: that it runs (CI)

The last line is one JSON object: `shrink_s_over_step_s_<layout>` (elastic back_s over the steady
step), `in_memory_over_restart_s_<layout>` (elastic back_s over restart back_s),
`grow_s_over_step_s_<layout>`, medians over the repeats with their spread, and every run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import signal
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCRIPT = r"""
import json, pathlib, sys, threading, time
from ray.cluster_utils import Cluster
import ray

run_dir, root, lose_at, mode = pathlib.Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[5]
fast = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False,
                                                        "_system_config": fast})
node = cluster.add_node(num_cpus=2) if mode == "lose" else None  # join: the head alone at first
cluster.wait_for_nodes()
ray.init(address=cluster.address, logging_level="WARNING")
log, joined = {}, []

def chaos():
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        tel = run_dir / "telemetry.jsonl"
        recs = [json.loads(l) for l in tel.read_text().splitlines()] if tel.exists() else []
        if max((r["step"] for r in recs if r["type"] == "step"), default=0) >= lose_at:
            break
        time.sleep(0.02)
    if node is not None:
        log["removed"] = time.time()
        cluster.remove_node(node, allow_graceful=False)
    else:  # a node joins, as an operator's `ray start` or an autoscaler's would
        import shutil, subprocess
        log["added"] = time.time()
        joined.append(subprocess.Popen([shutil.which("ray") or "ray", "start", "--address", cluster.address,
                                        "--num-cpus", "2", "--block", "--disable-usage-stats"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

threading.Thread(target=chaos, daemon=True).start()
from gearshift.orchestrator.commands import cli
overrides = json.loads(sys.argv[4])
code = cli.main(["run", str(pathlib.Path(root) / "examples" / "gpt.yaml"), "--run-dir", str(run_dir),
                 *[a for o in overrides for a in ("--set", o)]])
(run_dir / "chaos.json").write_text(json.dumps(log))
ray.shutdown()
for proc in joined:  # the node that joined, stopped by the pid it was started with
    proc.terminate()
    proc.wait(timeout=60)
cluster.shutdown()
sys.exit(code)
"""

LAYOUTS = {"data": ["parallel.strategy=data"], "hybrid": ["parallel.strategy=hybrid", "parallel.tp_size=2"]}
PATHS = {"elastic": ["cluster.min_workers=1"], "restart": ["fault.on_node_loss=shrink"],
         "grow": ["cluster.num_workers=2", "cluster.max_workers=4", "cluster.min_workers=1"]}
GROW_STEPS = 400  # after the join: a node takes 10-20 s to register and start its workers here


def one_run(work: pathlib.Path, layout: str, path: str, steps: int, lose_at: int, every: int,
            extra: list[str] = ()) -> dict:
    run_dir = work / f"{layout}-{path}-{len(list(work.iterdir()))}"
    grow = path == "grow"
    overrides = ["cluster.num_workers=4", "cluster.cpus_per_worker=1", "cluster.placement=pack",
                 f"train.steps={steps + GROW_STEPS if grow else steps}", f"checkpoint.every={every}",
                 "fault.max_failures=3", "telemetry.ray_metrics=false", *LAYOUTS[layout], *PATHS[path], *extra]
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(run_dir), str(ROOT), str(lose_at), json.dumps(overrides),
                             "join" if grow else "lose"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            env={**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    try:
        _, err = proc.communicate(timeout=900)
    finally:  # whatever the cluster started goes with the session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    if proc.returncode != 0:
        raise SystemExit(f"{layout}/{path} failed (exit {proc.returncode}):\n{err[-3000:]}")
    return grow_figures(run_dir) if grow else figures(run_dir)


def grow_figures(run_dir: pathlib.Path) -> dict:
    """What taking the new node's workers in cost the run (see the module's doc)."""
    recs = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    added = json.loads((run_dir / "chaos.json").read_text())["added"]
    summary = json.loads((run_dir / "summary.json").read_text())
    grow = next((r for r in recs if r.get("event") == "resize" and r.get("joined")), None)
    if grow is None:
        raise SystemExit(f"{run_dir.name}: the run ended on {summary['world_size']} workers without taking the new "
                         "node in (it took longer to start than the run lasted)")
    before = [r for r in recs if r["type"] == "step" and 3 < r["step"] < grow["step"]]
    first = next(r for r in recs if r["type"] == "step" and r["step"] == grow["step"])
    return {"step_s": statistics.median(r["step_time_max"] for r in before), "grow_s": grow["seconds"],
            "ready_s": first["ended_at"] - added, "regroup_s": grow["regroup_seconds"], "phases": grow.get("phases"),
            "peak_rss_before": max((r.get("peak_mem_bytes") or 0) for r in before),
            "at_step": grow["step"], "world": grow["world_size"], "to": grow["to"], "steps_redone": 0,
            "in_memory": not grow["from_checkpoint"], "final_loss": summary.get("final_loss")}


def figures(run_dir: pathlib.Path) -> dict:
    """The run's cost of the loss. The removed node's processes may train on for a moment after
    the removal (they exit once their raylet is gone), so the loss is timed from the end of the
    last step every rank finished (the one before the failed step), not from the removal."""
    recs = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    removed = json.loads((run_dir / "chaos.json").read_text())["removed"]
    at = next((i for i, r in enumerate(recs) if r.get("event") == "failure"), None)
    back = None if at is None else next((r for r in recs[at:] if r["type"] == "step"
                                         and r["step"] >= recs[at]["step"]), None)
    if back is None:
        raise SystemExit(f"{run_dir.name}: the run ended before the node's loss was seen, or before the step it "
                         "failed trained again: give it more steps after the loss")
    failure = recs[at]
    failed = failure["step"]
    steps_before = [r for r in recs[:at] if r["type"] == "step" and not r.get("partial")]
    last = max(steps_before, key=lambda r: r["step"])
    lost_at = last["ended_at"] if last["step"] == failed - 1 else removed
    first = next(r for r in recs[at:] if r["type"] == "step")
    resize = next((r for r in recs if r.get("event") == "resize"), None)
    recovered = next((r for r in recs if r.get("event") == "recovered"), None)
    in_memory = bool(resize and not resize["from_checkpoint"])
    redone = resize["steps_redone"] if in_memory else (recovered or {}).get("steps_recomputed")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"step_s": statistics.median(r["step_time_max"] for r in steps_before if r["step"] > 3),
            "first_step_s": first["ended_at"] - lost_at, "back_s": back["ended_at"] - lost_at,
            "trained_after_removal": failed - 1 - max([r["step"] for r in steps_before if r["time"] < removed] or [0]),
            "steps_redone": redone, "failed_step": failed, "world": [4, summary["world_size"]],
            "in_memory": in_memory, "to": (resize or {}).get("to"), "why_not_in_memory": failure.get("elastic"),
            # the loss seen, then the plan, the new group, the state on it (elastic)
            "detected_after_s": (first["ended_at"] - resize["seconds"] - lost_at) if in_memory else None,
            "phases": (resize or {}).get("phases"),
            "peak_rss_before": max((r.get("peak_mem_bytes") or 0) for r in steps_before),
            "final_loss": summary.get("final_loss")}


def _phases(phases: dict | None) -> str:
    return ", ".join(f"{k[:-2]} {v:.2f} s" if k.endswith("_s") else f"peak RSS of a worker {v / 2**20:.0f} MiB"
                     for k, v in (phases or {}).items())


def med(xs: list[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, fewer steps")
    ap.add_argument("--smoke", action="store_true", help="one run: data, elastic, 40 steps, the node lost after "
                    "step 6: that the bench runs")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--layouts", default="data,hybrid")
    ap.add_argument("--paths", default="elastic,restart,grow", help="which variants (default: all)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="job overrides for every run, e.g. model.kwargs='{n_layer: 4, n_embd: 256}'")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    # the node goes once the run's telemetry shows step lose_at, a few steps behind the workers: the
    # steps after it leave room for that and for the loss to be seen
    steps, lose_at, every = (40, 6, 5) if args.smoke else (30, 14, 10) if args.quick else (40, 18, 10)
    if args.smoke:
        args.layouts, args.paths = "data", "elastic"
    layouts = [x for x in args.layouts.split(",") if x]
    print(f"GPT (examples/gpt.yaml{', ' + ' '.join(args.overrides) if args.overrides else ''}) on a Ray cluster of "
          f"2-CPU nodes: 4 workers on two nodes, the second removed after step {lose_at} (elastic, restart); 2 "
          f"workers on one, a second node joining after step {lose_at} (grow); checkpoint.every {every}; {repeats} "
          f"repeat(s), interleaved; {platform.machine()} with {os.cpu_count()} cores", flush=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="gearshift-elastic-") as tmp:
        work = pathlib.Path(tmp)
        for rep in range(repeats):
            for layout in layouts:
                order = [p for p in (PATHS if rep % 2 == 0 else reversed(PATHS)) if p in args.paths.split(",")]
                for path in order:
                    f = one_run(work, layout, path, steps, lose_at, every, args.overrides)
                    runs.setdefault(f"{layout}/{path}", []).append(f)
                    show(rep, layout, path, f)
    out = {"bench": "elastic", "repeats": repeats, "lose_at": lose_at, "checkpoint_every": every,
           "overrides": args.overrides, "runs": runs}
    summarize(runs, layouts, out)
    print(json.dumps(out))


def show(rep: int, layout: str, path: str, f: dict) -> None:
    """One run's line."""
    if path == "grow":
        print(f"  repeat {rep + 1} {layout:6s} grow     step {f['step_s']:.3f} s  stood still "
              f"{f['grow_s']:5.2f} s (regroup {f['regroup_s']:.2f} s: {_phases(f['phases'])}; before it "
              f"{f['peak_rss_before'] / 2**20:.0f} MiB)  training on "
              f"{f['world'][1]} {f['ready_s']:5.1f} s after the node's start", flush=True)
        return
    print(f"  repeat {rep + 1} {layout:6s} {path:7s}  step {f['step_s']:.3f} s  first step after "
          f"{f['first_step_s']:5.2f} s  back at the failed step after {f['back_s']:5.2f} s  "
          f"{f['steps_redone']} redone  world {f['world']}  in memory {f['in_memory']}"
          + (f" ({f['why_not_in_memory']})" if f["why_not_in_memory"] else "")
          + (f"  seen after {f['detected_after_s']:.2f} s, then {_phases(f['phases'])} "
             f"(before the loss {f['peak_rss_before'] / 2**20:.0f} MiB)" if f["in_memory"] else ""),
          flush=True)


def summarize(runs: dict[str, list[dict]], layouts: list[str], out: dict) -> None:
    """The table over repeats, and the ratios per layout into `out`."""
    print(f"\n{'':16s}{'back_s':>24s}{'first_step_s':>24s}{'step_s':>10s}  redone")
    for key, rs in runs.items():
        if key.endswith("/grow"):
            continue
        b, f, s = med([r["back_s"] for r in rs]), med([r["first_step_s"] for r in rs]), med([r["step_s"] for r in rs])
        print(f"{key:16s}{b[0]:8.2f} [{b[1]:.2f}..{b[2]:.2f}]{f[0]:8.2f} [{f[1]:.2f}..{f[2]:.2f}]{s[0]:10.3f}  "
              f"{sorted(r['steps_redone'] for r in rs)}")
    for layout in layouts:
        el, re = runs.get(f"{layout}/elastic", []), runs.get(f"{layout}/restart", [])
        shrink = [r["back_s"] / r["step_s"] for r in el]
        ratio = [e["back_s"] / r["back_s"] for e, r in zip(el, re)]
        if shrink:
            out[f"shrink_s_over_step_s_{layout}"], lo, hi = med(shrink)
            out[f"shrink_s_over_step_s_{layout}_spread"] = [lo, hi]
            print(f"shrink_s_over_step_s_{layout:6s}       {out[f'shrink_s_over_step_s_{layout}']:.2f}  [{lo:.2f}..{hi:.2f}]")
        grows = [r["grow_s"] / r["step_s"] for r in runs.get(f"{layout}/grow", [])]
        if grows:
            out[f"grow_s_over_step_s_{layout}"], lo, hi = med(grows)
            out[f"grow_s_over_step_s_{layout}_spread"] = [lo, hi]
            ready = med([r["ready_s"] for r in runs[f"{layout}/grow"]])
            print(f"grow_s_over_step_s_{layout:6s}         {out[f'grow_s_over_step_s_{layout}']:.2f}  [{lo:.2f}..{hi:.2f}]"
                  f"  (training on the new node {ready[0]:.1f} s [{ready[1]:.1f}..{ready[2]:.1f}] after its start)")
        if ratio:
            out[f"in_memory_over_restart_s_{layout}"], lo, hi = med(ratio)
            out[f"in_memory_over_restart_s_{layout}_spread"] = [lo, hi]
            print(f"in_memory_over_restart_s_{layout:6s}   {out[f'in_memory_over_restart_s_{layout}']:.3f}  "
                  f"[{lo:.3f}..{hi:.3f}]")


if __name__ == "__main__":
    main()
