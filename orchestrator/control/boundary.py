"""What happens at the step boundary where a training chunk ends: one pure function that weighs
everything that may want the boundary (the forced schedule, the policy, the tuning round) and
returns one `Boundary` value, which the controller then carries out.

Precedence, as the controller has always had it:
  - the run is over (its steps are done, or `gearshift tune` has timed its last setting): stop;
  - a forced schedule entry due here beats a policy decision of the same chunk (the decision is
    dropped, but the policy still hears of the switch);
  - a layout change abandons a tuning round in progress: the new layout gets its own round;
  - after a revert, only a bucket size chosen for that layout before is put back (no new round:
    the layout was judged already); after a forced switch (nothing will judge it) a round starts
    at once; a switch the policy kept has its new layout tuned once the policy says so.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from gearshift.strategies.layout import Layout


class Then(enum.Enum):
    """The bucket tuning that follows a boundary."""
    NOTHING = "nothing"
    TUNE = "tune"                # a round on the layout in force (or the value a round chose for it before)
    REMEMBERED = "remembered"    # only the value a round chose for this layout before, if any


@dataclass(frozen=True)
class Boundary:
    """What the controller does at a step boundary, in this order: abandon the tuning round,
    switch to `to`, tell the policy, then tune as `then` says. `stop`: the run's training is over."""
    stop: bool = False
    to: Layout | None = None        # the layout to switch to (None: no switch)
    reason: str | None = None       # "schedule", or the policy's decision: "switch" / "revert"
    evidence: dict | None = None    # the policy's evidence for it
    scheduled: bool = False         # the switch is the forced schedule's next entry
    abandon_tuning: bool = False
    tell_policy: bool = False       # policy.switched(layout in force, step) after the switch
    then: Then = Then.NOTHING
    bucket: float | None = None     # a bucket_cap_mb put in force with the switch (a replayed tuning trial)


STOP = Boundary(stop=True)
NOTHING = Boundary()


def next_boundary(step: int, total: int, scheduled: Layout | None, decision=None, judged: bool = False,
                  tuning: bool = False, kept: bool = False, tuning_over: bool = False) -> Boundary:
    """What happens at boundary `step` of a run of `total` steps.

    scheduled   the layout a forced schedule entry due at `step` asks for (None: none is due)
    decision    the first Switch or Revert the policy asked for in the chunk just trained, or the
                switch a replay carries out here (control/script.py `Replayed`) (None: none)
    judged      a policy judges this run (strategy auto): it hears of every switch
    tuning      a tuning round is in progress (after the trial that ended here was scored)
    kept        the policy judged a switch in the chunk and kept it: time to tune the new layout
    tuning_over `gearshift tune`'s last setting was timed at `step`
    """
    if tuning_over or step >= total:
        return STOP
    if scheduled is not None:
        to, reason, evidence = scheduled, "schedule", None
    elif decision is not None:
        to, reason, evidence = decision.to, decision.name, decision.evidence
    else:
        return Boundary(then=Then.TUNE) if kept else NOTHING
    if decision is not None and decision.name == "revert":
        then = Then.REMEMBERED  # back on a layout tuned before
    elif decision is None:
        then = Then.TUNE  # a forced switch: nothing judges it, tune at once
    else:
        then = Then.TUNE if kept else Then.NOTHING  # the decision's layout is judged first
    return Boundary(to=to, reason=reason, evidence=evidence, scheduled=scheduled is not None,
                    abandon_tuning=tuning, tell_policy=judged, then=then,
                    bucket=getattr(decision, "bucket", None) if scheduled is None else None)
