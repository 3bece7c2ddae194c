"""Where the CPU goes during an embedded `gearshift run`'s steady state: every process beside
the two workers (Ray's GCS, raylet, agents, idle workers, the driver) and every thread of the
driver and the workers, as CPU time over a window of steps.

    python bench/attribute.py                       # examples/gpt.yaml, 2 workers, 300 steps
    python bench/attribute.py --set telemetry.enabled=false --label "telemetry off"
    python bench/attribute.py --from 0 --to 1 --steps 40   # from the command to the first step
    python bench/attribute.py --smoke                       # 16 steps, steps 4..12: that it runs (CI)

The job runs as a user would start it (a subprocess, its own embedded Ray). Once its telemetry
shows step `--from`, every process in its tree is read (psutil: user + system CPU time, and per
thread from /proc); again at step `--to`. The table gives each part's CPU time over the window
as a share of one core and of the machine, largest first. The workers' own threads are broken
out, so gearshift's samplers and sinks inside them show too. The last line is JSON.

CPU time, not wall time: the figures hold even when the machine's speed drifts, and they add up
to what the two cores were asked to do beside the training.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
JOB = ROOT / "examples" / "gpt.yaml"

# the process kinds of an embedded Ray, by what their command line holds
KINDS = [("ray::TrainWorker", "worker"), ("ray::Feeder", "data feeder"), ("ray::IDLE", "Ray idle worker"),
         ("gcs_server", "Ray GCS"), ("raylet", "Ray raylet"), ("dashboard/agent.py", "Ray dashboard agent"),
         ("ray::DashboardAgent", "Ray dashboard agent"), ("ray::RuntimeEnvAgent", "Ray runtime-env agent"),
         ("runtime_env/agent", "Ray runtime-env agent"), ("log_monitor", "Ray log monitor"),
         ("dashboard/dashboard.py", "Ray dashboard"), ("monitor.py", "Ray autoscaler monitor"),
         ("-m gearshift", "gearshift driver"), ("ray::", "Ray worker (other)")]


def kind_of(proc: psutil.Process) -> str:
    try:
        cmd = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return "gone"
    for needle, kind in KINDS:
        if needle in cmd:
            return kind
    return f"other ({proc.name()})"


def threads(pid: int) -> dict[str, float]:
    """CPU seconds per thread name of one process (threads of one name added up)."""
    out: dict[str, float] = collections.defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK")
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                name = pathlib.Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                fields = pathlib.Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
                out[name] += (int(fields[11]) + int(fields[12])) / tick
            except (OSError, IndexError, ValueError):
                continue
    except OSError:
        pass
    return out


def snapshot(root: psutil.Process) -> dict:
    procs = {}
    for p in [root] + root.children(recursive=True):
        try:
            t = p.cpu_times()
            procs[p.pid] = {"kind": kind_of(p), "cpu": t.user + t.system, "threads": threads(p.pid)}
        except psutil.Error:
            continue
    return {"time": time.monotonic(), "procs": procs}


def last_step(telemetry: pathlib.Path) -> int:
    if not telemetry.exists():
        return 0
    best = 0
    for line in telemetry.read_text().splitlines()[-200:]:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if r.get("type") == "step":
            best = max(best, r["step"])
    return best


def attribute(a: dict, b: dict) -> tuple[float, dict[str, float], dict[str, float]]:
    """(window s, CPU s per process kind, CPU s per thread of driver and workers)."""
    window = b["time"] - a["time"]
    kinds: dict[str, float] = collections.defaultdict(float)
    threads_by: dict[str, float] = collections.defaultdict(float)
    for pid, pb in b["procs"].items():
        pa = a["procs"].get(pid, {"cpu": 0.0, "threads": {}})
        kinds[pb["kind"]] += pb["cpu"] - pa["cpu"]
        if pb["kind"] in ("worker", "gearshift driver"):
            for name, cpu in pb["threads"].items():
                threads_by[f"{pb['kind']}: {name}"] += cpu - pa["threads"].get(name, 0.0)
    return window, dict(kinds), dict(threads_by)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--from", dest="start", type=int, default=60)
    ap.add_argument("--to", dest="end", type=int, default=260)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--set", action="append", default=[], help="a job override, as for gearshift run")
    ap.add_argument("--label", default="default")
    ap.add_argument("--smoke", action="store_true", help="16 steps, the window steps 4..12: that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        args.steps, args.start, args.end = 16, 4, 12
    with tempfile.TemporaryDirectory(prefix="gs-attribute-") as tmp:
        run_dir = pathlib.Path(tmp) / "run"
        cmd = [sys.executable, "-m", "gearshift", "run", str(JOB), "--run-dir", str(run_dir),
               "--set", "cluster.num_workers=2", "--set", f"train.steps={args.steps}", "--set",
               f"train.global_batch_size={args.batch}", "--set", "checkpoint.every=0", "--set",
               "parallel.strategy=data"] + [a for s in args.set for a in ("--set", s)]
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        root = psutil.Process(proc.pid)
        snaps, deadline = [], time.monotonic() + 900
        try:
            for target in (args.start, args.end):
                while last_step(run_dir / "telemetry.jsonl") < target:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        raise SystemExit(f"the run ended or stalled before step {target}: {proc.stderr.read()[-2000:]}")
                    time.sleep(0.05)
                snaps.append(snapshot(root))
            proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    window, kinds, by_thread = attribute(*snaps)
    total = sum(kinds.values())
    print(f"{args.label}: steps {args.start}..{args.end}, {window:.1f} s window, {os.cpu_count()} cores "
          f"({platform.machine()}); CPU seconds, share of one core")
    for name, cpu in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {name:<34}{cpu:>8.2f} s {cpu / window:>7.1%}")
    print(f"  {'all':<34}{total:>8.2f} s {total / window:>7.1%}")
    print("threads of the driver and the workers:")
    for name, cpu in sorted(by_thread.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {name:<34}{cpu:>8.2f} s {cpu / window:>7.1%}")
    print(json.dumps({"bench": "attribute", "label": args.label, "window_s": window, "cpu_s": kinds,
                      "threads_cpu_s": by_thread, "steps": [args.start, args.end]}))


if __name__ == "__main__":
    main()
