"""Peak memory per process under a pipeline, and of a switch into and out of one.

Four runs of a GPT of 8 layers (width 512: 25 M parameters, Adam) on 2 CPU workers: static data
(each worker holds the whole model and its optimizer), static pipeline (2 stages: each holds
half), the same interleaved (4 stages, 2 a worker: each still holds half), and data switched
into the pipeline at step 10 and back at step 20 (adapt.schedule); then on 4 workers (2 replicas of
each stage) the pipeline with whole state, with each stage's blocks sharded over its replicas
(parallel.dp_shard), and data switched into that sharded pipeline and back; then the 4 workers
as one replica of 2 stages whose blocks are split over 2 workers each (parallel.tp_size), and
data switched into that and back. Per
run: the driver's and the largest worker's peak resident set (bench.ingest.Watcher polls every
process of the run), and from the step records each worker's own high-water mark (`peak_mem_bytes`,
the process's peak since its previous report) just before each switch and just after it, so that
what a switch adds beyond the layouts' own shows as the rise across it.

    python bench/pipeline_memory.py            # ~9 minutes
    python bench/pipeline_memory.py --smoke    # data switched into the pipeline and back, a 0.1M-parameter
                                               # GPT: that it runs (CI)

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.overhead import timed  # noqa: E402

MiB = 2**20
MODEL = "model.kwargs={vocab_size: 128, block_size: 64, n_layer: 8, n_head: 8, n_embd: 512}"
SMOKE_MODEL = "model.kwargs={vocab_size: 128, block_size: 16, n_layer: 2, n_head: 2, n_embd: 64}"
SMOKE_RUNS = ["data>pipeline>data"]  # data, the pipeline and both switches in one run
BASE = ["train.steps=30", "train.global_batch_size=8", "checkpoint.every=0", "cluster.num_workers=2",
        "optimizer.name=adam", "optimizer.weight_decay=0.0", MODEL]
RUNS = {
    "data": ["parallel.strategy=data"],
    "pipeline": ["parallel.strategy=pipeline", "parallel.pp_size=2"],
    "interleaved": ["parallel.strategy=pipeline", "parallel.pp_size=2", "parallel.pp_schedule=interleaved_1f1b"],
    "data>pipeline>data": ["parallel.strategy=data", "adapt.schedule=[{step: 10, strategy: pipeline, pp_size: 2}, "
                           "{step: 20, strategy: data}]"],
    # 4 workers, 2 replicas of each stage: whole state, then each stage's blocks sharded over its replicas
    "pipeline 2x2": ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=pipeline", "parallel.pp_size=2"],
    "pipeline 2x2 dp_shard": ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=pipeline", "parallel.pp_size=2",
                              "parallel.dp_shard=true"],
    "data>pipeline 2x2 dp_shard>data": ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=data",
                                        "adapt.schedule=[{step: 10, strategy: pipeline, pp_size: 2, dp_shard: true}, "
                                        "{step: 20, strategy: data}]"],
    # 4 workers as 2 stages of one replica, each stage's blocks split over 2 workers (pp x tp)
    "pipeline 2 x tp2": ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=pipeline",
                         "parallel.pp_size=2", "parallel.tp_size=2"],
    "data>pipeline 2 x tp2>data": ["cluster.num_workers=4", "cluster.cpus_per_worker=0.5", "parallel.strategy=data",
                                   "adapt.schedule=[{step: 10, strategy: pipeline, pp_size: 2, tp_size: 2}, "
                                   "{step: 20, strategy: data}]"],
}


def one(name: str, overrides: list[str], tmp: pathlib.Path, smoke: bool = False) -> dict:
    run_dir = tmp / name.replace(">", "-")
    cmd = [sys.executable, "-m", "gearshift", "run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(run_dir)]
    for item in BASE + ([SMOKE_MODEL] if smoke else []) + overrides:
        cmd += ["--set", item]
    peaks: dict = {}
    timed(cmd, peaks=peaks)
    steps = {r["step"]: r for r in map(json.loads, (run_dir / "telemetry.jsonl").read_text().splitlines())
             if r["type"] == "step"}
    marks = {s: steps[s]["peak_mem_bytes"] / MiB for s in (9, 11, 19, 21, 30) if s in steps}
    return {"driver_peak_mib": peaks["driver"] / MiB, "worker_peak_mib": peaks["worker"] / MiB,
            "worker_high_water_mib_at_step": marks}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None, help="comma-separated names of RUNS to run (default: all)")
    ap.add_argument("--smoke", action="store_true", help=f"only {', '.join(SMOKE_RUNS)}, of a GPT of 0.1M "
                    "parameters: that the bench runs")
    args = ap.parse_args()
    names = args.only.split(",") if args.only else SMOKE_RUNS if args.smoke else list(RUNS)
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise SystemExit(f"--only: unknown run(s) {unknown}; the runs are {list(RUNS)}")
    out = {}
    with tempfile.TemporaryDirectory(prefix="gs-ppmem-") as tmp:
        for name, overrides in ((n, RUNS[n]) for n in names):
            out[name] = one(name, overrides, pathlib.Path(tmp), args.smoke)
            r = out[name]
            print(f"{name:<20} driver {r['driver_peak_mib']:7.0f} MiB   largest worker {r['worker_peak_mib']:7.0f} MiB   "
                  "worker high-water at step " + ", ".join(f"{s}: {v:.0f}" for s, v in
                                                          r["worker_high_water_mib_at_step"].items()), flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
