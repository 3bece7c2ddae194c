"""The driver's checkpoints folder, served to workers on nodes that do not share its file system.

A cluster without a shared file system (the shipped cluster.yaml) and without an object store
still gets sharded checkpoints: the controller starts one `FileServer` actor on the driver's own
node, and a worker that cannot see the checkpoints folder reaches it as the fsspec URL
`gearshift://SERVER/absolute/path`, through `ServedFileSystem`. DCP's fsspec reader and writer
and the checkpoint code (workers/storage.RemotePath) then work unchanged: every rank writes its
own shards and reads only its own pieces, in blocks of `BLOCK` bytes, and nothing is gathered.
The files land in the driver's folder under the same names a shared folder would give them, so
the driver commits (manifest, rename), prunes and reads them as local files.

The server holds one block per call in flight; it writes each file under a hidden temporary
name and renames it into place once fsynced, so a writer that dies leaves no partial file under
a real name. It answers only for paths inside the folder it serves.
"""

from __future__ import annotations

import errno
import hashlib
import os
import pathlib
import shutil
import uuid

from fsspec.spec import AbstractBufferedFile, AbstractFileSystem

PROTOCOL = "gearshift"
MARK = ".gearshift-served/name"  # in the served folder: the server's name (a worker seeing it sees the folder
# itself); in a folder of its own, so the checkpoints folder holds only folders
BLOCK = 1 << 20  # bytes per read or write call to the server (a larger block is kept by malloc)
IN_FLIGHT = 8  # blocks of one read or write at the server at once (its max_concurrency)
CALL_TIMEOUT_S = 300.0  # one block, or one fsync, on a loaded node


class FileServer:
    """Runs as a Ray actor on the driver's node (orchestrator/cluster/placement.py starts it)."""

    def __init__(self, root: str):
        self.root = pathlib.Path(root).resolve()
        self._open: dict[str, tuple] = {}  # handle -> (file object, temporary path, final path)

    def mark(self, name: str) -> None:
        write_mark(self.root, name)

    def _inside(self, path: str) -> pathlib.Path:
        p = pathlib.Path(os.path.normpath(path))
        if not p.is_absolute() or (p != self.root and self.root not in p.parents):
            raise PermissionError(errno.EACCES, f"{path} is outside the served folder {self.root}")
        return p

    @staticmethod
    def _entry(p: pathlib.Path, st: os.stat_result) -> dict:
        kind = "directory" if p.is_dir() else "file"
        return {"name": str(p), "size": st.st_size if kind == "file" else 0, "type": kind, "mtime": st.st_mtime}

    def call(self, op: str, *args):
        """One operation; an OSError comes back as a value (its class, errno and text), so the
        caller raises the same kind (FileNotFoundError stays FileNotFoundError)."""
        try:
            return {"ok": getattr(self, "_" + op)(*args)}
        except OSError as err:
            return {"error": type(err).__name__, "errno": err.errno, "text": str(err)}

    def _info(self, path):
        p = self._inside(path)
        return self._entry(p, p.stat())

    def _ls(self, path):
        p = self._inside(path)
        if not p.is_dir():
            return [self._entry(p, p.stat())]
        return [self._entry(c, c.stat()) for c in sorted(p.iterdir())]

    def _read(self, path, start, end):
        with open(self._inside(path), "rb") as f:
            f.seek(start)
            return f.read(max(0, end - start))

    def _begin(self, path):
        final = self._inside(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        handle = uuid.uuid4().hex
        tmp = final.with_name(f".{final.name}.part-{handle[:8]}")
        self._open[handle] = (os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), tmp, final)
        return handle

    def _write(self, handle, offset, data):
        # at its offset: a writer keeps several blocks in flight, and they may land in any order
        fd = self._open[handle][0]
        view = memoryview(data)
        while view:
            view = view[os.pwrite(fd, view, offset + len(data) - len(view)):]

    def _finish(self, handle, keep):
        fd, tmp, final = self._open.pop(handle)
        try:
            if keep:
                os.fsync(fd)
        finally:
            os.close(fd)
        if keep:
            os.replace(tmp, final)
        else:
            tmp.unlink(missing_ok=True)

    def _makedirs(self, path):
        self._inside(path).mkdir(parents=True, exist_ok=True)

    def _rm_file(self, path):
        self._inside(path).unlink()

    def _rmdir(self, path):
        p = self._inside(path)
        if p == self.root:
            raise PermissionError(errno.EACCES, "the served folder itself is not removed")
        shutil.rmtree(p)

    def _mv(self, src, dst):
        os.replace(self._inside(src), self._inside(dst))

    def _sha256(self, path):
        h = hashlib.sha256()
        with open(self._inside(path), "rb") as f:
            while block := f.read(1 << 22):
                h.update(block)
        return h.hexdigest()


def write_mark(root, name: str) -> None:
    """The mark by which a worker tells the driver's folder itself from one of the same name on
    another disk: the name of this start's server (whether or not it is started), written by the
    driver into the folder."""
    mark = pathlib.Path(root) / MARK
    mark.parent.mkdir(parents=True, exist_ok=True)
    tmp = mark.with_name(f".{mark.name}.tmp-{os.getpid()}")
    tmp.write_text(name)
    os.replace(tmp, mark)


def url(server: str, path: str) -> str:
    """The URL under which workers reach `path` (absolute, on the driver's node) through `server`."""
    return f"{PROTOCOL}://{server}{os.path.abspath(path)}"


class ServedFileSystem(AbstractFileSystem):
    """fsspec's view of a FileServer actor (found by its name in this Ray job's namespace)."""

    protocol = PROTOCOL
    cachable = False  # listings change under it: workers and the driver write between asks

    def __init__(self, server: str, **kwargs):
        super().__init__(**kwargs)
        import ray

        self.server = server
        self._actor = ray.get_actor(server)

    @classmethod
    def _strip_protocol(cls, path):
        path = str(path)
        if path.startswith(PROTOCOL + "://"):
            rest = path[len(PROTOCOL) + 3:]
            path = rest[rest.index("/"):] if "/" in rest else "/"
        return os.path.normpath(path) if path else path

    @staticmethod
    def _get_kwargs_from_urls(path):
        rest = str(path)[len(PROTOCOL) + 3:] if str(path).startswith(PROTOCOL + "://") else ""
        return {"server": rest.split("/", 1)[0]} if rest else {}

    def unstrip_protocol(self, name: str) -> str:
        return url(self.server, name)

    def _call(self, op: str, *args):
        return self._calls([(op, *args)])[0]

    def _calls(self, calls) -> list:
        """Several operations (an iterable, made as it is consumed), at most IN_FLIGHT of them at the
        server at once (blocks of one read or one write: the network stays busy while the server
        reads or writes the disk)."""
        import itertools

        import ray

        calls, out = iter(calls), []
        while window := list(itertools.islice(calls, IN_FLIGHT)):
            refs = [self._actor.call.remote(*c) for c in window]
            del window
            out += [self._answer(a) for a in ray.get(refs, timeout=CALL_TIMEOUT_S)]
        return out

    def _answer(self, answer: dict):
        if "error" in answer:
            kind = {"FileNotFoundError": FileNotFoundError, "FileExistsError": FileExistsError,
                    "PermissionError": PermissionError, "IsADirectoryError": IsADirectoryError,
                    "NotADirectoryError": NotADirectoryError}.get(answer["error"], OSError)
            raise kind(answer["errno"] or errno.EIO, f"{answer['text']} (on the driver's node, through {self.server})")
        return answer["ok"]

    # ---------------------------------------------------------------- queries
    def info(self, path, **kwargs):
        return self._call("info", self._strip_protocol(path))

    def ls(self, path, detail=True, **kwargs):
        entries = self._call("ls", self._strip_protocol(path))
        return entries if detail else [e["name"] for e in entries]

    def sha256(self, path) -> str:
        """The file's digest, computed where the file is (not read back over the network)."""
        return self._call("sha256", self._strip_protocol(path))

    # ---------------------------------------------------------------- changes
    def makedirs(self, path, exist_ok=False):
        self._call("makedirs", self._strip_protocol(path))

    def mkdir(self, path, create_parents=True, **kwargs):
        self.makedirs(path, exist_ok=True)

    def rm_file(self, path):
        self._call("rm_file", self._strip_protocol(path))

    def _rm(self, path):
        self.rm_file(path)

    def rm(self, path, recursive=False, maxdepth=None):
        for p in [path] if isinstance(path, str) else path:
            p = self._strip_protocol(p)
            if recursive and self.isdir(p):
                self._call("rmdir", p)
            else:
                self.rm_file(p)

    def rmdir(self, path):
        self._call("rmdir", self._strip_protocol(path))

    def mv(self, path1, path2, recursive=False, maxdepth=None, **kwargs):
        self._call("mv", self._strip_protocol(path1), self._strip_protocol(path2))

    def _open(self, path, mode="rb", block_size=None, autocommit=True, cache_options=None, **kwargs):
        return _ServedFile(self, self._strip_protocol(path), mode, block_size=block_size or BLOCK,
                           cache_type="readahead" if "r" in mode else "none", cache_options=cache_options)


class _ServedFile(AbstractBufferedFile):
    def _fetch_range(self, start, end):
        # a block a call, so the server holds a few blocks at most whatever the reader asks for
        return b"".join(self.fs._calls(("read", self.path, at, min(end, at + BLOCK))
                                       for at in range(start, end, BLOCK)))

    def _initiate_upload(self):
        self._handle = self.fs._call("begin", self.path)

    def _upload_chunk(self, final=False):
        if not getattr(self, "_handle", None):
            self._initiate_upload()
        data = self.buffer.getbuffer()
        self.fs._calls(("write", self._handle, self.offset + at, bytes(data[at:at + BLOCK]))
                       for at in range(0, len(data), BLOCK))
        del data  # a view of the buffer: fsspec replaces the buffer next
        if final:
            self.fs._call("finish", self._handle, True)
            self._handle = None
        return True

    def __exit__(self, exc_type, exc, tb):
        """A write that raised is dropped, not committed (fsspec would upload what was written)."""
        if exc_type is not None and self.writable():
            self.discard()
            self.closed = True
            return
        self.close()

    def discard(self):
        if getattr(self, "_handle", None):
            self.fs._call("finish", self._handle, False)
            self._handle = None
        super().discard()
