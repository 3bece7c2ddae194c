"""Device samplers: NVML through a fake pynvml, psutil for real, and the background thread.

Pure logic tier: no Ray, no process group, no GPU.
"""

from __future__ import annotations

import logging
import sys
import time
import types

import psutil
import pytest

from gearshift.monitoring import devices
from gearshift.monitoring.devices import (
    MIN_PERIOD_S,
    NvmlSampler,
    PsutilSampler,
    SamplerThread,
    make_sampler,
)
from gearshift.monitoring.schema import validate

UUID = "GPU-5a3c0e1d-0000-1111-2222-333344445555"


def fake_nvml(count: int = 4, unsupported: tuple[str, ...] = (), init_error: bool = False, name_bytes=False):
    """A stand-in for the pynvml module: device i reports util 10+i %, 1 GiB * (i+1) used of 80 GiB,
    (250+i) W as milliwatts, 1980 MHz SM clock. `unsupported` names functions that raise NotSupported."""
    m = types.ModuleType("pynvml")
    m.calls = []
    m.NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    m.NVMLError, m.NVMLError_NotSupported = NVMLError, NVMLError_NotSupported

    def fn(name, body):
        def call(*args):
            m.calls.append(name)
            if name in unsupported:
                raise NVMLError_NotSupported("Not Supported")
            return body(*args)
        setattr(m, name, call)

    def init():
        if init_error:
            raise NVMLError("Driver Not Loaded")

    def by_index(i):
        if not 0 <= i < count:
            raise NVMLError("Invalid Argument")
        return ("h", i)

    def by_uuid(u):
        if u != UUID:
            raise NVMLError("Not Found")
        return ("h", 2)

    def name(h):
        s = f"NVIDIA H100 #{h[1]}"
        return s.encode() if name_bytes else s

    fn("nvmlInit", init)
    fn("nvmlShutdown", lambda: None)
    fn("nvmlDeviceGetCount", lambda: count)
    fn("nvmlDeviceGetHandleByIndex", by_index)
    fn("nvmlDeviceGetHandleByUUID", by_uuid)
    fn("nvmlDeviceGetName", name)
    fn("nvmlDeviceGetUtilizationRates", lambda h: types.SimpleNamespace(gpu=10 + h[1], memory=5))
    fn("nvmlDeviceGetMemoryInfo", lambda h: types.SimpleNamespace(used=2**30 * (h[1] + 1), total=80 * 2**30,
                                                                    free=0))
    fn("nvmlDeviceGetPowerUsage", lambda h: 250_000 + 1000 * h[1])
    fn("nvmlDeviceGetClockInfo", lambda h, clock: 1980 if clock == m.NVML_CLOCK_SM else 0)
    return m


def as_record(sample: dict) -> dict:
    return {**sample, "rank": 0, "node_ip": "127.0.0.1"}


KEYS = {"type", "time", "source", "device", "util_pct", "mem_used_bytes", "mem_total_bytes", "power_w",
        "sm_clock_mhz", "host_cpu_pct"}


@pytest.fixture(autouse=True)
def fresh_log_memory(monkeypatch):
    # the once-per-process memory would otherwise leak between tests
    monkeypatch.setattr(devices, "_logged_reasons", set())


# --- NVML ---------------------------------------------------------------------------------

def test_nvml_reads_fake_values_with_units_and_worker_local_names():
    nvml = fake_nvml()
    s = NvmlSampler(["3", "1"], nvml=nvml)
    out = s.sample()
    assert [r["device"] for r in out] == ["cuda:0 NVIDIA H100 #3", "cuda:1 NVIDIA H100 #1"]
    first = out[0]
    assert set(first) == KEYS
    assert first["type"] == "sample" and first["source"] == "nvml"
    assert abs(first["time"] - time.time()) < 5
    assert first["util_pct"] == 13
    assert first["mem_used_bytes"] == 4 * 2**30 and first["mem_total_bytes"] == 80 * 2**30
    assert first["power_w"] == pytest.approx(253.0)  # milliwatts -> watts
    assert first["sm_clock_mhz"] == 1980
    assert first["host_cpu_pct"] is None
    for r in out:
        assert validate(as_record(r)) == []


def test_nvml_unsupported_field_is_none_and_the_rest_still_read():
    nvml = fake_nvml(unsupported=("nvmlDeviceGetPowerUsage", "nvmlDeviceGetUtilizationRates"))
    (r,) = NvmlSampler(["0"], nvml=nvml).sample()
    assert r["power_w"] is None and r["util_pct"] is None
    assert r["mem_used_bytes"] == 2**30 and r["sm_clock_mhz"] == 1980
    assert validate(as_record(r)) == []


def test_nvml_uuid_ids_and_bytes_names():
    nvml = fake_nvml(name_bytes=True)
    (r,) = NvmlSampler([UUID], nvml=nvml).sample()
    assert r["device"] == "cuda:0 NVIDIA H100 #2"
    assert "nvmlDeviceGetHandleByUUID" in nvml.calls and "nvmlDeviceGetHandleByIndex" not in nvml.calls


def test_nvml_close_shuts_down_once():
    nvml = fake_nvml()
    s = NvmlSampler(["0"], nvml=nvml)
    assert nvml.calls.count("nvmlInit") == 1
    s.close()
    s.close()
    assert nvml.calls.count("nvmlShutdown") == 1


# --- fallbacks ----------------------------------------------------------------------------

def test_init_failure_falls_back_with_reason():
    sampler, reason = make_sampler(["0"], nvml=fake_nvml(init_error=True))
    assert isinstance(sampler, PsutilSampler)
    assert reason.startswith("NVML init failed") and "Driver Not Loaded" in reason


def test_no_gpu_assigned_never_touches_nvml():
    nvml = fake_nvml()
    sampler, reason = make_sampler([], nvml=nvml)
    assert isinstance(sampler, PsutilSampler) and reason == "no GPU assigned to this worker"
    assert nvml.calls == []


def test_missing_pynvml_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    sampler, reason = make_sampler(["0"])
    assert isinstance(sampler, PsutilSampler) and reason == "nvidia-ml-py not installed"


@pytest.mark.parametrize("ids", [["7"], ["GPU-not-a-real-uuid"]])
def test_unresolvable_ids_fall_back_and_balance_init(ids):
    nvml = fake_nvml(count=2)
    sampler, reason = make_sampler(ids, nvml=nvml)
    assert isinstance(sampler, PsutilSampler)
    assert "did not resolve" in reason and ids[0] in reason
    assert nvml.calls.count("nvmlShutdown") == nvml.calls.count("nvmlInit") == 1


def test_nvml_success_has_no_reason():
    sampler, reason = make_sampler(["0"], nvml=fake_nvml())
    assert isinstance(sampler, NvmlSampler) and reason is None


def test_fallback_logged_once_per_reason(caplog):
    caplog.set_level(logging.INFO, logger="gearshift")
    make_sampler([])
    make_sampler([])
    make_sampler(["0"], nvml=fake_nvml(init_error=True))
    msgs = [r for r in caplog.records if "psutil instead of NVML" in r.getMessage()]
    assert len(msgs) == 2
    assert msgs[0].levelno == logging.INFO and "no GPU assigned" in msgs[0].getMessage()
    assert msgs[1].levelno == logging.WARNING and "NVML init failed" in msgs[1].getMessage()


def test_real_bindings_never_raise():
    # whatever this host has (no pynvml, no driver, a real GPU), make_sampler yields working readings
    sampler, reason = make_sampler(["0"])
    try:
        out = sampler.sample()
        assert out and all(validate(as_record(r)) == [] for r in out)
        assert (reason is None) == (sampler.source == "nvml")
    finally:
        sampler.close()


# --- psutil -------------------------------------------------------------------------------

def test_psutil_values_are_plausible_and_validate():
    s = PsutilSampler()
    (r,) = s.sample()
    assert set(r) == KEYS
    assert r["source"] == "psutil" and r["device"] == "cpu"
    assert r["mem_used_bytes"] > 0
    assert r["mem_total_bytes"] == psutil.virtual_memory().total
    assert isinstance(r["util_pct"], float) and r["util_pct"] >= 0
    assert isinstance(r["host_cpu_pct"], float) and 0 <= r["host_cpu_pct"] <= 100
    assert r["power_w"] is None and r["sm_clock_mhz"] is None
    assert validate(as_record(r)) == []


def test_psutil_sees_this_process_burn_cpu():
    """util_pct is this process's CPU time over the wall time since the previous sample: what the
    process's own clocks say of the same span. A busy loop of 0.3 s of this process's CPU (not of
    wall time: on a loaded machine that was 16 % of a core once, where ~100 % was asserted) reads
    as the share of the wall time the process had, however loaded the machine."""
    cpu0, wall0 = time.process_time(), time.monotonic()
    s = PsutilSampler()
    x = 0
    while time.process_time() - cpu0 < 0.3:
        x += 1
    (r,) = s.sample()
    cpu, wall = time.process_time() - cpu0, time.monotonic() - wall0
    assert r["util_pct"] == pytest.approx(100 * cpu / wall, rel=0.25, abs=3), (r, cpu, wall)


# --- SamplerThread ------------------------------------------------------------------------

class CountingSampler:
    source = "psutil"

    def __init__(self, fail: bool = False):
        self.n, self.fail, self.closed = 0, fail, 0

    def sample(self):
        self.n += 1
        if self.fail:
            raise RuntimeError(f"driver hiccup {self.n}")
        return [{"type": "sample", "time": time.time(), "n": self.n}]

    def close(self):
        self.closed += 1


def test_period_below_minimum_is_refused():
    with pytest.raises(ValueError, match="MIN_PERIOD_S"):
        SamplerThread(CountingSampler(), period_s=0.1)
    SamplerThread(CountingSampler(), period_s=MIN_PERIOD_S)  # the minimum itself is fine


def test_thread_samples_at_period_and_drains():
    t = SamplerThread(CountingSampler(), period_s=0.2).start()
    time.sleep(1.1)
    t.stop()
    got = t.drain()
    assert 4 <= len(got) <= 6, len(got)  # readings at 0.2, 0.4, ... 1.0 s, with slack for a busy host
    assert [r["n"] for r in got] == list(range(1, len(got) + 1))  # oldest first, none lost
    assert t.latest() == [got[-1]]
    assert t.drain() == []
    assert t.error is None


def test_real_psutil_samples_through_thread_validate():
    t = SamplerThread(PsutilSampler(), period_s=0.2).start()
    time.sleep(0.5)
    t.stop()
    got = t.drain()
    assert got and all(validate(as_record(r)) == [] for r in got)


def test_maxlen_bounds_undrained_buffer():
    t = SamplerThread(CountingSampler(), period_s=0.2, maxlen=2).start()
    time.sleep(0.9)
    t.stop()
    got = t.drain()
    assert len(got) == 2 and got[-1]["n"] >= 3  # older readings were dropped, newest kept


def test_stop_is_prompt_idempotent_and_closes_once():
    # A period of ten minutes and a join of one: a thread that slept out its period instead of
    # waking on the stop would still be alive when stop() gives up on it (and would not be closed).
    sampler = CountingSampler()
    t = SamplerThread(sampler, period_s=600.0).start()
    t.stop(timeout_s=60.0)
    t.stop(timeout_s=60.0)
    assert not t._thread.is_alive(), "stop() did not interrupt the sampling period"
    assert sampler.closed == 1 and sampler.n == 0  # closed once, and stopped before the first reading


def test_failing_sampler_keeps_thread_alive_and_records_error(caplog):
    sampler = CountingSampler(fail=True)
    t = SamplerThread(sampler, period_s=0.2).start()
    try:
        time.sleep(0.7)
        assert t._thread.is_alive()
        assert sampler.n >= 2 and t.errors == sampler.n  # kept trying after the first failure
        assert "driver hiccup" in t.error and t.drain() == []
    finally:
        t.stop()
    logged = [r for r in caplog.records if "device sampler failed" in r.getMessage()]
    assert len(logged) == 1

