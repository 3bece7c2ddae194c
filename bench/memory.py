"""What each layout holds in memory, what a switch costs in memory, and what checkpoints cost in time.

Plain gloo processes (bench/local_group.py, no Ray) train the built-in GPT at about 110M
parameters (n_layer 12, n_embd 768, vocab 16384, block_size 64; Adam, so the optimizer holds
two more copies of the parameters) on 4 workers with a global batch of 4.

State memory is a worker's resident set (RSS) minus its RSS just before the model was built.
Each worker samples its own RSS from /proc/self/statm every ~1 ms in a background thread and
keeps the maximum per named phase (ru_maxrss only grows, so it cannot tell phases apart); the
kernel's own high-water mark (VmHWM, reset at the start of every phase through
/proc/self/clear_refs) backs it up, as the sampler only runs when the scheduler and the GIL let
it: a phase's peak is the larger of the two (`sampler_missed_max_bytes` says by how much the
sampler alone fell short). Freed tensors must leave the RSS for its drops to mean anything, so
the workers run with MALLOC_MMAP_THRESHOLD_=131072 (glibc serves every block above 128 KiB with
its own mmap and returns it on free; without it, freed blocks stay in malloc's heap and later
phases still count them). Every phase starts after a garbage collection: a switch leaves the
old layout in reference cycles that only the collector frees (`switch_gc_leftover_over_steady`:
what a collection right after the switch freed, over the new layout's steady state). On a GPU
the same figures would be torch.cuda.max_memory_allocated per phase; here they also hold page
rounding and whatever else the process touches (gloo's buffers, the data loader).

1. Steady state per layout: the peak of a few training steps (after one warm-up step) in data(4),
   fsdp(4), hsdp(4, shard 2), hybrid(dp2 x tp2) and hybrid dp_shard (dp2 x tp2, shard 2), in a
   cycle of switches that visits every ordered pair of them (--quick: a shorter cycle).
   `fsdp4_over_data4_state` = median over workers and visits of fsdp's steady state over data's.
2. Switch peak: the peak during `worker.reshard` (the switch gearshift does) over the larger of
   the two layouts' steady states (the training phases just before and just after it), per
   worker; `switch_peak_over_steady` is the largest over workers and switches. The same cycle
   is run again with the full-gather switch earlier versions did (every rank gathers the whole
   model and Adam state, drops the old layout, builds the new one and loads its part):
   `switch_peak_over_steady_full_gather`.
3. The cost model's predicted per-rank memory against the measured peak (`memory_worst_rel_error`,
   null while orchestrator/costmodel.py has no memory model).
4. The first build under fsdp(4): a worker's peak growth while it builds (its RSS peak in the
   build minus its RSS before it) over the full fp32 parameter bytes, built on the meta device
   with only the worker's shards allocated (workers/build/meta_init.py) against the whole model built
   on every worker as before (interleaved, `--build-repeats`): `build_growth_over_full_params`
   (the largest over workers; goal <= 0.40) and `build_growth_over_full_params_whole`.
   Right after the first meta build, the same workers load pretrained weights (the export of
   step 7 below, safetensors by slices: `load_growth_over_full_params`) and then resume from the
   run's DCP checkpoint (`resume_growth_over_full_params`), each the largest growth over workers.
4b. The end of a run, as a user runs it: `gearshift run` of the GPT under fsdp(4) for one step
   (its final DCP checkpoint committed and final.pt written by the driver), then `gearshift
   export --max-shard-size 64MB` of that run; each command's process samples its own RSS from
   just before the command (after importing torch, Ray and gearshift, whose size is fixed):
   `driver_growth_over_full_params` (goal <= 0.10) and `export_growth_over_full_params`
   (goal <= 0.30), over the full fp32 parameter bytes.
5. Evaluation's peak growth (RSS peak in the phase minus the RSS after it) with micro-batches of
   2 over whole slices of a 64-sample global batch: `eval_micro_over_full_batch`.
6. Checkpoint save and load seconds at 4 and 2 workers, full format (the ranks gather a tensor
   at a time, rank 0 writes state.pt as it comes, the driver commits it; loading: every worker
   maps the file and takes its part) against DCP (every rank writes its own shards, the driver commits the manifest; loading:
   every rank reads its pieces), each timed as the driver sees it, as orchestrator/checkpoints.py
   does it, the two formats alternating; medians over repeats with their min-max spread.
7. The full format under a pipeline (pp 2 on 2 workers): each rank's peak growth while saving
   over the checkpoint's bytes, streamed a tensor at a time (each position's owner sends rank 0
   one tensor, rank 0 writes it) against the stages' parts pickled to rank 0 at once (before;
   still where rank 0 reaches no place to write), alternating:
   `pipeline_save_growth_rank0_streamed_over_pickled`.

    python bench/memory.py            # every ordered pair, 3 checkpoint repeats per format and size
    python bench/memory.py --quick    # data<->fsdp, fsdp<->hybrid; 2 repeats (about 8 min on 2 cores)
    python bench/memory.py --smoke    # parts 1-3, 5 and 7, data<->fsdp, a 0.1M-parameter GPT: that it runs (CI)

The last line of output is one JSON object with every figure (bytes are bytes, times seconds);
a part that failed has null figures and a `*_error` key with the error's first line.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKERS = 4
GPT = {"name": "gpt", "kwargs": {"vocab_size": 16384, "block_size": 64, "n_layer": 12, "n_head": 12, "n_embd": 768}}
LAYOUTS = {  # for 4 workers
    "data": {"strategy": "data", "dp": 4, "tp": 1},
    "fsdp": {"strategy": "fsdp", "dp": 4, "tp": 1, "shard": 4},
    "hsdp": {"strategy": "hsdp", "dp": 4, "tp": 1, "shard": 2},
    "hybrid": {"strategy": "hybrid", "dp": 2, "tp": 2},
    "hybrid_shard": {"strategy": "hybrid", "dp": 2, "tp": 2, "shard": 2},
}
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


# ------------------------------------------------------------------ in the worker processes

class _Sampler:
    """RSS of this process every `period_s`, the maximum kept per phase (the phase in force when
    sampled; a phase also samples when it starts and when it ends)."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self.page = os.sysconf("SC_PAGE_SIZE")
        self.statm = open("/proc/self/statm", "rb", buffering=0)
        self.lock = threading.Lock()
        self.phase: str | None = None
        self.peaks: dict[str, int] = {}  # sampled
        self.hwm: dict[str, int | None] = {}  # the kernel's
        self.hwm_ok = False
        self.samples = 0
        self.started = time.perf_counter()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self.thread.start()

    def rss(self) -> int:
        with self.lock:
            self.statm.seek(0)
            return int(self.statm.read().split()[1]) * self.page

    def sample(self) -> int:
        rss = self.rss()
        phase = self.phase
        if phase is not None and rss > self.peaks.get(phase, 0):
            self.peaks[phase] = rss
        self.samples += 1
        return rss

    def _run(self) -> None:
        while not self.stopped.wait(self.period_s):
            self.sample()

    def enter(self, phase: str | None) -> int:
        self.sample()  # the phase before ends here
        if self.phase is not None:
            self.hwm[self.phase] = self.high_water()
        self.phase = phase
        if phase is not None:
            self.reset_high_water()
        return self.sample()

    # The kernel's own peak (VmHWM) per phase, exact where the sampler may miss a short peak (it
    # runs when the scheduler and the GIL let it): a window of its own (monitoring/host_memory.py),
    # which the worker's per-report windows do not cut short.
    def reset_high_water(self) -> None:
        from gearshift.monitoring.host_memory import process_peak

        process_peak().take("bench phase")
        self.hwm_ok = process_peak().windowed

    def high_water(self) -> int | None:
        from gearshift.monitoring.host_memory import process_peak

        return process_peak().take("bench phase") if self.hwm_ok else None

    def peak(self, phase: str) -> int:
        return max(self.peaks.get(phase, 0), self.hwm.get(phase) or 0)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join(timeout=5)
        self.statm.close()


_SAMPLER: _Sampler | None = None


def mem_start(worker, period_s: float) -> int:
    """Start this process's sampler; its RSS now (the baseline, before the model is built)."""
    global _SAMPLER
    import gc

    gc.collect()
    # what the process holds before the build (torch and gearshift imported) is never garbage: out
    # of the collector's sight, the collections each phase starts and ends with (and the automatic
    # ones) scan only what the run made since, about 0.1 s of CPU less each here
    gc.freeze()
    if _SAMPLER is None:
        _SAMPLER = _Sampler(period_s)
    return _SAMPLER.enter(None)


def phased(worker, phase: str, method, *args):
    """Run worker.method(*args) (or method(worker, *args)) in `phase`, after collecting garbage;
    (its result, the phase's peak RSS, the RSS after it, the RSS after a garbage collection then).
    A switch leaves the old layout in reference cycles that only the garbage collector frees: the
    last two tell how much (every phase starts collected, so leftovers never count in the next)."""
    import gc

    gc.collect()
    _SAMPLER.enter(phase)
    try:
        result = method(worker, *args) if callable(method) else getattr(worker, method)(*args)
        if method == "train":
            result = list(result)
    finally:
        after = _SAMPLER.enter(None)
    gc.collect()
    return result, _SAMPLER.peak(phase), after, _SAMPLER.rss()


def mem_stats(worker) -> dict:
    """How the sampler did: its rate, and by how much its peaks fell short of the kernel's."""
    missed = [(_SAMPLER.hwm[p] or 0) - _SAMPLER.peaks.get(p, 0) for p in _SAMPLER.hwm]
    return {"samples": _SAMPLER.samples, "rate_hz": _SAMPLER.samples / (time.perf_counter() - _SAMPLER.started),
            "rss": _SAMPLER.rss(), "hwm": _SAMPLER.hwm_ok, "missed_max": max(missed, default=None)}


def full_gather_switch(worker, layout: dict) -> dict:
    """The switch as earlier versions did it: every rank gathers the whole model and optimizer
    state, drops the old layout, builds the new one and loads its part of the full tensors."""
    from gearshift.strategies.layout import Layout

    start = time.perf_counter()
    w = worker
    target = Layout.from_dict(layout)
    state = {**w.parallel.full_state(w.optimizer, w.rank, everywhere=True), "scaler": w.scaler.state_dict(),
             "step": w.step}
    w.parallel.detach()
    w.parallel = w.optimizer = None
    w.builder.lay_out(target)
    w.load(state)
    return {"seconds": time.perf_counter() - start, "layout": target.to_dict(), "step": w.step}


def grown(worker, phase: str, method):
    """(worker.method()'s result, or method(worker)'s, this process's peak growth while it ran)."""
    import gc

    gc.collect()
    before = _SAMPLER.enter(phase)
    try:
        result = method(worker) if callable(method) else getattr(worker, method)()
    finally:
        _SAMPLER.enter(None)
    return result, _SAMPLER.peak(phase) - before


def pickled_state(worker) -> None:
    """The whole state gathered as every pipeline checkpoint of the full format did before it
    streamed (each position's part pickled to rank 0 at once, Parallel.full_state); dropped."""
    worker.parallel.full_state(worker.optimizer, worker.rank)


def no_full_place(worker) -> None:
    """Rank 0 reaches no place to write: the full format's state goes to the driver whole."""
    worker.io.full_place = None


def set_checkpoints(worker, fmt: str, root: str) -> str:
    """Write checkpoints as `fmt` (full or dcp) under `root` from now on (a collective)."""
    from gearshift.workers.state import dcp

    from gearshift.workers.state import full_format

    worker.config = dataclasses.replace(worker.config, checkpoint_dir=root, checkpoint_format=fmt)
    worker.io.dcp_root, _ = dcp.root_for(root, fmt, worker.device)
    worker.io.full_place = full_format.place(root, None, None, False) if worker.io.dcp_root is None and worker.rank == 0 \
        else None
    return "dcp" if worker.io.dcp_root else "full"


# ------------------------------------------------------------------ the driver

def make_job(world: int, strategy: str = "data", extra_parallel: dict | None = None, as_dict: bool = True,
             model: dict | None = None):
    from gearshift.orchestrator.job import job_from_dict

    raw = {"model": model or GPT, "data": "chars", "optimizer": {"name": "adam"},
           "parallel": {"strategy": strategy, **(extra_parallel or {})},
           "train": {"steps": 100000, "global_batch_size": 4},
           "cluster": {"num_workers": world},
           "telemetry": {"enabled": False, "ray_metrics": False},
           "checkpoint": {"format": "full"}}
    job = job_from_dict(raw, base_dir=str(ROOT))
    return job.to_dict() if as_dict else job


def open_group(job: dict, world: int, period_s: float, before_build=None):
    """A LocalGroup whose workers start their RSS sampler before the model is built
    (`before_build(worker)` runs in each worker first, when given)."""
    from bench.local_group import LocalGroup

    class MemGroup(LocalGroup):
        def call(self, method, *args):
            if method == "build" and not args:
                if before_build is not None:
                    LocalGroup.apply(self, before_build)
                self.baselines = LocalGroup.call(self, mem_start, period_s)
                results = LocalGroup.call(self, phased, "build", "build")
                self.build_peaks = [r[1] for r in results]
                return [r[0] for r in results]
            return LocalGroup.call(self, method, *args)

    return MemGroup(job, world, [str(ROOT)], cpus=0.5, timeout_s=900.0, start="spawn")  # RSS measured


def eval_peak(worker, micro_batch):
    """Evaluate 2 global batches of 64 samples from the training data, `micro_batch` samples a
    forward (None: a rank's whole slice at once), in this phase."""
    from gearshift.workers.step.evaluation import held_out_loss

    return held_out_loss(worker.dataset, worker.runner.forward_loss, worker.parallel.module, worker.device, 64,
                         worker.layout, worker.rank, worker.world, 2, micro_batch=micro_batch)


def build_whole(worker) -> None:
    """The first build as it was before the meta device: every worker builds the whole model."""
    worker.builder._shards = lambda layout: False


def build_part(args, log, finish: dict | None = None) -> dict:
    """fsdp(4)'s first build, on the meta device and whole, interleaved; growth per worker. After
    the first meta build, with `finish`'s export and checkpoint: the pretrained load and the
    resume, each phase's growth per worker."""
    job = make_job(WORKERS, "fsdp")
    runs: dict[str, list] = {"meta": [], "whole": []}
    params = None
    loads: dict[str, list] = {}
    for _ in range(args.build_repeats):
        for variant in ("meta", "whole"):
            group = open_group(job, WORKERS, args.period_ms / 1000, before_build=None if variant == "meta"
                               else build_whole)
            try:
                params = group.infos[0]["parameters"]
                built = group.infos[0].get("build", {})
                if built.get("on_meta") is not (variant == "meta"):
                    raise RuntimeError(f"the {variant} build reported {built}")
                growth = [p - b for p, b in zip(group.build_peaks, group.baselines)]
                runs[variant].append(max(growth))
                log(f"build {variant:<6} growth per worker (GiB): {' '.join(gib(g) for g in growth)}")
                if variant == "meta" and finish and not loads:
                    for rank in group.apply(load_phases, finish["_export"], finish.get("_checkpoint")):
                        for phase, (peak, before, after) in rank.items():
                            loads.setdefault(phase, []).append(peak - before)
                            loads.setdefault(phase + "_transient", []).append(peak - after)
                    for phase in ("load", "resume"):
                        if phase in loads:
                            log(f"{phase:<12} growth per worker (GiB): {' '.join(gib(g) for g in loads[phase])}; "
                                f"above what stays: {' '.join(gib(g) for g in loads[phase + '_transient'])}")
            finally:
                group.close()
    full = params * 4
    out = {"build_parameters": params, "build_full_param_bytes": full}
    for phase in ("load", "resume"):
        if loads.get(phase):
            out[f"{phase}_growth_over_full_params"] = max(loads[phase]) / full
            out[f"{phase}_transient_over_full_params"] = max(loads[phase + "_transient"]) / full
    for variant, key in (("meta", "build_growth_over_full_params"), ("whole", "build_growth_over_full_params_whole")):
        out[key] = statistics.median(runs[variant]) / full
        out[key + "_spread"] = [min(runs[variant]) / full, max(runs[variant]) / full]
    return out


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
from bench.memory import _Sampler
import torch, ray, torch.distributed.checkpoint  # imported before the baseline: what they take is fixed
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.control import controller
from gearshift.workers.state import export
sampler = _Sampler({period})
baseline = sampler.enter("phase")
rc = cli.main({argv!r})
sampler.enter(None)
print("@@" + json.dumps({{"rc": rc, "baseline": baseline, "peak": sampler.peak("phase")}}), flush=True)
"""


def sampled_command(argv: list[str], period_s: float, timeout_s: float = 1200.0) -> dict:
    """`gearshift <argv>` in a fresh process that samples its own RSS from just before the command
    (after importing torch, Ray and gearshift): {rc, baseline, peak, growth, seconds}."""
    import subprocess

    env = {**os.environ, **MALLOC_ENV, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT), period=period_s, argv=argv)],
                          capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(ROOT))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("@@")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"gearshift {' '.join(argv[:2])} exited {proc.returncode}: "
                           f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:300]}")
    got = json.loads(lines[-1][2:])
    if got["rc"] != 0:
        raise RuntimeError(f"gearshift {' '.join(argv[:2])} returned {got['rc']}: "
                           f"{(proc.stderr.strip().splitlines() or ['no output'])[-1][:300]}")
    return {**got, "growth": got["peak"] - got["baseline"], "seconds": time.perf_counter() - start}


def finish_part(args, log, tmp: pathlib.Path) -> dict:
    """A real `gearshift run` of the GPT under fsdp(4) to its end (one step, its final DCP
    checkpoint committed, final.pt written), then `gearshift export --max-shard-size 64MB` of it:
    each command's process samples its own RSS. The driver's and the export's peak growth over
    the full fp32 parameter bytes; the export's folder is what the load phase reads."""
    import yaml

    job = make_job(WORKERS, "fsdp")
    job["train"]["steps"] = 1
    job["checkpoint"] = {**job["checkpoint"], "format": "dcp", "every": 0}
    job.pop("adapt", None)
    job["cluster"] = {**job["cluster"], "cpus_per_worker": 0.5}  # 4 workers on a 2-core machine
    job_file = tmp / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    run_dir, out_dir = tmp / "run", tmp / "export"
    driver = sampled_command(["run", str(job_file), "--run-dir", str(run_dir)],
                             args.period_ms / 1000)
    params = json.loads((run_dir / "summary.json").read_text())["parameters"]
    full = params * 4
    log(f"driver of `gearshift run` (fsdp(4), 1 step, final checkpoint and final.pt): peak growth "
        f"{gib(driver['growth'])} GiB over {gib(full)} GiB of fp32 parameters ({driver['seconds']:.0f} s)")
    # the same run of a GPT of 0.1 M parameters: what the driver takes whatever the model (Ray's
    # driver, lazily imported modules), measured the same way
    tiny = {**job, "model": {"name": "gpt", "kwargs": {"vocab_size": 128, "block_size": 64, "n_layer": 2,
                                                       "n_head": 4, "n_embd": 64}}}
    (tmp / "tiny.yaml").write_text(yaml.safe_dump(tiny))
    fixed = sampled_command(["run", str(tmp / "tiny.yaml"), "--run-dir", str(tmp / "tiny-run")], args.period_ms / 1000)
    log(f"driver of the same run of a 0.1M-parameter GPT: peak growth {gib(fixed['growth'])} GiB (the part "
        "that does not grow with the model)")
    exp = sampled_command(["export", str(run_dir), "--output", str(out_dir), "--max-shard-size", "64MB"],
                          args.period_ms / 1000)
    shards = len(list(out_dir.glob("*.safetensors")))
    log(f"gearshift export --max-shard-size 64MB: peak growth {gib(exp['growth'])} GiB, {shards} shards "
        f"({exp['seconds']:.0f} s)")
    return {"finish_parameters": params, "driver_growth_bytes": driver["growth"],
            "driver_growth_over_full_params": driver["growth"] / full, "driver_baseline_rss": driver["baseline"],
            "driver_fixed_growth_bytes": fixed["growth"],
            "driver_model_growth_over_full_params": (driver["growth"] - fixed["growth"]) / full,
            "export_growth_bytes": exp["growth"], "export_growth_over_full_params": exp["growth"] / full,
            "export_shards": shards, "export_seconds": exp["seconds"],
            "_export": str(out_dir), "_checkpoint": str(sorted((run_dir / "checkpoints").glob("step_*"))[-1])}


def load_phases(worker, export_dir: str, checkpoint_dir: str | None):
    """In the worker right after its first build: pretrained weights from `export_dir`, then a
    resume from the DCP checkpoint `checkpoint_dir`; each phase's (peak, RSS before, RSS after:
    a resume creates the Adam state it loads, which stays)."""
    before = _SAMPLER.rss()
    worker.config = dataclasses.replace(worker.config, model={**worker.config.model,
                                                              "pretrained": {"path": export_dir, "prefix": ""}})
    _, peak, after, _ = phased(worker, "load", "load_pretrained")
    out = {"load": (peak, before, after)}
    if checkpoint_dir:
        before = _SAMPLER.rss()
        _, peak, after, _ = phased(worker, "resume", "load", {"dcp": checkpoint_dir, "step": 1})
        out["resume"] = (peak, before, after)
    return out


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def available_layouts() -> list[str]:
    """The layouts this checkout can build: a registered strategy that implements its sharding
    (hybrid's dp_shard needs a hybrid that reads layout.shard)."""
    from gearshift import strategies
    from gearshift.strategies.layout import Layout

    out = []
    for name, d in LAYOUTS.items():
        try:
            strategies.lookup(d["strategy"])
            Layout.from_dict(d)
        except Exception:
            continue
        if name == "hybrid_shard":
            import gearshift.strategies.hybrid as hybrid

            if "layout.shard" not in inspect.getsource(hybrid):
                continue
        out.append(name)
    return out


def streaming_switch() -> bool:
    """Whether TrainWorker.reshard moves state without gathering the whole of it on every rank
    (earlier versions gathered in reshard itself, then in a gathering stand-in of relayout)."""
    from gearshift.strategies import relayout
    from gearshift.workers import worker

    if "everywhere=True" in inspect.getsource(worker.TrainWorker.reshard):
        return False
    fn = getattr(worker, "relayout", None) or getattr(relayout, "relayout", None)  # imported where it is used
    return callable(fn) and "everywhere=True" not in inspect.getsource(fn)


def euler_cycle(names: list[str]) -> list[str]:
    """A closed walk from names[0] through every ordered pair once (a complete digraph has one)."""
    out_edges = {a: [b for b in names if b != a] for a in names}
    stack, walk = [names[0]], []
    while stack:
        v = stack[-1]
        if out_edges[v]:
            stack.append(out_edges[v].pop(0))
        else:
            walk.append(stack.pop())
    return walk[::-1]


def train_phase(group, phase: str, until: int) -> list[int]:
    results = group.apply(phased, phase, "train", until, 0, 1000.0)
    return [r[1] for r in results]


def run_cycle(group, cycle: list[str], switch, warm: int, steps: int, step0: int, label: str, log) -> dict:
    """Train in cycle[0], then switch along the cycle, training warm + steps steps in each
    layout; per visit the steady peaks, per switch the peaks and seconds (lists over ranks)."""
    base = group.baselines
    visits, switches = [], []
    step = step0

    def visit(name: str) -> None:
        nonlocal step
        step += warm
        train_phase(group, f"{label}:warm:{name}:{len(visits)}", step)
        t0 = time.perf_counter()
        step += steps
        peaks = train_phase(group, f"{label}:steady:{name}:{len(visits)}", step)
        state = [p - b for p, b in zip(peaks, base)]
        visits.append({"layout": name, "state": state, "step_s": (time.perf_counter() - t0) / steps})
        log(f"  {label:<12}{'steady ' + name:<26}{gib(statistics.median(state)):>10} GiB (median rank)  "
            f"{visits[-1]['step_s']:.2f} s/step")

    visit(cycle[0])
    for a, b in zip(cycle, cycle[1:]):
        if switch == "reshard":
            results = group.apply(phased, f"{label}:switch:{a}>{b}", "reshard", LAYOUTS[b])
        else:
            results = group.apply(phased, f"{label}:switch:{a}>{b}", full_gather_switch, LAYOUTS[b])
        peak = [r[1] - bb for r, bb in zip(results, base)]
        leftover = [r[2] - r[3] for r in results]  # what only the garbage collector freed after the switch
        seconds = max(r[0]["seconds"] for r in results)
        before = visits[-1]
        visit(b)
        after = visits[-1]
        ratio = [p / max(x, y) for p, x, y in zip(peak, before["state"], after["state"])]
        switches.append({"from": a, "to": b, "peak": peak, "seconds": seconds, "ratio": ratio,
                         "leftover": leftover, "leftover_ratio": [x / y for x, y in zip(leftover, after["state"])]})
        log(f"  {label:<12}{'switch ' + a + '>' + b:<26}{gib(max(peak)):>10} GiB (worst rank)  "
            f"{max(ratio):.2f}x steady  {seconds:.1f} s  left for gc {gib(max(leftover))} GiB")
    return {"visits": visits, "switches": switches, "step": step}


def memory_part(args, log) -> dict:
    names = [n for n in available_layouts() if n in args.layouts]
    if args.quick:
        cycle = [n for n in ["data", "fsdp", "hybrid", "fsdp", "data"] if n in names]
        cycle = [n for i, n in enumerate(cycle) if i == 0 or n != cycle[i - 1]]
    else:
        cycle = euler_cycle(names)
    streaming = streaming_switch()
    out: dict = {"layouts": names, "cycle": cycle, "switch_pairs": [f"{a}>{b}" for a, b in zip(cycle, cycle[1:])],
                 "reshard_streams": streaming}
    group = open_group(make_job(WORKERS), WORKERS, args.period_ms / 1000)
    try:
        params = group.infos[0]["parameters"]
        out["parameters"] = params
        out["baseline_rss"] = group.baselines
        out["build_state"] = [p - b for p, b in zip(group.build_peaks, group.baselines)]
        log(f"GPT with {params:,} parameters ({params * 4 / 2**30:.2f} GiB fp32; with grads and Adam "
            f"{params * 16 / 2**30:.2f} GiB), {WORKERS} workers; baseline RSS {gib(statistics.median(group.baselines))} "
            f"GiB (median rank)")
        log(f"cycle: {' > '.join(cycle)} (reshard {'streams' if streaming else 'gathers everything'})")
        gs = run_cycle(group, cycle, "reshard", args.warm, args.steps, 0, "reshard", log)
        fg = run_cycle(group, cycle, "full_gather", args.warm, args.steps, gs["step"], "full-gather", log)
        growth = {}
        for label, micro in (("whole", None), ("micro", 2), ("whole", None), ("micro", 2)):  # interleaved
            results = group.apply(phased, f"eval-{label}", eval_peak, micro)
            growth.setdefault(label, []).append(max(r[1] - r[2] for r in results))
        out["eval_growth_bytes"] = {k: statistics.median(v) for k, v in growth.items()}
        out["eval_micro_over_full_batch"] = (out["eval_growth_bytes"]["micro"] / out["eval_growth_bytes"]["whole"]
                                             if out["eval_growth_bytes"]["whole"] > 0 else None)
        log(f"evaluation, 64 samples a batch over {WORKERS} workers: peak growth "
            f"{gib(out['eval_growth_bytes']['whole'])} GiB whole slices, {gib(out['eval_growth_bytes']['micro'])} GiB "
            f"in micro-batches of 2")
        stats = group.apply(mem_stats)
        out["sampler_hz"] = [round(s["rate_hz"]) for s in stats]
        out["kernel_high_water"] = all(s["hwm"] for s in stats)
        out["sampler_missed_max_bytes"] = max(s["missed_max"] or 0 for s in stats)
        if "ckpt" not in args.skip:  # the 4-worker checkpoints run in this group, laid out as asked
            group.apply(phased, "to-ckpt-layout", "reshard", LAYOUTS[args.ckpt_layout])
            out["ckpt4"] = checkpoint_rounds(group, WORKERS, args.repeats, fg["step"], log)
    finally:
        group.close()
    out.update(cycle_figures(names, gs, fg))
    return out


def cycle_figures(names: list[str], gs: dict, fg: dict) -> dict:
    """The steady state per layout and the switches' peaks over it, from the two cycles (reshard
    and full gather)."""
    out: dict = {}
    visits = gs["visits"] + fg["visits"]
    steady = {}
    for name in names:
        per_rank = [v["state"] for v in visits if v["layout"] == name]
        if per_rank:
            steady[name] = statistics.median(x for ranks in per_rank for x in ranks)
            out[f"state_bytes_{name}"] = steady[name]
            out[f"state_bytes_{name}_spread"] = spread([x for ranks in per_rank for x in ranks])
    if "fsdp" in steady and "data" in steady:
        out["fsdp4_over_data4_state"] = steady["fsdp"] / steady["data"]
    for label, run in (("", gs), ("_full_gather", fg)):
        worst = max(run["switches"], key=lambda s: max(s["ratio"]))
        out[f"switch_peak_over_steady{label}"] = max(worst["ratio"])
        out[f"switch_peak_over_steady{label}_at"] = f"{worst['from']}>{worst['to']}"
        for s in run["switches"]:
            key = f"{s['from']}_to_{s['to']}"
            out[f"switch_peak_over_steady{label}_{key}"] = max(s["ratio"])
            out[f"switch_s{label}_{key}"] = s["seconds"]
        out[f"switch_gc_leftover_over_steady{label}"] = max(max(s["leftover_ratio"]) for s in run["switches"])
    out["_visits"], out["_switches"] = visits, gs["switches"] + fg["switches"]
    return out


def checkpoint_round(group, root: pathlib.Path, fmt: str, step: int) -> tuple[float, float, int, int]:
    """One save and load in `fmt` under `root`: (save s, load s, bytes on disk, the largest rank's
    peak growth while saving)."""
    from gearshift.workers.state import checkpoint

    root.mkdir(exist_ok=True)
    got = group.apply(set_checkpoints, fmt, str(root))
    assert set(got) == {fmt}, got
    t0 = time.perf_counter()
    got = group.call(grown, "ckpt_save", "checkpoint")
    parts = [g[0] for g in got]
    grew = max(g[1] for g in got)
    if fmt == "full":  # rank 0 wrote state.pt as the ranks gathered it; committed here
        part = parts[0]["checkpoint_file"]
        path = checkpoint.commit(root, step, pathlib.Path(part["folder"]), part["files"], keep=1,
                                 fmt=checkpoint.FORMAT)
    else:
        ps = [p["checkpoint_part"] for p in parts]
        files = {n: d for p in ps for n, d in p["files"].items()}
        path = checkpoint.commit(root, step, pathlib.Path(ps[0]["folder"]), files, keep=1)
    t1 = time.perf_counter()
    del parts
    state = checkpoint.load(path, whole=False)  # a reference: each rank reads (full: maps) its part
    group.call("load", state)
    t2 = time.perf_counter()
    del state
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    shutil.rmtree(path)
    return t1 - t0, t2 - t1, size, grew


def checkpoint_rounds(group, world: int, repeats: int, step: int, log) -> dict:
    """Save and load under each format, alternating (full, dcp), (dcp, full), ...; seconds as the
    driver sees them (a save ends when the checkpoint is committed, a load when every rank has its state)."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gearshift-bench-memory-"))
    times: dict[str, list[float]] = {f"{k}_{f}": [] for k in ("save", "load") for f in ("full", "dcp")}
    sizes: dict[str, int] = {}
    growth: dict[str, list[int]] = {"full": [], "dcp": [], "full_whole": []}  # the largest rank's, per save
    try:
        for r in range(repeats):
            for fmt in (("full", "dcp") if r % 2 == 0 else ("dcp", "full")):
                save_s, load_s, sizes[fmt], grew = checkpoint_round(group, tmp / fmt, fmt, step)
                growth[fmt].append(grew)
                times[f"save_{fmt}"].append(save_s)
                times[f"load_{fmt}"].append(load_s)
                log(f"  ckpt {world} workers  {fmt:<5} save {save_s:6.2f} s  load {load_s:6.2f} s  "
                    f"({sizes[fmt] / 2**30:.2f} GiB on disk)")
        # once more in the full format as it was before it streamed: rank 0 gathers the whole state
        # and sends it to the driver (what it still does where it reaches no place to write)
        group.apply(set_checkpoints, "full", str(tmp / "full"))
        group.apply(no_full_place)
        got = group.call(grown, "ckpt_save", "checkpoint")
        growth["full_whole"].append(max(g[1] for g in got))
        del got
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"bytes_full": sizes.get("full"), "bytes_dcp": sizes.get("dcp")}
    for fmt, values in growth.items():  # over the bytes of the checkpoint (model and Adam state)
        out[f"save_growth_over_state_{fmt}"] = max(values) / sizes["full"] if values and sizes.get("full") else None
    log(f"  ckpt {world} workers  peak growth of the largest rank while saving, over the state's bytes: "
        + ", ".join(f"{k} {v:.3f}" for k, v in ((f, out[f'save_growth_over_state_{f}']) for f in growth) if v is not None))
    for k, v in times.items():
        out[k] = statistics.median(v)
        out[f"{k}_spread"] = spread(v)
    for k in ("save", "load"):
        ratios = [d / f for d, f in zip(times[f"{k}_dcp"], times[f"{k}_full"])]
        out[f"dcp_over_full_{k}"] = statistics.median(ratios)
        out[f"dcp_over_full_{k}_spread"] = spread(ratios)
    return out


def checkpoint_small(args, log) -> dict:
    """The 2-worker checkpoints, in a group of their own."""
    d = LAYOUTS[args.ckpt_layout]
    extra = {"shard_size": 2} if d["strategy"] == "hsdp" else {}
    if d["strategy"] == "hybrid":
        extra["tp_size"] = 2
    group = open_group(make_job(2, d["strategy"], extra), 2, args.period_ms / 1000)
    try:
        group.call("train", args.warm, 0, 1000.0)
        return checkpoint_rounds(group, 2, args.repeats, args.warm, log) | {"layout": group.infos[0]["layout"]}
    finally:
        group.close()


def pipeline_checkpoint(args, log) -> dict:
    """The full format under a pipeline (pp 2 on 2 workers): each rank's peak growth while saving,
    streamed a tensor at a time (strategies/pipeline/gather.py: each position's owner sends rank 0
    one tensor, rank 0 writes it) against the stages' parts pickled to rank 0 at once (what a
    rank that reaches no place to write still does, Parallel.full_state, and what every pipeline
    checkpoint did before), alternating; over the checkpoint's bytes."""
    model = {**GPT, "kwargs": {**GPT["kwargs"], "n_layer": max(2, GPT["kwargs"]["n_layer"])}}  # a block a stage
    group = open_group(make_job(2, "pipeline", {"pp_size": 2}, model=model), 2, args.period_ms / 1000)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gearshift-bench-pipeline-ckpt-"))
    growth: dict[str, list[list[int]]] = {"streamed": [], "pickled": []}
    size = None
    try:
        group.call("train", args.warm, 0, 1000.0)
        for r in range(args.repeats):
            for how in (("streamed", "pickled") if r % 2 == 0 else ("pickled", "streamed")):
                (tmp / how).mkdir(exist_ok=True)
                group.apply(set_checkpoints, "full", str(tmp / how))
                got = group.call(grown, f"ckpt_{how}", "checkpoint" if how == "streamed" else pickled_state)
                growth[how].append([g[1] for g in got])
                if how == "streamed":
                    size = got[0][0]["checkpoint_file"]["files"]["state.pt"]["bytes"]
                del got
                shutil.rmtree(tmp / how, ignore_errors=True)
    finally:
        group.close()
        shutil.rmtree(tmp, ignore_errors=True)
    out: dict = {"pipeline_ckpt_bytes": size}
    for how, rounds in growth.items():
        for rank in (0, 1):
            values = [g[rank] / size for g in rounds]
            out[f"pipeline_save_growth_over_state_{how}_rank{rank}"] = statistics.median(values)
            out[f"pipeline_save_growth_over_state_{how}_rank{rank}_spread"] = spread(values)
    ratios = [a[0] / b[0] for a, b in zip(growth["streamed"], growth["pickled"]) if b[0] > 0]
    out["pipeline_save_growth_rank0_streamed_over_pickled"] = statistics.median(ratios) if ratios else None
    out["pipeline_save_growth_rank0_streamed_over_pickled_spread"] = spread(ratios) if ratios else None
    log(f"  pipeline (pp 2) full-format save, peak growth over the state's {size / 2**30:.2f} GiB: rank 0 "
        f"streamed {out['pipeline_save_growth_over_state_streamed_rank0']:.3f}, pickled "
        f"{out['pipeline_save_growth_over_state_pickled_rank0']:.3f}; rank 1 streamed "
        f"{out['pipeline_save_growth_over_state_streamed_rank1']:.3f}, pickled "
        f"{out['pipeline_save_growth_over_state_pickled_rank1']:.3f}")
    return out


def cost_model_part(steady: dict) -> dict:
    """The cost model's predicted per-rank memory (orchestrator/costmodel.memory, for the job's
    model, optimizer and micro-batch) against the measured steady state per layout. The prediction
    is taken without its overhead term (MemoryOverhead(0, 0)): that term is the CUDA context and
    the caching allocator's slack, which a CPU process's RSS above its pre-build baseline has not."""
    from gearshift.orchestrator.policy import costmodel
    from gearshift.orchestrator.policy import job_shape

    if not hasattr(costmodel, "memory"):
        return {"memory_worst_rel_error": None,
                "memory_model": "orchestrator/costmodel.py has no memory model in this checkout"}
    job = make_job(WORKERS, as_dict=False)
    shape = job_shape.shape_of_job(job)
    settings = job_shape.memory_settings(job)
    none = costmodel.MemoryOverhead(0.0, 0.0)
    out, errors = {}, {}
    for name, measured in steady.items():
        d = LAYOUTS[name]
        pred = costmodel.memory(shape, d["dp"], d["tp"], d.get("shard", 1), global_batch=job.train.global_batch_size,
                                overhead=none, **settings)
        out[f"memory_predicted_bytes_{name}"] = pred["total"]
        out[f"memory_predicted_breakdown_{name}"] = {k: v for k, v in pred.items() if k != "total"}
        errors[name] = abs(pred["total"] - measured) / measured
        out[f"memory_rel_error_{name}"] = errors[name]
    if errors:
        worst = max(errors, key=errors.get)
        out.update({"memory_worst_rel_error": errors[worst], "memory_worst_rel_error_at": worst})
    else:
        out["memory_worst_rel_error"] = None
    return out


def smoke_sized(args) -> None:
    """--smoke: parts 1-3 and 5 (steady states, switches, the cost model, evaluation) in their
    smallest form; the others each start processes of their own (`gearshift run`, fresh groups)."""
    args.quick, args.steps, args.layouts = True, args.steps or 1, "data,fsdp"
    args.model = args.model or json.dumps({"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2,
                                           "n_embd": 64})
    args.skip = ",".join(filter(None, [args.skip, "finish", "build", "ckpt"]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a shorter cycle and fewer repeats")
    ap.add_argument("--steps", type=int, default=None, help="steady steps per layout visit")
    ap.add_argument("--warm", type=int, default=1, help="warm-up steps after each switch (not in the steady peak)")
    ap.add_argument("--repeats", type=int, default=None, help="checkpoint save/load repeats per format and size")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="which of " + ", ".join(LAYOUTS))
    ap.add_argument("--ckpt-layout", default=None, help="layout the checkpoints are taken in (default fsdp, else data)")
    ap.add_argument("--period-ms", type=float, default=1.0, help="RSS sampling period")
    ap.add_argument("--model", default=None, help="JSON: GPT kwargs to override (a smaller model for a try-out)")
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: memory, finish, build, ckpt, pipeline")
    ap.add_argument("--build-repeats", type=int, default=None, help="first builds per variant (meta, whole)")
    ap.add_argument("--smoke", action="store_true", help="the quick cycle over data and fsdp only, 1 steady step a "
                    "visit, a GPT of 0.1M parameters, no build, finish or checkpoint parts: that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        smoke_sized(args)
    args.steps = args.steps or (2 if args.quick else 3)
    args.repeats = args.repeats or (2 if args.quick else 3)
    args.build_repeats = args.build_repeats or (1 if args.quick else 2)
    args.layouts = args.layouts.split(",")
    skip = set(filter(None, args.skip.split(",")))
    if args.model:
        GPT["kwargs"].update(json.loads(args.model))
    os.environ.update(MALLOC_ENV)  # the workers are spawned: they inherit it

    def log(msg: str) -> None:
        print(msg, flush=True)

    if args.ckpt_layout is None:
        args.ckpt_layout = "fsdp" if "fsdp" in available_layouts() else "data"
    log(f"bench/memory.py on {platform.machine()} with {os.cpu_count()} cores, torch "
        f"{__import__('torch').__version__}, {'quick' if args.quick else 'full'} mode; checkpoints in "
        f"{args.ckpt_layout}")
    started = time.perf_counter()
    figures: dict = {"bench": "memory", "quick": args.quick, "workers": WORKERS, "model": GPT["kwargs"],
                     "malloc_env": MALLOC_ENV}
    switches = run_parts(args, skip, log, figures)
    figures["seconds"] = time.perf_counter() - started
    show(figures, switches, log)
    print(json.dumps(figures))


def run_parts(args, skip: set, log, figures: dict) -> list[dict]:
    """Every part not skipped, each one's figures into `figures` (a part that fails: its first
    line as `<part>_error`); the switches of the memory part."""
    mem: dict = {}
    if "memory" not in skip:
        try:
            mem = memory_part(args, log)
        except Exception as err:
            figures["memory_error"] = first_line(err)
            log(f"memory part FAILED: {figures['memory_error']}")
    finish: dict | None = None
    finish_tmp = pathlib.Path(tempfile.mkdtemp(prefix="gearshift-bench-finish-"))
    if "finish" not in skip:
        try:
            finish = finish_part(args, log, finish_tmp)
            figures.update({k: v for k, v in finish.items() if not k.startswith("_")})
        except Exception as err:
            figures["finish_error"] = first_line(err)
            log(f"finish part FAILED: {figures['finish_error']}")
    if "build" not in skip:
        try:
            figures.update(build_part(args, log, finish))
        except Exception as err:
            figures["build_error"] = first_line(err)
            log(f"build part FAILED: {figures['build_error']}")
    shutil.rmtree(finish_tmp, ignore_errors=True)
    ckpt4 = mem.pop("ckpt4", None)
    mem.pop("_visits", None)
    switches = mem.pop("_switches", [])
    figures.update(mem)
    try:
        figures.update(cost_model_part({k[len("state_bytes_"):]: v for k, v in mem.items()
                                        if k.startswith("state_bytes_") and not k.endswith("_spread")}))
    except Exception as err:
        figures.update({"memory_worst_rel_error": None, "memory_model_error": first_line(err)})
        log(f"cost model part FAILED: {figures['memory_model_error']}")
    ckpt = {4: ckpt4, 2: None}
    if "ckpt" not in skip:
        try:
            ckpt[2] = checkpoint_small(args, log)
        except Exception as err:
            figures["ckpt_2_error"] = first_line(err)
            log(f"2-worker checkpoints FAILED: {figures['ckpt_2_error']}")
    for world, c in ckpt.items():
        for k in ("save", "load"):
            for f in ("full", "dcp"):
                figures[f"ckpt_{k}_s_{f}_{world}"] = c and c[f"{k}_{f}"]
                figures[f"ckpt_{k}_s_{f}_{world}_spread"] = c and c[f"{k}_{f}_spread"]
            figures[f"dcp_over_full_{k}_{world}"] = c and c[f"dcp_over_full_{k}"]
            figures[f"dcp_over_full_{k}_{world}_spread"] = c and c[f"dcp_over_full_{k}_spread"]
        figures[f"ckpt_bytes_{world}"] = c and {"full": c["bytes_full"], "dcp": c["bytes_dcp"]}
    figures["ckpt_layout"] = args.ckpt_layout
    if "pipeline" not in skip:
        try:
            figures.update(pipeline_checkpoint(args, log))
        except Exception as err:
            figures["pipeline_ckpt_error"] = first_line(err)
            log(f"pipeline checkpoint part FAILED: {figures['pipeline_ckpt_error']}")
    return switches


def show(figures: dict, switches: list[dict], log) -> None:
    """The tables: state per layout, switches, checkpoints, then each figure against its goal."""
    log("")
    log(f"{'layout':<14}{'state GiB':>10}{'min-max':>14}{'predicted':>11}{'rel err':>9}   (per rank, steady)")
    for name in LAYOUTS:
        v = figures.get(f"state_bytes_{name}")
        if v is None:
            continue
        lo, hi = figures[f"state_bytes_{name}_spread"]
        pred, err = figures.get(f"memory_predicted_bytes_{name}"), figures.get(f"memory_rel_error_{name}")
        log(f"{name:<14}{gib(v):>10}{gib(lo) + '-' + gib(hi):>14}{gib(pred):>11}"
            f"{'-' if err is None else f'{err:.2f}':>9}")
    log("")
    log(f"{'switch':<28}{'peak/steady':>12}{'full-gather':>13}{'s':>7}{'s full-gather':>15}")
    for s_ in switches[:len(switches) // 2]:
        key = f"{s_['from']}_to_{s_['to']}"
        a, b = figures.get(f"switch_peak_over_steady_{key}"), figures.get(f"switch_peak_over_steady_full_gather_{key}")
        ta, tb = figures.get(f"switch_s_{key}"), figures.get(f"switch_s_full_gather_{key}")
        log(f"{s_['from'] + ' > ' + s_['to']:<28}{a:>12.2f}{b:>13.2f}{ta:>7.1f}{tb:>15.1f}")
    log("")
    log(f"{'checkpoint':<22}{'full s':>8}{'dcp s':>8}{'dcp/full':>10}{'min-max':>13}")
    for world in (4, 2):
        for k in ("save", "load"):
            full, dcp_ = figures.get(f"ckpt_{k}_s_full_{world}"), figures.get(f"ckpt_{k}_s_dcp_{world}")
            r, rs = figures.get(f"dcp_over_full_{k}_{world}"), figures.get(f"dcp_over_full_{k}_{world}_spread")
            if full is not None:
                log(f"{k + ', ' + str(world) + ' workers':<22}{full:>8.2f}{dcp_:>8.2f}{r:>10.2f}"
                    f"{f'{rs[0]:.2f}-{rs[1]:.2f}':>13}")
    log("")
    log(f"{'figure':<44}{'value':>10}  goal")
    for key, goal in (("fsdp4_over_data4_state", "<= 0.40"), ("switch_peak_over_steady", "<= 1.25"),
                      ("build_growth_over_full_params", "<= 0.40"),
                      ("driver_growth_over_full_params", "<= 0.10"),
                      ("driver_model_growth_over_full_params", "(less the same run of a 0.1M GPT)"),
                      ("export_growth_over_full_params", "<= 0.30"),
                      ("load_growth_over_full_params", "(pretrained, by slices)"),
                      ("resume_growth_over_full_params", "(DCP; includes the Adam state it creates)"),
                      ("resume_transient_over_full_params", "(the resume's peak above what stays)"),
                      ("eval_micro_over_full_batch", "(micro-batches of 2 over whole slices)"),
                      ("build_growth_over_full_params_whole", "(every worker built the whole model)"),
                      ("switch_peak_over_steady_full_gather", "(the full-gather switch)"),
                      ("memory_worst_rel_error", "<= 0.20"), ("dcp_over_full_save_4", "(< 1: DCP faster)"),
                      ("dcp_over_full_load_4", "")):
        v = figures.get(key)
        log(f"{key:<44}{'-' if v is None else f'{v:.3f}':>10}  {goal}")
    log(f"({figures['seconds']:.0f} s in all; cycle {' > '.join(figures.get('cycle') or [])}; "
        f"reshard streams: {figures.get('reshard_streams')})")


if __name__ == "__main__":
    main()
