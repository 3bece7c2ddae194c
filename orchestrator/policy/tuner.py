"""Tuning knobs such as `bucket_cap_mb` by measuring: pure logic, no Ray, no torch.distributed.

A `Tuner` proposes settings and takes back a score for each (samples/s, higher is better); it
never runs anything itself. Two ways to walk the space:

- `grid`: every combination of the values given, in order (`gearshift tune` before training);
- `search`: a hill climb over each knob's sorted values, one knob at a time, starting from the
  value in force (online, `parallel.bucket_cap_mb: auto`). From the start it tries the nearer
  neighbours, moves on while the score improves and stops a knob when neither neighbour does,
  or when the trial budget is spent. Step time against bucket size is close to unimodal (too
  small: per-collective latency; too big: no overlap with backward), which a climb suits, and a
  climb needs a handful of trials where a grid needs them all.

Knobs the user pinned are not tuned: they are left out of the space and kept at their value in
every proposal. Every trial is kept, with its evidence, for the telemetry (`trials`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Trial:
    setting: dict[str, Any]
    score: float | None = None
    evidence: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"setting": dict(self.setting), "score": self.score, **self.evidence}


class Tuner:
    def __init__(self, space: dict[str, list], start: dict[str, Any] | None = None,
                 pinned: dict[str, Any] | None = None, mode: str = "search", max_trials: int | None = None):
        if mode not in ("grid", "search"):
            raise ValueError(f"mode {mode!r}: 'grid' or 'search'")
        self.pinned = dict(pinned or {})
        self.space = {k: list(v) for k, v in space.items() if k not in self.pinned}
        for name, values in self.space.items():
            if not values:
                raise ValueError(f"{name}: no values to try")
            if len(set(values)) != len(values):
                raise ValueError(f"{name}: values repeat in {values}")
        self.mode = mode
        self.max_trials = max_trials
        self.trials: list[Trial] = []
        self._scores: dict[tuple, float] = {}
        start = dict(start or {})
        if mode == "search":
            for name, values in self.space.items():
                if all(isinstance(v, (int, float)) for v in values):
                    self.space[name] = sorted(values)
        self._start = {k: start.get(k, v[len(v) // 2]) for k, v in self.space.items()}
        for name, value in self._start.items():
            if value not in self.space[name]:
                raise ValueError(f"{name}: start value {value!r} is not one of {self.space[name]}")
        self._proposals = self._grid() if mode == "grid" else self._climb()
        self._waiting: Trial | None = None
        self._done = False

    # ------------------------------------------------------------------ the protocol

    def next(self) -> dict[str, Any] | None:
        """The next setting to try (pinned knobs included), or None when tuning is over."""
        if self._waiting is not None:
            raise RuntimeError("report() the score of the last setting before asking for the next")
        if self._done or (self.max_trials is not None and len(self.trials) >= self.max_trials):
            self._done = True
            return None
        try:
            setting = next(self._proposals)
        except StopIteration:
            self._done = True
            return None
        self._waiting = Trial({**self.pinned, **setting})
        return dict(self._waiting.setting)

    def report(self, score: float, **evidence) -> Trial:
        """The score of the setting `next()` gave last; evidence goes with the trial."""
        if self._waiting is None:
            raise RuntimeError("no setting is waiting for a score")
        trial, self._waiting = self._waiting, None
        trial.score, trial.evidence = float(score), evidence
        self.trials.append(trial)
        self._scores[self._key(trial.setting)] = trial.score
        return trial

    @property
    def done(self) -> bool:
        return self._done

    def best(self) -> Trial | None:
        scored = [t for t in self.trials if t.score is not None]
        return max(scored, key=lambda t: t.score) if scored else None

    def run(self, score: Callable[[dict], float]) -> Trial | None:
        """Drive the tuner with a score function to the end; the best trial."""
        while (setting := self.next()) is not None:
            self.report(score(setting))
        return self.best()

    # ------------------------------------------------------------------ walks

    def _key(self, setting: dict) -> tuple:
        return tuple(setting[k] for k in self.space)

    def _grid(self) -> Iterator[dict]:
        names = list(self.space)
        for values in itertools.product(*(self.space[n] for n in names)):
            yield dict(zip(names, values))

    def _climb(self) -> Iterator[dict]:
        current = dict(self._start)
        yield dict(current)
        best = self._scores[self._key(current)]
        for name, values in self.space.items():
            i = values.index(current[name])
            # the nearer neighbours first; once one direction improves, keep going that way
            for direction in (-1, 1):
                moved = False
                while 0 <= i + direction < len(values):
                    trial = {**current, name: values[i + direction]}
                    if self._key(trial) not in self._scores:
                        yield trial
                    score = self._scores[self._key(trial)]
                    if score <= best:
                        break
                    best, current, i, moved = score, trial, i + direction, True
                if moved:
                    break  # improved going down: going up from a better point was tried as the first step
