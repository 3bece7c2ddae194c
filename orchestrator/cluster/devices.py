"""Which GPUs each worker sees, and which of them is its own.

Ray sets CUDA_VISIBLE_DEVICES in each GPU actor to the one GPU it assigned, so the workers of a
node cannot see each other's devices and NCCL falls back from NVLink/P2P to copies through host
memory. As Ray Train does (`_share_cuda_visible_devices`), every worker of a node is given all
the GPUs assigned to the job's workers on that node, in one order, and picks its own by its
position in that list. Pure: the worker group gathers the ids (node_info) and hands each worker
its share (TrainWorker.use_devices) before any CUDA call or process group.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceShare:
    visible: str  # CUDA_VISIBLE_DEVICES for this worker: every GPU of the job on its node
    index: int  # this worker's own GPU in that list: torch.device("cuda", index)


def _order(ids: set[str]) -> list[str]:
    # physical order where the ids are indices (so "10" comes after "9"); UUIDs as text
    return sorted(ids, key=lambda g: (0, int(g), "") if g.isdigit() else (1, 0, g))


def share_devices(workers: list[dict]) -> list[DeviceShare | None]:
    """For each worker ({"node_id", "gpu_ids"}, as node_info gives them) its share, in the same
    order; None for a worker with no GPU (a CPU job: nothing changes). A worker holds one GPU
    (cluster.gpus_per_worker is 0 or 1)."""
    per_node: dict[str, set[str]] = {}
    for w in workers:
        per_node.setdefault(w["node_id"], set()).update(str(g) for g in w.get("gpu_ids") or ())
    out: list[DeviceShare | None] = []
    for w in workers:
        own = [str(g) for g in w.get("gpu_ids") or ()]
        if not own:
            out.append(None)
            continue
        if len(own) != 1:
            raise ValueError(f"a worker holds one GPU, this one holds {own} (node {w['node_id']})")
        ids = _order(per_node[w["node_id"]])
        out.append(DeviceShare(",".join(ids), ids.index(own[0])))
    return out
