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
    """Append-only; flushed on every event and every `flush_every` step records, so a reader
    (or `gearshift watch`) sees progress while the run is live without a write per step."""

    def __init__(self, path: pathlib.Path, flush_every: int = 20):
        self.path = pathlib.Path(path)
        self._f = open(self.path, "a", encoding="utf-8")
        self._pending = 0
        self.flush_every = flush_every

    def write(self, record: dict[str, Any]) -> None:
        record.setdefault("time", time.time())
        self._f.write(json.dumps(record, default=str) + "\n")
        self._pending += 1
        if record.get("type") != "step" or self._pending >= self.flush_every:
            self._f.flush()
            self._pending = 0

    def event(self, name: str, **fields: Any) -> None:
        self.write({"type": "event", "event": name, **fields})

    def close(self) -> None:
        if not self._f.closed:
            self._f.flush()
            self._f.close()


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
