"""A worker forms a new process group with its state in place: after a step that failed on some
rank (out of memory there, so the same ranks go on), or after ranks were lost (an elastic shrink:
the survivors go on as fewer ranks, and the state they hold moves onto the layout chosen for
them, strategies/survivors.py putting back together what the old group can no longer gather)."""

from __future__ import annotations

import time

from gearshift import strategies
from gearshift.strategies.base import SwitchAborted
from gearshift.strategies.layout import Layout
from gearshift.workers import oom


def rejoin(worker, master_addr: str, master_port: int, timeout_s: float, rank: int | None, world: int | None,
           layout: dict | None, old_ranks: list[int] | None) -> dict:
    """Leave the broken group and join a new one. Every tensor stays where it is: a replicated
    layout's module and optimizer are wrapped again; a sharded one's pieces move to the same
    places on the new mesh, with no collective of the old group. With `rank` of `world`, `layout`
    and `old_ranks` (the old rank of each new one): the survivors' state moves onto `layout`."""
    start = time.perf_counter()
    worker.writes.drop()  # a write behind the steps on the old group cannot finish
    oom.leave_group()
    if rank is not None:
        worker.rank, worker.world = rank, world
    worker._join(master_addr, master_port, timeout_s)
    worker.optimizer.zero_grad(set_to_none=True)
    if layout is not None:
        _move_survivors(worker, Layout.from_dict(layout), old_ranks)
    elif strategies.lookup(worker.layout.strategy).meta_ok:
        result = worker.reshard(worker.layout.to_dict())
        if "failed" in result:
            raise RuntimeError(f"rank {worker.rank}: the layout in force could not be rebuilt on the new process "
                               f"group: {result['failed']['message']}")
    else:
        scaler = worker.scaler.state_dict()
        old = (worker.parallel, worker.optimizer)
        worker.parallel.detach()
        worker.parallel = worker.optimizer = None
        worker._lay_out(worker.layout, rewrap=old)
        del old
        if scaler:
            worker.scaler.load_state_dict(scaler)
    oom.give_back(worker.device)
    return {"seconds": time.perf_counter() - start, "step": worker.step, "layout": worker.layout.to_dict()}


def _move_survivors(worker, target: Layout, old_ranks: list[int]) -> None:
    """The old layout's state, as the survivors hold it, laid out as `target` on the new group
    (a switch whose full tensors come from strategies/survivors.py)."""
    from gearshift.strategies.survivors import Survivors

    scaler = worker.scaler.state_dict()
    old = (worker.parallel, worker.optimizer)
    worker.parallel.detach()
    worker.parallel = worker.optimizer = None
    try:
        worker._lay_out(target, move_from=old, gather=Survivors(old_ranks).full)
    except SwitchAborted as err:
        raise RuntimeError(f"rank {worker.rank}: {err}") from None
    del old
    if scaler:
        worker.scaler.load_state_dict(scaler)
    worker._place_full()
