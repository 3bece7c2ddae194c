"""What the training loop's features cost or save, each measured side by side in one run.

Plain gloo processes (bench/local_group.py, no Ray), two workers, three comparisons:

1. compile vs eager: the built-in GPT under the data layout (and the tensor layout) with
   `train.compile` on and off, in alternating blocks in the same processes (the model is built
   afresh, and compiled afresh, for every block). The first steps of a block (which include the
   compilation) are left out of the rate; the compile time is reported on its own: the warm-up
   steps' time over what the same number of steady steps take. Each run gets an empty inductor
   cache (TORCHINDUCTOR_CACHE_DIR, unless set), so the first compile is cold, as a job's first
   compile on a fresh machine; later ones reuse torch's in-process and on-disk caches, as a
   switch's recompile does: both are shown.
2. loader processes 0 vs 2: an input-bound job (bench/slow_data.py: every sample waits 2 ms)
   with `data.loader.workers` 0 and 2, alternating; the data-time share of the step
   (data_times / step_times, from the step reports) and samples/s; here samples/s is steps over
   their summed time, not 1 / the median step time: loader processes hand batches over in
   bunches, so step times are bimodal (a wait, then ready batches) and their median says little.
3. gradient accumulation 1 vs 4 at the same global batch (`train.micro_batch_size` null vs
   global / (4 x dp)): samples/s in alternating blocks of one group, and peak memory. On CPU the
   peak is the process's peak resident set, which only grows, so for memory every variant runs in
   its own fresh group of processes, in the order A B B A ...; the growth of the peak during
   training (over the peak after the build) is shown too.

Rates are global samples / the median step time (slowest rank per step; the loader comparison
says otherwise below); ratios are taken per
pair of neighbouring blocks (or groups), then the median over pairs, with their min-max spread.

    python bench/loop.py            # 4 pairs per comparison, data and tensor compile
    python bench/loop.py --quick    # 1 compile pair (data layout only), 2 pairs of short blocks
                                    # otherwise (about 2.5 min on 2 cores)
    python bench/loop.py --smoke    # the loader and accumulation comparisons, 1 pair of 5-step blocks
                                    # each: that it runs (CI; the first, cold compile alone takes 20-80 s)

The last line of output is one JSON object with every figure; a comparison that failed has null
figures and a `*_error` key with the error's first line.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import shutil
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
sys.path.insert(0, str(ROOT))

WORKERS = 2
GPT = {"name": "gpt", "kwargs": {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 64}}


def make_job(raw: dict, base_dir: pathlib.Path) -> dict:
    from gearshift.orchestrator.job import job_from_dict

    raw = {**raw, "cluster": {"num_workers": WORKERS}, "telemetry": {"ray_metrics": False, **raw.get("telemetry", {})}}
    return job_from_dict(raw, base_dir=str(base_dir)).to_dict()


def rebuild(worker, changes: dict) -> None:
    """Runs in each worker process: change the worker's config and build the model afresh."""
    import dataclasses

    worker.config = dataclasses.replace(worker.config, **changes)
    if worker.telemetry is not None:
        worker.telemetry.stop()
        worker.telemetry = None
    worker.build()


def max_rss(worker) -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def block(group, steps: int, warm: int, batch: int) -> dict:
    """Train `steps` steps from a fresh build; the figures of the steps after the first `warm`."""
    reports = group.call("train", steps, 0, 1000.0)
    step_t = [[t for r in rr for t in r["step_times"]] for rr in reports]
    data_t = [[t for r in rr for t in r.get("data_times", [])] for rr in reports]
    slowest = [max(ts) for ts in zip(*step_t)]
    step_s = statistics.median(slowest[warm:])
    shares = [sum(d[warm:]) / sum(s[warm:]) for d, s in zip(data_t, step_t) if d]
    return {"samples_per_s": batch / step_s, "step_s": step_s, "first_step_s": slowest[0],
            # steps over their summed time: the rate for bursty steps (loader processes hand over
            # batches in bunches, so step times are bimodal and their median says little)
            "samples_per_s_mean": batch * len(slowest[warm:]) / sum(slowest[warm:]),
            "warmup_excess_s": sum(slowest[:warm]) - warm * step_s,
            "data_share": statistics.median(shares) if shares else None,
            # each report's peak is its own window's (monitoring/host_memory.py): the block's is their highest
            "peak_mem_bytes": max(r.get("peak_mem_bytes") or 0 for rr in reports for r in rr)}


def spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    # LocalGroup's errors start "rank r: Type: message" then the traceback
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


# ------------------------------------------------------------------ 1. compile vs eager

def compare_compile(layout: str, pairs: int, steps: int, warm: int, batch: int) -> dict:
    from bench.local_group import LocalGroup

    raw = {"model": GPT, "data": "chars", "parallel": {"strategy": layout},
           "train": {"steps": 100000, "global_batch_size": batch}}
    eager_job = make_job(raw, ROOT)
    compiled = make_job({**raw, "train": {**raw["train"], "compile": True}}, ROOT)["train"]["compile"]
    out: dict = {"layout": layout}
    with LocalGroup(eager_job, WORKERS, [str(ROOT)], cpus=0.5, timeout_s=300.0) as group:
        block(group, max(warm + 2, 6), warm, batch)  # warm-up: first-call imports, allocator
        eager, comp, ratios, compile_s = [], [], [], []
        try:
            for i in range(pairs):
                order = (True, False) if i % 2 == 0 else (False, True)
                got = {}
                for on in order:
                    group.apply(rebuild, {"compile": compiled if on else None})
                    got[on] = block(group, steps, warm, batch)
                eager.append(got[False])
                comp.append(got[True])
                ratios.append(got[True]["samples_per_s"] / got[False]["samples_per_s"])
                compile_s.append(got[True]["warmup_excess_s"] - got[False]["warmup_excess_s"])
        except Exception as err:  # a compile that fails here is reported, not hidden
            out["error"] = first_line(err)
            print(f"compile under {layout} FAILED: {out['error']}", flush=True)
            return out
    out.update({"samples_per_s_eager": statistics.median(b["samples_per_s"] for b in eager),
                "samples_per_s_eager_spread": spread([b["samples_per_s"] for b in eager]),
                "samples_per_s_compiled": statistics.median(b["samples_per_s"] for b in comp),
                "samples_per_s_compiled_spread": spread([b["samples_per_s"] for b in comp]),
                "compiled_over_eager": statistics.median(ratios), "compiled_over_eager_spread": spread(ratios),
                "compile_s_first": compile_s[0],
                "compile_s_later": statistics.median(compile_s[1:]) if len(compile_s) > 1 else None,
                "first_step_s_compiled": [b["first_step_s"] for b in comp]})
    return out


# ------------------------------------------------------------------ 2. loader processes

def compare_loader(pairs: int, steps: int, warm: int, batch: int, delay_ms: float) -> dict:
    from bench.local_group import LocalGroup

    def data(workers: int) -> dict:
        return {"entrypoint": "slow_data:slow_vectors", "kwargs": {"delay_ms": delay_ms},
                "loader": {"workers": workers, "prefetch": 2}}

    raw = {"model": {"name": "mlp", "kwargs": {"in_features": 64, "hidden": 64}}, "parallel": {"strategy": "data"},
           "train": {"steps": 100000, "global_batch_size": batch}}
    jobs = {w: make_job({**raw, "data": data(w)}, BENCH) for w in (0, 2)}
    out: dict = {"delay_ms_per_sample": delay_ms}
    try:
        with LocalGroup(jobs[0], WORKERS, [str(BENCH)], cpus=0.5, daemon=False) as group:  # loader processes
            block(group, warm + 3, warm, batch)
            got_all: dict[int, list] = {0: [], 2: []}
            ratios = []
            for i in range(pairs):
                got = {}
                for w in ((2, 0) if i % 2 == 0 else (0, 2)):
                    group.apply(rebuild, {"data": jobs[w]["data"], "loader": jobs[w]["data"]["loader"]})
                    got[w] = block(group, steps, warm, batch)
                    got_all[w].append(got[w])
                ratios.append(got[2]["samples_per_s_mean"] / got[0]["samples_per_s_mean"])
    except Exception as err:
        out["error"] = first_line(err)
        print(f"loader comparison FAILED: {out['error']}", flush=True)
        return out
    for w in (0, 2):
        out[f"samples_per_s_loader{w}"] = statistics.median(b["samples_per_s_mean"] for b in got_all[w])
        out[f"samples_per_s_loader{w}_spread"] = spread([b["samples_per_s_mean"] for b in got_all[w]])
        out[f"data_share_loader{w}"] = statistics.median(b["data_share"] for b in got_all[w])
        out[f"data_share_loader{w}_spread"] = spread([b["data_share"] for b in got_all[w]])
    out["loader2_over_loader0"] = statistics.median(ratios)
    out["loader2_over_loader0_spread"] = spread(ratios)
    return out


# ------------------------------------------------------------------ 3. gradient accumulation

def compare_accumulation(pairs: int, steps: int, warm: int, batch: int, mem_repeats: int, mem_steps: int) -> dict:
    """samples/s in alternating blocks of one group (as the other comparisons: drift of the shared
    machine weighs on both alike); peak memory in a fresh group per variant (peak RSS only grows)."""
    from bench.local_group import LocalGroup

    micro = batch // (4 * WORKERS)
    raw = {"model": GPT, "data": "chars", "parallel": {"strategy": "data"}}
    jobs = {n: make_job({**raw, "train": {"steps": 100000, "global_batch_size": batch,
                                          "micro_batch_size": None if n == 1 else micro}}, ROOT) for n in (1, 4)}
    rates: dict[int, list] = {1: [], 4: []}
    mems: dict[int, list] = {1: [], 4: []}
    ratios = []
    out: dict = {"global_batch_size": batch, "micro_batch_size_accum4": micro}
    try:
        with LocalGroup(jobs[1], WORKERS, [str(ROOT)], cpus=0.5) as group:
            block(group, warm + 3, warm, batch)
            for i in range(pairs):
                got = {}
                for n in ((4, 1) if i % 2 == 0 else (1, 4)):
                    group.apply(rebuild, {"micro_batch_size": jobs[n]["train"]["micro_batch_size"]})
                    got[n] = block(group, steps, warm, batch)["samples_per_s"]
                    rates[n].append(got[n])
                ratios.append(got[4] / got[1])
        for i in range(mem_repeats):
            for n in ((1, 4) if i % 2 == 0 else (4, 1)):
                # fresh processes, spawned: their peak resident set is measured
                with LocalGroup(jobs[n], WORKERS, [str(ROOT)], cpus=0.5, start="spawn") as group:
                    base = max(group.apply(max_rss))
                    b = block(group, mem_steps, 1, batch)
                    mems[n].append((b["peak_mem_bytes"], b["peak_mem_bytes"] - base))
    except Exception as err:
        out["error"] = first_line(err)
        print(f"accumulation comparison FAILED: {out['error']}", flush=True)
        return out
    for n in (1, 4):
        out[f"samples_per_s_accum{n}"] = statistics.median(rates[n])
        out[f"samples_per_s_accum{n}_spread"] = spread(rates[n])
        for j, key in enumerate(("peak_mem_bytes", "peak_growth_bytes")):
            vals = [m[j] for m in mems[n]]
            out[f"{key}_accum{n}"] = statistics.median(vals)
            out[f"{key}_accum{n}_spread"] = spread(vals)
    out["accum4_over_accum1_samples_per_s"] = statistics.median(ratios)
    out["accum4_over_accum1_samples_per_s_spread"] = spread(ratios)
    for j, name in enumerate(("peak_mem", "peak_mem_growth")):
        r = [m4[j] / m1[j] for m1, m4 in zip(mems[1], mems[4]) if m1[j] > 0]
        out[f"accum4_over_accum1_{name}"] = statistics.median(r) if r else None
        out[f"accum4_over_accum1_{name}_spread"] = spread(r) if r else None
    return out


# steps a block, per mode: compile, loader, accumulation, accumulation's memory blocks
STEPS = {"full": (30, 30, 30, 10), "quick": (12, 15, 12, 6), "smoke": (5, 5, 5, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one compile pair (data layout only), fewer steps")
    ap.add_argument("--smoke", action="store_true", help="the loader and accumulation comparisons (not compile, "
                    "whose cold compile takes 20-80 s), one pair of 5-step blocks each: that the bench runs")
    ap.add_argument("--pairs", type=int, default=None, help="pairs (or repeats) per comparison")
    ap.add_argument("--only", action="append", choices=["compile", "loader", "accum"])
    args = ap.parse_args()
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    pairs = args.pairs or (4 if mode == "full" else 1)
    only = set(args.only or (["loader", "accum"] if args.smoke else ["compile", "loader", "accum"]))
    t0 = time.perf_counter()
    own_cache = "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the worker processes inherit it
    if own_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="gearshift-bench-loop-inductor-")
    try:
        run(mode, pairs, only, t0)
    finally:
        if own_cache:
            shutil.rmtree(os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def run(mode: str, pairs: int, only: set, t0: float) -> None:
    q = mode != "full"
    loader_pairs = accum_pairs = {"full": pairs, "quick": 2, "smoke": 1}[mode]
    mem_repeats = 1 if q else 2
    compile_steps, loader_steps, accum_steps, mem_steps = STEPS[mode]
    print(f"training-loop features side by side, {WORKERS} gloo workers{f' (--{mode})' if q else ''}, on "
          f"{platform.machine()} with {os.cpu_count()} cores; block pairs: compile {pairs}, loader {loader_pairs}, "
          f"accumulation {accum_pairs} (+ {mem_repeats} fresh group(s) per variant for memory)", flush=True)
    result: dict = {"bench": "loop", "quick": q, "mode": mode, "pairs_compile": pairs, "pairs_loader": loader_pairs,
                    "pairs_accum": accum_pairs, "memory_groups_per_variant": mem_repeats,
                    "machine": platform.machine(), "cpus": os.cpu_count()}
    if "compile" in only:
        show_compile(result, ["data"] if q else ["data", "tensor"], pairs, compile_steps)
    if "loader" in only:
        show_loader(result, loader_pairs, loader_steps)
    if "accum" in only:
        show_accumulation(result, accum_pairs, accum_steps, mem_repeats, mem_steps)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"\ntook {result['seconds']:.0f} s")
    print(json.dumps(result))


def show_compile(result: dict, layouts: list[str], pairs: int, steps: int) -> None:
    print("\n1. torch.compile vs eager, GPT 2x128 block 64, global batch 16 (rates leave out 3 warm-up steps)")
    print(f"{'layout':<8}{'eager smp/s':>13}{'compiled smp/s':>16}{'comp/eager':>12}{'range':>15}"
          f"{'compile s (1st)':>17}{'later':>8}", flush=True)
    for layout in layouts:
        r = compare_compile(layout, pairs, steps, 3, 16)
        result[f"compile_{layout}"] = r
        result[f"compile_over_eager_{layout}"] = r.get("compiled_over_eager")
        if "error" in r:
            result[f"compile_over_eager_{layout}_error"] = r["error"]
            continue
        later = r["compile_s_later"]
        print(f"{layout:<8}{r['samples_per_s_eager']:>13.1f}{r['samples_per_s_compiled']:>16.1f}"
              f"{r['compiled_over_eager']:>12.3f}{r['compiled_over_eager_spread'][0]:>8.3f}-"
              f"{r['compiled_over_eager_spread'][1]:.3f}{r['compile_s_first']:>17.1f}"
              f"{'-' if later is None else f'{later:.1f}':>8}", flush=True)


def show_loader(result: dict, pairs: int, steps: int) -> None:
    print("\n2. loader processes 0 vs 2, input-bound MLP job (2 ms per sample, global batch 32; samples/s from "
          "summed step times, data share = data_times / step_times)")
    r = compare_loader(pairs, steps, 3, 32, 2.0)
    result["loader"] = r
    for key in ("loader2_over_loader0", "data_share_loader0", "data_share_loader2"):
        result[key] = r.get(key)
    if "error" in r:
        result["loader2_over_loader0_error"] = r["error"]
        return
    print(f"{'loader':<8}{'samples/s':>11}{'range':>17}{'data share':>12}{'range':>15}")
    for w in (0, 2):
        s, d = r[f"samples_per_s_loader{w}_spread"], r[f"data_share_loader{w}_spread"]
        print(f"{w:<8}{r[f'samples_per_s_loader{w}']:>11.1f}{s[0]:>9.1f}-{s[1]:<7.1f}"
              f"{r[f'data_share_loader{w}']:>12.3f}{d[0]:>8.3f}-{d[1]:.3f}")
    sp = r["loader2_over_loader0_spread"]
    print(f"loader2/loader0 samples/s = {r['loader2_over_loader0']:.2f} ({sp[0]:.2f}-{sp[1]:.2f})", flush=True)


def show_accumulation(result: dict, pairs: int, steps: int, mem_repeats: int, mem_steps: int) -> None:
    print("\n3. gradient accumulation 1 vs 4 micro-batches, GPT data layout, global batch 64: samples/s in "
          "alternating blocks of one group; peak memory from each variant in its own fresh processes (on CPU "
          "the peak is the process's peak RSS, which only grows; 'growth' is the rise over the peak after "
          "the build)")
    r = compare_accumulation(pairs, steps, 3, 64, mem_repeats, mem_steps)
    result["accum"] = r
    for key in ("accum4_over_accum1_samples_per_s", "accum4_over_accum1_peak_mem",
                "accum4_over_accum1_peak_mem_growth"):
        result[key] = r.get(key)
    if "error" in r:
        result["accum4_over_accum1_error"] = r["error"]
        return
    mib = 2**20
    print(f"{'accum':<7}{'samples/s':>11}{'range':>17}{'peak RSS MiB':>14}{'growth in training MiB':>24}")
    for n in (1, 4):
        s = r[f"samples_per_s_accum{n}_spread"]
        print(f"{n:<7}{r[f'samples_per_s_accum{n}']:>11.1f}{s[0]:>9.1f}-{s[1]:<7.1f}"
              f"{r[f'peak_mem_bytes_accum{n}'] / mib:>14.1f}{r[f'peak_growth_bytes_accum{n}'] / mib:>24.1f}")
    g = r["accum4_over_accum1_peak_mem_growth"]
    print(f"accum4/accum1: samples/s {r['accum4_over_accum1_samples_per_s']:.3f}, peak RSS "
          f"{r['accum4_over_accum1_peak_mem']:.3f}, peak growth {'n/a' if g is None else f'{g:.3f}'}",
          flush=True)


if __name__ == "__main__":
    main()
