"""FSDP2 layouts (fsdp, hsdp, hybrid with dp_shard) on multi-process gloo, checked against plain
single-process PyTorch on the same global batches. One spawn of 4 processes runs every check
(a spawn costs seconds on 2 cores) and the tests read its results."""

from __future__ import annotations

import contextlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

import gloo_pool

TOL = 1e-4
STEPS = 3
BATCH, SEQ, VOCAB = 8, 8, 128


# ---------------------------------------------------------------- multi-process harness

def spawn_gloo(fn, world: int, args: tuple = (), timeout_s: float = 120.0) -> None:
    """Run fn(rank, world, *args) on `world` processes joined in one gloo process group (the
    warm processes of tests/gloo_pool.py); raises if any fails, ends them all when they take
    longer than `timeout_s`."""
    gloo_pool.run(fn, world, args, timeout_s)


# ---------------------------------------------------------------- shared pieces

def tiny_gpt():
    from gearshift.workers.build.models import gpt

    torch.manual_seed(0)
    return gpt(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=32)


def batches(steps: int = STEPS):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
            for _ in range(steps)]


def loss_of(module, x, y):
    return F.cross_entropy(module(x).flatten(0, 1), y.flatten())


def train_reference(model, data, clip=None, micro=1, optimizer=None):
    """Plain single-process training: the global batch, mean loss, Adam."""
    opt = optimizer or torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for x, y in data:
        opt.zero_grad(set_to_none=True)
        for xm, ym in zip(x.chunk(micro), y.chunk(micro)):
            (loss_of(model, xm, ym) / micro).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        opt.step()
    return norms


def train_parallel(par, opt, layout, rank, data, clip=None, micro=1):
    """The worker's step on a layout: this rank's slice of each global batch, no_sync on all
    micro-batches but the last, the layout's norm and clip."""
    dp_rank, share = layout.dp_rank(rank), BATCH // layout.dp
    norms = []
    for x, y in data:
        x, y = x[dp_rank * share:(dp_rank + 1) * share], y[dp_rank * share:(dp_rank + 1) * share]
        opt.zero_grad(set_to_none=True)
        for i, (xm, ym) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            with par.no_sync() if i < micro - 1 else contextlib.nullcontext():
                (loss_of(par.module, xm, ym) / micro).backward()
        par.after_backward()
        norm = par.clip_grad_norm(clip) if clip else par.grad_norm()
        norms.append(float(norm))
        opt.step()
    return norms


def max_diff(par, reference) -> float:
    """Largest difference between the layout's parameters (gathered) and the reference's."""
    from gearshift.strategies.state import full

    ref = dict(reference.named_parameters())
    return max(float((full(p.detach()) - ref[n].detach()).abs().max()) for n, p in par.model.named_parameters())


class CountingComm:
    """A comm route that only counts: which mesh dimensions blocked, and that spans close."""

    def __init__(self):
        self.calls, self.open = {}, 0

    def ddp_hook(self, default):
        return None

    @contextlib.contextmanager
    def blocked(self, nbytes, dim):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1
            self.calls[dim] = self.calls.get(dim, 0) + 1

    def functional(self, active):
        pass


# ---------------------------------------------------------------- the spawned checks

def _layout_case(rank, world, layout, clip=None, micro=1, comm=None, compiled=False) -> dict:
    from gearshift import strategies
    data = batches()
    reference = tiny_gpt()
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    ref_norms = train_reference(reference, data, clip, micro, ref_opt)
    model = tiny_gpt()
    plan = model.tp_plan(layout.tp) if strategies.lookup(layout.strategy).needs_plan else None
    par = strategies.parallelize(model, layout, plan, strategies.Options(torch.device("cpu")))
    if compiled:  # the layout's own compile (fsdp and hsdp: each block in place; hybrid: the wrapper)
        par.compile({"backend": "aot_eager"})  # dynamo and autograd tracing; inductor adds only codegen time
    if comm is not None:
        par.attach(comm)
    opt = torch.optim.Adam(par.param_groups(), lr=1e-2)
    norms = train_parallel(par, opt, layout, rank, data, clip, micro)
    out = {"diff": max_diff(par, reference), "norm_diff": max(abs(a - b) for a, b in zip(norms, ref_norms)),
           "norms": norms,  # a compiled layout's state is the same layout's: its reload is checked uncompiled
           "reloaded_diff": None if compiled else _reload_diff(par, opt, layout, plan, rank, (reference, ref_opt), data),
           "compiled": par.compiled, "blocks_compiled": [getattr(b, "_compiled_call_impl", None) is not None
                                                         for b in par.model.blocks]}
    if comm is not None:
        par.detach()
        out.update(calls=comm.calls, open=comm.open)
    return out


def _reload_diff(par, opt, layout, plan, rank, reference: tuple, data) -> float:
    """Full state gathered from `par` and loaded into a fresh layout of other weights, then one
    more step on both: the reloaded one must match the reference taking that step too."""
    from gearshift import strategies
    with torch.no_grad():  # an evaluation first leaves FSDP2's root unit gathered
        par.module(data[0][0][:2])
    full = par.full_state(opt, rank, everywhere=True)
    torch.manual_seed(5)
    other = tiny_gpt().apply(lambda m: torch.nn.init.normal_(m.weight) if hasattr(m, "weight") else None)
    again = strategies.parallelize(other, layout, plan, strategies.Options(torch.device("cpu")))
    again_opt = torch.optim.Adam(again.param_groups(), lr=1e-2)
    again.load_full_state(again_opt, full)
    train_parallel(again, again_opt, layout, rank, data[:1])
    train_reference(reference[0], data[:1], optimizer=reference[1])
    return max_diff(again, reference[0])


def _fp16_overflow_on_one_rank(rank, world) -> dict:
    """An inf in one rank's gradient shard: every rank skips the step and lowers the scale."""
    from gearshift import strategies
    from gearshift.strategies import Layout

    layout = Layout.for_workers("fsdp", world, None)
    par = strategies.parallelize(tiny_gpt(), layout, None, strategies.Options(torch.device("cpu"), fp16=True))
    opt = torch.optim.Adam(par.param_groups(), lr=1e-2)
    scaler = par.make_scaler()
    before = [p.to_local().clone() for p in par.model.parameters()]
    x, y = batches(1)[0]
    scaler.scale(loss_of(par.module, x, y)).backward()
    if rank == 0:
        next(par.model.parameters()).grad.to_local().view(-1)[0] = float("inf")
    scale = float(scaler.get_scale())
    scaler.step(opt)
    scaler.update()
    unchanged = all(torch.equal(b, p.to_local()) for b, p in zip(before, par.model.parameters()))
    return {"skipped": unchanged, "scale_lowered": float(scaler.get_scale()) < scale}


def _all_cases(rank, world, out_dir):
    from gearshift.strategies import Layout

    cases = {
        "fsdp": lambda: _layout_case(rank, world, Layout.for_workers("fsdp", world, None)),
        "hsdp": lambda: _layout_case(rank, world, Layout.for_workers("hsdp", world, None, shard_size=2)),
        "hybrid_dp_shard": lambda: _layout_case(rank, world, Layout.for_workers("hybrid", world, 2, dp_shard=True)),
        "fsdp_accumulate_clip": lambda: _layout_case(rank, world, Layout.for_workers("fsdp", world, None),
                                                     clip=0.5, micro=2),
        "hsdp_timed": lambda: _layout_case(rank, world, Layout.for_workers("hsdp", world, None, shard_size=2),
                                           clip=0.5, comm=CountingComm()),
        # train.compile under each layout (the crossings table's compile row)
        "fsdp_compiled": lambda: _layout_case(rank, world, Layout.for_workers("fsdp", world, None), compiled=True),
        "hsdp_compiled": lambda: _layout_case(rank, world, Layout.for_workers("hsdp", world, None, shard_size=2),
                                              compiled=True),
        "hybrid_compiled": lambda: _layout_case(rank, world, Layout.for_workers("hybrid", world, 2), compiled=True),
    }
    results = {name: case() for name, case in cases.items()}
    results["fp16"] = _fp16_overflow_on_one_rank(rank, world)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    spawn_gloo(_all_cases, 4, (str(out),), timeout_s=150)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["fsdp", "hsdp", "hybrid_dp_shard", "fsdp_accumulate_clip", "hsdp_timed"])
def test_sharded_layout_trains_like_one_process(results, case):
    for rank, res in enumerate(results):
        assert res[case]["diff"] < TOL, (case, rank, res[case]["diff"])
        assert res[case]["reloaded_diff"] < TOL, (case, rank, res[case]["reloaded_diff"])
        assert res[case]["norm_diff"] < TOL, (case, rank, res[case]["norm_diff"])
        assert not res[case]["compiled"]
    # the norm (and so the clip) is the same on every rank
    assert all(res[case]["norms"] == results[0][case]["norms"] for res in results)


@pytest.mark.slow
@pytest.mark.parametrize("case,per_block", [
    pytest.param("fsdp_compiled", True, marks=pytest.mark.crossing("compile", "fsdp")),
    pytest.param("hsdp_compiled", True, marks=pytest.mark.crossing("compile", "hsdp")),
    pytest.param("hybrid_compiled", False, marks=pytest.mark.crossing("compile", "hybrid")),
])
def test_a_compiled_layout_trains_like_one_process(results, case, per_block):
    """torch.compile under the layout (FSDP2's units each compiled in place, so the gathers
    still run per unit; hybrid's wrapper compiled whole): the same steps as plain PyTorch."""
    for rank, res in enumerate(results):
        assert res[case]["compiled"], (case, rank)
        assert all(res[case]["blocks_compiled"]) if per_block else not any(res[case]["blocks_compiled"])
        assert res[case]["diff"] < TOL, (case, rank, res[case]["diff"])
        assert res[case]["norm_diff"] < TOL, (case, rank, res[case]["norm_diff"])
    assert all(res[case]["norms"] == results[0][case]["norms"] for res in results)


@pytest.mark.slow
def test_fsdp_collectives_run_inside_comm_timing(results):
    for res in results:
        calls = res["hsdp_timed"]["calls"]
        # all-gathers, reduce-scatters and hsdp's all-reduces, plus the clip's norm: all on dp
        assert set(calls) == {"dp"} and calls["dp"] >= 3 * STEPS
        assert res["hsdp_timed"]["open"] == 0


@pytest.mark.slow
def test_fp16_ranks_agree_on_an_overflow_in_one_shard(results):
    assert all(res["fp16"] == {"skipped": True, "scale_lowered": True} for res in results), results


def test_layout_rejects_shard_sizes_that_do_not_divide():
    from gearshift.strategies import Layout, LayoutError

    with pytest.raises(LayoutError, match=r"groups \* shard_size\(3\) != num_workers\(4\)"):
        Layout.for_workers("hsdp", 4, None, shard_size=3)
    with pytest.raises(LayoutError, match="needs parallel.shard_size"):
        Layout.for_workers("hsdp", 4, None)
    with pytest.raises(LayoutError, match="shard_size applies to hsdp"):
        Layout.for_workers("fsdp", 4, None, shard_size=2)
    with pytest.raises(LayoutError, match=r"shard\(3\) must divide dp\(4\)"):
        Layout("fsdp", 4, 1, 3)
    with pytest.raises(LayoutError, match="dp_shard applies to .*strategy fsdp cannot"):
        Layout.for_workers("fsdp", 4, None, dp_shard=True)
    with pytest.raises(LayoutError, match="dp_shard applies to .*strategy data cannot"):
        Layout.for_workers("data", 4, None, dp_shard=True)
    assert Layout.for_workers("fsdp", 4, None).shard == 4
    assert Layout.for_workers("hsdp", 4, None, shard_size=2).replicas == 2
    assert Layout.for_workers("hybrid", 4, 2, dp_shard=True).shard == 2


