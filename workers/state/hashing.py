"""DCP's storage writers with every file hashed as its bytes go out, so a checkpoint's digests
cost no second read of what was just written (on a served or remote folder that read would
cross the network again).

`hashed(writer)` wraps the writer's file system (DCP's local `FileSystem`, or the fsspec one
FsspecWriter and the driver's FileServer use): each stream it opens for writing hashes what is
written through it, and a rename (DCP writes `.metadata.tmp`, then renames it) carries the
digest to the new name. DCP writes its files front to back (`tell` for offsets, no seeks), so
the running digest is the file's digest; a seek would make it wrong, and raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import threading


class HashedStream(io.RawIOBase):
    """A stream open for writing that hashes and counts what goes through it."""

    def __init__(self, raw, done, name: str = ""):
        self.raw, self._done, self.name = raw, done, name
        self.sha, self.size = hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        written = self.raw.write(view)
        written = len(view) if written is None else written  # fsspec's buffered files return None
        self.sha.update(view[:written])  # hashlib lets go of the GIL for large blocks: training goes on
        self.size += written
        return written

    def tell(self) -> int:
        return self.raw.tell()

    def seek(self, *args):
        raise io.UnsupportedOperation("a hashed checkpoint stream is written front to back")

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        if not self.closed:
            self.raw.flush()
            self._done(self.size, self.sha.hexdigest())
        super().close()


class HashingFileSystem:
    """DCP's file system for one writer, recording {file name: {"bytes", "sha256"}} of what it
    wrote (names are the files' base names: a DCP folder is flat)."""

    def __init__(self, inner):
        self.inner = inner
        self.written: dict[str, dict] = {}
        self._lock = threading.Lock()  # DCP may write with several threads

    def __getattr__(self, name):
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        name = os.path.basename(os.fspath(path))

        def done(size: int, digest: str) -> None:
            with self._lock:
                self.written[name] = {"bytes": size, "sha256": digest}

        with self.inner.create_stream(path, mode) as raw:
            stream = HashedStream(raw, done, os.fspath(path))
            try:
                yield stream
            except BaseException:
                stream._done = lambda size, digest: None  # a write that raised has no digest to report
                raise
            finally:
                stream.close()  # before the inner stream closes: it flushes into it

    def rename(self, path, new_path) -> None:
        self.inner.rename(path, new_path)
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        with self._lock:
            if old in self.written:
                self.written[new] = self.written.pop(old)


def hashed(writer):
    """`writer` (a DCP FileSystemWriter or FsspecWriter), its files hashed as they are written;
    `digests(writer)` says what it wrote."""
    writer.fs = HashingFileSystem(writer.fs)
    return writer


def digests(writer) -> dict[str, dict]:
    with writer.fs._lock:
        return dict(writer.fs.written)
