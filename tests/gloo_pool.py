"""A warm pool of processes for the multi-process gloo tests.

A test that checks a layout on several processes (tests/test_fsdp.py's `spawn_gloo`, and the files
that import it) used to spawn its processes afresh: each imported torch and gearshift again, a few
seconds of a 2-core machine per process, often more than the check itself. The pool keeps the
processes of one pytest process alive between tests. Each call is a new gloo process group (a
port of its own) on the first `world` of them, torn down after the function, with the state a
function can leave behind in torch reset (dynamo's caches, the default dtype, the thread count,
gearshift's meshes).

A call that fails, dies or runs past its time limit ends the pool's processes (a peer may be stuck
in a collective the failed rank never joins) and the next call starts fresh ones; the failing
rank's traceback is raised here.

A second pool of the same processes, HOSTS, holds the TrainWorkers of tests/process_workers.py's
worker groups (a "host" call: one worker's session until the group ends it); the two kinds of work
never share a process. `GEARSHIFT_TEST_FRESH_PROCESSES=1` starts fresh processes for
every call (the behaviour before the pool), to tell a leak between calls from a fault.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import itertools
import os
import socket
import sys
import time
import traceback

import torch.multiprocessing as mp
from multiprocessing.connection import wait

STOP = None
# set in a pool process by test code that changes gearshift's own classes or functions for a fault
# (tests/fixtures/faults.py): the process then ends after the run instead of serving another
TAINTED = "GEARSHIFT_TEST_TAINTED"


class WorkerError(RuntimeError):
    """A rank's function raised: its traceback, as the rank printed it."""


class Pool:
    def __init__(self):
        self.members: list[tuple] = []  # (process, connection) by rank

    def run(self, fn, world: int, args: tuple, timeout_s: float) -> None:
        """fn(rank, world, *args) on `world` processes joined in one new gloo group; raises
        WorkerError (the first failing rank's traceback), or TimeoutError past `timeout_s`."""
        if os.environ.get("GEARSHIFT_TEST_FRESH_PROCESSES") == "1":
            self.close()
        self._grow(world)
        port = rendezvous_port()
        members = self.members[:world]
        for rank, (_, conn) in enumerate(members):
            conn.send((fn, rank, world, port, args, timeout_s))
        try:
            self._collect(members, timeout_s)
        except BaseException:
            self.close()  # a rank may still wait in a collective the failed one never joins
            raise

    def _collect(self, members, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        waiting = {conn: rank for rank, (_, conn) in enumerate(members)}
        sentinels = {proc.sentinel: rank for rank, (proc, _) in enumerate(members)}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                stuck = sorted(waiting.values())
                raise TimeoutError(f"{len(members)} gloo processes still running after {timeout_s:g}s "
                                   f"(ranks {stuck} never finished)" + stacks([members[r][0].pid for r in stuck]))
            ready = wait(list(waiting) + list(sentinels), timeout=left)
            for item in ready:
                if item in waiting:
                    rank = waiting.pop(item)
                    try:
                        status, text = item.recv()
                    except EOFError:  # it died between its last word and its sentinel's
                        members[rank][0].join(5)
                        raise WorkerError(f"rank {rank} of {len(members)} died (exit code "
                                          f"{members[rank][0].exitcode}) before it finished") from None
                    if status != "ok":
                        raise WorkerError(f"rank {rank} of {len(members)} failed:\n{text}")
                elif sentinels[item] in waiting.values():
                    rank = sentinels[item]
                    raise WorkerError(f"rank {rank} of {len(members)} died (exit code "
                                      f"{members[rank][0].exitcode}) before it finished")

    def take(self, world: int) -> list[tuple]:
        """The first `world` processes, for a worker group (tests/process_workers.py) to host its
        TrainWorkers on until it hands them back with `release`. A process that died since (a
        fault test killed it) is replaced, the others kept."""
        if os.environ.get("GEARSHIFT_TEST_FRESH_PROCESSES") == "1":
            self.close()
        for member in [m for m in self.members if ended(m[0])]:
            self._drop(member)
        self._grow(world)
        return self.members[:world]

    def take_more(self, count: int, busy: list[tuple]) -> list[tuple]:
        """`count` processes beside the `busy` ones a worker group holds already (its grow)."""
        for member in [m for m in self.members if ended(m[0]) and m not in busy]:
            self._drop(member)
        self._grow(len([m for m in self.members if m in busy]) + count)
        return [m for m in self.members if m not in busy][:count]

    def release(self, members: list[tuple], timeout_s: float) -> None:
        """End the hosted workers' sessions. A process that does not end its session within
        `timeout_s` (stuck in a collective a lost peer never joins), that died, or whose gearshift
        a fault fixture patched, is stopped and replaced at the next take; the others serve the
        next group. What an abandoned call still sends is read past."""
        deadline = time.monotonic() + timeout_s
        for _, conn in members:
            try:
                conn.send(("end",))
            except OSError:
                pass
        for member in members:
            if not self._ended(member[1], deadline):
                self._drop(member)

    @staticmethod
    def _ended(conn, deadline: float) -> bool:
        """Whether the session on `conn` ended in time, in a process fit to serve another."""
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not conn.poll(left):
                    return False
                answer = conn.recv()
                if answer[0] == "ended":
                    return not answer[1]
        except (EOFError, OSError):
            return False

    def _drop(self, member: tuple) -> None:
        """Stop one process by its handle and forget it."""
        proc, conn = member
        if member in self.members:
            self.members.remove(member)
        with contextlib.suppress(OSError):
            conn.send(STOP)
        proc.join(timeout=2)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        conn.close()

    def _grow(self, world: int) -> None:
        ctx = _context()
        while len(self.members) < world:
            ours, theirs = ctx.Pipe()
            # not daemonic: a hosted worker may start processes of its own (data.loader.workers);
            # each ends when its pipe closes, and close() (atexit) stops them by their handles
            proc = ctx.Process(target=_serve, args=(theirs, list(sys.path), dict(os.environ)), daemon=False)
            proc.start()
            theirs.close()
            self.members.append((proc, ours))

    def close(self) -> None:
        members, self.members = self.members, []
        for proc, conn in members:
            try:
                conn.send(STOP)
            except OSError:
                pass
        for proc, conn in members:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
            conn.close()


# What every pool process imports: the fork server imports it once and forks each new process from
# itself, so a process started after a kill or a failed call costs a fork, not the 1.5 to 2.5 s of
# a core that importing torch and gearshift takes on this machine. The fork server is a process
# of its own that has run nothing (this pytest process has, and forking it would be unsafe); a
# module that fails to import there is imported by the process that needs it, as before.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "gearshift.workers.worker", "process_workers"]


def _context():
    """The start method of the pool's processes. Under GEARSHIFT_TEST_FRESH_PROCESSES=1 they are
    forked afresh for every call all the same: the fork server has run no call, and a forked
    process's peak resident set starts at its size when forked (a test that reads a worker's
    lifetime peak wants that)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def ended(proc) -> bool:
    """Whether a pool process has ended. A forked process's end reaches `proc.is_alive()` only
    once the fork server has reaped it and written its status back, a moment later on a loaded
    machine; the kernel's state of it says so at once (a zombie, or gone). A controller asking
    which worker is gone right after a survivor's collective failed once heard "none" and fell
    back to the checkpoint instead of going on in memory."""
    if not proc.is_alive():
        return True
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # reaped since is_alive() looked
    if state in ("Z", "X"):
        proc.join(5)  # its status, for the exit code, is on its way from the fork server
        return True
    return False


def stacks(pids: list[int]) -> str:
    """Where each process is (py-spy's dump, native frames too), for a timeout's message: a hang
    that happens once in a hundred runs is diagnosed from the one failure's text. Empty without
    py-spy (the `test` extra installs it)."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy")
    if spy is None:
        return ""
    out = []
    for pid in pids:
        try:
            done = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                                  timeout=30)
            out.append(f"\n--- pid {pid}:\n" + (done.stdout or done.stderr)[-6000:])
        except (OSError, subprocess.SubprocessError) as err:
            out.append(f"\n--- pid {pid}: no stack ({err})")
    return "".join(out)


POOL = Pool()  # the gloo checks' processes
# the worker groups' (tests/process_workers.py): a TrainWorker leaves more behind than a gloo check
# resets (its held groups, its hooks), so the two never share a process
HOSTS = Pool()
atexit.register(POOL.close)
atexit.register(HOSTS.close)


def run(fn, world: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """POOL.run; a port taken by another process between choosing it and listening on it (tests
    run two at a time) is chosen again, twice at most."""
    for attempt in range(3):
        try:
            return POOL.run(fn, world, args, timeout_s)
        except WorkerError as err:
            if attempt == 2 or not any(w in str(err) for w in ("failed to listen", "EADDRINUSE", "address already")):
                raise


# The tests' rendezvous ports come from below the kernel's ephemeral range (32768 by default) and
# above Ray's worker ports (10002-19999). A port bound as port 0 (gloo's listeners, Ray's servers,
# another group's probe) is never one of them, so a port found free here is still free when rank 0
# listens on it; each pytest-xdist worker takes its own slice, in turn. A port taken from the
# ephemeral range instead was once handed to another process between the choice and the listen
# (EADDRINUSE, and a rank joined that process's store: a fresh-clone CI run's test_eval hung).
_PORT_LO, _PORT_HI = 20000, 32000
_NEXT = itertools.count(os.getpid())


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def rendezvous_port() -> int:
    """A port for a test group's rendezvous that nothing binding port 0 can be given meanwhile."""
    hi = min(_PORT_HI, _ephemeral_low())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]
    count = max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    span = max(1, (hi - _PORT_LO) // count)
    start = _PORT_LO + (int(worker) % count if worker.isdigit() else 0) * span
    for _ in range(span):
        port = start + next(_NEXT) % span
        with socket.socket() as s:
            try:
                s.bind(("", port))  # as rank 0's store binds it: every address
            except OSError:
                continue  # in use, or still in TIME_WAIT
        return port
    raise RuntimeError(f"no free rendezvous port in {start}..{start + span - 1}")



# ---------------------------------------------------------------- in each pool process

def _serve(conn, path: list[str], env: dict[str, str]) -> None:
    sys.path[:] = path
    # the environment of the pytest process now, as a spawned process would have it (a forked
    # one has the fork server's, from when that started)
    os.environ.clear()
    os.environ.update(env)
    while True:
        try:
            call = conn.recv()
        except EOFError:
            break
        if call is STOP:
            break
        if call[0] == "host":  # a worker group's TrainWorker, until the group ends its session
            import process_workers

            try:
                process_workers.host(conn, *call[1:])
            finally:
                _reset()
            # a run whose code patched gearshift's own classes (a fault fixture says so by setting
            # TAINTED) leaves this process to no other run; a test's modules are forgotten anyway
            tainted = os.environ.pop(TAINTED, None) is not None
            conn.send(("ended", tainted))
            if tainted:
                break
            continue
        fn, rank, world, port, args, timeout_s = call
        try:
            _one_call(fn, rank, world, port, args, timeout_s)
            answer = ("ok", None)
        except BaseException:  # noqa: BLE001  (the parent raises it, with this text)
            answer = ("error", traceback.format_exc())
        conn.send(answer)
    # Skip the interpreter's teardown: there a finished rank was once aborted by a background
    # thread still joinable ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_call(fn, rank: int, world: int, port: int, args: tuple, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # up to 8 processes on 2 cores
    # a collective may wait as long as the whole call may take (a compile on a loaded machine
    # keeps one rank away for long; gloo ends a process whose collective timed out)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        fn(rank, world, *args)
    finally:
        _reset()


def _reset() -> list[str]:
    """What one call may leave behind that another would see; the modules of code from outside
    the repository it imported (now forgotten)."""
    import gc

    import torch
    import torch.distributed as dist

    mesh = sys.modules.get("gearshift.strategies.mesh")
    if mesh is not None:
        mesh.forget()  # its cached groups belong to the group destroyed below
    rendezvous = sys.modules.get("gearshift.workers.group.rendezvous")
    if rendezvous is not None:
        # Imported (the fork server preloads it), it hooks every mesh's group making to exchange
        # listeners on the default store, numbering the exchanges since its own join made the
        # default group; a call's group is made here, not by that join, so the count starts
        # again here. Left counting, a process that had served more calls than its peers waited
        # on a key they never set (all ranks stuck in _exchange until the call's time limit).
        rendezvous._EXCHANGES[0] = 0
        rendezvous._OWN_PORTS.clear()
        rendezvous._LISTENERS.clear()
    route = sys.modules.get("gearshift.workers.group.comm")
    if route is not None and hasattr(route, "CommRoute"):
        route.CommRoute.off()
    if dist.is_initialized():
        dist.destroy_process_group()
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset()
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)
    outside = _forget_user_modules()
    gc.collect()
    # what survives the call (torch, gearshift and every module imported, their caches) moves to
    # the permanent generation: the next call's collections (this one's, the worker's own after an
    # out-of-memory step) scan only what was made since. A full collection over torch's objects
    # took 0.2-0.3 s of a core per call and process, 12 % of a layout-equivalence test's CPU
    gc.freeze()
    return outside


def _forget_user_modules() -> list[str]:
    """A run's own modules (a test's model file in its tmp_path, imported by name) go, so that the
    next run's file of the same name is imported afresh, not taken from sys.modules. Only files
    in the temporary folder count, outside this repository and the interpreter's own."""
    import tempfile

    temp = os.path.realpath(tempfile.gettempdir()) + os.sep
    keep = tuple(os.path.realpath(p) + os.sep for p in (_REPO, sys.prefix, sys.base_prefix))
    gone = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        real = _realpath(path) if path else ""
        if real.startswith(temp) and not real.startswith(keep):
            del sys.modules[name]
            gone.append(name)
    return gone


@functools.lru_cache(maxsize=None)
def _realpath(path: str) -> str:
    """A module file's real path, resolved once (a few thousand modules, every call)."""
    return os.path.realpath(path)


_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
