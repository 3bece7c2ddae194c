"""Which rows of the step's global batch a forward computes: a context that the step sets and the
layouts carry through the micro-batches they cut (a pipeline's schedule cuts them itself: its
stages narrow the pass's rows to each micro-batch's, strategies/pipeline/stage.py). What reads it:
dropout masks per sample (workers/step/sample_masks.py). It lives here, not with the step, because
the layouts that cut micro-batches must carry it and never import the workers' code."""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rows:
    """The rows a forward computes: the step and each row's place in the step's global batch."""

    seed: int
    step: int
    places: torch.Tensor  # int64, one per row

    def split(self, n: int, even: bool = True) -> list["Rows"]:
        """The rows of `n` micro-batches, cut as the step cuts its inputs (chunk; tensor_split
        where `even` is False)."""
        parts = self.places.chunk(n) if even else self.places.tensor_split(n)
        return [Rows(self.seed, self.step, part) for part in parts]

    def narrowed(self, places: torch.Tensor) -> "Rows":
        return Rows(self.seed, self.step, places)


_current: contextvars.ContextVar[Rows | None] = contextvars.ContextVar("gearshift_sample_rows", default=None)


@contextlib.contextmanager
def within(r: Rows | None):
    """Forwards inside draw the masks of rows `r` (None: torch's dropout)."""
    token = _current.set(r)
    try:
        yield
    finally:
        _current.reset(token)


def rows(seed: int, step: int, places: torch.Tensor | None):
    """`within` the rows at `places` of step `step`."""
    return within(None if places is None else Rows(seed, step, places))


def current() -> Rows | None:
    return _current.get()


def places(lo: int, hi: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The global-batch places of a replica's slice [lo, hi), on the device its rows are on."""
    return torch.arange(lo, hi, dtype=torch.int64, device=device)


def checkpoint_contexts():
    """torch.utils.checkpoint's `context_fn`: the recomputation in backward runs in the rows the
    forward ran in (backward runs outside every step variant's `rows`)."""
    seen = _current.get()

    @contextlib.contextmanager
    def again():
        token = _current.set(seen)
        try:
            yield
        finally:
            _current.reset(token)

    return contextlib.nullcontext(), again()
