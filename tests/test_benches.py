"""Every bench under bench/ can start, and every one runs: pyflakes finds no undefined name, unused
import or other mistake in any of them, each one's command line answers `--help` (its imports and
its argument parser), and each one runs its smoke form here, in CI. A bench that cannot start
fails this test rather than the next person who runs it (bench/costmodel.py once stopped at its
first line for months: a parameter shadowed the module it called, then a module it used was no
longer imported; bench/switch.py asked for layouts without their data-parallel size).

The smoke form of a bench (`--smoke`) is its smallest real form: the same code path as its full
form, through its set-up and at least its first measurement, at sizes that take seconds (a model
of 0.1M parameters, one repeat, a few steps). A bench that needs root and the two-namespace
testbed (bench/testbed/) takes `--dry-run` instead: its argument parsing and the runs it would
make, each one's `gearshift` arguments printed (adaptive, overlap and testbed.py: the testbed's
own commands too, and each run's job through every check `gearshift run` makes); nothing is
brought up. bench/costmodel.py is not here: its smoke test sits with the cost model's tests.

Each smoke run is a subprocess (this interpreter, the repository as its folder, HOME and TMPDIR
folders of its own), with a time limit, and must exit 0 and print what its first measurement
prints; a real run's output ends with its JSON line, which holds no `*_error` (benches that go
on past a failed part say so there). No process it started may outlive it: every process the
bench starts, Ray's included, carries a marker in its environment, and the test looks for it."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in [*ROOT.glob("bench/*.py"), *ROOT.glob("bench/testbed/*.py")] if p.name != "__init__.py")
# the benches' own helpers, imported by the benches: no command line of their own
HELPERS = {"ingest_data.py", "local_group.py", "slow_data.py", "cores.py"}
# benches whose smoke test lives elsewhere (with the tests of what they measure)
ELSEWHERE = {"costmodel.py"}
MARK = "GEARSHIFT_BENCH_SMOKE_MARK"  # in the environment of every process a smoke run starts


def test_every_bench_reads_clean_under_pyflakes():
    from pyflakes import api, reporter

    out, err = io.StringIO(), io.StringIO()
    found = sum(api.checkPath(str(p), reporter.Reporter(out, err)) for p in [*BENCHES, *ROOT.glob("tools/*.py")])
    assert BENCHES and found == 0, out.getvalue() + err.getvalue()


def test_the_installer_hands_pip_settings_to_uv(monkeypatch):
    """tools/install.py: what pip would read (here its environment variables) reaches uv, lists
    as uv reads them; a setting of uv's own is left as it is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("install", ROOT / "tools" / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    monkeypatch.setenv("PIP_FIND_LINKS", "/a/wheels /b/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///x/simple  file:///y/simple")
    monkeypatch.setenv("PIP_CONSTRAINT", "/c.txt")
    monkeypatch.setenv("UV_INDEX_URL", "https://mine.example/simple")
    monkeypatch.setenv("PIP_INDEX_URL", "https://theirs.example/simple")
    env = install.uv_env()
    assert env["UV_FIND_LINKS"] == "/a/wheels,/b/wheels" and env["UV_CONSTRAINT"] == "/c.txt"
    assert env["UV_EXTRA_INDEX_URL"] == "file:///x/simple file:///y/simple"
    assert env["UV_INDEX_URL"] == "https://mine.example/simple" and env["UV_INDEX_STRATEGY"] == "unsafe-best-match"


def test_the_helpers_listed_are_the_benches_without_a_command_line():
    """A new bench with no `__main__` is either a helper (listed above) or a bench that cannot run."""
    without = {p.name for p in BENCHES if "__main__" not in p.read_text()}
    assert without == HELPERS


@pytest.mark.parametrize("path", [p for p in BENCHES if p.name not in HELPERS], ids=lambda p: p.stem)
def test_every_bench_answers_help(path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", [str(path.parent), str(ROOT), *sys.path])
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    assert done.value.code == 0, shown.getvalue()
    assert "usage:" in shown.getvalue()


# ----------------------------------------------------------------------------- smoke runs

# How long a smoke run may go on: as long as it keeps printing, up to LIMIT_S; STALL_S without a
# new byte of output and it counts as stuck. A fixed limit on the whole run was a guess about the
# machine: bench/loop.py's smoke took 48 s in CI's part 1 and ended 240 s after its start beside a
# second suite (its exit 0 came with the limit's kill). The longest silence of a smoke here is the
# accumulation part's fresh spawned groups in loop.py and memory.py (about 20 s idle, four to five
# times that under a neighbour).
STALL_S, LIMIT_S = 240.0, 900.0


@dataclasses.dataclass(frozen=True)
class Smoke:
    bench: str  # its path in the repository
    args: tuple[str, ...]
    shows: tuple[str, ...]  # what the output holds once the first measurement is made
    ray: bool = False  # starts Ray (its own, embedded: the Ray tier runs it)
    dry: str = ""  # why a dry run and not the smallest real one (empty: a real run)

    @property
    def id(self) -> str:
        return pathlib.Path(self.bench).stem


TESTBED = "needs root: the testbed makes network namespaces, a shaped veth, cgroups (bench/testbed/)"
# Seconds each took here (2 cores, -n 2 --dist loadfile, this file alone): about 85 s for the
# tier without Ray and 155 s for the Ray tier; a machine busy with other work takes up to twice.
SMOKES = [
    # real runs that start no Ray: plain gloo processes (bench/local_group.py)
    Smoke("bench/switch.py", ("--smoke",), ("switch/step", "data    hybrid")),  # 11 s: 4 workers, 6 switches
    Smoke("bench/build_time.py", ("--smoke",), ("smoke exact ", "smoke per_shard ", "smoke pretrained ")),  # 15 s
    # 22 s: the memory part (steady states, both kinds of switch, evaluation), the cost model and a
    # pipeline's full-format save streamed and pickled (2 processes of its own); the finish, build
    # and checkpoint parts each start processes of their own (--quick runs them)
    Smoke("bench/memory.py", ("--smoke",), ("steady data", "switch data>fsdp", "fsdp4_over_data4_state",
                                            "pipeline (pp 2) full-format save")),
    # 19 s: the loader and accumulation comparisons; not the compile comparison, whose first (cold)
    # inductor compile alone takes 20-80 s here (`bench/loop.py --quick --only compile` runs it)
    Smoke("bench/loop.py", ("--smoke",), ("loader2/loader0 samples/s", "accum4/accum1: samples/s")),
    Smoke("bench/telemetry_overhead.py", ("--smoke",), ("worst case on/off", "tracking on/off")),  # 13 s
    Smoke("bench/dropout.py", ("--smoke",), ("sample/torch step time", "transient peak of a step")),  # 9 s: one process
    Smoke("bench/comm_wait.py", ("--smoke",), ("data    rank 1: wait rise / expected", "straggler data",
                                               "one worker: wait / step")),
    # real runs on a Ray of their own: embedded (elastic: a cluster of two nodes on this machine)
    Smoke("bench/attribute.py", ("--smoke",), ("steps 4..12", "Ray raylet"), ray=True),  # 10 s
    Smoke("bench/startup.py", ("--smoke",), ("repeat 1 default  first step", "rendezvous"), ray=True),  # 10 s
    Smoke("bench/strategies.py", ("--smoke",), ("mlp        2 tensor", "vs data"), ray=True),  # 13 s
    Smoke("bench/driver_io.py", ("--smoke",), ("final none repeat 0", "the driver read"), ray=True),  # 12 s
    Smoke("bench/served.py", ("--smoke",), ("repeat 0  served", "served / direct"), ray=True),  # 7 s
    # 14 s: gearshift against torchrun. Left out: Ray Train (TorchTrainer), which needs the `bench`
    # extra (ray[train]) that CI does not install, and gearshift joining a running Ray (one more Ray)
    Smoke("bench/overhead.py", ("--smoke",), ("repeat 1 torchrun", "ratio_gearshift_vs_torchrun"), ray=True),
    Smoke("bench/elastic.py", ("--smoke",), ("data   elastic", "shrink_s_over_step_s_data"), ray=True),  # 19 s
    Smoke("bench/pipeline_memory.py", ("--smoke",), ("data>pipeline>data   driver",), ray=True),  # 9 s
    # 25-40 s: two runs of 24 steps; whether a recut is made follows measured step times (beside another
    # smoke run none was, once): the smoke asks that the bench runs and says its figure, or that it has none
    Smoke("bench/recut.py", ("--smoke",), ("recut/static step time",), ray=True),
    Smoke("bench/ingest.py", ("--smoke",), ("repeat 1 ray", "repeat 1 map", "ray/map samples/s"), ray=True),  # 33 s
    Smoke("bench/serve.py", ("--smoke",), ("onnx-batched       clients   4",), ray=True),  # 25 s: one server
    # dry runs (2 s each): the testbed's benches
    Smoke("bench/adaptive.py", ("--quick", "--dry-run"), ("fixed_40mbit #1 pipeline", "auto: the job checked"),
          dry=TESTBED),
    Smoke("bench/overlap.py", ("--quick", "--dry-run"), ("repeat 1 before", "after: the job checked"), dry=TESTBED),
    Smoke("bench/straggler.py", ("--quick", "--dry-run"), ("slow #1 auto", "scenario #1"), dry=TESTBED),
    Smoke("bench/testbed/testbed.py", ("run", "examples/gpt.yaml", "--dry-run", "--own-cores", "--slow-node",
                                        "0.5@4", "--", "--run-dir", "runs/x", "--set", "cluster.num_workers=4"),
          ("starting the Ray worker node", "running the driver", "starts as data dp=4"), dry=TESTBED),
]


def test_every_bench_has_a_smoke_run():
    """A new bench gets its smoke form here too (or is a helper, or smoke-tested elsewhere)."""
    ran = {pathlib.Path(s.bench).name for s in SMOKES}
    assert ran == {p.name for p in BENCHES} - HELPERS - ELSEWHERE
    assert all((ROOT / s.bench).exists() for s in SMOKES)


def marked(value: str) -> list:
    """The processes whose environment holds the smoke run's marker (the run's own and whatever
    they started: Ray's daemons and workers too); processes of other users are not readable."""
    import psutil

    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if proc.environ().get(MARK) == value and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def stop_marked(value: str) -> list[str]:
    """Stop (SIGKILL, by pid) every process still carrying the marker; what they were."""
    import psutil

    left = marked(value)
    names = []
    for proc in left:
        with contextlib.suppress(psutil.Error):
            names.append(f"{proc.pid} {' '.join(proc.cmdline())[:120]}")
            proc.kill()
    psutil.wait_procs(left, timeout=10)
    return names


def run_smoke(smoke: Smoke, tmp_path: pathlib.Path) -> tuple[str, str]:
    """Run the bench's smoke form; its stdout and its stderr. Fails on a nonzero exit, on the time
    limit and on a process left behind."""
    value = uuid.uuid4().hex
    home = tmp_path / "home"
    home.mkdir()
    # a short folder: Ray's socket paths under TMPDIR must stay within 107 characters
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gs-smoke-", dir="/tmp"))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_JOB_ADDRESS")}
    env.update({MARK: value, "HOME": str(home), "TMPDIR": str(tmp), "RAY_USAGE_STATS_ENABLED": "0",
                "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
    # output to files, not pipes: a process left behind holding a pipe would keep a reader waiting
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    with stdout.open("w") as out, stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, str(ROOT / smoke.bench), *smoke.args], cwd=ROOT, env=env,
                                stdout=out, stderr=err, start_new_session=True)
    why = "was interrupted"
    try:
        why = wait_while_it_prints(proc, (stdout, stderr), STALL_S, LIMIT_S)
    finally:
        if why is not None:  # stuck, past the limit, or the test itself stopped
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stop_marked(value)
            proc.wait(timeout=30)
        # Ray's processes stop a moment after its shutdown returns: wait for them, then look
        deadline = time.monotonic() + 20
        while marked(value) and time.monotonic() < deadline:
            time.sleep(0.5)
        left = stop_marked(value)
        shutil.rmtree(tmp, ignore_errors=True)
    out, err = stdout.read_text(), stderr.read_text()
    assert why is None, f"{smoke.bench} {' '.join(smoke.args)} {why}; its output ends:\n{(out + err)[-3000:]}"
    assert proc.returncode == 0, f"{smoke.bench} exited {proc.returncode}; its output ends:\n{(out + err)[-4000:]}"
    assert not left, f"{smoke.bench} left processes behind (stopped now):\n" + "\n".join(left)
    return out, err


def wait_while_it_prints(proc: subprocess.Popen, outputs: tuple[pathlib.Path, ...], stall_s: float,
                         limit_s: float) -> str | None:
    """Wait for `proc` while it keeps writing to `outputs`: None once it has exited; why not, once
    it has written nothing for `stall_s` or run for `limit_s`."""
    start = last = time.monotonic()
    size = -1
    while proc.poll() is None:
        now = time.monotonic()
        written = sum(p.stat().st_size for p in outputs)
        if written != size:
            size, last = written, now
        if now - last > stall_s:
            return f"printed nothing for {stall_s:g} s (stuck)"
        if now - start > limit_s:
            return f"did not finish within {limit_s:g} s"
        time.sleep(0.5)
    return None


def check_output(smoke: Smoke, out: str, err: str) -> None:
    missing = [text for text in smoke.shows if text not in out + err]
    assert not missing, f"{smoke.bench}: its output lacks {missing}; it ends:\n{(out + err)[-3000:]}"


def check_figures(smoke: Smoke, out: str) -> None:
    """A real run ends with its JSON line on stdout (figures, or null and `*_error` where a part
    failed: a bench that goes on past a failed part)."""
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, f"{smoke.bench} printed no JSON line; its stdout ends:\n{out[-3000:]}"
    figures = json.loads(lines[-1])
    errors = {k: v for k, v in figures.items() if k.endswith("_error") and isinstance(v, str)}
    assert not errors, f"{smoke.bench}: a part failed: {errors}"


@pytest.mark.slow  # seconds each: out of the quick tier (make test), in CI's
@pytest.mark.timeout(LIMIT_S + 120)  # run_smoke's own limit, and its clean-up
@pytest.mark.parametrize("smoke", [s for s in SMOKES if not s.ray and not s.dry], ids=lambda s: s.id)
def test_smoke_run(smoke, tmp_path):
    """The bench's smallest real form, plain gloo processes and no Ray: it runs to its end and
    prints its first measurement and its figures."""
    out, err = run_smoke(smoke, tmp_path)
    check_output(smoke, out, err)
    check_figures(smoke, out)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(LIMIT_S + 120)
# in a part of CI's own (`alone`), two at a time and nothing else beside them: each starts a Ray of
# its own, and two beside the Ray tier's tests timed out starting it and slowed a timed fault test
# past its bound (two side by side: 124 s for the ten, against 162 s one at a time)
@pytest.mark.alone
@pytest.mark.parametrize("smoke", [s for s in SMOKES if s.ray], ids=lambda s: s.id)
def test_smoke_run_on_ray(smoke, tmp_path):
    """The bench's smallest real form on a Ray of its own (embedded, or a cluster of two nodes on
    this machine): it runs to its end, prints its first measurement and its figures, and no Ray
    process outlives it."""
    out, err = run_smoke(smoke, tmp_path)
    check_output(smoke, out, err)
    check_figures(smoke, out)


@pytest.mark.timeout(LIMIT_S + 120)
@pytest.mark.parametrize("smoke", [s for s in SMOKES if s.dry], ids=lambda s: s.id)
def test_dry_run(smoke, tmp_path):
    """A testbed bench's dry run (why not a real one: `smoke.dry`): its arguments parsed and the
    runs it would make printed (with their jobs through `gearshift run`'s checks where the bench
    does that); nothing brought up."""
    assert smoke.dry and "--dry-run" in smoke.args
    check_output(smoke, *run_smoke(smoke, tmp_path))


def test_a_smoke_run_may_take_as_long_as_it_keeps_printing(tmp_path):
    """The smoke runs' limit follows their output: one that prints goes on past the silence it
    is allowed (12 lines a quarter second apart against 2 s), one that falls silent is stopped."""
    out = tmp_path / "out"
    with out.open("w") as f:
        talks = subprocess.Popen(["sh", "-c", "for i in 1 2 3 4 5 6 7 8 9 10 11 12; do echo $i; sleep 0.25; done"],
                                 stdout=f)
    assert wait_while_it_prints(talks, (out,), stall_s=2.0, limit_s=120) is None and talks.returncode == 0
    assert out.read_text().split() == [str(i) for i in range(1, 13)]
    with out.open("w") as f:
        silent = subprocess.Popen(["sh", "-c", "echo start; exec sleep 120"], stdout=f)
    try:
        assert wait_while_it_prints(silent, (out,), stall_s=2.0, limit_s=120) == "printed nothing for 2 s (stuck)"
        assert silent.poll() is None  # it stops nothing itself: run_smoke kills the bench's group
    finally:
        silent.kill()
        silent.wait(10)
