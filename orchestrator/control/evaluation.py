"""Evaluation's bookkeeping on the driver: where a training chunk must end for it, running it on
the workers, the `eval` records, the best eval loss and the checkpoint that holds it.

The controller asks three things of it: `chunk_end` (a chunk ends at each eval step, as it does
at a schedule entry), `after_chunk` (evaluate there, except at the run's last step) and `at_end`
(the final evaluation, after the final checkpoint is written, so that a best final state has its
checkpoint already). Every rank takes part in one `group.call("evaluate", batches)`; the workers
all-reduce their sums, so any rank's answer is the answer (rank 0's is used).

checkpoint.keep_best: when an evaluation beats the best so far, the checkpoint of that step is
named the best (`checkpoints/best.json`). If no checkpoint was written at that step (it is not a
multiple of checkpoint.every), one is written then, before marking: the best is always a
checkpoint of exactly the model that was evaluated. A resumed run starts from the best its
earlier legs recorded; an evaluation repeated after a restart is recorded again (same model,
same figure).
"""

from __future__ import annotations

import math
import pathlib
import time
from typing import Callable

from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.workers.state import checkpoint


class Evaluation:
    def __init__(self, job: Job, report: Reporter, checkpoints: pathlib.Path, save: Callable[[object], int]):
        self.every, self.batches = job.eval.every, job.eval.batches
        self.keep_best, self.keep = job.checkpoint.keep_best, job.checkpoint.keep
        from gearshift.workers.state import storage

        self.report, self.checkpoints, self.save = report, storage.location(checkpoints), save
        self.last: dict | None = None  # the latest eval record
        marked = checkpoint.best(self.checkpoints) if self.keep_best else None
        self.best: tuple[int, float] | None = (int(marked["step"]), float(marked["eval_loss"])) \
            if marked and isinstance(marked.get("eval_loss"), (int, float)) else None

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def chunk_end(self, step: int, until: int) -> int:
        """`until`, or the next eval step after `step` when that comes first."""
        if not self.enabled:
            return until
        return min(until, (step // self.every + 1) * self.every)

    def after_chunk(self, group, step: int, total: int, layout) -> None:
        """At an eval step inside the run; the last step's evaluation is `at_end`'s."""
        if self.enabled and step % self.every == 0 and step < total:
            self.run(group, step, layout)

    def at_end(self, group, step: int, layout) -> None:
        if self.enabled and (self.last is None or self.last["step"] != step):
            self.run(group, step, layout)

    def run(self, group, step: int, layout) -> dict:
        start = time.time()
        result = group.call("evaluate", self.batches)[0]
        loss = float(result["loss"])
        record = {"type": "eval", "time": time.time(), "step": step, "loss": loss,
                  # perplexity means something for next-token targets only; exp of an MSE does not
                  "perplexity": _exp(loss) if result.get("token_targets") else None,
                  "samples": int(result["samples"]), "batches": int(result["batches"]),
                  "seconds": time.time() - start, **layout.to_dict()}
        self.last = record
        self.report.evaluated(record)
        if not math.isnan(loss) and (self.best is None or loss < self.best[1]):
            self.best = (step, loss)
            if self.keep_best:
                self._mark_best(group, step, loss)
        return record

    def _mark_best(self, group, step: int, loss: float) -> None:
        if not (self.checkpoints / f"step_{step:08d}").is_dir():
            self.save(group)  # a collective when sharded: every rank takes part
        path = checkpoint.mark_best(self.checkpoints, step, loss, self.keep)
        self.report.event("best", step=step, eval_loss=loss, path=str(path))

    def figures(self) -> dict:
        """summary.json's eval figures (None when the run evaluated nothing)."""
        return {"eval_loss": self.last["loss"] if self.last else None,
                "best_eval_loss": self.best[1] if self.best else None,
                "best_eval_step": self.best[0] if self.best else None}


def _exp(loss: float) -> float | None:
    try:
        return math.exp(loss)
    except OverflowError:  # an untrained model's loss can pass 709: JSON has no infinity
        return None
