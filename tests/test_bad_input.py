"""Malformed job files and overrides: one paragraph naming the field, a non-zero exit, no
traceback, nothing created and no Ray left running."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

import pytest

from gearshift.orchestrator.commands import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
MLP = "model: mlp\ntrain: {steps: 5, global_batch_size: 8}\ncluster: {num_workers: 2}\n"

# (case id, job file text, overrides, substrings the message must contain)
CASES = [
    ("yaml-syntax", "model: [mlp\ntrain: {steps: 3}\n", [], ["valid YAML", "line"]),
    ("top-level-list", "- model\n- mlp\n", [], ["(top level)", "must be a mapping"]),
    ("empty-file", "", [], ["model", "is required"]),
    ("unknown-top-key", "modle: mlp\n", [], ["modle", "unknown key", "Did you mean 'model'"]),
    ("unknown-nested-key", MLP + "optimizer: {name: adam, learning_rate: 0.1}\n", [],
     ["optimizer.learning_rate", "unknown key", "lr"]),
    ("wrong-type", MLP, ["train.steps=ten"], ["train.steps", "'ten'", "integer"]),
    ("bool-for-int", MLP, ["train.steps=true"], ["train.steps", "true", "integer"]),
    ("negative-workers", MLP, ["cluster.num_workers=-2"], ["cluster.num_workers", "-2", "between 1"]),
    ("zero-batch", MLP, ["train.global_batch_size=0"], ["train.global_batch_size", "0", ">= 1"]),
    ("negative-lr", MLP, ["optimizer.lr=-0.1"], ["optimizer.lr", "-0.1", "> 0"]),
    ("batch-not-divisible", MLP, ["train.global_batch_size=9"], ["train.global_batch_size", "9 % 2 = 1"]),
    ("unknown-model", "model: resnet\n", [], ["model.name", "'resnet'", "'mlp', 'gpt'"]),
    ("unknown-model-kwarg", MLP, ["model.kwargs={hiden: 3}"], ["model.kwargs.hiden", "Did you mean 'hidden'"]),
    ("unknown-optimizer", MLP, ["optimizer.name=addamw"], ["optimizer.name", "'addamw'", "Did you mean 'adamw'"]),
    ("bad-precision", MLP, ["train.precision=fp8"], ["train.precision", "'fp8'", "'bf16'"]),
    ("two-gpus", MLP, ["cluster.gpus_per_worker=2"], ["cluster.gpus_per_worker", "0 (train on CPU) or 1"]),
    ("bad-betas", MLP, ["optimizer.betas=[0.9]"], ["optimizer.betas", "two numbers"]),
    ("missing-module", "model: 'no_such_module:build'\ndata: 'no_such_module:data'\n", [],
     ["model.entrypoint", "no_such_module", "not found"]),
    ("missing-function", "model: 'user_model:biuld'\ndata: 'user_model:waves'\n", [],
     ["model.entrypoint", "no callable 'biuld'", "user_model:build"]),
    ("entrypoint-format", "model: {entrypoint: 'user_model.build'}\n", [], ["model.entrypoint", "module:function"]),
    ("user-model-without-data", "model: 'user_model:build'\n", [], ["data", "is required"]),
    ("name-and-entrypoint", "model: {name: mlp, entrypoint: 'user_model:build'}\n", [], ["either name", "not both"]),
    ("set-without-equals", MLP, ["train.steps"], ["--set", "KEY=VALUE"]),
    ("set-bad-yaml", MLP, ["model.kwargs={hidden: [1"], ["--set model.kwargs", "YAML"]),
    ("set-into-scalar", MLP, ["train.steps.max=3"], ["train.steps.max", "cannot set a key inside train.steps"]),
    ("momentum-with-adam", MLP, ["optimizer.momentum=0.9"], ["optimizer.momentum", "sgd only"]),
    ("nan-lr", MLP, ["optimizer.lr=.nan"], ["optimizer.lr", "finite"]),
    ("unknown-strategy", MLP, ["parallel.strategy=zigzag"], ["parallel.strategy", "'data', 'tensor', 'hybrid'"]),
    ("pipeline-without-pp-size", MLP, ["parallel.strategy=pipeline"], ["parallel.pp_size", "needs parallel.pp_size"]),
    ("pipeline-pp-not-dividing", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=3", "cluster.num_workers=4"],
     ["parallel.pp_size", "dp * pp_size(3) != num_workers(4): 4 % 3 = 1"]),
    ("pipeline-tp-not-dividing", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2", "parallel.tp_size=3",
                                       "cluster.num_workers=4"],
     ["parallel.tp_size", "pp_size(2) * dp * tp_size(3) != num_workers(4): 4 % 6 = 4", "a divisor of num_workers / pp_size (2)"]),
    ("pipeline-more-stages-than-blocks", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2"],
     ["parallel.pp_size", "2 stages need at least 2 blocks; the model has 1 (hidden.0)"]),
    ("pipeline-microbatches-not-dividing", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2",
                                                 "model.kwargs={layers: 2}", "parallel.pp_microbatches=5"],
     ["parallel.pp_microbatches", "5", "8 samples (train.global_batch_size / dp(1)): 8 % 5 = 3"]),
    ("pipeline-cut-names-no-block", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2", "model.kwargs={layers: 2}",
                                          "parallel.pp_split=[hidden.7]"],
     ["parallel.pp_split", "'hidden.7' names no block; the blocks are hidden.0, hidden.1"]),
    ("pipeline-interleaved-more-stages-than-blocks", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2",
                                                           "model.kwargs={layers: 3}",
                                                           "parallel.pp_schedule=interleaved_1f1b"],
     ["parallel.pp_size", "2 x 2 stages a rank (an interleaved schedule) = 4 stages need at least 4 blocks",
      "the model has 3"]),
    ("pipeline-interleaved-microbatches", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2",
                                                "model.kwargs={layers: 4}", "parallel.pp_schedule=interleaved_zb",
                                                "train.global_batch_size=10", "parallel.pp_microbatches=5"],
     ["parallel.pp_microbatches", "5", "interleaved_zb runs the micro-batches in rounds of pp_size (2)",
      "5 // 2 = 2 rounds must divide them", "[1, 2, 3, 4, 6, 8]"]),
    ("pipeline-options-without-pipeline", MLP, ["parallel.pp_microbatches=4"],
     ["parallel.pp_microbatches", "applies to strategy pipeline, not data"]),
    ("pipeline-compile-zero-bubble", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2", "model.kwargs={layers: 4}",
                                           "parallel.pp_schedule=interleaved_zb", "train.compile=true"],
     ["train.compile", "interleaved_zb", "use pp_schedule 1f1b, gpipe or interleaved_1f1b"]),
    ("hybrid-without-tp", MLP, ["parallel.strategy=hybrid"], ["parallel.strategy", "needs parallel.tp_size"]),
    ("hsdp-group-not-dividing", MLP, ["parallel.strategy=hsdp", "parallel.shard_size=3", "cluster.num_workers=4"],
     ["parallel.shard_size", "groups * shard_size(3) != num_workers(4): 4 % 3 = 1"]),
    ("shard-size-without-hsdp", MLP, ["parallel.strategy=fsdp", "parallel.shard_size=2"],
     ["parallel.shard_size", "applies to hsdp", "fsdp shards over every worker"]),
    ("dp-shard-without-hybrid", MLP, ["parallel.strategy=data", "parallel.dp_shard=true"],
     ["parallel.dp_shard", "applies to a layout that may shard its data dimension (hybrid, pipeline)"]),
    ("pipeline-dp-shard-zero-bubble", MLP, ["parallel.strategy=pipeline", "parallel.pp_size=2", "cluster.num_workers=4",
                                            "model.kwargs={layers: 4}", "parallel.dp_shard=true",
                                            "parallel.pp_schedule=interleaved_zb"],
     ["parallel.dp_shard", "gpipe, 1f1b or interleaved_1f1b, not interleaved_zb"]),
    ("schedule-hsdp-not-dividing", MLP, ["cluster.num_workers=4",
                                         "adapt.schedule=[{step: 2, strategy: hsdp, shard_size: 3}]"],
     ["adapt.schedule[0]", "4 % 3 = 1"]),
    ("tp-not-dividing-workers", MLP, ["parallel.strategy=hybrid", "parallel.tp_size=3", "cluster.num_workers=4"],
     ["parallel.tp_size", "dp * tp_size(3) != num_workers(4): 4 % 3 = 1"]),
    ("tensor-tp-mismatch", MLP, ["parallel.strategy=tensor", "parallel.tp_size=4"],
     ["parallel.tp_size", "tp_size(4) != num_workers(2)"]),
    ("plan-matches-nothing", "model: 'user_model:build'\ndata: 'user_model:waves'\n",
     ["parallel.strategy=tensor", "parallel.tp_plan={layers.*: colwise}"],
     ["parallel.tp_plan", "pattern 'layers.*' matches no module", "net.0"]),
    ("plan-on-non-linear", "model: 'user_model:build'\ndata: 'user_model:waves'\n",
     ["parallel.strategy=tensor", "parallel.tp_plan={net.1: colwise}"],
     ["parallel.tp_plan", "matches 'net.1', a Tanh", "only nn.Linear"]),
    ("plan-not-divisible", "model: {entrypoint: 'user_model:build', kwargs: {width: 30}}\ndata: 'user_model:waves'\n",
     ["parallel.strategy=tensor", "cluster.num_workers=4", "parallel.tp_plan={net.0: colwise, net.2: rowwise}"],
     ["parallel.tp_plan", "net.0 (colwise): out_features(30) % tp(4) = 2"]),
    ("plan-bad-style", MLP, ["parallel.strategy=tensor", "parallel.tp_plan={hidden.0: diagonal}"],
     ["parallel.tp_plan.hidden.0", "'diagonal'", "'colwise' or 'rowwise'"]),
    ("user-model-without-plan", "model: 'user_model:build'\ndata: 'user_model:waves'\n", ["parallel.strategy=tensor"],
     ["parallel.tp_plan", "no tensor-parallel plan"]),
    ("heads-not-divisible", "model: {name: gpt, kwargs: {n_head: 4, n_embd: 96}}\n",
     ["parallel.strategy=tensor", "cluster.num_workers=8", "train.global_batch_size=8"],
     ["parallel.tp_size", "n_head(4) % tp(8) = 4"]),
    ("plan-inside-multihead-attention", "model: 'user_model:with_mha'\ndata: 'user_model:waves'\n",
     ["parallel.strategy=tensor", "parallel.tp_plan={attn.out_proj: rowwise}"],
     ["parallel.tp_plan", "inside nn.MultiheadAttention"]),
    ("checkpointing-pattern-matching-nothing", "model: 'user_model:build'\ndata: 'user_model:waves'\n",
     ["train.activation_checkpointing=[blocks.*]"], ["train.activation_checkpointing", "'blocks.*'",
                                                     "matches no module", "net.0"]),
    ("checkpointing-not-a-list", MLP, ["train.activation_checkpointing=blocks"],
     ["train.activation_checkpointing", "true, false, or a list of module-name patterns"]),
    ("fsdp-units-matching-nothing", MLP, ["parallel.fsdp_units=[layers.*]"],
     ["parallel.fsdp_units", "'layers.*'", "matches no module", "hidden.0"]),
    ("schedule-past-the-end", MLP, ["adapt.schedule=[{step: 5, strategy: tensor}]"],
     ["adapt.schedule[0].step", "5", "before the last step"]),
    ("schedule-unknown-strategy", MLP, ["adapt.schedule=[{step: 2, strategy: zigzag}]"],
     ["adapt.schedule[0].strategy", "'zigzag'", "'data', 'tensor', 'hybrid'"]),
    ("schedule-out-of-order", MLP, ["train.steps=20", "adapt.schedule=[{step: 8, strategy: tensor}, {step: 4, strategy: data}]"],
     ["adapt.schedule[1].step", "later than the entry before it"]),
    ("schedule-hybrid-without-tp", MLP, ["adapt.schedule=[{step: 2, strategy: hybrid}]"],
     ["adapt.schedule[0]", "needs parallel.tp_size"]),
    ("schedule-entry-not-mapping", MLP, ["adapt.schedule=[3]"], ["adapt.schedule[0]", "{step: N, strategy"]),
    ("auto-with-tp-size", MLP, ["parallel.strategy=auto", "parallel.tp_size=2"],
     ["parallel.tp_size", "chosen by the policy"]),
    ("bad-threshold", MLP, ["adapt.threshold=1.5"], ["adapt.threshold", "1.5", "between 0.0 and 1.0"]),
    ("nodes-not-dividing", MLP, ["inject.nodes=3"], ["inject.nodes", "must divide cluster.num_workers (2)"]),
    ("link-without-nodes", MLP, ["inject.link={mb_per_s: 5}"], ["inject.link", "needs inject.nodes >= 2"]),
    ("link-bad-rate", MLP, ["inject.nodes=2", "inject.link={mb_per_s: 0}"], ["inject.link.mb_per_s", "> 0.0"]),
    ("metrics-port-out-of-range", MLP, ["telemetry.metrics_port=70000"], ["telemetry.metrics_port", "70000", "between 0 and 65535"]),
    ("sample-period-too-short", MLP, ["telemetry.sample_period_s=0.05"], ["telemetry.sample_period_s", "0.05", "between 0.2"]),
    ("bucket-word", MLP, ["parallel.bucket_cap_mb=big"], ["parallel.bucket_cap_mb", "'big'", "or 'auto'"]),
    ("bucket-zero", MLP, ["parallel.bucket_cap_mb=0"], ["parallel.bucket_cap_mb", "0", "(0, 4096]"]),
    ("tune-start-not-a-value", MLP, ["tune.bucket_values=[1, 5]", "tune.start=25"],
     ["tune.start", "25", "one of tune.bucket_values [1.0, 5.0]"]),
    ("tune-values-empty", MLP, ["tune.bucket_values=[]"], ["tune.bucket_values", "non-empty list"]),
    ("tune-values-repeat", MLP, ["tune.bucket_values=[5, 5]"], ["tune.bucket_values", "must not repeat"]),
    ("tune-trial-steps-zero", MLP, ["tune.trial_steps=0"], ["tune.trial_steps", "0"]),
    ("profile-past-the-end", MLP, ["train.profile={start_step: 4, steps: 3}"],
     ["train.profile", "start_step + steps - 1 = 6 > train.steps = 5", "start_step may be at most 3"]),
    ("profile-start-zero", MLP, ["train.profile={start_step: 0, steps: 2}"],
     ["train.profile.start_step", "0", ">= 1"]),
    ("profile-steps-missing", MLP, ["train.profile.start_step=2"],
     ["train.profile", "{start_step: S, steps: K}", "steps is required"]),
    ("profile-unknown-key", MLP, ["train.profile={start_step: 2, steps: 1, every: 3}"],
     ["train.profile", "unknown key 'every'"]),
    ("accumulation-not-dividing", MLP, ["train.micro_batch_size=3"],
     ["train.micro_batch_size", "3", "global_batch_size(8) must be a multiple of micro_batch_size(3) x dp(2) = 6",
      "8 % 6 = 2"]),
    ("accumulation-not-dividing-after-a-switch", MLP + "adapt: {schedule: [{step: 2, strategy: data}]}\n",
     ["parallel.strategy=tensor", "train.micro_batch_size=4", "train.global_batch_size=12"],
     ["train.micro_batch_size", "micro_batch_size(4) x dp(2) = 8", "adapt.schedule[0] = data dp=2 tp=1"]),
    ("unknown-schedule", MLP, ["optimizer.schedule=warmup_cosin"],
     ["optimizer.schedule.name", "'warmup_cosin'", "Did you mean 'warmup_cosine'"]),
    ("warmup-longer-than-the-run", MLP, ["optimizer.schedule={name: linear, warmup_steps: 5}"],
     ["optimizer.schedule.warmup_steps", "5", "shorter than the run (train.steps = 5)"]),
    ("schedule-returns-nan", MLP, ["optimizer.schedule=user_model:bad_schedule"],
     ["optimizer.schedule.name", "user_model:bad_schedule", "finite learning rate", "nan"]),
    ("micro-batch-zero", MLP, ["train.micro_batch_size=0"], ["train.micro_batch_size", "0", ">= 1"]),
    ("loader-workers-negative", MLP, ["data.loader={workers: -1}"], ["data.loader.workers", "-1"]),
    ("keep-fp32-matches-nothing", MLP, ["train.precision={dtype: bf16, keep_fp32: [embedding*]}"],
     ["train.precision.keep_fp32", "'embedding*'", "matches no module", "hidden.0"]),
    ("precision-phases-without-dtype", MLP, ["train.precision={fp32_warmup_steps: 3}"],
     ["train.precision", "dtype is required"]),
    ("compile-bad-mode", MLP, ["train.compile={mode: fastest}"], ["train.compile.mode", "'fastest'", "max-autotune"]),
    ("final-fp32-matches-nothing", MLP, ["train.precision={dtype: bf16, fp32_final_steps: 5, final_fp32: [lm_head]}"],
     ["train.precision.final_fp32", "'lm_head'", "matches no module"]),
    ("final-fp32-without-steps", MLP, ["train.precision={dtype: bf16, final_fp32: [out]}"],
     ["train.precision.final_fp32", "fp32_final_steps"]),
    ("rollback-without-checkpoints", MLP, ["fault.on_nan=rollback", "checkpoint.every=0"],
     ["fault.on_nan", "rollback", "checkpoint.every"]),
    ("grad-check-bad-ratio", MLP, ["train.grad_check={every: 5, explode_ratio: 0.5}"],
     ["train.grad_check.explode_ratio", "more than 1"]),
    # eval data that fails to load is refused as data is, naming eval.data
    ("eval-data-bad-entrypoint", MLP, ["eval.every=2", "eval.data=user_model:no_such_data"],
     ["eval.data.entrypoint", "'user_model:no_such_data'", "has no callable"]),
    ("eval-data-missing-module", MLP, ["eval.every=2", "eval.data=not_a_module:load"],
     ["eval.data.entrypoint", "'not_a_module:load'", "was not found"]),
    ("eval-data-bad-name", MLP, ["eval.every=2", "eval.data=mnist"],
     ["eval.data.name", "'mnist'", "one of 'synthetic_digits', 'chars'"]),
    ("eval-data-does-not-fit", MLP, ["eval.every=2", "eval.data=chars"], ["eval.data", "'chars'", "do not fit"]),
    ("eval-data-missing", MLP, ["eval.every=2"], ["eval.data", "is required when eval.every > 0"]),
    ("eval-batches-zero", MLP, ["eval.every=2", "eval.data=synthetic_digits", "eval.batches=0"],
     ["eval.batches", "= 0", ">= 1", "or null"]),
    ("keep-best-without-eval", MLP, ["checkpoint.keep_best=true"], ["checkpoint.keep_best", "eval.every > 0"]),
]


@pytest.mark.parametrize("case,text,overrides,expect", CASES, ids=[c[0] for c in CASES])
@pytest.mark.crossing("compile", "interleaved", refused=True)
def test_bad_job_is_one_paragraph_and_nothing_starts(tmp_path, monkeypatch, capsys, case, text, overrides, expect):
    shutil.copy(FIXTURES / "user_model.py", tmp_path / "user_model.py")
    (tmp_path / "job.yaml").write_text(text)
    monkeypatch.chdir(tmp_path)
    import gearshift.orchestrator.cluster.worker_group

    def no_ray(*args, **kwargs):
        pytest.fail("an invalid job must fail before Ray is started or joined")

    monkeypatch.setattr(gearshift.orchestrator.cluster.worker_group, "ray_session", no_ray)
    code = cli.main(["run", "job.yaml"] + [a for o in overrides for a in ("--set", o)])
    err = capsys.readouterr().err.strip()
    assert code == cli.EXIT_BAD_INPUT, err
    assert "Traceback" not in err and "\n\n" not in err and err.startswith("gearshift: ")
    for piece in expect:
        assert piece in err, f"{piece!r} missing from: {err}"
    assert not (tmp_path / "runs").exists(), "an invalid job must not create a run directory"


def test_every_command_the_parser_offers_has_its_function_and_no_other_is_listed():
    import argparse

    (subparsers,) = [a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(subparsers.choices) == set(cli.COMMANDS)


def test_missing_job_file(tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nope.yaml")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "nope.yaml" in err and "existing YAML file" in err


def test_module_that_fails_to_import(tmp_path, capsys):
    (tmp_path / "broken.py").write_text("import torch\nraise RuntimeError('no GPU driver here')\n")
    (tmp_path / "job.yaml").write_text("model: 'broken:build'\ndata: 'broken:data'\n")
    assert cli.main(["run", str(tmp_path / "job.yaml")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "importing 'broken' failed: RuntimeError: no GPU driver here" in err and "Traceback" not in err


def test_resume_of_a_folder_that_is_not_a_run(tmp_path, capsys):
    assert cli.main(["run", "--resume", str(tmp_path)]) == cli.EXIT_BAD_INPUT
    assert "not a gearshift run directory" in capsys.readouterr().err


def _ray_daemons() -> set[int]:
    from conftest import ray_daemons

    return ray_daemons()


@pytest.mark.ray
def test_more_workers_than_the_machine_fails_fast_and_stops_ray(tmp_path):
    """The real command in a fresh process: it starts an embedded Ray, finds the job cannot fit,
    says so in one paragraph and leaves no Ray process behind."""
    (tmp_path / "job.yaml").write_text(MLP)
    before = _ray_daemons()
    # an hour's placement wait: a run that waited for room instead of failing at the room check
    # would end at this call's time limit, not with the room check's paragraph
    proc = subprocess.run([sys.executable, "-m", "gearshift", "run", "job.yaml",
                           "--set", "cluster.num_workers=64", "--set", "train.global_batch_size=64",
                           "--set", "cluster.placement_timeout_s=3600"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": ""})
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr
    assert "cluster.num_workers = 64 does not fit" in proc.stderr and "CPU 64 needed" in proc.stderr
    assert "Traceback" not in proc.stderr and "could not place" not in proc.stderr
    deadline = time.monotonic() + 15
    while _ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (_ray_daemons() - before), "the embedded Ray must be shut down"


EMBEDDED_SESSION = """
import ray
from ray._private import ray_constants, worker
from gearshift.orchestrator.cluster.worker_group import ray_session

seen, real = {}, ray.shutdown

def shutdown(*args, **kwargs):
    procs = worker._global_node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, [])
    seen["monitors alive"] = [info.process.poll() is None for info in procs]
    return real(*args, **kwargs)

ray.shutdown = shutdown
with ray_session(None, 1):
    seen["monitors at start"] = len(worker._global_node.all_processes[ray_constants.PROCESS_TYPE_MONITOR])
print(seen, ray.is_initialized())
"""


@pytest.mark.ray
def test_an_embedded_ray_has_its_autoscaler_monitor_stopped_before_ray_shutdown(tmp_path):
    """Ray would stop the monitor after its GCS, and wait its 1 s grace for it on every run."""
    before = _ray_daemons()
    proc = subprocess.run([sys.executable, "-c", EMBEDDED_SESSION], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "RAY_ADDRESS": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "{'monitors at start': 1, 'monitors alive': [False]} False", proc.stdout
    assert "autoscaler failed" not in proc.stderr
    deadline = time.monotonic() + 15
    while _ray_daemons() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not (_ray_daemons() - before), "the embedded Ray must be shut down"


@pytest.mark.ray
def test_job_that_cannot_be_placed_on_a_joined_cluster_times_out_cleanly(ray_cluster, tmp_path, capsys):
    """On a cluster gearshift joined (it may grow), it waits placement_timeout_s, then fails."""
    (tmp_path / "job.yaml").write_text(MLP)
    code = cli.main(["run", str(tmp_path / "job.yaml"), "--run-dir", str(tmp_path / "run"),
                     "--set", "cluster.cpus_per_worker=3", "--set", "cluster.placement_timeout_s=2"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED and "could not place 2 workers" in err and "Traceback" not in err
    import ray
    from ray.util import placement_group_table

    assert all(pg["state"] == "REMOVED" for pg in placement_group_table().values())
    from conftest import wait_until

    assert wait_until(lambda: ray.available_resources().get("CPU") == ray.cluster_resources().get("CPU"))



def test_an_embedded_ray_that_times_out_starting_is_tried_once_more_then_said_in_one_paragraph(monkeypatch):
    """Ray raises a bare Exception when its processes are slow to come up on a loaded machine:
    the start is tried once more; failing again, it is a GearshiftError saying what to try,
    not Ray's traceback. Ray itself is not started here."""
    import ray

    from gearshift.orchestrator.cluster import ray_start
    from gearshift.orchestrator.errors import GearshiftError

    calls, shut = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) <= failures:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(1))
    failures = 1
    ray_start.start_ray(None, 2)  # the second try starts
    assert len(calls) == 2 and len(shut) == 1 and calls[1]["address"] == "local"
    calls.clear()
    failures = 2
    with pytest.raises(GearshiftError) as err:
        ray_start.start_ray(None, 2)
    text = str(err.value)
    assert len(calls) == 2 and "timed out" in text and "tried twice" in text and "--address" in text, text
    calls.clear()
    failures = 5
    with pytest.raises(GearshiftError) as err:  # a cluster to join is not retried
        ray_start.start_ray("10.0.0.1:6379", None)
    assert len(calls) == 1 and "tried twice" not in str(err.value)
