"""A worker forms a new process group with its state in place: after a step that failed on some
rank (out of memory there, so the same ranks go on), after ranks were lost (an elastic shrink:
the survivors go on as fewer ranks, and the state they hold moves onto the layout chosen for
them, strategies/survivors.py putting back together what the old group can no longer gather),
or with new workers (an elastic grow: they join holding nothing, as stand-ins made from a
holder's `describe`, and receive their pieces as the state moves onto the larger layout)."""

from __future__ import annotations

import time

import torch

from gearshift.strategies.base import SwitchAborted
from gearshift.strategies.layout import Layout
from gearshift.workers.step import oom


def rejoin(worker, master_addr: str, master_port: int, timeout_s: float, rank: int | None, world: int | None,
           layout: dict | None, old_ranks: list | None, joining: dict | None = None) -> dict:
    """Leave the broken group and join a new one. Every tensor stays where it is: a replicated
    layout's module and optimizer are wrapped again; a sharded one's pieces move to the same
    places on the new mesh, with no collective of the old group. With `rank` of `world`, `layout`
    and `old_ranks` (the old rank of each new one): the survivors' state moves onto `layout`."""
    start = time.perf_counter()
    worker.io.writes.drop()  # a write behind the steps on the old group cannot finish
    oom.leave_group()
    if worker.parallel is not None:
        worker.parallel.drop_step()  # what the layout kept of the step that broke off
    if rank is not None:
        worker.rank, worker.world = rank, world
    worker.member.join(master_addr, master_port, timeout_s)
    joined = time.perf_counter()
    if joining is not None:  # a new worker, or one a step behind: it receives the others' state
        if worker.parallel is not None:  # what it held is a step old: given up
            worker.parallel.detach()
            worker.parallel = worker.optimizer = None
            oom.give_back(worker.device)
        if not worker.builder.warmed:
            worker.builder.prepare()
        _move_survivors(worker, Layout.from_dict(layout), old_ranks, joining)
        return _done(worker, start, joined)
    worker.optimizer.zero_grad(set_to_none=True)
    target = Layout.from_dict(layout) if layout is not None else None
    if target is not None and not (worker.layout.whole and target.whole and None not in old_ranks):
        _move_survivors(worker, target, old_ranks)
    elif target is None and not worker.parallel.regroups_in_place:  # pieces bound to the old mesh
        result = worker.reshard(worker.layout.to_dict())
        if "failed" in result:
            raise RuntimeError(f"rank {worker.rank}: the layout in force could not be rebuilt on the new process "
                               f"group: {result['failed']['message']}")
    else:  # the same ranks holding the same tensors (whole replicas onto whole replicas, nobody
        # receiving; or the layout in force, a pipeline's cut stages too): the same modules and
        # optimizer wrapped again on the new group, nothing moved
        scaler = worker.scaler.state_dict()
        old = (worker.parallel, worker.optimizer)
        worker.parallel.detach()
        worker.parallel = worker.optimizer = None
        worker.builder.lay_out(target or worker.layout, rewrap=old)
        del old
        if scaler:
            worker.scaler.load_state_dict(scaler)
        if layout is not None:
            worker.io.locate()  # every rank of the new group: where they all write
    if layout is None or worker.device.type == "cuda":
        # after an out-of-memory step, or on a GPU: what the old layout held goes back now. (A
        # full collection takes 0.2-0.5 s in a worker; on the host, memory dropped in cycles
        # returns at the interpreter's next one)
        oom.give_back(worker.device)
    return _done(worker, start, joined)


def _done(worker, start: float, joined: float) -> dict:
    """A rejoin's result: its seconds, of which `join_s` forming the new group (the rest: the
    state laid out on it), where the worker is, and its process's peak resident memory since its
    last step report (bytes: what the regroup took at most; monitoring/host_memory.py)."""
    from gearshift.monitoring.host_memory import process_peak

    return {"seconds": time.perf_counter() - start, "join_s": joined - start, "step": worker.step,
            "layout": worker.layout.to_dict(), "peak_rss_bytes": process_peak().take()}


def warm(worker) -> None:
    """A worker started to join a running group does, while the group trains on, what it would
    otherwise do while the others wait for it: its data, loss and schedule, the modules a
    relayout uses, and a first build of the model on the meta device (its code imported)."""
    from gearshift.strategies import relayout, survivors  # noqa: F401 (imported now, not in the regroup)
    from gearshift.workers.build import components

    cfg = worker.config
    worker.builder.prepare()
    with torch.device("meta"):
        components.build_model_and_plan(dict(cfg.model), cfg.search_paths, cfg.activation_checkpointing)
    worker.builder.warmed = True


def describe(worker) -> dict:
    """The state `worker` holds, described for a worker joining the group: each tensor's shape,
    dtype and old placement (strategies/survivors.py), the optimizer's scalars, the step."""
    from gearshift.strategies.relayout import held_state
    from gearshift.strategies.survivors import describe as tensor

    held = held_state(worker.parallel, worker.optimizer)
    return {"sources": {n: tensor(t) for n, t in held.sources.items()},
            "saved": {n: {k: tensor(v) if torch.is_tensor(v) and v.dim() > 0 else _cpu(v) for k, v in st.items()}
                      for n, st in held.saved.items()},
            "hyper": {k: _cpu(v) for k, v in held.hyper.items()}, "scaler": worker.scaler.state_dict(),
            "step": worker.step, "micro_batch": worker.micro_batch}


def _cpu(v):
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v


def _stand_ins(joining: dict, device: torch.device):
    """A joining worker's `Held`: stand-ins for the tensors it receives, the scalars as they are."""
    from gearshift.strategies.relayout import Held
    from gearshift.strategies.survivors import absent

    def one(v):
        if isinstance(v, dict) and "shape" in v and "dtype" in v:
            return absent(v, device)
        return v.to(device) if torch.is_tensor(v) and device.type != "cpu" else v

    return Held({n: absent(d, device) for n, d in joining["sources"].items()},
                {n: {k: one(v) for k, v in st.items()} for n, st in joining["saved"].items()},
                dict(joining["hyper"]))


def _move_survivors(worker, target: Layout, old_ranks: list, joining: dict | None = None) -> None:
    """The old layout's state, as the survivors hold it, laid out as `target` on the new group
    (a switch whose full tensors come from strategies/survivors.py); a joining worker holds
    stand-ins and receives its pieces."""
    from gearshift.strategies.survivors import Survivors

    if joining is not None:
        scaler, old = joining["scaler"], (_stand_ins(joining, worker.device), None)
        worker.step, worker.micro_batch = joining["step"], joining["micro_batch"]
    else:
        scaler = worker.scaler.state_dict()
        old = (worker.parallel, worker.optimizer)
        worker.parallel.detach()
        worker.parallel = worker.optimizer = None
    try:
        worker.builder.lay_out(target, move_from=old, gather=Survivors(old_ranks).full)
    except SwitchAborted as err:
        raise RuntimeError(f"rank {worker.rank}: {err}") from None
    del old
    if scaler:
        worker.scaler.load_state_dict(scaler)
    worker.io.locate()  # every rank of the new group: where they all write
