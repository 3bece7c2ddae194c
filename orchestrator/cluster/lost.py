"""Elastic: telling the ranks that are gone from those still finishing their step, without waiting
for Ray to declare a lost node dead (its health checks take seconds, tens of seconds at their
defaults).

When a rank dies mid-step, its peers' collectives lose it: each drops the step and reports
`step_failed` within milliseconds (gloo sees the connection close). From the first such report,
`LossProbe` asks every other rank for a heartbeat on its control thread, which answers even
mid-step. A rank whose heartbeat fails (Ray says its actor is dead) is counted lost at once. A
rank that has neither reported nor answered within `PROBE_S` is counted lost when its whole node
is silent (no rank there reported or answered): a node gone. A silent rank on a node whose other
ranks answer is a process that is slow to answer (a loaded machine: a heartbeat can take seconds
there), not a lost one, for a process that dies on a node still up is reported dead by Ray within
moments: that rank is left to its own stream and to the stall watch. A rank that answers is alive,
and its loop will end and report as the others' did. (A node that vanishes without closing its
connections leaves its peers blocked until the collective timeout: that loss is seen as before,
by the stall watch.)
"""

from __future__ import annotations

import time

PROBE_S = 0.5  # a live worker answers a heartbeat in milliseconds, even mid-step


class LossProbe:
    def __init__(self, workers: list, infos: list[dict] | None = None):
        self.workers = workers
        infos = infos or [{}] * len(workers)  # the ranks' node_info (node_id: None where unknown)
        self.nodes = [info.get("node_id") for info in infos]
        self.failed: set[int] = set()      # ranks whose heartbeat failed: their actor is dead
        self.dropped: set[int] = set()     # ranks that reported their step dropped
        self.alive: set[int] = set()       # ranks that answered the probe
        self.probes: dict = {}             # heartbeat ref -> rank
        self.since: float | None = None    # monotonic time of the first dropped step
        self.detected: float | None = None  # wall time of it

    def step_dropped(self, rank: int) -> None:
        self.dropped.add(rank)
        if self.since is not None:
            return
        self.since, self.detected = time.monotonic(), time.time()
        for r, w in enumerate(self.workers):
            if r != rank:
                self.probes[w.heartbeat.options(concurrency_group="control").remote()] = r

    @property
    def probing(self) -> bool:
        return self.since is not None

    def gone(self, open_ranks) -> list[int]:
        """Of the ranks whose loop has not ended, those to count lost now (returns at once)."""
        import ray

        if self.since is None:
            return []
        if self.probes:
            done, _ = ray.wait(list(self.probes), num_returns=len(self.probes), timeout=0)
            for ref in done:
                rank = self.probes.pop(ref)
                try:
                    ray.get(ref, timeout=0)
                    self.alive.add(rank)
                except ray.exceptions.RayActorError:
                    self.failed.add(rank)
                except Exception:  # noqa: BLE001 - an answer that could not be read tells nothing
                    pass
        open_ranks = set(open_ranks)
        failed = sorted(r for r in open_ranks if r in self.failed)
        if time.monotonic() - self.since < PROBE_S:
            return failed
        heard = {self.nodes[r] for r in self.dropped | self.alive if r < len(self.nodes)}
        silent = (r for r in open_ranks if r not in self.dropped and r not in self.alive)
        return sorted(set(failed) | {r for r in silent if self.nodes[r] is None or self.nodes[r] not in heard})

    def why(self, rank: int) -> str:
        """Why `gone` counted `rank` lost (a sentence)."""
        if rank in self.failed:
            return "its peers lost it mid-step and Ray says its actor is dead"
        return (f"its peers lost it mid-step and it answered nothing for {PROBE_S:g} s, nor did any rank on its "
                "node: its node is gone")

    def drop(self) -> None:
        """Let go of the probes still in flight (before Ray shuts down)."""
        self.probes = {}


def dead_ranks(workers: list, known: dict, timeout_s: float) -> dict[int, str]:
    """Ranks whose actor is gone, with Ray's account of why; `known` (rank -> reason) are not
    asked again. A live worker still blocked in a collective does not answer in time either:
    that one counts as alive."""
    import ray

    refs = {w.node_info.remote(): rank for rank, w in enumerate(workers) if rank not in known}
    ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    dead = dict(known)
    for ref, rank in refs.items():
        try:
            ray.get(ref, timeout=0)
        except ray.exceptions.RayActorError as err:
            dead[rank] = str(err)
        except Exception:  # not ready (busy, blocked) or another error: not known to be dead
            pass
    return dict(sorted(dead.items()))
