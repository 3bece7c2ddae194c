"""A layout: how many pipeline stages (pp) of how many data-parallel replicas (dp) of how many
tensor-parallel shards (tp), and over how many of the dp ranks the state of each replica is
sharded (shard). Ranks fill the (pp, dp, tp) grid stage-major: a stage's ranks are consecutive,
a tp group's too.

`shard` = 1: every dp rank holds whole state for its tp slice (data, tensor, hybrid).
`shard` = dp: parameters, gradients and optimizer state are split over all dp ranks (fsdp,
hybrid with parallel.dp_shard). 1 < `shard` < dp: split inside groups of `shard` consecutive dp
ranks and replicated across the groups (hsdp).
"""

from __future__ import annotations

from dataclasses import dataclass

from gearshift.strategies.registry import STRATEGIES


class LayoutError(ValueError):
    """The numbers do not add up; the message prints the equation."""


# How a strategy shards the state of its data dimension (Strategy.sharding lists the forms it allows).
REPLICATED = "replicated"  # shard = 1
SHARDED = "sharded"        # shard = dp
GROUPED = "grouped"        # shard = parallel.shard_size, a divisor of dp


@dataclass(frozen=True)
class Layout:
    strategy: str  # a registered strategy: "data", "tensor", "hybrid", "fsdp", "hsdp", or a user's own
    dp: int
    tp: int
    shard: int = 1
    pp: int = 1  # pipeline stages (strategy pipeline)

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1 or self.shard < 1 or self.pp < 1:
            raise LayoutError(f"dp({self.dp}), tp({self.tp}), shard({self.shard}) and pp({self.pp}) must be at least 1")
        mesh = _mesh_of(self.strategy)
        if mesh != "pipe" and self.pp != 1:
            raise LayoutError(f"{self._noun()} has no pipeline stages: pp({self.pp}) must be 1")
        if mesh == "pipe" and self.pp < 2:
            raise LayoutError(f"strategy {self.strategy}: pp({self.pp}) stages; a pipeline has at least 2")
        if mesh == "pipe" and self.shard not in (1, self.dp):
            raise LayoutError(f"strategy {self.strategy}: a stage's state is whole or sharded over all its "
                              f"replicas: shard({self.shard}) must be 1 or dp({self.dp})")
        if mesh == "replicate" and self.tp != 1:
            raise LayoutError(f"{self._noun()} shards no layer: tp({self.tp}) must be 1")
        if mesh == "shard" and self.dp != 1:
            raise LayoutError(f"{self._noun()} uses every worker as one shard group: dp({self.dp}) must be 1")
        if self.dp % self.shard:
            raise LayoutError(f"shard({self.shard}) must divide dp({self.dp}): {self.dp} % {self.shard} = "
                              f"{self.dp % self.shard}")
        forms = _sharding_of(self.strategy)
        if forms is not None and self.dp > 1 and self.form not in forms:
            raise LayoutError(f"{self._noun()} with shard({self.shard}) over dp({self.dp}) is {self.form}; "
                              f"it allows {' or '.join(forms)} state")

    def _noun(self) -> str:
        return {"data": "data parallelism", "tensor": "tensor parallelism"}.get(self.strategy,
                                                                                f"strategy {self.strategy}")

    @property
    def form(self) -> str:
        """replicated, sharded or grouped (see the module's doc)."""
        if self.shard == 1 and self.dp > 1:
            return REPLICATED
        return SHARDED if self.shard == self.dp else GROUPED

    @property
    def whole(self) -> bool:
        """Whether every rank holds the whole model and optimizer state (a replica): no tensor
        shards, no sharded data dimension, no pipeline cut."""
        return self.pp == 1 and self.tp == 1 and self.shard == 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def replicas(self) -> int:
        """Whole copies of the state across the workers (hsdp: dp / shard)."""
        return self.dp // self.shard

    def to_dict(self) -> dict:
        """How records, events and the summary write a layout (`shard` only when state is sharded,
        so records of unsharded layouts read as they always did)."""
        out = {"strategy": self.strategy, "dp": self.dp, "tp": self.tp}
        if self.shard > 1:
            out["shard"] = self.shard
        if self.pp > 1:
            out["pp"] = self.pp
        return out

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(d["strategy"], int(d["dp"]), int(d["tp"]), int(d.get("shard") or 1), int(d.get("pp") or 1))

    def __str__(self) -> str:
        return (f"{self.strategy} " + (f"pp={self.pp} " if self.pp > 1 else "") + f"dp={self.dp} tp={self.tp}"
                + (f" shard={self.shard}" if self.shard > 1 else ""))

    @classmethod
    def for_workers(cls, strategy: str, num_workers: int, tp_size: int | None, shard_size: int | None = None,
                    dp_shard: bool = False, pp_size: int | None = None) -> "Layout":
        """The layout a job asks for, or LayoutError with the equation that fails. `shard_size`
        is hsdp's group; `dp_shard` shards a grid layout's data dimension (hybrid); `pp_size`
        the pipeline's stages."""
        mesh = _mesh_of(strategy)
        if mesh == "pipe":
            return _pipeline(strategy, num_workers, tp_size, pp_size, dp_shard)
        if pp_size not in (None, 1):
            raise LayoutError(f"parallel.pp_size applies to strategy pipeline; strategy {strategy} has no stages: "
                              f"pp_size({pp_size}) must be 1 or unset")
        if mesh == "replicate":
            if tp_size not in (None, 1):
                raise LayoutError(f"strategy {strategy} uses no tensor parallelism: tp_size({tp_size}) must be 1 "
                                  "or unset")
            dp, tp = num_workers, 1
        elif mesh == "shard":
            if tp_size not in (None, num_workers):
                raise LayoutError(f"strategy {strategy} shards over every worker: tp_size({tp_size}) != "
                                  f"num_workers({num_workers}); use hybrid for dp x tp")
            dp, tp = 1, num_workers
        elif mesh == "grid":
            if tp_size is None:
                raise LayoutError(f"strategy {strategy} needs parallel.tp_size (dp = num_workers / tp_size)")
            if num_workers % tp_size:
                raise LayoutError(f"dp * tp_size({tp_size}) != num_workers({num_workers}): "
                                  f"{num_workers} % {tp_size} = {num_workers % tp_size}")
            dp, tp = num_workers // tp_size, tp_size
        else:
            raise LayoutError(f"unknown strategy {strategy!r}")
        return cls(strategy, dp, tp, _shard_for(strategy, dp, shard_size, dp_shard))

    def dp_rank(self, rank: int) -> int:
        # ranks fill the (pp, dp, tp) mesh row by row: a tp group is tp consecutive ranks
        return (rank % (self.dp * self.tp)) // self.tp

    def stage_of(self, rank: int) -> int:
        """The pipeline stage `rank` runs (0 where there is no pipeline)."""
        return rank // (self.dp * self.tp)

    def seed_stream(self, rank: int) -> int:
        """Which random stream `rank` draws from (dropout, augmentation in the step): one per data
        replica and pipeline position, the same across a tensor-parallel group (its ranks compute
        one activation, so they must draw one mask). Without a pipeline it is the replica's rank, as
        it always was; a position after the first draws its own, so that the blocks after a cut
        do not reuse the masks the first position's blocks drew."""
        return self.stage_of(rank) * self.dp + self.dp_rank(rank)

    def tp_groups(self) -> list[list[int]]:
        return [list(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.pp * self.dp)]


def _pipeline(strategy: str, num_workers: int, tp_size: int | None, pp_size: int | None, dp_shard: bool) -> Layout:
    if pp_size is None:
        raise LayoutError(f"strategy {strategy} needs parallel.pp_size (the stages; dp = num_workers / pp_size)")
    if pp_size < 2:
        raise LayoutError(f"parallel.pp_size: {pp_size} stages; a pipeline has at least 2")
    if num_workers % pp_size:
        raise LayoutError(f"parallel.pp_size: dp * pp_size({pp_size}) != num_workers({num_workers}): "
                          f"{num_workers} % {pp_size} = {num_workers % pp_size}; allowed: a divisor of num_workers")
    tp = tp_size or 1
    if tp < 1 or num_workers % (pp_size * tp):
        raise LayoutError(f"parallel.tp_size: pp_size({pp_size}) * dp * tp_size({tp_size}) != "
                          f"num_workers({num_workers}): {num_workers} % {pp_size * tp} = "
                          f"{num_workers % (pp_size * tp) if tp >= 1 else 'undefined'}; allowed: a divisor of "
                          f"num_workers / pp_size ({num_workers // pp_size})")
    dp = num_workers // (pp_size * tp)
    return Layout(strategy, dp, tp, dp if dp_shard else 1, pp_size)


def _shard_for(strategy: str, dp: int, shard_size: int | None, dp_shard: bool) -> int:
    forms = _sharding_of(strategy) or (REPLICATED,)
    if dp_shard:
        if SHARDED not in forms or REPLICATED not in forms:
            raise LayoutError(f"parallel.dp_shard applies to a layout that may shard its data dimension "
                              f"(hybrid, pipeline); strategy {strategy} cannot")
        return dp
    if GROUPED in forms:
        if shard_size is None:
            raise LayoutError(f"strategy {strategy} needs parallel.shard_size (the workers of one shard group)")
        if shard_size < 1 or dp % shard_size:
            raise LayoutError(f"groups * shard_size({shard_size}) != num_workers({dp}): "
                              f"{dp} % {shard_size} = {dp % shard_size if shard_size else 'undefined'}")
        return shard_size
    if shard_size is not None:
        raise LayoutError(f"parallel.shard_size applies to hsdp; strategy {strategy} "
                          + ("shards over every worker" if forms == (SHARDED,) else "does not shard its state"))
    return dp if forms == (SHARDED,) else 1


def _strategy(strategy: str):
    return STRATEGIES.get(strategy)


def _mesh_of(strategy: str) -> str | None:
    """How a registered strategy uses the workers (None: not registered in this process)."""
    found = _strategy(strategy)
    return found.mesh if found is not None else None


def _sharding_of(strategy: str) -> tuple[str, ...] | None:
    found = _strategy(strategy)
    return tuple(found.sharding) if found is not None else None
