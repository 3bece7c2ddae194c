"""Strategies on a real (one-process, gloo) process group."""

from __future__ import annotations

import json

import pytest
import torch

from gearshift.strategies import data as data_strategy
from gearshift.workers.build.models import mlp


@pytest.mark.parametrize("mb", [1.0, 7.5, 25.0])
def test_bucket_cap_mb_reaches_ddp(process_group, mb):
    from gearshift.strategies import Layout, Options

    ddp = data_strategy.apply(mlp(hidden=64), None, Layout("data", 1, 1), None,
                              Options(torch.device("cpu"), bucket_cap_mb=mb)).module
    assert ddp.bucket_bytes_cap == int(mb * 1024 * 1024)
    ddp(torch.randn(4, 784)).sum().backward()  # buckets work with gradients as bucket views
    assert all(p.grad is not None for p in ddp.parameters())


def test_a_data_layout_torn_down_lets_go_of_its_ddp(process_group):
    """DDP's reducer (C++) holds its comm hook and the hook's state for the DDP's life, where
    Python's cycle collector cannot see them: a hook that led back to the DDP (a bound method of
    the layout) kept every data layout ever torn down alive, with its gradient buckets and its
    process group (a switch away from data, a regroup)."""
    import gc
    import weakref

    from gearshift.monitoring.comm import CommClock
    from gearshift.strategies import Layout, Options
    from gearshift.workers.group.comm import CommRoute

    par = data_strategy.apply(mlp(hidden=64), None, Layout("data", 1, 1), None, Options(torch.device("cpu")))
    clock = CommClock(torch.device("cpu"))
    par.attach(CommRoute(clock, None))
    par.module(torch.randn(4, 784)).sum().backward()
    assert clock.calls > 0  # the gradients' all-reduce went through the route's hook
    par.attach(CommRoute(CommClock(torch.device("cpu")), None))  # attached again: the route is swapped
    par.detach()
    ddp, layout = weakref.ref(par.module), weakref.ref(par)
    del par
    gc.collect()
    assert ddp() is None and layout() is None


def test_param_groups_keep_shards_apart_for_fused_optimizers(process_group):
    """On GPU, Adam's default multi-tensor (foreach) update cannot mix DTensor shards and plain
    tensors in one call; forcing foreach here reproduces that on CPU."""
    from gearshift import strategies
    from gearshift.strategies.layout import Layout
    from gearshift.workers.build.models import gpt

    torch.manual_seed(0)
    model = gpt(n_layer=1, n_embd=32, n_head=4, block_size=8)
    par = strategies.parallelize(model, Layout("tensor", 1, 1), model.tp_plan(1),
                                 strategies.Options(torch.device("cpu")))
    groups = par.param_groups()
    assert len(groups) == 2 and sum(len(g["params"]) for g in groups) == len(list(par.model.parameters()))
    opt = torch.optim.Adam(groups, lr=1e-3, foreach=True)
    par.module(torch.randint(0, 128, (2, 8))).sum().backward()
    opt.step()  # a single mixed group raises "got mixed torch.Tensor and DTensor" here
    mixed = torch.optim.Adam(list(par.model.parameters()), lr=1e-3, foreach=True)
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        mixed.step()


@pytest.mark.crossing("dropout", "data")
@pytest.mark.crossing("dropout", "pipeline")
@pytest.mark.crossing("dropout", "pipeline_tp")
def test_each_replica_and_pipeline_position_draws_its_own_stream_and_a_tp_group_one():
    """Dropout under a pipeline: the blocks after a cut must not draw the masks the first
    position's blocks drew; a tensor-parallel group computes one activation, so draws one mask."""
    from gearshift.strategies.layout import Layout

    pipe = Layout("pipeline", dp=2, tp=2, pp=2)  # ranks: position-major, then replica, then tp
    streams = [pipe.seed_stream(r) for r in range(pipe.world)]
    assert streams[0] == streams[1] and streams[2] == streams[3]  # a tp group: one stream
    by_place = {(pipe.stage_of(r), pipe.dp_rank(r)): streams[r] for r in range(pipe.world)}
    assert len(set(by_place.values())) == 4  # 2 positions x 2 replicas: four streams
    data = Layout("data", dp=4, tp=1)
    assert [data.seed_stream(r) for r in range(4)] == [0, 1, 2, 3]  # without a pipeline: the replica's, as before



def _two_default_groups(rank, world, out):
    """In the pool's group, then in a second default group of the same size (as a regroup makes):
    a row-wise layer's partial sums all-reduced over a tp dimension of 2 of the 4 ranks, each time.
    The second group meets in a file store, not on a port: a port picked free in the test and
    bound only later, by rank 0, was once taken meanwhile by another process's store, and rank 3
    connected to that one (`DistNetworkError: Broken pipe` in CI)."""
    import json

    import torch.distributed as dist
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

    from gearshift.strategies import mesh

    sums = []
    for round_ in range(2):
        if round_ == 1:
            mesh.forget()  # as leaving a group does (workers/group/rendezvous.py)
            dist.destroy_process_group()
            dist.init_process_group("gloo", init_method=f"file://{out}/second-group", rank=rank, world_size=world)
        else:
            dist.new_group(list(range(world)))  # the first mesh's groups get names the second's will not have
        m = mesh.device_mesh("cpu", (2, world // 2), ("dp", "tp"))["tp"]  # groups of their own: 2 of 4 ranks
        torch.manual_seed(0)
        layer = parallelize_module(torch.nn.Linear(4, 4, bias=False), m, RowwiseParallel(input_layouts=Replicate()))
        sums.append(layer(torch.ones(2, 4)).sum().item())
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(sums, f)


def test_a_mesh_on_a_new_default_group_of_the_same_size_is_not_handed_the_old_groups(tmp_path):
    """A worker that leaves its group and joins a new one of the same size (a regroup) makes its
    meshes again, and DTensor must not answer an op from what it cached on the old mesh: it caches
    by the mesh's shape and names, and a cached result holds the old mesh, whose groups are gone
    ("Could not resolve the process group registered under the name ...")."""
    from test_fsdp import spawn_gloo

    spawn_gloo(_two_default_groups, 4, (str(tmp_path),), timeout_s=120)
    torch.manual_seed(0)
    want = torch.nn.Linear(4, 4, bias=False)(torch.ones(2, 4)).sum().item()
    for rank in range(4):
        sums = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sums == pytest.approx([want, want], abs=1e-6), (rank, sums)
