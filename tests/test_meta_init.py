"""A model built on the meta device and materialised by replaying its record
(workers/build/meta_init.py) holds exactly what a plain CPU build after the same seed holds: random
initialisers, a padding row zeroed through a view, a second initialisation pass, buffers
computed from arange, tied weights; whole-value peaks stay near the largest tensor."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from gearshift.workers.build.meta_init import build_recorded, materialise


class Rope(nn.Module):
    def __init__(self, dim: int = 8, seq: int = 16):
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        freqs = torch.outer(torch.arange(seq).float(), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)


class Tied(nn.Module):
    """An embedding with a padding row, blocks initialised twice (the layers' own init, then a
    pass over every module as a Hugging Face post_init does), a RoPE table, a head tied to the
    embedding, a trunc-normal parameter."""

    def __init__(self, vocab: int = 50, d: int = 16, n: int = 3):
        super().__init__()
        self.wte = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                  nn.Linear(4 * d, d)) for _ in range(n))
        self.rope = Rope()
        self.scale = nn.Parameter(torch.empty(d))
        nn.init.trunc_normal_(self.scale, std=0.02)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


def _replayed(build, seed=3):
    torch.manual_seed(seed)
    model, record = build_recorded(build)
    assert record.replayable, record.reason
    assert all(p.device.type == "meta" for p in model.parameters())
    got = {}
    torch.manual_seed(seed)
    materialise(record, lambda name, value: got.__setitem__(name, value.clone()))
    return model, got


@pytest.mark.parametrize("build", [Tied, lambda: nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3))],
                         ids=["tied", "mlp"])
def test_replay_equals_the_plain_build_after_the_same_seed(build):
    torch.manual_seed(3)
    plain = build()
    _, got = _replayed(build)
    want = {**dict(plain.named_parameters()), **{f"buffer:{n}": b for n, b in plain.named_buffers()}}
    assert set(got) == set(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), name


def test_the_builtin_gpt_replays_exactly():
    from gearshift.workers.build.models import gpt

    build = lambda: gpt(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)  # noqa: E731
    torch.manual_seed(5)
    plain = build()
    _, got = _replayed(build, seed=5)
    for name, value in plain.named_parameters():
        assert torch.equal(got[name], value), name


def test_each_value_is_handed_over_once_and_the_peak_is_one_tensor_not_the_model():
    """With 12 blocks of equal size, the replay holds about one block's values whole at a time,
    not 12."""
    n, d = 12, 64
    build = lambda: nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])  # noqa: E731
    torch.manual_seed(0)
    _, record = build_recorded(build)
    seen = []
    torch.manual_seed(0)
    peak = materialise(record, lambda name, value: seen.append(name))
    assert sorted(seen) == sorted(name for name, _ in build().named_parameters())
    assert len(seen) == len(set(seen))
    block = (d * d + d) * 4
    assert block * 0.9 <= peak <= 2 * block, (peak, block)


def test_a_constant_from_python_data_is_replayed():
    class Constant(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.tensor([1.0, 2.0, 3.0]) * 2)

    _, got = _replayed(Constant)
    assert torch.equal(got["buffer:table"], torch.tensor([2.0, 4.0, 6.0]))


def test_a_parameter_left_empty_is_not_replayable():
    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3))

    _, record = build_recorded(Empty)
    assert not record.replayable and "w is allocated but never filled" in record.reason


def _laid_out_from_the_record(rank, world, out_dir):
    import json

    from gearshift import strategies
    from gearshift.strategies.layout import Layout
    from gearshift.strategies.state import full
    from gearshift.workers.build.meta_init import fill
    from gearshift.workers.build.models import gpt

    build = lambda: gpt(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)  # noqa: E731
    torch.manual_seed(11)
    plain = build()
    out = {}
    for strategy in ("fsdp", "tensor"):
        torch.manual_seed(11)
        model, record = build_recorded(build)
        layout = Layout.for_workers(strategy, world, None)
        plan = model.tp_plan(world) if strategy == "tensor" else None
        par = strategies.parallelize(model, layout, plan, strategies.Options(torch.device("cpu")))
        torch.manual_seed(11)
        fill(par.model, record, torch.device("cpu"))
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in par.model.parameters())
        diff = max(float((full(p.detach()) - dict(plain.named_parameters())[n]).abs().max())
                   for n, p in par.model.named_parameters())
        out[strategy] = {"diff": diff, "local": local, "total": sum(p.numel() for p in plain.parameters())}
    (out_dir / f"laid-{rank}.json").write_text(json.dumps(out))


def test_fsdp_and_tensor_layouts_filled_from_the_record_equal_the_plain_build(tmp_path):
    import json

    from test_fsdp import spawn_gloo

    spawn_gloo(_laid_out_from_the_record, 2, (tmp_path,))
    for rank in range(2):
        got = json.loads((tmp_path / f"laid-{rank}.json").read_text())
        for strategy, r in got.items():
            assert r["diff"] == 0.0, (strategy, r)
            assert r["local"] < 0.75 * r["total"], (strategy, r)  # this rank holds pieces, not the model


def test_tensors_left_to_pretrained_weights_are_not_made_and_draw_nothing():
    """A replay that skips every random tensor (pretrained weights give them) draws no random
    number at all, makes the RoPE table it keeps exactly, and hands over nothing it skipped."""
    torch.manual_seed(3)
    plain = Tied()
    torch.manual_seed(3)
    _, record = build_recorded(Tied)
    skip = {name for name in record.finals if not name.startswith("buffer:")}
    got = {}
    torch.manual_seed(3)
    before = torch.default_generator.get_state()
    materialise(record, lambda name, value: got.__setitem__(name, value.clone()), skip)
    assert torch.equal(torch.default_generator.get_state(), before)  # not one number drawn
    assert set(got) == {"buffer:rope.cos", "buffer:rope.sin"}
    assert torch.equal(got["buffer:rope.cos"], plain.rope.cos) and torch.equal(got["buffer:rope.sin"], plain.rope.sin)


def test_a_kept_tensor_drawn_after_skipped_ones_still_gets_the_plain_builds_numbers():
    """`scale`'s truncated normal comes before the second pass's draws: skipped, it is still drawn
    (into scratch), so every value kept equals the plain build's."""
    torch.manual_seed(3)
    plain = Tied()
    torch.manual_seed(3)
    _, record = build_recorded(Tied)
    got = {}
    torch.manual_seed(3)
    materialise(record, lambda name, value: got.__setitem__(name, value.clone()), {"scale"})
    want = {n: p for n, p in plain.named_parameters() if n != "scale"}
    assert "scale" not in got and set(want) <= set(got)
    for name, value in want.items():
        assert torch.equal(got[name], value), name
