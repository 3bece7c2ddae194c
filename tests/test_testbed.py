"""The two-namespace testbed leaves nothing behind: no namespaces, veths or Ray processes, after
success, after failure and after interruption. Needs root and iproute2 (CI runs as root)."""

from __future__ import annotations

import contextlib
import json
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


needs_root = pytest.mark.skipif(not _can_make_namespaces(), reason="needs root and network namespaces")


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
    left = [g for c in ("cpuset", "cpu") for g in pathlib.Path("/sys/fs/cgroup", c).glob(f"{tag_prefix}-*")]
    assert left == [], left  # an own_cores testbed's groups go once their processes are gone


def cores_of(pid: int) -> frozenset:
    """The cores a process may run on ("0-2,4" -> {0, 1, 2, 4})."""
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            out = set()
            for part in line.split(":", 1)[1].strip().split(","):
                a, _, b = part.partition("-")
                out |= set(range(int(a), int(b or a) + 1))
            return frozenset(out)
    return frozenset()


@pytest.mark.slow
@pytest.mark.ray  # a Ray cluster in network namespaces
@needs_root
def test_up_runs_a_job_across_the_link_and_down_leaves_nothing(tmp_path):
    from testbed import Testbed, parse_scenario

    from testbed import _ns_pids

    with Testbed(rate="500mbit", tag=f"t{os.getpid()}", own_cores=True) as tb:
        prefix, temp = f"gs-tb-{tb.tag}", str(tb.temp)
        assert sorted(namespaces(prefix)) == sorted(tb.ns)
        assert processes_using(temp), "no Ray processes in the namespaces"
        # each node's Ray processes on that node's cores only
        for k, ns in enumerate(tb.ns):
            ray_pids = [pid for pid in _ns_pids(ns) if pid in processes_using(temp)]
            assert ray_pids and {cores_of(pid) for pid in ray_pids} == {frozenset(tb.cores.cores[k])}, k
        # the link changes when the run reaches step 20, read from its telemetry
        done = tb.run_driver(["run", str(ROOT / "examples/gpt.yaml"), "--run-dir", str(tmp_path / "run"),
                              "--set", "train.steps=60", "--set", "checkpoint.every=0"],
                             parse_scenario("500mbit@0,100mbit@20"), capture=True, timeout_s=300)
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["nodes"] == sorted(tb.ips), "the two workers should sit on the two nodes"
        assert [c[0] for c in tb.changes] == ["500mbit", "100mbit"]
        assert 20 <= tb.changes[1][2] < 60, tb.changes
        shaped = subprocess.run(["ip", "netns", "exec", tb.ns[0], "tc", "qdisc", "show", "dev", "gs0"],
                                capture_output=True, text=True).stdout
        assert "100Mbit" in shaped, shaped
    assert_clean(prefix, temp)


@pytest.mark.slow
@pytest.mark.ray  # a Ray cluster in network namespaces
@pytest.mark.extended  # make test-extended: the interrupted run below leaves nothing either, by the same teardown
@needs_root
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


@pytest.mark.slow
@pytest.mark.ray  # a Ray cluster in network namespaces
@needs_root
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
        if proc.poll() is None:  # the test fails (the exception above); leave the machine as it was
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            for ns in namespaces(prefix):
                pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30).stdout
                for pid in pids.split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=30)
    assert namespaces(prefix) == []
    for temp in temps:
        marker = temp.split("gs-testbed-")[1].split("/")[0]
        assert processes_using("gs-testbed-" + marker) == []
    assert veths() == []


@pytest.mark.slow
@pytest.mark.ray  # a Ray cluster in network namespaces
@needs_root
def test_comes_up_where_ray_never_ran(tmp_path, monkeypatch):
    """No ~/.ray/auth_token (HOME an empty folder): the testbed makes its own token, in its own
    folder, and both nodes and a client use it; HOME stays empty."""
    from testbed import Testbed, sh

    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    probe = ("import ray, sys\n"
             "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On\n"
             "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
             "ip = ray.remote(num_cpus=0.1)(ray.util.get_node_ip_address)\n"
             "nodes = [n['NodeID'] for n in ray.nodes() if n['Alive']]\n"
             "print(sorted(ray.get([ip.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes],"
             " timeout=60)))\n")
    with Testbed(rate="500mbit", tag=f"h{os.getpid()}", start_timeout_s=60) as tb:
        prefix, temp = f"gs-tb-{tb.tag}", str(tb.temp)
        assert tb.token_path.parent == tb.temp and oct(tb.token_path.stat().st_mode & 0o777) == "0o600"
        assert tb.env()["RAY_AUTH_TOKEN_PATH"] == str(tb.token_path)
        done = sh(*tb._in(tb.ns[0], sys.executable, "-c", probe, tb.address), env=tb.env(), timeout=120,
                  step="running a task on each node")
        assert done.stdout.split("\n")[-2] == str(sorted(tb.ips)), done.stdout  # a task ran on each node
    assert list(home.iterdir()) == [], "the testbed wrote into HOME"
    assert not pathlib.Path(temp).exists()
    assert_clean(prefix, temp)


@pytest.mark.slow
@pytest.mark.ray  # a Ray cluster in network namespaces
@needs_root
def test_a_failing_ray_start_says_what_ray_said_and_leaves_nothing(monkeypatch):
    from testbed import Testbed, TestbedError

    monkeypatch.setattr(Testbed, "_make_token", lambda self: None)  # RAY_AUTH_TOKEN_PATH names no file
    tb = Testbed(rate="500mbit", tag=f"e{os.getpid()}", start_timeout_s=60)
    with pytest.raises(TestbedError) as failed:
        with tb:
            pass
    message = str(failed.value)
    assert f"starting the Ray head in {tb.ns[0]} failed" in message
    assert "ray start --head" in message and "exited with status 1" in message
    assert "RAY_AUTH_TOKEN_PATH is set but file cannot be opened" in message, message  # Ray's own words
    assert_clean(f"gs-tb-{tb.tag}", str(tb.temp))


def test_a_failing_step_names_itself_its_command_and_what_it_printed():
    from testbed import TestbedError, sh

    with pytest.raises(TestbedError) as failed:
        sh(sys.executable, "-c", "import sys; print('fine so far'); print('line 1', file=sys.stderr); "
                                 "sys.exit('InvalidAuthToken: no token found')", step="starting the Ray head")
    message = str(failed.value)
    assert message.startswith("testbed: starting the Ray head failed: `")
    assert f"{sys.executable} -c" in message and "exited with status 1" in message
    assert message.endswith("exited with status 1. Its stderr ends:\nline 1\nInvalidAuthToken: no token found")

    with pytest.raises(TestbedError, match=r"(?s)a step failed: .* exited with status 3\. Its stdout ends:\nonly"):
        sh(sys.executable, "-c", "import sys; print('only on stdout'); sys.exit(3)")  # no stderr: stdout's tail
    with pytest.raises(TestbedError, match=r"(?s)waiting failed: .*did not finish within 0\.5 s"):
        sh(sys.executable, "-c", "import time; time.sleep(30)", timeout=0.5, step="waiting")
    assert sh(sys.executable, "-c", "import sys; sys.exit(4)", check=False).returncode == 4


def test_every_process_gets_the_testbeds_own_token(tmp_path, monkeypatch):
    from testbed import Testbed

    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses")  # Ray's loader would prefer it to the file
    tb = Testbed.__new__(Testbed)  # no namespaces: only the token and the environment
    tb.token_path = tmp_path / "auth_token"
    tb._make_token()
    token = tb.token_path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0
    assert oct(tb.token_path.stat().st_mode & 0o777) == "0o600"
    env = tb.env()
    assert env["RAY_AUTH_MODE"] == "token" and env["RAY_AUTH_TOKEN_PATH"] == str(tb.token_path)
    assert "RAY_AUTH_TOKEN" not in env


def test_scenarios_parse_by_seconds_or_by_step():
    from testbed import Phase, parse_scenario

    assert parse_scenario("1gbit:20,50mbit:40") == [Phase("1gbit", seconds=20.0), Phase("50mbit", seconds=40.0)]
    assert parse_scenario("1gbit@0,50mbit@60,1gbit@240") == [
        Phase("1gbit", from_step=0), Phase("50mbit", from_step=60), Phase("1gbit", from_step=240)]
    assert str(Phase("50mbit", from_step=60)) == "50mbit@60"


@pytest.mark.parametrize("text, says", [
    ("1gbit", "RATE:SECONDS"), ("1gbit:x", "RATE:SECONDS"), (":5", "RATE:SECONDS"), ("1gbit@-3", "RATE@STEP"),
    ("1gbit:5,50mbit@10", "every part"), ("1gbit@50,50mbit@10", "must not decrease"),
])
def test_bad_scenarios_say_what_is_wrong(text, says):
    from testbed import parse_scenario

    with pytest.raises(SystemExit, match=says):
        parse_scenario(text)


def test_step_reader_follows_a_growing_file_and_skips_a_partial_line(tmp_path):
    from testbed import _StepReader

    path = tmp_path / "telemetry.jsonl"
    reader = _StepReader(path)
    assert reader.latest() == 0  # not there yet
    path.write_text('{"type": "event", "event": "state"}\n{"type": "step", "step": 3}\n{"type": "st')
    assert reader.latest() == 3
    with path.open("a") as f:
        f.write('ep", "step": 9}\n')
    assert reader.latest() == 9
