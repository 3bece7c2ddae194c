"""The job file model: defaults, shorthands, overrides, fingerprints and resume rules."""

from __future__ import annotations

import pathlib

import pytest
import yaml

from gearshift.orchestrator.job import JobError, apply_overrides, job_from_dict, load_job
from gearshift.orchestrator.records.rundir import resume_conflicts

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["mlp", "gpt", "gpt-fsdp"])
def test_examples_load_and_round_trip(name):
    job = load_job(ROOT / "examples" / f"{name}.yaml")
    assert job.name == name and job.model.name == name.split("-")[0]
    again = job_from_dict(yaml.safe_load(yaml.safe_dump(job.to_dict())), job.base_dir)
    assert again == job and again.fingerprint() == job.fingerprint()


def test_overrides_parse_as_yaml():
    job = load_job(ROOT / "examples/mlp.yaml", ["optimizer.betas=[0.8, 0.9]", "model.kwargs={hidden: 64}",
                                                  "optimizer.lr=1e-2", "train.grad_clip=null"])
    assert job.optimizer.betas == (0.8, 0.9)
    assert job.model.kwargs == {"hidden": 64}  # a mapping replaces the mapping
    assert job.optimizer.lr == pytest.approx(0.01)  # YAML 1.1 reads 1e-2 as text; it is a number here
    assert job.train.grad_clip is None


def test_shorthands_and_defaults(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text("model: gpt\nloss: cross_entropy\n")
    job = load_job(path)
    assert job.name == "tiny"  # from the file name
    assert job.model.name == "gpt" and job.loss.name == "cross_entropy" and job.data.name is None
    assert job.parallel.strategy == "data" and job.cluster.num_workers == 2
    raw = apply_overrides({"model": "gpt"}, ["model.kwargs.n_layer=1"])
    assert raw["model"] == {"name": "gpt", "kwargs": {"n_layer": 1}}


def test_fingerprint_tracks_what_changes_the_result():
    base = load_job(ROOT / "examples/mlp.yaml")
    renamed = load_job(ROOT / "examples/mlp.yaml", ["name=other"])
    changed = load_job(ROOT / "examples/mlp.yaml", ["optimizer.lr=0.5"])
    assert base.fingerprint() == renamed.fingerprint()
    assert base.fingerprint() != changed.fingerprint()


def test_resume_allows_only_length_and_cadence_changes():
    base = load_job(ROOT / "examples/mlp.yaml")
    longer = load_job(ROOT / "examples/mlp.yaml", ["train.steps=900", "checkpoint.every=7",
                                                     "parallel.strategy=tensor", "cluster.num_workers=4"])
    other = load_job(ROOT / "examples/mlp.yaml", ["optimizer.lr=0.5", "model.kwargs={hidden: 8}"])
    assert resume_conflicts(base, longer) == []
    conflicts = resume_conflicts(base, other)
    assert any(c.startswith("optimizer.lr") for c in conflicts)
    assert any(c.startswith("model.kwargs") for c in conflicts)


def test_error_carries_field_value_and_allowed():
    with pytest.raises(JobError) as info:
        load_job(ROOT / "examples/mlp.yaml", ["cluster.placement=scatter"])
    err = info.value
    assert (err.field_path, err.value) == ("cluster.placement", "scatter")
    assert "'pack', 'spread'" in err.allowed and "mlp.yaml" in str(err)


def test_the_job_knows_the_built_in_strategies_without_importing_torch():
    from gearshift import strategies
    from gearshift.orchestrator.job import BUILTIN_STRATEGIES

    assert BUILTIN_STRATEGIES == strategies.builtin_names()


def test_checking_a_job_imports_neither_torch_dynamo_nor_dtensor():
    """The driver checks a job (and a data-parallel worker imports its code) without
    torch._dynamo (1.4 s of CPU) or torch.distributed.tensor (0.7 s): start-up is CPU-bound."""
    import subprocess
    import sys

    code = ("import sys; from gearshift.orchestrator.job import load_job; load_job('examples/gpt.yaml'); "
            "load_job('examples/mlp.yaml'); import gearshift.workers.worker; "
            "print(sorted(m for m in ('torch', 'torch._dynamo', 'torch.distributed.tensor') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['torch']", done.stdout


@pytest.mark.parametrize("limit", [0, 10**9], ids=["on-meta", "on-real-tensors"])
def test_a_model_that_does_not_fit_its_data_is_refused_on_meta_and_real_tensors(monkeypatch, limit):
    from gearshift.workers.build import components

    monkeypatch.setattr(components, "REAL_CHECK_PARAMS", limit)
    components.check_builtin_fit({"name": "gpt", "kwargs": {}}, {"name": "chars", "kwargs": {}})
    with pytest.raises(components.ComponentError, match="do not fit model 'mlp'"):
        components.check_builtin_fit({"name": "mlp", "kwargs": {}}, {"name": "chars", "kwargs": {}})


def test_meta_builds_skip_the_initialisers_in_their_own_thread_only():
    """on_meta() swaps torch.nn.init's functions for the whole process; another thread building
    a real model meanwhile must still get initialised weights."""
    import threading

    import torch
    from torch import nn

    from gearshift.workers.build import components

    original = nn.init.kaiming_uniform_
    inside, built, out = threading.Event(), threading.Event(), {}

    def build_elsewhere():
        inside.wait(10)
        torch.manual_seed(0)
        out["weight"] = nn.Linear(16, 16).weight.detach().clone()
        built.set()

    thread = threading.Thread(target=build_elsewhere)
    thread.start()
    with components.on_meta():
        meta = nn.Linear(16, 16)
        inside.set()
        assert built.wait(10)
    thread.join(10)
    torch.manual_seed(0)
    assert meta.weight.is_meta and torch.equal(out["weight"], nn.Linear(16, 16).weight)
    assert nn.init.kaiming_uniform_ is original
