"""Checkpoints seen from the driver: it asks for them, commits them, and writes `final.pt`.

The workers write a checkpoint's data (workers/state/dcp.py: every rank its own shards; or, in the
full format, rank 0's whole state, which the driver writes). A DCP checkpoint arrives as one
part per rank, each naming the files that rank hashed as it wrote them; once every rank's part
is in, the driver writes the manifest and renames the folder into place (workers/checkpoint.commit),
so no checkpoint is visible before all of its data is on disk. Written behind the steps
(checkpoint.async_save), a rank's part comes with a later report of the same chunk, once its write
has ended; a part of a chunk that failed is forgotten with it (`new_chunk`), and its folder, never
committed, is pruned.
"""

from __future__ import annotations

import pathlib

import torch

from gearshift.orchestrator.errors import WorkerFailed
from gearshift.orchestrator.job import Job
from gearshift.orchestrator.control.reporting import Reporter
from gearshift.workers.state import checkpoint, storage


def load_into(group, root: pathlib.Path, found: tuple[str, dict], report: Reporter | None,
              before: int | None = None) -> tuple[int, str]:
    """Load checkpoint `found` (name, reference) into the workers, who hash their shares of its
    files before reading them (workers/dcp.check_files); one whose files do not match is passed
    over, with a line saying so, for the newest before it (those of a step at or after `before`
    are never taken). (the step loaded, the checkpoint's name); WorkerFailed when none loads."""
    name, state = found
    while True:
        try:
            return int(group.call("load", group.put(state))[0]), name
        except WorkerFailed as err:
            if "not match its manifest" not in str(err):  # CheckpointError: some file changed
                raise
            step = int(name.split("_")[1])
            older = checkpoint.load_latest(root, whole=False, before=step if before is None else min(step, before))
            if report is not None:
                report.say(f"checkpoint {name}: a worker found its files changed since they were written "
                           f"({err.reason}); " + (f"loading {older[0].name} instead" if older else "none before it"))
            if older is None:
                raise
            name, state = older[0].name, older[1]


FINAL_AUTO_BYTES = 2 << 30  # checkpoint.final auto: final.pt only for a model smaller than this in fp32


def final_wanted(setting: str, parameters: int | None) -> bool:
    """Whether the run writes final.pt (checkpoint.final) for a model of `parameters` elements."""
    return setting == "full" or (setting == "auto" and (parameters or 0) * 4 < FINAL_AUTO_BYTES)


class Checkpoints:
    def __init__(self, job: Job, root: pathlib.Path, report: Reporter):
        self.job, self.root, self.report = job, storage.location(root), report
        self._parts: dict[int, dict[int, dict]] = {}  # step -> rank -> the DCP parts the ranks sent so far

    def add(self, batch: dict, world: int) -> None:
        """A worker's report batch, which may hold rank 0's full state or one rank's DCP part."""
        if "checkpoint" in batch:
            self._save_full(batch["checkpoint"])
        elif "checkpoint_file" in batch:
            self._commit([batch["checkpoint_file"]], fmt=checkpoint.FORMAT)
        elif "checkpoint_part" in batch:
            part = batch["checkpoint_part"]
            parts = self._parts.setdefault(part["step"], {})
            parts[part.get("rank", len(parts))] = part
            if len(parts) == world:
                self._commit(list(self._parts.pop(part["step"]).values()))

    def new_chunk(self) -> None:
        """A chunk starts: every rank reports its writes before its chunk ends, so a part still
        waiting for its peers belongs to a chunk that failed, whose step will be written again."""
        self._parts.clear()

    def load_into(self, group, found: tuple[str, dict]) -> tuple[int, str]:
        return load_into(group, self.root, found, self.report)

    def save_now(self, group) -> int:
        """A checkpoint of the step the workers are at (all ranks take part); its step."""
        parts = group.call("checkpoint")
        if "checkpoint" in parts[0]:
            return self._save_full(parts[0]["checkpoint"])
        if "checkpoint_file" in parts[0]:
            return self._commit([parts[0]["checkpoint_file"]], fmt=checkpoint.FORMAT)
        return self._commit([p["checkpoint_part"] for p in parts])

    def write_final(self, step: int, path: pathlib.Path, verify: bool = False) -> None:
        """final.pt: the model's full tensors (weights_only loadable), read back from the checkpoint
        of `step` on the driver one tensor at a time (workers/state/export.py), so neither a worker nor
        the driver ever holds the whole model for it. The model's tensors only are read: the
        checkpoint's files are hashed first only with `verify` (one this run did not just write)."""
        from gearshift.workers.state import export

        export.write_torch(export.ModelTensors(self.root / f"step_{step:08d}", verify=verify), path)

    def _save_full(self, state: dict) -> int:
        path = checkpoint.save(self.root, state["step"], state, self.job.checkpoint.keep, meta=self._meta())
        self.report.event("checkpoint", step=state["step"], path=str(path), format="full")
        return int(state["step"])

    def _commit(self, parts: list[dict], fmt: int = checkpoint.DCP_FORMAT) -> int:
        """A checkpoint the workers wrote into its temporary folder: every rank's DCP shards, or
        (the full format) rank 0's state.pt."""
        from gearshift.workers.state import dcp

        # the folder the ranks wrote, named here (the ranks name it the same way, without asking)
        step, folder = parts[0]["step"], dcp.tmp_folder(self.root, parts[0]["step"])
        files = {name: digest for p in parts for name, digest in p["files"].items()}
        path = checkpoint.commit(self.root, step, folder, files, self.job.checkpoint.keep, meta=self._meta(), fmt=fmt)
        # written behind the steps: when the last rank's write ended, to line up with the steps' ends
        written = {} if not all("written" in p for p in parts) else {
            "write_started": min(p["written"][0] for p in parts), "write_ended": max(p["written"][1] for p in parts)}
        self.report.event("checkpoint", step=step, path=str(path), format="dcp" if fmt == checkpoint.DCP_FORMAT
                          else "full", bytes=sum(f["bytes"] for f in files.values()), **written)
        return int(step)

    def _meta(self) -> dict:
        return {"fingerprint": self.job.fingerprint(), "torch": torch.__version__}
