"""What the workers measure before the model is built, for strategy auto's first layout: the
device's rate on a matmul and the link a world-wide all-reduce crosses (`probe`). Every rank runs
it at once, as a step would: workers that share a core measure their share of it.

The link is read from the growth of an all-reduce's time with its size, so a fixed cost (latency,
a start-up) and a shaper's burst (a token bucket lets its first bytes through at once) cancel
out: the sizes double from `start_bytes` until one takes `min_s`, then that size and its half
are timed again, back to back, and the slope between them is what a byte costs. The ranks agree
on each doubling (the largest time of any rank decides), so they stay in step.
"""

from __future__ import annotations

import time
from statistics import median

import torch
import torch.distributed as dist

START_BYTES = 64 * 1024
MAX_BYTES = 32 * 2**20
MIN_S = 0.08
REPEATS = 3
MATMUL = (512, 512, 512)  # (m, k, n): a block's linear layer on a few hundred tokens
MATMUL_S = 0.1


def probe(net=None, min_s: float = MIN_S, max_bytes: int = MAX_BYTES, device: torch.device | None = None) -> dict:
    """{"flops": this rank's matmul rate, "allreduce": [[bytes, seconds], ...] the timings the
    link is fitted from, "world": ranks}. `net`: the simulated network (workers/group/simnet.py)
    whose link the all-reduce crosses, as a data-parallel layout's would. `device`: where the
    tensors live (the process group's backend's: a GPU under NCCL; only CPU under gloo has run)."""
    device = device or torch.device("cpu")
    return {"flops": matmul_rate(device=device), "allreduce": allreduce_times(net, min_s, max_bytes, device),
            "world": dist.get_world_size()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_rate(shape: tuple[int, int, int] = MATMUL, seconds: float = MATMUL_S,
                device: torch.device = torch.device("cpu")) -> float:
    """FLOP/s of fp32 matmuls of `shape` on this process's threads or its GPU (the best of short
    rounds)."""
    m, k, n = shape
    a, b = torch.randn(m, k, device=device), torch.randn(k, n, device=device)
    torch.mm(a, b)  # warm-up: the first call picks its kernel
    _sync(device)
    best, spent, rounds = 0.0, 0.0, 0
    while spent < seconds or rounds < 3:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b)
        _sync(device)
        dt = time.perf_counter() - t0
        spent, rounds = spent + dt, rounds + 1
        best = max(best, 4 * 2 * m * k * n / dt)
    return best


def _timed(nbytes: int, net, device: torch.device) -> float:
    """Seconds of one all-reduce of `nbytes` over the world, the slowest rank's."""
    t = torch.zeros(max(1, nbytes // 4), device=device)
    _sync(device)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    _sync(device)
    if net is not None:
        time.sleep(net.delay(nbytes, "dp"))
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # every rank gets the same figure: they stay in step
    return float(elapsed.item())


def allreduce_times(net=None, min_s: float = MIN_S, max_bytes: int = MAX_BYTES,
                    device: torch.device = torch.device("cpu")) -> list[list[float]]:
    """[[bytes, seconds], ...]: a small all-reduce (the fixed cost), then the doubling sizes, then
    the last size and its half `REPEATS` times each, back to back."""
    def timed(nbytes: int) -> float:
        return _timed(nbytes, net, device)

    timed(4)  # the connections made
    out = [[4.0, median(timed(4) for _ in range(REPEATS))]]
    size = START_BYTES
    while True:
        took = timed(size)
        out.append([float(size), took])
        if took >= min_s or size >= max_bytes:
            break
        size *= 2
    half = max(4, size // 2)
    for _ in range(REPEATS):
        out.append([float(half), timed(half)])
        out.append([float(size), timed(size)])
    return out
