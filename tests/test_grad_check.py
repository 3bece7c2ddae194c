"""train.grad_check: per-parameter gradient norms on the asked steps; a NaN/Inf or exploding one is
a grad_anomaly record naming the module and parameter, with a diagnosis."""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import pytest
import torch
from torch import nn

import gearshift
from gearshift.workers.step.grad_check import GradCheck, param_norms

ROOT = pathlib.Path(__file__).resolve().parents[1]


class _Scaler:
    def is_enabled(self):
        return False


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _backward(model, scale=1.0, x=None):
    model.zero_grad()
    x = torch.randn(5, 4) if x is None else x
    (model(x).pow(2).sum() * scale).backward()
    return x


def test_norms_are_each_parameters_gradient_norm():
    model = _model()
    _backward(model)
    norms = param_norms(model)
    assert list(norms) == [n for n, _ in model.named_parameters()]
    for n, p in model.named_parameters():
        assert math.isclose(norms[n], float(p.grad.norm()), rel_tol=1e-5)


def test_an_exploding_weight_is_named_with_the_learning_rate_and_its_initial_range():
    model = _model()
    check = GradCheck({"every": 1, "explode_ratio": 100}, model)
    for step in range(5):
        _backward(model)
        check.check(step, model, torch.tensor(1.0), 0.01, _Scaler(), range(step * 5, step * 5 + 5))
    assert check.take() == []
    _backward(model)
    model[2].weight.grad *= 1e4  # one layer's gradient blows up
    check.check(5, model, torch.tensor(1.0), 0.01, _Scaler(), range(25, 30))
    [found] = check.take()
    assert (found["module"], found["parameter"], found["kind"], found["step"]) == ("2", "weight", "explode", 6)
    assert found["ratio"] > 100 and found["samples"] is None  # the loss did not jump: not the data
    assert "initial range (it started with std" in found["suggestions"][0] and "now 0.01" in found["suggestions"][0]


def test_a_nan_in_a_norm_and_a_loss_spike_point_at_the_normalisation_and_the_batch():
    model = _model()
    check = GradCheck({"every": 1}, model)
    for step in range(4):
        _backward(model)
        check.check(step, model, torch.tensor(1.0), 0.1, _Scaler(), [step])
    _backward(model)
    model[1].bias.grad[0] = float("nan")
    check.check(4, model, torch.tensor(50.0), 0.1, _Scaler(), [7, 8, 9])
    [found] = check.take()
    assert (found["module"], found["module_type"], found["parameter"], found["kind"]) == \
        ("1", "LayerNorm", "bias", "nonfinite")
    assert "a normalisation's bias" in found["suggestions"][0]
    assert found["samples"] == [7, 8, 9] and "samples [7, 8, 9]" in found["suggestions"][-1]


@pytest.mark.parametrize("value,words", [({"every": 0}, "every"), ({"explode_ratio": 1}, "more than 1"),
                                         ({"each": 3}, "{every: N, explode_ratio: R}")])
def test_bad_settings_say_what_is_allowed(value, words):
    with pytest.raises(gearshift.JobError, match="train.grad_check") as err:
        gearshift.load_job(ROOT / "examples" / "mlp.yaml", {"train.grad_check": value})
    assert words in str(err.value)


def test_a_layer_that_explodes_in_a_run_is_named_at_that_step(local_workers, tmp_path):
    shutil.copy(ROOT / "tests" / "fixtures" / "inspected.py", tmp_path / "inspected.py")
    shutil.copy(ROOT / "tests" / "fixtures" / "user_model.py", tmp_path / "user_model.py")
    job = tmp_path / "job.yaml"
    job.write_text("name: boom\nmodel: {entrypoint: 'inspected:exploding', kwargs: {at_step: 8}}\n"
                   "data: {entrypoint: 'user_model:waves', kwargs: {size: 256}}\nloss: mse\n"
                   "optimizer: {name: sgd, lr: 0.001}\n"
                   "train: {steps: 10, global_batch_size: 16, grad_check: {every: 1, explode_ratio: 100}}\n"
                   "cluster: {num_workers: 2}\ncheckpoint: {every: 0}\n")
    gearshift.run(job, run_dir=tmp_path / "run")
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    found = [r for r in records if r.get("event") == "grad_anomaly"]
    assert found and found[0]["step"] == 8, found  # within one check
    assert (found[0]["module"], found[0]["parameter"], found[0]["kind"]) == ("boom", "weight", "explode")
    assert found[0]["ratio"] > 100 and found[0]["lr"] == pytest.approx(0.001)
    from gearshift.monitoring.report import _load, format_summary, summarise

    text = format_summary(summarise(_load(tmp_path / "run"), tmp_path / "run"))
    assert "grad anomaly" in text and "step 8: boom.weight" in text  # `gearshift report` says it too
