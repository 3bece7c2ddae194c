"""Where the adaptive policy stands in a run (`Standing`): the layout in force and since when, the
steps seen on it, the switch under judgement, the layouts held back. The policy owns it and keeps
it as the steps come; its rules read it, and those whose verdict changes what the run knows (a
revert holds a layout back, a kept switch sets the wait rule 6 compares against) write it."""

from __future__ import annotations

from dataclasses import dataclass, field

from gearshift.orchestrator.policy.decisions import Fits
from gearshift.orchestrator.policy.online import ChangePoint, Estimate, OnlineModel
from gearshift.strategies.layout import Layout


@dataclass(frozen=True)
class Trial:
    """A switch under judgement: the layout left, and its latest steps at the link as it was
    (`rate`: their samples/s, or the decision's figure when the policy had no steps of its own);
    `back`: the switch is a step back (rule 6); `wait`: the comm-wait fraction of the window that
    led to it (a revert holds the layout back until the wait grows past 1.5x it)."""
    layout: Layout
    before: list[dict]
    rate: float
    back: bool = False
    wait: float | None = None

    def steps(self) -> list[int] | None:
        return [self.before[0]["step"], self.before[-1]["step"]] if self.before else None


class PassedOver:
    """What the evidence says of a candidate that does not fit the devices; None when it fits
    (or memory is not judged). A prediction from the layout alone: the same every time, cached."""

    def __init__(self, fits: Fits | None):
        self.fits, self.cache = fits, {}

    def __call__(self, layout: Layout) -> dict | None:
        if self.fits is None:
            return None
        if layout not in self.cache:
            ok, said = self.fits(layout)
            self.cache[layout] = None if ok else {"layout": layout.to_dict(), **said}
        return self.cache[layout]


@dataclass
class Standing:
    """The run as the policy has seen it so far; see the module's doc."""
    candidates: list[Layout]
    current: Layout
    change: ChangePoint                    # the per-step comm wait's change points (the link changed)
    passed_over: PassedOver                # candidates that do not fit the devices
    model: OnlineModel | None = None       # the online cost model; None: decide by trial
    predicting: bool = False               # deciding by prediction (until `max_misses` predicted moves reverted)
    total_steps: int | None = None         # None: a move is weighed over retry_after steps
    since: int | None = None               # step the current layout took over; None: from the start
    window: list[dict] = field(default_factory=list)  # the steps of the window being filled
    recent: list[dict] = field(default_factory=list)  # the current layout's latest records (a change point's evidence)
    trial: Trial | None = None             # the switch being judged
    estimate: Estimate | None = None       # the prediction of the move on trial
    misses: int = 0                        # predicted moves reverted in a row
    held: bool = False                     # said that no move pays (this layout and link)
    kept_wait: float | None = None         # comm wait (s per step) when the current layout was judged and kept
    rebase: bool = False                   # measure kept_wait again on the next window (resume_at)
    skipped: list[dict] = field(default_factory=list)  # candidates the last move passed over for memory
    blocked: dict[Layout, int] = field(default_factory=dict)  # reverted layout -> first step it may be tried again
    # the comm-wait fraction that sent the policy to a layout later reverted (1.5x it lifts the block)
    blocked_wait: dict[Layout, float] = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)  # every decision that is not a bare Keep, with its step

    def open(self, layout: Layout, step: int) -> bool:
        """Not held back at `step` (never reverted, or its block over)."""
        return self.blocked.get(layout, step) <= step

    def cooling(self, step: int, cooldown: int) -> bool:
        """Within `cooldown` steps of the last switch: no move for comm wait or memory yet."""
        return self.since is not None and step < self.since + cooldown
