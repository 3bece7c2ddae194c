"""Hybrid's data-parallel average overlapped with backward (strategies/grads.py
OverlappedAverager), on 4 gloo processes as hybrid(2 x 2): equal to plain single-process PyTorch
on the same global batches with accumulation and clipping, equal to the serial average it
replaced, launched while backward still runs, and timed as wait only where it blocks."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch

from test_fsdp import BATCH, batches, loss_of, max_diff, spawn_gloo, tiny_gpt, train_parallel, train_reference

TOL = 1e-5
STEPS = 3


class RecordingRoute:
    """A comm route that records what the averager tells it; no delay."""

    def __init__(self, delay_s: float = 0.0):
        self.launches, self.waits, self.hidden_s, self.delay = 0, 0, [], delay_s

    def ddp_hook(self, default):
        return None

    def blocked(self, nbytes, dim):
        return contextlib.nullcontext()

    def functional(self, active):
        pass

    def launched(self, dim):
        assert dim == "dp"
        self.launches += 1

    def delay_s(self, nbytes, dim):
        return self.delay

    @contextlib.contextmanager
    def waiting(self):
        self.waits += 1
        yield

    def hidden(self, hidden_s, waited_s):
        assert waited_s >= 0
        self.hidden_s.append(hidden_s)


def _hybrid(overlap: bool, bucket_cap_mb: float):
    from gearshift import strategies
    from gearshift.strategies.layout import Layout

    from gearshift.workers.build import components

    model = tiny_gpt()
    layout = Layout.for_workers("hybrid", 4, 2)
    plan = components.tp_plan(model, {}, None, layout.tp)
    options = strategies.Options(torch.device("cpu"), bucket_cap_mb, dp_overlap=overlap)
    par = strategies.parallelize(model, layout, plan, options)
    return par, layout


def _ranks(rank: int, world: int, out: str) -> None:
    from gearshift.strategies.state import full

    data = batches(STEPS)
    results, finals = {}, {}
    for name, overlap, cap, micro, clip in [("overlap", True, 0.01, 2, 0.5), ("serial", False, 0.01, 2, 0.5),
                                            ("overlap_one_bucket", True, 25.0, 1, None)]:
        par, layout = _hybrid(overlap, cap)
        route = RecordingRoute()
        par.attach(route)
        # Adam at lr 1e-3: Adam turns a rounding difference in a near-zero gradient into a step of
        # up to lr, so lr bounds how far the tp matmuls' split sums may move the parameters
        opt = torch.optim.Adam(par.param_groups(), lr=1e-3)
        norms = train_parallel(par, opt, layout, rank, data, clip=clip, micro=micro)
        reference = tiny_gpt()
        ref_norms = train_reference(reference, data, clip=clip, micro=micro,
                                    optimizer=torch.optim.Adam(reference.parameters(), lr=1e-3))
        finals[name] = {n: full(p.detach()).clone() for n, p in par.model.named_parameters()}
        results[name] = {"diff": max_diff(par, reference), "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
                         "launches": route.launches, "waits": route.waits,
                         "buckets": len(getattr(par.averager, "buckets", [])),
                         "hidden": route.hidden_s}
        par.detach()
    results["overlap_vs_serial"] = max(float((finals["overlap"][n] - finals["serial"][n]).abs().max())
                                       for n in finals["overlap"])
    # launched while backward runs: with small buckets, some all-reduce is in flight when backward returns
    par, layout = _hybrid(True, 0.01)
    dp_rank, share = layout.dp_rank(rank), BATCH // layout.dp
    x, y = data[0][0][dp_rank * share:(dp_rank + 1) * share], data[0][1][dp_rank * share:(dp_rank + 1) * share]
    loss_of(par.module, x, y).backward()
    results["inflight_after_backward"] = len(par.averager._inflight)
    par.after_backward()
    results["inflight_after_finish"] = len(par.averager._inflight)
    hooks_before = len(par.averager._hooks)
    par.detach()
    results["hooks"] = [hooks_before, len(par.averager._hooks)]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("overlap") / "results.json")
    spawn_gloo(_ranks, 4, (out,), timeout_s=240)
    with open(out) as f:
        return json.load(f)


@pytest.mark.parametrize("name", ["overlap", "serial", "overlap_one_bucket"])
def test_hybrid_average_equals_plain_pytorch(results, name):
    """hybrid(2 x 2), Adam, 3 steps, 2 micro-batches and clipping at 0.5 (and once one bucket, no
    clip): parameters and every step's gradient norm as single-process PyTorch."""
    r = results[name]
    assert r["diff"] <= TOL, r
    assert r["norm_diff"] <= TOL * 10, r


def test_overlapped_average_equals_the_serial_one(results):
    """The same sums in the same buckets: the order they are launched in changes nothing."""
    assert results["overlap_vs_serial"] <= 1e-7


def test_overlapped_average_launches_every_bucket_once_a_step(results):
    r = results["overlap"]
    assert r["buckets"] > 3  # 0.01 MB buckets: the tiny GPT's gradients make several
    assert r["launches"] == r["buckets"] * STEPS  # one all-reduce per bucket per step, none inside no_sync
    assert r["waits"] == STEPS and len(r["hidden"]) == STEPS and all(h >= 0 for h in r["hidden"])
    assert results["overlap_one_bucket"]["launches"] == STEPS


def test_all_reduces_start_before_backward_ends(results):
    """Buckets go out from the hooks: when backward returns, all of them but at most the ones
    backward never completed are already launched; finish() leaves nothing in flight."""
    assert results["inflight_after_backward"] >= 3
    assert results["inflight_after_finish"] == 0


def test_detach_removes_the_hooks(results):
    assert results["hooks"][0] > 0 and results["hooks"][1] == 0


def test_hidden_is_the_union_of_spans_outside_the_wait():
    from gearshift.strategies.grads import _hidden

    # (grads, flat, fut, launched, done): two overlapping spans, one that runs into the wait
    spans = [(None, None, None, 0.0, [2.0]), (None, None, None, 1.0, [3.0]), (None, None, None, 5.0, [9.0])]
    assert _hidden(spans, wait_start=6.0, wait_end=9.0) == pytest.approx(3.0 + 1.0)
    assert _hidden([], 0.0, 1.0) == 0.0


def test_job_field_reaches_the_worker():
    from gearshift.orchestrator.job import load_job
    from gearshift.workers.config import WorkerConfig

    job = load_job(os.path.join(os.path.dirname(__file__), "..", "examples", "gpt.yaml"),
                   overrides={"parallel.dp_overlap": False})
    assert WorkerConfig.from_job(job.to_dict()).dp_overlap is False
    assert WorkerConfig.from_job(load_job(os.path.join(os.path.dirname(__file__), "..", "examples",
                                                       "gpt.yaml")).to_dict()).dp_overlap is True


def _inflight_at_each_finish(worker):
    """Runs in each worker: how many buckets were already in flight when backward returned, for
    two training steps of the real step loop (the model was built on the meta device)."""
    par = worker.parallel
    seen, finish = [], par.after_backward

    def after_backward():
        seen.append(len(par.averager._inflight))
        finish()

    par.after_backward = after_backward
    list(worker.train(worker.step + 2, 0, 1000.0))
    return seen, worker.builder.info["on_meta"]


def test_a_model_built_on_meta_overlaps_in_the_worker():
    """The layout is applied on the meta device and its storage swapped in afterwards: hooks put on
    before that swap never fire, so the averager binds them on the first forward. In the worker's
    own loop, buckets are in flight before backward returns from the very first step."""
    from process_workers import PooledGroup
    from gearshift.orchestrator.job import job_from_dict

    root = os.path.join(os.path.dirname(__file__), "..")
    job = job_from_dict({"model": {"name": "gpt", "kwargs": {"vocab_size": 128, "block_size": 16, "n_layer": 2,
                                                           "n_head": 4, "n_embd": 32}},
                         "data": "chars", "train": {"steps": 2, "global_batch_size": 8},
                         "cluster": {"num_workers": 4},
                         "parallel": {"strategy": "hybrid", "tp_size": 2, "bucket_cap_mb": 0.01},
                         "telemetry": {"ray_metrics": False}}).to_dict()
    with PooledGroup(job, 4, search_paths=[root], cpus=0.5) as group:
        group.call("build")
        for seen, on_meta in group.apply(_inflight_at_each_finish):
            assert on_meta
            assert len(seen) == 2 and all(n >= 3 for n in seen), seen
