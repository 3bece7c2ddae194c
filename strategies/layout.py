"""A layout: how many data-parallel replicas (dp) of how many tensor-parallel shards (tp)."""

from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """The numbers do not add up; the message prints the equation."""


@dataclass(frozen=True)
class Layout:
    strategy: str  # "data", "tensor" or "hybrid"
    dp: int
    tp: int

    def __post_init__(self):
        if self.dp < 1 or self.tp < 1:
            raise LayoutError(f"dp({self.dp}) and tp({self.tp}) must be at least 1")
        mesh = _mesh_of(self.strategy)
        if mesh == "replicate" and self.tp != 1:
            raise LayoutError(f"{self._noun()} shards nothing: tp({self.tp}) must be 1")
        if mesh == "shard" and self.dp != 1:
            raise LayoutError(f"{self._noun()} uses every worker as one shard group: dp({self.dp}) must be 1")

    def _noun(self) -> str:
        return {"data": "data parallelism", "tensor": "tensor parallelism"}.get(self.strategy,
                                                                                f"strategy {self.strategy}")

    @property
    def world(self) -> int:
        return self.dp * self.tp

    def to_dict(self) -> dict:
        """How records, events and the summary write a layout."""
        return {"strategy": self.strategy, "dp": self.dp, "tp": self.tp}

    @classmethod
    def from_dict(cls, d: dict) -> "Layout":
        return cls(d["strategy"], int(d["dp"]), int(d["tp"]))

    def __str__(self) -> str:
        return f"{self.strategy} dp={self.dp} tp={self.tp}"

    @classmethod
    def for_workers(cls, strategy: str, num_workers: int, tp_size: int | None) -> "Layout":
        """The layout a job asks for, or LayoutError with the equation that fails."""
        mesh = _mesh_of(strategy)
        if mesh == "replicate":
            if tp_size not in (None, 1):
                raise LayoutError(f"strategy {strategy} uses no tensor parallelism: tp_size({tp_size}) must be 1 "
                                  "or unset")
            return cls(strategy, num_workers, 1)
        if mesh == "shard":
            if tp_size not in (None, num_workers):
                raise LayoutError(f"strategy {strategy} shards over every worker: tp_size({tp_size}) != "
                                  f"num_workers({num_workers}); use hybrid for dp x tp")
            return cls(strategy, 1, num_workers)
        if mesh == "grid":
            if tp_size is None:
                raise LayoutError(f"strategy {strategy} needs parallel.tp_size (dp = num_workers / tp_size)")
            if num_workers % tp_size:
                raise LayoutError(f"dp * tp_size({tp_size}) != num_workers({num_workers}): "
                                  f"{num_workers} % {tp_size} = {num_workers % tp_size}")
            return cls(strategy, num_workers // tp_size, tp_size)
        raise LayoutError(f"unknown strategy {strategy!r}")

    def dp_rank(self, rank: int) -> int:
        # ranks fill the (dp, tp) mesh row by row: a tp group is tp consecutive ranks
        return rank // self.tp

    def tp_groups(self) -> list[list[int]]:
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]


def _mesh_of(strategy: str) -> str | None:
    """How a registered strategy uses the workers (None: not registered in this process)."""
    from strategies import STRATEGIES  # the registry imports this module

    found = STRATEGIES.get(strategy)
    return found.mesh if found is not None else None
