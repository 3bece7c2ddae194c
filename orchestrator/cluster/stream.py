"""One step loop's reports, streamed from every rank as they arrive (RayWorkerGroup.train).

While no report comes in, the workers are asked for heartbeats on their control thread, and
liveness.py says when a silence, a wait inside one collective or a group that gets nowhere is a
hang. Under fault.on_node_loss elastic a rank that dies does not end the stream at once: the
survivors' loops end first (their collectives lose it), each reporting where it stopped, and
lost.py's probe tells the lost ranks from slow ones before Ray does. The stream then raises the
lowest lost rank's failure, naming every lost rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Iterator

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.cluster.calls import CALL_TIMEOUT_S, Ranks, died, task_failure
from gearshift.orchestrator.cluster.liveness import Liveness
from gearshift.orchestrator.cluster.lost import LossProbe

log = logging.getLogger("gearshift")

STALL_MARGIN_S = 5.0   # no report nor heartbeat, or one collective, for the collective timeout plus this: stuck


class TrainStream:
    """The reports of one call of every rank's `train`; `lost` (rank -> failure) is filled with
    the ranks lost meanwhile under elastic (the group's membership keeps it after the stream)."""

    def __init__(self, job: Job, ranks: Ranks, lost: dict[int, WorkerFailed]):
        self.job, self.ranks, self.lost = job, ranks, lost
        # heartbeat calls in flight -> rank (one per rank at a time); kept so that the group's
        # shutdown drops them while Ray is still up (an ObjectRef freed after ray.shutdown, at the
        # interpreter's exit, can crash the process)
        self.beats: dict[Any, int] = {}

    def reports(self, until_step: int, checkpoint_every: int, stall_timeout_s: float | None,
                last_step: int | None, chunk: int | None) -> Iterator[tuple[int, dict]]:
        """(rank, report) pairs until every rank's loop has ended. `chunk`: the number of a
        stoppable loop (every step reported as it ends, stop_early names it), or None."""
        import ray

        fault = self.job.fault
        stall_timeout_s = stall_timeout_s or fault.collective_timeout_s + STALL_MARGIN_S
        flush_s = 0.0 if chunk is not None else 0.5
        gens = {w.train.remote(until_step, checkpoint_every, flush_s, last_step, chunk,
                               self.job.checkpoint.async_save): rank
                for rank, w in enumerate(self.ranks.workers)}
        watch = Liveness(len(self.ranks.workers), stall_timeout_s, fault.progress_timeout_s, time.monotonic())
        probe = LossProbe(self.ranks.workers, self.ranks.infos) if self.job.on_node_loss == "elastic" else None
        while gens:
            ready, _ = ray.wait(list(gens), num_returns=1, timeout=0.1 if probe and probe.probing else 1.0)
            for rank in probe.gone(gens.values()) if probe else ():  # its peers lost it; it answers nothing
                self._lose(gens, rank, WorkerFailed(rank, probe.why(rank), kind=WorkerFailed.DIED), probe.detected,
                           watch)
            ready = [g for g in ready if g in gens]
            if not ready:
                self._hear(watch)
                hung = watch.verdict(time.monotonic())
                if hung is not None:
                    raise WorkerFailed(hung.rank, hung.reason, kind=WorkerFailed.SILENT)
                continue
            for gen in ready:
                rank = gens[gen]
                report = self._next(gens, gen, watch)
                if report is None:  # its loop ended, or (elastic) it was lost
                    continue
                watch.reported(rank, time.monotonic())
                if probe and "step_failed" in report:
                    probe.step_dropped(rank)
                yield rank, report
        if self.lost:
            err = self.lost[min(self.lost)]
            err.lost_ranks = sorted(self.lost)
            raise err

    def _next(self, gens: dict, gen, watch: Liveness) -> dict | None:
        """The next report of `gen`'s rank; None where its loop has ended or, under elastic, its
        process is gone (the rank counted lost). Any other failure raises."""
        import ray

        rank = gens[gen]
        try:
            ref = next(gen)
        except StopIteration:
            del gens[gen]
            watch.finished(rank, time.monotonic())
            return None
        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailed(rank, f"its report did not arrive within {CALL_TIMEOUT_S:g} s",
                               kind=WorkerFailed.SILENT) from None
        except ray.exceptions.RayActorError as err:
            if self.job.on_node_loss != "elastic":
                raise died(rank, self.ranks.infos[rank], err) from None
            self._lose(gens, rank, died(rank, self.ranks.infos[rank], err), time.time(), watch)
            return None
        except ray.exceptions.RayError as err:
            raise task_failure(err, rank) from None

    def _lose(self, gens: dict, rank: int, err: WorkerFailed, detected: float | None, watch: Liveness) -> None:
        """Elastic: count `rank` lost (seen at wall time `detected`) and stop waiting on it."""
        err.detected = detected
        self.lost[rank] = err
        del gens[next(g for g, r in gens.items() if r == rank)]
        watch.finished(rank, time.monotonic())

    def _hear(self, watch: Liveness) -> None:
        """Take the heartbeats that have come back, and ask again where the watch says so. A
        worker still answering its last one is not asked twice, so a frozen one is not buried
        in calls."""
        import ray

        beats = self.beats
        if beats:
            done, _ = ray.wait(list(beats), num_returns=len(beats), timeout=0)
            for ref in done:
                rank = beats.pop(ref)
                if rank in self.lost:
                    continue  # dead, and accounted for (elastic)
                try:
                    watch.answered(rank, ray.get(ref, timeout=0), time.monotonic())
                except ray.exceptions.RayActorError as err:
                    raise died(rank, self.ranks.infos[rank], err) from None
                except ray.exceptions.RayError as err:  # an answer that could not be read tells nothing
                    log.debug("heartbeat of rank %d: %s", rank, err)
        if watch.should_poll(time.monotonic()):
            waiting = set(beats.values())
            for rank, w in enumerate(self.ranks.workers):
                if rank not in waiting and rank not in self.lost:
                    beats[w.heartbeat.options(concurrency_group="control").remote()] = rank

    def drop(self) -> None:
        """Let go of the heartbeats still in flight (before Ray shuts down)."""
        self.beats.clear()
