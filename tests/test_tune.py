"""bucket_cap_mb tuning on real workers: online (`parallel.bucket_cap_mb: auto`) and offline
(`gearshift tune`). The tuner's own logic is tested in test_tuner.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import load_job
from test_train_equivalence import GPT, MLP, max_diff, run_gearshift



def events(run_dir, name=None):
    records = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    return [r for r in records if r["type"] == "event" and (name is None or r["event"] == name)]


def test_online_tuning_changes_the_bucket_mid_run_and_ends_where_the_winner_alone_ends(local_workers, tmp_path):
    # tiny buckets (50 KB) split the GPT's gradients into many all-reduces: a real difference
    tune = ["parallel.bucket_cap_mb=auto", "tune.bucket_values=[0.05, 1, 25]", "tune.start=1",
            "tune.warmup_steps=1", "tune.trial_steps=3", "tune.max_trials=3"]
    base = ["cluster.num_workers=2", "train.steps=16", "train.global_batch_size=16", "checkpoint.every=0"]
    summary = run_gearshift(GPT[0], GPT[1] + base + tune, tmp_path / "auto")
    assert summary["steps_done"] == 16 and summary["status"] == "done"
    [start] = events(tmp_path / "auto", "tune_start")
    trials = events(tmp_path / "auto", "tune_trial")
    # this GPT's gradients are under 1 MB: 25 MB buckets them as 1 MB does, and is not tried
    assert start["step"] == 0 and start["space"] == {"bucket_cap_mb": [0.05, 1.0]}
    assert start["same_as"] == {"25.0": 1.0}
    assert [t["setting"]["bucket_cap_mb"] for t in trials][:2] == [1.0, 0.05]  # the value in force, then a neighbour
    assert all(t["score"] > 0 and t["comm_wait_frac"] is not None for t in trials)
    changes = events(tmp_path / "auto", "bucket")
    assert changes and changes[0]["previous"] == 1.0 and changes[0]["bucket_cap_mb"] == 0.05
    [tuned] = events(tmp_path / "auto", "tuned")
    winner = tuned["best"]["setting"]["bucket_cap_mb"]
    assert tuned["best"]["score"] == max(t["score"] for t in trials)
    assert summary["bucket_cap_mb"] == winner and summary["tuning"][0]["best"]["setting"] == {"bucket_cap_mb": winner}
    # every step record carries the bucket size it ran with
    steps = [json.loads(line) for line in (tmp_path / "auto" / "telemetry.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r["bucket_cap_mb"] for r in steps if r["type"] == "step"}
    for t in trials:
        first, last = t["steps"]
        assert {by_step[s] for s in range(first, last + 1)} == {t["setting"]["bucket_cap_mb"]}
    assert by_step[16] == winner

    run_gearshift(GPT[0], GPT[1] + base + [f"parallel.bucket_cap_mb={winner}"], tmp_path / "fixed")
    a = torch.load(tmp_path / "auto" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "fixed" / "final.pt", weights_only=True)
    assert max_diff(a, b) <= 1e-4


def test_a_new_layout_gets_its_own_round_and_a_layout_without_data_parallelism_none(local_workers, tmp_path):
    tune = ["parallel.bucket_cap_mb=auto", "tune.bucket_values=[0.001, 25]", "tune.start=25",
            "tune.warmup_steps=1", "tune.trial_steps=2", "tune.max_trials=2"]
    schedule = ("adapt.schedule=[{step: 8, strategy: hybrid, tp_size: 2}, {step: 16, strategy: tensor}, "
                "{step: 18, strategy: data}]")
    base = ["cluster.num_workers=4", "cluster.cpus_per_worker=1", "train.steps=20", "train.global_batch_size=16",
            "checkpoint.every=0"]
    summary = run_gearshift(MLP[0], MLP[1] + base + tune + [schedule], tmp_path / "run")
    rounds = summary["tuning"]
    assert [(r["started"], r["layout"]["strategy"]) for r in rounds] == [(0, "data"), (8, "hybrid")]
    assert all(len(r["trials"]) == 2 for r in rounds)
    # tensor (dp 1) has no gradient all-reduce to tune; back on data the value its round chose returns
    assert not [e for e in events(tmp_path / "run", "tune_start") if e["layout"]["strategy"] == "tensor"]
    history = {h["step"]: (h["strategy"], h["bucket_cap_mb"]) for h in summary["strategy_history"]}
    assert history[18][0] == "data" and summary["bucket_cap_mb"] == rounds[0]["best"]["setting"]["bucket_cap_mb"]


def test_gearshift_tune_times_every_setting_and_writes_the_winner(local_workers, tmp_path, capsys):
    out = tmp_path / "tuned.yaml"
    code = cli.main(["tune", str(MLP[0]), *[a for o in MLP[1] + ["cluster.num_workers=2"] for a in ("--set", o)],
                     "--param", "bucket_cap_mb=0.01,25", "--param", "strategy=data,tensor",
                     "--warmup", "1", "--steps", "3", "--run-dir", str(tmp_path / "trials"), "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.strip() and "samples/s" not in line]
    assert len(rows) == 4 and sum("<- best" in r for r in rows) == 1
    [round_] = json.loads((tmp_path / "trials" / "summary.json").read_text())["tuning"]
    settings = [(t["setting"]["bucket_cap_mb"], t["setting"]["strategy"]) for t in round_["trials"]]
    assert sorted(settings) == sorted([(0.01, "data"), (0.01, "tensor"), (25.0, "data"), (25.0, "tensor")])
    best = max(round_["trials"], key=lambda t: t["score"])["setting"]
    tuned = load_job(out)  # the written file is a valid job with the winner in it
    assert tuned.parallel.bucket_cap_mb == best["bucket_cap_mb"] and tuned.parallel.strategy == best["strategy"]
    assert yaml.safe_load(out.read_text())["train"]["steps"] == load_job(MLP[0], MLP[1]).train.steps


@pytest.mark.parametrize("param, says", [
    ("bucket_cap_mb=0,5", "bucket_cap_mb takes"), ("bucket_cap_mb=x", "bucket_cap_mb takes"),
    ("strategy=pipeline", "data, tensor or hybrid"), ("colour=red", "NAME=V1,V2"), ("bucket_cap_mb=", "NAME=V1,V2"),
    ("bucket_cap_mb=5,5", "listed twice"), ("strategy=hybrid", "needs a tensor-parallel size"),
])
def test_bad_tune_arguments_are_refused_before_anything_starts(tmp_path, capsys, param, says):
    code = cli.main(["tune", str(MLP[0]), "--param", param, "--run-dir", str(tmp_path / "never")])
    assert code == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "never").exists()


def test_bucket_sizes_that_hold_every_gradient_are_one_setting():
    from gearshift.orchestrator.control.bucket_tuning import distinct_buckets

    # 437,504 fp32 parameters: 1.67 MB of gradients; 5 and up all make one bucket
    assert distinct_buckets([1, 5, 10, 25, 50, 100], 437_504) == ([1, 5], {10: 5, 25: 5, 50: 5, 100: 5})
    # a tp shard holds half: 0.83 MB, and 1 MB already holds it whole
    assert distinct_buckets([1, 5, 10], 437_504, tp=2) == ([1], {5: 1, 10: 1})
    assert distinct_buckets([1, 5], 100_000_000) == ([1, 5], {})  # 381 MB: every size splits it
    assert distinct_buckets([1, 5], None) == ([1, 5], {})
