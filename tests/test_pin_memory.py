"""data.loader.pin_memory: auto by default (on where the worker has a GPU), an explicit true or
false kept, anything else refused with the field named."""

from __future__ import annotations

import pathlib

import pytest
import torch

from gearshift.orchestrator.job import JobError, load_job
from gearshift.workers.config import WorkerConfig
from gearshift.workers.step.loader import pin_memory

ROOT = pathlib.Path(__file__).resolve().parents[1]
CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)  # a device value only: nothing runs on it


def test_auto_pins_on_a_gpu_worker_only():
    assert pin_memory("auto", GPU) is True
    assert pin_memory("auto", CPU) is False


def test_an_explicit_setting_is_kept():
    assert pin_memory(False, GPU) is False
    assert pin_memory(True, GPU) is True
    assert pin_memory(True, CPU) is False  # page-locking speeds up copies to a GPU only
    with pytest.raises(ValueError, match="must be true, false or 'auto'"):
        pin_memory("yes", GPU)


def test_the_job_defaults_to_auto_and_the_worker_is_told():
    job = load_job(ROOT / "examples/mlp.yaml")
    assert job.data.loader.pin_memory == "auto"
    assert WorkerConfig.from_job(job.to_dict()).loader["pin_memory"] == "auto"
    job = load_job(ROOT / "examples/mlp.yaml", ["data.loader.pin_memory=false"])
    assert WorkerConfig.from_job(job.to_dict()).loader["pin_memory"] is False
    assert load_job(ROOT / "examples/mlp.yaml", ["data.loader.pin_memory=true"]).data.loader.pin_memory is True


def test_a_bad_value_names_the_field_and_what_is_allowed():
    with pytest.raises(JobError, match=r"data.loader.pin_memory = 'sometimes' is not valid: must be true, false "
                                       r"or 'auto'"):
        load_job(ROOT / "examples/mlp.yaml", ["data.loader.pin_memory=sometimes"])


def test_the_schema_allows_what_the_checker_does():
    from gearshift.orchestrator.job.schema import job_schema

    data = next(f for f in job_schema()["properties"]["data"]["anyOf"] if "properties" in f)  # the mapping form
    fragment = data["properties"]["loader"]["properties"]["pin_memory"]
    assert fragment["default"] == "auto"
    assert {"type": "boolean"} in fragment["anyOf"] and {"type": "string", "enum": ["auto"]} in fragment["anyOf"]
