"""One step loop's reports, taken from every rank as they arrive (RayWorkerGroup.train): each
rank's loop is one call, its reports are taken in long polls (workers/step/outbox.py).

While no report comes in, the workers are asked for heartbeats on their control thread, and
liveness.py says when a silence, a wait inside one collective or a group that gets nowhere is a
hang. Under fault.on_node_loss elastic a rank that dies does not end the stream at once: the
survivors' loops end first (their collectives lose it), each reporting where it stopped, and
lost.py's probe tells the lost ranks from slow ones before Ray does. The stream then raises the
lowest lost rank's failure, naming every lost rank.

Which news reaches the driver first is a race: a survivor's loop may fail outright (its failure
raised, not a dropped step) and a dead rank's heartbeat may fail, before the lost ranks' polls do.
Under elastic neither ends the stream as a plain failure: a dead heartbeat counts its rank lost, and
a rank's raised failure is held (`Held`) while the probe asks every rank still open, until each has
answered (nobody lost: the held failure is raised), a rank is counted lost (the loss is raised, the
held failure kept in its details), or HOLD_S has passed.
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
POLL_S = 1.0  # a poll of a rank's reports returns after this when none comes (its first report ends it at once)
# elastic: how long a rank's raised failure waits for a loss to be accounted before it is raised as
# it is. A live rank answers the probe in milliseconds (seconds on a loaded machine) and a dead
# process on a live node is reported dead by Ray within moments; a node gone is counted after
# lost.PROBE_S of silence. A loss that takes longer to show is seen by the stall watch, as before.
HOLD_S = 10.0


class Held:
    """Elastic: the first failure a rank raised, held until the ranks still open are accounted
    for; `ranks`: every rank whose loop raised meanwhile."""

    def __init__(self, failure: WorkerFailed, now: float):
        self.failure, self.until = failure, now + HOLD_S
        self.ranks = [failure.rank]

    def settled(self, open_ranks, alive: set[int], now: float) -> bool:
        """Whether to raise the held failure now: every open rank answered alive, or the hold is over."""
        return all(r in alive for r in open_ranks) or now >= self.until


class TrainStream:
    """The reports of one call of every rank's `train`; `lost` (rank -> failure) is filled with
    the ranks lost meanwhile under elastic (the group's membership keeps it after the stream).

    Each rank's loop is one plain call (`run_train`) and its reports are taken in long polls
    (`take_reports`, workers/step/outbox.py), one in flight per rank: the driver holds no Ray
    streaming generator, whose I/O thread outlives it."""

    def __init__(self, job: Job, ranks: Ranks, lost: dict[int, WorkerFailed], call: int = 0):
        self.job, self.ranks, self.lost, self.call = job, ranks, lost, call
        # calls in flight: heartbeats and polls -> rank (one of each per rank at a time), each
        # rank's loop; kept so that the group's shutdown drops them while Ray is still up (an
        # ObjectRef freed after ray.shutdown, at the interpreter's exit, can crash the process)
        self.beats: dict[Any, int] = {}
        self.polls: dict[Any, int] = {}
        self.runs: dict[int, Any] = {}

    def reports(self, until_step: int, checkpoint_every: int, stall_timeout_s: float | None,
                last_step: int | None, chunk: int | None) -> Iterator[tuple[int, dict]]:
        """(rank, report) pairs until every rank's loop has ended. `chunk`: the number of a
        stoppable loop (every step reported as it ends, stop_early names it), or None."""
        import ray

        fault = self.job.fault
        stall_timeout_s = stall_timeout_s or fault.collective_timeout_s + STALL_MARGIN_S
        flush_s = 0.0 if chunk is not None else 0.5
        self.runs = {rank: w.run_train.remote(self.call, until_step, checkpoint_every, flush_s, last_step, chunk,
                                              self.job.checkpoint.async_save)
                     for rank, w in enumerate(self.ranks.workers)}
        self.polls = {self._poll(rank): rank for rank in self.runs}
        watch = Liveness(len(self.ranks.workers), stall_timeout_s, fault.progress_timeout_s, time.monotonic())
        probe = LossProbe(self.ranks.workers, self.ranks.infos) if self.job.on_node_loss == "elastic" else None
        held: Held | None = None
        while self.polls:
            ready, _ = ray.wait(list(self.polls), num_returns=1, timeout=0.1 if probe and probe.probing else 1.0)
            for rank in probe.gone(list(self.runs)) if probe else ():  # its peers lost it; it answers nothing
                self._lose(rank, WorkerFailed(rank, probe.why(rank), kind=WorkerFailed.DIED), probe.detected, watch)
            heard = False  # a report came in: no rank is silent now
            for ref in [p for p in ready if p in self.polls]:
                rank = self.polls.pop(ref)
                taken = self._take(rank, ref, watch)
                if taken is None:  # lost (elastic)
                    continue
                reports, ended = taken
                for report in reports:
                    heard = True
                    watch.reported(rank, time.monotonic())
                    if probe and "step_failed" in report:
                        probe.step_dropped(rank)
                    yield rank, report
                if ended:
                    failure = self._end(rank, watch, probe)
                    if failure is not None and held is None:
                        held = Held(failure, time.monotonic())
                    elif failure is not None:
                        held.ranks.append(rank)
                else:
                    self.polls[self._poll(rank)] = rank
            if held is not None and not self.lost and held.settled(self.runs, probe.alive, time.monotonic()):
                raise held.failure
            if not heard:  # an empty poll comes back every POLL_S: the watch is kept whatever returned
                self._hear(watch)
                hung = watch.verdict(time.monotonic())
                if hung is not None:
                    raise WorkerFailed(hung.rank, hung.reason, kind=WorkerFailed.SILENT)
        if self.lost:
            err = self.lost[min(self.lost)]
            err.lost_ranks = sorted(self.lost)
            if held is not None:  # survivors whose loop failed with the loss: said with it; they receive the state
                err.raised_ranks = sorted(held.ranks)
                err.details = "\n".join(d for d in (err.details, f"rank {held.failure.rank} raised meanwhile: "
                                                                  f"{held.failure.reason}") if d)
            raise err
        if held is not None:
            raise held.failure

    def _poll(self, rank: int):
        """A long poll of `rank`'s outbox, on its own thread (a heartbeat is not held up)."""
        return self.ranks.workers[rank].take_reports.options(concurrency_group="reports").remote(self.call, POLL_S)

    def _take(self, rank: int, ref, watch: Liveness) -> tuple[list[dict], bool] | None:
        """What `rank`'s poll brought: (reports, whether its loop ended); None where, under
        elastic, its process is gone (the rank counted lost). Any other failure raises."""
        import ray

        try:
            return ray.get(ref, timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailed(rank, f"its reports did not arrive within {CALL_TIMEOUT_S:g} s",
                               kind=WorkerFailed.SILENT) from None
        except ray.exceptions.RayActorError as err:
            return self._died(rank, err, watch)

    def _end(self, rank: int, watch: Liveness, probe: LossProbe | None) -> WorkerFailed | None:
        """`rank`'s loop has ended and every report of it is in: its call's failure, if any, is
        raised; under elastic (`probe`) it is returned to be held, and the probe asks the others."""
        import ray

        try:
            ray.get(self.runs.pop(rank), timeout=CALL_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise WorkerFailed(rank, f"its loop's end did not arrive within {CALL_TIMEOUT_S:g} s",
                               kind=WorkerFailed.SILENT) from None
        except ray.exceptions.RayActorError as err:
            self._died(rank, err, watch)
            return None
        except ray.exceptions.RayError as err:
            if probe is None:
                raise task_failure(err, rank) from None
            probe.step_dropped(rank)  # the others are asked: a loss may be behind it
            watch.finished(rank, time.monotonic())
            return task_failure(err, rank)
        watch.finished(rank, time.monotonic())
        return None

    def _died(self, rank: int, err, watch: Liveness) -> None:
        """`rank`'s process is gone: the run's failure, or under elastic a rank lost."""
        if self.job.on_node_loss != "elastic":
            raise died(rank, self.ranks.infos[rank], err) from None
        self._lose(rank, died(rank, self.ranks.infos[rank], err), time.time(), watch)

    def _lose(self, rank: int, err: WorkerFailed, detected: float | None, watch: Liveness) -> None:
        """Elastic: count `rank` lost (seen at wall time `detected`) and stop waiting on it."""
        err.detected = detected
        self.lost[rank] = err
        self.runs.pop(rank, None)
        for ref in [p for p, r in self.polls.items() if r == rank]:
            del self.polls[ref]
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
                except ray.exceptions.RayActorError as err:  # elastic: counted lost, not the run's end
                    self._died(rank, err, watch)
                except ray.exceptions.RayError as err:  # an answer that could not be read tells nothing
                    log.debug("heartbeat of rank %d: %s", rank, err)
        if watch.should_poll(time.monotonic()):
            waiting = set(beats.values())
            for rank, w in enumerate(self.ranks.workers):
                if rank not in waiting and rank not in self.lost:
                    beats[w.heartbeat.options(concurrency_group="control").remote()] = rank

    def drop(self) -> None:
        """Let go of the calls still in flight (before Ray shuts down)."""
        self.beats.clear()
        self.polls.clear()
        self.runs.clear()
