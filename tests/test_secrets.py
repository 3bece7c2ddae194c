"""Secrets stay secret: `${VAR}` is read from the environment, never written; credentials are
masked in job.yaml, MLflow, TensorBoard, logs, errors and `gearshift check`, left out of the
fingerprint; replay and --resume read them again and say which are missing."""

from __future__ import annotations

import json
import logging
import pathlib
import secrets as random_secrets
import shutil

import pytest
import yaml

from gearshift import api
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import JobError, dump_job, job_from_dict, load_job
from gearshift.orchestrator.job import credentials, secrets
from gearshift.orchestrator.records.rundir import RunDir, resume_conflicts

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def _job(**sections) -> dict:
    return {"model": "mlp", "train": {"steps": 2, "global_batch_size": 8}, "cluster": {"num_workers": 1},
            **sections}


# ----------------------------------------------------------------------------- expansion, no Ray


def test_references_are_read_from_the_environment_with_defaults_and_escapes():
    env = {"A": "one", "EMPTY": ""}
    resolved, refs = secrets.expand({"x": "${A}", "y": "pre-${A}-${B:-two}", "z": "${EMPTY:-dflt}",
                                     "w": "$${A} and a $ sign", "n": 3, "l": ["${A}", "plain"]}, env)
    assert resolved == {"x": "one", "y": "pre-one-two", "z": "dflt", "w": "${A} and a $ sign", "n": 3,
                        "l": ["one", "plain"]}
    assert refs == {("x",): "${A}", ("y",): "pre-${A}-${B:-two}", ("z",): "${EMPTY:-dflt}",
                    ("w",): "$${A} and a $ sign", ("l", 0): "${A}"}


def test_an_unset_variable_is_one_line_naming_the_field_and_the_variable(monkeypatch):
    monkeypatch.delenv("GS_NOT_SET", raising=False)
    with pytest.raises(JobError) as err:
        job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_NOT_SET}"}}))
    text = str(err.value)
    assert err.value.field == "checkpoint.storage_options.key" and "GS_NOT_SET" in text
    assert "not set" in text and "${GS_NOT_SET:-value}" in text and "\n" not in text


def test_a_malformed_reference_is_an_error_naming_the_field():
    with pytest.raises(JobError, match=r"cluster.env.X = .* malformed reference"):
        job_from_dict(_job(cluster={"num_workers": 1, "env": {"X": "${1BAD}"}}))


def test_which_fields_are_credentials():
    yes = [("checkpoint", "storage_options", "endpoint_url"), ("cluster", "env", "NCCL_DEBUG"),
           ("model", "kwargs", "hf_token"), ("data", "kwargs", "API_KEY"), ("x", "Password"),
           ("checkpoint", "storage_options", "client_kwargs", "aws_secret_access_key")]
    no = [("model", "kwargs", "tokenizer"), ("checkpoint", "storage_options"), ("train", "steps"),
          ("checkpoint", "keep")]
    assert all(credentials.is_credential(p) for p in yes) and not any(credentials.is_credential(p) for p in no)
    assert credentials.mask_url("http://me:pw@host:5000/x") == "http://me:***@host:5000/x"
    assert credentials.mask_url("http://me:${PW}@host") == "http://me:${PW}@host"
    assert credentials.scrub("failed: https://me:pw@host/a (x)") == "failed: https://me:***@host/a (x)"


def test_the_written_job_keeps_references_masks_typed_credentials_and_the_code_gets_the_values(monkeypatch):
    monkeypatch.setenv("GS_KEY", "the-key-value")
    monkeypatch.delenv("GS_UNSET", raising=False)
    job = job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_KEY}", "secret": "typed-secret",
                                                             "anon": False, "region": "${GS_UNSET:-eu-1}"}},
                             cluster={"num_workers": 1, "env": {"HF_TOKEN": "${GS_KEY}", "NCCL_DEBUG": "INFO"}},
                             model="${GS_UNSET:-mlp}"))
    assert job.checkpoint.storage_options == {"key": "the-key-value", "secret": "typed-secret", "anon": False,
                                              "region": "eu-1"}
    assert job.cluster.env == {"HF_TOKEN": "the-key-value", "NCCL_DEBUG": "INFO"} and job.model.name == "mlp"
    written = yaml.safe_load(dump_job(job))
    # a default typed into a credential is a typed credential: masked with it
    assert written["checkpoint"]["storage_options"] == {"key": "${GS_KEY}", "secret": "***", "anon": False,
                                                        "region": "${GS_UNSET:-***}"}
    assert written["cluster"]["env"] == {"HF_TOKEN": "${GS_KEY}", "NCCL_DEBUG": "***"}
    assert written["model"] == "${GS_UNSET:-mlp}"  # a shorthand typed as a reference goes back as one
    assert "the-key-value" not in dump_job(job) and "typed-secret" not in dump_job(job)
    # rebuilt with overrides (the Python API), the references are read and kept again
    again = api.load_job(job, {"train.steps": 3})
    assert again.checkpoint.storage_options["key"] == "the-key-value"
    assert yaml.safe_load(dump_job(again))["checkpoint"]["storage_options"]["key"] == "${GS_KEY}"


def test_a_bad_credential_is_named_but_never_shown():
    with pytest.raises(JobError) as err:
        job_from_dict(_job(model={"name": "mlp", "kwargs": {"hf_token": "hunter2-secret"}}))
    assert "model.kwargs.hf_token" in str(err.value) and "hunter2" not in str(err.value)
    assert err.value.value == "***"


def test_a_rotated_credential_keeps_the_fingerprint_a_changed_value_does_not(monkeypatch):
    def fingerprint(key, strategy="data"):
        monkeypatch.setenv("GS_KEY", key)
        monkeypatch.setenv("GS_STRATEGY", strategy)
        return job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_KEY}", "secret": key}},
                                  cluster={"num_workers": 1, "env": {"WANDB_API_KEY": key}},
                                  data={"name": "synthetic_digits", "kwargs": {"api_token": key}},
                                  parallel={"strategy": "${GS_STRATEGY}"})).fingerprint()

    monkeypatch.setattr("gearshift.orchestrator.job.load.check_job", lambda job: None)
    assert fingerprint("old-key") == fingerprint("new-key")
    assert fingerprint("k", "data") != fingerprint("k", "tensor")  # a value read for ${VAR} is the job's


def test_resume_compares_the_written_jobs_without_credentials(monkeypatch):
    monkeypatch.setenv("GS_KEY", "one")
    a = job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_KEY}", "secret": "typed"}}))
    b = job_from_dict(_job(checkpoint={"storage_options": {"key": "rotated", "secret": "other"}}))
    assert resume_conflicts(a, b) == []
    c = job_from_dict(_job(train={"steps": 2, "global_batch_size": 16}))
    conflicts = resume_conflicts(a, c)
    assert conflicts == ["train.global_batch_size: 8 -> 16"]


# ----------------------------------------------------------------------------- replay and --resume, no Ray


def _recorded_run(tmp_path, monkeypatch) -> RunDir:
    monkeypatch.setenv("GS_S3_KEY", "key-from-env")
    job = job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_S3_KEY}", "secret": "typed-secret"}}))
    return RunDir.create(job, root=str(tmp_path / "runs"))


def test_resume_from_the_run_dir_says_which_credentials_are_missing(tmp_path, monkeypatch, capsys):
    run = _recorded_run(tmp_path, monkeypatch)
    with pytest.raises(JobError) as err:
        api.run(resume=run.path)
    text = str(err.value)
    assert "checkpoint.storage_options.secret" in text and "typed into the job file" in text
    assert "--set 'checkpoint.storage_options.secret=${VAR}'" in text
    monkeypatch.delenv("GS_S3_KEY")
    with pytest.raises(JobError, match=r"checkpoint.storage_options.key .*GS_S3_KEY, which is not set"):
        api.run(resume=run.path, overrides=["checkpoint.storage_options.secret=${GS_S3_SECRET:-x}"])
    # given again, the job loads (and the values are the ones read now)
    monkeypatch.setenv("GS_S3_KEY", "key-now")
    monkeypatch.setenv("GS_S3_SECRET", "secret-now")
    job = run.load_job(["checkpoint.storage_options.secret=${GS_S3_SECRET}"])
    assert job.checkpoint.storage_options == {"key": "key-now", "secret": "secret-now"}


def test_replay_says_which_are_missing_and_takes_them_with_set(tmp_path, monkeypatch, capsys):
    run = _recorded_run(tmp_path, monkeypatch)
    assert cli.main(["replay", str(run.path), "--run-dir", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.storage_options.secret" in err and "typed-secret" not in err
    started = []
    monkeypatch.setattr(api, "train", lambda job, new, resume, **kw: started.append(job))
    monkeypatch.setenv("GS_S3_SECRET", "secret-now")
    assert cli.main(["replay", str(run.path), "--run-dir", str(tmp_path / "again"),
                     "--set", "checkpoint.storage_options.secret=${GS_S3_SECRET}"]) == 0
    assert started[0].checkpoint.storage_options == {"key": "key-from-env", "secret": "secret-now"}
    assert "secret-now" not in (tmp_path / "again" / "job.yaml").read_text()


def test_check_output_masks_credentials(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("GS_TOKEN", "tok-" + random_secrets.token_hex(8))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job(cluster={"num_workers": 1, "env": {"HF_TOKEN": "${GS_TOKEN}",
                                                                            "WANDB_API_KEY": "typed-key"}})))
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "HF_TOKEN: ${GS_TOKEN}" in out and "WANDB_API_KEY: '***'" in out
    assert "typed-key" not in out and "tok-" not in out


# ----------------------------------------------------------------------------- submit, no Ray


@pytest.fixture
def submitted(tmp_path, monkeypatch):
    """A job file to submit, and the Submissions that reach the Job Submission API (none is sent)."""
    from gearshift.orchestrator.cluster import jobs_api

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_job()))
    sent = []
    monkeypatch.setattr(jobs_api, "send_submission", lambda address, sub: sent.append(sub) or sub.submission_id)
    return path, sent


@pytest.mark.parametrize("overrides", [
    ["checkpoint.storage_options.secret=SECRET"],                      # --set, a credential typed
    {"checkpoint.storage_options": {"key": "${GS_S3_KEY}", "secret": "SECRET"}},  # the Python API's mapping
    ["cluster.env.HF_TOKEN=${GS_S3_KEY:-SECRET}"],                     # a default typed into a credential
    {"tracking.mlflow.tracking_uri": "https://me:SECRET@mlflow.internal"},  # a URL's password
])
def test_submit_refuses_a_credential_in_clear_naming_the_field_never_the_value(submitted, monkeypatch, capsys,
                                                                                overrides):
    path, sent = submitted
    planted = "gs-typed-" + random_secrets.token_hex(8)
    monkeypatch.setenv("GS_S3_KEY", "key-" + random_secrets.token_hex(8))
    overrides = (json.loads(json.dumps(overrides).replace("SECRET", planted)))
    with pytest.raises(JobError) as err:
        api.submit(path, address="http://127.0.0.1:1", overrides=overrides)
    text = str(err.value)
    assert planted not in text and planted not in repr(err.value.value) and "\n" not in text
    assert err.value.field.split(".")[0] in ("checkpoint", "cluster", "tracking")
    assert "hidden" in text and "${VAR}" in text and sent == []
    if isinstance(overrides, list):  # the command: exit 2, the same line, nothing sent
        assert cli.main(["submit", str(path), "--address", "http://127.0.0.1:1", "--set", overrides[0]]) == 2
        said = capsys.readouterr()
        assert err.value.field in said.err and planted not in said.out + said.err and sent == []


def test_a_submitted_reference_travels_as_typed_and_no_value_reaches_the_ray_job(submitted, monkeypatch):
    path, sent = submitted
    key, token = "key-" + random_secrets.token_hex(8), "tok-" + random_secrets.token_hex(8)
    monkeypatch.setenv("GS_S3_KEY", key)
    monkeypatch.setenv("GS_TOKEN", token)
    api.submit(path, address="http://127.0.0.1:1",
               overrides=["checkpoint.storage_options.key=${GS_S3_KEY}", "cluster.env.HF_TOKEN=${GS_TOKEN}",
                          "train.steps=3"])
    [sub] = sent
    # what `ray job list` and the dashboard show: the entrypoint, the runtime_env, the metadata
    shown = json.dumps([sub.entrypoint, sub.runtime_env, sub.metadata])
    assert key not in shown and token not in shown
    assert "checkpoint.storage_options.key=\"${GS_S3_KEY}\"" in sub.entrypoint  # read on the head, as the file's are
    assert "cluster.env.HF_TOKEN=\"${GS_TOKEN}\"" in sub.entrypoint and "train.steps=3" in sub.entrypoint


# ----------------------------------------------------------------------------- what a worker says, no Ray


class _Saying:
    """A worker group whose workers say `text`: in a call's result, in a report, and as a failure."""

    def __init__(self, text):
        self.text = text

    def call(self, method, *args):
        return [{"why": self.text, "seconds": 1.0}, {"rank": 1}]

    def put(self, value):
        return value

    def train(self, until, every, last_step=None, stoppable=False):
        yield 0, {"step_failed": {"step": 3, "message": self.text}, "losses": [1.0]}
        raise WorkerFailed(1, f"OSError: {self.text}", details=f"Traceback ...\nOSError: {self.text}",
                           cause=OSError(self.text))


def test_what_a_worker_says_reaches_the_driver_without_the_runs_secrets(monkeypatch):
    from gearshift.orchestrator.cluster.scrubbed import ScrubbedGroup

    key, token = "key-" + random_secrets.token_hex(8), "tok-" + random_secrets.token_hex(8)
    password = "pw-" + random_secrets.token_hex(8)
    monkeypatch.setenv("GS_S3_KEY", key)
    monkeypatch.setenv("GS_TOKEN", token)
    job = job_from_dict(_job(checkpoint={"storage_options": {"key": "${GS_S3_KEY}"}},
                             cluster={"num_workers": 1, "env": {"HF_TOKEN": "${GS_TOKEN}", "NCCL_IB_DISABLE": "1"}}))
    # fsspec names the URL with its password (this one is not the job's: any URL's goes), a library
    # echoes a key or a token it was given
    said = f"s3://me:{password}@minio:9000/b/step_4 refused key {key} (token={token}), rank 1, step 10"
    group = ScrubbedGroup(_Saying(said), secrets.Scrubber(job.secret_values()))
    results = group.call("reshard")
    reports = group.train(4, 0)
    rank, report = next(reports)
    with pytest.raises(WorkerFailed) as failed:
        next(reports)
    err = failed.value
    texts = [results[0]["why"], report["step_failed"]["message"], str(err), err.reason, err.details, err.cause_text,
             repr(err.args), repr(err.cause)]
    for secret in (key, token, password):
        assert not [t for t in texts if secret in t], secret
    assert results[0]["why"] == "s3://me:***@minio:9000/b/step_4 refused key *** (token=***), rank 1, step 10"
    assert not err.recoverable and err.cause_text.startswith("OSError: ")  # what the verdict reads stays
    assert results[1] == {"rank": 1} and report["losses"] == [1.0]  # the rest as it came ("1" is no secret)
    state = {"step": 3}
    assert group.put(state) is state and not hasattr(group, "joinable")  # the group's own answers


def test_scrubbing_leaves_what_holds_no_secret_as_it_is():
    scrub = secrets.Scrubber(("a-long-secret",))
    report = {"losses": [1.0], "samples": [{"device": "cpu"}], "checkpoint": {"w": object()}}
    assert scrub.value(report) is report
    assert scrub.text("see ${PW} in s3://me:${PW}@host") == "see ${PW} in s3://me:${PW}@host"  # a reference, kept
    err = scrub.error(ValueError("x a-long-secret y"))
    assert str(err) == "x *** y"


# ----------------------------------------------------------------------------- a real run, on Ray

_MODEL = '''
import os
import pathlib

from user_model import build as _build, smooth_l1, waves  # noqa: F401


def build(width, api_token, seen):
    """The worker gets the values: the kwarg read from ${VAR}, cluster.env's from the driver."""
    if os.environ.get("HF_TOKEN") is not None:  # on a worker (the driver checks the model too)
        ok = os.environ["HF_TOKEN"] == api_token and os.environ.get("WANDB_API_KEY", "").startswith("typed-")
        pathlib.Path(seen).write_text("ok" if ok else "the values did not reach the worker")
    return _build(width=width)
'''


@pytest.mark.ray
def test_a_planted_secret_is_nowhere_in_the_run_dir_mlflow_or_the_logs(ray_cluster, tmp_path, monkeypatch,
                                                                        capsys, caplog):
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    planted = "gs-secret-" + random_secrets.token_hex(12)
    typed = "typed-" + random_secrets.token_hex(12)
    monkeypatch.setenv("GS_PLANTED", planted)
    shutil.copy(FIXTURES / "user_model.py", tmp_path / "user_model.py")
    (tmp_path / "secret_model.py").write_text(_MODEL)
    store = tmp_path / "mlflow"
    store.mkdir()
    job = {
        "name": "secrets",
        "model": {"entrypoint": "secret_model:build",
                  "kwargs": {"width": 8, "api_token": "${GS_PLANTED}", "seen": str(tmp_path / "seen")}},
        "data": {"entrypoint": "secret_model:waves", "kwargs": {"size": 32}},
        "loss": "secret_model:smooth_l1",
        "train": {"steps": 3, "global_batch_size": 8, "log_every": 1},
        "cluster": {"num_workers": 2, "env": {"HF_TOKEN": "${GS_PLANTED}", "WANDB_API_KEY": typed}},
        "checkpoint": {"every": 1, "storage_options": {"key": "${GS_PLANTED}", "secret": typed}},
        "tracking": {"mlflow": {"tracking_uri": f"sqlite:///{store / 'm.db'}"}, "tensorboard": True},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    run_dir = tmp_path / "run"
    caplog.set_level(logging.INFO)
    assert cli.main(["run", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir)]) == 0
    assert (tmp_path / "seen").read_text() == "ok"  # the workers had both values

    captured = capsys.readouterr()
    said = captured.out + captured.err + caplog.text
    files = [p for p in list(run_dir.rglob("*")) + list(store.rglob("*")) if p.is_file()]
    assert any(p.suffix == ".db" for p in files) and any("tfevents" in p.name for p in files)
    assert len([p for p in files if "mlartifacts" in p.parts]) >= 3  # job.yaml, summary.json, final.pt ...
    for secret in (planted, typed):
        assert secret not in said
        leaked = [str(p) for p in files if secret.encode() in p.read_bytes()]
        assert leaked == [], f"{secret[:6]}... found in {leaked}"
    written = yaml.safe_load((run_dir / "job.yaml").read_text())
    assert written["cluster"]["env"] == {"HF_TOKEN": "${GS_PLANTED}", "WANDB_API_KEY": "***"}
    assert written["model"]["kwargs"]["api_token"] == "${GS_PLANTED}"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "done"
