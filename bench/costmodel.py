"""The cost model's predictions against measured step times on this machine.

Calibration (orchestrator/costmodel.py) fits the figures from runs' own telemetry:

- a data-parallel run fits the device rate (its slowest rank's compute time) and the link's
  bandwidth (the comm wait of the rank that reached the all-reduce last);
- a tensor-parallel run fits the work a sharded layout adds on every rank (its compute beyond its
  FLOPs), and the per-hop latency of the link (its comm wait beyond the bandwidth term); the two
  are fitted together (calibration.calibrate_pair) until bandwidth and latency agree with both.

On loopback, world 2 runs data 2x1 and tensor 1x2 to calibrate; world 4 runs data 4x1 to refit
the device rate and link (four workers share the two cores), and then tensor 1x4 and hybrid 2x2
are predicted from those figures and measured. At each world a pipeline of 2 stages (pipeline
2x1, 2x2: stages x replicas) is predicted by orchestrator/policy/pipeline_cost.py from the same
figures. At world 2, data parallelism with rank 1 slowed (`inject.slow` factor 2, under
`adapt.stragglers: off`, so its shares stay even) is predicted by orchestrator/policy/speeds.py
with that rank at half speed (`data 2x1 1@0.5`, as `gearshift plan --slow 1@0.5` writes it); not
at world 4, where four workers share two cores and a sleeping rank's core goes to the others. On the
two-node testbed (root), per link rate, data 4x1 across the nodes fits the link between them;
hybrid 2x2 (tp inside a node) and tensor 1x4 (tp across the nodes) are predicted and measured.

    python bench/costmodel.py            # loopback, world 2 and 4, each layout twice, 60 steps a run
    python bench/costmodel.py --quick    # each layout once, 30 steps a run
    python bench/costmodel.py --smoke    # world 2, 20 steps: data 2x1 fits, data 2x1 1@0.5 predicted
    sudo python bench/costmodel.py --testbed 1gbit,100mbit   # and on the shaped two-node testbed
    python bench/costmodel.py --keep DIR # keep every run's directory (telemetry.jsonl) under DIR
    python bench/costmodel.py --replay DIR [--testbed RATES]   # the table again from kept runs

The table ends with the worst relative error per layout (data with a slow rank apart from
data), against the goal of 15 %. The last line is one JSON object: `worst_rel_error_by_layout`
the same, `worst_rel_error` the largest |predicted - measured| / measured over every row that was
not used for calibration.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import platform
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gearshift.orchestrator.commands import cli  # noqa: E402
from gearshift.orchestrator.policy import calibration, costmodel, job_shape, pipeline_cost  # noqa: E402
from gearshift.orchestrator.policy import speeds as uneven  # noqa: E402
from gearshift.orchestrator.job import load_job  # noqa: E402

JOB = ROOT / "examples" / "gpt.yaml"
BATCH = 32
GOAL = 0.15  # the worst relative error a layout's predictions may have
SLOW_FACTOR = 2.0  # inject.slow's factor on the slowed rank: it computes at 1 / SLOW_FACTOR of full speed


def common(world: int, steps: int) -> list[str]:
    return [f"cluster.num_workers={world}", f"cluster.cpus_per_worker={2 / world:g}", f"train.steps={steps}",
            f"train.global_batch_size={BATCH}", "checkpoint.every=0"]


REPLAY = False  # --replay: read the runs a --keep left instead of running them


REPEAT = 1    # --repeat: runs of each layout, their steady steps pooled


def run_dirs(out: pathlib.Path, name: str) -> list[pathlib.Path]:
    return [out / (name if i == 0 else f"{name}-r{i + 1}") for i in range(REPEAT)]


def run_local(out: pathlib.Path, name: str, world: int, sets: list[str], steps: int) -> list[dict]:
    pooled = []
    for run_dir in run_dirs(out, name):
        if not REPLAY:
            argv = ["run", str(JOB), "--run-dir", str(run_dir)]
            for s in [*common(world, steps), *sets]:
                argv += ["--set", s]
            if cli.main(argv) != 0:
                raise SystemExit(f"{run_dir.name} failed")
        pooled += records(run_dir)
    return pooled


def records(run_dir: pathlib.Path) -> list[dict]:
    if REPLAY and not (run_dir / "telemetry.jsonl").is_file():
        raise SystemExit(f"--replay: no {run_dir}/telemetry.jsonl: the kept runs lack one this bench makes now "
                         "(runs kept with --quick replay with --quick)")
    out = []
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line cut short by a crash
            out.append(json.loads(line))
    return out


def row(where: str, layout: str, recs: list[dict], pred: costmodel.Prediction, fitted: bool,
        kind: str | None = None) -> dict:
    """`fitted`: the row was used to fit the hardware (its error says nothing of the model).
    `kind`: the layout its error counts for (default: the layout's first word)."""
    rs = calibration.steady(recs)
    measured = calibration.measured_step(recs)
    r = {"where": where, "layout": layout, "kind": kind or layout.split()[0], "calibration": fitted,
         "measured_ms": measured * 1e3,
         "measured_compute_ms": calibration._median([calibration.slowest_compute(x) for x in rs]) * 1e3,
         "measured_wait_ms": calibration._median([calibration.transfer_wait(x) for x in rs]) * 1e3,
         "predicted_ms": pred.step_s * 1e3, "predicted_compute_ms": pred.compute_s * 1e3,
         "predicted_wait_ms": pred.exposed_wait_s * 1e3}
    r["rel_error"] = abs(pred.step_s - measured) / measured
    return r


def slowed(out: pathlib.Path, model: costmodel.ModelShape, hw: costmodel.Hardware, world: int, steps: int) -> dict:
    """Data parallelism with the last rank computing SLOW_FACTOR times as long (inject.slow, shares
    kept even), against the model with that rank at 1 / SLOW_FACTOR of full speed."""
    rank = world - 1
    sets = ["parallel.strategy=data", "adapt.stragglers=off",
            f"inject.slow={{ranks: [{rank}], factor: {SLOW_FACTOR:g}, from_step: 0}}"]
    recs = run_local(out, f"data{world}-slow", world, sets, steps)
    speeds = tuple(1 / SLOW_FACTOR if r == rank else 1.0 for r in range(world))
    pred = uneven.price(costmodel.predict(model, hw, BATCH, world, 1), BATCH, speeds).even
    return row("loopback", f"data {world}x1 {rank}@{1 / SLOW_FACTOR:g}", recs, pred, False, kind="data, a slow rank")


def pipeline(out: pathlib.Path, model: costmodel.ModelShape, hw: costmodel.Hardware, world: int, steps: int) -> dict:
    """A pipeline of 2 stages and world / 2 replicas (1F1B, the default micro-batches)."""
    recs = run_local(out, f"pipeline{world}", world, ["parallel.strategy=pipeline", "parallel.pp_size=2"], steps)
    return row("loopback", f"pipeline 2x{world // 2}", recs, pipeline_cost.predict(model, hw, BATCH, 2, world // 2),
               False)


def link_rate(bandwidth: float) -> str:
    return "no bandwidth limit in the waits" if bandwidth >= 1e15 else f"{bandwidth / 1e6:.1f} MB/s"


def loopback(out: pathlib.Path, model: costmodel.ModelShape, steps: int):
    rows = []
    # world 2: calibrate everything
    data2 = run_local(out, "data2", 2, ["parallel.strategy=data"], steps)
    tensor2 = run_local(out, "tensor2", 2, ["parallel.strategy=tensor"], steps)
    model, hw2 = calibration.calibrate_pair(model, data2, tensor2, BATCH, per_node=2)
    rows.append(row("loopback", "data 2x1", data2, costmodel.predict(model, hw2, BATCH, 2, 1), True))
    rows.append(row("loopback", "tensor 1x2", tensor2, costmodel.predict(model, hw2, BATCH, 1, 2), True))
    print(f"  world 2: {hw2.flops / 1e9:.1f} GFLOP/s a worker, link {link_rate(hw2.intra.bandwidth)} and "
          f"{hw2.intra.latency * 1e6:.0f} us a hop; a sharded layout adds "
          f"{model.tp_overhead_flops / hw2.flops * 1e3:.1f} ms of work a step", flush=True)
    rows += [pipeline(out, model, hw2, 2, steps), slowed(out, model, hw2, 2, steps)]
    # world 4: the device rate and link refitted (four workers on two cores), the rest predicted
    data4 = run_local(out, "data4", 4, ["parallel.strategy=data"], steps)
    hw4 = calibration.calibrate(model, data4, BATCH, per_node=4, latency=hw2.intra.latency)
    rows.append(row("loopback", "data 4x1", data4, costmodel.predict(model, hw4, BATCH, 4, 1), True))
    print(f"  world 4: {hw4.flops / 1e9:.1f} GFLOP/s a worker, link {link_rate(hw4.intra.bandwidth)}", flush=True)
    for name, dp, tp, sets in [("tensor", 1, 4, ["parallel.strategy=tensor"]),
                               ("hybrid", 2, 2, ["parallel.strategy=hybrid", "parallel.tp_size=2"])]:
        recs = run_local(out, f"{name}4", 4, sets, steps)
        rows.append(row("loopback", f"{name} {dp}x{tp}", recs, costmodel.predict(model, hw4, BATCH, dp, tp), False))
    # no slowed rank at world 4: four workers share the two cores, so the slowed rank's sleep hands its
    # core to the other three, which then compute faster; the model's ranks are devices of their own
    rows.append(pipeline(out, model, hw4, 4, steps))
    return model, hw4, rows


def smoke(out: pathlib.Path, model: costmodel.ModelShape, steps: int = 20) -> list[dict]:
    """The bench's path end to end in two short runs: data 2x1 fits the device and link (no
    tensor run: no per-hop latency), data 2x1 with rank 1 slowed is predicted from them."""
    data2 = run_local(out, "data2", 2, ["parallel.strategy=data"], steps)
    hw2 = calibration.calibrate(model, data2, BATCH, per_node=2)
    return [row("loopback", "data 2x1", data2, costmodel.predict(model, hw2, BATCH, 2, 1), True),
            slowed(out, model, hw2, 2, steps)]


def testbed(out: pathlib.Path, model: costmodel.ModelShape, local: costmodel.Hardware, rates: list[str],
            steps: int) -> list[dict]:
    """Per link rate, on two namespaces of two workers each: data 4x1 fits the link between the
    nodes; hybrid 2x2 and tensor 1x4 are predicted with it and the loopback figures inside a node."""
    sys.path.insert(0, str(ROOT / "bench" / "testbed"))
    from testbed import Testbed

    rows = []
    with contextlib.nullcontext() if REPLAY else Testbed(rate=rates[0]) as tb:
        def on_testbed(name: str, sets: list[str], n: int) -> list[dict]:
            pooled = []
            for run_dir in run_dirs(out, name):
                if not REPLAY:
                    argv = ["run", str(JOB), "--run-dir", str(run_dir)]
                    for s in [*common(4, n), "cluster.placement=pack", *sets]:
                        argv += ["--set", s]
                    done = tb.run_driver(argv, capture=True)
                    if done.returncode != 0:
                        raise SystemExit(f"{run_dir.name} failed:\n{done.stderr[-2000:]}")
                pooled += records(run_dir)
            return pooled

        for rate in rates:
            if not REPLAY:
                tb.set_rate(rate)
            data = on_testbed(f"tb-data-{rate}", ["parallel.strategy=data"], steps)
            fitted = calibration.calibrate(model, data, BATCH, per_node=2, nodes=2, latency=local.intra.latency)
            hw = costmodel.replace(local, nodes=2, per_node=2, flops=fitted.flops, inter=fitted.inter)
            rows.append(row(f"testbed {rate}", "data 4x1", data, costmodel.predict(model, hw, BATCH, 4, 1), True))
            print(f"  testbed {rate}: link between the nodes fitted at {link_rate(hw.inter.bandwidth)}", flush=True)
            hybrid = on_testbed(f"tb-hybrid-{rate}", ["parallel.strategy=hybrid", "parallel.tp_size=2"], steps)
            rows.append(row(f"testbed {rate}", "hybrid 2x2", hybrid, costmodel.predict(model, hw, BATCH, 2, 2), False))
            # tensor across the nodes crosses the slow link 8 times a step: fewer steps
            tensor = on_testbed(f"tb-tensor-{rate}", ["parallel.strategy=tensor", "parallel.tp_across_nodes=true"],
                                min(steps, 24))
            rows.append(row(f"testbed {rate}", "tensor 1x4", tensor, costmodel.predict(model, hw, BATCH, 1, 4), False))
    return rows


def worst_per_layout(rows: list[dict]) -> dict[str, float]:
    """The largest relative error of each kind of layout's predicted rows (calibration rows left out)."""
    out: dict[str, float] = {}
    for r in rows:
        if not r["calibration"]:
            out[r["kind"]] = max(out.get(r["kind"], 0.0), r["rel_error"])
    return out


def report(rows: list[dict]) -> None:
    """The table, the worst error per layout against the goal, and the JSON line."""
    print(f"\n{'where':<17}{'layout':<16}{'measured ms':>12} {'(compute+wait)':<16}{'predicted ms':>12} "
          f"{'(compute+wait)':<16}{'error':>7}")
    for r in rows:
        err = "(fit)" if r["calibration"] else f"{r['rel_error']:.1%}"
        print(f"{r['where']:<17}{r['layout']:<16}{r['measured_ms']:>12.1f} "
              f"{'(%.1f+%.1f)' % (r['measured_compute_ms'], r['measured_wait_ms']):<16}{r['predicted_ms']:>12.1f} "
              f"{'(%.1f+%.1f)' % (r['predicted_compute_ms'], r['predicted_wait_ms']):<16}{err:>7}")
    per = worst_per_layout(rows)
    missed = sorted(k for k, e in per.items() if e > GOAL)
    print(f"\nworst error per layout (goal within {GOAL:.0%}): "
          + ", ".join(f"{k} {e:.1%}" for k, e in per.items())
          + (f"; over the goal: {', '.join(missed)}" if missed else "; every layout within it"))
    worst = max(per.values(), default=0.0)
    print(json.dumps({"bench": "costmodel", "machine": f"{platform.machine()} {os.cpu_count()} cores",
                      "rows": rows, "goal": GOAL, "worst_rel_error_by_layout": per, "over_goal": missed,
                      "worst_rel_error": worst}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="each layout once, 30 steps a run instead of 60")
    ap.add_argument("--smoke", action="store_true",
                    help="two runs of 20 steps at world 2: data 2x1 calibrates, data 2x1 with rank 1 slowed is "
                         "predicted (the bench's path end to end, for CI)")
    ap.add_argument("--testbed", default=None, metavar="RATES",
                    help="also on the two-node testbed (root) at these link rates, e.g. 1gbit,100mbit")
    ap.add_argument("--keep", default=None, metavar="DIR", help="keep every run's directory under DIR")
    ap.add_argument("--replay", default=None, metavar="DIR",
                    help="recompute the table from the runs a --keep DIR left (after a change to the model)")
    ap.add_argument("--repeat", type=int, default=2, metavar="N",
                    help="runs of each layout, their steady steps pooled (default 2; 1 with --quick or --smoke)")
    args = ap.parse_args()
    global REPLAY, REPEAT
    REPEAT = 1 if args.quick or args.smoke else args.repeat
    if REPEAT < 1:
        raise SystemExit(f"--repeat {REPEAT}: at least 1")
    if args.smoke and args.testbed:
        raise SystemExit("--smoke runs on loopback alone: leave out --testbed")
    if args.replay:
        REPLAY, args.keep = True, args.replay
    steps = 30 if args.quick else 60
    model = job_shape.shape_of_job(load_job(JOB))
    print(f"GPT (examples/gpt.yaml, {model.params:,.0f} parameters), batch {BATCH}, {platform.machine()} with "
          f"{os.cpu_count()} cores", flush=True)
    with contextlib.ExitStack() as stack:
        if args.keep:
            out = pathlib.Path(args.keep)
            out.mkdir(parents=True, exist_ok=True)
        else:
            out = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gs-costmodel-")))
        if args.smoke:
            rows = smoke(out, model)
        else:
            model, hw4, rows = loopback(out, model, steps)
            if args.testbed:
                rows += testbed(out, model, hw4, args.testbed.split(","), steps)
    report(rows)


if __name__ == "__main__":
    main()
