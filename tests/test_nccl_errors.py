"""NCCL as the code meets it on a GPU cluster, checked without one: the environment a worker's
NCCL group is made with (a failed collective raises in every rank, the process lives), and the
error texts of NCCL's watchdog and result codes read as a lost peer, as gloo's socket errors are.
The texts are torch's own wording; that they arrive this way from a real NCCL failure has not
been seen here (docs/fault-tolerance.md, NCCL as it stands)."""

from __future__ import annotations

import pytest

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.workers.step import oom
from gearshift.workers.group.rendezvous import NCCL_ENVIRONMENT, nccl_environment

WATCHDOG = ("[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, "
            "NumelIn=1048576, NumelOut=1048576, Timeout(ms)=300000) ran for 300004 milliseconds before timing out.")
REMOTE = ("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error, "
          "NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a remote "
          "process exiting prematurely.")


def test_a_worker_sets_what_nccl_needs_to_raise_and_leaves_the_users_own_values():
    env = {}
    assert nccl_environment(env) == NCCL_ENVIRONMENT
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCH_NCCL_PROPAGATE_ERROR"] == "1"
    mine = {"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_PROPAGATE_ERROR": "0"}  # the older name counts too
    assert nccl_environment(mine) == {}
    assert mine == {"NCCL_ASYNC_ERROR_HANDLING": "1", "TORCH_NCCL_PROPAGATE_ERROR": "0"}


@pytest.mark.parametrize("text", [WATCHDOG, REMOTE, "torch.distributed.DistBackendError: NCCL communicator was aborted"])
def test_nccls_failures_are_worth_a_restart_and_are_a_peer_gone_in_a_step(text):
    assert WorkerFailed(1, text.splitlines()[0], details=text).recoverable
    assert oom.peer_gone(RuntimeError(text))


def test_an_error_in_the_users_code_is_still_not_retried():
    failed = WorkerFailed(0, "ValueError: shapes do not match", details="ValueError: shapes (3,) and (4,)")
    assert not failed.recoverable
    assert not oom.peer_gone(RuntimeError("CUDA error: an illegal memory access was encountered"))


def test_a_checkpoint_collective_that_lost_a_peer_is_a_peer_gone():
    """torch.distributed.checkpoint raises a CheckpointException (a BaseException, outside the
    cause chain) holding each failed rank's own error: a lost peer inside it is still read as one."""
    from torch.distributed.checkpoint.api import CheckpointException

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:4711")
    assert oom.peer_gone(CheckpointException("save failed", {1: (lost, None)}))
    assert not oom.peer_gone(CheckpointException("save failed", {0: (OSError("No space left on device"), None)}))
