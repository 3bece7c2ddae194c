"""Checkpoints in torch.distributed.checkpoint (DCP) format: every rank writes its own shards.

Nothing is gathered: a rank writes the pieces of the model and optimizer state it holds (a
tensor replicated on several ranks is written once, by one of them), all ranks at once, into
the checkpoint's temporary folder; DCP's `.metadata` is written last, by rank 0, after every
rank's data is on disk. Each rank hashes its files as it writes them (workers/state/hashing.py: nothing
is read back) and reports the digests; the driver writes the manifest and renames the folder into
place (workers/state/checkpoint.py), so a checkpoint becomes visible only when complete.

`start_save` writes behind the training steps (DCP's `async_save`): the rank's state is copied
to the CPU (one copy of this rank's state), then written by a thread of DCP's while training goes
on; `PendingSave.part()` is the rank's part once the write is done. The planner's collectives of
that thread run on a gloo group of their own (`save_group`), never on the group the training
steps use, whose collectives they would interleave with in a different order on each rank.

Optimizer state is keyed by parameter name (torch's `get_state_dict`), not by position, and
tensors are stored with their global shapes: loading reads what this rank's layout needs from
whichever files hold it, so any layout and world size can load what any other wrote.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import io
import logging
import pathlib
import time
import warnings

import torch
import torch.distributed as dist
from torch import nn

from gearshift.workers.state import checkpoint, hashing, storage
from gearshift.workers.state.checkpoint import CheckpointError, DCP_DIR, EXTRA

log = logging.getLogger("gearshift.checkpoint")

# how long a checkpoint step (or the end of a chunk) waits for the write before it: the write's
# collectives time out on their own with the job's collective timeout, so only storage that
# takes no more bytes and raises nothing meets this
WRITE_TIMEOUT_S = 3600.0


def root_for(checkpoint_dir: str | None, fmt: str, device: torch.device, options: dict | None = None,
             served: str | None = None, unshared: bool = False) -> tuple:
    """(where this run's ranks write DCP checkpoints, or None for the full format; why this rank
    could not reach the place, or None). The full format: checkpoint.format
    full, no run directory, or (auto) some rank cannot reach the checkpoints' place and there is
    no way round: an object store this node has no route or credentials to, or the driver's
    folder on a cluster whose nodes share no file system when no FileServer was started for it.
    When the driver's FileServer `served` runs (workers/state/fileserver.py) and some rank does not see
    the folder (or `unshared`: inject.unshared_storage says to act so), every rank reaches it
    through the server. Every rank must agree, so it is a collective."""
    if fmt == "full" or not checkpoint_dir:
        return None, None
    root = storage.location(checkpoint_dir, options)
    why = None
    if storage.is_remote(root):
        try:
            storage.probe(root)
            reached = True
        except Exception as err:  # noqa: BLE001 - whatever the storage says, this rank cannot use it
            reached = False  # and the run says why at its start (expired credentials, a missing bucket)
            why = f"{type(err).__name__}: {err}"[:300]
    else:
        reached = not unshared and _sees(root, served)
    seen = torch.tensor([1 if reached else 0], device=device)
    if dist.is_initialized():
        dist.all_reduce(seen, op=dist.ReduceOp.MIN)
    if seen.item():
        return root, None
    via = _through_server(root, served, device) if not storage.is_remote(root) else None
    if via is not None:
        return via, None
    if fmt == "dcp":
        raise RuntimeError(f"checkpoint.format is dcp but {checkpoint_dir} is not visible on every worker's node: "
                           "put the run directory on storage all nodes share (--run-dir), or use checkpoint.format "
                           "auto or full" + (f" (this worker's probe of it said: {why})" if why else ""))
    return None, why


def _sees(root: pathlib.Path, served: str | None) -> bool:
    """This node sees the driver's folder itself: it exists here, and when the driver's server runs,
    it holds the server's mark (a folder of the same name on another disk does not count)."""
    from gearshift.workers.state import fileserver

    if not root.is_dir():
        return False
    if not served:
        return True
    try:
        return (root / fileserver.MARK).read_text() == served
    except OSError:
        return False


def _through_server(root: pathlib.Path, served: str | None, device: torch.device):
    """The driver's folder as reached through its FileServer, or None when no server answers.
    Every rank takes part: all of them use the server or none does."""
    from gearshift.workers.state import fileserver

    ok = True
    try:
        via = storage.location(fileserver.url(served, str(root))) if served else None
        ok = via is not None and via.is_dir()
    except Exception:  # noqa: BLE001 - no such actor (never started), or it does not answer
        via, ok = None, False
    agreed = torch.tensor([1 if ok else 0], device=device)
    if dist.is_initialized():
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    return via if agreed.item() else None


def locate(path: str, root, options: dict | None = None):
    """A checkpoint folder the driver named (a path on its node, or a URL) as this rank reaches
    it: through the driver's FileServer when this rank writes through it."""
    if storage.is_served(root) and not storage.is_url(path):
        from gearshift.workers.state import fileserver

        return storage.location(fileserver.url(root.fs.server, path))
    return storage.location(path, options)


def open_full(path: str, server: str | None = None, options: dict | None = None, unshared: bool = False) -> dict:
    """A full-format checkpoint's state (`path`: its state.pt, as the driver named it), mapped from
    this node's disk rather than handed over by the driver: the driver's file itself where this
    node sees it; else a copy fetched block by block (through the driver's FileServer, or from the
    object store) into a temporary file here, mapped, then unlinked (the mapping keeps it). Each
    layout then copies out only its pieces, so only the pages those touch are read."""
    import shutil
    import tempfile

    from gearshift.workers.state import fileserver

    local = None if storage.is_url(path) else pathlib.Path(path)
    if local is not None and not unshared and local.is_file() and _sees(local.parent.parent, server):
        return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
    if local is not None and not server:
        raise CheckpointError(f"{path} is not visible on this worker's node, and no file server was started")
    source = storage.location(fileserver.url(server, path)) if local is not None else storage.location(path, options)
    with tempfile.NamedTemporaryFile(prefix="gearshift-state-", suffix=".pt") as copy:
        with source.open("rb") as f:
            shutil.copyfileobj(f, copy, fileserver.BLOCK)
        copy.flush()
        return torch.load(copy.name, map_location="cpu", weights_only=True, mmap=True)


def tmp_folder(root, step: int):
    """The folder every rank writes the checkpoint of `step` into (the same name on every rank
    without asking: the driver renames it once all of them reported). In an object store, which
    cannot rename, the checkpoint's own folder: it counts once the driver wrote its manifest."""
    root = storage.location(root)
    if storage.is_remote(root) and not storage.is_served(root):
        return root / f"step_{step:08d}"
    return root / f".step_{step:08d}.tmp-dcp"  # the driver renames it; through its server too


def _writer(folder):
    """DCP's writer for `folder`, every file it writes hashed on the way (workers/state/hashing.py)."""
    dcp = _dcp()
    if storage.is_remote(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        return hashing.hashed(FsspecWriter((folder / DCP_DIR).url, sync_files=False, thread_count=1,
                                           **folder.options))
    return hashing.hashed(dcp.FileSystemWriter(str(folder / DCP_DIR), sync_files=True, thread_count=1))


def _written(writer) -> dict:
    return {f"{DCP_DIR}/{name}": digest for name, digest in hashing.digests(writer).items()}


def reader(folder):
    """DCP's reader for the checkpoint folder `folder` (a local path or a RemotePath)."""
    dcp = _dcp()
    folder = storage.location(folder)
    if storage.is_remote(folder):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        return FsspecReader((folder / DCP_DIR).url, **folder.options)
    return dcp.FileSystemReader(str(folder / DCP_DIR))


def _load_extra(folder) -> dict:
    folder = storage.location(folder)
    if storage.is_remote(folder):
        return torch.load(io.BytesIO((folder / EXTRA).read_bytes()), map_location="cpu", weights_only=True)
    return torch.load(folder / EXTRA, map_location="cpu", weights_only=True)


def _dcp():
    """torch.distributed.checkpoint, imported when a DCP checkpoint is first written or read: it
    pulls in torch.distributed.tensor, which a data-parallel worker otherwise never imports."""
    import torch.distributed.checkpoint as dcp

    return dcp


def _prepare(folder, rank: int) -> None:
    """Rank 0 readies the folder; every rank waits for it (on the training group, from the
    training thread: all ranks are at the same step)."""
    if rank == 0:
        if storage.is_remote(folder):  # a checkpoint of this step written before (a rerun) stops counting first
            (folder / "manifest.json").unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in (folder / DCP_DIR).glob("*"):  # a crashed attempt at this step left files behind
            stale.unlink()
    dist.barrier()


def _state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    # param_groups stay out: layouts group parameters differently (by mesh), and the
    # hyperparameters come from the job (the learning rate is set every step)
    return {"model": model_sd, "optim": {"state": optim_sd["state"]}}


def _write_extra(folder, rank: int, extra: dict) -> dict:
    """Rank 0 writes `extra` (scaler, step) and hashes the bytes it wrote; other ranks nothing."""
    if rank != 0:
        return {}
    data = checkpoint.torch_bytes(extra)
    checkpoint.write_file_atomic(folder / EXTRA, data)
    return {EXTRA: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}}


def save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: pathlib.Path, rank: int, world: int,
         extra: dict) -> dict:
    """Write this rank's shards of the model and optimizer under `folder` (all ranks call it at
    the same step) and wait for them; rank 0 also writes `extra` (scaler, step). Returns this
    rank's digests of what it wrote: {relative path: {"bytes", "sha256"}}."""
    folder = storage.location(folder)
    _prepare(folder, rank)
    writer = _writer(folder)
    _dcp().save(_state(model, optimizer), storage_writer=writer)
    return {**_written(writer), **_write_extra(folder, rank, extra)}


def save_group():
    """The gloo group a rank's writes behind training coordinate on (every rank makes it at the
    same point); it times out with the job's collective timeout, so a lost peer fails the write
    instead of hanging it. None without a process group."""
    if not dist.is_initialized():
        return None
    from gearshift.strategies.mesh import group_timeout

    return dist.new_group(backend="gloo", timeout=group_timeout())


class PendingSave:
    """One rank's checkpoint being written behind the training steps."""

    def __init__(self, step: int, folder, future, writer, files: dict):
        self.step, self.folder, self.future, self.writer, self.files = step, folder, future, writer, files
        self.started, self.finished = time.time(), None
        # stamped by the thread that wrote it, when it ends: the write's end, not when it was noticed
        future.add_done_callback(lambda _: setattr(self, "finished", time.time()))

    def done(self) -> bool:
        return self.future.done()

    def part(self, timeout: float = WRITE_TIMEOUT_S) -> dict:
        """This rank's part of the checkpoint (waits for the write; raises what it raised):
        {"step", "folder", "files", "written": [start, end] (wall clock)}."""
        try:
            self.future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise CheckpointError(f"the checkpoint of step {self.step} was still being written after {timeout:g} s "
                                  f"({self.folder})") from None
        finished = self.finished or time.time()  # the callback may run just after result() returns
        return {"step": self.step, "folder": str(self.folder), "files": {**_written(self.writer), **self.files},
                "written": [self.started, finished]}


def start_save(model: nn.Module, optimizer: torch.optim.Optimizer, folder: pathlib.Path, step: int, rank: int,
               extra: dict, group) -> PendingSave:
    """Start writing this rank's shards under `folder` behind the training steps (all ranks call
    it at the same step): the state is copied to the CPU here, so the steps that follow may
    change the model; DCP writes the copy in a thread of its own, coordinating over `group`
    (`save_group`). Rank 0 writes `extra` now (it is small)."""
    folder = storage.location(folder)
    _prepare(folder, rank)
    files = _write_extra(folder, rank, extra)
    writer = _writer(folder)
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    # a thread, not a process: the staged copy is handed over without pickling it again
    future = dcp.async_save(_state(model, optimizer), storage_writer=writer, process_group=group,
                            async_checkpointer_type=AsyncCheckpointerType.THREAD)
    return PendingSave(step, folder, future, writer, files)


class Behind:
    """A rank's checkpoints written behind its training steps, one at a time."""

    def __init__(self):
        self.pending: PendingSave | None = None
        self.group = None  # save_group's, made at the first write (every rank at the same step)
        self.rank = 0

    def start(self, model, optimizer, folder, step: int, rank: int, extra: dict) -> dict:
        """Start the checkpoint of `step` behind the steps (all ranks together, at a checkpoint
        step of the loop): this rank's state is copied to the CPU and written while the steps that
        follow run. One write at a time per rank: one still in flight is waited for here first, and
        its part (as a report's entry) is returned; this one's part comes from `take`, with a later
        report of the same train call, or at its end at the latest."""
        done = self.take(wait=True)
        if self.group is None:
            self.group = save_group()
        self.pending = start_save(model, optimizer, folder, step, rank, extra, self.group)
        self.rank = rank
        return done

    def take(self, wait: bool) -> dict:
        """{"checkpoint_part": ...} of the write in flight once it has ended (`wait`: waited for,
        at most WRITE_TIMEOUT_S; a write that failed raises, as the synchronous save would); {}
        while it goes on, or when there is none."""
        if self.pending is None or not (wait or self.pending.done()):
            return {}
        pending, self.pending = self.pending, None
        return {"checkpoint_part": {**pending.part(), "rank": self.rank}}

    def settle(self) -> None:
        """Outside a train call (a switch, a load, a checkpoint, shutdown): wait for a write still
        in flight. Its part can no longer be reported, so that checkpoint is never committed (a
        train call reports its writes before it ends: this only follows one cut short)."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        try:
            pending.part()
        except Exception as err:  # noqa: BLE001 - nothing counts on that checkpoint any more
            log.warning("the checkpoint of step %d failed behind the steps: %s", pending.step, err)

    def drop(self) -> None:
        """Forget the write in flight (the group it coordinates on is about to be left, so it
        fails or ends unreported: never committed either way)."""
        self.pending = None


def load(model: nn.Module, optimizer: torch.optim.Optimizer, folder: pathlib.Path, files: dict | None = None) -> dict:
    """Read this rank's pieces of a DCP checkpoint into the model and optimizer as laid out now;
    returns the extra state (scaler, step). All ranks call it together. With `files` (the
    manifest's digests) the ranks first hash a share of the files each and agree that all match:
    a mismatch found anywhere is a CheckpointError on every rank, before anything is read in."""
    folder = storage.location(folder)
    if files:
        check_files(folder, files)
    dcp = _dcp()
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    check_matches(folder, model_sd, _all_names(model_sd))
    state = {"model": model_sd, "optim": {"state": optim_sd["state"]}}
    dcp.load(state, storage_reader=reader(folder))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={"state": state["optim"]["state"], "param_groups": optim_sd["param_groups"]})
    return _load_extra(folder)


def check_files(folder: pathlib.Path, files: dict) -> None:
    """Every rank hashes its share of `files` (checkpoint.verify_share); CheckpointError on every
    rank, naming the files, when any rank found one that does not match."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    bad = checkpoint.verify_share(folder, files, rank, world)
    found = [bad]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, bad)
    names = sorted(n for part in found for n in part or ())
    if names:
        raise CheckpointError(f"{folder}: {', '.join(names[:4])} do(es) not match its manifest (size or checksum)")


def _all_names(model_sd: dict) -> set[str]:
    """The model's tensor names over every rank: a pipeline stage holds only its own."""
    names = set(model_sd)
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, sorted(names))
        names = {n for part in found for n in part}
    return names


def check_matches(folder: pathlib.Path, model_sd: dict, everyone: set[str] | None = None) -> None:
    """CheckpointError naming the first tensor whose name or global shape differs between the
    checkpoint and the model (DCP's own message would not say which). `everyone`: the names
    every rank's model holds together (default: this rank's), which the checkpoint must not
    exceed."""
    saved = reader(folder).read_metadata().state_dict_metadata
    shapes = {k[len("model."):]: list(v.size) for k, v in saved.items()
              if k.startswith("model.") and hasattr(v, "size")}
    for name, tensor in model_sd.items():
        if not torch.is_tensor(tensor):
            continue
        if name not in shapes:
            raise CheckpointError(f"{folder.name}: the model has {name} {list(tensor.shape)}, the checkpoint "
                                  f"does not (it holds {', '.join(sorted(shapes)[:4])}, ...)")
        if shapes[name] != list(tensor.shape):
            raise CheckpointError(f"{folder.name}: {name} is {shapes[name]} in the checkpoint, "
                                  f"{list(tensor.shape)} in the model")
    extra = sorted(set(shapes) - (everyone if everyone is not None else set(model_sd)))
    if extra:
        raise CheckpointError(f"{folder.name}: the checkpoint has {extra[0]} {shapes[extra[0]]}, the model does not")


def full_model(folder: pathlib.Path) -> dict:
    """The model's full tensors read from a DCP checkpoint in this process (no process group):
    how the driver writes `final.pt` without a worker ever holding the whole model."""
    return _read(folder, "model.").get("model", {})


def full_state(folder: pathlib.Path) -> dict:
    """Everything in a DCP checkpoint as full tensors, shaped like a full-format checkpoint
    (model, optimizer {"state": {name: {...}}, "hyperparameters"}, scaler, step): for tools and
    tests that read a checkpoint whole, in one process."""
    loaded = _read(folder, "")
    extra = _load_extra(folder)
    optimizer = {"state": loaded.get("optim", {}).get("state", {}), "hyperparameters": extra.pop("hyperparameters", {})}
    return {"model": loaded.get("model", {}), "optimizer": optimizer, **extra}


def _read(folder: pathlib.Path, prefix: str) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    source = reader(folder)
    keys = {k for k in source.read_metadata().state_dict_metadata if k.startswith(prefix)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        return _load_state_dict_from_keys(keys, storage_reader=source)


def load_full(path: pathlib.Path) -> dict:
    """A checkpoint's whole state as full tensors in this process, whichever format it has
    ({"model", "optimizer", "scaler", "step"}); verified first. For tools and tests: a run loads
    checkpoints with `checkpoint.load`, each worker reading only its pieces."""
    state = checkpoint.load(path)
    if "dcp" not in state:
        return state
    return full_state(storage.location(path))
