"""A two-node Ray cluster with a real slow link, on one machine (run as root).

Two network namespaces, joined by a veth pair whose rate `tc` shapes (tbf), hold one Ray node
each: the head in the first, a worker node in the second. Inside a namespace, workers talk over
local delivery (the fast link inside a node); between the namespaces every byte crosses the
shaped veth (the slow link between nodes). The gearshift driver runs in the head's namespace.

    sudo python bench/testbed/testbed.py run examples/gpt.yaml --rate 200mbit -- --set cluster.num_workers=4
        (arguments after -- go to `gearshift run`)
    sudo python bench/testbed/testbed.py run JOB.yaml --scenario 1000mbit:20,50mbit:40,1000mbit:20
    sudo python bench/testbed/testbed.py run JOB.yaml --scenario 1gbit@0,50mbit@100,1gbit@300 -- --run-dir runs/x
    sudo python bench/testbed/testbed.py run JOB.yaml --own-cores --slow-node 0.5 -- ...
        (node 1, the worker node, at half its cores' time from the start: a slow node)
    sudo python bench/testbed/testbed.py run JOB.yaml --own-cores --slow-node 0.5@60,1.0@140 -- --run-dir runs/x
        (node 1 at half from training step 60, back to full from step 140; --slow-node-index K: node K)
    python bench/testbed/testbed.py run JOB.yaml --dry-run -- ...
        (every command it would run, printed; nothing made, no root needed)
    sudo python bench/testbed/testbed.py check      # what would be left behind (namespaces, veths, Ray)
    sudo python bench/testbed/testbed.py clean      # take down what a testbed killed with SIGKILL left

Everything it starts lives inside its two namespaces; teardown stops exactly the processes that
`ip netns pids` lists there (never a name-wide kill such as `ray stop`), then deletes the
namespaces, which takes the veth pair with them. Teardown runs on success, on failure and on
Ctrl-C or SIGTERM.

Ray's heads turn token auth on, and every node and client must then present the cluster's token.
The testbed makes its own (a random one, as `ray get-auth-token --generate` would) in its temporary
folder and hands it to every process it starts through RAY_AUTH_TOKEN_PATH, so it works where Ray
never ran and never reads or writes ~/.ray. A step that fails raises TestbedError, naming the
step and the command with the end of what the command printed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from cores import NodeCores

ROOT = pathlib.Path(__file__).resolve().parents[2]
PREFIX = "gs-tb"  # every namespace this testbed makes is named PREFIX-<tag>-{a,b}
SUBNET = "10.77.{n}.{host}"
RAY_PORT = 6379


class TestbedError(RuntimeError):
    """A step of bringing the testbed up (or of reading its state) failed; the message says which."""


def sh(*argv: str, check: bool = True, timeout: float = 60, step: str | None = None,
       **kw) -> subprocess.CompletedProcess:
    """Run ARGV, output captured. With check, a nonzero exit or a timeout raises TestbedError that
    names STEP and the command, with the end of its stderr (of its stdout where stderr is empty)."""
    try:
        done = subprocess.run(list(argv), timeout=timeout, capture_output=True, text=True, **kw)
    except subprocess.TimeoutExpired as e:
        raise TestbedError(_failed(step, argv, f"did not finish within {timeout:g} s",
                                   _text(e.stderr), _text(e.stdout))) from None
    if check and done.returncode != 0:
        raise TestbedError(_failed(step, argv, f"exited with status {done.returncode}", done.stderr, done.stdout))
    return done


def _text(out: str | bytes | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else out or ""


def _failed(step: str | None, argv, what: str, stderr: str, stdout: str = "", lines: int = 12,
            chars: int = 3000) -> str:
    """One paragraph: the step, the command, what went wrong, then the end of its stderr (of its
    stdout where it wrote nothing to stderr)."""
    stream, output = ("stderr", stderr) if stderr.strip() else ("stdout", stdout)
    tail = "\n".join(output.strip().splitlines()[-lines:])[-chars:]
    said = f" Its {stream} ends:\n{tail}" if tail else " It printed nothing."
    return f"testbed: {step or 'a step'} failed: `{shlex.join(map(str, argv))}` {what}.{said}"


def leftovers() -> dict:
    """Namespaces, and processes inside them, that a testbed made and did not take down."""
    listed = sh("ip", "netns", "list", step="listing network namespaces").stdout
    names = [line.split()[0] for line in listed.splitlines() if line.startswith(PREFIX)]
    pids = {ns: _ns_pids(ns) for ns in names}
    return {"namespaces": names, "pids": {ns: p for ns, p in pids.items() if p}, "cgroups": _cgroups()}


def _cgroups() -> list[str]:
    """The cgroups an own_cores testbed made (cores.py), left behind."""
    from cores import CGROUP

    return sorted(str(g) for c in ("cpuset", "cpu") if (CGROUP / c).is_dir() for g in (CGROUP / c).glob(f"{PREFIX}-*"))


def _ns_pids(ns: str) -> list[int]:
    out = sh("ip", "netns", "pids", ns, check=False).stdout
    return [int(p) for p in out.split()]


class Testbed:
    """`with Testbed(rate="200mbit") as tb: tb.run_driver([...])` — up on enter, down on exit."""

    def __init__(self, rate: str = "200mbit", cpus: tuple[float, float] = (1, 1), tag: str | None = None,
                 burst: str = "256kb", delay_ms: float = 0.0, start_timeout_s: float = 90,
                 own_cores: bool = False, dry_run: bool = False):
        # dry_run: a testbed that only says what it would run (plan(), driver_command()); it
        # needs no root and brings nothing up
        self.dry_run = dry_run
        if os.geteuid() != 0 and not dry_run:
            raise SystemExit("the testbed makes network namespaces and shapes links: run it as root")
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None and not dry_run:
                raise SystemExit(f"the testbed needs `{tool}` (iproute2)")
        self.tag = tag or f"{os.getpid() % 100000}"
        self.ns = (f"{PREFIX}-{self.tag}-a", f"{PREFIX}-{self.tag}-b")
        n = os.getpid() % 200 + 10
        self.ips = (SUBNET.format(n=n, host=1), SUBNET.format(n=n, host=2))
        self.rate, self.burst, self.delay_ms = rate, burst, delay_ms
        self.cpus = cpus
        self.own_cores = own_cores  # each node on cores of its own (cores.py), as real nodes have their own devices
        self.cores: NodeCores | None = None
        self.start_timeout_s = start_timeout_s
        self.temp = (pathlib.Path(tempfile.gettempdir()) / "gs-testbed-XXXXXXXX" if dry_run
                     else pathlib.Path(tempfile.mkdtemp(prefix="gs-testbed-")))
        self.token_path = self.temp / "auth_token"  # made in up(), given to every process as RAY_AUTH_TOKEN_PATH
        self.address = f"{self.ips[0]}:{RAY_PORT}"
        self._up = False

    # ------------------------------------------------------------------ up

    def __enter__(self) -> Testbed:
        # SIGTERM (a scheduler, `kill`) must unwind like Ctrl-C, or the teardown below never runs
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.down()
        finally:
            if self._previous is not None:
                signal.signal(signal.SIGTERM, self._previous)

    def up(self) -> None:
        if self.dry_run:
            raise TestbedError("a dry-run testbed brings nothing up: it only lists what it would run (plan())")
        self._up = True  # from here on, down() has something to take down
        for step, argv in self._link_steps():
            sh(*argv, step=step)
        if self.own_cores:
            self.cores = NodeCores(self.tag, nodes=len(self.ns))
        self._make_token()
        self._start_ray()

    def _link_steps(self) -> list[tuple[str, list[str]]]:
        """(step, argv) of each command that makes the two namespaces and the shaped link, in order."""
        a, b = self.ns
        steps = []
        for ns in self.ns:
            steps += [(f"making network namespace {ns}", ["ip", "netns", "add", ns]),
                      (f"bringing up lo in {ns}", ["ip", "-n", ns, "link", "set", "lo", "up"])]
        # one veth pair, each end called gs0 inside its namespace (names are per namespace)
        steps.append(("making the veth pair between the namespaces",
                      ["ip", "link", "add", "gs0", "netns", a, "type", "veth", "peer", "name", "gs0", "netns", b]))
        for ns, ip in zip(self.ns, self.ips):
            steps += [(f"giving gs0 in {ns} address {ip}", ["ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "gs0"]),
                      (f"bringing up gs0 in {ns}", ["ip", "-n", ns, "link", "set", "gs0", "up"]),
                      *self._shape_steps(ns, "add")]
        return steps

    def plan(self, argv: list[str]) -> list[tuple[str, list[str]]]:
        """(step, argv) of the commands that bring the testbed up and run `gearshift ARGV` on it, in
        order (with own_cores, up() also makes each node's cgroups first and starts the node's
        commands inside them; a testbed not yet up lists them unwrapped)."""
        return [*self._link_steps(), *self._ray_steps(), ("running the driver", self.driver_command(argv))]

    def _make_token(self) -> None:
        """The cluster's auth token: random, like Ray's own (`ray get-auth-token --generate`, 32
        random bytes in hex), but in the testbed's folder, never in ~/.ray (HOME may be anywhere)."""
        fd = os.open(self.token_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))

    def _shape(self, ns: str, verb: str) -> None:
        for step, argv in self._shape_steps(ns, verb):
            sh(*argv, step=step)

    def _shape_steps(self, ns: str, verb: str) -> list[tuple[str, list[str]]]:
        """tbf on the veth end: both directions of the link are shaped to the rate."""
        qdisc = ["tbf", "rate", self.rate, "burst", self.burst, "latency", "100ms"]
        step = f"shaping gs0 in {ns} to {self.rate}"
        if self.delay_ms:  # netem is missing on some kernels; add delay only where asked
            return [(f"adding {self.delay_ms:g} ms delay (netem) to gs0 in {ns}",
                     ["tc", "-n", ns, "qdisc", verb, "dev", "gs0", "root", "handle", "1:", "netem",
                      "delay", f"{self.delay_ms}ms"]),
                    (step, ["tc", "-n", ns, "qdisc", verb, "dev", "gs0", "parent", "1:", "handle", "2:", *qdisc])]
        return [(step, ["tc", "-n", ns, "qdisc", verb, "dev", "gs0", "root", *qdisc])]

    def set_rate(self, rate: str) -> None:
        """Change the link's rate while a run trains (both ends)."""
        self.rate = rate
        for ns in self.ns:
            self._shape(ns, "change")

    def env(self) -> dict:
        env = dict(os.environ)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(self.token_path), GLOO_SOCKET_IFNAME="gs0",
                   PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
        env.pop("RAY_ADDRESS", None)
        env.pop("RAY_AUTH_TOKEN", None)  # Ray's loader would take it before RAY_AUTH_TOKEN_PATH
        return env

    def _in(self, ns: str, *argv: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def _node(self, k: int, *argv: str) -> list[str]:
        """ARGV in node K's namespace and, with own_cores, on node K's cores."""
        cmd = self._in(self.ns[k], *argv)
        return self.cores.wrap(k, cmd) if self.cores else cmd

    def set_node_share(self, node: int, share: float) -> None:
        """Node NODE's processes at SHARE of its cores' time while a run trains (needs own_cores)."""
        if self.cores is None:
            raise TestbedError("a node's share of its cores needs the testbed made with own_cores=True")
        self.cores.set_share(node, share)

    def _start_ray(self) -> None:
        for step, argv in self._ray_steps():
            sh(*argv, env=self.env(), timeout=self.start_timeout_s, step=step)
        self._wait_for_nodes(2)

    def _ray_steps(self) -> list[tuple[str, list[str]]]:
        """(step, argv) of the head's `ray start`, then the worker node's."""
        ray = str(pathlib.Path(sys.executable).with_name("ray"))
        common = ["--disable-usage-stats", "--temp-dir", str(self.temp / "ray"), "--num-gpus", "0"]
        return [(f"starting the Ray head in {self.ns[0]}",
                 self._node(0, ray, "start", "--head", "--node-ip-address", self.ips[0], "--port", str(RAY_PORT),
                            "--num-cpus", str(self.cpus[0]), "--include-dashboard", "false", *common)),
                (f"starting the Ray worker node in {self.ns[1]}",
                 self._node(1, ray, "start", "--address", self.address, "--node-ip-address", self.ips[1],
                            "--num-cpus", str(self.cpus[1]), *common))]

    def driver_command(self, argv: list[str]) -> list[str]:
        """`python -m gearshift ARGV --address HEAD` in the head's namespace: what run_driver runs."""
        return self._in(self.ns[0], sys.executable, "-m", "gearshift", *argv, "--address", self.address)

    def _wait_for_nodes(self, count: int) -> None:
        probe = ("import ray, time\n"
                 f"ray.init(address='{self.address}', logging_level='ERROR')\n"
                 f"deadline = time.time() + {self.start_timeout_s}\n"
                 f"while len([n for n in ray.nodes() if n['Alive']]) < {count} and time.time() < deadline:\n"
                 "    time.sleep(0.5)\n"
                 "print(len([n for n in ray.nodes() if n['Alive']]))\n")
        cmd = self._in(self.ns[0], sys.executable, "-c", probe)
        step = f"waiting for the Ray cluster at {self.address} to have {count} nodes"
        out = sh(*cmd, env=self.env(), timeout=self.start_timeout_s + 30, step=step)
        if out.stdout.strip().splitlines()[-1:] != [str(count)]:
            alive = (out.stdout.strip().splitlines() or ["?"])[-1]
            raise TestbedError(_failed(step, cmd, f"saw {alive} alive after {self.start_timeout_s:g} s",
                                       out.stderr, out.stdout))

    # ------------------------------------------------------------------ run

    def run_driver(self, argv: list[str], scenario: list[Phase] | None = None,
                   timeout_s: float = 3600, capture: bool = False, slow_node: list[SharePhase] | None = None,
                   slow_node_index: int = 1) -> subprocess.CompletedProcess:
        """Run `python -m gearshift ARGV --address HEAD` in the head's namespace. With a
        scenario the link's rate follows it while the driver runs: phases timed in seconds from
        the driver's start, or starting at a training step, read from the run's telemetry.jsonl
        (ARGV must then give --run-dir). `self.changes` lists (rate, seconds, step) as applied.
        With `slow_node` (own_cores only) node `slow_node_index` runs at each phase's share of its
        cores' time from the phase's step on (a phase from step 0 before the driver starts);
        `self.share_changes` lists (share, seconds, step) as applied, seconds counted from
        `self.started_at` (wall clock, the driver's start), and the node is back at its full share
        when this returns, however the run ended. A change follows the step the telemetry has
        reached, which trails the workers by a few steps: to find the step it landed at, compare
        started_at + seconds with the step records' `ended_at`."""
        cmd = self.driver_command(argv)
        self.started_at, start = time.time(), time.monotonic()
        run_dir = argv[argv.index("--run-dir") + 1] if "--run-dir" in argv else None
        self.changes: list[tuple[str, float, int | None]] = []
        self.share_changes: list[tuple[float, float, int | None]] = []
        if scenario and any(p.from_step is not None for p in scenario) and run_dir is None:
            raise ValueError("a scenario with RATE@STEP phases needs --run-dir in the driver's arguments")
        if slow_node:
            self._check_slow_node(slow_node, slow_node_index, run_dir)
        stop = threading.Event()
        followers = []
        if scenario:
            followers.append(threading.Thread(target=self._follow, args=(scenario, stop, run_dir), daemon=True))
        if slow_node:
            followers.append(threading.Thread(target=self._follow_share, daemon=True,
                                              args=(slow_node, slow_node_index, stop, run_dir, start)))
        try:
            for phase in (p for p in slow_node or [] if p.from_step == 0):  # from the start: before any worker
                self._apply_share(slow_node_index, phase, 0.0, None)
            for follower in followers:
                follower.start()
            return subprocess.run(cmd, env=self.env(), cwd=ROOT, timeout=timeout_s, text=True,
                                  capture_output=capture)
        finally:
            stop.set()
            for follower in followers:
                if follower.ident is not None:  # started
                    follower.join(timeout=10)
            if slow_node:
                self._lift_shares()

    def _check_slow_node(self, phases: list[SharePhase], node: int, run_dir: str | None) -> None:
        if self.cores is None:
            raise TestbedError("a slow node (a node held to a share of its cores' time) needs the testbed made "
                               "with own_cores=True (--own-cores)")
        if not 0 <= node < len(self.ns):
            raise ValueError(f"the slow node's index is 0..{len(self.ns) - 1}, not {node}")
        if any(p.from_step > 0 for p in phases) and run_dir is None:
            raise ValueError("a slow node with SHARE@STEP phases needs --run-dir in the driver's arguments")

    def _follow(self, scenario: list[Phase], stop: threading.Event, run_dir: str | None) -> None:
        start = time.monotonic()
        steps = _StepReader(pathlib.Path(run_dir) / "telemetry.jsonl") if run_dir else None
        for i, phase in enumerate(scenario):
            if phase.from_step is not None and i and not _reach(steps, phase.from_step, stop):
                return
            self.set_rate(phase.rate)
            step = steps.latest() if steps else None
            self.changes.append((phase.rate, round(time.monotonic() - start, 2), step))
            print(f"testbed: link at {phase.rate} ({phase}; now step {step})", file=sys.stderr, flush=True)
            if phase.seconds is not None and stop.wait(phase.seconds):
                return

    def _follow_share(self, phases: list[SharePhase], node: int, stop: threading.Event, run_dir: str | None,
                      start: float) -> None:
        """The slow node's share through the run: each phase from its step on (read from the run's
        telemetry); a first phase from step 0 was applied before the driver started."""
        steps = _StepReader(pathlib.Path(run_dir) / "telemetry.jsonl") if run_dir else None
        for phase in phases:
            if phase.from_step == 0:
                continue
            if not _reach(steps, phase.from_step, stop):
                return
            self._apply_share(node, phase, round(time.monotonic() - start, 2), steps.latest())

    def _apply_share(self, node: int, phase: SharePhase, seconds: float, step: int | None) -> None:
        self.set_node_share(node, phase.share)
        self.share_changes.append((phase.share, seconds, step))
        print(f"testbed: node {node} at {phase.share:g} of its cores' time ({phase}; now step {step})",
              file=sys.stderr, flush=True)

    def _lift_shares(self) -> None:
        """Every node back at its full share (the quota lifted): nothing stays throttled."""
        if self.cores is None:
            return
        for node, share in enumerate(self.cores.shares):
            if share != 1:
                with contextlib.suppress(OSError):
                    self.cores.set_share(node, 1.0)

    # ------------------------------------------------------------------ down

    def down(self) -> None:
        """Stop every process in the namespaces by pid (TERM, then KILL), delete the namespaces."""
        if not self._up:
            return
        self._lift_shares()  # a throttled node's processes stop sooner at full speed
        for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            pids = [p for ns in self.ns for p in _ns_pids(ns)]
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(_ns_pids(ns) for ns in self.ns):
                time.sleep(0.2)
        if self.cores is not None:  # the groups' own processes too (a node's stray child outside the netns)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                for pid in self.cores.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
                deadline = time.monotonic() + 5
                while self.cores.pids() and time.monotonic() < deadline:
                    time.sleep(0.2)
            left = self.cores.remove()
            if left:
                print(f"testbed: could not remove cgroups {left}", file=sys.stderr)
            self.cores = None
        for ns in self.ns:
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.temp, ignore_errors=True)
        self._up = False


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def clean() -> dict:
    """Take down what testbeds left behind (one killed with SIGKILL cannot clean up after itself)."""
    left = leftovers()
    for ns in left["namespaces"]:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _ns_pids(ns):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while _ns_pids(ns) and time.monotonic() < deadline:
                time.sleep(0.2)
        sh("ip", "netns", "del", ns, check=False)
    for group in map(pathlib.Path, left["cgroups"]):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in (int(p) for p in (group / "cgroup.procs").read_text().split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + 10
            while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
                time.sleep(0.2)
        with contextlib.suppress(OSError):
            group.rmdir()
    return left


@dataclasses.dataclass(frozen=True)
class Phase:
    """The link at `rate` for `seconds`, or from training step `from_step` until the next phase."""
    rate: str
    seconds: float | None = None
    from_step: int | None = None

    def __str__(self) -> str:
        return f"{self.rate}:{self.seconds:g}" if self.seconds is not None else f"{self.rate}@{self.from_step}"


class _StepReader:
    """The highest step in a run's telemetry.jsonl so far, read incrementally."""

    def __init__(self, path: pathlib.Path):
        self.path, self.offset, self.step, self.rest = path, 0, 0, b""

    def latest(self) -> int:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = self.rest + f.read()
            self.offset = f.tell()
            lines = data.split(b"\n")
            self.rest = lines.pop()  # a line still being written
            for line in lines:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if record.get("type") == "step":
                        self.step = max(self.step, record["step"])
        return self.step


def parse_scenario(text: str) -> list[Phase]:
    """'1gbit:20,50mbit:40' (seconds from the driver's start) or '1gbit@0,50mbit@60,1gbit@240'
    (from that training step on); the two kinds do not mix."""
    phases = []
    for part in text.split(","):
        rate, sep, value = part.partition("@") if "@" in part else part.partition(":")
        try:
            phase = Phase(rate, seconds=float(value)) if sep == ":" else Phase(rate, from_step=int(value))
        except ValueError:
            phase = None
        if not rate or phase is None or (phase.seconds or 0) < 0 or (phase.from_step or 0) < 0:
            raise SystemExit(f"--scenario {text!r}: each part is RATE:SECONDS (e.g. 50mbit:30) "
                             f"or RATE@STEP (e.g. 50mbit@100), not {part!r}")
        phases.append(phase)
    kinds = {p.seconds is None for p in phases}
    if len(kinds) > 1:
        raise SystemExit(f"--scenario {text!r}: use RATE:SECONDS for every part or RATE@STEP for every part")
    starts = [p.from_step for p in phases if p.from_step is not None]
    if starts != sorted(starts):
        raise SystemExit(f"--scenario {text!r}: the steps must not decrease")
    return phases


def _reach(steps: _StepReader, step: int, stop: threading.Event) -> bool:
    """Wait for the run to reach training step STEP; False when told to stop first."""
    while steps.latest() < step:
        if stop.wait(0.1):
            return False
    return True


@dataclasses.dataclass(frozen=True)
class SharePhase:
    """A node at `share` (0 < share <= 1) of its cores' time from training step `from_step` on
    (0: from before the driver starts) until the next phase."""
    share: float
    from_step: int = 0

    def __str__(self) -> str:
        return f"{self.share:g}@{self.from_step}"


def parse_slow_node(text: str) -> list[SharePhase]:
    """'0.5' (from the start) or '0.5@60,1.0@140' (from that training step on): SHARE in (0, 1],
    the steps not decreasing; a bare SHARE is step 0, so only the first part may be one."""
    phases = []
    for part in text.split(","):
        share, sep, value = part.partition("@")
        try:
            phase = SharePhase(float(share), int(value) if sep else 0)
        except ValueError:
            phase = None
        if phase is None or (sep and not value) or phase.from_step < 0 or (phases and not sep):
            raise SystemExit(f"--slow-node {text!r}: each part is SHARE@STEP (e.g. 0.5@60), or the first one a "
                             f"bare SHARE (from the start), not {part!r}")
        if not 0 < phase.share <= 1:
            raise SystemExit(f"--slow-node {text!r}: a share of the node's cores' time is in (0, 1] (1: full "
                             f"speed), not {share}")
        phases.append(phase)
    starts = [p.from_step for p in phases]
    if starts != sorted(starts):
        raise SystemExit(f"--slow-node {text!r}: the steps must not decrease")
    return phases


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="bring the testbed up, run a gearshift job on it, take it down")
    run.add_argument("job")
    run.add_argument("--rate", default="200mbit", help="the link's rate (tc units: 50mbit, 1gbit, ...)")
    run.add_argument("--delay-ms", type=float, default=0.0, help="link delay (needs netem in the kernel)")
    run.add_argument("--scenario", help="rate changes while the job runs: RATE:SECONDS,... (seconds from the "
                                        "driver's start) or RATE@STEP,... (from that step on; needs --run-dir)")
    run.add_argument("--cpus", type=float, nargs=2, default=(1, 1), metavar=("HEAD", "WORKER"))
    run.add_argument("--own-cores", action="store_true",
                     help="each node on cores of its own (cgroup cpuset), as real nodes have their own devices")
    run.add_argument("--slow-node", metavar="SHARE[@STEP],...",
                     help="a slow node (needs --own-cores): SHARE (0 < SHARE <= 1) of its cores' time from the start, "
                          "or SHARE@STEP,... from that training step on (needs --run-dir), e.g. 0.5@60,1.0@140")
    run.add_argument("--slow-node-index", type=int, default=1, metavar="K",
                     help="which node is slow: 0 the head's, 1 the worker node's (default)")
    run.add_argument("--dry-run", action="store_true", help="print every command it would run; make nothing "
                     "(no root needed)")
    sub.add_parser("check", help="list namespaces and processes a testbed left behind (exit 1 if any)")
    sub.add_parser("clean", help="stop and delete whatever a killed testbed left behind")
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)  # after --: arguments for `gearshift run`
    args = ap.parse_args(argv[:split])
    args.rest = argv[split + 1:]
    if args.command == "check":
        left = leftovers()
        print(left)
        return 1 if left["namespaces"] or left["cgroups"] else 0
    if args.command == "clean":
        print(f"removed: {clean()}")
        return 0
    extra = args.rest
    scenario = parse_scenario(args.scenario) if args.scenario else None
    if scenario and scenario[0].from_step is not None and "--run-dir" not in extra:
        raise SystemExit(f"--scenario {args.scenario!r} changes the link at steps, which the testbed reads from "
                         "the run's telemetry: give the run dir after --, e.g. -- --run-dir runs/mine")
    slow_node = _slow_node_args(args, extra)
    if args.dry_run:
        return dry_run(args, extra, scenario, slow_node)
    try:
        with Testbed(args.rate, tuple(args.cpus), delay_ms=args.delay_ms, own_cores=args.own_cores) as tb:
            print(f"testbed: head {tb.ips[0]} ({tb.ns[0]}), worker {tb.ips[1]} ({tb.ns[1]}), link {args.rate}"
                  + (f"; {tb.cores.describe()}" if tb.cores else ""), file=sys.stderr, flush=True)
            return tb.run_driver(["run", args.job, *extra], scenario, slow_node=slow_node,
                                 slow_node_index=args.slow_node_index).returncode
    except TestbedError as e:  # already taken down; the message names the step and what it printed
        print(e, file=sys.stderr)
        return 1


def check_driver_args(argv: list[str]) -> str:
    """The job `gearshift ARGV` would train (ARGV: run JOB [--set KEY=VALUE]...), through every check
    `gearshift run` makes before it starts anything (gearshift.api.check): its first layout. For a
    dry run, where nothing else would tell that a run's settings are no longer a valid job."""
    from gearshift import api

    overrides = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]
    return str(api.check(argv[1], overrides=overrides).layout)


def dry_run(args: argparse.Namespace, extra: list[str], scenario: list[Phase] | None,
            slow_node: list[SharePhase] | None) -> int:
    """What `run` would do, command by command, with nothing made."""
    tb = Testbed(args.rate, tuple(args.cpus), delay_ms=args.delay_ms, own_cores=args.own_cores, dry_run=True)
    print(f"testbed (dry run, nothing made): head {tb.ips[0]} ({tb.ns[0]}), worker {tb.ips[1]} ({tb.ns[1]}), "
          f"link {args.rate}")
    if args.own_cores:
        print("each node on cores of its own: up() makes a cpuset and a cpu cgroup per node (cores.py) and starts "
              "the node's commands below inside them")
    for step, argv in tb.plan(["run", args.job, *extra]):
        print(f"{step}: {shlex.join(argv)}")
    print(f"the job, checked as `gearshift run` checks it: starts as {check_driver_args(['run', args.job, *extra])}")
    if scenario:
        print("the link's rate, while the driver runs: " + ", ".join(map(str, scenario)))
    if slow_node:
        print(f"node {args.slow_node_index}'s share of its cores' time: " + ", ".join(map(str, slow_node)))
    return 0


def _slow_node_args(args: argparse.Namespace, extra: list[str]) -> list[SharePhase] | None:
    """--slow-node's phases, checked against the other arguments before anything is brought up."""
    if not args.slow_node:
        return None
    phases = parse_slow_node(args.slow_node)
    if not args.own_cores:
        raise SystemExit(f"--slow-node {args.slow_node!r} holds a node to a share of its own cores: add --own-cores")
    if args.slow_node_index not in (0, 1):
        raise SystemExit(f"--slow-node-index: 0 (the head's node) or 1 (the worker node), not {args.slow_node_index}")
    if any(p.from_step > 0 for p in phases) and "--run-dir" not in extra:
        raise SystemExit(f"--slow-node {args.slow_node!r} changes the node's share at steps, which the testbed reads "
                         "from the run's telemetry: give the run dir after --, e.g. -- --run-dir runs/mine")
    return phases


if __name__ == "__main__":
    sys.exit(main())
