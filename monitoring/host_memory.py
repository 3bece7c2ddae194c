"""The process's peak resident set over a window, for a worker on CPU (on GPU, torch's device
peak is read and reset instead).

`ru_maxrss` is the process's lifetime peak: it only grows, so a warm process that once built a
larger model, or a switch long past, reads as memory pressure on every later step. On Linux the
kernel's high-water mark (VmHWM in /proc/self/status) can be reset to the current resident set
through /proc/self/clear_refs (Linux 4.0+), which makes it a peak per window. `ru_maxrss` follows
that reset too: a reader of it in the same process sees the window, not the lifetime.

One reader owns the windows of a process: `take` returns the peak since the previous `take` and
starts the next window. Where /proc cannot be written (another OS, a locked-down container) the
figure is the lifetime peak, and `windowed` says so.
"""

from __future__ import annotations

import resource
import threading

_STATUS, _CLEAR = "/proc/self/status", "/proc/self/clear_refs"


class HostPeak:
    """The kernel's high-water mark cut into windows, one series of windows per reader: a take by
    one reader (a step report) does not shorten another's window (a regroup's, a bench phase's)."""

    def __init__(self):
        self._lock = threading.Lock()  # a report and a regroup may take from two threads of a worker
        self.windowed = True  # until a reset fails
        self._since: dict[str, int] = {}  # reader -> the highest mark of the windows closed since its last take
        self._lifetime = 0  # the highest mark read so far

    def take(self, reader: str = "report") -> int:
        """The peak resident set (bytes) since `reader`'s previous take (since the process
        started, for its first); the lifetime peak where the kernel's mark cannot be reset."""
        with self._lock:
            if not self.windowed:
                return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
            mark = _high_water()
            self._lifetime = max(self._lifetime, mark)
            # a reader's first window reaches back to the process's start, before any reset
            peak = max(mark, self._since.pop(reader, self._lifetime))
            for other in self._since:  # the window now closed counts in every other reader's
                self._since[other] = max(self._since[other], mark)
            self._since[reader] = 0
            self.windowed = _reset()
            return peak


def _high_water() -> int:
    with open(_STATUS) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset() -> bool:
    """Reset the kernel's high-water mark to the resident set now; whether it could be."""
    try:
        with open(_CLEAR, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


_PROCESS: HostPeak | None = None


def process_peak() -> HostPeak:
    """This process's one HostPeak (its windows are shared by every reader in the process)."""
    global _PROCESS
    if _PROCESS is None:
        _PROCESS = HostPeak()
    return _PROCESS
