"""`gearshift serve` under load: requests/s and p50/p99 latency at 1, 8 and 64 concurrent clients,
for adaptive batching against --max-batch 1, ONNX Runtime against PyTorch, int8 against fp32.

The model is the built-in MLP made heavy enough that its forward, not HTTP, is what a request
costs (784 -> --hidden x --layers -> 10; 80M parameters, 322 MB of fp32, at the defaults),
random weights, exported once per variant. With a lighter model the serving path's own cost
(Serve's HTTP proxy, the router's hop, the client threads, all on the same 2 cores) caps the
batched server first: at --hidden 4096 (37M parameters) batched over unbatched was 2.30 at 64
clients, against 3.13 [2.89..3.37] at 6144 (docs/benchmarks.md).

- onnx, batched:     ONNX (fp32) under onnxruntime, --max-batch 32, --batch-wait-ms 5
- onnx, unbatched:   the same with --max-batch 1
- torch, batched:    a torch.export program run by PyTorch (eager kernels), --max-batch 32
- onnx-int8, batched: onnxruntime's dynamic int8 quantisation of the ONNX model, --max-batch 32

Each variant is a real `gearshift serve` process (its own embedded Ray, one replica of one
thread), started, warmed, loaded and stopped by SIGTERM; variants are interleaved within each
repeat. Clients are threads of this process, each with its own keep-alive connection, sending
one-row requests; latency is from send to answer.

    python bench/serve.py            # 2 repeats
    python bench/serve.py --quick    # 1 repeat, fewer requests (within 10 minutes)
    python bench/serve.py --smoke    # onnx, batched, of an MLP 784-64-10, at 1 and 4 clients: that it runs (CI)

The last line is one JSON object: per variant and client count the medians over repeats of
requests/s, p50 and p99 (ms), with [min, max]; and the ratios `batched_over_unbatched_rps_64`,
`onnx_over_torch_rps_64`, `int8_over_fp32_rps_64`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import pathlib
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {"onnx-batched": ("fp32.onnx", 32), "onnx-unbatched": ("fp32.onnx", 1),
            "torch-batched": ("fp32.pt2", 32), "onnx-int8-batched": ("int8.onnx", 32)}


def build(folder: pathlib.Path, hidden: int, layers: int) -> None:
    import torch

    from gearshift.serving import artifact
    from gearshift.workers.build import models

    torch.manual_seed(0)
    model = models.MLP(784, hidden, 10, layers=layers).eval()
    x = torch.randn(2, 1, 28, 28)
    record = {"version": "bench", "input_shape": [1, 28, 28], "input_dtype": "float32"}
    artifact.export_onnx(model, x, folder / "fp32.onnx", {**record, "version": "fp32"})
    artifact.quantize_onnx(folder / "fp32.onnx", folder / "int8.onnx")
    artifact.export_program(model, x, folder / "fp32.pt2", {**record, "version": "torch"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(folder: pathlib.Path, file: str, max_batch: int):
    port = free_port()
    state = folder / f"state-{port}.json"
    log = open(folder / f"serve-{port}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "gearshift", "serve", str(folder / file), "--port", str(port),
                             "--max-batch", str(max_batch), "--batch-wait-ms", "5", "--state", str(state)],
                            cwd=folder, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 180
    while not state.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise SystemExit(f"gearshift serve did not come up: {(folder / f'serve-{port}.log').read_text()[-2000:]}")
        time.sleep(0.5)
    return proc, port


def stop(proc) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def load(port: int, clients: int, requests: int) -> dict:
    import numpy as np

    body = json.dumps({"inputs": np.random.default_rng(0).standard_normal((1, 1, 28, 28)).round(4).tolist()})
    per = max(1, requests // clients)

    def client(_):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        times = []
        for _ in range(per):
            t = time.perf_counter()
            conn.request("POST", "/predict", body, {"content-type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                raise RuntimeError(f"status {r.status}")
            times.append(time.perf_counter() - t)
        conn.close()
        return times

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        times = [t for ts in pool.map(client, range(clients)) for t in ts]
    wall = time.perf_counter() - t0
    times.sort()
    return {"rps": len(times) / wall, "p50_ms": 1e3 * times[len(times) // 2],
            "p99_ms": 1e3 * times[min(len(times) - 1, int(0.99 * len(times)))], "requests": len(times)}


def replica_rss_mb(port_proc) -> float:
    """Peak resident memory of the variant's replica process (Linux VmHWM), in MiB."""
    import psutil

    for p in psutil.process_iter(["cmdline"]):
        try:
            if "ServeReplica:gearshift:stable" in " ".join(p.info["cmdline"] or []):
                for line in open(f"/proc/{p.pid}/status"):
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
            continue
    return float("nan")


def spread(values: list[float]) -> list:
    return [round(statistics.median(values), 3), [round(min(values), 3), round(max(values), 3)]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, fewer requests")
    ap.add_argument("--repeats", type=int)
    ap.add_argument("--hidden", type=int, default=6144)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--clients", default="1,8,64")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="which of " + ", ".join(VARIANTS))
    ap.add_argument("--smoke", action="store_true", help="onnx-batched only, an MLP 784-64-10, 1 and 4 clients, "
                    "20 requests at one: that the bench runs (each variant is a server of its own, ~20 s)")
    args = ap.parse_args()
    if args.smoke:
        args.hidden, args.layers, args.clients, args.variants = 64, 1, "1,4", "onnx-batched"
    unknown = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; the variants are {', '.join(VARIANTS)}")
    variants = {name: VARIANTS[name] for name in args.variants.split(",")}
    repeats = args.repeats or (1 if args.quick or args.smoke else 2)
    counts = [int(c) for c in args.clients.split(",")]
    base = 20 if args.smoke else 40 if args.quick else 120  # requests at one client; more clients send more
    with tempfile.TemporaryDirectory(prefix="gearshift-bench-serve-") as tmp:
        folder = pathlib.Path(tmp)
        build(folder, args.hidden, args.layers)
        sizes = {f: (folder / f).stat().st_size for f in ("fp32.onnx", "int8.onnx", "fp32.pt2")}
        print(f"model sizes: {json.dumps(sizes)}", flush=True)
        runs: dict = {}
        rss: dict = {}
        for rep in range(repeats):
            for name, (file, max_batch) in variants.items():
                proc, port = start(folder, file, max_batch)
                try:
                    for c in counts:
                        load(port, c, min(4 * c, 8))  # warm the connection path too
                        got = load(port, c, base * max(1, c // 4) if c > 1 else base)
                        runs.setdefault(name, {}).setdefault(str(c), []).append(got)
                        print(f"repeat {rep} {name:18} clients {c:3}: {got['rps']:8.1f} req/s  p50 "
                              f"{got['p50_ms']:8.2f} ms  p99 {got['p99_ms']:8.2f} ms", flush=True)
                    rss.setdefault(name, []).append(replica_rss_mb(proc))
                finally:
                    stop(proc)
    result: dict = {"sizes": sizes, "variants": {},
                    "replica_peak_rss_mib": {k: spread(v) for k, v in rss.items()}}
    for name, by_c in runs.items():
        result["variants"][name] = {c: {k: spread([r[k] for r in rs]) for k in ("rps", "p50_ms", "p99_ms")}
                                    for c, rs in by_c.items()}
    top = str(max(counts))

    for key, a, b in (("batched_over_unbatched", "onnx-batched", "onnx-unbatched"),
                      ("onnx_over_torch", "onnx-batched", "torch-batched"),
                      ("int8_over_fp32", "onnx-int8-batched", "onnx-batched")):
        if a in runs and b in runs:  # both variants measured
            result[f"{key}_rps_{top}"] = spread([x["rps"] / y["rps"] for x, y in zip(runs[a][top], runs[b][top])])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
