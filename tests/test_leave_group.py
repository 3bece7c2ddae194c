"""A worker that leaves its process group (a step that failed: out of memory here or on a peer;
an elastic regroup) holds the groups it left until their collectives have timed out. A gloo
group's destructor waits for its threads, and one still in a collective whose peer left waits
out the whole collective timeout: freed at the step loop's end, it held the controller there
(tests/test_oom.py's move to fsdp hung in 5 of 20 runs before)."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from gearshift.workers.group import rendezvous


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
