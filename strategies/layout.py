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
        if self.strategy == "data" and self.tp != 1:
            raise LayoutError(f"data parallelism shards nothing: tp({self.tp}) must be 1")
        if self.strategy == "tensor" and self.dp != 1:
            raise LayoutError(f"tensor parallelism uses every worker as one shard group: dp({self.dp}) must be 1")

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
        if strategy == "data":
            if tp_size not in (None, 1):
                raise LayoutError(f"strategy data uses no tensor parallelism: tp_size({tp_size}) must be 1 or unset")
            return cls("data", num_workers, 1)
        if strategy == "tensor":
            if tp_size not in (None, num_workers):
                raise LayoutError(f"strategy tensor shards over every worker: tp_size({tp_size}) != "
                                  f"num_workers({num_workers}); use hybrid for dp x tp")
            return cls("tensor", 1, num_workers)
        if strategy == "hybrid":
            if tp_size is None:
                raise LayoutError("strategy hybrid needs parallel.tp_size (dp = num_workers / tp_size)")
            if num_workers % tp_size:
                raise LayoutError(f"dp * tp_size({tp_size}) != num_workers({num_workers}): "
                                  f"{num_workers} % {tp_size} = {num_workers % tp_size}")
            return cls("hybrid", num_workers // tp_size, tp_size)
        raise LayoutError(f"unknown strategy {strategy!r}")

    def dp_rank(self, rank: int) -> int:
        # ranks fill the (dp, tp) mesh row by row: a tp group is tp consecutive ranks
        return rank // self.tp

    def tp_groups(self) -> list[list[int]]:
        return [list(range(d * self.tp, (d + 1) * self.tp)) for d in range(self.dp)]
