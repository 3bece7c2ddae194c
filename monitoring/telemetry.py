"""Telemetry records of a run, written as JSON lines to `telemetry.jsonl` in the run dir.

Three kinds of record share the file, told apart by "type": "step" (one per optimizer step,
aggregated over ranks), "sample" (periodic device readings) and "event" (state changes,
checkpoints, decisions, failures). Readers skip lines they do not know.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Any


# A submitted job's driver also prints its records into the job log, one per line behind this
# prefix, so `gearshift watch JOB_ID` can follow a run whose files live on the cluster.
LOG_PREFIX = "@gearshift-telemetry "


class TelemetryError(Exception):
    """A telemetry file or run dir that cannot be read or shown; the message says what to do."""


class JsonlSink:
    """Append-only; flushed on every event, and after `flush_every` step records or `flush_s`
    seconds, whichever comes first, so a reader (or `gearshift watch`) sees progress while the
    run is live without a write per step."""

    def __init__(self, path: pathlib.Path, flush_every: int = 20, flush_s: float = 1.0):
        self.path = pathlib.Path(path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._pending = 0
        self.flush_every, self.flush_s = flush_every, flush_s
        self._flushed = time.monotonic()

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())
        self._f.write(json.dumps(record, default=str) + "\n")
        self._pending += 1
        now = time.monotonic()
        if record.get("type") != "step" or self._pending >= self.flush_every or now - self._flushed >= self.flush_s:
            self._f.flush()
            self._pending, self._flushed = 0, now

    def event(self, name: str, **fields: Any) -> None:
        self.write({"type": "event", "event": name, **fields})

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


class LogEcho:
    """Prints records into the job log (stdout) behind LOG_PREFIX, for `gearshift watch JOB_ID`.

    Events go out at once; step records at most every `every_s` seconds (the latest one), and
    with it the latest sample of each rank, so a fast job does not flood its own log."""

    def __init__(self, every_s: float = 0.5, stream=None):
        import sys

        self.every_s = every_s
        self.stream = stream or sys.stdout
        self._last: float | None = None  # None: nothing printed yet (monotonic time may be near 0 after boot)
        self._samples: dict[int, dict] = {}
        self._step: dict | None = None

    def observe(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "sample":
            self._samples[record.get("rank", 0)] = record
            return
        if kind == "step":
            self._step = record
            if self._last is not None and time.monotonic() - self._last < self.every_s:
                return
        # an event goes out after the step it follows, so a reader never sees "done" at step 90
        held = [*self._samples.values(), *([self._step] if self._step else [])]
        self._samples, self._step, self._last = {}, None, time.monotonic()
        for r in held + ([record] if kind != "step" else []):
            self.stream.write(LOG_PREFIX + json.dumps(r, default=str) + "\n")
        self.stream.flush()


def read(path: pathlib.Path) -> list[dict]:
    """All records; a torn last line (the run is still writing) is ignored."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
