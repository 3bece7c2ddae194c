"""A CPU worker's peak memory per report (monitoring/host_memory.py): the process's peak resident
set since the previous report, not its lifetime peak. A warm process that once held more (an
earlier, larger build) read as memory pressure on every later step while the figure only grew, and
the adaptive policy switched a run for memory it did not use."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from gearshift.monitoring.host_memory import HostPeak
from gearshift.workers.config import WorkerConfig
from gearshift.workers.step.telemetry import WorkerTelemetry

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's mark is Linux's")
MiB = 2**20
HELD = 96 * MiB  # far above what the interpreter's own churn moves between two takes


class hold:
    """`nbytes` made resident (each page touched) in a mapping of its own, and given back to the
    system when closed: not from the allocator's heap, whose freed chunks stay resident and can
    serve a new allocation without a page the process did not hold already."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes)
        for offset in range(0, nbytes, mmap.PAGESIZE):
            self.map[offset] = 1

    def __del__(self):
        self.map.close()


def test_a_window_after_a_larger_one_reads_its_own_peak():
    peak = HostPeak()
    peak.take()
    block = hold(HELD)
    del block
    high = peak.take()
    low = peak.take()
    assert peak.windowed and high - low >= HELD * 0.9, (high / MiB, low / MiB)


def test_each_reader_has_its_own_windows():
    """A report's take does not cut a regroup's window short, and a reader's first window reaches
    back to the process's start."""
    peak = HostPeak()
    peak.take("report")
    base = peak.take("report")
    block = hold(HELD)
    del block
    assert peak.take("report") - base >= HELD * 0.9
    assert peak.take("regroup") - base >= HELD * 0.9  # its first window: the whole process
    block = hold(HELD)
    del block
    peak.take("report")
    assert peak.take("regroup") - base >= HELD * 0.9  # the report's take closed a window it counts
    assert peak.take("regroup") - base < HELD * 0.5


def test_a_cpu_workers_reported_peak_falls_once_the_memory_is_given_back():
    telemetry = WorkerTelemetry(WorkerConfig.__new__(WorkerConfig), torch.device("cpu"))
    telemetry.peak_memory()
    block = hold(HELD)
    del block
    during = telemetry.peak_memory()
    after = telemetry.peak_memory()
    assert during - after >= HELD * 0.9, (during / MiB, after / MiB)
