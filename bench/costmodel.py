"""The cost model's predictions against measured step times on this machine.

For each world size, a data-parallel run of the built-in GPT calibrates the model (device rate
from its compute time, link bandwidth from its comm wait: orchestrator/costmodel.calibrate), and
the first world's tensor-parallel run fits the per-hop latency (calibrate_latency); every other
layout is then run and its median steady step time compared with the prediction.

    python bench/costmodel.py            # world 2 and 4 on loopback, 60 steps a run
    python bench/costmodel.py --quick    # world 2 only, 40 steps
    sudo python bench/costmodel.py --testbed 1gbit,40mbit   # and on the shaped two-node testbed

The last line is one JSON object whose `worst_rel_error` is the largest |predicted - measured| /
measured over every layout that was not used for calibration.
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
sys.path.insert(0, str(ROOT))

from orchestrator import cli, costmodel  # noqa: E402
from orchestrator.job import load_job  # noqa: E402

JOB = ROOT / "examples" / "gpt.yaml"
BATCH = 32


def run(tmp: pathlib.Path, name: str, world: int, layout: list[str], steps: int) -> list[dict]:
    run_dir = tmp / name
    sets = [f"cluster.num_workers={world}", f"cluster.cpus_per_worker={2 / world:g}", f"train.steps={steps}",
            f"train.global_batch_size={BATCH}", "checkpoint.every=0", *layout]
    code = cli.main(["run", str(JOB), "--run-dir", str(run_dir), *[a for s in sets for a in ("--set", s)]])
    if code != 0:
        raise SystemExit(f"{name} failed ({code})")
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


def testbed_rows(model, loopback: costmodel.Hardware, rates: list[str], steps: int) -> list[dict]:
    """On the two-namespace testbed (as root): per link rate, a data(4) run across the two nodes
    fits the link between them; hybrid 2 x 2 (tp inside a node, on the loopback figures fitted
    above) is then predicted and measured."""
    sys.path.insert(0, str(ROOT / "bench" / "testbed"))
    from testbed import Testbed

    rows = []
    with tempfile.TemporaryDirectory(prefix="gs-costmodel-tb-") as tmp, Testbed(rate=rates[0]) as tb:
        tmp = pathlib.Path(tmp)

        def on_testbed(name: str, sets: list[str]) -> list[dict]:
            run_dir = tmp / name
            argv = ["run", str(JOB), "--run-dir", str(run_dir)]
            for item in ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "cluster.placement=pack",
                         f"train.steps={steps}", f"train.global_batch_size={BATCH}", "checkpoint.every=0", *sets]:
                argv += ["--set", item]
            done = tb.run_driver(argv, capture=True)
            if done.returncode != 0:
                raise SystemExit(f"{name} failed:\n{done.stderr[-2000:]}")
            return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]

        for rate in rates:
            tb.set_rate(rate)
            data = on_testbed(f"data-{rate}", ["parallel.strategy=data"])
            fitted = costmodel.calibrate(model, data, BATCH, per_node=2, nodes=2)
            hw = costmodel.Hardware(nodes=2, per_node=2, flops=fitted.flops, intra=loopback.intra,
                                    inter=costmodel.Link(fitted.inter.bandwidth, loopback.intra.latency))
            rows.append({"world": 4, "layout": f"data 4x1 @{rate}", "calibration": True,
                         "measured_ms": costmodel.measured_step(data) * 1e3,
                         "predicted_ms": costmodel.predict(model, hw, BATCH, 4, 1).step_s * 1e3})
            hybrid = on_testbed(f"hybrid-{rate}", ["parallel.strategy=hybrid", "parallel.tp_size=2"])
            measured = costmodel.measured_step(hybrid)
            pred = costmodel.predict(model, hw, BATCH, 2, 2).step_s
            rows.append({"world": 4, "layout": f"hybrid 2x2 @{rate}", "calibration": False,
                         "measured_ms": measured * 1e3, "predicted_ms": pred * 1e3,
                         "rel_error": abs(pred - measured) / measured})
            print(f"  testbed {rate}: link between nodes fitted at {hw.inter.bandwidth / 1e6:.1f} MB/s", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--testbed", default=None, metavar="RATES",
                    help="also on the two-node testbed (root) at these link rates, e.g. 1gbit,40mbit")
    args = ap.parse_args()
    worlds = [2] if args.quick else [2, 4]
    steps = 40 if args.quick else 60
    model = costmodel.shape_of_job(load_job(JOB))
    rows, worst = [], 0.0
    print(f"GPT (examples/gpt.yaml, {model.params:,.0f} parameters), batch {BATCH}, loopback, {platform.machine()} "
          f"with {os.cpu_count()} cores", flush=True)
    with tempfile.TemporaryDirectory(prefix="gs-costmodel-") as tmp:
        tmp = pathlib.Path(tmp)
        latency_from = None
        for world in worlds:
            cal = run(tmp, f"data{world}", world, ["parallel.strategy=data"], steps)
            hw = costmodel.calibrate(model, cal, BATCH, per_node=world)
            layouts = [("tensor", 1, world, ["parallel.strategy=tensor"])]
            if world == 4:
                layouts.insert(0, ("hybrid", 2, 2, ["parallel.strategy=hybrid", "parallel.tp_size=2"]))
            measured = costmodel.measured_step(cal)
            pred = costmodel.predict(model, hw, BATCH, world, 1).step_s
            rows.append({"world": world, "layout": f"data {world}x1", "measured_ms": measured * 1e3,
                         "predicted_ms": pred * 1e3, "calibration": True})
            if latency_from is None:  # the first tensor run fits the per-hop latency for all that follow
                kind, dp, tp, sets = layouts.pop()
                tensor = run(tmp, f"{kind}{world}", world, sets, steps)
                hw = costmodel.calibrate_latency(model, hw, tensor, BATCH)
                latency_from = hw.intra.latency
                rows.append({"world": world, "layout": f"{kind} {dp}x{tp}", "calibration": True,
                             "measured_ms": costmodel.measured_step(tensor) * 1e3,
                             "predicted_ms": costmodel.predict(model, hw, BATCH, dp, tp).step_s * 1e3})
            else:
                hw = costmodel.replace(hw, intra=costmodel.Link(hw.intra.bandwidth, latency_from),
                                       inter=costmodel.Link(hw.inter.bandwidth, latency_from))
            for kind, dp, tp, sets in layouts:
                measured = costmodel.measured_step(run(tmp, f"{kind}{world}", world, sets, steps))
                pred = costmodel.predict(model, hw, BATCH, dp, tp).step_s
                err = abs(pred - measured) / measured
                worst = max(worst, err)
                rows.append({"world": world, "layout": f"{kind} {dp}x{tp}", "measured_ms": measured * 1e3,
                             "predicted_ms": pred * 1e3, "rel_error": err, "calibration": False})
            print(f"  world {world}: fitted {hw.flops / 1e9:.1f} GFLOP/s per worker, link "
                  f"{hw.intra.bandwidth / 1e9:.2f} GB/s, {hw.intra.latency * 1e6:.0f} us a hop", flush=True)
    if args.testbed:
        loopback = hw if worlds[-1] == 4 else costmodel.replace(hw, per_node=4)
        tb_rows = testbed_rows(model, loopback, args.testbed.split(","), steps)
        rows += tb_rows
        worst = max([worst] + [r["rel_error"] for r in tb_rows if not r["calibration"]])
    print(f"\n{'world':>5}  {'layout':<20}{'measured ms':>12}{'predicted ms':>14}{'error':>8}")
    for r in rows:
        err = "(fit)" if r["calibration"] else f"{r['rel_error']:.1%}"
        print(f"{r['world']:>5}  {r['layout']:<20}{r['measured_ms']:>12.1f}{r['predicted_ms']:>14.1f}{err:>8}")
    print(json.dumps({"bench": "costmodel", "rows": rows, "worst_rel_error": worst}))


if __name__ == "__main__":
    main()
