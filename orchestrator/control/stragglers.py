"""adapt.stragglers on a live run: the step records fed to the rebalancer
(orchestrator/policy/rebalance.py), and its decision carried out where the workers stop for it
(within two steps of the record that showed it, as a switch is), by `TrainWorker.set_shares` on
every rank at the same step boundary. A rebalance waits while a bucket-tuning round or a switch's
trial runs (their timings must not see the shares move), and every new layout, world or
micro-batch starts over on even shares: the workers' own reset (workers/build/builder.py)."""

from __future__ import annotations

from gearshift.orchestrator.policy.decisions import Report
from gearshift.orchestrator.policy.rebalance import Rebalance, Rebalancer


class Stragglers:
    def __init__(self, ctl):
        self.ctl = ctl
        self.rebalancer: Rebalancer | None = None
        self.pending: tuple[Rebalance, int] | None = None  # the chunk's rebalance and the step it was seen
        self.shares: tuple[int, ...] | None = None  # the shares in force (None: even)

    def start_over(self) -> None:
        """Even shares on the layout in force (the workers are there already, or were just built)."""
        ctl = self.ctl
        mode, lay = ctl.job.adapt.stragglers, ctl.layout
        watched = mode != "off" and lay.dp > 1 and lay.pp == 1 and ctl.job.telemetry.enabled
        self.rebalancer = Rebalancer(mode, lay, ctl.job.train.global_batch_size, ctl.micro, ctl.infos,
                                     cooldown=ctl.job.adapt.cooldown) if watched else None
        if self.pending is not None:
            self._report(*self.pending, applied=None)
        self.pending, self.shares = None, None

    @property
    def watching(self) -> bool:
        return self.rebalancer is not None

    def context(self) -> dict:
        """What the step records of the chunk about to run are stamped with."""
        return {"shares": list(self.shares)} if self.shares else {}

    def observe(self, record: dict) -> bool:
        """Feed one step record; True where a rebalance is now waiting for the chunk to end."""
        ctl = self.ctl
        if self.rebalancer is None or self.pending is not None or ctl.tuning.active or self._on_trial():
            return False
        got = self.rebalancer.observe(record)
        if isinstance(got, Report):
            ctl.report.decided(got, record["step"], record["step"])
        elif isinstance(got, Rebalance):
            self.pending = (got, record["step"])
            return True
        return False

    def carry_out(self, step: int) -> None:
        """At chunk end `step`: the pending rebalance on every rank (the workers agree on nothing
        more: each takes the same list)."""
        if self.pending is None:
            return
        decision, seen = self.pending
        self.pending = None
        self.ctl.group.call("set_shares", list(decision.shares))
        self.rebalancer.applied(decision, step)
        self.shares = decision.shares
        self._report(decision, seen, applied=step)

    def _report(self, decision: Rebalance, seen: int, applied: int | None) -> None:
        self.ctl.report.decided(decision, seen, applied)

    def _on_trial(self) -> bool:
        policy = self.ctl.policy
        standing = getattr(policy, "standing", None)
        return getattr(standing, "trial", None) is not None
