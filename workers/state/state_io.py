"""What a worker writes and reads of its state: its part of a checkpoint (DCP shards, or the full
format's state.pt gathered a tensor at a time), a load from a checkpoint or from pretrained
weights, and final.pt written by rank 0 on its own node.

StateIO is the worker's state part: the worker's actor methods (`state`, `checkpoint`, `load`,
`load_pretrained`, `write_final`) call it. It keeps where checkpoints go (`dcp_root`,
`full_place`: decided by `locate` once the group is formed, a collective) and the checkpoint
written behind the steps (`writes`, one at a time).
"""

from __future__ import annotations

import pathlib
import time

import torch

from gearshift.workers.state import dcp, full_format
from gearshift.workers.step import oom
from gearshift.workers.state.checkpoint import to_cpu

FINAL_MARK = ".final-mark"  # the driver's token in the run's folder: rank 0 writes final.pt only where it reads it


class StateIO:
    def __init__(self, worker):
        self.w = worker
        self.writes = dcp.Behind()  # a checkpoint written behind the steps (checkpoint.async_save)
        self.dcp_root = None  # where DCP checkpoints go, None for the full format (locate)
        self.unreached = None  # why this rank could not reach the checkpoints' place (its probe's error)
        self.full_place = None  # where rank 0 writes the full format's state.pt, if it reaches one

    def locate(self) -> None:
        """Where checkpoints go (a collective) and where rank 0 writes the full format's state.pt."""
        w, cfg = self.w, self.w.config
        self.dcp_root, self.unreached = dcp.root_for(cfg.checkpoint_dir, cfg.checkpoint_format, w.device,
                                                     cfg.checkpoint_options, served=cfg.checkpoint_server,
                                                     unshared=cfg.unshared_storage)
        self.full_place = None if self.dcp_root is not None or w.rank != 0 else full_format.place(
            cfg.checkpoint_dir, cfg.checkpoint_server, cfg.checkpoint_options, cfg.unshared_storage)

    def state(self) -> dict | None:
        """The full state on rank 0, on the CPU (see TrainWorker.state); a collective when sharded."""
        w = self.w
        full = w.parallel.full_state(w.optimizer, w.rank)
        if full is None:
            return None
        return to_cpu({**full, "scaler": w.scaler.state_dict(), "step": w.step})

    def checkpoint(self) -> dict:
        """This rank's part of a checkpoint of the current step (see TrainWorker.checkpoint)."""
        w = self.w
        self.writes.settle()
        if self.dcp_root is None:
            extra = {"scaler": to_cpu(w.scaler.state_dict()), "step": w.step}
            if w.rank != 0 or self.full_place is not None:
                part = full_format.save(w.parallel, w.optimizer, self.full_place, w.step, w.rank, extra)
                return {"checkpoint_file": part} if part is not None else {}
            # rank 0 reaches no place to write: the state goes to the driver whole, gathered as
            # the other ranks' `save` gathers it
            return {"checkpoint": to_cpu({**full_format.gathered(w.parallel, w.optimizer, w.rank), **extra})}
        folder = dcp.tmp_folder(self.dcp_root, w.step)
        files = dcp.save(w.parallel.model, w.optimizer, folder, w.rank, w.world, self.extra())
        return {"checkpoint_part": {"step": w.step, "folder": str(folder), "files": files, "rank": w.rank}}

    def extra(self) -> dict:
        """What a DCP checkpoint holds beside the shards: scaler, step, the optimizer's settings."""
        w = self.w
        hyper = {k: v for k, v in w.optimizer.param_groups[0].items() if k != "params"}
        return {"scaler": to_cpu(w.scaler.state_dict()), "step": w.step, "hyperparameters": to_cpu(hyper)}

    def load(self, state: dict) -> int:
        """Continue from a checkpoint (see TrainWorker.load); the step it is of."""
        w, cfg = self.w, self.w.config
        self.writes.settle()
        if "dcp" in state:
            state = dcp.load(w.parallel.model, w.optimizer,
                             dcp.locate(state["dcp"], self.dcp_root, cfg.checkpoint_options), state.get("files"))
        else:
            if "full" in state:
                state = dcp.open_full(state["full"], cfg.checkpoint_server, cfg.checkpoint_options,
                                      cfg.unshared_storage)
            w.parallel.load_full_state(w.optimizer, state)
        if state.get("scaler"):
            w.scaler.load_state_dict(state["scaler"])
        w.step = int(state["step"])
        return w.step

    def load_pretrained(self) -> dict:
        """model.pretrained's weights into the model as laid out, this rank's pieces only."""
        from gearshift.workers.build import pretrained

        w = self.w
        spec = w.config.model.get("pretrained")
        if not spec:
            return {}
        start = time.perf_counter()
        folder = pretrained.folder(spec, w.config.search_paths)
        # a pipeline rank's model is its stages' part of the whole (the driver checked the whole)
        got = pretrained.load(w.parallel.model, folder, spec.get("prefix", ""), part=w.layout.pp > 1)
        if spec.get("hash") == "full":  # every byte, this rank's share of the slices (the driver reads none)
            got["slices"] = pretrained.hash_share(folder, w.rank, w.world)
        if w.device.type == "cuda":
            torch.cuda.synchronize(w.device)
        return {**got, "seconds": round(time.perf_counter() - start, 3), "memory": oom.memory_figures(w.device)}

    def write_final(self, folder: str, target: str, token: str) -> dict:
        """final.pt out of the committed DCP checkpoint `folder` (as the driver named it), a tensor
        at a time, by rank 0 where it sees the run's folder itself (the driver's token in
        FINAL_MARK there); {"written": bool, "bytes": ...}. Other ranks do nothing."""
        from gearshift.workers.state import export

        w = self.w
        if w.rank != 0:
            return {}
        target = pathlib.Path(target)
        try:
            seen = (target.parent / FINAL_MARK).read_text() == token
        except OSError:
            seen = False
        if not seen:
            return {"written": False}
        source = export.ModelTensors(dcp.locate(folder, self.dcp_root, w.config.checkpoint_options), verify=False)
        return {"written": True, "bytes": export.write_torch(source, target)}
