"""Where checkpoints live: a local or shared folder (a `pathlib.Path`), or an object store or any
other fsspec URL (`s3://bucket/prefix`, `gs://...`, `memory://...`), as a `RemotePath`.

`RemotePath` offers the few `pathlib.Path` operations the checkpoint code uses (`/`, `name`,
`parent`, `is_dir`, `is_file`, `exists`, `iterdir`, `glob`, `read_bytes`, `read_text`,
`write_bytes`, `open`, `stat`, `mkdir`, `unlink`), so that code reads the same for both; what
differs is said where it differs (workers/state/checkpoint.py): an object store has no rename and
no fsync, so a checkpoint there is written under its final name and becomes a checkpoint when
its manifest, written last in one PUT, appears; a folder without a manifest is never loaded.

`storage_options` (the job's checkpoint.storage_options) go to fsspec: an S3-compatible
endpoint, credentials, a region.
"""

from __future__ import annotations

import fnmatch
import pathlib
import posixpath
from dataclasses import dataclass
from typing import Any


def is_url(root: Any) -> bool:
    """A URL with a scheme other than file:// (those are local folders)."""
    return isinstance(root, str) and "://" in root and not root.startswith("file://")


def location(root: "str | pathlib.Path | RemotePath", options: dict | None = None):
    """A checkpoint root as a Path (local, file://) or a RemotePath (any other fsspec URL)."""
    if isinstance(root, (RemotePath, pathlib.Path)):
        return root
    if is_url(root):
        return RemotePath.open_url(root, options or {})
    return pathlib.Path(root[len("file://"):] if str(root).startswith("file://") else root)


def is_remote(path) -> bool:
    return isinstance(path, RemotePath)


def is_served(path) -> bool:
    """A folder on the driver's node that this worker reaches through its FileServer."""
    from gearshift.workers.state import fileserver

    return is_remote(path) and path.fs.protocol == fileserver.PROTOCOL


_OBJECT_STORES = {"s3", "s3a", "gs", "gcs", "abfs", "az", "oss", "r2"}


@dataclass(frozen=True)
class _Stat:
    st_size: int
    st_mtime: float


class RemotePath:
    """A path in an fsspec filesystem, with the pathlib operations the checkpoint code uses."""

    def __init__(self, fs, path: str, url_root: str, root_path: str, options: dict):
        self.fs, self.path, self.options = fs, path.rstrip("/"), dict(options)
        self._url_root, self._root_path = url_root, root_path.rstrip("/")

    @classmethod
    def open_url(cls, url: str, options: dict) -> "RemotePath":
        import fsspec

        from gearshift.workers.state import fileserver

        # the driver's folder served to workers on other nodes (workers/state/fileserver.py)
        fsspec.register_implementation(fileserver.PROTOCOL, "gearshift.workers.state.fileserver.ServedFileSystem",
                                       clobber=True)
        fs, path = fsspec.core.url_to_fs(url, **options)
        return cls(fs, path, url.rstrip("/"), path, options)

    # ---------------------------------------------------------------- naming
    def __truediv__(self, part: str) -> "RemotePath":
        return RemotePath(self.fs, posixpath.join(self.path, str(part)), self._url_root, self._root_path, self.options)

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.fs, posixpath.dirname(self.path), self._url_root, self._root_path, self.options)

    @property
    def url(self) -> str:
        """The full URL (what fsspec opens, and what DCP's fsspec reader and writer take)."""
        rel = self.path[len(self._root_path):] if self.path.startswith(self._root_path) else "/" + self.path
        return self._url_root + rel

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def resolve(self) -> "RemotePath":
        return self

    # ---------------------------------------------------------------- queries
    # Each query asks the storage afresh: fsspec caches listings, and workers write between asks.
    def exists(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return self.fs.exists(self.path)

    def is_dir(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return self.fs.isdir(self.path)

    def is_file(self) -> bool:
        self.fs.invalidate_cache(self.path)
        return self.fs.isfile(self.path)

    def iterdir(self):
        self.fs.invalidate_cache(self.path)  # another process (a worker) may have written since
        try:
            names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return
        for name in names:
            if name.rstrip("/") != self.path:
                yield RemotePath(self.fs, name, self._url_root, self._root_path, self.options)

    def glob(self, pattern: str):
        return [p for p in self.iterdir() if fnmatch.fnmatch(p.name, pattern)]

    def rglob(self, pattern: str):
        for name in self.fs.find(self.path):
            p = RemotePath(self.fs, name, self._url_root, self._root_path, self.options)
            if fnmatch.fnmatch(p.name, pattern):
                yield p

    def stat(self) -> _Stat:
        self.fs.invalidate_cache(self.path)
        info = self.fs.info(self.path)
        mtime = info.get("LastModified") or info.get("mtime") or info.get("created") or 0
        return _Stat(int(info.get("size") or 0), mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime))

    # ---------------------------------------------------------------- data
    def open(self, mode: str = "rb"):
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.path)

    def read_text(self) -> str:
        return self.read_bytes().decode()

    def write_bytes(self, data: bytes) -> None:
        """One PUT on an object store: the object appears whole or not at all."""
        self.fs.pipe_file(self.path, data)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """A folder where the filesystem has folders. In an object store nothing: keys need no
        folders, and a `mkdir` there would create a missing bucket, which is the user's to make."""
        if not self.object_store:
            self.fs.makedirs(self.path, exist_ok=True)

    @property
    def object_store(self) -> bool:
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        return bool(set(protocols) & _OBJECT_STORES)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        try:
            self.fs.rm(self.path, recursive=True)
        except FileNotFoundError:
            pass


def remove_tree(path) -> None:
    """shutil.rmtree for either kind of path, ignoring what is already gone."""
    if is_remote(path):
        path.rmtree()
    else:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def probe(root, timeout_s: float = 30.0) -> None:
    """Write, read back and delete a small object under `root`: raises OSError with the storage's
    own reason when this process cannot use it (no such bucket, no credentials, no endpoint).
    Bounded by `timeout_s` whatever the client's retries."""
    import concurrent.futures
    import os
    import uuid

    root = location(root)
    name = f".gearshift-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}"

    def attempt() -> None:
        root.mkdir(parents=True, exist_ok=True)
        target = root / name
        target.write_bytes(b"gearshift")
        if target.read_bytes() != b"gearshift":
            raise OSError(f"{target} read back other bytes than were written")
        target.unlink(missing_ok=True)

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(attempt).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise OSError(f"no answer within {timeout_s:.0f} s") from None
    finally:
        pool.shutdown(wait=False)
