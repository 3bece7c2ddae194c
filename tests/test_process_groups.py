"""Process groups on multi-process gloo: switching between layouts reuses each shape's mesh, so
the live groups stay as many however often a run switches; every group carries the job's
collective timeout; a new default group (the rejoin after an OOM) never gets a mesh of the old
one. One spawn of 4 TrainWorkers (no Ray) runs every check and the tests read its results."""

from __future__ import annotations

import json
import math
import os
import pathlib
import time

import pytest
import torch
import torch.multiprocessing as mp

from conftest import free_port

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD, SWITCHES, TIMEOUT_S = 4, 20, 37
CYCLE = [{"strategy": "hybrid", "dp": 2, "tp": 2}, {"strategy": "hsdp", "dp": 4, "tp": 1, "shard": 2},
         {"strategy": "data", "dp": 4, "tp": 1}]


def _spawn(fn, args: tuple, timeout_s: float) -> None:
    """fn(rank, *args) in WORLD spawned processes that join no group themselves (the worker does)."""
    ctx = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{WORLD} gloo processes still running after {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


def _groups() -> list:
    import torch.distributed as dist

    return list(dist.distributed_c10d._world.pg_map)


def _timeouts() -> list[float]:
    from gearshift.strategies.mesh import group_timeout

    return sorted({group_timeout(g).total_seconds() for g in _groups()})


def _run(rank: int, ports: tuple[int, int], out_dir: str) -> None:
    torch.set_num_threads(1)  # 4 processes on 2 cores
    from gearshift.orchestrator.job import load_job
    from gearshift.workers.worker import TrainWorker, WorkerConfig

    job = load_job(ROOT / "examples/gpt.yaml", [
        "train.steps=100", "train.global_batch_size=8", "checkpoint.every=0", f"cluster.num_workers={WORLD}",
        "model.kwargs={vocab_size: 128, block_size: 8, n_layer: 1, n_head: 2, n_embd: 16}", "telemetry.enabled=false"])
    worker = TrainWorker(WorkerConfig.from_job(job.to_dict(), [job.base_dir]))
    worker.setup(rank, WORLD, "127.0.0.1", ports[0], TIMEOUT_S)
    worker.build()

    def step() -> float:
        return [loss for r in worker.train(worker.step + 1) for loss in r["losses"]][-1]

    res = {"counts": [len(_groups())], "losses": [step()], "timeouts": {}}
    for i in range(SWITCHES):
        worker.reshard(CYCLE[i % len(CYCLE)])
        res["counts"].append(len(_groups()))
        res["losses"].append(step())
        res["timeouts"].setdefault(CYCLE[i % len(CYCLE)]["strategy"], _timeouts())
    # a new default group in the same process, as after an OOM: the layout in force (hybrid) is
    # rebuilt on it, and every mesh it uses must be one of the new group's
    worker.reshard(CYCLE[0])
    worker.rejoin("127.0.0.1", ports[1], TIMEOUT_S)
    live = _groups()
    res["rejoined_mesh_live"] = all(g in live for g in worker.parallel.mesh.get_all_groups())
    res["after_rejoin"] = []
    for layout in CYCLE + CYCLE:
        worker.reshard(layout)
        res["after_rejoin"].append(len(_groups()))
        res["losses"].append(step())
    res["timeouts_after_rejoin"] = _timeouts()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    worker.shutdown()
    os._exit(0)  # done; skip the interpreter's teardown (see tests/test_fsdp.py's _entry)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("groups")
    _spawn(_run, ((free_port(), free_port()), str(out)), timeout_s=200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow
def test_twenty_switches_keep_the_live_process_groups_constant(runs):
    for res in runs:
        counts = res["counts"]
        # the first round through the cycle makes each shape's mesh; after it nothing is added
        settled = counts[len(CYCLE)]
        assert counts[len(CYCLE):] == [settled] * (SWITCHES + 1 - len(CYCLE)), counts
        # the default group, the stop agreement's, hybrid's dp and tp, hsdp's replicate and shard
        assert settled == 6, counts
        assert len(res["losses"]) == 1 + SWITCHES + 2 * len(CYCLE)  # a step trained after every switch
        assert all(math.isfinite(loss) for loss in res["losses"])


@pytest.mark.slow
def test_every_group_and_sub_group_carries_the_jobs_collective_timeout(runs):
    for res in runs:
        assert set(res["timeouts"]) == {"hybrid", "hsdp", "data"}
        assert all(t == [float(TIMEOUT_S)] for t in res["timeouts"].values()), res["timeouts"]
        assert res["timeouts_after_rejoin"] == [float(TIMEOUT_S)]


@pytest.mark.slow
def test_a_new_default_group_gets_meshes_of_its_own(runs):
    for res in runs:
        assert res["rejoined_mesh_live"]
        # the old group's meshes are gone with it; the new one's are made once, as before
        assert res["after_rejoin"][len(CYCLE):] == [res["counts"][-1]] * len(CYCLE), res["after_rejoin"]
        assert res["after_rejoin"][-1] == 6


def test_a_mesh_is_reused_until_its_default_group_is_gone(process_group):
    """Without the worker's forget() (TrainWorker.shutdown destroys the group directly): a mesh
    made on a destroyed group is never handed out again, though torch reuses its groups' names."""
    import torch.distributed as dist

    from gearshift.strategies import mesh

    first = mesh.device_mesh("cpu", (1, 1), ("dp", "tp"))
    assert mesh.device_mesh("cpu", (1, 1), ("dp", "tp")) is first
    assert mesh.device_mesh("cpu", (1,), ("dp",)) is not first and mesh.cached() == 2
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    again = mesh.device_mesh("cpu", (1, 1), ("dp", "tp"))
    assert again is not first and mesh.cached() == 1
    assert all(g in _groups() for g in again.get_all_groups())
    mesh.forget()
    assert mesh.cached() == 0


def test_forgetting_the_meshes_lets_go_of_their_groups_whoever_still_holds_a_mesh(process_group):
    """A mesh holds its groups, and DTensor's caches hold meshes (some where no one can clear
    them: another thread's cache, the native one). Each forgotten mesh lets go of its groups, so a
    destroyed group's gloo threads and connections end with it, not with the process."""
    import gc
    import weakref

    import torch.distributed as dist

    from gearshift.strategies import mesh

    held = mesh.device_mesh("cpu", (1, 1), ("dp", "tp"))  # as a cache that outlives the group would
    groups = [weakref.ref(g) for g in held.get_all_groups()] + [weakref.ref(g) for g in _groups()]
    mesh.forget()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    gc.collect()
    assert held is not None and [g for g in groups if g() is not None] == []
