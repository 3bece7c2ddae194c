"""The two-namespace testbed leaves nothing behind: no namespaces, veths or Ray processes, after
success, after failure and after interruption. Needs root and iproute2 (CI runs as root)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "testbed"))


def _can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return False
    probe = f"gs-tb-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not _can_make_namespaces(),
                                                   reason="needs root and network namespaces")]


def namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(prefix)]


def processes_using(marker: str) -> list[int]:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if any(marker in part for part in p.info["cmdline"] or []):
                found.append(p.info["pid"])
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def veths() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show", "type", "veth"], capture_output=True, text=True).stdout
    return [line.split(":")[1].strip() for line in out.splitlines() if "gs0" in line]


def assert_clean(tag_prefix: str, temp: str) -> None:
    assert namespaces(tag_prefix) == []
    assert processes_using(temp) == [], "Ray processes of the testbed outlived it"
    assert veths() == []  # the veth pair goes with its namespaces


def test_up_runs_a_job_across_the_link_and_down_leaves_nothing(tmp_path):
    from testbed import Testbed

    with Testbed(rate="500mbit", tag=f"t{os.getpid()}") as tb:
        prefix, temp = f"gs-tb-{tb.tag}", str(tb.temp)
        assert sorted(namespaces(prefix)) == sorted(tb.ns)
        assert processes_using(temp), "no Ray processes in the namespaces"
        done = tb.run_driver(["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(tmp_path / "run"),
                              "--set", "train.steps=6", "--set", "checkpoint.every=0"], capture=True, timeout_s=300)
        assert done.returncode == 0, done.stderr[-2000:]
        import json

        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["nodes"] == sorted(tb.ips), "the two workers should sit on the two nodes"
    assert_clean(prefix, temp)


def test_a_failing_run_leaves_nothing(tmp_path):
    from testbed import Testbed

    with pytest.raises(RuntimeError, match="job failed"):
        with Testbed(rate="500mbit", tag=f"f{os.getpid()}") as tb:
            prefix, temp = f"gs-tb-{tb.tag}", str(tb.temp)
            done = tb.run_driver(["run", str(ROOT / "examples/mlp.yaml"), "--run-dir", str(tmp_path / "run"),
                                  "--set", "train.steps=0"], capture=True, timeout_s=120)
            assert done.returncode == 2  # a bad job: refused before anything starts
            raise RuntimeError("job failed")
    assert_clean(prefix, temp)


def test_ctrl_c_while_a_job_runs_leaves_nothing(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench/testbed/testbed.py"), "run", str(ROOT / "examples/gpt.yaml"), "--",
         "--run-dir", str(tmp_path / "run"), "--set", "train.steps=100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    prefix = f"gs-tb-{proc.pid % 100000}"
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "run" / "telemetry.jsonl").exists() or "step" not in \
                (tmp_path / "run" / "telemetry.jsonl").read_text():
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "the job never started training"
            time.sleep(0.5)
        temps = {part for pid in processes_using("gs-testbed-") for part in psutil.Process(pid).cmdline()
                 if "gs-testbed-" in part}
        os.kill(proc.pid, signal.SIGINT)  # Ctrl-C: the testbed process only, as a terminal would not
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert namespaces(prefix) == []
    for temp in temps:
        marker = temp.split("gs-testbed-")[1].split("/")[0]
        assert processes_using("gs-testbed-" + marker) == []
    assert veths() == []
