"""Decisions replayed, not re-decided (`gearshift replay`).

Where a run's layout, shares or cut followed measured timing, a second run of the same job on a
busy machine decides otherwise, and ends elsewhere. A replay takes every such decision from the
original's records instead and carries it out at the step boundary the original carried it out
at, and takes no new one:

- the first layout (strategy auto: where the start probe's prediction put the run) from the
  summary's `strategy_history`;
- each switch a judge made (`switch` records with reason `switch`, `revert`, or `tune`: a
  tuning trial's layout) and each bucket_cap_mb put in force (`bucket` records);
- each rebalance of the shares, recut of a pipeline and replica let go (`decision` records of
  adapt.stragglers with an `applied_step`).

With a script the controller makes no policy, runs no tuning round and watches no straggler
(orchestrator/control/states/training.py, stragglers.py, bucket_tuning.py). What a run does by
itself again on the same machine is left to happen again, not replayed: the forced schedule, an
out-of-memory step's lighter micro-batch or layout, a restore, a lost worker. Pure: built from
records, asked by step.
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import ClassVar

from gearshift.orchestrator.policy.rebalance import Drop, Rebalance
from gearshift.orchestrator.policy.stages import Recut
from gearshift.strategies.layout import Layout

JUDGED = ("switch", "revert", "tune")  # the switch reasons that followed measured timing
STRAGGLERS = ("rebalance", "recut", "drop")


@dataclass(frozen=True)
class Replayed:
    """A layout the original switched to at boundary `step` (with `bucket`, a new bucket_cap_mb at
    the same time), as TRAINING hands a policy's switch to the boundary."""
    to: Layout
    step: int
    bucket: float | None
    evidence: dict
    name: ClassVar[str] = "replay"


class ScriptError(ValueError):
    """The original's records cannot be read as a script."""


@dataclass
class Script:
    start: Layout | None = None  # the layout the original trained its first step on
    switches: dict[int, Replayed] = field(default_factory=dict)
    buckets: dict[int, float] = field(default_factory=dict)
    stragglers: dict[int, tuple] = field(default_factory=dict)  # step -> (decision, the step it was seen at)

    @classmethod
    def of_run(cls, telemetry: pathlib.Path, summary: dict | None) -> "Script":
        """The script of the run whose records are `telemetry` (telemetry.jsonl) and `summary`."""
        script = cls()
        history = (summary or {}).get("strategy_history") or []
        if history:
            first = {k: v for k, v in history[0].items() if k not in ("step", "bucket_cap_mb")}
            script.start = Layout.from_dict(first)
        try:
            lines = telemetry.read_text().splitlines()
        except OSError as err:
            raise ScriptError(f"{telemetry} cannot be read ({err.strerror or err})") from None
        for number, line in enumerate(lines, 1):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if number == len(lines):  # a last line cut short by a killed driver
                    break
                raise ScriptError(f"{telemetry}: line {number} is not JSON") from None
            if record.get("type") == "event":
                script._add(record)
        return script

    def _add(self, record: dict) -> None:
        event = record.get("event")
        if event == "switch" and record.get("reason") in JUDGED:
            self.switches[record["step"]] = Replayed(Layout.from_dict(record["to"]), record["step"],
                                                     record.get("bucket_cap_mb"),
                                                     {"replayed": record["reason"], "original_step": record["step"]})
        elif event == "bucket":
            self.buckets[record["step"]] = record["bucket_cap_mb"]
        elif event == "decision" and record.get("decision") in STRAGGLERS and record.get("applied_step") is not None:
            self.stragglers[record["applied_step"]] = (_decision(record), record.get("seen_step", record["applied_step"]))

    @property
    def moves(self) -> int:
        return len(self.switches) + len(self.buckets) + len(self.stragglers)

    def describe(self) -> str:
        return (f"{len(self.switches)} switch(es), {len(self.buckets)} bucket_cap_mb change(s), "
                f"{len(self.stragglers)} rebalance(s), recut(s) or drop(s)"
                + (f", starting as {self.start}" if self.start is not None else ""))

    def next_step(self, after: int) -> int | None:
        """The first boundary after `after` at which the script moves something (None: none)."""
        later = [s for s in (*self.switches, *self.buckets, *self.stragglers) if s > after]
        return min(later) if later else None

    def switch_at(self, step: int) -> Replayed | None:
        return self.switches.get(step)

    def bucket_at(self, step: int) -> float | None:
        return self.buckets.get(step)

    def straggler_at(self, step: int) -> tuple | None:
        return self.stragglers.get(step)


def _decision(record: dict):
    """A recorded rebalance, recut or drop made again, as the watcher made it."""
    evidence = dict(record.get("evidence") or {})
    name = record["decision"]
    if name == "rebalance":
        return Rebalance(tuple(record["shares"]), evidence)
    if name == "recut":
        return Recut(tuple(record["split"]), (), evidence)
    return Drop(tuple(record.get("replicas") or ()), tuple(record["ranks"]), evidence)


class ScriptedWatch:
    """What stands where a straggler watcher stands in a replay: it observes nothing, and what
    the script carries out is taken as applied (orchestrator/control/stragglers.py)."""

    def observe(self, record: dict):
        return None

    def applied(self, decision, step: int) -> None:
        pass

    def not_allocated(self, decision) -> None:
        pass
