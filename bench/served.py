"""Checkpoints through the driver's file server (workers/state/fileserver.py) against the same
checkpoints written straight to the folder: what a cluster without a shared file system pays.

One Ray actor (a rank of a one-process gloo group) holds the built-in GPT and its Adam state and
saves / loads a DCP checkpoint of it, alternately straight into a local folder and through a
FileServer actor (the fsspec URL gearshift://SERVER/path), as TrainWorker.checkpoint and
TrainWorker.load do. Each process's peak growth per phase is sampled every 2 ms (RSS and its
private and shared parts), the kernel's high-water mark (VmHWM, reset before the phase) backing
up the total.

    python bench/served.py            # GPT n_layer 8 (about 80M parameters), 3 repeats
    python bench/served.py --quick    # n_layer 2, 2 repeats
    python bench/served.py --smoke    # a GPT of 0.1M parameters, 1 repeat: that it runs (CI)

Prints a table, then, as its last line, one JSON object: `served_over_direct_save` and
`served_over_direct_load` (medians of the per-repeat ratios, with their spread), and
`server_growth_over_checkpoint_bytes` (the server's largest peak growth over the bytes it moved),
split into its own memory (RssAnon) and the pages of Ray's object store it mapped (RssShmem:
every block crosses the object store).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shutil
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":")[0]
            if key in ("VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(line.split()[1]) * 1024
    return out


class _Peaks:
    """The peak of RSS and of its parts (private: RssAnon; the object store's shared pages:
    RssShmem) in this process since the last `reset`, sampled every 2 ms by a thread, the kernel's
    VmHWM backing up the total."""

    def __init__(self):
        import threading

        self.base, self.peak = _status(), _status()
        self.lock = threading.Lock()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        while True:
            now = _status()
            with self.lock:
                self.peak = {k: max(v, self.peak.get(k, 0)) for k, v in now.items()}
            time.sleep(0.002)

    def reset(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        with self.lock:
            self.base = _status()
            self.peak = dict(self.base)

    def growth(self) -> dict[str, int]:
        with self.lock:
            got = {k: self.peak[k] - self.base[k] for k in ("VmRSS", "RssAnon", "RssShmem")}
        with open("/proc/self/status") as f:
            hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
        got["VmRSS"] = max(got["VmRSS"], hwm - self.base["VmRSS"])
        return got


class Rank:
    """A one-rank group holding the GPT and its Adam state."""

    def __init__(self, model: dict):
        import socket

        import torch
        import torch.distributed as dist

        from gearshift.workers.build import models

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        torch.manual_seed(0)
        self.model = models.gpt(**model)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        x = torch.randint(0, model["vocab_size"], (2, model["block_size"]))
        self.model(x).float().mean().backward()
        self.opt.step()
        self.peaks = _Peaks()

    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def save(self, folder: str) -> dict:
        from gearshift.workers.state import dcp, storage

        self.peaks.reset()
        start = time.perf_counter()
        files = dcp.save(self.model, self.opt, storage.location(folder), 0, 1, {"scaler": {}, "step": 1})
        return {"s": time.perf_counter() - start, "growth": self.peaks.growth(),
                "bytes": sum(f["bytes"] for f in files.values())}

    def load(self, folder: str) -> dict:
        from gearshift.workers.state import dcp, storage

        self.peaks.reset()
        start = time.perf_counter()
        dcp.load(self.model, self.opt, storage.location(folder))
        return {"s": time.perf_counter() - start, "growth": self.peaks.growth()}


def _server_class():
    from gearshift.workers.state.fileserver import FileServer

    class MeasuredServer(FileServer):
        def reset(self) -> None:
            if not hasattr(self, "peaks"):
                self.peaks = _Peaks()
            self.peaks.reset()

        def growth(self) -> dict[str, int]:
            return self.peaks.growth()

    return MeasuredServer


def figures_of(rows: dict[str, list], server_growth: list[dict], nbytes: int) -> dict:
    """served / direct per repeat (median and spread), the medians of each, the rank's and the
    server's largest growth, and the server's over the checkpoint's bytes."""
    ratio = {op: [s["s"] / d["s"] for s, d in zip(rows[op + "_served"], rows[op + "_direct"])]
             for op in ("save", "load")}
    figures = {}
    for op in ("save", "load"):
        figures[f"served_over_direct_{op}"] = statistics.median(ratio[op])
        figures[f"served_over_direct_{op}_spread"] = [min(ratio[op]), max(ratio[op])]
        for how in ("direct", "served"):
            figures[f"{op}_s_{how}"] = statistics.median(r["s"] for r in rows[f"{op}_{how}"])
            for part, key in (("rss", "VmRSS"), ("own", "RssAnon"), ("store", "RssShmem")):
                figures[f"{op}_rank_growth_{part}_bytes_{how}"] = max(r["growth"][key] for r in rows[f"{op}_{how}"])
    for part, key in (("rss", "VmRSS"), ("own", "RssAnon"), ("store", "RssShmem")):
        figures[f"server_growth_{part}_bytes"] = max(g[key] for g in server_growth)
    figures["server_growth_over_checkpoint_bytes"] = figures["server_growth_rss_bytes"] / nbytes
    figures["server_own_growth_over_checkpoint_bytes"] = figures["server_growth_own_bytes"] / nbytes
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model, 2 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--n-layer", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="a GPT of 0.1M parameters, 1 repeat: that the bench runs")
    args = ap.parse_args()
    repeats = args.repeats or (1 if args.smoke else 2 if args.quick else 3)
    model = ({"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 64} if args.smoke else
             {"vocab_size": 16384, "block_size": 64, "n_layer": args.n_layer or (2 if args.quick else 8), "n_head": 12,
              "n_embd": 768})

    import ray

    from gearshift.workers.state import fileserver

    work = pathlib.Path(tempfile.mkdtemp(prefix="gearshift-served-"))
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR")
    try:
        name = "gearshift-files-bench"
        server = ray.remote(_server_class()).options(name=name, num_cpus=0, max_concurrency=fileserver.IN_FLIGHT).remote(str(work))
        ray.get(server.mark.remote(name), timeout=120)
        rank = ray.remote(Rank).options(num_cpus=1).remote(model)
        params = ray.get(rank.parameters.remote(), timeout=600)
        print(f"bench/served.py on {platform.machine()} with {os.cpu_count()} cores; GPT {params:,} parameters, "
              f"Adam; {repeats} repeats, direct and served alternating")
        rows: dict[str, list] = {"save_direct": [], "save_served": [], "load_direct": [], "load_served": []}
        server_growth: list[int] = []
        nbytes = 0
        for i in range(repeats):
            for how in (("direct", "served") if i % 2 == 0 else ("served", "direct")):
                folder = work / f"{how}-{i}"
                where = fileserver.url(name, str(folder)) if how == "served" else str(folder)
                ray.get(server.reset.remote(), timeout=60)
                saved = ray.get(rank.save.remote(where), timeout=1800)
                loaded = ray.get(rank.load.remote(where), timeout=1800)
                if how == "served":
                    server_growth.append(ray.get(server.growth.remote(), timeout=60))
                nbytes = saved["bytes"]
                rows["save_" + how].append(saved)
                rows["load_" + how].append(loaded)
                mib = lambda g: f"+{g['VmRSS'] / 2**20:4.0f} MiB: {g['RssAnon'] / 2**20:4.0f} own, {g['RssShmem'] / 2**20:4.0f} store"  # noqa: E731
                print(f"  repeat {i}  {how:<7} save {saved['s']:6.2f} s ({mib(saved['growth'])})  "
                      f"load {loaded['s']:6.2f} s ({mib(loaded['growth'])})"
                      + (f"  server ({mib(server_growth[-1])})" if how == "served" else ""))
                shutil.rmtree(folder, ignore_errors=True)
        figures = {"bench": "served", "quick": args.quick, "parameters": params, "checkpoint_bytes": nbytes,
                   "repeats": repeats, **figures_of(rows, server_growth, nbytes)}
        print(f"\ncheckpoint {nbytes / 2**20:.0f} MiB; served / direct: save {figures['served_over_direct_save']:.2f} "
              f"{figures['served_over_direct_save_spread']}, load {figures['served_over_direct_load']:.2f} "
              f"{figures['served_over_direct_load_spread']}; the server's peak growth "
              f"{figures['server_growth_rss_bytes'] / 2**20:.0f} MiB, of which its own memory "
              f"{figures['server_growth_own_bytes'] / 2**20:.0f} MiB and the object store's pages "
              f"{figures['server_growth_store_bytes'] / 2**20:.0f} MiB")
        print(json.dumps(figures))
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
