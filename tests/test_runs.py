"""`gearshift runs`, `runs diff` and `replay`: a run is reproducible from its record."""

from __future__ import annotations

import json
import pathlib
import shutil
import socket

import pytest
import torch

from gearshift import api
from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.commands import runs as runs_command
from gearshift.orchestrator.job import load_job
from gearshift.orchestrator.records.rundir import RunDir

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = pathlib.Path(__file__).parent / "fixtures"
TINY = ["train.steps=4", "train.global_batch_size=32", "data.kwargs.size=512", "checkpoint.every=0"]


def make_run(root: pathlib.Path, overrides=(), summary: dict | None = None) -> RunDir:
    job = load_job(ROOT / "examples/mlp.yaml", TINY + list(overrides))
    run = RunDir.create(job, root=str(root))
    if summary is not None:
        run.write_summary({"job": job.name, "fingerprint": job.fingerprint(), **summary})
    return run


def user_job(tmp_path: pathlib.Path) -> pathlib.Path:
    shutil.copy(FIXTURES / "user_model.py", tmp_path / "user_model.py")
    job = tmp_path / "user.yaml"
    job.write_text("name: user\n"
                   "model: {entrypoint: 'user_model:build', kwargs: {width: 16}}\n"
                   "data: {entrypoint: 'user_model:waves', kwargs: {size: 64}}\n"
                   "loss: {entrypoint: 'user_model:smooth_l1'}\n"
                   "train: {steps: 2, global_batch_size: 8}\n"
                   "cluster: {num_workers: 1}\n")
    return job


# ----------------------------------------------------------------------------- diff


def test_diff_of_two_runs_that_differ_in_one_field_shows_that_field_only(tmp_path, capsys):
    a = make_run(tmp_path)
    b = make_run(tmp_path, ["optimizer.lr=0.002"])
    assert cli.main(["runs", "diff", str(a.path), str(b.path)]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = out[out.index(next(line for line in out if line.startswith("FIELD"))) + 1:]
    assert len(rows) == 1 and rows[0].split() == ["optimizer.lr", "0.001", "0.002"]

    # by fingerprint prefix, with --root given after diff
    fa, fb = a.load_job().fingerprint(), b.load_job().fingerprint()
    assert cli.main(["runs", "diff", fa[:6], fb, "--root", str(tmp_path)]) == 0
    assert capsys.readouterr().out.count("optimizer.lr") == 1
    # by the name the table's RUN DIR column shows
    assert cli.main(["runs", "--root", str(tmp_path), "diff", a.path.name, b.path.name]) == 0
    assert capsys.readouterr().out.count("optimizer.lr") == 1


def test_diff_of_the_same_job_says_so(tmp_path, capsys):
    a, b = make_run(tmp_path), make_run(tmp_path)
    assert cli.main(["runs", "diff", str(a.path), str(b.path)]) == 0
    assert "same in every field" in capsys.readouterr().out


# ----------------------------------------------------------------------------- finding a run


def test_replay_of_a_directory_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "stuff").mkdir()
    assert cli.main(["replay", str(tmp_path / "stuff")]) == 2
    err = capsys.readouterr().err
    assert "is not a gearshift run directory" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_unknown_and_ambiguous_fingerprints_list_the_candidates(tmp_path, capsys):
    a, b = make_run(tmp_path), make_run(tmp_path)  # the same job twice: one fingerprint, two runs
    fp = a.load_job().fingerprint()
    assert cli.main(["replay", fp[:4], "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "ambiguous" in err and str(a.path) in err and str(b.path) in err and "Traceback" not in err

    unknown = "0" * 8 if not fp.startswith("0") else "f" * 8
    assert cli.main(["runs", "diff", unknown, str(a.path), "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no run under" in err and fp in err

    assert cli.main(["replay", "not-a-run", "--root", str(tmp_path)]) == 2
    assert "neither a directory nor a fingerprint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- the table


def test_table_shows_finished_failed_running_and_killed_runs(tmp_path, capsys):
    done = make_run(tmp_path, summary={"status": "done", "steps_done": 4, "steps_target": 4, "final_loss": 2.25,
                                       "best_eval_loss": 2.5, "samples_per_s": 1234.5,
                                       "strategy_history": [{"step": 0, "strategy": "data", "dp": 2, "tp": 1},
                                                            {"step": 2, "strategy": "tensor", "dp": 1, "tp": 2}]})
    failed = make_run(tmp_path, ["train.seed=1"], summary={"status": "failed", "steps_done": 1, "steps_target": 4})
    running = make_run(tmp_path, ["train.seed=2"])
    running.write_driver()  # this process: alive
    data_2x1 = {"strategy": "data", "dp": 2, "tp": 1}
    records = [{"type": "event", "event": "state", "state": "starting", "layout": data_2x1},
               {"type": "event", "event": "state", "state": "training", "steps_target": 4},
               {"type": "step", "step": 3, "loss": 2.125, "strategy": "data", "dp": 2, "tp": 1}]
    running.telemetry.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"type": "st')  # mid-write
    killed = make_run(tmp_path, ["train.seed=3"])
    killed.driver.write_text(json.dumps({"pid": 2 ** 22 + 12345, "host": socket.gethostname(), "started": 0}))

    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "job.yaml").write_text("{ not yaml")

    assert cli.main(["runs", "--root", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and lines[-1].endswith("damaged") and " unknown " in lines[-1]
    assert lines[0].split()[:4] == ["FINGERPRINT", "NAME", "STARTED", "STATUS"]
    row = {r.path.name: next(line for line in lines if line.endswith(r.path.name))
           for r in (done, failed, running, killed)}
    assert " done " in row[done.path.name] and "2.2500" in row[done.path.name] and "2.5000" in row[done.path.name]
    assert "1,234" in row[done.path.name] and "data 2x1, tensor 1x2" in row[done.path.name]
    assert " failed " in row[failed.path.name] and "1/4" in row[failed.path.name]
    assert " running " in row[running.path.name] and "3/4" in row[running.path.name]
    assert "2.1250" in row[running.path.name] and "data 2x1" in row[running.path.name]
    assert " killed " in row[killed.path.name]
    assert row[done.path.name].startswith(done.load_job().fingerprint())


def test_table_of_a_hundred_runs_reads_only_the_ends_of_their_telemetry(tmp_path, capsys, monkeypatch):
    """A table over many runs must stay quick however long they ran: a run's telemetry is glanced
    at (its first and last few kB), never read whole. Checked by the bytes read, not by a clock."""
    from gearshift.orchestrator.commands import runs as runs_command

    big = {"type": "step", "step": 1, "loss": 1.0, "strategy": "data", "dp": 2, "tp": 1, "pad": "x" * 2000}
    first = make_run(tmp_path / "runs")
    first.telemetry.write_text((json.dumps(big) + "\n") * 5000)  # 10 MB that must not be read whole
    for i in range(99):
        shutil.copytree(first.path, tmp_path / "runs" / f"copy-{i}")
    read = []
    real_open = pathlib.Path.open

    class Counted:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def read(self, *args):
            data = self.f.read(*args)
            read.append(len(data))
            return data

        def __getattr__(self, name):
            return getattr(self.f, name)

    def counting_open(self, *args, **kwargs):
        f = real_open(self, *args, **kwargs)
        return Counted(f) if self.name == "telemetry.jsonl" else f

    monkeypatch.setattr(pathlib.Path, "open", counting_open)
    assert cli.main(["runs", "--root", str(tmp_path / "runs")]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 101
    assert read and sum(read) <= 100 * 2 * runs_command._GLANCE_BYTES, f"{sum(read)} bytes of telemetry read"


# ----------------------------------------------------------------------------- source.json


def test_a_run_records_its_source(tmp_path):
    run = RunDir.create(load_job(user_job(tmp_path)), root=str(tmp_path / "runs"))
    source = json.loads(run.source.read_text())
    assert source["base_dir"] == str(tmp_path.resolve())
    assert source["packages"]["torch"] and source["python"] and source["gearshift"]["version"]
    assert list(source["modules"]) == ["user_model"]
    assert source["modules"]["user_model"]["path"] == str((tmp_path / "user_model.py").resolve())
    assert runs_command.source_warnings(run) == []


def test_replay_warns_when_a_user_module_or_a_version_changed(tmp_path, capsys, monkeypatch):
    run = RunDir.create(load_job(user_job(tmp_path)), root=str(tmp_path / "runs"))
    with open(tmp_path / "user_model.py", "a") as f:
        f.write("\n# edited after the run\n")
    source = json.loads(run.source.read_text())
    source["packages"]["numpy"] = "0.0.1"
    run.source.write_text(json.dumps(source))

    started = []
    monkeypatch.setattr(api, "train", lambda job, new, resume, **kw: started.append(new))
    assert cli.main(["replay", str(run.path), "--run-dir", str(tmp_path / "again")]) == 0
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if line.startswith("gearshift: warning:")]
    assert len(warnings) == 2
    assert any("module user_model" in w and "has changed since the run" in w for w in warnings)
    assert any("numpy: 0.0.1 then" in w for w in warnings)
    assert started and started[0].path == tmp_path / "again"  # it warns, then goes on
    assert json.loads(started[0].meta.read_text())["replay_of"] == str(run.path.resolve())


# ----------------------------------------------------------------------------- replay on Ray


def test_replay_of_a_finished_run_is_bit_equal(tmp_path, local_workers, capsys):
    root = tmp_path / "runs"
    original = root / "original"
    args = ["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(original)]
    assert cli.main(args + [a for o in TINY + ["cluster.num_workers=2"] for a in ("--set", o)]) == 0
    capsys.readouterr()

    fingerprint = json.loads((original / "summary.json").read_text())["fingerprint"]
    replayed = tmp_path / "replayed"
    assert cli.main(["replay", fingerprint[:5], "--root", str(root), "--run-dir", str(replayed)]) == 0
    err = capsys.readouterr().err
    assert "warning" not in err and "bit-equal to the original's" in err

    a = torch.load(original / "final.pt", weights_only=True)
    b = torch.load(replayed / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and len(a) > 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert json.loads((replayed / "summary.json").read_text())["fingerprint"] == fingerprint


def test_replay_carries_out_the_original_decisions_and_takes_none_of_its_own(tmp_path, local_workers, capsys):
    """The original's rank 1 computes 4x as long (inject.slow): samples move off it at a step the
    machine's timing picked. The replay is told rank 0 is the slow one instead: deciding anew, it
    would move samples off rank 0. It moves them as the original did, at the original's steps,
    off rank 1, and ends bit-equal."""
    root = tmp_path / "runs"
    original = root / "original"
    sets = TINY + ["train.steps=30", "train.global_batch_size=64", "cluster.num_workers=2", "parallel.strategy=data",
                   "optimizer.name=sgd", "optimizer.lr=0.05", "inject.slow={ranks: [1], factor: 4}"]
    assert cli.main(["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(original),
                     *[a for o in sets for a in ("--set", o)]]) == 0
    capsys.readouterr()

    def moves(run):
        records = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
        return [(r["applied_step"], r["shares"]) for r in records
                if r.get("event") == "decision" and r["decision"] == "rebalance" and r["applied_step"] is not None]

    before = moves(original)
    assert before and before[0][1][1] < before[0][1][0], before  # off the slow rank 1
    replayed = tmp_path / "replayed"
    assert cli.main(["replay", str(original), "--run-dir", str(replayed),
                     "--set", "inject.slow={ranks: [0], factor: 4}"]) == 0
    err = capsys.readouterr().err
    assert f"replaying the original's decisions at their steps (0 switch(es), 0 bucket_cap_mb change(s), " \
           f"{len(before)} rebalance(s)" in err, err
    assert moves(replayed) == before
    assert "bit-equal to the original's" in err, err


def test_a_script_takes_the_judged_moves_of_a_run_and_leaves_what_happens_again(tmp_path):
    """What `gearshift replay` carries out, read from an original's records: the policy's and
    tuning's switches, the buckets, the stragglers' moves that were carried out; not the forced
    schedule, an out-of-memory move or a move never carried out (they happen again, or never
    did)."""
    from gearshift.orchestrator.control.script import Script, ScriptError
    from gearshift.orchestrator.policy.rebalance import Drop, Rebalance
    from gearshift.orchestrator.policy.stages import Recut
    from gearshift.strategies.layout import Layout

    data2, tensor2 = {"strategy": "data", "dp": 2, "tp": 1}, {"strategy": "tensor", "dp": 1, "tp": 2}
    events = [
        {"event": "switch", "step": 10, "from": data2, "to": tensor2, "reason": "switch"},
        {"event": "switch", "step": 20, "from": tensor2, "to": data2, "reason": "revert"},
        {"event": "switch", "step": 25, "from": data2, "to": tensor2, "reason": "schedule"},
        {"event": "switch", "step": 26, "from": tensor2, "to": data2, "reason": "oom"},
        {"event": "switch", "step": 30, "from": data2, "to": tensor2, "reason": "tune", "bucket_cap_mb": 5.0},
        {"event": "bucket", "step": 12, "bucket_cap_mb": 25.0, "previous": 5.0},
        {"event": "decision", "decision": "rebalance", "seen_step": 14, "applied_step": 15, "shares": [40, 24],
         "evidence": {"replica": 1}},
        {"event": "decision", "decision": "rebalance", "seen_step": 16, "applied_step": None, "shares": [48, 16],
         "evidence": {}},
        {"event": "decision", "decision": "recut", "seen_step": 33, "applied_step": 34, "split": ["blocks.3"],
         "evidence": {"blocks_per_stage_after": [3, 1]}},
        {"event": "decision", "decision": "drop", "seen_step": 40, "applied_step": 41, "ranks": [1], "replicas": [1],
         "evidence": {}},
        {"event": "decision", "decision": "keep", "seen_step": 42, "applied_step": 42},
    ]
    telemetry = tmp_path / "telemetry.jsonl"
    telemetry.write_text("".join(json.dumps({"type": "event", **e}) + "\n" for e in events) + '{"type": "ev')
    script = Script.of_run(telemetry, {"strategy_history": [{"step": 0, **data2, "bucket_cap_mb": 25.0}]})
    assert script.start == Layout("data", 2, 1)
    assert sorted(script.switches) == [10, 20, 30] and script.switch_at(30).bucket == 5.0
    assert script.switch_at(10).to == Layout("tensor", 1, 2) and script.switch_at(25) is None
    assert script.buckets == {12: 25.0}
    assert script.straggler_at(15) == (Rebalance((40, 24), {"replica": 1}), 14) and script.straggler_at(17) is None
    assert script.straggler_at(34)[0] == Recut(("blocks.3",), (), {"blocks_per_stage_after": [3, 1]})
    assert script.straggler_at(41)[0] == Drop((1,), (1,), {})
    assert [script.next_step(s) for s in (0, 10, 15, 34, 41)] == [10, 12, 20, 41, None]
    telemetry.write_text("not json\n{}\n")
    with pytest.raises(ScriptError, match="line 1 is not JSON"):
        Script.of_run(telemetry, None)


def test_a_replay_restarted_at_its_switch_boundary_does_not_switch_again():
    """A replay restarted from the checkpoint of a boundary where it carried out the original's
    switch is on that layout already: TRAINING's begin switches only where the layout differs (a
    second switch there would be a record the original does not have)."""
    from types import SimpleNamespace

    from gearshift.orchestrator.control.script import Replayed, Script
    from gearshift.orchestrator.control.states.training import TrainingState
    from gearshift.strategies.layout import Layout

    switched = []
    tensor = Layout("tensor", 1, 2)
    script = Script(start=Layout("data", 2, 1), switches={10: Replayed(tensor, 10, None, {})})
    ctl = SimpleNamespace(
        job=load_job(ROOT / "examples/mlp.yaml", TINY + ["train.steps=20", "cluster.num_workers=2"]),
        layout=Layout("data", 2, 1), script=script, group=SimpleNamespace(),
        tuning=SimpleNamespace(grid=None, begin=lambda step: None, apply_bucket=lambda bucket, step: None),
        stragglers=SimpleNamespace(start_over=lambda: None, watching=False), make_policy=lambda: None)

    def switch(target, step, reason, evidence=None, bucket=None):
        switched.append((target, step, reason))
        ctl.layout = target

    ctl.switch = switch
    TrainingState(ctl).begin(10)  # the boundary, first reached: the switch is carried out
    assert switched == [(tensor, 10, "replay")]
    TrainingState(ctl).begin(10)  # restarted from step 10's checkpoint, on tensor already
    assert switched == [(tensor, 10, "replay")] and ctl.layout == tensor


def test_a_replay_switches_and_puts_buckets_in_force_where_the_original_did(tmp_path, local_workers, capsys):
    """bucket_cap_mb auto: the original's tuning round tries buckets at steps its timing picks, and
    a switch at step 8 (a forced schedule's, its record rewritten here as a judge's, so that only
    the replay's script can make it: the replay runs without the schedule). The replay takes no
    tuning round of its own: it puts each bucket in force and switches where the original did,
    and ends bit-equal."""
    original, replayed = tmp_path / "original", tmp_path / "replayed"
    sets = TINY + ["train.steps=16", "train.global_batch_size=64", "cluster.num_workers=2", "parallel.strategy=data",
                   "parallel.bucket_cap_mb=auto", "adapt.schedule=[{step: 8, strategy: tensor}]"]
    assert cli.main(["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(original),
                     *[a for o in sets for a in ("--set", o)]]) == 0
    lines = (original / "telemetry.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    for r in records:
        if r.get("event") == "switch" and r["reason"] == "schedule":
            r["reason"] = "switch"  # as strategy auto's policy writes its switches
    (original / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert cli.main(["replay", str(original), "--run-dir", str(replayed), "--set", "adapt.schedule=[]"]) == 0
    err = capsys.readouterr().err

    def moves(run):
        got = [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]
        return ([(r["step"], r["bucket_cap_mb"]) for r in got if r.get("event") == "bucket"],
                [(r["step"], r["to"]) for r in got if r.get("event") == "switch"],
                [r for r in got if r.get("event") == "tune_start"])

    buckets, switches, rounds = moves(original)
    assert buckets and rounds and switches == [(8, {"strategy": "tensor", "dp": 1, "tp": 2})]
    again = moves(replayed)
    assert again[0] == buckets and again[1] == switches and not again[2]  # no tuning round of its own
    assert "bit-equal to the original's" in err, err
