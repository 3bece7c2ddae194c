"""Stopping every rank at the same step boundary, soon after the controller asks, without a
round trip to the driver on the hot path.

The controller asks any rank (`TrainWorker.request_stop`, which Ray runs on a thread of its own
while the step loop goes on) and the ranks agree among themselves: at each step boundary every
rank adds its flag to an all-reduce (max) over a small group of its own, started without
waiting, and reads the result of the one it started at the boundary before, which has run
behind the step. That result is the same on every rank, so all of them stop at the same
boundary: the second after the one where any rank saw the request. The group is gloo on CPU
tensors whatever the training backend, so it never queues behind a step's own collectives.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from gearshift.strategies.mesh import group_timeout


def flag_group(world: int):
    """The process group the flags travel in (every rank must call this at the same point); None
    for one process, whose flag is its own. It times out with the default group (the job's
    collective timeout), not after torch's 30 minutes."""
    return dist.new_group(backend="gloo", timeout=group_timeout()) if world > 1 else None


class StopAgreement:
    def __init__(self, group, asked: Callable[[], bool]):
        self.group, self.asked = group, asked
        self.flag: torch.Tensor | None = None
        self.work = None

    def stop_here(self) -> bool:
        """At a step boundary: whether every rank stops here (the same answer on all)."""
        if self.group is None:
            return self.asked()
        if self.work is not None:
            self.work.wait()
            self.work = None
            if int(self.flag.item()):
                return True
        self.flag = torch.tensor([1 if self.asked() else 0], dtype=torch.int32)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return False

    def close(self) -> None:
        """The loop ended without stopping here: the last flag's all-reduce is done on every rank
        before anything else runs on the group."""
        if self.work is not None:
            self.work.wait()
            self.work = None
