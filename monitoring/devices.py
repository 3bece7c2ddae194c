"""Device samplers for training workers: periodic GPU (NVML) or host (psutil) readings.

Each sampler's `sample()` returns one dict per device in the shape of a "sample" record (see
`gearshift.monitoring.schema.SAMPLE`) minus `rank` and `node_ip`, which the worker adds. `make_sampler`
picks NVML when this worker was given GPUs that NVML can read and falls back to psutil with a
one-line reason otherwise; `SamplerThread` runs a sampler in the background so reading devices
never sits on the training step's critical path.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

log = logging.getLogger("gearshift")

# NVML calls take a per-driver lock shared with every other NVML client on the host
# (nvidia-smi, DCGM, other workers); polling faster than this contends for it and buys no insight.
MIN_PERIOD_S = 0.2


def _error_text(exc: BaseException) -> str:
    # NVMLError.__str__ may call into the library to look the code up; never let that mask the error.
    try:
        return f"{type(exc).__name__}: {exc}"
    except Exception:  # noqa: BLE001
        return type(exc).__name__


def _record(source: str, device: str, **fields: Any) -> dict[str, Any]:
    return {"type": "sample", "time": time.time(), "source": source, "device": device, **fields}


class NvmlUnavailable(Exception):
    """NVML cannot read this worker's GPUs; the message is the reason, one line."""


class NvmlSampler:
    """Reads the GPUs Ray assigned to this worker. `gpu_ids` are physical indices ("0", "3") or
    UUIDs ("GPU-...", "MIG-..."): NVML ignores CUDA_VISIBLE_DEVICES, so position i in `gpu_ids`
    is what the worker calls cuda:i. Raises NvmlUnavailable when NVML cannot be used."""

    source = "nvml"

    def __init__(self, gpu_ids: list[str], nvml: Any = None):
        if not gpu_ids:
            raise NvmlUnavailable("no GPU assigned to this worker")
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise NvmlUnavailable("nvidia-ml-py not installed") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        # NVMLError_LibraryNotFound / DriverNotLoaded on CPU-only hosts; and whatever an odd binding
        # raises: telemetry must never be the reason a training worker fails to start.
        except Exception as e:  # noqa: BLE001
            raise NvmlUnavailable(f"NVML init failed: {_error_text(e)}") from None
        self._closed = False
        try:
            self.handles = [self._handle(gpu_id) for gpu_id in gpu_ids]
            self.devices = [f"cuda:{i} {self._name(h)}" for i, h in enumerate(self.handles)]
        except Exception as e:  # noqa: BLE001 - NVMLError, our ValueError, or a binding missing a call
            self.close()  # balance nvmlInit: NVML reference-counts init/shutdown
            raise NvmlUnavailable(f"GPU ids {list(gpu_ids)} did not resolve: {_error_text(e)}") from None

    def _handle(self, gpu_id: str):
        gpu_id = str(gpu_id).strip()
        if gpu_id.isdigit():
            count = self.nvml.nvmlDeviceGetCount()
            if int(gpu_id) >= count:
                raise ValueError(f"index {gpu_id} but NVML sees {count} devices")
            return self.nvml.nvmlDeviceGetHandleByIndex(int(gpu_id))
        # anything else is a UUID; a malformed one fails here with NVMLError, not silently
        return self.nvml.nvmlDeviceGetHandleByUUID(gpu_id)

    def _name(self, handle) -> str:
        name = self._read(self.nvml.nvmlDeviceGetName, handle)
        if isinstance(name, bytes):  # bindings before 11.5 return bytes
            name = name.decode(errors="replace")
        return name or "unknown"

    def _read(self, fn, *args):
        # Consumer boards, MIG slices and vGPUs lack some counters (NVMLError_NotSupported);
        # a missing field is null, not a reason to stop reading the others.
        try:
            return fn(*args)
        except self.nvml.NVMLError:
            return None

    def sample(self) -> list[dict[str, Any]]:
        nvml, out = self.nvml, []
        for handle, device in zip(self.handles, self.devices):
            util = self._read(nvml.nvmlDeviceGetUtilizationRates, handle)
            mem = self._read(nvml.nvmlDeviceGetMemoryInfo, handle)
            power_mw = self._read(nvml.nvmlDeviceGetPowerUsage, handle)
            out.append(_record(
                "nvml", device,
                util_pct=None if util is None else util.gpu,
                mem_used_bytes=None if mem is None else mem.used,
                mem_total_bytes=None if mem is None else mem.total,
                power_w=None if power_mw is None else power_mw / 1000.0,
                sm_clock_mhz=self._read(nvml.nvmlDeviceGetClockInfo, handle, nvml.NVML_CLOCK_SM),
                host_cpu_pct=None,
            ))
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            try:
                self.nvml.nvmlShutdown()
            except self.nvml.NVMLError as e:
                log.debug("nvmlShutdown failed: %s", _error_text(e))


class PsutilSampler:
    """This worker process's CPU and memory, for hosts (or workers) without an NVIDIA GPU."""

    source = "psutil"

    def __init__(self):
        import psutil

        self._psutil = psutil
        self._proc = psutil.Process()
        # cpu_percent(None) measures since the previous call and returns 0.0 on the first one;
        # prime both so the first real sample covers the interval since construction.
        self._proc.cpu_percent(None)
        psutil.cpu_percent(None)

    def sample(self) -> list[dict[str, Any]]:
        ps = self._psutil
        return [_record(
            "psutil", "cpu",
            util_pct=self._proc.cpu_percent(None),  # may exceed 100: summed over threads
            mem_used_bytes=self._proc.memory_info().rss,
            mem_total_bytes=ps.virtual_memory().total,
            power_w=None,
            sm_clock_mhz=None,
            host_cpu_pct=ps.cpu_percent(None),
        )]

    def close(self) -> None:
        pass


_logged_reasons: set[str] = set()
_logged_lock = threading.Lock()


def make_sampler(gpu_ids: list[str], nvml: Any = None) -> tuple[NvmlSampler | PsutilSampler, str | None]:
    """The NVML sampler for `gpu_ids` when it works, else a PsutilSampler and why not.

    A worker with no GPU assigned never touches NVML even on a GPU host: its readings would be
    some other job's GPU."""
    try:
        return NvmlSampler(gpu_ids, nvml=nvml), None
    except NvmlUnavailable as e:
        reason = str(e)
    # A CPU worker falling back is the expected case (INFO); a worker that was given GPUs it cannot
    # read is a misconfigured host whose GPU telemetry will silently be CPU numbers (WARNING).
    # Once per process and reason: every worker restart or re-layout calls this again.
    with _logged_lock:
        first = reason not in _logged_reasons
        _logged_reasons.add(reason)
    if first:
        level = logging.INFO if not gpu_ids else logging.WARNING
        log.log(level, "device sampler: psutil instead of NVML (%s)", reason)
    return PsutilSampler(), reason


class SamplerThread:
    """Runs `sampler.sample()` every `period_s` on a daemon thread; the worker drains readings
    between steps. Bounded: a thread nobody drains keeps the last `maxlen` readings."""

    def __init__(self, sampler, period_s: float = 1.0, maxlen: int = 600):
        if period_s < MIN_PERIOD_S:
            raise ValueError(f"period_s={period_s} is below MIN_PERIOD_S={MIN_PERIOD_S}: "
                             "NVML calls take a driver lock shared with other clients")
        if maxlen < 1:
            raise ValueError(f"maxlen={maxlen} must be at least 1")
        self.sampler, self.period_s = sampler, period_s
        self.error: str | None = None  # the latest exception from sampler.sample(), as text
        self.errors = 0  # how many sample() calls raised
        self._buf: collections.deque[dict[str, Any]] = collections.deque(maxlen=maxlen)
        self._latest: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self) -> SamplerThread:
        if self._thread is not None:
            raise RuntimeError("SamplerThread already started")
        self._thread = threading.Thread(target=self._run, name="gearshift-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        # Deadlines, not sleep(period) after each sample, so slow NVML calls do not stretch the cadence;
        # the first reading comes one period in, so psutil's CPU % covers a full interval.
        deadline = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, deadline - time.monotonic())):
            try:
                readings = self.sampler.sample()
            except Exception as e:
                # Keep going: a transient driver hiccup must not end telemetry for the whole run.
                if self.error is None:
                    log.warning("device sampler failed, will keep trying: %s", _error_text(e), exc_info=True)
                self.error, self.errors = _error_text(e), self.errors + 1
            else:
                with self._lock:
                    self._buf.extend(readings)
                    self._latest = readings
            deadline += self.period_s
            if deadline <= time.monotonic():  # fell a period behind: skip ahead rather than burst
                deadline = time.monotonic() + self.period_s

    def drain(self) -> list[dict[str, Any]]:
        """Readings since the last drain, oldest first."""
        with self._lock:
            out = list(self._buf)
            self._buf.clear()
        return out

    def latest(self) -> list[dict[str, Any]]:
        """The last reading (one dict per device); [] before the first."""
        with self._lock:
            return [dict(r) for r in self._latest]

    def stop(self, timeout_s: float = 2.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                # Stuck inside a driver call: shutting NVML down under it could crash the process;
                # leave it (daemon) to die with the process.
                log.warning("device sampler thread did not stop within %.1fs", timeout_s)
                return
        self.sampler.close()
