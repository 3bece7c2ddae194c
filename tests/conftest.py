"""Test tiers: pure logic (no fixture), then a real Ray cluster shared by the session.

Every Ray-using test takes the `ray_cluster` fixture; it starts one embedded Ray for the whole
session and shuts it down at the end, so no Ray process outlives the suite.
"""

from __future__ import annotations

import os
import signal
import socket

import pytest

# Tests stop the processes they start with SIGINT, as Ctrl-C would. A suite launched in the
# background by a non-interactive shell (`cmd &`, nohup) inherits SIGINT ignored, and an ignored
# signal stays ignored across exec: every child would shrug it off. Handling it here gives the
# children the default disposition again.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

# Ray prints a warning per connection about token auth; tests read stderr, so keep it quiet.
os.environ.setdefault("RAY_DEDUP_LOGS", "1")
# Ray's processes report metrics to its Prometheus endpoint every second, not every ten,
# so the test that scrapes gearshift's Ray metrics finds them quickly
os.environ.setdefault("RAY_metrics_report_interval_ms", "1000")


def wait_until(condition, timeout_s: float = 15.0, interval_s: float = 0.2) -> bool:
    """Poll `condition` until it holds or `timeout_s` passes; Ray frees resources asynchronously."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # 4 logical CPUs on a 2-core machine: room for a 2-worker job and a test that needs more
    info = ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    try:
        yield {"gcs_address": info.address_info["gcs_address"]}
    finally:
        ray.shutdown()


def pytest_collection_modifyitems(config, items):
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except Exception:
        has_gpu = False
    if not has_gpu:
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
