"""A pipeline position's gradients after the schedule (strategies/pipeline/parallel.py): a
parameter two positions hold (a tied head) gets the sum of their gradients; a stage's replicas
average what FSDP2 did not already reduce (everything, unless parallel.dp_shard); the global
norm over every stage (a sharded gradient's squares summed over its replicas' shards first, a
tied one counted at one position), and clipping by it."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gearshift.strategies.grads import GradAverager
from gearshift.strategies.state import _is_dtensor


class StageGrads:
    """The gradients of `parallel` (a PipelineParallel): `ties`, a parameter several positions
    hold -> those positions; `tie_groups`, those positions -> this replica's group of them."""

    def __init__(self, parallel, ties: dict[str, tuple], tie_groups: dict[tuple, object]):
        self.parallel, self.ties, self.tie_groups = parallel, ties, tie_groups
        self.model, self.position = parallel.model, parallel.position
        # FSDP2 reduces a sharded stage's gradients itself; a whole stage's (tp shards too) are averaged here
        self.averager = GradAverager([] if parallel.sharded else list(self.model.parameters()), parallel.dp_group,
                                     parallel.options.bucket_cap_mb)
        self.averager.timer = lambda nbytes: parallel.blocked(nbytes, "dp")

    def after_backward(self) -> None:
        """Tied parameters' gradients summed between their positions; then every stage's replicas
        average theirs."""
        for name, positions in self.ties.items():
            group = self.tie_groups.get(positions)
            p = self.model.get_parameter(name)
            if group is None or p.grad is None:
                continue
            grad = p.grad.to_local() if _is_dtensor(p.grad) else p.grad  # sharded alike at both positions
            with self.parallel.blocked(grad.numel() * grad.element_size(), "pp"):
                dist.all_reduce(grad, group=group)
        self.averager()

    def owned(self) -> list[torch.Tensor]:
        """The gradients this position counts in the global norm: a parameter two positions hold
        counts on the first of them only."""
        out = []
        for name, p in self.model.named_parameters():
            positions = self.ties.get(name)
            if p.grad is not None and (positions is None or positions[0] == self.position):
                out.append(p.grad)
        return out

    def norm(self) -> torch.Tensor:
        """The global norm over every stage: each position's squares (a sharded gradient's summed
        over the mesh dimensions it is split over: tp, the replicas, or both), summed over the
        positions."""
        from gearshift.strategies.grads import mesh_grad_squares

        par = self.parallel
        squares = mesh_grad_squares(self.owned(), par.blocked, par.options.device)
        if par.layout.pp > 1:
            with par.blocked(squares.element_size(), "pp"):
                dist.all_reduce(squares, group=par.pp_group)
        return squares.sqrt()

    def clip(self, max_norm: float) -> torch.Tensor:
        """As torch.nn.utils.clip_grad_norm_ over the whole model: the global norm over every
        stage, each gradient scaled by max_norm / (norm + 1e-6) where that is below 1."""
        norm = self.norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        grads = [p.grad.to_local() if _is_dtensor(p.grad) else p.grad
                 for p in self.model.parameters() if p.grad is not None]
        if grads:
            torch._foreach_mul_(grads, coef.to(grads[0].device))
        return norm


__all__ = ["StageGrads"]
