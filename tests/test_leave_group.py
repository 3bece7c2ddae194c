"""A worker that leaves its process group (a step that failed: out of memory here or on a peer;
an elastic regroup) holds the groups it left until their collectives have timed out. A gloo
group's destructor waits for its threads, and one still in a collective whose peer left waits
out the whole collective timeout: freed at the step loop's end, it held the controller there
(tests/test_oom.py's move to fsdp hung in 5 of 20 runs before).

Leaving half-closes the groups' own connections, so that a peer blocked in a collective fails at
once, and no other: a connection another library (Ray's gRPC, its object transfers) opened while
the groups were made, or one that took a descriptor number theirs had, keeps working."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port
from gearshift.workers.group import rendezvous

WORLD, TIMEOUT_S = 2, 60  # a peer that waited out the timeout would say so, well inside the test's 150 s


def test_the_groups_left_are_held_until_their_collectives_have_timed_out(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(rendezvous.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(rendezvous, "_LEFT", [])
    monkeypatch.setattr(rendezvous, "_TIMEOUT_S", [30.0])
    port = rendezvous.free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        sub = dist.new_group([0])
        groups = {dist.distributed_c10d._get_default_group(), sub}
    finally:
        rendezvous.leave()
    assert not dist.is_initialized()
    held = [g for _, gs in rendezvous._LEFT for g in gs]
    assert set(held) == groups and rendezvous.groups_held() == 2
    clock[0] += 30.0  # the timeout itself: a collective may still be waiting
    rendezvous._hold([])
    assert rendezvous.groups_held() == 2
    clock[0] += 5.5   # past the timeout and the margin: let go
    rendezvous._hold([])
    assert rendezvous.groups_held() == 0


def _connection(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    """Both ends of a new connection to `server`, another library's listener in this process."""
    client = socket.create_connection(server.getsockname(), timeout=TIMEOUT_S)
    served, _ = server.accept()
    served.settimeout(TIMEOUT_S)
    return client, served


def _works(pair: tuple[socket.socket, socket.socket]) -> bool:
    """Whether bytes still go both ways on the connection `pair`."""
    client, served = pair
    try:
        client.sendall(b"ping")
        heard = served.recv(4, socket.MSG_WAITALL)
        served.sendall(b"pong")
        return heard == b"ping" and client.recv(4, socket.MSG_WAITALL) == b"pong"
    except OSError:
        return False


def _groups_and_others(rank: int, port: int) -> dict:
    """The default group and a sub-group made through rendezvous.opened_by, with another
    library's connection opened between them ("opened"), and one ("later") opened after them
    under the descriptor numbers that a connection made in the same window had."""
    server = socket.create_server(("127.0.0.1", 0))  # up before the groups, as Ray's servers are
    server.settimeout(TIMEOUT_S)
    made = {}

    def make_groups():
        rendezvous.join(rank, WORLD, "127.0.0.1", port, TIMEOUT_S, gpu=False)
        made["opened"] = _connection(server)
        made["gone"] = _connection(server)
        made["sub"] = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=TIMEOUT_S))

    rendezvous.opened_by(make_groups)
    later = _connection(server)
    for gone, now in zip(made.pop("gone"), later):
        os.dup2(now.fileno(), gone.detach())  # the number a window's connection had names a later one
    made["later"] = later
    return made


def _leave_while_a_peer_waits(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 leaves; rank 1, blocked in collectives on the sub-group and the default group,
    notes how each failed, then leaves too. Each rank notes whether the others' connections work."""
    torch.set_num_threads(1)
    made = _groups_and_others(rank, port)
    res = {"failed": []}
    if rank == 1:
        for group in (made["sub"], None):
            try:
                dist.all_reduce(torch.ones(4), group=group)
            except RuntimeError as e:
                res["failed"].append(str(e))
    rendezvous.leave()
    res["works"] = {name: _works(made[name]) for name in ("opened", "later")}
    pathlib.Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))
    deadline = time.monotonic() + 2 * TIMEOUT_S
    while rank == 0 and not pathlib.Path(out_dir, "rank1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # alive until the peer is done: an exit would close every connection
    os._exit(0)  # skip the interpreter's teardown (see tests/test_fsdp.py's _entry)


@pytest.mark.slow  # two spawned processes: about 10 s
def test_leaving_cuts_the_groups_connections_and_no_other_librarys(tmp_path):
    ctx = mp.start_processes(_leave_while_a_peer_waits, args=(free_port(), str(tmp_path)), nprocs=WORLD,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + 150
    try:
        while not ctx.join(timeout=5) and time.monotonic() < deadline:
            pass
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["works"] == {"opened": True, "later": True} for r in res), res
    # the peer's collectives on both groups failed on the closed connection, not at the timeout
    assert len(res[1]["failed"]) == 2 and all("Connection closed by peer" in m for m in res[1]["failed"]), res
