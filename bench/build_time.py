"""How long a worker's first build takes, and what it holds, by how the initial values are made.

Four plain gloo processes (bench/local_group.py, no Ray; 2 cores, so each worker has half a
core and one thread) build the built-in GPT under fsdp(4) at three sizes (n_embd 1024, vocab
16384, block_size 64; n_layer 12, 24 and 48: about 170M, 320M and 620M parameters), each
three ways, interleaved and repeated (the machine drifts):

- `exact`: the record replayed whole on every rank (a plain build's values; workers/build/meta_init.py);
- `per_shard`: each rank makes only the blocks of rows it holds (workers/build/shard_init.py);
- `pretrained`: model.pretrained over every tensor (a safetensors file written here from a plain
  build): nothing is drawn, each rank reads its slices (`load_pretrained`), timed apart.

Per variant: the seconds of the build (the constructor recorded on fake tensors, laid out on
meta, the pieces allocated and filled), of which the fill, and the load for pretrained; the
random numbers each rank drew; each rank's resident-set growth over the build (bench/memory.py's
sampler, VmHWM backed). Medians over ranks and repeats, with min and max.

Measured (2-core CPU machine, no GPU; 2 repeats, medians over 8 rank-builds, min-max):

    size (params)   exact build         per_shard build    pretrained build + load   growth exact / per_shard / pretrained
    1x (185M)       4.9 s (4.2-5.0)     1.3 s (1.2-1.5)    0.5 s + 0.5 s              258 / 176 / 447 MiB
    2x (336M)       9.2 s (9.0-9.3)     2.9 s (2.7-3.0)    1.1 s + 0.7 s              402 / 321 / 833 MiB
    4x (638M)      18.1 s (17.3-19.1)   6.2 s (5.5-6.4)    2.3 s + 1.4 s              692 / 609 / 1620 MiB

per_shard drew 46M, 84M and 159M random numbers per rank (a quarter of the model). The pretrained
load's growth is its peak while reading: after it a rank holds its quarter (anonymous 178 MiB at
1x, file-backed pages 1-2 MiB), the transient above that is the load's own.

    python bench/build_time.py            # 3 sizes, 2 repeats (about 8 min on 2 cores)
    python bench/build_time.py --quick    # the 170M GPT only, 1 repeat
    python bench/build_time.py --smoke    # 2 layers at width 64 (0.1M parameters), 1 repeat: that it runs (CI)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WORKERS = 4
SIZES = {"1x": 12, "2x": 24, "4x": 48}  # n_layer
VARIANTS = ("exact", "per_shard", "pretrained")


def _spec(n_layer: int, smoke: bool = False) -> dict:
    kwargs = {"vocab_size": 16384, "block_size": 64, "n_layer": n_layer, "n_head": 16, "n_embd": 1024}
    if smoke:  # width 64 and a vocabulary of 256: every step of the bench, in seconds
        kwargs.update(vocab_size=256, n_head=2, n_embd=64)
    return {"name": "gpt", "kwargs": kwargs}


def timed_build(worker, spec: dict, layout: dict) -> dict:
    """This rank's first build of `spec` under `layout` (and its pretrained load, where the spec
    has one), timed, with its resident-set growth."""
    import gc

    from bench import memory
    from gearshift.strategies.layout import Layout

    worker.parallel = worker.optimizer = worker.scaler = None  # the last build's model, freed
    gc.collect()
    baseline = memory.mem_start(worker, 0.001)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    before = {"file": int(status["RssFile"].split()[0]) * 1024, "anon": int(status["RssAnon"].split()[0]) * 1024}
    sampler = memory._SAMPLER
    worker.config = dataclasses.replace(worker.config, model=spec)
    worker.builder.info = {"on_meta": False}
    phase = f"build-{time.perf_counter()}"  # a phase's peak is kept per name: a name per build
    sampler.enter(phase)
    started = time.perf_counter()
    worker.builder.lay_out(Layout.from_dict(layout))
    built = time.perf_counter() - started
    loaded = worker.load_pretrained() if spec.get("pretrained") else {}
    total = time.perf_counter() - started
    sampler.enter(None)
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return {"rss_file_after": int(status["RssFile"].split()[0]) * 1024 - before["file"],
            "rss_anon_after": int(status["RssAnon"].split()[0]) * 1024 - before["anon"],"build_s": built, "fill_s": worker.builder.info.get("fill_s"), "load_s": loaded.get("seconds"),
            "total_s": total, "drawn": worker.builder.info.get("drawn"), "init": worker.builder.info.get("init"),
            "growth": sampler.peak(phase) - baseline}


def _pretrained_folder(spec: dict, where: pathlib.Path) -> str:
    import safetensors.torch
    import torch

    from gearshift.workers.build import components

    torch.manual_seed(0)
    model, _ = components.build_model_and_plan(spec)
    where.mkdir(parents=True, exist_ok=True)
    safetensors.torch.save_model(model, str(where / "model.safetensors"))
    return str(where)


def _median(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--sizes", default=None, help="comma-separated, of " + ", ".join(SIZES))
    parser.add_argument("--smoke", action="store_true", help="a GPT of 2 layers at width 64, 1 repeat: that the "
                        "bench runs")
    args = parser.parse_args()
    sizes = {k: SIZES[k] for k in (args.sizes.split(",") if args.sizes else ["1x"] if args.quick else SIZES)}
    if args.smoke:
        sizes = {"smoke": 2}
    repeats = args.repeats or (1 if args.quick or args.smoke else 2)
    from bench.local_group import LocalGroup
    from bench.memory import MALLOC_ENV, make_job

    os.environ.update(MALLOC_ENV)  # freed blocks leave the resident set (bench/memory.py); inherited by the workers
    from gearshift.strategies.layout import Layout

    layout = Layout.for_workers("fsdp", WORKERS, None, None, False).to_dict()
    job = make_job(WORKERS, "fsdp")
    job["model"] = {"name": "gpt", "kwargs": {"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2,
                                              "n_embd": 16}}
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp, LocalGroup(job, WORKERS, [str(ROOT)], cpus=0.5,
                                                          timeout_s=1800.0, start="spawn") as group:  # RSS measured
        for size, n_layer in sizes.items():
            folder = _pretrained_folder(_spec(n_layer, args.smoke), pathlib.Path(tmp) / size)
            runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
            for r in range(repeats):
                for variant in VARIANTS:  # interleaved
                    spec = {**_spec(n_layer, args.smoke), "init": "exact" if variant == "exact" else "per_shard"}
                    if variant == "pretrained":
                        spec["pretrained"] = {"path": folder, "prefix": "", "hash": "header"}
                    ranks = group.apply(timed_build, spec, layout)
                    runs[variant].extend(ranks)
                    print(f"{size} {variant:10s} repeat {r}: build " + " ".join(f"{g['build_s']:.1f}" for g in ranks)
                          + " s per rank (fill " + " ".join(f"{g['fill_s'] or 0:.1f}" for g in ranks) + ")"
                          + (", load " + " ".join(f"{g['load_s']:.1f}" for g in ranks) if variant == "pretrained"
                             else "")
                          + f"; drawn per rank {[g['drawn'] for g in ranks]}; growth per rank (MiB) "
                          + " ".join(f"{g['growth'] / 2**20:.0f}" for g in ranks) + "; after it, anonymous "
                          + " ".join(f"{g['rss_anon_after'] / 2**20:.0f}" for g in ranks) + ", file-backed "
                          + " ".join(f"{g['rss_file_after'] / 2**20:.0f}" for g in ranks), flush=True)
            figures[size] = {"n_layer": n_layer, **{
                v: {"build_s": _median([g["build_s"] for g in got]), "total_s": _median([g["total_s"] for g in got]),
                    "fill_s": _median([g["fill_s"] or 0.0 for g in got]),
                    "drawn_per_rank": _median([g["drawn"] or 0 for g in got]),
                    "growth_mib": _median([g["growth"] / 2**20 for g in got]),
                    "file_backed_after_mib": _median([g["rss_file_after"] / 2**20 for g in got])}
                for v, got in runs.items()}}
    print(json.dumps({"workers": WORKERS, "repeats": repeats, "sizes": figures}))


if __name__ == "__main__":
    main()
