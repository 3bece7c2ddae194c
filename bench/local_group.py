"""TrainWorkers in plain processes over gloo, without Ray: for benchmarks and tests that look at
the step loop itself (not part of gearshift: its runs go through Ray's worker group) (its timing, its overhead) with nothing else on the machine's two cores.

Each process holds one TrainWorker and answers calls sent over a pipe, like a tiny actor; a
generator method (`train`) comes back as the list of what it yielded. Every wait is bounded,
and `close()` stops the processes by their handles, whatever state they are in.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from typing import Any


def _serve(conn, job: dict, search_paths: list[str], rank: int, world: int, port: int, cpus: float) -> None:
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
                 timeout_s: float = 300.0, daemon: bool = True):
        # daemon=False lets a worker start processes of its own (data.loader.workers > 0: a
        # daemonic process may not have children); close() still stops every process it started
        ctx = mp.get_context("spawn")  # forking a process that has run torch is unsafe
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.timeout_s = timeout_s
        self.conns, self.procs = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, job, search_paths or ["."], rank, world, port, cpus),
                               daemon=daemon)
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
