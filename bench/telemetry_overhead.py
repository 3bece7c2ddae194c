"""What telemetry costs the step loop: steps/s with telemetry on and off, side by side.

One group of plain gloo processes (bench/local_group.py, no Ray: nothing else competes for the
two cores) trains the job in alternating blocks with `telemetry.enabled` on (DDP comm hook or
functional-collective timing, per-step data/comm marks, device sampling every second, reports
with timings) and off (DDP's built-in all-reduce, no sampler): on, off, off, on, ... The
workers rebuild the model between blocks, in the same processes, so that a process's own
quirks (where its memory landed, which core it got) weigh on both alike. Two estimates of each
block's steps/s: 1 / the median step time (slowest rank per step), which a stray pause of the
shared machine cannot move, and steps over the block's wall time, which also holds whatever
telemetry costs between steps (reports, the sampler thread). The ratio on/off is taken per pair
of neighbouring blocks, then the median over pairs.

    python bench/telemetry_overhead.py            # 16 pairs of 300-step blocks per case
    python bench/telemetry_overhead.py --quick    # 4 pairs of 100 steps
    python bench/telemetry_overhead.py --quick --case mlp-data-x2   # one case (tracking runs on the first)
    python bench/telemetry_overhead.py --smoke    # mlp-data-x2, 1 pair of 6-step blocks: that it runs (CI)

Tracking on vs off (`tracking.mlflow` to a local sqlite database and `tracking.tensorboard`):
trackers live in the controller, not in the workers, so what they can cost the step loop is the
driver-side CPU their threads take from the same two cores. In tracking-on blocks the driver runs
the real trackers (orchestrator/tracking.py: the pumps, MLflow's client on sqlite, TensorBoard's
writer) and a feeder thread hands them one step record per step, at the pace of the steps just
measured, while the workers train; off blocks run the same group with no trackers. Blocks
alternate the same way (ABBA); telemetry is on in both. The trackers' end (artifacts, report
plots) comes after the block and is not timed: it is not steady state.

Goal: on/off >= 0.99 (median step time), telemetry and tracking alike. The last line of output
is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {  # name -> (job mapping, workers)
    "mlp-data-x2": ({"model": "mlp", "parallel": {"strategy": "data"}}, 2),
    "gpt-data-x2": ({"model": {"name": "gpt", "kwargs": {"block_size": 32, "n_layer": 2, "n_embd": 64}},
                     "data": "chars", "parallel": {"strategy": "data"}}, 2),
    "gpt-tensor-x2": ({"model": {"name": "gpt", "kwargs": {"block_size": 32, "n_layer": 2, "n_embd": 64}},
                       "data": "chars", "parallel": {"strategy": "tensor"}}, 2),
}


def job_for(spec: dict, workers: int, telemetry: bool, steps: int) -> dict:
    from gearshift.orchestrator.job import job_from_dict

    raw = {**spec, "train": {"steps": steps, "global_batch_size": 32},
           "cluster": {"num_workers": workers},
           "telemetry": {"enabled": telemetry, "ray_metrics": False}}
    return job_from_dict(raw, base_dir=str(ROOT)).to_dict()


def set_telemetry(worker, enabled: bool) -> None:
    """Runs in each worker process: rebuild the model with telemetry on or off."""
    import dataclasses

    worker.config = dataclasses.replace(worker.config, telemetry=enabled)
    if worker.telemetry is not None:
        worker.telemetry.stop()
        worker.telemetry = None
    worker.build()


def run_case(name: str, pairs: int, steps: int) -> dict:
    from bench.local_group import LocalGroup

    spec, workers = CASES[name]
    group = LocalGroup(job_for(spec, workers, True, steps), workers, [str(ROOT)])
    try:
        def rates(enabled: bool) -> tuple[float, float]:
            """(1 / median step time, steps / wall time) of one block."""
            group.apply(set_telemetry, enabled)
            start = time.perf_counter()
            reports = group.call("train", steps, 0)
            wall = time.perf_counter() - start
            per_rank = [[t for r in rank_reports for t in r["step_times"]] for rank_reports in reports]
            slowest = [max(ts) for ts in zip(*per_rank)][3:]  # the first steps of a rebuilt model warm up
            return 1.0 / statistics.median(slowest), steps / wall

        rates(True), rates(False)  # warm-up: first-call imports, allocator
        median_ratios, wall_ratios, on_rates, off_rates = [], [], [], []
        for i in range(pairs):
            order = (True, False) if i % 2 == 0 else (False, True)  # ABBA: drift favours neither
            got = {enabled: rates(enabled) for enabled in order}
            on_rates.append(got[True][0])
            off_rates.append(got[False][0])
            median_ratios.append(got[True][0] / got[False][0])
            wall_ratios.append(got[True][1] / got[False][1])
    finally:
        group.close()
    return {"steps_per_s_on": statistics.median(on_rates), "steps_per_s_off": statistics.median(off_rates),
            "on_vs_off": statistics.median(median_ratios), "ratio_min": min(median_ratios),
            "ratio_max": max(median_ratios), "on_vs_off_wall": statistics.median(wall_ratios)}


class Trackers:
    """The real trackers of a job with MLflow (sqlite) and TensorBoard, fed step records at a
    given pace from a thread of the driver, as a controller would while the workers train."""

    def __init__(self, spec: dict, workers: int, root: pathlib.Path, period_s: float):
        import types

        from gearshift.orchestrator.records import tracking
        from gearshift.orchestrator.job import job_from_dict

        self.tracking = tracking
        raw = {**spec, "cluster": {"num_workers": workers},
               "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{root / 'mlflow.db'}"}, "tensorboard": True}}
        self.job = job_from_dict(raw, base_dir=str(ROOT))
        self.root, self.period_s, self.n = root, period_s, 0
        self.cpu_s: list[float] = []  # per tracked block: CPU seconds of the trackers' threads
        self.wall_s: list[float] = []
        self.report = types.SimpleNamespace(event=lambda *a, **k: None, say=lambda *a: None)

    def __enter__(self):
        import threading

        self.n += 1
        run_dir = self.root / f"block{self.n}"
        run_dir.mkdir(parents=True)
        self.pumps = self.tracking.start(self.job, run_dir, self.report)
        for pump in self.pumps:  # connected (an MLflow run created): from here on, steady state
            pump.attempted.wait(30)
        self.stop = threading.Event()
        self.feeder = threading.Thread(target=self._feed, daemon=True)
        self.feeder.start()
        self.t0 = time.monotonic()
        self.cpu0 = thread_cpu_s(self.threads())
        return self

    def _feed(self) -> None:
        step = 0
        while not self.stop.wait(self.period_s):
            step += 1
            record = {"type": "step", "time": time.time(), "step": step, "loss": 1.0 / step, "lr": 1e-3,
                      "samples_per_s": 32 / self.period_s, "comm_wait_frac_mean": 0.1, "step_time_max": self.period_s}
            for pump in self.pumps:
                pump.observe(record)

    def __exit__(self, *exc):
        self.cpu_s.append(thread_cpu_s(self.threads()) - self.cpu0)  # before the threads wind down
        self.wall_s.append(time.monotonic() - self.t0)
        self.stop.set()
        self.feeder.join(5)
        return False

    def threads(self) -> list[int]:
        """The native ids of the trackers' threads (their pumps) and of the thread feeding them."""
        import threading

        return [t.native_id for t in threading.enumerate()
                if t.name.startswith("gearshift-") or t is self.feeder]

    def finish(self) -> None:
        self.tracking.finish(self.pumps, 60, self.report)


def thread_cpu_s(native_ids: list[int]) -> float:
    """User + system CPU seconds of these threads of this process, from /proc."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for tid in native_ids:
        try:
            fields = pathlib.Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            continue
    return total


def run_tracking(name: str, pairs: int, steps: int) -> dict:
    """Steps/s with the trackers running in the driver and without, alternating, telemetry on."""
    import tempfile

    from bench.local_group import LocalGroup

    spec, workers = CASES[name]
    group = LocalGroup(job_for(spec, workers, True, steps), workers, [str(ROOT)])
    with tempfile.TemporaryDirectory(prefix="gearshift-tracking-bench-") as tmp:
        try:
            def rate() -> float:
                reports = group.call("train", steps, 0)
                per_rank = [[t for r in rank_reports for t in r["step_times"]] for rank_reports in reports]
                return 1.0 / statistics.median([max(ts) for ts in zip(*per_rank)][3:])

            group.apply(set_telemetry, True)
            base = rate()  # warm-up, and the pace the feeder keeps
            trackers = Trackers(spec, workers, pathlib.Path(tmp), 1.0 / base)
            ratios, on_rates, off_rates = [], [], []
            for i in range(pairs):
                got = {}
                for on in ((True, False) if i % 2 == 0 else (False, True)):
                    group.apply(set_telemetry, True)  # a rebuilt model, as in the telemetry blocks
                    if on:
                        with trackers:
                            got[on] = rate()
                        trackers.finish()
                    else:
                        got[on] = rate()
                on_rates.append(got[True])
                off_rates.append(got[False])
                ratios.append(got[True] / got[False])
        finally:
            group.close()
    # what the trackers take from the machine, by CPU time rather than wall clock (which cannot
    # resolve 1 % here): their threads' CPU over the tracked blocks' wall time, over all cores
    share = sum(trackers.cpu_s) / (sum(trackers.wall_s) * (os.cpu_count() or 1))
    return {"steps_per_s_on": statistics.median(on_rates), "steps_per_s_off": statistics.median(off_rates),
            "on_vs_off": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "tracker_cpu_s": sum(trackers.cpu_s), "tracked_wall_s": sum(trackers.wall_s),
            "tracker_cpu_share_of_machine": share}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 pairs of 100-step blocks per case")
    ap.add_argument("--pairs", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="steps per block")
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="run only these cases")
    ap.add_argument("--tracking-only", action="store_true", help="skip telemetry on/off; tracking on/off only")
    ap.add_argument("--smoke", action="store_true", help="mlp-data-x2 only, 1 pair of 6-step blocks, then tracking "
                    "the same way: that the bench runs")
    args = ap.parse_args()
    if args.smoke:
        args.pairs, args.steps, args.case = args.pairs or 1, args.steps or 6, args.case or ["mlp-data-x2"]
    pairs = args.pairs or (4 if args.quick else 16)
    steps = args.steps or (100 if args.quick else 300)
    results = {}
    print(f"telemetry on vs off, {pairs} block pairs x {steps} steps, on {platform.machine()} "
          f"with {os.cpu_count()} cores", flush=True)
    print(f"{'case':<16}{'on steps/s':>12}{'off steps/s':>13}{'on/off':>9}{'range':>16}{'on/off wall':>13}",
          flush=True)
    for name in [] if args.tracking_only else args.case or list(CASES):
        r = run_case(name, pairs, steps)
        results[name] = r
        print(f"{name:<16}{r['steps_per_s_on']:>12.1f}{r['steps_per_s_off']:>13.1f}{r['on_vs_off']:>9.4f}"
              f"{r['ratio_min']:>8.3f}-{r['ratio_max']:.3f}{r['on_vs_off_wall']:>13.4f}", flush=True)
    worst = min((r["on_vs_off"] for r in results.values()), default=None)
    worst_wall = min((r["on_vs_off_wall"] for r in results.values()), default=None)
    if results:
        print(f"worst case on/off = {worst:.4f} by median step time (goal >= 0.99), {worst_wall:.4f} by wall time")
    tracked = (args.case or list(CASES))[0]
    t = run_tracking(tracked, pairs, steps)
    print(f"\ntracking (mlflow sqlite + tensorboard in the driver) on vs off, {tracked}, telemetry on")
    print(f"{'case':<16}{'on steps/s':>12}{'off steps/s':>13}{'on/off':>9}{'range':>16}")
    print(f"{tracked:<16}{t['steps_per_s_on']:>12.1f}{t['steps_per_s_off']:>13.1f}{t['on_vs_off']:>9.4f}"
          f"{t['ratio_min']:>8.3f}-{t['ratio_max']:.3f}")
    print(f"tracking on/off = {t['on_vs_off']:.4f} by median step time (goal >= 0.99)")
    print(f"the trackers' threads used {t['tracker_cpu_s']:.2f} CPU-s over {t['tracked_wall_s']:.1f} s of tracked "
          f"blocks: {t['tracker_cpu_share_of_machine']:.2%} of the machine's {os.cpu_count()} cores (what they can "
          f"take from the step, at most)")
    print(json.dumps({"bench": "telemetry_overhead", "pairs": pairs, "steps_per_block": steps,
                      "cases": results, "worst_telemetry_on_vs_off_steps_per_s": worst,
                      "worst_telemetry_on_vs_off_steps_per_s_wall": worst_wall,
                      "tracking": {"case": tracked, **t}, "tracking_on_vs_off_steps_per_s": t["on_vs_off"]}))


if __name__ == "__main__":
    main()
