"""FINISHING, the run's end as a state like the others: the final checkpoint, the last
evaluation and final.pt.

A worker lost while no step runs (this state, an evaluation between chunks) leaves every
survivor holding the state of the step they are all at: the failure is marked `at_rest` with
that step, and RECOVERING handles it as anywhere else: under `fault.on_node_loss: elastic` the
survivors that hold every piece go on in memory (orchestrator/control/elastic.py, `plan_at_rest`)
and write the checkpoint themselves; otherwise the run restarts from its newest checkpoint and
trains the rest again. So a run whose every step trained never ends with nothing while a restart
is allowed (`fault.max_failures`).
"""

from __future__ import annotations

import contextlib
import secrets

from gearshift.orchestrator.control.checkpoints import FINAL_AUTO_BYTES, final_wanted
from gearshift.orchestrator.errors import WorkerFailed
from gearshift.workers.state import storage


@contextlib.contextmanager
def at_rest(step: int):
    """Calls made while no step runs: a worker lost in one leaves the others at `step`."""
    try:
        yield
    except WorkerFailed as err:
        err.at_rest = step
        raise


class Finishing:
    """The end of one run; `saved` is the step whose checkpoint exists (written here, or the one
    a restart loaded), so that the end after a recovery does not write it twice."""

    def __init__(self, controller):
        self.c = controller
        self.saved: int | None = None

    def loaded(self, step: int) -> None:
        """The workers were restored from the checkpoint of `step`."""
        self.saved = step

    def run(self) -> int:
        """The final checkpoint (every rank writes its shards), the last evaluation and final.pt;
        the step they are of."""
        c = self.c
        with at_rest(c.step):
            if self.saved != c.step:
                self.saved = c.checkpoints.save_now(c.group)
            c.evals.at_end(c.group, c.step, c.layout)  # after the save: the best may be this one
        # a recovery that no step followed: its records are written at the step it ended on
        c.recovery.trained({"step": c.step}, c.job.cluster.num_workers)
        c.elastic.trained({"step": c.step}, c.layout)
        parameters = c.infos[0].get("parameters") if c.infos else None
        c.summary["final"] = None
        if final_wanted(c.job.checkpoint.final, parameters):
            with at_rest(c.step):
                by = self._final_by_worker()
            if not by:  # rank 0 does not see the run's folder (or the checkpoint is a full-format one)
                c.checkpoints.write_final(c.step, c.run_dir.final)
            c.summary["final"] = str(c.run_dir.final)
            c.summary["final_written_by"] = "rank 0" if by else "driver"
        else:
            c.report.say(self._no_final(parameters))
        return c.step

    def _final_by_worker(self) -> bool:
        """final.pt written by rank 0 on its node, out of the DCP checkpoint just committed, where
        rank 0 sees the run's folder (a token the driver leaves there says so); whether it did."""
        from gearshift.workers.state import checkpoint
        from gearshift.workers.state.state_io import FINAL_MARK

        c = self.c
        folder = c.checkpoints.root / f"step_{c.step:08d}"
        if checkpoint.manifest_of(folder)["format"] != checkpoint.DCP_FORMAT:
            return False
        mark, token = c.run_dir.path / FINAL_MARK, secrets.token_hex(8)
        checkpoint.write_file_atomic(mark, token.encode())
        try:
            named = folder.url if storage.is_remote(folder) else str(folder.resolve())
            answers = c.group.call("write_final", named, str(c.run_dir.final), token)
        finally:
            mark.unlink(missing_ok=True)
        return any(a.get("written") for a in answers)

    def _no_final(self, parameters: int | None) -> str:
        c = self.c
        why = ("checkpoint.final is none" if c.job.checkpoint.final == "none" else
               f"the model is {(parameters or 0) * 4 / 2**30:.1f} GiB in fp32, over checkpoint.final auto's "
               f"{FINAL_AUTO_BYTES / 2**30:.0f} GiB")
        return (f"final.pt: not written ({why}); `gearshift export {c.run_dir.path}` writes the model from the "
                f"checkpoint of step {c.step} as safetensors shards (--set checkpoint.final=full writes final.pt)")
