"""Uneven shares of a global batch between the data-parallel replicas: a straggler's rebalance.

A step's global batch is cut into contiguous slices in replica order, as with even shares, only
of the sizes the controller set (`TrainWorker.set_shares`): the samples of every step and their
order are the same whatever the shares, so no sample is dropped or repeated. Each replica's mean
loss is weighted by its count x dp / the global batch, so the replicas' average of the gradients
(what DDP, FSDP2's reduce-scatter and hybrid's dp average compute) is the global batch's mean
gradient, as a single process computes it. A step takes as many micro-batches on every rank
(`micro_batches`): a sharded layout's collectives inside forward and backward pair up.
"""

from __future__ import annotations

from collections.abc import Sequence


class SharesError(ValueError):
    """Shares that do not cut the global batch between the replicas."""


def check(shares: Sequence[int] | None, dp: int, batch: int) -> tuple[int, ...] | None:
    """`shares` as a tuple, one whole count per replica adding up to the global batch; None for
    even shares (also what an even list is given back as)."""
    if shares is None:
        return None
    counts = tuple(shares)
    if len(counts) != dp:
        raise SharesError(f"shares {list(counts)}: one count per data-parallel replica, {dp} of them")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in counts):
        raise SharesError(f"shares {list(counts)}: each is a whole number of samples, at least 1")
    if sum(counts) != batch:
        raise SharesError(f"shares {list(counts)} add up to {sum(counts)}, not the global batch {batch}")
    return None if counts == even(dp, batch) else counts


def even(dp: int, batch: int) -> tuple[int, ...]:
    return (batch // dp,) * dp


def bounds(batch: int, dp_rank: int, dp: int, shares: Sequence[int] | None = None) -> tuple[int, int]:
    """Replica `dp_rank`'s slice [lo, hi) of a global batch."""
    if shares is None:
        per = batch // dp
        return dp_rank * per, (dp_rank + 1) * per
    lo = sum(shares[:dp_rank])
    return lo, lo + shares[dp_rank]


def micro_batches(shares: Sequence[int], micro_batch: int | None) -> int:
    """The micro-batches of a step, as many on every rank: enough that the largest share's are at
    most `micro_batch` samples (None: a share at once). Every share must hold one sample each."""
    k = max(-(-n // micro_batch) for n in shares) if micro_batch else 1
    if min(shares) < k:
        raise SharesError(f"shares {list(shares)}: the largest takes {k} micro-batches of at most {micro_batch}, "
                          f"so each share needs at least {k} samples")
    return k

