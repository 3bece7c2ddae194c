"""Where a worker is and how it joins the others: node facts for placement, a free port for the
rendezvous, and the process group."""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist


def node_info() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
            "hostname": socket.gethostname(), "gpu_ids": list(ctx.get_accelerator_ids().get("GPU", []))}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def join(rank: int, world: int, master_addr: str, master_port: int, timeout_s: float,
         gpu: bool) -> tuple[torch.device, str]:
    """Join the process group; (this worker's device, the backend)."""
    # The job, not the host, decides: a CPU job on a GPU node must not touch GPUs that Ray
    # never reserved for it (Ray leaves CUDA_VISIBLE_DEVICES alone when num_gpus is 0).
    if gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.gpus_per_worker is 1 but this worker sees no CUDA device "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU, so it is always cuda:0 here
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return device, backend


def device_memory(device: torch.device) -> dict:
    """What this worker's device can hold: a GPU's own memory, or on CPU the host's memory,
    which every worker on the node shares (the driver divides it among them)."""
    if device.type == "cuda":
        return {"bytes": int(torch.cuda.get_device_properties(device).total_memory), "shared": False}
    import psutil

    return {"bytes": int(psutil.virtual_memory().total), "shared": True}
