"""Evaluation: the mean loss over held-out data under the layout in force."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gearshift.workers.step.data import load_batch, tokens_per_sample


def held_out_loss(dataset, forward_loss, module, device, global_batch: int, layout, rank: int, world: int,
                  max_batches: int | None = None, micro_batch: int | None = None) -> dict:
    """Mean loss over `dataset`; every rank calls it at the same step boundary.

    Batch b is samples [b*G, (b+1)*G) of the eval dataset in order (G = the global batch; the
    last one may be short), each data-parallel replica taking its contiguous slice, as in
    training. The ranks of a tensor-parallel group compute the same slice, so the
    (sum of losses, samples) all-reduced over the whole world counts each slice tp times in
    numerator and denominator alike: the ratio is the mean over the data. Every rank runs one
    forward per batch (also on an empty slice) so the layout's collectives stay in step. With
    `micro_batch` (train.micro_batch_size, or the one an out-of-memory step left), a slice runs
    that many samples a forward, and every rank runs as many forwards as the largest slice of
    the batch needs (empty ones where its own is shorter), so the peak is one micro-batch's
    activations, not a whole slice's.
    """
    n, g = len(dataset), global_batch
    total = -(-n // g) if max_batches is None else min(max_batches, -(-n // g))
    dp_rank, dp = layout.dp_rank(rank), layout.dp
    sums = torch.zeros(2, dtype=torch.float64, device=device)
    module.eval()  # dropout off; batch-norm statistics used, not updated
    try:
        with torch.no_grad():
            for b in range(total):
                lo, hi = b * g, min((b + 1) * g, n)
                mine = list(range(lo + (hi - lo) * dp_rank // dp, lo + (hi - lo) * (dp_rank + 1) // dp))
                largest = -(-(hi - lo) // dp)  # the largest slice of this batch over the dp ranks
                step = micro_batch if micro_batch and micro_batch < largest else max(largest, 1)
                for first in range(0, max(largest, 1), step):
                    part = mine[first:first + step]
                    x, y = load_batch(dataset, part or [lo])  # an empty part still runs a forward
                    x, y = x.to(device), y.to(device)
                    if not part:
                        x, y = x[:0], y[:0]
                    if not part and layout.pp > 1:  # a pipeline's replica skips it on every stage: no collective
                        continue
                    loss = forward_loss(x, y)  # the training forward and loss, with its autocast
                    if part and loss is not None:  # a mean over its samples, weighted by their count (None: not
                        # a pipeline's last stage)
                        sums[0] += loss.detach().double() * len(part)
                        sums[1] += len(part)
    finally:
        module.train()
    dist.all_reduce(sums)
    loss_sum, count = sums.tolist()
    copies = world // dp // layout.pp  # the ranks that counted each sample: a tp group's (a pipeline's last stage)
    return {"loss": loss_sum / count, "samples": int(round(count / copies)), "batches": total,
            "token_targets": tokens_per_sample(dataset) is not None}
