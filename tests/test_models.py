"""Built-in models: activation checkpointing really recomputes; the plans they ship."""

from __future__ import annotations

import pytest
import torch

from gearshift.strategies.tp_plan import PlanError, resolve
from gearshift.workers.build.models import gpt, mlp


@pytest.mark.parametrize("build,make_input,block", [
    (lambda ac: gpt(n_layer=2, n_embd=32, n_head=4, block_size=16, activation_checkpointing=ac),
     lambda: torch.randint(0, 128, (2, 16)), lambda m: m.blocks[0]),
    (lambda ac: mlp(hidden=32, layers=2, activation_checkpointing=ac),
     lambda: torch.randn(2, 784), lambda m: m.hidden[0]),
])
def test_activation_checkpointing_recomputes_in_backward(build, make_input, block):
    for recompute, forwards in ((False, 1), (True, 2)):
        torch.manual_seed(0)
        model = build(recompute)
        calls = []
        block(model).register_forward_pre_hook(lambda *a: calls.append(1))  # the recompute may stop early
        model(make_input()).sum().backward()
        assert len(calls) == forwards


def test_builtin_plans_resolve_and_check_divisibility():
    g = gpt(n_layer=2, n_embd=64, n_head=4)
    names = resolve(g, g.tp_plan(4), 4)
    assert names["blocks.1.attn.q"] == "colwise" and names["blocks.0.mlp.proj"] == "rowwise"
    assert len(names) == 12  # six per block
    with pytest.raises(ValueError, match=r"n_head\(4\) % tp\(8\) = 4"):
        g.tp_plan(8)
    m = mlp(hidden=30)
    with pytest.raises(PlanError, match=r"hidden.0 \(colwise\): out_features\(30\) % tp\(4\) = 2"):
        resolve(m, m.tp_plan(4), 4)
    assert mlp(layers=2).tp_plan(2) == {"hidden.0": "colwise", "hidden.1": "rowwise"}
