"""What the adaptive policy is set with (`AdaptConfig`, the job's `adapt` section) and what it
answers (`Keep`, `Switch`, `Revert`, `Report`): values the controller carries out, each with the
evidence that led to it. Every rule of the policy returns one of these, or None for "not mine"."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

from gearshift.strategies.layout import Layout


@dataclass(frozen=True)
class AdaptConfig:
    threshold: float = 0.15        # comm-wait fraction of the step that calls for a switch
    window: int = 20               # steps per evaluation
    cooldown: int = 40             # steps after a switch/revert before the next switch (and between repeated reports)
    settle: int = 3                # steps ignored after a switch: the first steps on a new layout pay warm-up
    retry_after: int = 400         # steps a reverted layout is not tried again
    early_check: int = 5           # steps into a trial (after settle) at which a clear loss reverts at once
    early_loss: float = 0.2        # "clear": samples/s below (1 - early_loss) x before
    min_gain: float = 0.0          # a switch is kept unless after < before * (1 + min_gain) - noise
    noise_sigmas: float = 2.0      # "noise": this many standard errors of the two rates' difference
    memory_threshold: float = 0.92  # peak memory / device memory in a window that calls for a lighter layout
    straggler_ratio: float = 1.5   # slow rank's compute time / median of the others
    input_bound_frac: float = 0.3  # data time / step time
    # deciding by prediction (with an online cost model; see adaptive.py's doc)
    decide: str = "predict"        # "predict", or "trial": try the next candidate and judge it
    predict_error: float = 0.05    # least relative error assumed of a prediction (more when moves measured more)
    unseen_error: float = 0.25     # relative error of a layout whose tp or sharding costs the run has not measured
    switch_margin: float = 1.0     # a move's predicted gain over the remaining steps must pay (1 + this) x its cost
    max_misses: int = 2            # predicted moves reverted in a row before the policy decides by trial
    change_factor: float = 1.5     # a change point: per-step comm wait beyond this factor of its level...
    change_steps: int = 3          # ...for this many steps in a row


@dataclass(frozen=True)
class Keep:
    evidence: dict = field(default_factory=dict)  # empty for "nothing to do"; set when a switch was judged and kept
    name: ClassVar[str] = "keep"

    def to_dict(self) -> dict:
        return {"decision": self.name, "evidence": self.evidence}


@dataclass(frozen=True)
class Switch:
    to: Layout
    evidence: dict
    name: ClassVar[str] = "switch"

    def to_dict(self) -> dict:
        return {"decision": self.name, "to": self.to.to_dict(), "evidence": self.evidence}


@dataclass(frozen=True)
class Revert:
    to: Layout
    evidence: dict
    name: ClassVar[str] = "revert"

    def to_dict(self) -> dict:
        return {"decision": self.name, "to": self.to.to_dict(), "evidence": self.evidence}


@dataclass(frozen=True)
class Report:
    kind: str  # "straggler", "input_bound", "memory_pressure" or "hold"
    evidence: dict
    name: ClassVar[str] = "report"

    def to_dict(self) -> dict:
        return {"decision": self.name, "kind": self.kind, "evidence": self.evidence}


Decision = Keep | Switch | Revert | Report
KEEP = Keep()

Fits = Callable[[Layout], "tuple[bool, dict]"]  # layout -> (fits the devices, evidence: predicted and available bytes)
