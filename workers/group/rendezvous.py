"""Where a worker is and how it joins the others: node facts for placement, a free port for the
rendezvous, the process group, and leaving it (its own connections cut, the groups held)."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import struct
import time

import torch
import torch.distributed as dist

from gearshift.strategies import mesh


def node_info() -> dict:
    """Where this process runs: its Ray node, or this machine where it runs outside Ray (a worker
    group of plain processes, as the tests' tests/process_workers.py makes)."""
    import ray

    if not ray.is_initialized():
        host = socket.gethostname()
        return {"node_ip": "127.0.0.1", "node_id": f"local:{host}", "pid": os.getpid(), "hostname": host,
                "gpu_ids": []}
    ctx = ray.get_runtime_context()
    return {"node_ip": ray.util.get_node_ip_address(), "node_id": ctx.get_node_id(), "pid": os.getpid(),
            "hostname": socket.gethostname(), "gpu_ids": list(ctx.get_accelerator_ids().get("GPU", []))}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# What leave() cuts: the TCP connections of this process with an end at one of its groups'
# listeners. Each of a gloo group's pairs is a connection from one rank to the other's listener
# (every rank opens one per group), and each store client connects to rank 0's store server: a
# connection ending at neither is another library's (Ray's gRPC and object transfers), whenever it
# was opened. Only the listeners are found by time, as the listening sockets a process opened
# while its groups were made: a worker opens none of its own then (Ray's servers are up before).
_OWN_PORTS: set[int] = set()              # the ports of this process's group listeners
_LISTENERS: set[tuple[str, int]] = set()  # every rank's, as the (address, port) its peers connect to
_EXCHANGES = [0]  # exchanges of listeners on the default group's store since it was made (join resets it)
_LISTEN = "0A"  # the state of a listening socket in /proc/net/tcp
_TIMEOUT_S = [300.0]  # the collective timeout of the groups joined last (join sets it)
# Groups left, held until their collectives have timed out: (until, groups), monotonic seconds.
# A gloo group's destructor joins its worker threads, and a thread still in a collective whose
# peer left waits out the collective timeout: with two ranks, a bucket's all-reduce queued behind
# the one that failed blocked in its send (gloo's UnboundBuffer::waitSend) after both sides had
# closed the pair. Freed where the last reference went (the step loop's end, in 5 of 20 runs of
# an OOM test here), that wait held the step loop's end for the whole timeout, and the controller
# with it.
_LEFT: list[tuple[float, list]] = []


def _socket_fds() -> dict[int, int]:
    """This process's sockets, inode -> file descriptor (Linux; none known elsewhere)."""
    out = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (listdir's own descriptor among them)
            continue
        if link.startswith("socket:["):
            out[int(link[8:-1])] = int(fd)
    return out


def _endpoint(field: str) -> tuple[str, int]:
    """/proc/net/tcp's "ADDRESS:PORT" (the address as 32-bit words in host order, the port in hex)
    as (address, port); an IPv4 address mapped into IPv6 as the IPv4 one its peer sees."""
    words, port = field.split(":")
    raw = b"".join(struct.pack("=I", int(words[i:i + 8], 16)) for i in range(0, len(words), 8))
    address = ipaddress.ip_address(raw)
    if address.version == 6 and address.ipv4_mapped:
        address = address.ipv4_mapped
    return str(address), int(port, 16)


def _tcp_table() -> dict[int, tuple[str, tuple[str, int], tuple[str, int]]]:
    """The TCP sockets of this network namespace, inode -> (state, local end, remote end)."""
    out = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            out[int(fields[9])] = (fields[3], _endpoint(fields[1]), _endpoint(fields[2]))
    return out


def _listening(inodes: set[int]) -> tuple[set[int], set[tuple[str, int]]]:
    """Of the sockets `inodes`, the listeners' ports and where peers reach them: the bound
    address (gloo binds the host's), or for one bound to every address (the store's server)
    the local ends of the connections it accepted."""
    table = _tcp_table()
    bound = {table[i][1] for i in inodes if i in table and table[i][0] == _LISTEN}
    everywhere = {port for address, port in bound if ipaddress.ip_address(address).is_unspecified}
    ends = {(address, port) for address, port in bound if port not in everywhere}
    ends |= {local for state, local, _ in table.values() if state != _LISTEN and local[1] in everywhere}
    return {port for _, port in bound}, ends


def opened_by(make_groups) -> None:
    """Run `make_groups()` (process groups made; every rank calls it at the same point) and
    remember the groups' listeners, this process's and, through the store, every rank's."""
    before = set(_socket_fds())
    try:
        make_groups()
    finally:
        ports, ends = _listening(set(_socket_fds()) - before)
        _OWN_PORTS.update(ports)
        _LISTENERS.update(ends)
    _LISTENERS.update(_exchange(ends))


def _exchange(ends: set[tuple[str, int]]) -> set[tuple[str, int]]:
    """Every rank's listeners, each rank giving its `ends` (a rank connects to its peers'
    listeners, so leaving it must know them). Every rank makes the same groups in one order, so
    the n-th exchange since the default group was made is the same on all."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return set()
    store, rank, n = dist.distributed_c10d._get_default_store(), dist.get_rank(), _EXCHANGES[0]
    _EXCHANGES[0] += 1
    store.set(f"gearshift/listeners/{n}/{rank}", json.dumps(sorted(ends)))
    keys = [f"gearshift/listeners/{n}/{r}" for r in range(dist.get_world_size())]
    store.wait(keys, datetime.timedelta(seconds=_TIMEOUT_S[0]))
    return {(address, port) for key in keys for address, port in json.loads(store.get(key))}


mesh.MAKE_GROUPS[0] = opened_by  # a mesh's sub-groups open connections of their own


def _group_connections() -> dict[int, int]:
    """This process's TCP connections with an end at one of its groups' listeners, inode -> fd."""
    fds = _socket_fds()
    table = _tcp_table()
    out = {}
    for inode, fd in fds.items():
        if inode in table:
            state, local, remote = table[inode]
            if state != _LISTEN and (local[1] in _OWN_PORTS or remote in _LISTENERS):
                out[inode] = fd
    return out


def _half_close(fd: int, inode: int) -> None:
    """Shut the writing side of socket `inode` at `fd`, if `fd` still holds it: a number closed
    since may name another socket by now."""
    try:
        with socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM) as s:  # a duplicate: ours to close
            if os.fstat(s.fileno()).st_ino == inode:
                s.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def leave() -> None:
    """Leave every process group now, so that a peer blocked in one of its collectives fails at
    once instead of at the collective timeout. NCCL has an abort for that. Gloo has none (torch's
    ProcessGroup.abort and shutdown do nothing for it), and a group stays alive as long as a
    layout holds it (DDP's reducer does), so its connections are half-closed (this side writes no
    more): the peer reads the end of the stream and its collective raises; this side's next
    collective on it would fail, and there is none. Only the groups' own connections: those with
    an end at a group listener (_OWN_PORTS, _LISTENERS)."""
    mesh.forget()  # their meshes die with them, and a new group must not be handed one
    if not dist.is_initialized():
        return
    _hold(list(dist.distributed_c10d._world.pg_map))
    if dist.get_backend() == "nccl":
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception:  # noqa: BLE001 - leaving is what matters
            pass
    for inode, fd in _group_connections().items():
        _half_close(fd, inode)
    _OWN_PORTS.clear()
    _LISTENERS.clear()
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a group already broken is what we want anyway
        pass


def _hold(groups: list) -> None:
    """Keep `groups` (left now) until any collective still running on them has timed out, so that
    no thread of this worker frees one while one of its threads waits in it; let go of the groups
    held for longer than that (freeing one then is quick: its threads are idle)."""
    now = time.monotonic()
    _LEFT[:] = [(until, held) for until, held in _LEFT if until > now]
    if groups:
        _LEFT.append((now + _TIMEOUT_S[0] + 5.0, groups))


def groups_held() -> int:
    """How many groups left are held until their collectives have timed out (the tests read it)."""
    return sum(len(held) for _, held in _LEFT)


# What torch's NCCL process group does when a collective fails or times out: abort the
# communicator so that the collective raises in this process (2, CleanUpOnly), where torch's
# default (3, SkipCleanUp) and Ray Train's (1, TearDown) end the process; and tell the other ranks
# through the store, so that each raises too rather than waiting out its own timeout. A rank
# that raises is a worker that reports: the controller decides (restart, shrink, drop a step).
# A value the user set in cluster.env or the node's environment is left as it is.
NCCL_ENVIRONMENT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_PROPAGATE_ERROR": "1"}


def nccl_environment(environ=os.environ) -> dict[str, str]:
    """Set NCCL_ENVIRONMENT where `environ` has no value of its own (torch also reads the older
    NCCL_ASYNC_ERROR_HANDLING); what was set."""
    aliases = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "NCCL_ASYNC_ERROR_HANDLING"}
    chosen = {k: v for k, v in NCCL_ENVIRONMENT.items() if k not in environ and aliases.get(k) not in environ}
    environ.update(chosen)
    return chosen


def join(rank: int, world: int, master_addr: str, master_port: int, timeout_s: float,
         gpu: bool, device_index: int = 0) -> tuple[torch.device, str]:
    """Join the process group; (this worker's device, the backend). Every group made after it
    (the layouts' meshes, the stop agreement's) takes its timeout, `timeout_s`."""
    # The job, not the host, decides: a CPU job on a GPU node must not touch GPUs that Ray
    # never reserved for it (Ray leaves CUDA_VISIBLE_DEVICES alone when num_gpus is 0).
    if gpu:
        if not torch.cuda.is_available():
            raise RuntimeError("cluster.gpus_per_worker is 1 but this worker sees no CUDA device "
                               f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        # Ray sets CUDA_VISIBLE_DEVICES to this worker's GPU (cuda:0 here), or the worker group
        # widened it to every GPU the job holds on this node and named this worker's among them
        # (orchestrator/cluster/devices.py), so NCCL may use NVLink and P2P between them
        if device_index >= torch.cuda.device_count():
            raise RuntimeError(f"this worker was given GPU {device_index} of the node's shared ones, but sees "
                               f"{torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
        backend = "nccl"
        nccl_environment()  # read by the process group as it is made
    else:
        device, backend = torch.device("cpu"), "gloo"
    mesh.forget()  # a mesh of a group this process had before is not one of this group's
    _TIMEOUT_S[0] = float(timeout_s)
    _EXCHANGES[0] = 0  # a new default group: a new store
    _hold([])
    # device_id binds the group to this GPU: NCCL connects now, where a broken peer shows at
    # once, rather than at the first collective, and the meshes' sub-groups are split from it
    # (ncclCommSplit) instead of each going through a rendezvous of its own
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    return device, backend


def device_memory(device: torch.device) -> dict:
    """What this worker's device can hold for it: what is free on it plus what this process holds
    already (another process's share is not ours), never more than the device's total. On CPU the
    host's memory, which every worker on the node shares (the driver divides it among them)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        own = torch.cuda.memory_reserved(device)
        return {"bytes": int(min(total, free + own)), "total_bytes": int(total), "shared": False}
    import psutil

    vm = psutil.virtual_memory()
    own = psutil.Process().memory_info().rss
    return {"bytes": int(min(vm.total, vm.available + own)), "total_bytes": int(vm.total), "shared": True}
