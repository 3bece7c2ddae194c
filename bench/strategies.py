"""Step time and samples/s of every strategy, for each built-in model, at world size 2 and 4.

Runs real gearshift jobs on one embedded Ray (as `gearshift run` does), alternating the layouts
within each repeat so that machine noise hits them all alike, and reports medians. Ratios are
samples/s of a layout divided by samples/s of data parallelism at the same world size.

    python bench/strategies.py            # 3 repeats
    python bench/strategies.py --quick    # 1 repeat, fewer steps
    python bench/strategies.py --smoke    # the MLP, data and tensor at world size 2, 6 steps: that it runs (CI)

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pathlib
import platform
import statistics
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = {  # world size -> layouts measured there
    2: {"data": [], "tensor": ["parallel.strategy=tensor"], "fsdp": ["parallel.strategy=fsdp"]},
    4: {"data": [], "tensor": ["parallel.strategy=tensor"],
        "hybrid": ["parallel.strategy=hybrid", "parallel.tp_size=2"], "fsdp": ["parallel.strategy=fsdp"],
        "hsdp": ["parallel.strategy=hsdp", "parallel.shard_size=2"],
        "hybridsh": ["parallel.strategy=hybrid", "parallel.tp_size=2", "parallel.dp_shard=true"]},
}
MODELS = {"mlp": ROOT / "examples/mlp.yaml", "gpt": ROOT / "examples/gpt.yaml"}


def run_once(model: str, world: int, layout: list[str], steps: int, tmp: pathlib.Path) -> dict:
    from gearshift.orchestrator.commands import cli

    run_dir = tmp / f"{model}-{world}-{len(list(tmp.iterdir()))}"
    args = ["run", str(MODELS[model]), "--run-dir", str(run_dir), "--set", f"train.steps={steps}",
            "--set", f"cluster.num_workers={world}", "--set", "checkpoint.every=0",
            "--set", "train.global_batch_size=64"] + [a for o in layout for a in ("--set", o)]
    with contextlib.redirect_stderr(io.StringIO()) as err:
        code = cli.main(args)
    if code != 0:
        raise SystemExit(f"{model} x{world} {layout} failed:\n{err.getvalue()}")
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat and fewer steps")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="the MLP under data and tensor at world size 2 only, 6 "
                    "steps each, 1 repeat: that the bench runs")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.quick or args.smoke else 3)
    steps = {"mlp": 30 if args.quick else 80, "gpt": 20 if args.quick else 50}
    models, layouts = MODELS, LAYOUTS
    if args.smoke:
        at_two = {k: v for k, v in LAYOUTS[2].items() if k in ("data", "tensor")}
        steps, models, layouts = {"mlp": 6}, {"mlp": MODELS["mlp"]}, {2: at_two}

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    samples: dict[tuple, list[dict]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for rep in range(repeats):
                for model in models:
                    for world, at_world in layouts.items():
                        names = list(at_world) if rep % 2 == 0 else list(at_world)[::-1]  # alternate the order
                        for name in names:
                            summary = run_once(model, world, at_world[name], steps[model], pathlib.Path(tmp))
                            samples.setdefault((model, world, name), []).append(summary)
    finally:
        ray.shutdown()

    figures, rows = {}, []
    for (model, world, name), runs in samples.items():
        step_s = statistics.median(r["median_step_time_s"] for r in runs)
        rate = statistics.median(r["samples_per_s"] for r in runs)
        figures[f"{model}_ws{world}_{name}"] = {"step_time_s": step_s, "samples_per_s": rate}
    for key, fig in figures.items():
        model, ws, name = key.split("_")
        base = figures[f"{model}_{ws}_data"]["samples_per_s"]
        fig["ratio_samples_per_s_vs_data"] = fig["samples_per_s"] / base
        rows.append((model, ws[2:], name, fig["step_time_s"] * 1000, fig["samples_per_s"],
                     fig["ratio_samples_per_s_vs_data"]))

    print(f"gearshift strategies, {platform.machine()} {os.cpu_count()} CPUs, gloo on CPU, global batch 64, "
          f"medians of {repeats} repeat(s)")
    print(f"{'model':6} {'world':>5} {'strategy':9} {'step ms':>9} {'samples/s':>10} {'vs data':>8}")
    for model, ws, name, ms, rate, ratio in rows:
        print(f"{model:6} {ws:>5} {name:9} {ms:9.1f} {rate:10.0f} {ratio:8.2f}")
    print(json.dumps({"repeats": repeats, "quick": args.quick, "figures": figures}))


if __name__ == "__main__":
    main()
