"""train.activation_checkpointing for any model (workers/build/recompute.py): the chosen modules run
forward again in backward, the gradients are exactly those without it, names stay the same."""

from __future__ import annotations

import torch
from torch import nn

from gearshift.workers.build import recompute


class Blocks(nn.Module):
    _no_split_modules = ["Layer"]

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(Layer() for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.drop = nn.Dropout(0.3)  # recomputation must draw the same mask
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + self.drop(torch.tanh(self.fc(x)))


def _grads(model, x):
    torch.manual_seed(7)
    model(x).square().sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_true_checkpoints_the_units_and_changes_no_gradient():
    torch.manual_seed(0)
    plain = Blocks()
    torch.manual_seed(0)
    wrapped = Blocks()
    names = recompute.apply(wrapped, True)
    assert names == ["layers.0", "layers.1", "layers.2"]
    assert [n for n, _ in wrapped.named_parameters()] == [n for n, _ in plain.named_parameters()]
    x = torch.randn(5, 6)
    want, got = _grads(plain, x), _grads(wrapped, x)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert [layer.calls for layer in wrapped.layers] == [2, 2, 2]  # forward, then again in backward
    assert [layer.calls for layer in plain.layers] == [1, 1, 1]
    wrapped.eval()
    with torch.no_grad():
        wrapped(x)
    assert [layer.calls for layer in wrapped.layers] == [3, 3, 3]  # evaluation: once


def test_patterns_choose_by_name_or_class_and_a_builtin_with_true_is_left_to_itself():
    model = Blocks()
    assert recompute.chosen(model, ["layers.1", "head"]) == ["layers.1", "head"]
    assert recompute.chosen(model, ["Layer"]) == ["layers.0", "layers.1", "layers.2"]
    assert recompute.chosen(model, ["layers.*"]) == ["layers.0", "layers.1", "layers.2"]  # not layers.0.fc
    assert recompute.chosen(model, True, builtin=True) == [] and recompute.chosen(model, False) == []
