"""A step with a non-finite gradient skipped on the device: the layout's found-inf flag is the same
on every rank (agreed where ranks hold different pieces), a fused optimizer takes it and leaves
parameters and optimizer state as they were, and nothing reads it on the host in the step. On
CPU the logic is checked with the flag itself; on CUDA the syncs are counted (marked gpu)."""

from __future__ import annotations

import json

import pytest
import torch

from test_fsdp import BATCH, batches, loss_of, spawn_gloo, tiny_gpt


def _layout(name: str, world: int):
    from gearshift import strategies
    from gearshift.strategies.layout import Layout
    from gearshift.workers.build import components

    model = tiny_gpt()
    layout = Layout.for_workers(name, world, 2 if name == "hybrid" else None)
    plan = components.tp_plan(model, {}, None, layout.tp) if strategies.lookup(name).needs_plan else None
    return strategies.parallelize(model, layout, plan, strategies.Options(torch.device("cpu"))), layout


def _ranks(rank: int, world: int, out: str) -> None:
    from gearshift.strategies.state import full
    from gearshift.workers.build import components

    results = {}
    for name in ("tensor", "hybrid", "fsdp", "data"):
        par, layout = _layout(name, world)
        opt = components.build_optimizer(par.param_groups(), {"name": "adamw", "lr": 1e-2, "weight_decay": 0.1,
                                                              "betas": (0.9, 0.999), "eps": 1e-8, "fused": True})
        (x, y), = batches(1)
        dp_rank, share = layout.dp_rank(rank), BATCH // layout.dp
        x, y = x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]
        flags, moved = [], []
        for poison in (False, True, False):
            opt.zero_grad(set_to_none=True)
            loss_of(par.module, x, y).backward()
            par.after_backward()
            if poison and rank == world - 1:  # one rank's own piece goes bad after the gradients were synced
                g = next(p.grad for p in par.model.parameters() if p.grad is not None)
                (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("nan")
            found = par.found_inf()
            before = {n: full(p.detach()).clone() for n, p in par.model.named_parameters()}
            opt.grad_scale, opt.found_inf = None, found
            opt.step()
            del opt.grad_scale, opt.found_inf
            flags.append(float(found))
            moved.append(any(not torch.equal(before[n], full(p.detach())) for n, p in par.model.named_parameters()))
        steps = sorted({float(s["step"]) for s in opt.state.values()})
        results[name] = {"flags": flags, "moved": moved, "steps": steps,
                         "clip_flag": [float(par.found_inf(torch.tensor(v))) for v in (1.0, float("inf"), float("nan"))]}
        par.detach()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("skip") / "results")
    spawn_gloo(_ranks, 2, (out,), timeout_s=240)
    return [json.load(open(f"{out}.{r}")) for r in range(2)]


@pytest.mark.parametrize("layout", ["tensor", "hybrid", "fsdp"])
def test_a_bad_piece_on_one_rank_skips_the_step_on_every_rank(results, layout):
    for rank in results:
        r = rank[layout]
        assert r["flags"] == [0.0, 1.0, 0.0], r
        assert r["moved"] == [True, False, True], r  # the flagged update left every parameter as it was
        assert r["steps"] == [2.0], r  # and the optimizer's step count: two updates, not three


def test_a_replicated_layout_needs_no_agreement(results):
    """Under data parallelism the synced gradients are the same everywhere: the rank that was not
    poisoned finds nothing (a real NaN would be in every rank's all-reduced gradient)."""
    assert results[1]["data"]["flags"] == [0.0, 1.0, 0.0]
    assert results[0]["data"]["flags"] == [0.0, 0.0, 0.0]


def test_the_clipping_norm_decides_where_there_is_one(results):
    assert all(rank[name]["clip_flag"] == [0.0, 1.0, 1.0] for rank in results for name in rank)


def test_fused_is_chosen_on_gpu_only_by_default():
    from gearshift.workers.build import components

    spec = {"name": "adamw", "lr": 1e-3, "weight_decay": 0.0, "betas": (0.9, 0.999), "eps": 1e-8}
    p = [torch.nn.Parameter(torch.zeros(2))]
    assert not components.build_optimizer(p, spec, torch.device("cpu")).defaults.get("fused")
    assert components.build_optimizer(p, dict(spec, fused=True), torch.device("cpu")).defaults["fused"]
    assert not components.build_optimizer(p, dict(spec, fused=False), torch.device("cuda")).defaults.get("fused")


def test_fused_field_is_checked():
    from gearshift.orchestrator.job import JobError, job_from_dict

    assert job_from_dict({"model": "mlp", "optimizer": {"fused": True}}).optimizer.fused is True
    assert job_from_dict({"model": "mlp"}).optimizer.fused == "auto"
    with pytest.raises(JobError) as err:
        job_from_dict({"model": "mlp", "optimizer": {"fused": "yes"}})
    assert "optimizer.fused" in str(err.value) and "true, false or 'auto'" in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_no_host_sync_in_the_step_on_cuda(tmp_path):
    """A single-GPU TrainWorker's steps, with a non-finite gradient among them, under
    torch.cuda.set_sync_debug_mode('error'): any host sync inside the step raises."""
    import datetime

    import torch.distributed as dist

    from conftest import free_port
    from gearshift.orchestrator.job import job_from_dict
    from gearshift.workers.worker import TrainWorker, WorkerConfig

    job = job_from_dict({"model": {"name": "gpt", "kwargs": {"n_layer": 2, "n_embd": 64, "block_size": 32}},
                         "data": "chars", "train": {"steps": 6, "global_batch_size": 8},
                         "cluster": {"num_workers": 1, "gpus_per_worker": 1},
                         "telemetry": {"enabled": False}}).to_dict()
    worker = TrainWorker(WorkerConfig.from_job(job, ["."]))
    worker.setup(0, 1, "127.0.0.1", free_port(), 60.0)
    try:
        worker.build()
        worker.runner.one_step(0)  # warm-up: lazy init of kernels and the allocator may sync
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for step in range(1, 4):
                *_, found = worker.runner.one_step(step)
                assert found is not None  # checked on the device, read later
        finally:
            torch.cuda.set_sync_debug_mode(0)
    finally:
        worker.shutdown()
        if dist.is_initialized():
            dist.destroy_process_group()
