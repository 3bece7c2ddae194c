"""The cost model at unequal speeds: a step of a layout whose ranks compute at shares of full
speed (a throttled GPU, a slower generation in the mix, a noisy neighbour), with even shares of
the global batch or with shares that follow the speeds (adapt.stragglers: rebalance). Pure, like
costmodel.py: `gearshift simulate` prices its scenario's `slow` events with it, `gearshift plan
--slow` its table.

- A data-parallel replica computes its share at its slowest rank's speed (a tensor-parallel group
  computes together) and the step waits for the slowest replica, plus the layout's comm tail
  (what no compute hides, as at full speed).
- Rebalanced, each replica takes whole samples in proportion to its speed, each share at least
  what the step's micro-batches need (rebalance.proportional: the live rule's shares where a
  replica's compute time is proportional to its samples).
- A pipeline's pace is its slowest stage's: taken as the whole step's compute at its slowest
  rank's speed. A stage's share of the layers is not moved (nothing rebalances a pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gearshift.orchestrator.policy.costmodel import Prediction
from gearshift.orchestrator.policy.rebalance import proportional
from gearshift.strategies.layout import Layout

REBALANCING = ("rebalance", "drop")  # the adapt.stragglers modes that move shares to follow the speeds


def layout_of(pred: Prediction) -> Layout:
    """The layout a prediction is for (its ranks in the mesh order the workers take)."""
    return Layout(pred.strategy, pred.dp, pred.tp, pred.shard, pred.pp)


def replica_speeds(layout: Layout, speeds: tuple[float, ...]) -> list[float]:
    """Each data-parallel replica's speed: its slowest rank's."""
    out = [1.0] * layout.dp
    for r in range(layout.world):
        j = layout.dp_rank(r)
        out[j] = min(out[j], speeds[r])
    return out


def step(pred: Prediction, layout: Layout, batch: int, speeds: tuple[float, ...], shares=None
         ) -> tuple[float, list[float]]:
    """(the step's seconds, each rank's compute seconds) of `pred`'s layout with its ranks at
    `speeds` and its replicas on `shares` of the global batch (None: even)."""
    compute = pred.step_s - pred.exposed_wait_s
    if layout.pp > 1 or min(speeds) == 1.0 and shares is None:
        slowest = min(speeds)
        return pred.step_s + compute * (1 / slowest - 1), [compute / slowest] * layout.world
    even = batch / layout.dp
    per_rank = [compute * (shares[layout.dp_rank(r)] if shares else even) / even / speeds[r]
                for r in range(layout.world)]
    return max(per_rank) + pred.exposed_wait_s, per_rank


def balanced(pred: Prediction, layout: Layout, speeds: tuple[float, ...]) -> float:
    """The step with shares exactly in proportion to the replicas' speeds, fractions of a sample
    allowed (a bound: simulate's oracle)."""
    if layout.pp > 1 or min(speeds) == 1.0:
        return step(pred, layout, 0, speeds)[0]
    compute = pred.step_s - pred.exposed_wait_s
    return compute * layout.dp / sum(replica_speeds(layout, speeds)) + pred.exposed_wait_s


def at(pred: Prediction, batch: int, seconds: float) -> Prediction:
    """`pred` with its step lasting `seconds`: the compute stretched, the comm tail as it was."""
    return replace(pred, compute_s=seconds - pred.exposed_wait_s, step_s=seconds,
                   samples_per_s=batch / seconds if seconds > 0 else 0.0)


@dataclass(frozen=True)
class Priced:
    """A layout at unequal speeds: its step on even shares, and rebalanced where that moves
    samples (None: a pipeline, a single replica, or replicas all as fast)."""

    even: Prediction
    rebalanced: Prediction | None = None
    shares: tuple[int, ...] | None = None

    def run(self, mode: str = "rebalance") -> Prediction:
        """The step a run gets under adapt.stragglers `mode`: rebalanced where the mode moves shares."""
        return self.rebalanced if mode in REBALANCING and self.rebalanced is not None else self.even


def price(pred: Prediction, batch: int, speeds: tuple[float, ...], micro_batch: int | None = None) -> Priced:
    """`pred` (a layout at full speed) with its ranks at `speeds`, even and rebalanced."""
    layout = layout_of(pred)
    even = at(pred, batch, step(pred, layout, batch, speeds)[0])
    replicas = replica_speeds(layout, speeds)
    if layout.pp > 1 or layout.dp == 1 or len(set(replicas)) == 1:
        return Priced(even)
    shares = proportional(replicas, batch, micro_batch)
    if len(set(shares)) == 1:
        return Priced(even)
    return Priced(even, at(pred, batch, step(pred, layout, batch, speeds, shares)[0]), shares)


def ranks_text(ranks) -> str:
    """Ranks as ranges: 8-15, 20."""
    out, run = [], [ranks[0]]
    for r in ranks[1:]:
        if r == run[-1] + 1:
            run.append(r)
        else:
            out.append(run)
            run = [r]
    out.append(run)
    return ", ".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in out)
