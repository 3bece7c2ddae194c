"""Member: the worker's group part. Where this worker runs and which device it takes, the process
group it forms with its peers (and the stop agreement's group beside it), whether every rank says
yes at a switch's commit point, and the controller's request to end a chunk early."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from gearshift.workers.group import priority, regroup, rendezvous
from gearshift.workers.group.heartbeat import ACTIVITY
from gearshift.workers.step.stopping import flag_group


class Member:
    def __init__(self, worker):
        self.w = worker
        self.priority = priority.as_parent()  # Ray's workers run 15 nice levels below it (workers/group/priority.py)
        self.gpu_ids, self.node_ip = [], "127.0.0.1"
        self.device_index: int | None = None  # this worker's GPU among the node's shared ones (use_devices)
        self.flags = None      # the stop agreement's process group (workers/step/stopping.py)
        self.stop_chunk = -1   # the chunk the controller asked to stop early (request_stop)

    def node_info(self, warm: bool = False) -> dict:
        """Where this worker runs (see TrainWorker.node_info)."""
        regroup.warm(self.w) if warm else None
        info = rendezvous.node_info()
        info["nice"] = self.priority
        self.gpu_ids = [str(g) for g in info["gpu_ids"]] if self.w.config.gpu else []
        self.node_ip = info["node_ip"]
        return info

    def use_devices(self, visible: str, index: int) -> bool:
        """Every GPU the job holds on this node visible, this worker on the `index`-th (see
        TrainWorker.use_devices); False where CUDA has started and nothing changes."""
        if torch.cuda.is_initialized():
            return False
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        self.device_index = index
        return True

    def join(self, master_addr: str, master_port: int, timeout_s: float) -> str:
        """Form the process group as this worker's rank of its world, and the flags' group beside
        it; the backend."""
        w, joined = self.w, {}

        def make_groups():
            w.io.writes.group = None  # gone with the groups it was made beside; made again at the next save
            index = {"device_index": self.device_index} if self.device_index is not None else {}
            joined["device"], joined["backend"] = rendezvous.join(w.rank, w.world, master_addr, master_port,
                                                                  timeout_s, w.config.gpu, **index)
            self.flags = flag_group(w.world)

        rendezvous.opened_by(make_groups)
        w.device = joined["device"]
        return joined["backend"]

    def agree(self, ok: bool) -> bool:
        """Whether every rank says `ok` (a switch's commit point); all ranks call it together."""
        if self.flags is None:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        with ACTIVITY.collective():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.flags)
        return bool(flag.item())
