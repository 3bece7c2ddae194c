"""`gearshift watch`: folding records, the view, following a growing file, and the CLI under a
real pseudo-terminal (the way a person runs it). No Ray: the runs are synthetic telemetry files."""

from __future__ import annotations

import fcntl
import io
import json
import os
import pathlib
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time

import pytest
from rich.console import Console

from gearshift.monitoring import watch
from gearshift.monitoring.schema import validate
from gearshift.monitoring.telemetry import LOG_PREFIX, TelemetryError

REPO = pathlib.Path(__file__).resolve().parents[1]
T0 = 1_800_000_000.0
WORLD = 4
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>]")
SLOW_RANK, COMM_RANK = 2, 3  # rank 2 takes longest per step; rank 3 waits 31 % of its step on collectives


def step(n: int, world: int = WORLD, loss: float | None = None, t: float | None = None, **extra) -> dict:
    times = [0.120 if r == SLOW_RANK else 0.100 for r in range(world)]
    frac = [0.31 if r == COMM_RANK else 0.05 for r in range(world)]
    comm = [f * s for f, s in zip(frac, times)]
    data = [0.002] * world
    slowest = max(range(world), key=lambda r: times[r])
    return {"type": "step", "time": T0 + 10 + n if t is None else t, "step": n, "ended_at": T0 + 10 + n, "strategy": "hybrid", "dp": 2,
            "tp": 2, "bucket_cap_mb": 25.0, "loss": 2.0 / n if loss is None else loss, "lr": 1e-3,
            "step_time_max": times[slowest], "step_time_mean": sum(times) / world, "slowest_rank": slowest,
            "data_time_mean": 0.002, "data_time_max": 0.002,
            "compute_time_mean": sum(s - c - d for s, c, d in zip(times, comm, data)) / world,
            "comm_wait_mean": sum(comm) / world, "comm_wait_max": max(comm),
            "comm_wait_frac_mean": sum(frac) / world, "comm_wait_frac_max": max(frac), "comm_hidden_mean": None, "comm_hidden_frac_mean": None, "bubble_frac_mean": None, "link_wait_frac_mean": None, "comm_calls": 3,
            "samples_per_s": 64 / times[slowest], "tokens_per_s": 64 * 128 / times[slowest],
            "peak_mem_bytes": 3 << 30,
            "ranks": {"step_time": times, "data_time": data,
                      "compute_time": [s - c - d for s, c, d in zip(times, comm, data)],
                      "comm_wait": comm, "comm_wait_frac": frac, "samples_per_s": [16 / s for s in times]},
            **extra}


def sample(rank: int, t: float = T0 + 11) -> dict:
    return {"type": "sample", "time": t, "rank": rank, "node_ip": f"10.0.0.{1 + rank // 2}", "source": "nvml",
            "device": f"cuda:{rank % 2} NVIDIA H200", "util_pct": 87.0 + rank, "mem_used_bytes": 12 * (1 << 30),
            "mem_total_bytes": 141 * (1 << 30), "power_w": 400.0, "sm_clock_mhz": 1980.0, "host_cpu_pct": None}


def event(name: str, t: float, **fields) -> dict:
    return {"type": "event", "time": t, "event": name, **fields}


def start_records(world: int = WORLD, steps: int = 10) -> list[dict]:
    workers = [{"rank": r, "node_ip": f"10.0.0.{1 + r // 2}", "pid": 1000 + r} for r in range(world)]
    return [event("state", T0, state="placing", workers=world, placement="pack"),
            event("state", T0 + 5, state="starting", workers=workers, layout={"kind": "hybrid", "dp": 2, "tp": 2}),
            event("state", T0 + 6, state="training", from_step=0, steps_target=steps)]


def finished_run(world: int = WORLD, steps: int = 10, end: str = "done") -> list[dict]:
    records = start_records(world, steps) + [sample(r) for r in range(world)]
    records += [step(n, world) for n in range(1, steps + 1)]
    records.insert(-3, event("decision", T0 + 17, decision={"action": "switch", "to": "hybrid dp=2 tp=2"},
                             evidence={"comm_wait_frac_mean": 0.31, "threshold": 0.15, "window": 5}))
    layouts = {"from": {"strategy": "data", "dp": 4, "tp": 1}, "to": {"strategy": "hybrid", "dp": 2, "tp": 2}}
    records.insert(-3, event("switch", T0 + 17.5, step=7, seconds=1.25, **layouts))
    records.append(event("checkpoint", T0 + 21, step=steps, path=f"checkpoints/step_{steps:08d}"))
    end_fields = {"step": steps} if end == "done" else {"error": "worker 3 died: OOM"}
    records.append(event("state", T0 + 22, state=end, **end_fields))
    return records


def text_of(renderable, width: int = 120) -> str:
    console = Console(file=io.StringIO(), width=width, force_terminal=False)
    console.print(renderable)
    return console.file.getvalue()


def row(text: str, rank: int) -> str:
    found = re.search(rf"^\s+{rank}\s{{2,}}\S.*$", text, re.MULTILINE)
    assert found, f"no row for rank {rank} in:\n{text}"
    return found.group(0)


def fold(records) -> watch.WatchState:
    state = watch.WatchState()
    for record in records:
        state.add(record)
    return state


class FakeClock:
    """Stands in for the `time` module inside gearshift.monitoring.watch: `sleep` is recorded and
    moves `monotonic` on at once, so pacing and idle timeouts are checked in the clock's own terms
    without waiting. A loop that would sleep past `limit_s` fails instead of spinning forever."""

    def __init__(self, limit_s: float = 600.0):
        self.now, self.slept, self.limit_s = 5.0, [], limit_s

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds
        assert sum(self.slept) <= self.limit_s, f"still sleeping after {self.limit_s:g} s of the fake clock"


def write_run(run_dir: pathlib.Path, records: list[dict]) -> pathlib.Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.yaml").write_text("name: synthetic\n")
    with open(run_dir / "telemetry.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return run_dir


# ---- the state and the view


def test_synthetic_records_conform_to_the_schema():
    for record in finished_run() + finished_run(end="failed"):
        assert validate(record) == [], record


def test_view_shows_workers_comm_wait_strategy_and_decisions():
    text = text_of(watch.render(fold(finished_run()), "runs/x"))
    assert "gearshift watch runs/x" in text and "state done" in text and "step 10/10" in text and "100%" in text
    assert "hybrid dp=2 tp=2" in text and "bucket_cap_mb 25" in text and "tokens/s" in text
    assert "4 worker(s) on 2 node(s)" in text and "4x NVIDIA H200" in text
    for r in range(WORLD):
        line = row(text, r)
        assert f"10.0.0.{1 + r // 2}" in line and f"{87 + r}% GPU" in line and "12.0/141.0 GiB" in line
        assert ("31.0%" if r == COMM_RANK else "5.0%") in line
        assert ("120.0" if r == SLOW_RANK else "100.0") in line
        assert ("slowest" in line) == (r == SLOW_RANK)
        assert ("comm-bound" in line) == (r == COMM_RANK)
    assert "last decisions and events" in text
    assert "action=switch" in text and "evidence: comm_wait_frac_mean=0.31, threshold=0.15" in text
    assert "data dp=4 tp=1 -> hybrid dp=2 tp=2 in 1.2 s" in text
    assert "checkpoint" in text and "step_00000010" in text


def test_a_failed_run_shows_its_error():
    state = fold(finished_run(end="failed"))
    text = text_of(watch.render(state))
    assert "state failed" in text and "worker 3 died: OOM" in text and state.ended


def test_view_with_pieces_missing():
    assert "waiting for records" in text_of(watch.render(watch.WatchState()))
    starting = text_of(watch.render(fold(start_records()[:2])))
    assert "state starting" in starting and "no steps yet" in starting and row(starting, 3)
    equal = step(1)
    equal["ranks"]["step_time"] = [0.1] * WORLD
    assert "slowest" not in text_of(watch.render(fold([equal])))
    # steps but no device samples, and one worker only
    one = text_of(watch.render(fold([step(1, world=1), step(2, world=1)])))
    assert "step 2" in one and "100.0" in row(one, 0) and "slowest" not in one
    # samples but no steps
    sampled = text_of(watch.render(fold([sample(0)])))
    assert "87% GPU" in row(sampled, 0)


def test_view_with_telemetry_off():
    record = step(1)  # telemetry.enabled: false leaves the timing fields null
    for name in ("data_time", "compute_time", "comm_wait", "comm_wait_frac"):
        record["ranks"][name] = None
    for name in ("data_time_mean", "data_time_max", "compute_time_mean", "comm_wait_mean", "comm_wait_max",
                 "comm_wait_frac_mean", "comm_wait_frac_max"):
        record[name] = None
    assert validate(record) == []
    text = text_of(watch.render(fold([record])))
    line = row(text, SLOW_RANK)
    assert "120.0" in line and "slowest" in line and "%" not in line and "comm-bound" not in text


def test_many_workers_fit_a_row_limit_keeping_the_slowest():
    records = [step(1, world=64)]
    records[0]["ranks"]["step_time"][50] = 0.5
    state = fold(records + [sample(r) for r in range(64)])
    full = text_of(watch.render(state))
    assert all(row(full, r) for r in range(64)) and "slowest" in row(full, 50)
    capped = text_of(watch.render(state, max_rows=10))
    assert "54 more ranks not shown" in capped and "slowest" in row(capped, 50)
    assert len(re.findall(r"^\s+\d+\s{2,}\S", capped, re.MULTILINE)) == 10


def test_events_are_capped_and_unknown_records_ignored():
    unknown = [{"type": "mystery"}, event("mystery", T0), "not a dict", event("sampler", T0, rank=0, source="nvml")]
    state = fold([event("checkpoint", T0 + i, step=i, path=f"c{i}") for i in range(10)] + unknown)
    assert [e["step"] for e in state.events] == [4, 5, 6, 7, 8, 9]
    assert state.state is None and state.step is None
    text_of(watch.render(state))
    state.add(event("sampler", T0 + 20, rank=1, source="psutil", reason="no NVIDIA driver"))
    assert "sampler" in text_of(watch.render(state)) and "no NVIDIA driver" in text_of(watch.render(state))


# ---- following a file


def test_follow_file_reads_a_growing_file_and_stops_at_the_end(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    path.write_text("")
    records = start_records() + [step(n) for n in range(1, 6)] + [event("state", T0 + 30, state="done", step=5)]
    lines = [json.dumps(r) + "\n" for r in records]
    followed = threading.Event()

    def writer():
        with open(path, "a") as f:
            for i, line in enumerate(lines):
                if i == 4:  # torn across two writes, with a pause a reader can fall into
                    f.write(line[:40])
                    f.flush()
                    time.sleep(0.15)
                    f.write(line[40:])
                else:
                    f.write(line)
                f.flush()
                time.sleep(0.02)
            followed.wait(60)  # the writer stays open until the reader is done: it has to stop by itself

    # An idle timeout of ten minutes and a wait of one: a reader that did not stop at the end
    # record (only after the idle timeout, or never) would still be reading when the wait ends.
    got = []
    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    reader = threading.Thread(target=lambda: got.extend(watch.follow_file(path, poll_s=0.02, idle_timeout_s=600)),
                              daemon=True)
    reader.start()
    reader.join(60)
    followed.set()
    assert not reader.is_alive(), "the reader did not stop at the run's end record"
    assert got == records


def test_follow_file_reads_past_an_end_when_a_resumed_leg_follows(tmp_path):
    first = finished_run(end="failed")
    second = start_records() + [step(11), event("state", T0 + 60, state="done", step=11)]
    write_run(tmp_path, first + second)
    got = list(watch.follow_file(tmp_path / "telemetry.jsonl", poll_s=0.01, idle_timeout_s=5))
    assert got == first + second
    assert fold(got).state == "done"


def test_follow_file_idle_timeout_ends_without_error(tmp_path, monkeypatch):
    run = write_run(tmp_path / "run", start_records() + [step(1)])
    clock = FakeClock()
    monkeypatch.setattr(watch, "time", clock)
    got = list(watch.follow_file(run / "telemetry.jsonl", poll_s=0.02, idle_timeout_s=0.3))
    assert len(got) == 4
    # It polled for the whole idle timeout (not stopping at the first end of the file) and stopped
    # at the first poll past it.
    assert set(clock.slept) == {0.02} and 0.3 <= sum(clock.slept) < 0.3 + 2 * 0.02, clock.slept


def test_follow_file_missing_or_not_telemetry(tmp_path):
    with pytest.raises(TelemetryError, match="not a gearshift run dir.*Pass a run dir"):
        watch.follow_file(tmp_path / "telemetry.jsonl")
    (tmp_path / "job.yaml").write_text("name: x\n")
    with pytest.raises(TelemetryError, match="not a gearshift telemetry file"):
        watch.follow_file(tmp_path / "job.yaml")


def test_follow_file_waits_for_a_run_that_has_not_started(tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    path = tmp_path / "telemetry.jsonl"
    assert list(watch.follow_file(path, poll_s=0.02, idle_timeout_s=0.2)) == []
    records = finished_run()
    threading.Timer(0.2, lambda: path.write_text("".join(json.dumps(r) + "\n" for r in records))).start()
    assert list(watch.follow_file(path, poll_s=0.02, idle_timeout_s=5)) == records


def test_records_from_log_lines():
    records = [step(1), event("state", T0, state="done")]
    lines = ["INFO job started\n", LOG_PREFIX + json.dumps(records[0]) + "\n", f"  {LOG_PREFIX}not json\n",
             f"\x1b[36m{LOG_PREFIX}{json.dumps(records[1])}\x1b[0m\r\n", f"{LOG_PREFIX}[1, 2]\n",
             "(pid=12) " + LOG_PREFIX + "{}\n", "\n"]
    assert list(watch.records_from_log_lines(lines)) == records


# ---- watch()


def test_watch_off_a_terminal_prints_the_final_view_once():
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    assert watch.watch(iter(finished_run()), console, title="r") == 0
    out = console.file.getvalue()
    assert out.count("gearshift watch r") == 1 and "state done" in out and "stopped waiting" not in out
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    assert watch.watch(iter(finished_run(end="failed")), console) == 1
    console = Console(file=io.StringIO(), width=120, force_terminal=False)
    assert watch.watch(iter(start_records()), console) == 0
    assert "stopped waiting" in console.file.getvalue()


def test_watch_on_a_terminal_redraws_per_refresh_not_per_record(monkeypatch):
    calls, drawn = [], threading.Event()
    real = watch.render

    def counting(*args, **kwargs):
        calls.append(1)
        drawn.set()
        return real(*args, **kwargs)

    monkeypatch.setattr(watch, "render", counting)
    records = finished_run(steps=3000)
    refresh_s = watch.REFRESH_S

    # With a refresh every ten minutes none falls due while the 3000 records come: the view is
    # drawn once, at the end, however long folding them takes, and never once per record.
    monkeypatch.setattr(watch, "REFRESH_S", 600.0)
    console = Console(file=io.StringIO(), width=120, height=40, force_terminal=True)
    assert watch.watch(iter(records), console) == 0
    assert len(calls) == 1
    assert "3000/3000" in ANSI.sub("", console.file.getvalue())

    # At the real refresh the view is redrawn while the source waits and no record comes (a
    # growing file between two steps): the redraws follow the clock, not the records.
    monkeypatch.setattr(watch, "REFRESH_S", refresh_s)
    redrawn = []

    def waiting_source():
        yield from records[:1500]
        drawn.clear()
        redrawn.append(drawn.wait(120 * refresh_s))
        yield from records[1500:]

    console = Console(file=io.StringIO(), width=120, height=40, force_terminal=True)
    assert watch.watch(waiting_source(), console) == 0
    assert redrawn == [True], "the view was not redrawn while the source waited"
    assert "3000/3000" in ANSI.sub("", console.file.getvalue())


def test_replay_paces_by_record_time_and_caps_long_pauses(monkeypatch):
    records = [step(1, t=T0), step(2, t=T0 + 10), step(3, t=T0 + 1000)]  # 10 s, then a 990 s pause
    clock = FakeClock()
    monkeypatch.setattr(watch, "time", clock)
    assert list(watch._paced(records, 100)) == records
    assert clock.slept == pytest.approx([0.1, watch.MAX_REPLAY_SLEEP_S])  # 0.1 s + a pause capped at 0.5 s, not 9.9 s
    clock.slept.clear()
    assert list(watch._paced(records, None)) == records
    assert clock.slept == []  # no speed: no pacing at all


def test_ctrl_c_stops_watching_cleanly():
    def interrupted():
        yield from start_records()
        raise KeyboardInterrupt

    for terminal in (True, False):
        console = Console(file=io.StringIO(), width=120, force_terminal=terminal)
        assert watch.watch(interrupted(), console) == 130
        out = ANSI.sub("", console.file.getvalue())
        assert "the run itself is not affected" in out and "state training" in out


# ---- the CLI under a pseudo-terminal

def run_in_pty(args: list[str], timeout_s: float = 120, during=None) -> tuple[int, str, str]:
    """`gearshift watch ARGS` on a 120x40 pseudo-terminal: (exit status, raw output, text without
    escape codes). `during(text so far, process)` is called as output arrives. The limit only
    stops a watch that would never end: a start of the command (its imports) and a few dozen
    frames take seconds alone and over 30 s beside another suite on two cores."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {k: v for k, v in os.environ.items()
           if k not in ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "PYTEST_CURRENT_TEST")}
    env.update(TERM="xterm-256color", COLUMNS="120", LINES="40")
    proc = subprocess.Popen([sys.executable, "-m", "gearshift", "watch", *args], cwd=REPO, env=env,
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    raw = b""
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if time.monotonic() > deadline:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                raise AssertionError(f"watch {args} still running after {timeout_s} s; output:\n"
                                     + ANSI.sub("", raw.decode(errors="replace")))
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: every holder of the slave side has closed it
                    data = b""
                if not data:
                    break
                raw += data
                if during:
                    during(ANSI.sub("", raw.decode(errors="replace")), proc)
        rc = proc.wait(timeout=5)
    finally:
        os.close(master)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    text = raw.decode(errors="replace")
    return rc, text, ANSI.sub("", text).replace("\r", "")


def assert_final_view(text: str, steps: int) -> None:
    assert "state done" in text and f"step {steps}/{steps}" in text and "hybrid dp=2 tp=2" in text
    for r in range(WORLD):
        line = row(text, r)
        assert ("31.0%" if r == COMM_RANK else "5.0%") in line and f"{87 + r}% GPU" in line
    assert "slowest" in row(text, SLOW_RANK) and "comm-bound" in row(text, COMM_RANK)


def test_cli_watch_finished_run_on_a_terminal(tmp_path):
    run = write_run(tmp_path / "run", finished_run())
    rc, raw, text = run_in_pty([str(run)])
    assert rc == 0, text
    assert_final_view(text, 10)
    assert "\x1b[?25l" in raw and raw.rfind("\x1b[?25h") > raw.rfind("\x1b[?25l")  # cursor given back
    assert "stopped waiting" not in text and "Traceback" not in text


def test_cli_watch_replay_on_a_terminal(tmp_path, monkeypatch):
    """The replay of a finished run draws its final view on a terminal. Its pacing is read off a
    fake clock (test_replay_... above), not the machine's: here the command line is checked to
    hand --speed to the replay, in process, and the real command to draw the run to its end."""
    from gearshift.orchestrator.commands import cli

    run = write_run(tmp_path / "run", finished_run())
    asked = []
    monkeypatch.setattr(watch, "watch", lambda records, console, replay_speed=None, title="": asked.append(
        replay_speed) or 0)
    assert cli.main(["watch", str(run), "--replay", "--speed", "1000"]) == 0
    assert cli.main(["watch", str(run)]) == 0
    assert asked == [1000.0, None]  # the speed asked for, and no pacing without --replay
    monkeypatch.undo()
    rc, _, text = run_in_pty([str(run), "--replay", "--speed", "1000"])
    assert rc == 0, text
    assert_final_view(text, 10)


def test_cli_watch_failed_run_exits_1(tmp_path):
    run = write_run(tmp_path / "run", finished_run(end="failed"))
    rc, _, text = run_in_pty([str(run)])
    assert rc == 1 and "worker 3 died: OOM" in text


def test_cli_watch_not_a_run_dir(tmp_path):
    rc, _, text = run_in_pty([str(tmp_path)])
    assert rc == 2 and "not a gearshift run dir" in text and "Traceback" not in text


def test_cli_watch_follows_a_live_run(tmp_path):
    records = start_records(steps=40) + [sample(r) for r in range(WORLD)] + [step(1), step(2)]
    run = write_run(tmp_path / "run", records)
    seen_early = threading.Event()

    def feed():  # the limits only stop a watch that never shows the run (run_in_pty's 120 s above them)
        assert seen_early.wait(100)
        with open(run / "telemetry.jsonl", "a") as f:
            for n in range(3, 41):
                f.write(json.dumps(step(n, loss=0.1234 if n == 40 else 1.0)) + "\n")
                if n % 10 == 0:
                    f.flush()
                    time.sleep(0.3)
            f.write(json.dumps(event("state", T0 + 60, state="done", step=40)) + "\n")

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    rc, _, text = run_in_pty([str(run), "--timeout", "100"],
                             during=lambda text, proc: "step 2/40" in text and seen_early.set())
    writer.join(5)
    assert seen_early.is_set()
    assert rc == 0, text
    assert_final_view(text, 40)
    assert "loss 0.1234" in text and "stopped waiting" not in text



def test_cli_watch_ctrl_c_leaves_the_terminal_sane(tmp_path):
    run = write_run(tmp_path / "run", start_records() + [step(1)])  # a live run: no end yet
    sent = []

    def interrupt(text, proc):
        if "step 1/10" in text and not sent:
            sent.append(os.kill(proc.pid, signal.SIGINT))

    rc, raw, text = run_in_pty([str(run)], during=interrupt)
    assert sent and rc == 130, text
    assert "the run itself is not affected" in text and "Traceback" not in text
    assert raw.rfind("\x1b[?25h") > raw.rfind("\x1b[?25l")


def test_watching_a_run_whose_driver_was_killed_ends_and_says_so(tmp_path):
    """A driver killed with SIGKILL writes no end record; watch must not wait for one forever."""
    import socket

    records = start_records(steps=100) + [step(n) for n in range(1, 6)]
    run_dir = write_run(tmp_path / "run", records)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)  # its pid now names no process
    (run_dir / "driver.json").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    # No --timeout: only seeing the driver gone can end the watch; one that waited for an end
    # record would run into the subprocess's limit.
    try:
        proc = subprocess.run([sys.executable, "-m", "gearshift", "watch", str(run_dir)], capture_output=True,
                              text=True, timeout=60, cwd=pathlib.Path(__file__).resolve().parents[1])
    except subprocess.TimeoutExpired:
        pytest.fail("watch kept waiting for the end record of a run whose driver is gone")
    assert proc.returncode == 1, proc.stderr
    assert "killed" in proc.stderr and f"--resume {run_dir}" in proc.stderr
