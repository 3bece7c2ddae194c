"""model.init: per_shard in one process: the values are fixed by the seed (the same twice,
another for another seed), drawn from the constructor's own distributions, tensors without
random numbers equal to a plain build's; which mode auto picks, and a bad value's error.
Under every layout against this single-process build: tests/test_first_build.py."""

from __future__ import annotations

import pathlib

import pytest
import torch

from gearshift.workers.build import components, shard_init
from gearshift.workers.build.meta_init import build_recorded, _tensors

pytest.importorskip("transformers")

FIXTURES = str(pathlib.Path(__file__).parent / "fixtures")
SPECS = {"gpt": {"name": "gpt", "kwargs": {"vocab_size": 512, "block_size": 64, "n_layer": 2, "n_head": 4,
                                             "n_embd": 256}},
         "llama": {"entrypoint": "first_build:llama"}, "vit": {"entrypoint": "first_build:vit"},
         "second_pass": {"entrypoint": "first_build:second_pass"}}


def _build(spec):
    return components.build_model_and_plan(spec, [FIXTURES])


def _per_shard(spec, seed):
    torch.manual_seed(seed)
    (model, _), record = build_recorded(lambda: _build(spec))
    made = shard_init.fill(model, record, torch.device("cpu"), seed)
    return {name: t.detach().clone() for name, t in _tensors(model).items()}, made, record


def _random(record, name) -> bool:
    """Whether `name`'s value takes random numbers (its chain has a draw)."""
    from gearshift.workers.build.meta_init import _needed

    return any(record.ops[i].seeded for i in _needed(record.ops, {record.finals[name].key})[0])


@pytest.mark.parametrize("family", list(SPECS))
def test_per_shard_values_are_fixed_by_the_seed_and_drawn_as_the_model_draws(family):
    first, made, record = _per_shard(SPECS[family], 3)
    again, _, _ = _per_shard(SPECS[family], 3)
    other, _, _ = _per_shard(SPECS[family], 4)
    torch.manual_seed(3)
    plain = {name: t.detach() for name, t in _tensors(_build(SPECS[family])[0]).items()}
    assert made.drawn > 0.9 * sum(t.numel() for name, t in plain.items() if _random(record, name))
    for name, value in first.items():
        assert torch.equal(value, again[name]), name
        if not _random(record, name):  # ones, zeros, a RoPE table: a plain build's values
            assert torch.equal(value, plain[name]), name
            continue
        assert not torch.equal(value, plain[name]) and not torch.equal(value, other[name]), name
        if value.numel() >= 4096:  # the constructor's distribution: its spread and centre
            want, got = plain[name].float(), value.float()
            assert abs(got.std() - want.std()) < 0.05 * want.std(), (name, got.std(), want.std())
            assert abs(got.mean() - want.mean()) < 0.05 * want.std() + 1e-6, (name, got.mean(), want.mean())


def test_rows_made_alone_equal_the_same_rows_of_the_whole():
    """A rank's rows, made from only the blocks that hold them, are those rows of the whole value
    (blocks fixed by the shape, not by who asks): cut at a block's edge and inside one."""
    torch.manual_seed(0)
    (model, _), record = build_recorded(lambda: _build(SPECS["gpt"]))
    name = max(record.finals, key=lambda n: record.finals[n].numel)
    whole_made, part_made = shard_init.Made(), shard_init.Made()
    chain = shard_init._Chain(record, name, 5)
    assert chain.by_rows and chain.rows > 2 * chain.per_block, (chain.rows, chain.per_block)
    whole = chain.make(0, chain.rows, whole_made)
    lo, hi = chain.per_block - 3, 2 * chain.per_block + 1
    assert torch.equal(chain.make(lo, hi, part_made), whole[lo:hi])
    assert part_made.blocks == 3 and part_made.drawn == 3 * chain.per_block * chain.row < whole_made.drawn, \
        (part_made, whole_made)


def test_auto_picks_by_size_and_a_bad_value_is_named():
    from gearshift.orchestrator.job import JobError, job_from_dict

    assert shard_init.choose("auto", shard_init.AUTO_PER_SHARD - 1)[0] == "exact"
    assert shard_init.choose("auto", shard_init.AUTO_PER_SHARD)[0] == "per_shard"
    assert shard_init.choose("exact", 10 ** 12) == ("exact", "asked")
    with pytest.raises(JobError) as err:
        job_from_dict({"model": {"name": "gpt", "init": "random"}, "train": {"steps": 1}})
    assert "model.init" in str(err.value) and "per_shard" in str(err.value) and "random" in str(err.value)


def test_the_start_line_says_the_mode_and_why():
    from gearshift.orchestrator.control.startup import build_lines

    built = {"on_meta": True, "init": "per_shard", "init_why": "auto: 1,200M parameters, >= 1B",
             "drawn_whole": ["buffer:rope"]}
    assert build_lines(built, loaded=False) == ["init: per_shard (auto: 1,200M parameters, >= 1B), "
                                                "1 tensors drawn whole"]
    assert build_lines(built, loaded=True) == []  # a checkpoint replaces the initial values


def test_a_build_that_cannot_be_recorded_keeps_the_plain_values_and_says_why():
    """per_shard asked of a model built whole whose constructor reads a value: the plain build's
    values stand (never a half-made start), and the reason is what the start line says."""
    class Reads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(8, 8)
            self.scale = float(torch.rand(()))  # read while built: a fake tensor has no value

    torch.manual_seed(1)
    model = Reads()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    got = shard_init.whole(model, Reads, "per_shard", 1, torch.device("cpu"))
    assert got["init"] == "exact" and "cannot be recorded" in got["init_why"], got
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    made = shard_init.whole(torch.nn.Linear(8, 8), lambda: torch.nn.Linear(8, 8), "per_shard", 1, torch.device("cpu"))
    assert made["init"] == "per_shard" and made["drawn"] == 8 * 8 + 8, made
