"""`gearshift report`: plots and summary from a synthetic telemetry.jsonl (pure logic, no Ray).

The figures the report prints are recomputed here straight from the records the test wrote, so a
wrong median, mean or mode in monitoring/report.py fails the test rather than agreeing with itself.
"""

from __future__ import annotations

import collections
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from matplotlib.image import imread

from gearshift.monitoring import report, schema
from gearshift.monitoring.telemetry import TelemetryError

ROOT = pathlib.Path(__file__).resolve().parents[1]
T0 = 1_800_000_000.0
TRAIN_START = T0 + 3.0  # `state training`; step k ends at TRAIN_START + 0.1 k
PNGS = ("throughput.png", "comm_wait.png", "utilisation.png", "loss.png")


def step_record(step, *, strategy="data", dp=2, tp=1, t=None, rng=None, tokens=128):
    rng = rng or np.random.default_rng(step)
    times = [0.09 + 0.01 * rng.random() for _ in range(2)]
    waits = [0.005 + 0.02 * rng.random() for _ in range(2)]
    sps = 64 / max(times)
    return {
        "type": "step", "time": TRAIN_START + 0.1 * step if t is None else t, "step": step, "ended_at": None,
        "strategy": strategy, "dp": dp, "tp": tp, "bucket_cap_mb": 25, "loss": 3.0 / (1 + step / 50), "lr": 1e-3,
        "step_time_max": max(times), "step_time_mean": sum(times) / 2, "slowest_rank": 1 if step % 3 else 0,
        "data_time_mean": 0.001, "data_time_max": 0.002, "compute_time_mean": 0.07,
        "comm_wait_mean": sum(waits) / 2, "comm_wait_max": max(waits),
        "comm_wait_frac_mean": sum(w / s for w, s in zip(waits, times)) / 2,
        "comm_wait_frac_max": max(w / s for w, s in zip(waits, times)),
        "comm_hidden_mean": None, "comm_hidden_frac_mean": None, "bubble_frac_mean": None, "link_wait_frac_mean": None, "comm_calls": 4, "samples_per_s": sps, "tokens_per_s": sps * tokens if tokens else None,
        "peak_mem_bytes": None,
        "ranks": {"step_time": times, "data_time": [0.001, 0.002], "compute_time": [0.07, 0.07],
                  "comm_wait": waits, "comm_wait_frac": [w / s for w, s in zip(waits, times)],
                  "samples_per_s": [32 / s for s in times]},
    }


def sample_record(rank, t, util, source="psutil"):
    return {"type": "sample", "time": t, "rank": rank, "node_ip": "10.0.0.1", "source": source, "device": "cpu",
            "util_pct": util, "mem_used_bytes": 1e9, "mem_total_bytes": 8e9, "power_w": None,
            "sm_clock_mhz": None, "host_cpu_pct": 50.0}


def event(name, t, **fields):
    return {"type": "event", "time": t, "event": name, **fields}


def synthetic_run(samples=True, tokens=128) -> list[dict]:
    """200 steps on 2 ranks: data layout to step 99, a decision and a switch to tensor at 100,
    checkpoints at 50 and 150, samples every 0.5 s per rank (from before training starts), done."""
    recs = [event("state", T0, state="placing", workers=2), event("state", T0 + 2, state="starting", workers=[]),
            event("state", TRAIN_START, state="training", from_step=0)]
    rng = np.random.default_rng(1)
    for k in range(1, 201):
        if k == 100:
            recs.append(event("decision", TRAIN_START + 9.85, decision="switch", evidence={"comm_wait": 0.3}))
            recs.append(event("switch", TRAIN_START + 9.9, step=99, **{"from": "data"}, to="tensor", seconds=0.05))
        kind = ("data", 2, 1) if k < 100 else ("tensor", 1, 2)
        recs.append(step_record(k, strategy=kind[0], dp=kind[1], tp=kind[2], rng=rng, tokens=tokens))
        if k in (50, 150):
            recs.append(event("checkpoint", TRAIN_START + 0.1 * k + 0.01, step=k, path=f"ck/step_{k:08d}"))
    if samples:
        for i in range(int((0.1 * 200 + 3) / 0.5)):
            t = T0 + 0.5 * i + 0.25
            recs += [sample_record(0, t, 80 + 10 * rng.random()), sample_record(1, t, 50 + 10 * rng.random())]
    recs.append(event("state", TRAIN_START + 20.05, state="done", step=200))
    recs.sort(key=lambda r: r["time"])
    return recs


def write_run(path: pathlib.Path, records, extra_lines=()) -> pathlib.Path:
    path.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    (path / "telemetry.jsonl").write_text("".join(line + "\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    records = synthetic_run()
    run = write_run(tmp_path_factory.mktemp("run"), records)
    return records, run, report.make_report(run)


def test_helpers_write_conforming_records():
    for r in synthetic_run() + synthetic_run(samples=False, tokens=None):
        assert schema.validate(r) == [], r


def test_pngs_are_real_images(made):
    _, run, result = made
    assert [p.name for p in result.paths] == list(PNGS)
    for name in PNGS:
        path = run / "report" / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = imread(path)
        assert image.shape == (400, 1000, 4)
        assert image[..., :3].std() > 0.05  # something was drawn, not a blank canvas
    assert (run / "report" / "report.txt").read_text() == result.summary_text + "\n"


def test_summary_figures_match_the_records(made):
    records, run, result = made
    s = result.summary
    steps = [r for r in records if r["type"] == "step"]
    sps = [r["samples_per_s"] for r in steps]
    assert (s["first_step"], s["last_step"], s["steps"]) == (1, 200, 200)
    assert s["samples_per_s_median"] == pytest.approx(np.median(sps))
    assert s["samples_per_s_p90"] == pytest.approx(np.percentile(sps, 90))
    assert s["tokens_per_s_median"] == pytest.approx(128 * np.median(sps))
    assert s["comm_wait_pct_mean"] == pytest.approx(100 * np.mean([r["comm_wait_frac_mean"] for r in steps]))
    assert s["comm_wait_pct_max"] == pytest.approx(100 * max(r["comm_wait_frac_max"] for r in steps))
    assert s["step_time_median_s"] == pytest.approx(np.median([r["step_time_max"] for r in steps]))
    (rank, count), = collections.Counter(r["slowest_rank"] for r in steps).most_common(1)
    assert (s["slowest_rank"], s["slowest_rank_steps"]) == (rank, count) == (1, 134)
    assert s["wall_time_s"] == pytest.approx(records[-1]["time"] - records[0]["time"])
    assert [(x["strategy"], x["first_step"], x["last_step"]) for x in s["strategies"]] == [
        ("data", 1, 99), ("tensor", 100, 200)]
    assert (s["checkpoints"], s["decisions"], s["switches"], s["final_state"]) == (2, 1, 1, "done")
    for r in (0, 1):  # samples from before training starts are not part of the mean
        util = [x["util_pct"] for x in records if x["type"] == "sample" and x["rank"] == r
                and TRAIN_START <= x["time"] <= steps[-1]["time"]]
        assert s["util_pct_mean_by_rank"][r] == pytest.approx(np.mean(util))
    text = result.summary_text
    for part in (str(run), "1..200", f"{np.median(sps):,.0f} samples/s", "rank 1 in 134 of 200 steps",
                 "data (dp=2 tp=1) steps 1..99, then tensor (dp=1 tp=2) steps 100..200", "2 checkpoints",
                 "1 decision,", "1 switch", "final state  done", "psutil", "worker CPU"):
        assert part in text, part


def test_time_to_step_and_markers():
    at, st = np.array([10.0, 11.0, 12.0]), np.array([0.0, 1.0, 2.0])
    assert report.time_to_step([10.5, 12.0, 9.0, 13.0], at, st).tolist() == [0.5, 2.0, 0.0, 2.0]
    assert np.isnan(report.time_to_step([9.0, 13.0], at, st, clamp=False)).all()
    # a resumed leg restarts at step 1 at t=20: the gap holds the earlier leg's last step (markers)
    # or is off the plot (samples), instead of sliding back from 2 to 1
    at, st = np.array([10.0, 11.0, 12.0, 20.0, 21.0]), np.array([0.0, 1.0, 2.0, 1.0, 2.0])
    assert report.time_to_step([15.0, 20.5, 25.0], at, st).tolist() == [2.0, 1.5, 2.0]
    assert report.time_to_step([15.0, 20.5], at, st, clamp=False)[1] == 1.5
    assert np.isnan(report.time_to_step([15.0], at, st, clamp=False)).all()

    records = synthetic_run() + [
        event("state", TRAIN_START + 5.05, state="failed", error="boom"),  # between steps 50 and 51
        event("resumed", TRAIN_START + 6, checkpoint="step_00000050", step=50),
        event("sampler", T0, rank=0, source="psutil"), event("mystery", T0)]
    got = sorted(report.markers(records))
    assert [(k, label) for k, _, label in got] == [("checkpoint", ""), ("checkpoint", ""), ("decision", ""),
                                                   ("failed", ""), ("resumed", ""), ("switch", "tensor")]
    assert [s for _, s, _ in got] == pytest.approx([50, 150, 98.5, 50.5, 50, 99], abs=1e-5)


def test_one_legend_entry_per_event_kind(tmp_path):
    steps = [step_record(k) for k in range(1, 101)]
    marks = [("checkpoint", float(k), "") for k in range(10, 101, 10)] + [("switch", 40.0, "tensor"),
                                                                          ("switch", 70.0, "data")]
    fig, ax = report._figure("t", "y")
    report._series(ax, report._col(steps, "step"), report._col(steps, "loss"), "loss", "C0")
    report._finish(fig, ax, marks, tmp_path / "x.png")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["loss (rolling median)", "checkpoint", "switch"]
    assert sorted(t.get_text() for t in ax.texts) == ["to data", "to tensor"]
    # a checkpoint every step would paint the plot grey: dense markers become ticks at the bottom
    fig, ax = report._figure("t", "y")
    report._finish(fig, ax, [("checkpoint", float(k), "") for k in range(1, 101)], tmp_path / "y.png")
    assert [t.get_text() for t in fig.legends[0].get_texts()] == ["checkpoint (ticks at the bottom)"]


def test_long_series_are_binned():
    _, ax = report._figure("t", "y")
    x = np.arange(1, 100_001, dtype=float)
    report._series(ax, x, np.random.default_rng(0).random(x.size), "samples/s", "C0")
    (line,) = ax.lines
    assert line.get_xdata().size == report.BINS


def test_run_without_samples_or_tokens(tmp_path):
    result = report.make_report(write_run(tmp_path / "run", synthetic_run(samples=False, tokens=None)),
                                tmp_path / "out")
    assert [p.name for p in result.paths] == ["throughput.png", "comm_wait.png", "loss.png"]
    assert not (tmp_path / "out" / "utilisation.png").exists()
    assert "no device samples in this run: no utilisation plot" in result.summary_text
    assert "tokens/s" not in result.summary_text and result.summary["tokens_per_s_median"] is None


def test_run_with_telemetry_off(tmp_path):
    records = synthetic_run(samples=False)
    for r in records:
        if r["type"] == "step":  # what `telemetry.enabled: false` writes: no timing breakdown
            r.update({k: None for k in r if k.startswith(("data_time", "compute_time", "comm_wait"))})
            r["ranks"].update({k: None for k in ("data_time", "compute_time", "comm_wait", "comm_wait_frac")})
        assert schema.validate(r) == [], r
    result = report.make_report(write_run(tmp_path, records))
    assert [p.name for p in result.paths] == ["throughput.png", "loss.png"]
    assert result.summary["comm_wait_pct_mean"] is None and "comm wait not recorded" in result.summary_text


def test_torn_line_unknown_records_and_events_are_skipped(tmp_path, made):
    records = synthetic_run()
    noisy = records[:10] + [{"type": "future", "time": T0 + 1}, event("mystery", T0 + 1), {"time": T0}] + records[10:]
    result = report.make_report(write_run(tmp_path, noisy, extra_lines=["42", '{"type": "step", "ti']))
    clean = dict(made[2].summary, run_dir=str(tmp_path))
    assert result.summary == clean


def test_resumed_run_keeps_the_later_steps_and_failures(tmp_path):
    leg1 = [step_record(k) for k in range(1, 121)] + [event("state", TRAIN_START + 12.05, state="failed",
                                                            error="WorkerFailed: rank 1 died")]
    t2 = TRAIN_START + 20  # the second leg re-runs 101..120
    leg2 = [event("state", t2 - 0.5, state="placing", workers=2), event("resumed", t2 - 0.2, checkpoint="c", step=100),
            event("state", t2, state="training", from_step=100)]
    leg2 += [step_record(k, t=t2 + 0.1 * (k - 100)) for k in range(101, 201)]
    result = report.make_report(write_run(tmp_path, leg1 + leg2))
    s = result.summary
    assert (s["steps"], s["last_step"], s["final_state"]) == (200, 200, "running or unknown")
    assert "20 step records were re-runs after a resume" in result.summary_text
    assert "still running, or it ended without a final record (last state: training)" in result.summary_text
    kinds = {k: step for k, step, _ in report.markers(leg1 + leg2)}
    assert kinds["resumed"] == 100 and kinds["failed"] == pytest.approx(120)

    failed = report.make_report(write_run(tmp_path / "f", leg1))
    assert failed.summary["final_state"] == "failed"
    assert "final state  failed: WorkerFailed: rank 1 died" in failed.summary_text


@pytest.mark.parametrize("setup, expected", [
    (lambda d: d / "nope", "does not exist"),
    (lambda d: d, "not a gearshift run dir"),
    (lambda d: write_run(d, []), "no telemetry records yet"),
    (lambda d: write_run(d, [event("state", T0, state="placing", workers=2)]), "still placing"),
    (lambda d: write_run(d, [event("state", T0, state="failed", error="no GPUs free")]),
     "failed before its first step: no GPUs free"),
])
def test_errors_say_what_to_do(tmp_path, setup, expected):
    with pytest.raises(TelemetryError, match=expected):
        report.make_report(setup(tmp_path))


def test_cli_report(made, tmp_path):
    _, run, _ = made
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    ok = subprocess.run([sys.executable, "-m", "gearshift", "report", str(run), "--out", str(tmp_path)],
                        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "slowest rank rank 1 in 134 of 200 steps" in ok.stdout
    assert f"plots: {tmp_path / 'throughput.png'}" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "gearshift", "report", str(tmp_path / "nope")],
                         capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert bad.returncode == 2
    assert "Traceback" not in bad.stderr and bad.stderr.startswith("gearshift: ")
    assert len(bad.stderr.strip().splitlines()) == 1
