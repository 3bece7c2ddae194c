"""Atomic checkpoints with a manifest: a checkpoint either verifies whole or is not used.

Two formats, both loaded by any layout and world size:
- `dcp` (format 2): `checkpoints/step_00000050/{dcp/.metadata, dcp/__R_0.distcp..., extra.pt,
  manifest.json}`. Every rank writes its own shards in parallel (workers/state/dcp.py); nothing is
  gathered. `extra.pt` holds the scaler state and the step.
- `full` (format 1, what earlier versions wrote; chosen by checkpoint.format full, or when some
  worker reaches the checkpoints' place by no route): `checkpoints/step_00000050/{state.pt,
  manifest.json}`, whole tensors, gathered a tensor at a time and written by rank 0 as they come
  (workers/state/full_format.py); the driver commits it. Where rank 0 reaches no place either, it
  sends the whole state and the driver writes it (`save`).

A checkpoint is written into a temporary folder, every file fsynced, then the folder renamed
into place (rename is atomic on POSIX), so a crash mid-write leaves a `.step_*.tmp-*` folder that
loading ignores, never a half file under a real name. The manifest, written last, records each
file's size and sha256; loading verifies them and falls back to the previous checkpoint when one
does not verify.

`checkpoints/best.json` (written atomically; only with checkpoint.keep_best) names the checkpoint
with the lowest eval loss: `{"step", "path", "eval_loss"}`. Pruning never deletes the checkpoint
it names, so the best survives besides the newest `keep`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pathlib
import re
import shutil
import time
from typing import Any

import torch

from gearshift.workers.state.storage import is_remote, location, remove_tree

log = logging.getLogger("gearshift.checkpoint")

FORMAT = 1  # whole tensors in state.pt
DCP_FORMAT = 2  # torch.distributed.checkpoint shards under dcp/, written by every rank
DCP_DIR = "dcp"
EXTRA = "extra.pt"
_NAME = re.compile(r"^step_(\d{8})$")
_TMP = re.compile(r"^\.step_(\d{8})\.tmp-")


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: pathlib.Path) -> None:
    if is_remote(path):  # an object store has no folders to sync: each object is durable once written
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: pathlib.Path, data: bytes) -> None:
    """temp file in the same folder, fsync, rename, fsync the folder (in an object store: one PUT,
    which is atomic there)."""
    path = location(path)
    if is_remote(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def sha256_file(path: pathlib.Path, chunk: int = 1 << 22) -> str:
    """Streamed: a shard file is never held in memory whole. A file the driver's FileServer
    holds is hashed there, not read back over the network."""
    if is_remote(path) and hasattr(path.fs, "sha256"):
        return path.fs.sha256(path.path)
    h = hashlib.sha256()
    with (path.open("rb") if is_remote(path) else open(path, "rb")) as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _fsync_tree(folder: pathlib.Path) -> None:
    if is_remote(folder):
        return
    for path in sorted(folder.rglob("*"), reverse=True):  # files before the folders holding them
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        else:
            _fsync_dir(path)
    _fsync_dir(folder)


def commit(root: pathlib.Path, step: int, tmp: pathlib.Path, files: dict, keep: int,
           meta: dict | None = None, fmt: int = DCP_FORMAT) -> pathlib.Path:
    """Make the checkpoint the ranks wrote into `tmp` (DCP shards, or in the full format rank 0's
    state.pt: `fmt`) visible as the checkpoint of `step`:
    check every file the ranks reported is there with its size, write the manifest (last),
    fsync, rename, prune. Raises CheckpointError (and removes `tmp`) when a file is missing:
    then the workers wrote somewhere this process cannot see."""
    root, tmp = location(root), location(tmp)

    def fill() -> None:
        for name, want in files.items():
            path = tmp / name
            if not path.is_file() or path.stat().st_size != want["bytes"]:
                raise CheckpointError(f"{tmp}: {name} that a worker wrote is missing or of another size here; "
                                      "the workers and the driver must share the run directory's file system")
        manifest = {"format": fmt, "step": step, "created": time.time(), "files": files, **(meta or {})}
        _fsync_tree(tmp)
        write_file_atomic(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())

    return _publish(root, step, tmp, fill, keep)


def _publish(root: pathlib.Path, step: int, tmp: pathlib.Path, fill, keep: int) -> pathlib.Path:
    """`fill()` completes the temp folder; then it becomes the checkpoint of `step` (one rename,
    the parent fsynced) and old ones are pruned. Whatever fails, the temp folder goes. In an
    object store, which cannot rename, the folder already has its final name and `fill()` writes
    the manifest last: the checkpoint exists from that PUT on."""
    final = root / f"step_{step:08d}"
    if is_remote(root):
        try:
            fill()
        except BaseException:
            remove_tree(tmp)
            raise
        _prune(root, keep)
        return final
    try:
        fill()
        if final.exists():  # a rerun of the same step (after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(root: pathlib.Path, step: int, state: dict, keep: int, meta: dict | None = None) -> pathlib.Path:
    """Write `state` as the checkpoint of `step` under `root`, then keep only the newest `keep`."""
    root = location(root)
    root.mkdir(parents=True, exist_ok=True)
    if is_remote(root):  # written under its final name, the manifest last (an earlier one goes first)
        tmp = root / f"step_{step:08d}"
        (tmp / "manifest.json").unlink(missing_ok=True)
    else:
        tmp = root / f".step_{step:08d}.tmp-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()

    def fill() -> None:
        # torch.save straight into the file (no second copy of the state as bytes), hashed after
        if is_remote(tmp):
            with (tmp / "state.pt").open("wb") as f:
                torch.save(state, f)
        else:
            with open(tmp / "state.pt", "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
        files = {"state.pt": {"bytes": (tmp / "state.pt").stat().st_size, "sha256": sha256_file(tmp / "state.pt")}}
        manifest = {"format": FORMAT, "step": step, "created": time.time(), "files": files, **(meta or {})}
        write_file_atomic(tmp / "manifest.json", json.dumps(manifest, indent=2).encode())
        _fsync_dir(tmp)

    return _publish(root, step, tmp, fill, keep)


def _prune(root: pathlib.Path, keep: int) -> None:
    marked = best(root)
    complete = list_checkpoints(root)
    for path in complete[:-keep]:
        if marked is None or path.name != marked["path"]:
            remove_tree(path)
    if is_remote(root):  # a write cut short left a step folder without a manifest, older than the newest
        newest = _step_of(complete[-1]) if complete else -1
        for stale in root.iterdir():
            m = _NAME.match(stale.name)
            if m and int(m.group(1)) < newest and not (stale / "manifest.json").exists():
                remove_tree(stale)
        return
    newest = _step_of(complete[-1]) if complete else -1
    for stale in root.glob(".step_*.tmp-*"):  # left by a crash mid-write
        # one of a newer step may be a write behind the steps still going on: it goes once a newer
        # checkpoint is in
        m = _TMP.match(stale.name)
        if (m is None or int(m.group(1)) < newest) and stale.stat().st_mtime < time.time() - 60:
            shutil.rmtree(stale, ignore_errors=True)


def _step_of(path) -> int:
    return int(_NAME.match(path.name).group(1))


BEST = "best.json"


def best(root: pathlib.Path) -> dict | None:
    """What best.json says ({"step", "path", "eval_loss"}), or None when there is none (or it is unreadable:
    then nothing is protected from pruning, which only costs the old best)."""
    try:
        marked = json.loads((location(root) / BEST).read_text())
    except (OSError, ValueError):
        return None
    return marked if isinstance(marked, dict) and isinstance(marked.get("path"), str) else None


def mark_best(root: pathlib.Path, step: int, eval_loss: float, keep: int) -> pathlib.Path:
    """Name the checkpoint of `step` (it must exist) as the best, then prune: the old best goes
    unless it is among the newest `keep`."""
    root = location(root)
    path = root / f"step_{step:08d}"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint at step {step} to mark as the best")
    write_file_atomic(root / BEST, json.dumps({"step": step, "path": path.name, "eval_loss": eval_loss}).encode())
    _prune(root, keep)
    return path


def list_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoint folders, oldest first (temporary folders are never listed; in an object
    store, neither are folders whose manifest was not written)."""
    root = location(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and p.is_dir()]
    if is_remote(root):
        found = [p for p in found if (p / "manifest.json").exists()]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def manifest_of(path: pathlib.Path, sizes: bool = False) -> dict:
    """The manifest of the checkpoint at `path` when it is one this gearshift reads and lists what
    a load needs (with `sizes`, every file it lists is there at its size: metadata only, no byte of
    data read); else CheckpointError."""
    path = location(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: manifest unreadable ({err})") from None
    if manifest.get("format") not in (FORMAT, DCP_FORMAT):
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this gearshift reads {FORMAT} and "
                              f"{DCP_FORMAT}")
    needed = ("state.pt",) if manifest["format"] == FORMAT else (f"{DCP_DIR}/.metadata", EXTRA)
    for name in needed:
        if name not in manifest.get("files", {}):
            raise CheckpointError(f"{path}: the manifest lists no {name}")
    for name, want in manifest["files"].items() if sizes else ():
        try:
            size = (path / name).stat().st_size
        except OSError as err:
            raise CheckpointError(f"{path}: {name} unreadable ({err})") from None
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {name} does not match its manifest (size)")
    return manifest


def verify_share(folder: pathlib.Path, files: dict, rank: int, world: int) -> list[str]:
    """Hash this rank's share of a checkpoint's files (every world-th of them, by name) as the
    manifest lists them; the names that do not match. The ranks of a load share the reading, so
    no process reads the whole checkpoint to check it."""
    folder = location(folder)
    bad = []
    for name in sorted(files)[rank::world]:
        try:
            ok = (folder / name).stat().st_size == files[name]["bytes"] and \
                sha256_file(folder / name) == files[name]["sha256"]
        except OSError:
            ok = False
        if not ok:
            bad.append(name)
    return bad


def verify(path: pathlib.Path, read: bool = True) -> tuple[dict, dict[str, bytes]]:
    """The manifest, and the bytes of state.pt (format 1 with `read`; otherwise every file is
    hashed streaming and none is held in memory), when every file matches the manifest; else
    CheckpointError. One process reads every byte: for tools and the full format; a DCP load
    checks its files in the workers (`verify_share`)."""
    path = location(path)
    manifest = manifest_of(path)
    files = {}
    for name, want in manifest.get("files", {}).items():
        try:
            if manifest["format"] == DCP_FORMAT or not read:
                size, digest = (path / name).stat().st_size, sha256_file(path / name)
            else:
                files[name] = data = (path / name).read_bytes()
                size, digest = len(data), hashlib.sha256(data).hexdigest()
        except OSError as err:
            raise CheckpointError(f"{path}: {name} unreadable ({err})") from None
        if size != want["bytes"] or digest != want["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its manifest (size or checksum)")
    return manifest, files


def load(path: pathlib.Path, whole: bool = True) -> dict:
    """What a worker's `load` takes: for a DCP checkpoint a reference {"dcp": folder, "step": N}
    from which every rank reads its own pieces; for the full format the whole state (`whole`, for
    tools and tests) or a reference {"full": file, "step": N} from which every worker maps the file
    on its own node (workers/dcp.open_full), so the driver never reads the state to pass it on.
    A DCP reference carries the manifest's digests: the workers hash their shares of the files
    before reading (`verify_share`), the driver only reads the manifest and the files' sizes."""
    manifest = manifest_of(path, sizes=True)
    if whole or manifest["format"] != DCP_FORMAT:  # hashed here, streaming (state.pt is not held as bytes)
        manifest = verify(path, read=False)[0]
    path = location(path)
    if manifest["format"] == DCP_FORMAT:
        return {"dcp": str(path.resolve()), "step": int(manifest["step"]), "files": manifest["files"]}
    if not whole:
        state = path / "state.pt"
        return {"full": state.url if is_remote(state) else str(state.resolve()), "step": int(manifest["step"])}
    # weights_only: a checkpoint is data; loading one never runs code from it. A local file is
    # mapped, not read
    if is_remote(path):
        return torch.load(io.BytesIO((path / "state.pt").read_bytes()), map_location="cpu", weights_only=True)
    return torch.load(path / "state.pt", map_location="cpu", weights_only=True, mmap=True)


def load_latest(root: pathlib.Path, whole: bool = True, before: int | None = None) -> tuple[pathlib.Path, dict] | None:
    """The newest checkpoint (of a step before `before`, if given) that verifies and loads
    (`whole`: see `load`); broken ones are skipped with a warning."""
    for path in reversed(list_checkpoints(root)):
        if before is not None and int(path.name.split("_")[1]) >= before:
            continue
        try:
            return path, load(path, whole)
        except Exception as err:  # any checkpoint that cannot be used is skipped, whatever the reason
            log.warning("skipping checkpoint %s: %s", path.name, str(err).splitlines()[0])
    return None


def to_cpu(obj):
    """A copy of `obj` (tensors, and dicts, lists and tuples of them) on the host, detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True) if obj.device.type != "cpu" else obj.detach().clone()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj
