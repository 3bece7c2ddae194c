"""FSDP units found at any depth (a Hugging Face model's `_no_split_modules`, the blocks of a
ModuleList below the root) or named by `parallel.fsdp_units`, and a model where none are found
said so; a nested model sharded by its blocks trains like one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from test_fsdp import TOL, VOCAB, batches, spawn_gloo, train_parallel, train_reference

from gearshift.strategies.fsdp import describe_units, find_units


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))  # a container inside a block

    def forward(self, x):
        return x + self.mlp(self.ln(x))


class Body(nn.Module):
    def __init__(self, d: int, n: int):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.h = nn.ModuleList(Block(d) for _ in range(n))  # blocks two levels down, as GPT-2's transformer.h
        self.ln_f = nn.LayerNorm(d)

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class Nested(nn.Module):
    def __init__(self, d: int = 32, n: int = 3):
        super().__init__()
        self.transformer = Body(d, n)
        self.lm_head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))


class HFLike(Nested):
    _no_split_modules = ["Block"]  # what a Hugging Face PreTrainedModel names as its blocks


def test_blocks_are_found_below_the_root():
    units, how = find_units(Nested())
    assert how == "blocks"
    assert [n for n, _ in units] == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]  # not their mlp


def test_no_split_modules_name_the_units():
    units, how = find_units(HFLike(n=2))
    assert how == "no_split_modules" and [n for n, _ in units] == ["transformer.h.0", "transformer.h.1"]


def test_patterns_by_name_and_by_class_take_the_outermost_match():
    model = Nested(n=2)
    by_name, how = find_units(model, ["transformer.h.*"])  # also matches transformer.h.0.mlp.0 ...: outermost only
    assert how == "patterns" and [n for n, _ in by_name] == ["transformer.h.0", "transformer.h.1"]
    by_class, _ = find_units(model, ["Linear"])
    assert [n for n, _ in by_class] == ["transformer.h.0.mlp.0", "transformer.h.0.mlp.2",
                                        "transformer.h.1.mlp.0", "transformer.h.1.mlp.2", "lm_head"]


def test_a_model_without_blocks_says_the_root_is_the_only_unit():
    described = describe_units(nn.Linear(4, 4))
    assert described["found_by"] == "none" and described["count"] == 0
    assert "parallel.fsdp_units" in described["note"]
    # its 2 blocks, and the embedding and the head, which are sharded as units of their own
    assert describe_units(Nested(n=2))["count"] == 4


def test_the_embedding_and_the_head_are_sharded_as_units_unless_tied():
    units, how = find_units(Nested(n=2), outside=True)
    assert how == "blocks"
    assert [n for n, _ in units] == ["transformer.wte", "transformer.h.0", "transformer.h.1", "lm_head"]
    tied = Nested(n=2)
    tied.lm_head.weight = tied.transformer.wte.weight  # one parameter cannot be in two units: both stay in the root
    assert [n for n, _ in find_units(tied, outside=True)[0]] == ["transformer.h.0", "transformer.h.1"]
    small = Nested(d=32, n=2)
    small.transformer.wte = nn.Embedding(4, 32)  # far less than half a block: stays in the root
    assert [n for n, _ in find_units(small, outside=True)[0]][0] == "transformer.h.0"
    # what recompute checkpoints stays the blocks
    assert [n for n, _ in find_units(Nested(n=2))[0]] == ["transformer.h.0", "transformer.h.1"]


def test_a_pattern_matching_nothing_is_a_job_error(tmp_path):
    from gearshift.orchestrator.job.fields import JobError
    from gearshift.orchestrator.job.load import job_from_dict

    job = {"name": "units", "model": {"name": "mlp", "kwargs": {"hidden": 16, "layers": 2}},
           "data": {"name": "synthetic_digits", "kwargs": {"size": 64}},
           "parallel": {"strategy": "fsdp", "fsdp_units": ["blocks.*"]},
           "cluster": {"num_workers": 2}, "train": {"steps": 2, "global_batch_size": 8}}
    with pytest.raises(JobError) as err:
        job_from_dict(job, base_dir=tmp_path)
    text = str(err.value)
    assert "parallel.fsdp_units" in text and "blocks.*" in text and "matches no module" in text
    with pytest.raises(JobError, match="parallel.fsdp_units"):
        job_from_dict({**job, "parallel": {"strategy": "fsdp", "fsdp_units": "blocks"}}, base_dir=tmp_path)


def _nested_fsdp(rank, world, out_dir, patterns):
    from torch.distributed.fsdp import FSDPModule

    from gearshift import strategies
    from gearshift.strategies.layout import Layout

    torch.manual_seed(0)
    reference = HFLike()
    torch.manual_seed(0)
    model = HFLike()
    layout = Layout.for_workers("fsdp", world, None)
    par = strategies.parallelize(model, layout, None, strategies.Options(torch.device("cpu"), fsdp_units=patterns))
    opt = torch.optim.Adam(par.param_groups()[0]["params"], lr=1e-2)
    data = batches()
    train_parallel(par, opt, layout, rank, data)
    sharded = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    found = describe_units(model, patterns)  # after fully_shard, classes are FSDP<name>: still found
    from gearshift.strategies.state import full

    ref_params = dict(reference.named_parameters())
    train_reference(reference, data)
    diff = max(float((full(p.detach()) - ref_params[n].detach()).abs().max()) for n, p in model.named_parameters())
    if rank == 0:
        (out_dir / f"nested-{'-'.join(patterns) or 'found'}.json").write_text(
            json.dumps({"sharded": sharded, "found": found, "diff": diff}))


@pytest.mark.slow
def test_a_nested_model_is_sharded_by_its_blocks_and_trains_like_one_process(tmp_path):
    spawn_gloo(_nested_fsdp, 2, (tmp_path, ()))
    spawn_gloo(_nested_fsdp, 2, (tmp_path, ("Block",)))
    found = json.loads((tmp_path / "nested-found.json").read_text())
    named = json.loads((tmp_path / "nested-Block.json").read_text())
    # found: the blocks (the _no_split_modules), and the embedding and the head as units of their own
    assert found["sharded"] == ["", "transformer.wte", "transformer.h.0", "transformer.h.1", "transformer.h.2",
                                "lm_head"]
    assert found["found"]["count"] == 5
    # named: exactly what the patterns say
    assert named["sharded"] == ["", "transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert named["found"]["count"] == 3
    for result in (found, named):
        assert result["diff"] <= TOL, result["diff"]
    assert found["found"]["found_by"] == "no_split_modules" and named["found"]["found_by"] == "patterns"
