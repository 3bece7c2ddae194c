"""Each testbed node on cores of its own (cgroup v1 `cpuset`), optionally held to a share of them
(cgroup v1 `cpu`, `cpu.cfs_quota_us`), as root.

Without it the two namespaces' Ray processes share every core of the machine, so a rank that waits
(a pipeline stage in its bubble, a rank blocked on the link) hands its core to a rank of the other
node: idle time that a real cluster, whose nodes each have their own devices, would lose. With it
node k runs on its own slice of the cores, as a node has its own GPUs.

    cores = NodeCores(tag, nodes=2)       # node 0 on the first half of the cores, node 1 on the rest
    cores.wrap(0, ["ray", "start", ...])  # that command, and every process it starts, on node 0's cores
    cores.set_share(1, 0.5)               # node 1 at half its cores' speed (a slow node); 1.0: full
    cores.remove()                        # once the processes are gone

Processes join their node's groups when the wrapped command starts (`echo $$ > cgroup.procs`, then
exec); everything they fork stays there. Nothing here kills a process: the testbed stops its
processes by pid first, then removes the groups.
"""

from __future__ import annotations

import os
import pathlib
import time

CGROUP = pathlib.Path("/sys/fs/cgroup")
PERIOD_US = 100_000


class CoresError(RuntimeError):
    """The cgroup v1 controllers are missing or not writable; the message says which."""


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


class NodeCores:
    def __init__(self, tag: str, nodes: int = 2, root: pathlib.Path = CGROUP):
        cpus = _cpus()
        if len(cpus) < nodes:
            raise CoresError(f"{nodes} nodes need a core each; this process may run on {len(cpus)}")
        for controller in ("cpuset", "cpu"):
            if not os.access(root / controller, os.W_OK):
                raise CoresError(f"{root / controller} is missing or not writable (cgroup v1 `{controller}`, as root)")
        per = len(cpus) // nodes
        self.cores = [cpus[k * per:(k + 1) * per] for k in range(nodes)]
        self.mems = (root / "cpuset" / "cpuset.mems").read_text().strip()
        self.groups = [(root / "cpuset" / f"gs-tb-{tag}-{k}", root / "cpu" / f"gs-tb-{tag}-{k}")
                       for k in range(nodes)]
        self.shares = [1.0] * nodes
        for k, (cpuset, cpu) in enumerate(self.groups):
            cpuset.mkdir(exist_ok=True)
            (cpuset / "cpuset.cpus").write_text(",".join(map(str, self.cores[k])))
            (cpuset / "cpuset.mems").write_text(self.mems)
            cpu.mkdir(exist_ok=True)

    def wrap(self, node: int, argv: list[str]) -> list[str]:
        """ARGV run inside node NODE's groups (and all it starts)."""
        procs = " ".join(str(g / "cgroup.procs") for g in self.groups[node])
        join = f'for f in {procs}; do echo $$ > "$f" || exit 97; done; exec "$@"'
        return ["sh", "-c", join, "sh", *argv]

    def set_share(self, node: int, share: float) -> None:
        """Node NODE at SHARE of its cores' time (0 < SHARE <= 1; 1 lifts the quota)."""
        if not 0 < share <= 1:
            raise ValueError(f"a node's share of its cores is in (0, 1], not {share}")
        quota = -1 if share == 1 else max(1000, int(share * PERIOD_US * len(self.cores[node])))
        cpu = self.groups[node][1]
        (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (cpu / "cpu.cfs_quota_us").write_text(str(quota))
        self.shares[node] = share

    def pids(self) -> list[int]:
        out = []
        for cpuset, _ in self.groups:
            if (cpuset / "cgroup.procs").exists():
                out += [int(p) for p in (cpuset / "cgroup.procs").read_text().split()]
        return out

    def remove(self, timeout_s: float = 10) -> list[str]:
        """Remove the groups (they must be empty: stop their processes first). Returns what could
        not be removed."""
        left = []
        for group in (g for pair in self.groups for g in pair):
            deadline = time.monotonic() + timeout_s
            while group.exists():
                try:
                    group.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        left.append(str(group))
                        break
                    time.sleep(0.2)
        return left

    def describe(self) -> str:
        return ", ".join(f"node {k} on cores {','.join(map(str, c))} at {s:g}"
                         for k, (c, s) in enumerate(zip(self.cores, self.shares)))
