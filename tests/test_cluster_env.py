"""cluster.env: environment variables set in every worker before any process group exists. The
checker and the actor options as logic; one short Ray run in which every worker reports them."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest

from gearshift.orchestrator.cluster.worker_group import with_env
from gearshift.orchestrator.job import JobError, load_job
from gearshift.orchestrator.job.schema import job_schema

ROOT = pathlib.Path(__file__).resolve().parents[1]
MLP = ROOT / "examples/mlp.yaml"


def test_names_and_values_are_checked_and_values_become_strings():
    job = load_job(MLP, {"cluster.env": {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": 1, "_X2": 0.5}})
    assert job.cluster.env == {"NCCL_DEBUG": "INFO", "NCCL_IB_DISABLE": "1", "_X2": "0.5"}
    assert load_job(MLP).cluster.env == {}
    assert load_job(MLP, {"cluster.env": None}).cluster.env == {}


@pytest.mark.parametrize("env, field, says", [
    ({"1NCCL": "x"}, "cluster.env.1NCCL", "not an environment variable name"),
    ({"NCCL-DEBUG": "x"}, "cluster.env.NCCL-DEBUG", "letters, digits and '_'"),
    ({"A=B": "x"}, "cluster.env.A=B", "not an environment variable name"),
    ({"NCCL_DEBUG": True}, "cluster.env.NCCL_DEBUG", "must be a string or a number"),
    ({"NCCL_DEBUG": None}, "cluster.env.NCCL_DEBUG", "must be a string or a number"),
    ({"NCCL_DEBUG": ["a"]}, "cluster.env.NCCL_DEBUG", "must be a string or a number"),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, "cluster.env.CUDA_VISIBLE_DEVICES", "set by Ray"),
    (["NCCL_DEBUG=INFO"], "cluster.env", "must be a mapping of environment variable names"),
])
def test_a_bad_env_names_the_field_the_value_and_what_is_allowed(env, field, says):
    with pytest.raises(JobError) as err:
        load_job(MLP, {"cluster.env": env})
    assert err.value.field == field and says in str(err.value), str(err.value)


def test_the_schema_offers_names_and_string_or_number_values():
    env = job_schema()["properties"]["cluster"]["properties"]["env"]
    assert env["additionalProperties"] == {"type": ["string", "number"]}
    assert env["propertyNames"]["pattern"] == r"^[A-Za-z_][A-Za-z0-9_]*$"


def test_the_job_env_joins_what_the_actor_options_already_set():
    options = {"num_cpus": 1, "runtime_env": {"env_vars": {"KEEP": "1", "NCCL_DEBUG": "WARN"}, "pip": ["x"]}}
    out = with_env(options, {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"})
    assert out["runtime_env"] == {"env_vars": {"KEEP": "1", "NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "eth0"},
                                  "pip": ["x"]}
    assert options["runtime_env"]["env_vars"]["NCCL_DEBUG"] == "WARN"  # the caller's options are left alone
    assert with_env({"num_cpus": 1}, {}) == {"num_cpus": 1}  # no env: no runtime_env (no new worker processes)


@pytest.mark.ray
def test_every_worker_sees_the_job_env_when_it_builds(ray_cluster, tmp_path):
    from test_train_equivalence import run_gearshift

    shutil.copy(ROOT / "tests/fixtures/env_model.py", tmp_path / "env_model.py")
    job = tmp_path / "mlp.yaml"
    shutil.copy(MLP, job)
    names = ["GEARSHIFT_TEST_FLAG", "NCCL_DEBUG", "GEARSHIFT_TEST_UNSET"]
    kwargs = {**load_job(MLP).model.kwargs, "names": names, "out": str(tmp_path / "env")}
    overrides = ["train.steps=2", "train.global_batch_size=16", "checkpoint.every=0", "cluster.num_workers=2",
                 f"model={{entrypoint: 'env_model:env_reporting_mlp', kwargs: {json.dumps(kwargs)}}}",
                 "cluster.env={GEARSHIFT_TEST_FLAG: 42, NCCL_DEBUG: INFO}"]
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done"
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"env.rank{rank}").read_text())
        assert seen == {"GEARSHIFT_TEST_FLAG": "42", "NCCL_DEBUG": "INFO", "GEARSHIFT_TEST_UNSET": None}, (rank, seen)
