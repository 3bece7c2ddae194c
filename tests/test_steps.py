"""The step's variants (workers/step/steps.py): which one a layout gets, and that taking a share in
micro-batches leaves the same gradients and mean loss as taking it at once. Pure logic, no
process group."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from gearshift.workers.step import steps


class _Layout:  # a Parallel as far as the variants see it
    def __init__(self, model, step_variant=None):
        self.module = self.model = model
        if step_variant is not None:
            self.step_variant = step_variant

    def no_sync(self):
        return contextlib.nullcontext()


def _runner(model, accumulation):
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    w = types.SimpleNamespace(parallel=_Layout(model), scaler=scaler, accumulation=accumulation,
                              device=torch.device("cpu"))
    runner = types.SimpleNamespace(w=w)
    runner.forward_loss = lambda x, y, rows=None: torch.nn.functional.mse_loss(model(x), y)
    return runner


def test_a_layout_without_its_own_step_gets_plain_or_accumulated():
    assert steps.choose(_Layout(None), 1) is steps.plain
    assert steps.choose(_Layout(None), 4) is steps.accumulated
    assert steps.choose(_Layout(None, "accumulated"), 1) is steps.accumulated


def test_an_unknown_variant_is_named_with_the_ones_there_are():
    with pytest.raises(ValueError, match=r"step_variant is 'zigzag': the step variants are \['accumulated', 'pipelined', 'plain', 'uneven'\]"):
        steps.choose(_Layout(None, "zigzag"), 1)


@pytest.mark.parametrize("n", [2, 4])
def test_micro_batches_give_the_gradients_and_loss_of_the_whole_share(n):
    torch.manual_seed(0)
    x, y = torch.randn(8, 5), torch.randn(8, 3)
    whole, parts = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    parts.load_state_dict(whole.state_dict())
    loss_whole = steps.plain(_runner(whole, 1), x, y)
    loss_parts = steps.accumulated(_runner(parts, n), x, y)
    assert torch.allclose(loss_whole, loss_parts, atol=1e-6)
    for a, b in zip(whole.parameters(), parts.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    # and each against plain autograd on the same batch
    ref = torch.nn.Linear(5, 3)
    ref.load_state_dict(whole.state_dict())
    torch.nn.functional.mse_loss(ref(x), y).backward()
    assert all(torch.allclose(a.grad, r.grad, atol=1e-6) for a, r in zip(parts.parameters(), ref.parameters()))
