"""TrainWorkers in plain processes over gloo, without Ray: for benchmarks and tests that look at
the step loop itself (not part of gearshift: its runs go through Ray's worker group) (its timing, its overhead) with nothing else on the machine's two cores.

Each process holds one TrainWorker and answers calls sent over a pipe, like a tiny actor; a
generator method (`train`) comes back as the list of what it yielded. Every wait is bounded,
and `close()` stops the processes by their handles, whatever state they are in.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback
from typing import Any


# What _serve imports first, before anything is measured: the fork server imports it once and
# forks each worker from itself, so a group's start costs a fork per worker instead of importing
# torch and gearshift again (1.5 to 2.5 s of a core each on a 2-core machine). The fork server is a
# process that has run nothing: the bench's own process has, and forking that would be unsafe. What
# a worker imports later (in its build, its first step) it imports itself, as before, so no
# measured phase changes.
PRELOAD = ["gearshift.workers.worker"]


def _context(start: str):
    if start == "spawn":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _serve(conn, env: dict[str, str], job: dict, search_paths: list[str], rank: int, world: int, port: int,
           cpus: float) -> None:
    # the bench's environment now, as a spawned process would have it (a forked one has the fork
    # server's). What the C library reads only as a process starts (glibc's MALLOC_* settings) is
    # the fork server's: a bench sets it before its first group, as every bench here does.
    os.environ.clear()
    os.environ.update(env)
    from gearshift.workers.worker import TrainWorker, WorkerConfig

    worker = TrainWorker(WorkerConfig.from_job(job, search_paths), cpus)
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, args = msg
            try:
                if method == "setup":
                    result = worker.setup(rank, world, "127.0.0.1", port, 120.0)
                elif callable(method):  # apply(): a module-level function run on the worker
                    result = method(worker, *args)
                else:
                    result = getattr(worker, method)(*args)
                    if method == "train":
                        result = list(result)
                conn.send(("ok", result))
            except BaseException as err:  # sent back; the caller raises it
                conn.send(("error", f"rank {rank}: {type(err).__name__}: {err}\n{traceback.format_exc()}"))
    finally:
        worker.shutdown()


class LocalGroup:
    def __init__(self, job: dict, world: int, search_paths: list[str] | None = None, cpus: float = 1.0,
                 timeout_s: float = 300.0, daemon: bool = True, start: str = "forkserver"):
        """`start`: "forkserver" (the default: forked from the fork server, torch and gearshift
        imported) or "spawn" (a fresh interpreter each), for a bench that measures the resident
        set: a forked process has not faulted the libraries' pages in, so its RSS starts lower and
        grows as it touches them, which a spawned one did while importing."""
        # daemon=False lets a worker start processes of its own (data.loader.workers > 0: a
        # daemonic process may not have children); close() still stops every process it started
        ctx = _context(start)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, dict(os.environ), job, search_paths or ["."], rank, world,
                                                    port, cpus), daemon=daemon)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.call("setup")
            self.infos = self.call("build")
        except BaseException:
            self.close()
            raise

    def call(self, method, *args: Any) -> list:
        for conn in self.conns:
            conn.send((method, args))
        results = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"rank {rank} did not answer {getattr(method, '__name__', method)!r} "
                                   f"within {self.timeout_s:g} s")
            status, value = conn.recv()
            if status == "error":
                raise RuntimeError(value)
            results.append(value)
        return results

    def apply(self, fn, *args: Any) -> list:
        """Run `fn(worker, *args)` in every process (fn must be importable there)."""
        return self.call(fn, *args)

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self.conns, self.procs = [], []

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
