"""Streaming a Parquet dataset to the workers with Ray Data against loading it whole, side by side.

The bench writes a Parquet dataset several times larger than a worker's other memory (a worker's
RSS after its build is ~300-400 MB here; full: ~1.5 GB on disk, --quick: ~300 MB) into a temp
dir: `x`, F float32 features per row in Ray's tensor extension (Ray Data reads it back as a 2-D
float32 ndarray column, checked before the runs), `y` int64 labels (the argmax of the first 10
features: learnable), random and incompressible, in many files of many row groups. Then it trains
one pass over it (train.steps = rows // global batch) with an MLP, data parallel on 2 workers,
two ways per repeat, alternating which goes first:

- ray: `data: {read: parquet, paths: GLOB, input: x, target: y}`, read by gearshift's feeder
  actor with Ray Data; each worker gets only its slice of each global batch, data.loader.prefetch
  steps ahead (workers/step/streaming.py);
- map: `data: {entrypoint: "ingest_data:parquet_in_memory"}` (bench/ingest_data.py, copied next
  to the job file, the job's search path): every worker reads all the files into memory with
  pyarrow at build and indexes its batches from there (`get_batch`).

Each run is `gearshift run` in a subprocess (its own embedded Ray), cluster.cpus_per_worker 0.5
(Ray Data's read tasks need a free CPU on this 2-core machine; the same for both). Per run:

- samples/s: summary.json's `samples_per_s`, the steady rate (global batch x steps over the sum of
  step times, after the first 10 steps); `samples_per_s_ray_over_map` is the ratio per repeat,
  then the median (min..max);
- data share: data_time_mean / step_time_mean summed over the same steady steps of
  telemetry.jsonl (data_time: loading the batch and moving it to the device; for the ray path,
  waiting on the feeder's slice and copying it out of the object store);
- memory: the bench polls every TrainWorker process (a descendant of the CLI whose title reads
  `ray::TrainWorker...`) every ~0.2 s: RSS, and RssAnon / RssShmem from /proc/PID/status.
  growth = peak RSS during training - (the worker's RSS at its first step - the data it loaded
  before that step). The first step (telemetry's step 1 `ended_at`; the first sample after it) is
  the baseline because by then the model, optimizer, DDP buckets and gloo buffers exist and
  have been touched once: build alone grows a worker by ~100-150 MB here whatever the data, which
  would be 0.1x of the full dataset (and 0.5x of --quick's) and is no cost of ingest. The map
  path loads its data inside build, before the first step, so that load is added back: the map
  dataset writes its process's RSS just before and after reading the files (ingest_data.py's
  `rss_report`); the ray path loads nothing before its first step (0). So the map path is ~1x
  by construction and the ray path is what streaming holds at its peak.
  `peak_rss_growth_over_dataset` = the larger worker's growth / the dataset's bytes on disk (the
  Parquet files, uncompressed: ~ the data's bytes in memory). Shown beside it: the growth in
  training alone, the load, the growth over the RSS just before build (everything together), and
  build's own cost.
  RSS counts the shared-memory pages a process has touched, and Ray's object store is shared
  memory: a slice the worker reads zero-copy out of the store counts in its RSS (as RssShmem)
  while it is mapped. The goal uses RSS (the conservative figure); the anon growth (RssAnon:
  the private heap, what USS mostly is) is reported beside it. Where the rest of the memory
  lives is reported too: the feeder actor's peak RSS and the Ray Data task processes' (sum of
  peaks). CPU seconds per role (workers, feeder, Ray Data tasks, Ray's own daemons and pooled
  workers, the driver) say where the time goes on a machine whose 2 cores the two workers already
  fill; each look charges the CPU used since the last one to what the process is titled now, so
  `ray::IDLE` holds Ray Data tasks shorter than the poll and worker processes' start-up.
  `other_cpu_s` is the machine's busy CPU during a run that the run's own processes did not use:
  other load on a shared machine, which distorts the samples/s comparison.

Goals: peak_rss_growth_over_dataset <= 0.10 (the ray path; the map path is ~1x by construction),
samples_per_s_ray_over_map >= 0.90. The growth goal is meant for the full size: the training's
own growth after its first step (allocator, autograd; the map path's `growth_in_training`) is
~50-60 MB here, already 0.2x of --quick's 300 MB, so --quick cannot meet it whatever ingest does.
On a machine shared with other work, read `other_cpu_s` before the samples/s ratio.

    python bench/ingest.py              # ~1.5 GB, 3 repeats (each pass ~1-3 min per path)
    python bench/ingest.py --quick      # ~300 MB, 1 repeat
    python bench/ingest.py --mb 20      # a short run
    python bench/ingest.py --smoke      # 15 steps of 64 rows of 32 features, 1 repeat: that it runs (CI)

The last line of output is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
WORKERS = 2
PATHS = ("ray", "map")
WARMUP = 10  # orchestrator/reporting.py RunStats.WARMUP: the summary's steady rate leaves these out
POLL_S = 0.2
MIB = 2**20


# ----------------------------------------------------------------------------- the dataset

def write_dataset(folder: pathlib.Path, rows: int, features: int, seed: int = 0,
                  file_mb: float = 32.0, row_group: int = 512) -> dict:
    """Parquet files of `x` (float32 tensor column, Ray's extension type) and `y` (int64), a file
    at a time (the bench's own memory stays one file)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    folder.mkdir(parents=True)
    per_file = min(int(file_mb * MIB // (features * 4)), -(-rows // 8))  # at least 8 files
    per_file = max(row_group, per_file // row_group * row_group)
    rng = np.random.default_rng(seed)
    done, i = 0, 0
    while done < rows:
        n = min(per_file, rows - done)
        x = rng.standard_normal((n, features), dtype=np.float32)
        y = np.argmax(x[:, :10], axis=1).astype(np.int64)
        table = pa.table({"x": ArrowTensorArray.from_numpy(x), "y": pa.array(y)})
        # no dictionary: random floats would leave a 1 MB dictionary page per row group (+30% on disk)
        pq.write_table(table, folder / f"part-{i:04d}.parquet", row_group_size=row_group, compression="none",
                       use_dictionary=False)
        done += n
        i += 1
    files = sorted(folder.glob("*.parquet"))
    return {"rows": rows, "files": len(files), "row_group": row_group,
            "bytes": sum(f.stat().st_size for f in files)}


CHECK = """
import json, logging, sys, ray
ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level=logging.ERROR, log_to_driver=False)
try:
    ray.data.DataContext.get_current().enable_progress_bars = False
    b = ray.data.read_parquet(sys.argv[1]).take_batch(2, batch_format="numpy")
    got = {"x_dtype": str(b["x"].dtype), "x_shape": list(b["x"].shape), "y_dtype": str(b["y"].dtype)}
    with open(sys.argv[2], "w") as f:
        json.dump(got, f)
finally:
    ray.shutdown()
"""


def check_tensor_column(first_file: pathlib.Path, env: dict) -> dict:
    """Ray Data reads `x` back as a 2-D float32 ndarray (the tensor extension), not objects."""
    # the answer goes to a file: Ray may print its own lines to stdout, before ours or after it
    answer = first_file.parent.parent / "check.json"
    answer.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-c", CHECK, str(first_file), str(answer)], capture_output=True,
                          text=True, timeout=180, env=env, cwd=ROOT)
    if done.returncode != 0 or not answer.exists():
        raise SystemExit(f"reading the dataset back with Ray Data failed (exit {done.returncode}):\n"
                         f"{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    got = json.loads(answer.read_text())
    if got["x_dtype"] != "float32" or len(got["x_shape"]) != 2 or got["y_dtype"] != "int64":
        raise SystemExit(f"Ray Data reads the columns back as {got}, not x: float32 (2, F), y: int64")
    return got


# ----------------------------------------------------------------------------- watching the processes

def _status(pid: int) -> dict:
    """RssAnon, RssFile, RssShmem (bytes) from /proc/PID/status: one cheap read."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                key, val = line.split(":", 1)
                out[key] = int(val.split()[0]) * 1024
    return out


def role_of(title: str) -> str:
    if title.startswith("ray::TrainWorker"):
        return "worker"
    if title.startswith("ray::") and title.split()[0].endswith(("Feeder", "Feeder.take", "Feeder.describe")) \
            or title.startswith("ray::Feeder"):
        return "feeder"  # titled ray::Feeder.method, or ray::NAME:Feeder for the named actor
    if title.startswith("ray::") and not title.startswith(("ray::IDLE", "ray::_StatsActor")):
        return "ray_data"  # Ray Data's read / map tasks and its own actors
    if "raylet" in title or "gcs_server" in title or "dashboard" in title or "ray/_private" in title \
            or "ray::IDLE" in title or "log_monitor" in title or "_StatsActor" in title:
        return "ray_daemons"
    return "driver" if "-m gearshift" in title else "ray_daemons"


def detail_of(title: str) -> str:
    """A finer name for the CPU breakdown: the Ray task/actor, or the daemon's program."""
    if title.startswith("ray::"):
        name = title.split()[0].split(".")[0]
        return "ray::Feeder" if name.endswith(":Feeder") else name[:40]
    args = title.split()
    if not args:
        return "?"
    prog = os.path.basename(args[0])
    if prog.startswith("python") and len(args) > 1:
        script = next((a for a in args[1:] if not a.startswith("-")), "")
        if "-m gearshift" in title:
            return "driver (gearshift run)"
        return os.path.basename(script)[:40] or prog
    return prog[:40]


class Watcher:
    """Polls the CLI's descendants every POLL_S: the TrainWorkers' RSS series (with their titles),
    every other process's peak RSS and CPU seconds, by role."""

    def __init__(self, root_pid: int):
        import psutil

        self.psutil = psutil
        self.root = psutil.Process(root_pid)
        self.series: dict[int, list[tuple]] = {}  # worker pid -> [(t, title, rss, anon, shmem)]
        self.peaks: dict[int, tuple[str, int, int, int]] = {}  # pid -> (role, peak rss, peak anon, peak shmem)
        self.cpu_seen: dict[int, float] = {}  # pid -> its CPU seconds at the last look
        self.cpu_role: dict[str, float] = {}  # role -> CPU seconds
        self.cpu_detail: dict[str, float] = {}  # finer name -> CPU seconds
        self.seen: dict[int, float] = {}  # pid -> create_time: for the clean-up
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="ingest-watcher")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.time()
            try:
                procs = [self.root] + self.root.children(recursive=True)
            except self.psutil.Error:
                procs = []
            for p in procs:
                try:
                    if p.pid not in self.seen:
                        self.seen[p.pid] = p.create_time()
                    title = " ".join(p.cmdline())
                    role = role_of(title)
                    st = _status(p.pid)
                    ct = p.cpu_times()
                except (self.psutil.Error, OSError):
                    continue
                rss = st.get("VmRSS", 0)
                # CPU used since the last look, charged to what the process is now (pooled Ray
                # workers run Ray Data's tasks and go back to ray::IDLE between them)
                used = ct.user + ct.system
                delta = used - self.cpu_seen.get(p.pid, 0.0)
                self.cpu_seen[p.pid] = used
                name = detail_of(title) if title else f"({p.name()})"
                self.cpu_role[role] = self.cpu_role.get(role, 0.0) + delta
                self.cpu_detail[name] = self.cpu_detail.get(name, 0.0) + delta
                _, r0, a0, s0 = self.peaks.get(p.pid, (role, 0, 0, 0))
                self.peaks[p.pid] = (role, max(r0, rss), max(a0, st.get("RssAnon", 0)), max(s0, st.get("RssShmem", 0)))
                if role == "worker":
                    self.series.setdefault(p.pid, []).append(
                        (t, title, rss, st.get("RssAnon", 0), st.get("RssShmem", 0)))
            self._stop.wait(max(0.0, POLL_S - (time.time() - t)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def leftovers(self) -> list:
        """Processes seen under the CLI that still run (the same pid and start time)."""
        left = []
        for pid, created in self.seen.items():
            try:
                p = self.psutil.Process(pid)
                if p.create_time() == created and p.status() != self.psutil.STATUS_ZOMBIE:
                    left.append(p)
            except self.psutil.Error:
                pass
        return left


def worker_memory(series: list[tuple], first_step_at: float | None, load: dict | None) -> dict:
    """growth = peak RSS - (RSS at the first step - what the worker loaded before it); also the
    growth over the RSS just before `build` (data, model, optimizer and build's imports together)."""
    i_build = next((i for i, s in enumerate(series) if ".build" in s[1]), None)
    base = series[max(0, i_build - 1) if i_build is not None else 0]
    peak_rss, peak_anon = max(s[2] for s in series), max(s[3] for s in series)
    after = [s for s in series if first_step_at is not None and s[0] >= first_step_at]
    at_step = after[0] if after else None
    loaded = (load["rss_after"] - load["rss_before"]) if load else 0
    loaded_anon = (load["anon_after"] - load["anon_before"]) if load else 0
    out = {"rss_before_build": base[2], "baseline_seen_before_build": bool(i_build), "rss_peak": peak_rss,
           "anon_peak": peak_anon, "shmem_peak": max(s[4] for s in series), "loaded_before_training": loaded,
           "growth_since_before_build": peak_rss - base[2], "anon_growth_since_before_build": peak_anon - base[3],
           "rss_at_first_step": at_step[2] if at_step else None, "samples": len(series),
           "growth": None, "anon_growth": None, "growth_in_training": None}
    if at_step:
        # the growth's course: the peak over each quarter of training, over the first-step RSS
        # (flat: bounded; climbing: something grows with the data read)
        t0, t1 = after[0][0], after[-1][0]
        quarters = [[s[2] for s in after if t0 + k * (t1 - t0) / 4 <= s[0] <= t0 + (k + 1) * (t1 - t0) / 4]
                    for k in range(4)]
        out["growth_by_quarter"] = [max(q) - at_step[2] if q else None for q in quarters]
        out["shmem_by_quarter"] = [max((s[4] for s in after if t0 + k * (t1 - t0) / 4 <= s[0]
                                        <= t0 + (k + 1) * (t1 - t0) / 4), default=None) for k in range(4)]
        out["growth_in_training"] = max(s[2] for s in after) - at_step[2]
        out["growth"] = out["growth_in_training"] + loaded
        out["anon_growth"] = max(s[3] for s in after) - at_step[3] + loaded_anon
        # build's own cost without the data: model, optimizer, DDP/gloo set-up, lazy imports
        out["build_overhead"] = at_step[2] - base[2] - loaded
    return out


# ----------------------------------------------------------------------------- one run

def job_for(path: str, data_glob: str, steps: int, args, loads: pathlib.Path) -> dict:
    data = ({"read": "parquet", "paths": data_glob, "input": "x", "target": "y"} if path == "ray" else
            {"entrypoint": "ingest_data:parquet_in_memory", "kwargs": {"paths": data_glob, "rss_report": str(loads)}})
    return {"name": f"ingest-{path}",
            "model": {"name": "mlp", "kwargs": {"in_features": args.features, "hidden": args.hidden,
                                                "out_features": 10, "layers": args.layers}},
            "data": data, "loss": "cross_entropy", "optimizer": {"name": "adamw", "lr": 1e-3},
            "train": {"steps": steps, "global_batch_size": args.batch, "log_every": max(1, steps // 5)},
            "cluster": {"num_workers": WORKERS, "cpus_per_worker": 0.5},
            "parallel": {"strategy": "data"}, "checkpoint": {"every": 0},
            "telemetry": {"ray_metrics": False}}


def stop_cli(proc: subprocess.Popen, watcher: Watcher) -> None:
    """SIGINT (the CLI shuts its Ray down), then SIGKILL; then whatever it left, by pid."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    for p in watcher.leftovers():
        try:
            p.terminate()
        except Exception:
            pass
    time.sleep(1.0)
    for p in watcher.leftovers():
        try:
            p.kill()
        except Exception:
            pass


def launch(job_file: pathlib.Path, run_dir: pathlib.Path, log: pathlib.Path, env: dict, timeout: float):
    """Run the job in a gearshift process of its own, watched; (its exit code or None on a timeout,
    the wall time, the host's CPU busy seconds meanwhile, the watcher)."""
    import psutil

    host0 = psutil.cpu_times()
    start = time.time()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gearshift", "run", str(job_file),
                                 "--run-dir", str(run_dir)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        watcher = Watcher(proc.pid)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            wall = time.time() - start
            host1 = psutil.cpu_times()
            watcher.stop()
            stop_cli(proc, watcher)
    busy = lambda c: c.user + c.nice + c.system + c.irq + c.softirq + getattr(c, "steal", 0.0)  # noqa: E731
    return rc, start, wall, busy(host1) - busy(host0), watcher


def step_figures(run_dir: pathlib.Path, start: float, wall: float) -> tuple[dict, list[dict]]:
    """The run's figures from its summary and step records, and the step records."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines() if line.strip()]
    steps_r = sorted((r for r in records if r["type"] == "step"), key=lambda r: r["step"])
    steady = [r for r in steps_r if r["step"] - steps_r[0]["step"] >= WARMUP] or steps_r
    timed = [r for r in steady if r.get("data_time_mean") is not None]
    share = (sum(r["data_time_mean"] for r in timed) / sum(r["step_time_mean"] for r in timed)) if timed else None
    share_max = (sum(r["data_time_max"] for r in timed) / sum(r["step_time_max"] for r in timed)) if timed else None
    first_step_at = steps_r[0]["ended_at"] if steps_r else None
    pass_s = (steps_r[-1]["ended_at"] - steps_r[0]["ended_at"]) if len(steps_r) > 1 else None
    return {"steps": len(steps_r), "samples_per_s": summary.get("samples_per_s"),
            "median_step_time_s": summary.get("median_step_time_s"), "data_share": share, "data_share_max": share_max,
            "comm_wait_frac": summary.get("comm_wait_frac"), "first_loss": summary.get("first_loss"),
            "final_loss": summary.get("final_loss"), "pass_s": pass_s, "wall_s": wall,
            "first_step_after_s": first_step_at - start if first_step_at else None}, steps_r


def memory_figures(path: str, watcher, loads_dir: pathlib.Path, first_step_at: float | None,
                   dataset_bytes: int) -> dict:
    """Each worker's memory growth against the dataset's size, and the peaks by role."""
    loads = {}
    for f in (loads_dir.glob("load-*.json") if loads_dir.is_dir() else []):
        rec = json.loads(f.read_text())
        loads[rec["pid"]] = rec
    if path == "map" and len(loads) != WORKERS:
        print(f"  warning: {len(loads)} load reports from the map dataset, not {WORKERS}", flush=True)
    workers = {pid: worker_memory(s, first_step_at, loads.get(pid)) for pid, s in watcher.series.items() if s}
    if len(workers) != WORKERS:
        print(f"  warning: saw {len(workers)} TrainWorker processes, not {WORKERS}", flush=True)
    measured = [w for w in workers.values() if w["growth"] is not None]
    worst = max(measured, key=lambda w: w["growth"]) if len(measured) == len(workers) and workers else None
    per_dataset = lambda key: max(w[key] for w in measured) / dataset_bytes if worst else None  # noqa: E731
    peaks: dict[str, tuple] = {}
    for role, rss, anon, shm in watcher.peaks.values():
        if rss >= peaks.get(role, (0, 0, 0))[0]:
            peaks[role] = (rss, anon, shm)
    ray_data_sum = sum(v[1] for v in watcher.peaks.values() if v[0] == "ray_data")
    return {
        "growth_bytes": worst["growth"] if worst else None,
        "peak_rss_growth_over_dataset": worst["growth"] / dataset_bytes if worst else None,
        "anon_growth_over_dataset": per_dataset("anon_growth"),
        "growth_in_training_over_dataset": per_dataset("growth_in_training"),
        "loaded_before_training_over_dataset": per_dataset("loaded_before_training"),
        "growth_since_before_build_over_dataset": max(w["growth_since_before_build"] for w in workers.values())
        / dataset_bytes if workers else None,
        "build_overhead_bytes": max(w["build_overhead"] for w in measured) if worst else None,
        "workers": list(workers.values()),
        "feeder_peak_rss": peaks.get("feeder", (None,))[0],
        "feeder_peak_anon": peaks.get("feeder", (None, None))[1],
        "feeder_peak_shmem": peaks.get("feeder", (None, None, None))[2],
        "ray_data_task_peak_rss": peaks.get("ray_data", (None,))[0],
        "ray_data_task_peak_rss_sum": ray_data_sum or None,
        "growth_by_quarter_mib": [[None if g is None else round(g / MIB, 1) for g in w.get("growth_by_quarter", [])]
                                  for w in workers.values()],
    }


def run_one(path: str, tag: str, tmp: pathlib.Path, data_glob: str, steps: int, dataset_bytes: int, args,
            env: dict) -> dict:
    job_file = tmp / f"{path}-{tag}.yaml"
    loads_dir = tmp / f"loads-{path}-{tag}"
    job_file.write_text(json.dumps(job_for(path, data_glob, steps, args, loads_dir), indent=1))  # JSON is YAML
    run_dir = tmp / f"run-{path}-{tag}"
    log = tmp / f"{path}-{tag}.log"
    rc, start, wall, host_busy, watcher = launch(job_file, run_dir, log, env, args.timeout)
    if rc != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"{path} run {'timed out' if rc is None else f'failed ({rc})'}; its output ends:\n{tail}")
    figures, steps_r = step_figures(run_dir, start, wall)
    first_step_at = steps_r[0]["ended_at"] if steps_r else None
    cpu, detail = watcher.cpu_role, watcher.cpu_detail
    return {
        "path": path, **figures, **memory_figures(path, watcher, loads_dir, first_step_at, dataset_bytes),
        "cpu_s": {k: round(v, 1) for k, v in sorted(cpu.items())},
        # the machine's busy CPU seconds during the run that this run's processes did not use:
        # other load on a shared machine (it slows either path; compare the two runs' figures)
        "host_busy_cpu_s": round(host_busy, 1), "other_cpu_s": round(host_busy - sum(cpu.values()), 1),
        "cpu_s_detail": {k: round(v, 1) for k, v in sorted(detail.items(), key=lambda kv: -kv[1])[:10]},
    }


# ----------------------------------------------------------------------------- main

def spread(values: list[float]) -> list[float]:
    return [min(values), max(values)]


def med(runs: list[dict], key: str):
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def fmt(v, spec: str, missing: str = "-") -> str:
    return missing if v is None else format(v, spec)


def smoke_sized(args) -> None:
    """--smoke: the smallest pass the figures allow (the warm-up's steps and 5 more), rows, model and
    row groups small enough that each run is its start-up and little else."""
    args.repeats, args.batch, args.features, args.hidden, args.layers = 1, 64, 32, 32, 1
    args.rows, args.row_group = args.batch * (WARMUP + 5), 64


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~300 MB, 1 repeat")
    ap.add_argument("--repeats", type=int, default=None, help="pairs of runs (default 3, --quick 1)")
    ap.add_argument("--mb", type=float, default=None, help="dataset size on disk in MB (default 1500, --quick 300)")
    ap.add_argument("--rows", type=int, default=None, help="rows (overrides --mb)")
    ap.add_argument("--features", type=int, default=1024, help="float32 features per row")
    ap.add_argument("--row-group", type=int, default=512, help="rows per Parquet row group")
    ap.add_argument("--hidden", type=int, default=1536, help="the MLP's hidden width")
    ap.add_argument("--layers", type=int, default=2, help="the MLP's hidden layers")
    ap.add_argument("--batch", type=int, default=1024, help="global batch")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one run may take")
    ap.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)  # keep the temp dir (debugging)
    ap.add_argument("--smoke", action="store_true", help="15 steps of 64 rows of 32 features, an MLP 32-32-10, 1 "
                    "repeat: that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        smoke_sized(args)
    return args


def main() -> None:
    args = parse_args()
    q = args.quick
    repeats = args.repeats or (1 if q else 3)
    mb = args.mb or (300.0 if q else 1500.0)
    row_bytes = args.features * 4 + 8
    rows = args.rows or max(args.batch * (WARMUP + 5), int(mb * 1e6 // row_bytes))
    steps = rows // args.batch
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([os.environ["PYTHONPATH"]]
                                                                        if os.environ.get("PYTHONPATH") else [])),
           "RAY_USAGE_STATS_ENABLED": "0"}
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gs-ingest-"))
    result: dict = {"bench": "ingest", "quick": q, "repeats": repeats, "machine": platform.machine(),
                    "cpus": os.cpu_count(), "workers": WORKERS, "features": args.features,
                    "model": f"mlp {args.features}-{args.hidden}x{args.layers}-10", "global_batch_size": args.batch,
                    "steps": steps}
    try:
        ds = write_dataset(tmp / "data", rows, args.features, row_group=args.row_group)
        result.update(dataset_mb=round(ds["bytes"] / 1e6, 1), dataset_bytes=ds["bytes"], rows=rows,
                      files=ds["files"], row_group=ds["row_group"])
        got = check_tensor_column(sorted((tmp / "data").glob("*.parquet"))[0], env)
        print(f"Parquet ingest, {WORKERS} workers (data parallel, 0.5 CPU each), {platform.machine()} with "
              f"{os.cpu_count()} cores{' (--quick)' if q else ''}: {ds['bytes'] / 1e6:.0f} MB on disk, {rows} rows "
              f"in {ds['files']} files of {ds['row_group']}-row groups (Ray Data reads x as {got['x_dtype']} "
              f"{got['x_shape']}); MLP {args.features}-{args.hidden}x{args.layers}-10, global batch {args.batch}, "
              f"one pass = {steps} steps; {repeats} repeat(s), alternating", flush=True)
        shutil.copy(BENCH / "ingest_data.py", tmp / "ingest_data.py")  # the job's folder is its search path
        # the folder, not a glob: workers/step/streaming.py checks a glob with glob.glob but hands it to
        # ray.data.read_parquet unexpanded, which takes it for a file name (FileNotFoundError)
        data_glob = str(tmp / "data")
        runs: dict[str, list[dict]] = {p: [] for p in PATHS}
        ratios = []
        for r in range(repeats):
            got_r = {}
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                res = run_one(path, str(r), tmp, data_glob, steps, ds["bytes"], args, env)
                runs[path].append(res)
                got_r[path] = res
                print(f"  repeat {r + 1} {path:<4}{fmt(res['samples_per_s'], '>9.1f')} samples/s  data share "
                      f"{fmt(res['data_share'], '.3f')}  peak RSS growth "
                      f"{fmt(res['growth_bytes'] / MIB if res['growth_bytes'] is not None else None, '>7.1f')} MiB "
                      f"({fmt(res['peak_rss_growth_over_dataset'], '.3f')} x dataset)  pass "
                      f"{fmt(res['pass_s'], '.1f')} s  wall {res['wall_s']:.1f} s  other load "
                      f"{res['other_cpu_s']:.0f} cpu-s", flush=True)
            if got_r["ray"]["samples_per_s"] and got_r["map"]["samples_per_s"]:
                ratios.append(got_r["ray"]["samples_per_s"] / got_r["map"]["samples_per_s"])
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    report(runs, ratios, result)
    result["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"took {result['seconds']:.0f} s")
    print(json.dumps(result))


def report(runs: dict[str, list[dict]], ratios: list[float], result: dict) -> None:
    """The table of medians per path, where the memory and the CPU went; the figures into `result`."""
    print(f"\n{'path':<6}{'samples/s':>11}{'data share':>12}{'RSS growth MiB':>16}{'/dataset':>10}"
          f"{'anon/dataset':>14}{'loaded/ds':>11}{'in training/ds':>16}{'since build/ds':>16}{'build MiB':>11}"
          f"{'feeder MiB':>12}{'RD tasks MiB':>14}   (medians)")
    for path in PATHS:
        rr = runs[path]
        gb = med(rr, "growth_bytes")
        fe, rd = med(rr, "feeder_peak_rss"), med(rr, "ray_data_task_peak_rss_sum")
        print(f"{path:<6}{fmt(med(rr, 'samples_per_s'), '>11.1f')}{fmt(med(rr, 'data_share'), '>12.3f')}"
              f"{fmt(gb / MIB if gb is not None else None, '>16.1f')}"
              f"{fmt(med(rr, 'peak_rss_growth_over_dataset'), '>10.3f')}"
              f"{fmt(med(rr, 'anon_growth_over_dataset'), '>14.3f')}"
              f"{fmt(med(rr, 'loaded_before_training_over_dataset'), '>11.3f')}"
              f"{fmt(med(rr, 'growth_in_training_over_dataset'), '>16.3f')}"
              f"{fmt(med(rr, 'growth_since_before_build_over_dataset'), '>16.3f')}"
              f"{fmt(med(rr, 'build_overhead_bytes') / MIB if med(rr, 'build_overhead_bytes') is not None else None, '>11.0f')}"
              f"{fmt(fe / MIB if fe else None, '>12.0f')}{fmt(rd / MIB if rd else None, '>14.0f')}")
    for path in PATHS:
        print(f"{path} workers' RSS growth over their first step, peak per quarter of training (MiB), last run: "
              + "; ".join(str(g) for g in runs[path][-1]["growth_by_quarter_mib"]))
    fa, fs = med(runs["ray"], "feeder_peak_anon"), med(runs["ray"], "feeder_peak_shmem")
    if fa is not None:
        print(f"feeder actor peak: RssAnon {fa / MIB:.0f} MiB, RssShmem (object store pages touched) {fs / MIB:.0f} MiB")
    print("CPU seconds by process role (median over runs), and the largest single consumers of the last run:")
    for path in PATHS:
        roles = sorted({k for r in runs[path] for k in r["cpu_s"]})
        print(f"  {path:<5}" + "  ".join(f"{k} {statistics.median(r['cpu_s'].get(k, 0.0) for r in runs[path]):.1f}"
                                         for k in roles))
        print(f"  {'':<5}" + ", ".join(f"{k} {v:.1f}" for k, v in list(runs[path][-1]["cpu_s_detail"].items())[:7]))
    growth = med(runs["ray"], "peak_rss_growth_over_dataset")
    ratio = statistics.median(ratios) if ratios else None
    print(f"ray/map samples/s = {fmt(ratio, '.3f')} ({fmt(min(ratios) if ratios else None, '.3f')}.."
          f"{fmt(max(ratios) if ratios else None, '.3f')}; goal >= 0.90); ray peak RSS growth / dataset = "
          f"{fmt(growth, '.3f')} (goal <= 0.10)")
    result.update({
        "peak_rss_growth_over_dataset": growth,
        "peak_rss_growth_over_dataset_map": med(runs["map"], "peak_rss_growth_over_dataset"),
        "anon_growth_over_dataset": med(runs["ray"], "anon_growth_over_dataset"),
        "anon_growth_over_dataset_map": med(runs["map"], "anon_growth_over_dataset"),
        "growth_in_training_over_dataset": med(runs["ray"], "growth_in_training_over_dataset"),
        "growth_in_training_over_dataset_map": med(runs["map"], "growth_in_training_over_dataset"),
        "growth_since_before_build_over_dataset": med(runs["ray"], "growth_since_before_build_over_dataset"),
        "growth_since_before_build_over_dataset_map": med(runs["map"], "growth_since_before_build_over_dataset"),
        "build_overhead_bytes": med(runs["ray"], "build_overhead_bytes"),
        "samples_per_s_ray_over_map": ratio,
        "samples_per_s_ray_over_map_min": min(ratios) if ratios else None,
        "samples_per_s_ray_over_map_max": max(ratios) if ratios else None,
        "samples_per_s_ray": med(runs["ray"], "samples_per_s"), "samples_per_s_map": med(runs["map"], "samples_per_s"),
        "data_share_ray": med(runs["ray"], "data_share"), "data_share_map": med(runs["map"], "data_share"),
        "goal_growth_met": growth is not None and growth <= 0.10,
        "goal_ratio_met": ratio is not None and ratio >= 0.90,
        "runs": runs})


if __name__ == "__main__":
    main()
