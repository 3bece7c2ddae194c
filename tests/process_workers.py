"""A worker group without Ray, for the tests whose subject is training, not Ray.

gearshift's controller drives its workers through the `WorkerGroup` interface
(orchestrator/cluster/group.py); a run on Ray gets `RayWorkerGroup`, one actor per worker, each a
new process that imports torch and gearshift again (2.5 to 3.6 s of a 2-core machine per run).
`ProcessWorkerGroup` holds each rank's TrainWorker in a process of the warm pool of
tests/gloo_pool.py instead: the same TrainWorker, the same controller and the same calls, in
processes that have imported torch once for the whole pytest process. The `local_workers`
fixture (conftest.py) makes every run a test starts in-process (`gearshift.api.train`, so
`cli.main(["run", ...])` and `gearshift.run(...)` alike) use it.

Under fault.on_node_loss elastic a lost worker's process is seen gone at once (its pipe and its
sentinel); the survivors' loops end as on Ray (their collectives lose it, each reporting where
it stopped), and the group then goes on in memory on the survivors (`shrink`: each survivor's
real TrainWorker.rejoin) or the controller restarts it from the checkpoint.

What it does not do, so the tests of these stay on Ray: placement and nodes (one node, here),
cluster.env (set before a process starts), streamed datasets (Ray Data's feeders), the file
server, heartbeats (a silence is measured from the last report instead), Ray's own account of a
lost worker (lost.py's probe, a node's death), and placement's account of free places: a grow
takes pool processes into as many places as a test gives (`SLOTS`; none by default, so a run
grows only where a test asks it to).

Every wait is bounded: a call by the group's call timeout, the step loop by the job's collective
timeout plus a margin since the last report. A failed or timed-out run ends the pool's processes
(a rank may still sit in a collective) and the next run starts fresh ones.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator

import gloo_pool
from gearshift.orchestrator.errors import WorkerFailed

STALL_MARGIN_S = 30.0  # past the collective timeout with no report from any rank: stuck
RELEASE_S = 30.0  # a finished run's workers shut down (a final write settles) within this
RELEASE_AFTER_FAILURE_S = 5.0  # after a failure: a rank not done by then waits in a collective
_IDS = itertools.count(1)


class ProcessWorkerGroup:
    """The WorkerGroup interface on warm pool processes (see the module's text)."""

    def __init__(self, job, checkpoint_dir: str | None = None):
        from gearshift.orchestrator.cluster.calls import CALL_MARGIN_S, CALL_TIMEOUT_S

        self.job = job
        self.checkpoint_dir = checkpoint_dir
        self.members: list[tuple] = []  # (process, connection), index = rank
        self.infos: list[dict] = []
        self.chunk = 0
        self.call_timeout_s = max(job.fault.collective_timeout_s + CALL_MARGIN_S, CALL_TIMEOUT_S)
        self.choose_layout = None  # strategy auto: set by the controller, as on RayWorkerGroup
        self.start_layout = None
        self.gone: dict[int, str] = {}  # ranks whose process died, with why

    # the places the cluster has now, given the group (its `chunk`: training chunks begun), for
    # joinable; a test sets it. None: the run's own places only
    SLOTS: Callable[["ProcessWorkerGroup"], int] | None = None

    # ---------------------------------------------------------------- start

    def start(self) -> list[dict]:
        from gearshift.orchestrator.cluster.placement import Placement
        from gearshift.workers.worker import WorkerConfig

        job = self.job
        world = job.cluster.num_workers
        config = WorkerConfig.from_job(job.to_dict(), [job.base_dir], self.checkpoint_dir)
        self.members = gloo_pool.HOSTS.take(world)
        for _, conn in self.members:
            conn.send(("host", config, job.cluster.cpus_per_worker))
        self.infos = self.call("node_info")
        port = _free_port()
        self._each(lambda rank: ("setup", (rank, world, "127.0.0.1", port, job.fault.collective_timeout_s)), "setup")
        if self.choose_layout is not None:
            for info, memory in zip(self.infos, self.call("device_memory"), strict=True):
                info["device_memory"] = memory
            self.start_layout = self.choose_layout(self.infos)
        placement = Placement.__new__(Placement)  # only its layout rule (hsdp's group from the nodes)
        placement.job = job
        layout = placement.layout(self.infos, self.start_layout)
        builds = self.call("build", layout.to_dict())
        for rank, (info, built) in enumerate(zip(self.infos, builds, strict=True)):
            info.update(rank=rank, backend="gloo", **built)
        return self.infos

    # ---------------------------------------------------------------- calls

    def call(self, method: str, *args, timeout: float | None = None) -> list:
        return self._each(lambda rank: (method, args), method, timeout)

    def _each(self, request, what: str, timeout: float | None = None, ranks: list[int] | None = None) -> list:
        """`request(rank)` = (method, args) called on each of `ranks` (default: all), their results."""
        ident = next(_IDS)
        ranks = list(range(len(self.members))) if ranks is None else ranks
        for rank in ranks:
            method, args = request(rank)
            self._send(rank, ("call", ident, method, args))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + (timeout or self.call_timeout_s)
        while len(results) < len(ranks):
            rank, msg = self._receive(set(ranks) - set(results), deadline, what, None)
            if msg[1] != ident:
                continue  # an answer to a call abandoned earlier
            if msg[0] == "error":
                raise _raised(None, msg)
            results[rank] = msg[2]
        return [results[r] for r in ranks]

    def put(self, value: Any) -> Any:
        return value  # handed to each process by the pipe

    def train(self, until_step: int, checkpoint_every: int, stall_timeout_s: float | None = None,
              last_step: int | None = None, stoppable: bool = False) -> Iterator[tuple[int, dict]]:
        self.chunk += 1
        ident = next(_IDS)
        args = (until_step, checkpoint_every, 0.0 if stoppable else 0.5, last_step,
                self.chunk if stoppable else None, self.job.checkpoint.async_save)
        for rank in range(len(self.members)):
            self._send(rank, ("train", ident, args))
        silence = stall_timeout_s or self.job.fault.collective_timeout_s + STALL_MARGIN_S
        running = set(range(len(self.members)))
        lost: dict[int, WorkerFailed] = {}  # elastic: ranks gone while the survivors' loops end
        while running:
            try:
                rank, msg = self._receive(running, time.monotonic() + silence, "train", silence)
            except WorkerFailed as err:
                if self.job.on_node_loss != "elastic" or err.kind != WorkerFailed.DIED:
                    raise
                err.detected = time.time()
                lost[err.rank] = err
                running.discard(err.rank)
                continue
            if msg[1] != ident:
                continue
            if msg[0] == "error":
                raise _raised(rank, msg)
            if msg[0] == "done":
                running.discard(rank)
                continue
            yield rank, msg[2]
        if lost:  # as RayWorkerGroup's stream: the lowest lost rank's failure, naming every lost rank
            err = lost[min(lost)]
            err.lost_ranks = sorted(lost)
            raise err

    def stop_early(self) -> None:
        for rank in range(len(self.members)):
            with contextlib.suppress(OSError):
                self._send(rank, ("stop", self.chunk))

    def regroup(self) -> None:
        port = _free_port()
        self.call("rejoin", "127.0.0.1", port, self.job.fault.collective_timeout_s)

    def shrink(self, keep: list[int], layout: dict, behind: list[int] = ()) -> list[dict]:
        """Elastic: go on with the workers of ranks `keep` (new rank i is keep[i]) on a new process
        group in `layout`, as RayWorkerGroup's Membership.shrink: the others' sessions end (a dead
        or stuck process is replaced in the pool), the ranks in `behind` receive the state as a
        joining worker would. Each survivor's rejoin result."""
        joining = self._each(lambda rank: ("describe", ()), "describe", ranks=[keep[0]])[0] if behind else None
        left = [self.members[r] for r in range(len(self.members)) if r not in keep]
        self.members = [self.members[r] for r in keep]
        self.infos = [dict(self.infos[r], rank=i) for i, r in enumerate(keep)]
        self.gone = {}
        gloo_pool.HOSTS.release(left, RELEASE_AFTER_FAILURE_S)
        old_ranks = [None if r in behind else r for r in keep]
        port, t, world = _free_port(), self.job.fault.collective_timeout_s, len(keep)
        return self._each(lambda i: ("rejoin", ("127.0.0.1", port, t, i, world, layout, old_ranks,
                                                joining if old_ranks[i] is None else None)), "rejoin")

    def joinable(self) -> int:
        """Elastic: how many workers could join now. The pool has a process for any place; a test
        says how many places the cluster has (`SLOTS`: a node that joined, a lost place back);
        by default none beyond the run's own, so a run grows only where a test asks it to."""
        return 0 if self.SLOTS is None else max(0, self.SLOTS(self) - len(self.members))

    def joining(self, count: int) -> list[dict]:
        return [{k: v for k, v in self.infos[0].items() if k != "rank"} for _ in range(count)]  # this node

    def grow(self, count: int, layout: dict) -> list[dict]:
        """Elastic: `count` pool processes join as the last ranks, each hosting a TrainWorker; every
        worker forms a new process group and the state moves onto `layout`, the newcomers
        receiving their pieces (TrainWorker.rejoin), as RayWorkerGroup's Membership.grow."""
        from gearshift.workers.worker import WorkerConfig

        joining = self._each(lambda rank: ("describe", ()), "describe", ranks=[0])[0]
        config = WorkerConfig.from_job(self.job.to_dict(), [self.job.base_dir], self.checkpoint_dir)
        new = gloo_pool.HOSTS.take_more(count, self.members)
        for _, conn in new:
            conn.send(("host", config, self.job.cluster.cpus_per_worker))
        old_world = len(self.members)
        self.members += new
        infos = self._each(lambda rank: ("node_info", (True,)), "node_info",  # warm: to join a running group
                           ranks=list(range(old_world, old_world + count)))
        self.infos += [dict(info, rank=old_world + i) for i, info in enumerate(infos)]
        old_ranks = list(range(old_world)) + [None] * count
        port, t, world = _free_port(), self.job.fault.collective_timeout_s, len(self.members)
        return self._each(lambda i: ("rejoin", ("127.0.0.1", port, t, i, world, layout, old_ranks,
                                                joining if old_ranks[i] is None else None)), "rejoin")

    # ---------------------------------------------------------------- what the controller asks of the cluster

    def dead_ranks(self) -> dict[int, str]:
        dead = dict(self.gone)
        for rank, (proc, _) in enumerate(self.members):
            if rank not in dead and gloo_pool.ended(proc):
                dead[rank] = f"its process (pid {proc.pid}) died (exit code {proc.exitcode})"
        return dead

    def alive_node_ids(self) -> set[str]:
        return {info["node_id"] for info in self.infos} if self.infos else set()

    def alive_node_resources(self) -> list[dict[str, float]]:
        return [{"CPU": float(os.cpu_count() or 1)}]

    def shutdown(self, polite: bool = True) -> None:
        """Each worker's session ended; a process that does not end it in time (after a failure: a
        rank stuck in a collective with a lost peer) is stopped and replaced, the others serve
        the next run."""
        members, self.members = self.members, []
        if members:
            gloo_pool.HOSTS.release(members, RELEASE_S if polite else RELEASE_AFTER_FAILURE_S)

    # ---------------------------------------------------------------- the pipe

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self.members[rank][1].send(msg)
        except (OSError, BrokenPipeError):
            raise self._died(rank) from None

    def _receive(self, ranks: set[int], deadline: float, what: str, silence: float | None) -> tuple[int, tuple]:
        """The next message of one of `ranks`; a WorkerFailed where a process died, or where none
        answered by `deadline`."""
        conns = {self.members[r][1]: r for r in ranks}
        sentinels = {self.members[r][0].sentinel: r for r in ranks}
        left = deadline - time.monotonic()
        ready = wait(list(conns) + list(sentinels), timeout=max(0.0, left)) if left > 0 else []
        for item in ready:
            if item in conns:
                try:
                    return conns[item], item.recv()
                except (EOFError, OSError):
                    raise self._died(conns[item]) from None
        for item in ready:
            raise self._died(sentinels[item])
        if silence is not None:
            raise WorkerFailed(None, f"no rank reported for {silence:g} s (the collective timeout plus "
                                     f"{STALL_MARGIN_S:g} s)", kind=WorkerFailed.SILENT)
        raise WorkerFailed(None, f"workers did not answer '{what}' in time", kind=WorkerFailed.SILENT)

    def _died(self, rank: int) -> WorkerFailed:
        proc = self.members[rank][0]
        proc.join(1)
        why = f"its process (pid {proc.pid}) died (exit code {proc.exitcode})"
        self.gone[rank] = why
        return WorkerFailed(rank, why, kind=WorkerFailed.DIED)


def groups(job, run, address):
    """What gearshift.api.train gets its worker groups from (api.GROUPS), without Ray."""
    @contextlib.contextmanager
    def session():
        yield lambda j: ProcessWorkerGroup(j, str(run.checkpoint_root(j.checkpoint, j.base_dir).resolve()))

    return session()


def _raised(rank: int | None, msg: tuple) -> WorkerFailed:
    _, _, text, details, cause = msg
    try:
        cause = pickle.loads(cause) if cause is not None else None
    except Exception:  # noqa: BLE001  (an exception that cannot be rebuilt here: its text stands)
        cause = None
    return WorkerFailed(rank, text, details=details, cause=cause)


def _free_port() -> int:
    return gloo_pool.rendezvous_port()  # never one a process binding port 0 can be given meanwhile


class PooledGroup:
    """bench/local_group.py's LocalGroup (`call`, `apply`, `close`; set up and built on entry) on
    the warm pool's processes, for the tests that drive TrainWorkers directly without the
    controller (a step loop and its timing, a build): the same TrainWorker and calls, without a
    new process per worker that imports torch and gearshift again. `call("train", ...)` gives each
    rank's list of what its step loop yielded. Every wait is bounded by `timeout_s`; a group that
    fails ends its processes (a rank may still sit in a collective) and the next one starts fresh."""

    def __init__(self, job: dict, world: int, search_paths: list[str] | None = None, cpus: float = 1.0,
                 timeout_s: float = 300.0):
        from gearshift.workers.worker import WorkerConfig

        self.timeout_s = timeout_s
        config = WorkerConfig.from_job(job, [str(p) for p in search_paths or ["."]])
        for attempt in range(3):
            self.members = gloo_pool.HOSTS.take(world)
            for _, conn in self.members:
                conn.send(("host", config, cpus))
            port = _free_port()
            try:
                self._each(lambda rank: ("call", ("setup", (rank, world, "127.0.0.1", port, 120.0))))
                self.infos = self.call("build")
                return
            except BaseException as err:
                self.close(failed=True)
                # the port was taken by another process between choosing it and rank 0 listening on it
                # (tests run two at a time): the group is made again on another, twice at most
                if attempt == 2 or not any(w in str(err) for w in ("EADDRINUSE", "address already in use")):
                    raise

    def call(self, method, *args: Any) -> list:
        if method == "train":
            return self._each(lambda rank: ("train", args))
        return self._each(lambda rank: ("call", (method, args)))

    def apply(self, fn, *args: Any) -> list:
        """Run `fn(worker, *args)` in every process (fn must be importable there)."""
        return self.call(fn, *args)

    def _each(self, request) -> list:
        ident = next(_IDS)
        for rank, (_, conn) in enumerate(self.members):
            kind, body = request(rank)
            conn.send((kind, ident, *body) if kind == "call" else (kind, ident, body))
        results: dict[int, Any] = {}
        reports: dict[int, list] = {rank: [] for rank in range(len(self.members))}
        deadline = time.monotonic() + self.timeout_s
        for rank, (proc, conn) in enumerate(self.members):
            while rank not in results:
                left = deadline - time.monotonic()
                if left <= 0 or not wait([conn, proc.sentinel], timeout=left):
                    raise TimeoutError(f"rank {rank} did not answer within {self.timeout_s:g} s")
                if not conn.poll():
                    raise RuntimeError(f"rank {rank}: its process (pid {proc.pid}) died (exit code {proc.exitcode})")
                msg = conn.recv()
                if msg[1] != ident:
                    continue  # an answer to an abandoned call
                if msg[0] == "error":
                    raise RuntimeError(f"rank {rank}: {msg[2]}\n{msg[3]}")
                if msg[0] == "report":
                    reports[rank].append(msg[2])
                else:
                    results[rank] = reports[rank] if msg[0] == "done" else msg[2]
        return [results[r] for r in range(len(self.members))]

    def close(self, failed: bool = False) -> None:
        members, self.members = self.members, []
        if members:
            gloo_pool.HOSTS.release(members, RELEASE_AFTER_FAILURE_S if failed else RELEASE_S)

    def __enter__(self) -> "PooledGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close(failed=exc[0] is not None)


# ---------------------------------------------------------------- in each pool process

def host(conn, config, cpus: float) -> None:
    """One TrainWorker's life in a pool process: calls and step loops as the parent sends them,
    until it sends "end" (tests/gloo_pool.py then answers "ended"). `request_stop` is heard on a thread of its own, as on Ray's control
    thread, so that it reaches a step loop in progress."""
    from gearshift.workers.worker import TrainWorker

    if os.getcwd() not in sys.path:  # as Ray's workers have their driver's folder on their path
        sys.path.insert(0, os.getcwd())
    worker = TrainWorker(config, cpus)
    inbox: queue.Queue = queue.Queue()

    def listen() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                inbox.put(("end",))
                return
            if msg is None:  # the pool ends (tests/gloo_pool.py's STOP)
                inbox.put(("end",))
                return
            if msg[0] == "stop":
                worker.request_stop(msg[1])
                continue
            inbox.put(msg)
            if msg[0] == "end":
                return

    listener = threading.Thread(target=listen, name="process-workers-control", daemon=True)
    listener.start()
    try:
        while True:
            msg = inbox.get()
            if msg[0] == "end":
                break
            kind, ident, *rest = msg
            try:
                if kind == "train":
                    for report in worker.train(*rest[0]):
                        conn.send(("report", ident, report))
                    conn.send(("done", ident, None))
                else:
                    method, args = rest  # a TrainWorker method's name, or a function of the worker (PooledGroup.apply)
                    result = method(worker, *args) if callable(method) else getattr(worker, method)(*args)
                    conn.send(("ok", ident, result))
            except BaseException as err:  # noqa: BLE001  (the parent raises it as a WorkerFailed)
                conn.send(("error", ident, f"{type(err).__name__}: {err}", traceback.format_exc(), _pickled(err)))
    finally:
        with contextlib.suppress(Exception):
            worker.shutdown()
        listener.join(5)


def _pickled(err: BaseException) -> bytes | None:
    try:
        data = pickle.dumps(err)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001
        return None
