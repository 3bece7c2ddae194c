"""The model's weights written out of a checkpoint one tensor at a time: `final.pt` and
`gearshift export`.

Nothing here builds the model's state as one dict. A checkpoint's tensors are listed from its
metadata (DCP's `.metadata`, or a full-format `state.pt` opened memory-mapped), each output
file's layout is written first (the torch zip's records with their space reserved, or a
safetensors header), then each tensor is read from the checkpoint, converted, written at its
place and dropped. A process's peak is therefore about its largest tensor, whatever the model's
size; `bench/memory.py` measures it (driver_growth_over_full_params,
export_growth_over_full_params).

Every file is written under a temporary name, fsynced and renamed into place; an export's
index is written last, so a folder with an index is a complete export.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import pathlib
import pickle
import shutil
import struct
import sys
import warnings
from typing import Iterator

import torch

from gearshift.workers.state import checkpoint, storage

INDEX = "model.safetensors.index.json"
PIECE = 64 << 20  # bytes of a mapped full tensor converted and written at once
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}


class ExportError(RuntimeError):
    """The checkpoint cannot be exported as asked; one paragraph."""


class ModelTensors:
    """The model's tensors of one verified checkpoint, read one at a time: `names` lists them
    with (dtype, shape) in the checkpoint's order; `read(name)` returns one as a full CPU tensor."""

    def __init__(self, folder: pathlib.Path, verify: bool = True):
        self.folder = storage.location(folder)
        # verify: every file hashed first (a checkpoint from elsewhere); else its manifest only (one
        # this run committed a moment ago from the digests its writers took as they wrote)
        manifest = checkpoint.verify(self.folder, read=False)[0] if verify else checkpoint.manifest_of(self.folder, True)
        self.step = int(manifest["step"])
        self.format = manifest["format"]
        if self.format == checkpoint.DCP_FORMAT:
            import torch.distributed.checkpoint as dcp

            from gearshift.workers.state import dcp as shards

            self._dcp, self._reader = dcp, lambda: shards.reader(self.folder)
            self._metadata = self._reader().read_metadata()
            meta = self._metadata.state_dict_metadata
            self.names = {k[len("model."):]: (v.properties.dtype, list(v.size)) for k, v in meta.items()
                          if k.startswith("model.") and hasattr(v, "size")}
        else:  # whole tensors in state.pt: mapped, not read, so only the tensor being written is touched
            # (an object store cannot be mapped: there the file is read whole)
            state = (torch.load(io.BytesIO((self.folder / "state.pt").read_bytes()), map_location="cpu",
                                weights_only=True) if storage.is_remote(self.folder) else
                     torch.load(self.folder / "state.pt", map_location="cpu", weights_only=True, mmap=True))
            self._full = state["model"]
            self.names = {k: (v.dtype, list(v.shape)) for k, v in self._full.items()}

    def read(self, name: str) -> torch.Tensor:
        if self.format != checkpoint.DCP_FORMAT:
            return self._full[name]
        dtype, shape = self.names[name]
        out = torch.empty(shape, dtype=dtype)
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            self._dcp.load({"model." + name: out}, storage_reader=self._reader(), no_dist=True)
        return out

    def pieces(self, name: str) -> Iterator[torch.Tensor]:
        """The tensor as consecutive blocks of whole rows (dim 0), in order: their bytes, one after
        the other, are the tensor's. From a DCP checkpoint whose shards of it are blocks of rows
        (FSDP's and a column-parallel layer's), each shard is read alone, so a process holds one
        shard of the tensor, not the tensor; otherwise (shards cut across columns) the whole
        tensor is read, as one piece. From a mapped state.pt, blocks of about PIECE bytes."""
        if self.format != checkpoint.DCP_FORMAT:
            t = self._full[name]
            rows = max(1, PIECE // max(1, t[0].numel() * t.element_size())) if t.dim() else 1
            yield from (t[i:i + rows] for i in range(0, len(t), rows)) if t.dim() else (t,)
            return
        chunks = self._row_blocks(name)
        if chunks is None:
            yield self.read(name)
            return
        from torch.distributed.checkpoint.utils import _create_file_view

        for info in chunks:
            path = self.folder / checkpoint.DCP_DIR / info.relative_path
            with (path.open("rb") if storage.is_remote(path) else open(path, "rb")) as f:
                yield torch.load(_create_file_view(f, info.offset, info.length), map_location="cpu",
                                 weights_only=True)

    def _row_blocks(self, name: str) -> list | None:
        """Where each block of rows of `name` is stored, in row order; None when its shards are
        not whole-row blocks that tile it (or are stored transformed, e.g. compressed)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        md, fqn = self._metadata, "model." + name
        shape = list(md.state_dict_metadata[fqn].size)
        if not shape:
            return None
        chunks = sorted(md.state_dict_metadata[fqn].chunks, key=lambda c: c.offsets[0])
        at, out = 0, []
        for c in chunks:
            if c.offsets[0] != at or list(c.offsets[1:]) != [0] * (len(shape) - 1) or list(c.sizes[1:]) != shape[1:]:
                return None
            info = md.storage_data.get(MetadataIndex(fqn, c.offsets))
            if info is None or getattr(info, "transform_descriptors", None):
                return None
            out.append(info)
            at += c.sizes[0]
        return out if at == shape[0] else None


def _converted(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """The tensor in the export's dtype (floating tensors only; integer buffers stay as they are)."""
    t = t.detach()
    if dtype is not None and t.is_floating_point() and t.dtype != dtype:
        t = t.to(dtype)
    t = t.contiguous()
    if t.storage_offset() != 0 or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone()  # a view into a larger storage (tied tensors saved together): its own bytes only
    return t


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


@contextlib.contextmanager
def _atomic(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A temporary name beside `path`; renamed into place (and fsynced) only if the body succeeds."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        checkpoint._fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


class _Storage:
    """Stands for a tensor's storage in the pickle: written as torch.save writes one."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int):
        self.key, self.dtype, self.numel = key, dtype, numel


class _Tensor:
    """Pickles as torch.save pickles a contiguous CPU tensor, holding no data."""

    def __init__(self, storage: _Storage, shape: list[int]):
        self.storage, self.shape = storage, tuple(shape)

    def __reduce_ex__(self, protocol):
        stride, acc = [], 1
        for size in reversed(self.shape):
            stride.append(acc)
            acc *= size
        return (torch._utils._rebuild_tensor_v2,
                (self.storage, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict()))


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            kind = getattr(torch, torch.storage._dtype_to_storage_type_map()[obj.dtype])
            return ("storage", kind, obj.key, "cpu", obj.numel)
        return None


def placeholder(dtype: torch.dtype, shape, key: int) -> "_Tensor":
    """What stands for a tensor in a structure given to `write_streamed`: its dtype and shape, and
    `key`, the tensor's place in the order the file is filled (0, 1, 2, ...)."""
    shape = list(shape)
    return _Tensor(_Storage(str(key), dtype, _numel(shape)), shape)


def write_streamed(path: pathlib.Path, tree, tensors) -> int:
    """A `torch.save` file of `tree` (loadable with weights_only=True) whose tensors are given one at
    a time: `tree` holds a `placeholder` for each, and `tensors` yields, in the placeholders' key
    order, for each one an iterable of pieces (blocks of whole rows, in order) in its dtype. The
    pickle of the structure is written first, every tensor's record reserved (no checksum: its
    bytes come later), then each record is filled piece by piece as the pieces come; nothing
    holds more than a piece. Written under a temporary name, fsynced, renamed into place.
    Returns the bytes of tensor data written."""
    buf = io.BytesIO()
    holders: list[_Tensor] = []

    class Collect(_Pickler):
        def persistent_id(self, obj):
            return super().persistent_id(obj)

        def reducer_override(self, obj):
            if isinstance(obj, _Tensor):
                holders.append(obj)
            return NotImplemented

    Collect(buf, protocol=2).dump(tree)
    order = sorted(holders, key=lambda t: int(t.storage.key))
    path = pathlib.Path(path)
    total = 0
    with _atomic(path) as tmp:
        writer = torch._C.PyTorchFileWriter(str(tmp), False, 64)
        pickled = buf.getvalue()
        writer.write_record("data.pkl", pickled, len(pickled))
        for name, value in ((".format_version", "1"), (".storage_alignment", "64"), ("byteorder", sys.byteorder)):
            writer.write_record(name, value, len(value))
        for t in order:
            st = t.storage
            writer.write_record_metadata(f"data/{st.key}", st.numel * torch.empty(0, dtype=st.dtype).element_size())
        writer.write_end_of_file()
        del writer
        reader = torch._C.PyTorchFileReader(str(tmp))
        offsets = [reader.get_record_offset(f"data/{t.storage.key}") for t in order]
        del reader
        with open(tmp, "r+b") as f:
            for t_layout, offset, pieces in zip(order, offsets, tensors, strict=True):
                f.seek(offset)
                written = 0
                for piece in pieces:
                    t = _converted(piece, None)
                    if t.dtype != t_layout.storage.dtype:
                        raise ExportError(f"tensor {t_layout.storage.key}: came as {t.dtype}, laid out as "
                                          f"{t_layout.storage.dtype}")
                    f.write(_bytes(t))
                    written += t.numel() * t.element_size()
                    del t, piece
                if written != t_layout.storage.numel * torch.empty(0, dtype=t_layout.storage.dtype).element_size():
                    raise ExportError(f"tensor {t_layout.storage.key}: {written} bytes came, its record holds "
                                      f"{t_layout.storage.numel} elements of {t_layout.storage.dtype}")
                total += written
    return total


def write_torch(source: ModelTensors, path: pathlib.Path, names: dict[str, str] | None = None,
                dtype: torch.dtype | None = None) -> int:
    """A `torch.save` file of {name: tensor} (loadable with weights_only=True), written one tensor at
    a time out of a checkpoint (`write_streamed`). `names`: {output name: checkpoint name}
    (default: all, unchanged). Returns the bytes of tensor data written."""
    names = names or {n: n for n in source.names}
    tree = {out: placeholder(_out_dtype(source.names[src][0], dtype), source.names[src][1], k)
            for k, (out, src) in enumerate(names.items())}
    return write_streamed(path, tree, ((_converted(p, dtype) for p in source.pieces(src)) for src in names.values()))


def _out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and saved.is_floating_point else saved


def _pieces_of(source: ModelTensors, src, held: dict):
    """A checkpoint tensor's pieces, or (name, index): that part of it (a fused tensor split as a
    transformers checkpoint stores it), read once for all its parts."""
    if isinstance(src, str):
        yield from source.pieces(src)
        return
    name, index = src
    if name not in held:
        held.clear()
        held[name] = source.read(name)
    yield held[name][index].contiguous()


def _view_shape(shape: list, index: tuple) -> list:
    return list(torch.empty(shape, device="meta")[index].shape)


def parse_size(text: str) -> int:
    """'5GB', '64MB', '500KB', '1024' (bytes) -> bytes; decimal units as Hugging Face uses them."""
    units = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10, "B": 1}
    raw = str(text).strip().upper()
    for unit, scale in units.items():
        if raw.endswith(unit) and raw[: -len(unit)].strip():
            number = raw[: -len(unit)].strip()
            break
    else:
        number, scale = raw, 1
    try:
        value = float(number)
    except ValueError:
        raise ExportError(f"--max-shard-size {text!r} is not a size: give bytes or a number with KB, MB, GB "
                          "(or KiB, MiB, GiB), e.g. 5GB") from None
    if value <= 0:
        raise ExportError(f"--max-shard-size {text!r} must be more than 0")
    return int(value * scale)


def shard_plan(sizes: dict[str, int], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards in order, each at most `max_bytes` (a tensor larger than that
    gets a shard of its own), as Hugging Face's save_pretrained splits them."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes.items():
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return [s for s in shards if s]


def write_safetensors(source: ModelTensors, out_dir: pathlib.Path, names: dict[str, str] | None = None,
                      dtype: torch.dtype | None = None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """Hugging Face-style shards `model-0000K-of-0000N.safetensors` plus `model.safetensors.index.json`
    (written last) in `out_dir`, each shard's header first and then its tensors one at a time.
    Returns the index."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = names or {n: n for n in source.names}
    meta = {out: (_out_dtype(source.names[src][0], dtype), source.names[src][1]) if isinstance(src, str) else
            (_out_dtype(source.names[src[0]][0], dtype), _view_shape(source.names[src[0]][1], src[1]))
            for out, src in names.items()}
    for d, _ in meta.values():
        if d not in _ST_DTYPES:
            raise ExportError(f"a tensor of dtype {d} cannot be written as safetensors; use --format torch")
    sizes = {out: _numel(shape) * torch.empty(0, dtype=d).element_size() for out, (d, shape) in meta.items()}
    shards = shard_plan(sizes, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        header, offset = {}, 0
        for out in shard:
            header[out] = {"dtype": _ST_DTYPES[meta[out][0]], "shape": meta[out][1],
                           "data_offsets": [offset, offset + sizes[out]]}
            offset += sizes[out]
        header["__metadata__"] = {"format": "pt"}
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
        with _atomic(out_dir / file) as tmp, open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            held: dict = {}  # the fused tensor whose pieces are being written (one at a time)
            for out in shard:
                for piece in _pieces_of(source, names[out], held):
                    f.write(_bytes(_converted(piece, dtype)))
                    del piece
        weight_map.update({out: file for out in shard})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    checkpoint.write_file_atomic(out_dir / INDEX, json.dumps(index, indent=2).encode())
    return index


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def output_names(source: ModelTensors, prefix: str = "", aliases: list[list[str]] | None = None) -> dict[str, str]:
    """{output name: checkpoint name}: `prefix` taken off the front (names without it are left
    out: they are the wrapper's, not the exported model's), and of each group of names the
    model shares one tensor under (a tied head), only the first."""
    skip = {n for group in (aliases or []) for n in group[1:]}
    out = {}
    for name in source.names:
        if name in skip or not name.startswith(prefix):
            continue
        out[name[len(prefix):]] = name
    return out


def copy_config(pretrained_folder: pathlib.Path | None, out_dir: pathlib.Path) -> list[str]:
    """config.json (and generation_config.json) from the folder the run's weights came from."""
    copied = []
    for name in ("config.json", "generation_config.json"):
        if pretrained_folder is not None and (pretrained_folder / name).is_file():
            shutil.copyfile(pretrained_folder / name, out_dir / name)
            copied.append(name)
    return copied
