"""Atomic checkpoints with a manifest: a checkpoint either verifies whole or is not used.

Layout: `checkpoints/step_00000050/{state.pt, manifest.json}`. A checkpoint is written into a
temporary folder, every file fsynced, then the folder renamed into place (rename is atomic on
POSIX), so a crash mid-write leaves a `.tmp-*` folder that loading ignores, never a half file
under a real name. The manifest records each file's size and sha256; loading verifies them and
falls back to the previous checkpoint when one does not verify.

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

log = logging.getLogger("gearshift.checkpoint")

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: pathlib.Path, data: bytes) -> None:
    """temp file in the same folder, fsync, rename, fsync the folder."""
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(root: pathlib.Path, step: int, state: dict, keep: int, meta: dict | None = None) -> pathlib.Path:
    """Write `state` as the checkpoint of `step` under `root`, then keep only the newest `keep`."""
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".step_{step:08d}.tmp-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        blob = torch_bytes(state)
        files = {"state.pt": blob}
        manifest = {
            "format": FORMAT,
            "step": step,
            "created": time.time(),
            "files": {name: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for name, b in files.items()},
            **(meta or {}),
        }
        files["manifest.json"] = json.dumps(manifest, indent=2).encode()
        for name, data in files.items():
            with open(tmp / name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        if final.exists():  # a rerun of the same step (after a resume): replace it whole
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _prune(root, keep)
    return final


def _prune(root: pathlib.Path, keep: int) -> None:
    marked = best(root)
    for path in list_checkpoints(root)[:-keep]:
        if marked is None or path.name != marked["path"]:
            shutil.rmtree(path, ignore_errors=True)
    for stale in root.glob(".step_*.tmp-*"):  # left by a crash mid-write
        if stale.stat().st_mtime < time.time() - 60:
            shutil.rmtree(stale, ignore_errors=True)


BEST = "best.json"


def best(root: pathlib.Path) -> dict | None:
    """What best.json says ({"step", "path", "eval_loss"}), or None when there is none (or it is unreadable:
    then nothing is protected from pruning, which only costs the old best)."""
    try:
        marked = json.loads((pathlib.Path(root) / BEST).read_text())
    except (OSError, ValueError):
        return None
    return marked if isinstance(marked, dict) and isinstance(marked.get("path"), str) else None


def mark_best(root: pathlib.Path, step: int, eval_loss: float, keep: int) -> pathlib.Path:
    """Name the checkpoint of `step` (it must exist) as the best, then prune: the old best goes
    unless it is among the newest `keep`."""
    root = pathlib.Path(root)
    path = root / f"step_{step:08d}"
    if not path.is_dir():
        raise CheckpointError(f"{path}: no checkpoint at step {step} to mark as the best")
    write_file_atomic(root / BEST, json.dumps({"step": step, "path": path.name, "eval_loss": eval_loss}).encode())
    _prune(root, keep)
    return path


def list_checkpoints(root: pathlib.Path) -> list[pathlib.Path]:
    """Complete checkpoint folders, oldest first (temporary folders are never listed)."""
    root = pathlib.Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


def verify(path: pathlib.Path) -> tuple[dict, dict[str, bytes]]:
    """The manifest and the files' bytes, when every file matches the manifest; else CheckpointError."""
    path = pathlib.Path(path)
    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: manifest unreadable ({err})") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {manifest.get('format')!r}, this gearshift reads {FORMAT}")
    files = {}
    for name, want in manifest.get("files", {}).items():
        try:
            data = (path / name).read_bytes()
        except OSError as err:
            raise CheckpointError(f"{path}: {name} unreadable ({err})") from None
        if len(data) != want["bytes"] or hashlib.sha256(data).hexdigest() != want["sha256"]:
            raise CheckpointError(f"{path}: {name} does not match its manifest (size or checksum)")
        files[name] = data
    if "state.pt" not in files:
        raise CheckpointError(f"{path}: the manifest lists no state.pt")
    return manifest, files


def load(path: pathlib.Path) -> dict:
    _, files = verify(path)
    # weights_only: a checkpoint is data; loading one never runs code from it
    return torch.load(io.BytesIO(files["state.pt"]), map_location="cpu", weights_only=True)


def load_latest(root: pathlib.Path) -> tuple[pathlib.Path, dict] | None:
    """The newest checkpoint that verifies and loads; broken ones are skipped with a warning."""
    for path in reversed(list_checkpoints(root)):
        try:
            return path, load(path)
        except Exception as err:  # any checkpoint that cannot be used is skipped, whatever the reason
            log.warning("skipping checkpoint %s: %s", path.name, str(err).splitlines()[0])
    return None
