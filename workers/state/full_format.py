"""The full checkpoint format (whole tensors in one `state.pt`), written without building the state.

Where the full format is still chosen (checkpoint.format: full), the ranks gather the state one
tensor at a time (every rank takes part in each gather when the layout shards), and rank 0
writes each into `state.pt` as it comes (workers/export.write_streamed: the file's structure
first, then each tensor's record filled), in a temporary file on its own node; the file then goes
into the checkpoint's temporary folder (moved, or uploaded block by block through the driver's
file server or to the object store), and the driver commits it like a DCP checkpoint: manifest,
rename. Rank 0 holds one gathered tensor at a time, never the state; the driver holds nothing.
"""

from __future__ import annotations

import itertools
import pathlib
import shutil
import tempfile

import torch

from gearshift.strategies.state import tensors_of
from gearshift.workers.state import checkpoint, dcp, export, storage

STATE = "state.pt"


def place(checkpoint_dir: str | None, server: str | None, options: dict | None, unshared: bool):
    """Where this rank can put a full-format checkpoint's file: the driver's folder itself where
    this node sees it, else through the driver's file server, else (a URL) the store; None when
    nothing reaches it (then the state goes to the driver whole, as earlier versions sent it)."""
    from gearshift.workers.state import fileserver

    if not checkpoint_dir:
        return None
    root = storage.location(checkpoint_dir, options)
    if storage.is_remote(root):  # an object store: only if this node gets through to it
        try:
            storage.probe(root)
            return root
        except Exception:  # noqa: BLE001 - whatever the storage says, this rank cannot use it
            return None
    if not unshared and dcp._sees(root, server):
        return root
    if server:
        try:
            via = storage.location(fileserver.url(server, str(root)))
            return via if via.is_dir() else None
        except Exception:  # noqa: BLE001 - no server answers: nothing reaches the folder from here
            return None
    return None


def _placeholders(tree, counter: list):
    if isinstance(tree, dict):
        return {k: _placeholders(v, counter) for k, v in tree.items()}
    if torch.is_tensor(tree):
        counter.append(None)
        return export.placeholder(tree.dtype, tree.shape, len(counter) - 1)
    return tree


def gathered(parallel, optimizer, rank: int) -> dict | None:
    """The whole state as full tensors on rank 0, gathered as `save` gathers it (None elsewhere):
    rank 0 takes this where it reaches no place to write while the other ranks `save`, so every
    rank takes part in the same gathers and sends. Rank 0 holds the whole state (it goes to the
    driver whole)."""
    whole = parallel.whole_state(optimizer, rank)
    tensors = whole.tensors()
    if rank != 0:
        for _ in tensors:
            pass
        return None

    def filled(tree):
        if isinstance(tree, dict):
            return {k: filled(v) for k, v in tree.items()}
        return next(tensors) if torch.is_tensor(tree) else tree

    return filled(whole.tree())


def save(parallel, optimizer, root, step: int, rank: int, extra: dict) -> dict | None:
    """Rank 0 writes the checkpoint of `step` as `state.pt` into its temporary folder under `root`
    and returns {"step", "folder", "files"}; the other ranks take part in the gathers and return
    None. All ranks call it at the same step."""
    whole = parallel.whole_state(optimizer, rank)
    if rank != 0:
        for _ in whole.tensors():  # this rank's part of each gather or send, in rank 0's order
            pass
        return None
    tree = {**whole.tree(), **extra}
    layout = _placeholders(tree, [])
    extras = (t.detach().cpu() for t in tensors_of(extra))
    local = pathlib.Path(tempfile.mkdtemp(prefix="gearshift-state-"))
    try:
        written = local / STATE
        export.write_streamed(written, layout, ((t,) for t in itertools.chain(whole.tensors(), extras)))
        files = {STATE: {"bytes": written.stat().st_size, "sha256": checkpoint.sha256_file(written)}}
        folder = dcp.tmp_folder(root, step)
        if storage.is_remote(folder):  # an object store: a checkpoint of this step written before stops counting
            (folder / "manifest.json").unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        if storage.is_remote(folder):
            with open(written, "rb") as src, (folder / STATE).open("wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)
        else:
            shutil.move(str(written), folder / STATE)
    finally:
        shutil.rmtree(local, ignore_errors=True)
    return {"step": step, "folder": str(folder), "files": files}

