"""Test tiers: pure logic (no fixture), then a real Ray cluster shared by the session.

Every Ray-using test takes the `ray_cluster` fixture; it starts one embedded Ray for the whole
session and shuts it down at the end, so no Ray process outlives the suite.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import sys
import tempfile

import pytest

# Tests stop the processes they start with SIGINT, as Ctrl-C would. A suite launched in the
# background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored, and an ignored
# signal stays ignored across exec: every child would shrug it off. Handling it here gives the
# children the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Every Ray this pytest process brings up, or a process it starts (a `gearshift run` command, a
# Ray job, a bench), lives in a temporary folder of this process's own: Ray reads its temporary
# folder to find "the" cluster on the machine (the newest session, the address file a job's driver
# joins), and in the machine's shared /tmp/ray that is whichever Ray started last, another xdist
# worker's or another suite's. Short, under /tmp: Ray's sockets live below it. Made afresh in each
# pytest process when it starts (pytest_configure: an xdist worker inherits its parent's
# environment and makes its own), removed at its exit. Any other process that imports this file
# (one a test or a pool starts, a Ray worker unpickling a test's function) keeps the folder of
# the pytest process it descends from: it may end by a kill, which runs no exit handler, and a
# folder of its own would be left behind.
RAY_TMPDIR = os.environ.get("RAY_TMPDIR", "")


def pytest_configure(config):
    global RAY_TMPDIR
    RAY_TMPDIR = tempfile.mkdtemp(prefix="gsr", dir="/tmp")
    os.environ["RAY_TMPDIR"] = RAY_TMPDIR
    # Ray's own folder below it, made now: a ray.cluster_utils.Cluster writes its address file
    # there before any Ray of this process has made it
    os.makedirs(os.path.join(RAY_TMPDIR, "ray"), exist_ok=True)
    atexit.register(shutil.rmtree, RAY_TMPDIR, True)
    config.pluginmanager.register(LongestFirst(), "gearshift-longest-first")


# Ray prints a warning per connection about token auth; tests read stderr, so keep it quiet.
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Ray's processes report metrics to its Prometheus endpoint every second, not every ten,
# so the test that scrapes gearshift's Ray metrics finds them quickly
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")


@pytest.fixture(autouse=True)
def freshly_booted_clock(request, monkeypatch):
    """Quick-tier tests run as on a machine that booted seconds ago: `time.monotonic()` counts
    from boot, so code that starts a "last time" at 0 and compares it with monotonic time breaks
    only on a young machine (CI's may be minutes old). Each test not marked `ray` sees the clock
    start near 5 s. GEARSHIFT_TEST_REAL_MONOTONIC=1 turns this off."""
    import time

    if request.node.get_closest_marker("ray") or os.environ.get("GEARSHIFT_TEST_REAL_MONOTONIC") == "1":
        yield
        return
    real = time.monotonic
    offset = real() - 5.0
    monkeypatch.setattr(time, "monotonic", lambda: real() - offset)
    yield


@pytest.fixture(autouse=True)
def no_ray_left_up(request):
    """A test outside the Ray tier leaves no Ray initialised in its pytest process: the next test
    there would find it (a check that "starts nothing" once failed on a Ray an earlier test had
    left up, in whichever test came next). The one that left it fails, and the Ray is shut down.
    The session's own Ray (ray_cluster, which the quick tier's Ray tests share with the rest)
    is not a leak."""
    yield
    ray = sys.modules.get("ray")
    if "ray" not in request.keywords and ray is not None and ray.is_initialized() and not SESSION_RAY:
        ray.shutdown()
        pytest.fail("this test left Ray initialised in the pytest process: a test that starts Ray stops it, "
                    "and one of the Ray tier is marked `ray`")


def wait_until(condition, timeout_s: float = 15.0, interval_s: float = 0.2) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; Ray frees resources asynchronously."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def own_processes(match) -> set[int]:
    """The ids of the processes of this pytest process's Rays (those whose environment names its
    RAY_TMPDIR: a Ray's daemons and workers inherit it from whatever started it) for which
    `match(name, cmdline)` holds. Tests that check nothing outlives a run count these, never the
    machine's: another suite, or the other xdist worker, may run its own Ray beside them."""
    import psutil

    found = set()
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            if match(proc.info["name"] or "", " ".join(proc.info["cmdline"] or [])) \
                    and proc.environ().get("RAY_TMPDIR") == RAY_TMPDIR:
                found.add(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def ray_daemons() -> set[int]:
    """This pytest process's Ray daemons (own_processes)."""
    return own_processes(lambda name, _: name in ("raylet", "gcs_server"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SESSION_RAY = []  # non-empty while ray_cluster's Ray is up: one the session keeps, not a leak


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # 4 logical CPUs on a 2-core machine: room for a 2-worker job and a test that needs more
    info = ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    SESSION_RAY.append(info.address_info["gcs_address"])
    try:
        yield {"gcs_address": info.address_info["gcs_address"]}
    finally:
        SESSION_RAY.clear()
        ray.shutdown()


@pytest.hookimpl(tryfirst=True)  # before -m deselects by the marks
def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    for item in items:  # a run on the warm processes: out of the quick tier (pyproject's markers)
        if "local_workers" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.runs)
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


# ------------------------------------------------------------------ the order files are handed out

SECONDS = pathlib.Path(__file__).with_name("seconds.json")


class LongestFirst:
    """A plugin of its own (registered in pytest_configure): this module's own
    pytest_collection_modifyitems runs first, this one last, after -m has deselected, so a file
    costs what runs of it."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config, items):
        longest_files_first(items)


def longest_files_first(items: list) -> None:
    """Order the tests file by file, the files by the measured seconds of their selected tests,
    longest first (tests/seconds.json, written by tests/seconds_table.py; a file none of whose
    tests is in it counts as the longest), each file's tests in their own order. xdist's loadfile
    hands files out in this order (the Makefile passes --no-loadscope-reorder, which would order
    them by their number of tests): the long files start first and the short ones fill the end,
    so neither process idles through a long tail while the other runs a long file it was handed
    last."""
    table = json.loads(SECONDS.read_text()) if SECONDS.exists() else {}
    cost: dict[str, float] = {}
    known: set[str] = set()
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        name = item.nodeid.split("::")[0]
        first.setdefault(name, i)
        cost[name] = cost.get(name, 0.0) + table.get(item.nodeid, 0.0)
        if item.nodeid in table:
            known.add(name)

    def key(item) -> tuple[float, int]:
        name = item.nodeid.split("::")[0]
        return (-(cost[name] if name in known else float("inf")), first[name])

    items.sort(key=key)  # stable: a file's tests keep their order


@pytest.fixture
def process_group():
    """A one-process gloo group for tests of code that needs torch.distributed initialised."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def local_groups():
    """Inside it, every run started in this process (`cli.main(["run", ...])`, `gearshift.run(...)`)
    drives its workers in the warm processes of tests/gloo_pool.py instead of Ray actors: the
    same controller and TrainWorker, no Ray (tests/process_workers.py says what it leaves out)."""
    import gearshift.api
    import process_workers

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gearshift.api, "GROUPS", process_workers.groups)
        yield


@pytest.fixture
def local_workers():
    """local_groups() for the test: for tests whose subject is training, not Ray."""
    with local_groups():
        yield


# ---------------------------------------------------------------- where the suite's CPU time goes

CPU_LOG = os.environ.get("GEARSHIFT_TEST_CPU_LOG")  # a folder: each test's CPU seconds, one file per process


def _cpu_seconds() -> float:
    """This process's CPU time, its live descendants' (the warm pool, Ray, a bench), and that of
    the children it has waited for."""
    import resource

    import psutil

    me = psutil.Process()
    total = sum(me.cpu_times()[:2])
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            total += sum(child.cpu_times()[:2])
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    return total + done.ru_utime + done.ru_stime


if CPU_LOG:
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        """GEARSHIFT_TEST_CPU_LOG=DIR: each test's CPU seconds (setup, call and teardown, with every
        process it started or used) and wall seconds, a line each, to DIR/cpu-PID.tsv. A
        process that ended without being waited for by this one is missed (Ray's daemons)."""
        import time

        before, start = _cpu_seconds(), time.monotonic()
        yield
        cpu, wall = _cpu_seconds() - before, time.monotonic() - start
        os.makedirs(CPU_LOG, exist_ok=True)
        with open(os.path.join(CPU_LOG, f"cpu-{os.getpid()}.tsv"), "a") as f:
            f.write(f"{item.nodeid}\t{cpu:.2f}\t{wall:.2f}\n")
