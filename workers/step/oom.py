"""A step that runs out of memory, on this rank or on a peer: what the worker does so that every
rank leaves the step with nothing applied, and what it tells the controller.

The rank whose step raised `torch.OutOfMemoryError` drops the step's partial work (gradients,
the loss), gives back what it can, and leaves its process group: a peer blocked in one of the
step's collectives then gets an error at once (gloo: the connection closes) instead of waiting
for the collective timeout. That peer drops its partial work too and says its step was
aborted. Every rank's step loop ends at the same boundary, the last step all of them finished;
the controller forms a new process group on the same processes (`TrainWorker.rejoin`) and goes
on at the same step with a setting that needs less memory (orchestrator/control/memory.py).

An update half applied (an OOM inside the optimizer's step) cannot be taken back: that one is
reported as such, and the run stops rather than continue from a state no plain run reaches.
"""

from __future__ import annotations

import gc
import sys

import torch
import torch.distributed as dist

# what a collective raises on a rank whose peer left the group (or whose group was aborted)
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
              "NCCL communicator was aborted", "has been aborted", "ProcessGroup abort", "Connection refused",
              "process group has been destroyed", "Default process group has not been initialized",
              # NCCL: a peer's exit or a network error (ncclRemoteError), its watchdog's abort
              "ncclRemoteError", "remote process exited", "Watchdog caught collective operation timeout")


def causes(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from: torch.distributed.pipelining raises a stage's
    failure as a RuntimeError ("[Stage k] failed to run forward") from the collective's or the
    allocation's own error, so what failed is read down the chain. A checkpoint's collective
    raises torch.distributed.checkpoint's CheckpointException (a BaseException) holding each
    failed rank's own exception apart from the chain: those are read too."""
    chain: list[BaseException] = []
    while err is not None and err not in chain:
        chain.append(err)
        for inner in checkpoint_failures(err):
            chain.extend(e for e in causes(inner) if e not in chain)
        err = err.__cause__
    return chain


def checkpoint_failures(err: BaseException) -> list[BaseException]:
    """The ranks' own exceptions inside a CheckpointException; [] for any other exception."""
    api = sys.modules.get("torch.distributed.checkpoint.api")  # not imported: no checkpoint raised
    if api is None or not isinstance(err, api.CheckpointException):
        return []
    return [inner for inner, _trace in err.failures.values() if isinstance(inner, BaseException)]


def ran_out(err: BaseException) -> bool:
    """Whether `err`, raised in a step, is (or was raised from) running out of device memory."""
    return any(isinstance(e, torch.OutOfMemoryError) for e in causes(err))


def peer_gone(err: BaseException) -> bool:
    """Whether `err`, raised in a step, is (or was raised from) a collective failing because a
    peer left the group."""
    if ran_out(err):
        return False
    return any(isinstance(e, (RuntimeError, dist.DistError)) and any(s in str(e) for s in _PEER_GONE)
               for e in causes(err))


def memory_figures(device: torch.device) -> dict:
    """This rank's memory right after the failure: what torch has allocated and reserved on the
    device and what the device has free (on CPU, the process's resident set and the host's
    available memory)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated_bytes": int(torch.cuda.memory_allocated(device)),
                "reserved_bytes": int(torch.cuda.memory_reserved(device)),
                "free_bytes": int(free), "total_bytes": int(total)}
    import psutil

    vm = psutil.virtual_memory()
    return {"allocated_bytes": int(psutil.Process().memory_info().rss), "reserved_bytes": None,
            "free_bytes": int(vm.available), "total_bytes": int(vm.total)}


def give_back(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def leave_group() -> None:
    """Leave every process group now, so that peers blocked in this step's collectives fail fast."""
    from gearshift.workers.group import rendezvous

    rendezvous.leave()
