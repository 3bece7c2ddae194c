"""FSDP2 mixed precision from the job's precision: bf16 gathers and compute, fp32 master weights,
gradients reduced in parallel.reduce_dtype (fp32 by default). Checked on two gloo processes
against plain single-process PyTorch doing the same arithmetic, and read back from FSDP2's state."""

from __future__ import annotations

import copy
import json
import os
import pathlib

import pytest
import torch

from test_fsdp import BATCH, STEPS, batches, loss_of, spawn_gloo, tiny_gpt

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The reference does what FSDP2 does, op for op: each rank's half batch through a bf16 copy of
# the fp32 weights, its bf16 gradients cast to the reduce dtype, summed over the 2 ranks and
# halved (gloo: forced sum, then the division), Adam on the fp32 weights. Same ops on the same
# shapes: measured here, the two agree bit for bit (0.0) after 3 steps; 1e-6 leaves room for
# another CPU's kernels ordering a sum otherwise, and is far below what the reduce dtype alone
# changes (the other reduce dtype's reference differs by more) or what bf16 itself does.
TOL = 1e-6
BF16_EFFECT = 1e-3  # the least a bf16 run must differ from the fp32 one, or bf16 was not in force


# ---------------------------------------------------------------- the rule, no process group

def test_bf16_gathers_unless_precision_phases_say_otherwise():
    from gearshift.workers.config import fsdp_mixed_precision

    assert fsdp_mixed_precision("bf16") == (("bf16", "fp32"), None)
    assert fsdp_mixed_precision("bf16", "bf16") == (("bf16", "bf16"), None)
    assert fsdp_mixed_precision({"dtype": "bf16", "fp32_warmup_steps": 0, "keep_fp32": []}) == (("bf16", "fp32"), None)
    assert fsdp_mixed_precision("fp32") == (None, None)
    assert fsdp_mixed_precision("fp16") == (None, None)  # loss-scaled autocast over fp32 gathers, as before
    policy, note = fsdp_mixed_precision({"dtype": "bf16", "fp32_warmup_steps": 5, "keep_fp32": []})
    assert policy is None and "fp32_warmup_steps" in note and "fp32" in note
    policy, note = fsdp_mixed_precision({"dtype": "bf16", "fp32_warmup_steps": 0, "keep_fp32": ["ln_f"]})
    assert policy is None and "keep_fp32" in note


def test_the_worker_is_told_the_policy():
    from gearshift.orchestrator.job import load_job
    from gearshift.workers.config import WorkerConfig

    job = load_job(ROOT / "examples/gpt.yaml", ["train.precision=bf16", "parallel.reduce_dtype=bf16"]).to_dict()
    assert WorkerConfig.from_job(job).fsdp_mixed_precision == ("bf16", "bf16")
    job = load_job(ROOT / "examples/gpt.yaml", ["train.precision=fp32"]).to_dict()
    assert WorkerConfig.from_job(job).fsdp_mixed_precision is None


def test_reduce_dtype_bad_values_name_the_field():
    from gearshift.orchestrator.job import JobError, load_job

    with pytest.raises(JobError, match=r"parallel.reduce_dtype = 'fp16' is not valid: must be one of 'fp32', 'bf16'"):
        load_job(ROOT / "examples/gpt.yaml", ["parallel.reduce_dtype=fp16"])
    with pytest.raises(JobError, match=r"parallel.reduce_dtype = 'bf16' is not valid: applies only where .* "
                                       r"train.precision bf16"):
        load_job(ROOT / "examples/gpt.yaml", ["train.precision=fp32", "parallel.reduce_dtype=bf16"])
    with pytest.raises(JobError, match="parallel.reduce_dtype"):
        load_job(ROOT / "examples/gpt.yaml", ["train.precision={dtype: bf16, fp32_warmup_steps: 2}",
                                              "parallel.reduce_dtype=bf16"])
    assert load_job(ROOT / "examples/gpt.yaml", ["train.precision=bf16"]).parallel.reduce_dtype == "fp32"


def test_policy_names_what_is_allowed():
    from gearshift.strategies.fsdp import policy

    assert policy(("bf16", "fp32")).param_dtype == torch.bfloat16
    assert policy(None).param_dtype is None
    with pytest.raises(ValueError, match="each one of bf16, fp32"):
        policy(("bf16", "fp16"))


# ---------------------------------------------------------------- two gloo processes

def _reference(data, reduce_dtype, world):
    master = tiny_gpt()
    opt = torch.optim.Adam(master.parameters(), lr=1e-2)
    share = BATCH // world
    for x, y in data:
        summed = None
        for r in range(world):
            replica = copy.deepcopy(master).to(torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(replica, x[r * share:(r + 1) * share], y[r * share:(r + 1) * share])
            loss.backward()
            g = [p.grad.to(reduce_dtype) for p in replica.parameters()]
            summed = g if summed is None else [a + b for a, b in zip(summed, g)]
        for p, g in zip(master.parameters(), summed):
            p.grad = (g / world).float()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return master


def _plain_fp32(data):
    model = tiny_gpt()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in data:
        loss_of(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def _diff(par, reference) -> float:
    from gearshift.strategies.state import full

    ref = dict(reference.named_parameters())
    return max(float((full(p.detach()) - ref[n].detach()).abs().max()) for n, p in par.model.named_parameters())


def _mixed(rank, world, out_dir):
    from gearshift import strategies
    from gearshift.strategies import Layout
    from gearshift.strategies.fsdp import held_precision

    data = batches()
    layout = Layout.for_workers("fsdp", world, None)
    out = {}
    for reduce in ("fp32", "bf16"):
        par = strategies.parallelize(tiny_gpt(), layout, None,
                                     strategies.Options(torch.device("cpu"), mixed_precision=("bf16", reduce)))
        seen = {}
        block = par.model.blocks[0]
        hook = block.register_forward_pre_hook(lambda m, a: seen.setdefault("block", str(m.attn.q.weight.dtype)) and None)
        opt = torch.optim.Adam(par.param_groups(), lr=1e-2)
        share = BATCH // world
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = loss_of(par.module, x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share])
            loss.backward()
            opt.step()
        hook.remove()
        dtype = torch.float32 if reduce == "fp32" else torch.bfloat16
        other = torch.bfloat16 if reduce == "fp32" else torch.float32
        out[reduce] = {"diff": _diff(par, _reference(data, dtype, world)), "fp32_diff": _diff(par, _plain_fp32(data)),
                       "other_reduce_diff": _diff(par, _reference(data, other, world)),
                       "held": held_precision(par.model), "computed_in": seen["block"],
                       "shards": sorted({str(p.dtype) for p in par.model.parameters()}),
                       "units": sum(1 for m in par.model.modules() if hasattr(m, "_get_fsdp_state"))}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_mp")
    spawn_gloo(_mixed, 2, (str(out),), timeout_s=200)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_bf16_fsdp_trains_like_plain_pytorch_with_the_same_arithmetic(mixed, reduce):
    for res in mixed:
        r = res[reduce]
        assert r["diff"] < TOL, r
        assert r["fp32_diff"] > BF16_EFFECT, r  # bf16 was in force: far from an fp32 run
        assert r["other_reduce_diff"] > 10 * TOL, r  # and the gradients were reduced in the dtype asked for
        assert r["computed_in"] == "torch.bfloat16"  # the gathered weights a block computes with
        assert r["shards"] == ["torch.float32"]  # the optimizer's master weights


@pytest.mark.slow
@pytest.mark.parametrize("reduce", ["fp32", "bf16"])
def test_the_policy_is_what_fsdp2_holds(mixed, reduce):
    for res in mixed:
        r = res[reduce]
        assert r["units"] > 1
        # every unit holds the same policy (held_precision says "mixed" otherwise); on gloo every
        # unit sums and divides after, not the root alone
        assert r["held"] == {"param_dtype": "bfloat16", "reduce_dtype": "float32" if reduce == "fp32" else "bfloat16",
                             "force_sum": True}, r["held"]


def test_the_run_says_when_bf16_jobs_keep_fp32_gathers():
    from gearshift.api import _fsdp_precision_note
    from gearshift.orchestrator.job import load_job

    phases = "train.precision={dtype: bf16, fp32_warmup_steps: 2}"
    note = _fsdp_precision_note(load_job(ROOT / "examples/gpt.yaml", [phases, "parallel.strategy=fsdp"]))
    assert "fp32_warmup_steps" in note and "bf16 autocast" in note
    assert _fsdp_precision_note(load_job(ROOT / "examples/gpt.yaml", [phases, "parallel.strategy=data"])) is None
    assert _fsdp_precision_note(load_job(ROOT / "examples/gpt.yaml", ["train.precision=bf16",
                                                                       "parallel.strategy=fsdp"])) is None
