"""Whether the workers of a training chunk are alive and getting on, from their step reports and,
while none comes in, their heartbeats (TrainWorker.heartbeat, answered on the actor's control
thread, which a busy step does not block). Pure: no Ray, times passed in, so it is tested as
logic; the train stream (stream.py) sends the heartbeats and carries out the verdict.

A worker is hung when
- it answers neither with a report nor with a heartbeat for `silent_s` (the collective timeout
  plus a margin): its process is frozen or unreachable;
- its heartbeat says it has waited inside one collective for longer than that: the collective's
  own timeout should have raised by then, so it will not return;
- every worker answers but none has finished a step for `progress_s` (fault.progress_timeout_s):
  alive, busy, going nowhere (a deadlock in the user's code, a collective nobody marks).
A slow step, a first compile or a checkpoint inside the loop is none of these.
"""

from __future__ import annotations

from dataclasses import dataclass

POLL_AFTER_S = 1.0  # heartbeats are asked for only after this long without any report
POLL_EVERY_S = 1.0  # and then at most this often (one call per rank in flight at a time)


@dataclass(frozen=True)
class Hung:
    rank: int | None
    reason: str


class Liveness:
    def __init__(self, world: int, silent_s: float, progress_s: float, now: float,
                 timeout_name: str = "fault.collective_timeout_s"):
        self.world, self.silent_s, self.progress_s = world, silent_s, progress_s
        self.timeout_name = timeout_name
        self.heard = dict.fromkeys(range(world), now)  # a report or a heartbeat answer, per rank
        self.beats: dict[int, tuple[float, dict]] = {}  # rank -> (when it answered, its answer)
        self.last_report = now  # from any rank
        self.last_progress = now  # the last time a step ended on any rank
        self.last_poll = -float("inf")
        self.steps: dict[int, int] = {}  # the highest step each rank has told of

    def reported(self, rank: int, now: float) -> None:
        """A step report from `rank`: a step ended there."""
        self.heard[rank] = self.last_report = self.last_progress = now
        self.beats.pop(rank, None)  # what it was doing before the report is stale

    def finished(self, rank: int, now: float) -> None:
        """`rank`'s loop has ended: it owes nothing more (its silence is not a hang)."""
        self.heard.pop(rank, None)
        self.beats.pop(rank, None)
        self.last_report = self.last_progress = now

    def answered(self, rank: int, beat: dict, now: float) -> None:
        if rank not in self.heard:  # finished meanwhile
            return
        self.heard[rank] = now
        self.beats[rank] = (now, beat)
        step = int(beat.get("step", 0))
        if step > self.steps.get(rank, step):  # a step ended there since its last answer
            self.last_progress = now
        self.steps[rank] = max(step, self.steps.get(rank, step))

    def should_poll(self, now: float) -> bool:
        """Whether to ask for heartbeats now: only while no report comes in, and not more often
        than once a POLL_EVERY_S."""
        if now - self.last_report < POLL_AFTER_S or now - self.last_poll < POLL_EVERY_S:
            return False
        self.last_poll = now
        return True

    def verdict(self, now: float) -> Hung | None:
        limit = f"{self.timeout_name} plus the margin, {self.silent_s:g} s"
        for rank, heard in sorted(self.heard.items()):
            quiet = now - heard
            if quiet > self.silent_s:
                return Hung(rank, f"it answered neither with a step nor with a heartbeat for {quiet:.0f} s "
                                  f"({limit}): its process is frozen or cannot be reached")
        for rank, (at, beat) in sorted(self.beats.items()):
            inside = beat.get("in_collective_s")
            if inside is not None and inside + (now - at) > self.silent_s:
                return Hung(rank, f"it has waited inside one collective for {inside + now - at:.0f} s at step "
                                  f"{beat.get('step', 0) + 1} ({beat.get('phase', '?')}), past {limit}: a peer "
                                  "stopped taking part, or the collective will not return")
        idle = now - self.last_progress
        if idle > self.progress_s:
            doing = ", ".join(f"rank {r}: {b.get('phase', '?')} at step {b.get('step', 0) + 1}"
                              for r, (_, b) in sorted(self.beats.items())) or "no heartbeat yet"
            return Hung(None, f"no step finished for {idle:.0f} s (fault.progress_timeout_s = "
                              f"{self.progress_s:g}) although every worker still answers ({doing})")
        return None
