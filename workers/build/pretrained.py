"""Pretrained weights (`model.pretrained`), read by slices: each rank reads only its pieces.

The weights are a folder of Hugging Face safetensors: one `model.safetensors`, or shards named
by `model.safetensors.index.json` (what `save_pretrained` and `gearshift export` write). The
driver checks the folder against the model built on the meta device before anything starts
(`check`: names, shapes; one paragraph naming the first few that differ); every rank then loads
with torch.distributed.checkpoint's HuggingFaceStorageReader into the model as laid out, so an
fsdp rank reads its rows of each tensor, a tensor-parallel rank its columns or rows, and a
data-parallel rank the whole (it holds the whole). A file's dtype may differ from the model's:
values are converted as they are copied in.

`prefix` is what the model's names carry in front of the file's (a wrapper holding a Hugging Face
model as `lm` has `lm.model.layers.0...` where the file has `model.layers.0...`: prefix `lm.`).
A tensor the model shares under two names (a head tied to the embedding) needs only one of them
in the file, as `save_pretrained` writes it.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import struct
import warnings

import torch
from torch import nn

SUFFIX = ".safetensors"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
INDEX = "model.safetensors.index.json"
_SHOWN = 4  # names shown in an error, per kind


class PretrainedError(RuntimeError):
    """The folder cannot give this model its weights; the message is one paragraph."""


def weight_files(folder: str | pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of `folder`: those its index names, else every *.safetensors."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise PretrainedError(f"{folder} is not a folder (give the folder that holds the .safetensors files, "
                              f"or its {INDEX})")
    index = folder / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise PretrainedError(f"{index}: not a safetensors index ({type(err).__name__}: {err}); it must hold "
                                  '{"weight_map": {tensor name: file name}}') from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise PretrainedError(f"{index} names {', '.join(missing[:_SHOWN])}, which {folder} does not hold")
        return [folder / n for n in names]
    found = sorted(folder.glob("*" + SUFFIX))
    if not found:
        raise PretrainedError(f"{folder} holds no {SUFFIX} files (a Hugging Face model saved with save_pretrained, "
                              "or a gearshift export, has model.safetensors or shards with "
                              f"{INDEX})")
    return found


def read_header(file: pathlib.Path) -> dict[str, tuple[str, list[int]]]:
    """{tensor name: (dtype, shape)} from a safetensors file's header (8 bytes of length, then
    JSON), without reading any tensor."""
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        return {name: (meta["dtype"], list(meta["shape"])) for name, meta in header.items() if name != "__metadata__"}
    except (OSError, ValueError, struct.error, KeyError, TypeError) as err:
        raise PretrainedError(f"{file}: not a safetensors file ({type(err).__name__}: {err})") from None


def folder(spec: dict, search_paths) -> pathlib.Path:
    """model.pretrained's folder, relative to the job file's (a Hugging Face cache folder: its snapshot)."""
    return snapshot(pathlib.Path(search_paths[0]).joinpath(pathlib.Path(spec["path"]).expanduser()))


def snapshot(path: pathlib.Path) -> pathlib.Path:
    """The folder that holds the weight files: `path` itself, or, for a model in a Hugging Face
    cache as huggingface_hub lays it out (`models--org--name/` with `refs/`, `snapshots/<rev>/`
    whose files link into `blobs/`), the snapshot `refs/main` names, or its only one. Nothing is
    downloaded: a cache without the snapshot is a PretrainedError."""
    path = pathlib.Path(path)
    snapshots = path / "snapshots"
    if not snapshots.is_dir() or any(path.glob("*" + SUFFIX)) or (path / INDEX).is_file():
        return path
    revs = sorted(p.name for p in snapshots.iterdir() if p.is_dir())
    ref = path / "refs" / "main"
    wanted = ref.read_text().strip() if ref.is_file() else (revs[0] if len(revs) == 1 else None)
    if wanted is None or wanted not in revs:
        raise PretrainedError(f"{path} is a Hugging Face cache folder, but "
                              + (f"refs/main names {wanted}, which snapshots/ does not hold" if wanted else
                                 f"it has {len(revs)} snapshots ({', '.join(revs[:_SHOWN]) or 'none'}) and no refs/main")
                              + "; give the snapshot folder itself (models--.../snapshots/REVISION); nothing is downloaded")
    return snapshots / wanted


def covered(model: nn.Module, spec: dict | None, search_paths) -> set[str]:
    """The names of `model`'s parameters and buffers ("buffer:NAME", as the first build names
    them) whose values model.pretrained's weights give (none without it): the tensors a load
    overwrites, so that the build need not make them. A tensor shared under several names counts
    once, under the name the model lists first, when the file holds any of them."""
    if not spec:
        return set()
    from gearshift.workers.build.hf_conversion import mapped

    prefix = spec.get("prefix", "")
    saved = mapped(model, saved_tensors(folder(spec, search_paths)), prefix)  # as the model names them
    named = [*((n, t) for n, t in model.named_parameters(remove_duplicate=False)),
             *((n, t) for n, t in model.named_buffers(remove_duplicate=False))]
    given = {id(t) for n, t in named if n.startswith(prefix) and n[len(prefix):] in saved}
    return ({n for n, p in model.named_parameters() if id(p) in given}
            | {f"buffer:{n}" for n, b in model.named_buffers() if id(b) in given})


def saved_tensors(folder: str | pathlib.Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor the folder holds: {name: (dtype, shape)}."""
    out: dict[str, tuple[str, list[int]]] = {}
    for file in weight_files(folder):
        out.update(read_header(file))
    return out


def locations(folder: str | pathlib.Path) -> dict[str, str]:
    """{tensor name: the name of the file that holds it}."""
    return {name: file.name for file in weight_files(folder) for name in read_header(file)}


def _aliases(model: nn.Module) -> list[list[str]]:
    """The model's state-dict names grouped by the tensor they hold (a tied head and its
    embedding are one group), in state-dict order."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def plan(model: nn.Module, saved: dict[str, tuple[str, list[int]]], prefix: str = "",
         part: bool = False) -> dict[str, str]:
    """{model name: the file's name for it, or a hf_conversion.Fused} for every tensor of the
    model, each read from the files (through a transformers model's own conversion mapping); a
    PretrainedError naming what is missing, unexpected or of another shape otherwise. Works on a
    model on the meta device (the driver's check) as on a real one. `part`: `model` is one
    pipeline stage's part of the whole (the driver checked the files against the whole), so the
    file's tensors that other stages hold are expected, not an error."""
    from gearshift.workers.build.hf_conversion import mapped

    sources = mapped(model, saved, prefix)
    saved = {k: (src.dtype, src.shape) if not isinstance(src, str) else saved[src] for k, src in sources.items()}
    shapes = {name: list(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    if prefix and not any(name.startswith(prefix) for name in shapes):
        raise PretrainedError(f"prefix {prefix!r} begins none of the model's names (they begin "
                              f"{_list(sorted({n.split('.')[0] + '.' for n in shapes}))}); it is what the model's names "
                              "carry in front of the file's, such as 'lm.' for a wrapper holding the model as lm")
    chosen, missing, misshaped, used = {}, [], [], set()
    for group in _aliases(model):
        in_file = [n for n in group if n.startswith(prefix) and n[len(prefix):] in saved]
        if not in_file:
            missing.append(group[0])
            continue
        name = in_file[0]
        key = name[len(prefix):]
        used.update(n[len(prefix):] for n in in_file)
        if saved[key][1] != shapes[name]:
            misshaped.append(f"{name} is {shapes[name]} in the model, {saved[key][1]} in the file")
            continue
        chosen[name] = sources[key]
    unexpected = [] if part else sorted(sources[k] if isinstance(sources[k], str) else k for k in set(saved) - used)
    if missing or unexpected or misshaped:
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the model's tensors are not in it ({_list(missing)}"
                         + (f"; looked up without the prefix {prefix!r}" if prefix else "") + ")")
        if unexpected:
            parts.append(f"{len(unexpected)} of its tensors are not the model's ({_list(unexpected)})")
        if misshaped:
            parts.append(f"{len(misshaped)} differ in shape ({'; '.join(misshaped[:_SHOWN])})")
        guess = _guess_prefix(list(shapes), unexpected) if missing and unexpected else None
        hint = f"; the model's names carry {guess!r} in front of the file's: give prefix: {guess!r}" if guess else ""
        raise PretrainedError("the weights do not fit the model: " + "; ".join(parts) + hint)
    return chosen


def _guess_prefix(model_names: list[str], file_names: list[str]) -> str | None:
    """The prefix most of the file's names would match the model's with, if there is one."""
    counts: dict[str, int] = {}
    for key in file_names:
        for name in model_names:
            if name.endswith("." + key):
                counts[name[: -len(key)]] = counts.get(name[: -len(key)], 0) + 1
    best = max(counts, key=counts.get, default=None)
    return best if best is not None and counts[best] * 2 >= len(file_names) else None


def _list(names: list[str]) -> str:
    return ", ".join(names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")


def check(model: nn.Module, folder: str | pathlib.Path, prefix: str = "") -> dict[str, str]:
    """The driver's check before anything starts: the folder's files and headers against the model."""
    return plan(model, saved_tensors(folder), prefix)


def load(model: nn.Module, folder: str | pathlib.Path, prefix: str = "", part: bool = False) -> dict:
    """Read the weights into the model as laid out now, each rank only the pieces it holds (all
    ranks call it together when the model is sharded; `part`: a pipeline stage's, see `plan`).
    Returns {"tensors", "bytes"}: how many tensors were loaded and the bytes of the pieces this
    rank holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    folder = pathlib.Path(folder)
    weight_files(folder)  # a folder that changed since the driver's check fails here, by name
    saved = saved_tensors(folder)
    names = plan(model, saved, prefix, part)
    state = get_model_state_dict(model)
    direct = {name: key for name, key in names.items() if isinstance(key, str)}
    cast: dict[str, int] = {}  # "BF16 -> torch.float32": tensors converted as they are read
    for name, src in names.items():
        stored = saved[src][0] if isinstance(src, str) else src.dtype
        if _DTYPES.get(stored) != state[name].dtype:
            key = f"{stored} -> {str(state[name].dtype).replace('torch.', '')}"
            cast[key] = cast.get(key, 0) + 1
    wanted = {key: state[name] for name, key in direct.items()}
    if wanted:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process" without a group
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(wanted, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    got = {"bytes": sum(_local(t).numel() * t.element_size() for t in wanted.values()), "read_whole": []}
    fused = {name: src for name, src in names.items() if not isinstance(src, str)}
    if fused:
        _load_fused(model, state, fused, folder, prefix, got)
    set_model_state_dict(model, {**{name: wanted[key] for name, key in direct.items()},
                                 **{name: state[name] for name in fused}}, options=StateDictOptions(strict=False))
    return {"tensors": len(names), **got, "cast": cast}


def _load_fused(model: nn.Module, state: dict, fused: dict, folder: pathlib.Path, prefix: str, got: dict) -> None:
    """Fill the model's fused tensors (state's, as laid out) from their sources in the files: this
    rank's rows and columns of each, by slices where the conversion allows, else whole."""
    from gearshift.strategies.state import shard_like
    from gearshift.workers.build import hf_conversion

    where, hf = locations(folder), hf_conversion.transformers_model(model, prefix)
    for name, source in fused.items():
        target = state[name]
        region, cut = _region(target)
        value, read = hf_conversion.read(source, folder, where, region, target.dtype, hf)
        got["bytes"] += read
        if not source.by_slices:
            got["read_whole"].append({"tensor": name, "bytes": read})
        with torch.no_grad():
            _local(target).copy_(_local(shard_like(value, target)) if cut else value)


def _region(target: torch.Tensor) -> tuple[list[tuple[int, int]], bool]:
    """[(start, length)] per dim of the part of `target`'s full value this rank holds, and
    whether the layout still has to cut it (a strided shard: the whole value is read)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    whole = [(0, n) for n in target.shape]
    if not isinstance(target, DTensor):
        return whole, False
    if any(type(p) not in (Shard, Replicate) for p in target.placements):
        return whole, True
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return list(zip(offset, shape)), False


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def identity(folder: str | pathlib.Path) -> dict[str, dict]:
    """What tells the weight files apart, for the run's source.json, per file: its size and the
    sha256 of its safetensors header (names, dtypes, shapes, offsets: a few kilobytes read),
    and of the index when there is one. The sha256 of every byte (`model.pretrained.hash: full`)
    is taken by the workers, by slices (`hash_share`), never here."""
    folder = pathlib.Path(folder)
    out = {}
    for file in weight_files(folder):
        with open(file, "rb") as f:
            head = f.read(8)
            (length,) = struct.unpack("<Q", head) if len(head) == 8 else (0,)
            out[file.name] = {"bytes": file.stat().st_size,
                              "header_sha256": hashlib.sha256(head + f.read(min(length, 100 << 20))).hexdigest()}
    if (folder / INDEX).is_file():
        out[INDEX] = {"bytes": (folder / INDEX).stat().st_size,
                      "sha256": hashlib.sha256((folder / INDEX).read_bytes()).hexdigest()}
    return out


SLICE_BYTES = 256 << 20  # a weight file is hashed in slices of this many bytes, spread over the workers


def slices(folder: str | pathlib.Path) -> list[tuple[str, int, int]]:
    """(file name, start, length) of every slice of the weight files, in order: the same list on
    every worker, so that slice i is hashed by rank i % world."""
    return [(file.name, start, min(SLICE_BYTES, size - start))
            for file in weight_files(folder) for size in [file.stat().st_size]
            for start in range(0, max(size, 1), SLICE_BYTES)]


def hash_share(folder: str | pathlib.Path, rank: int, world: int) -> dict[int, str]:
    """The sha256 of each slice this rank hashes (slice i for i % world == rank), by index."""
    folder, out = pathlib.Path(folder), {}
    for i, (name, start, length) in enumerate(slices(folder)):
        if i % world != rank:
            continue
        h = hashlib.sha256()
        with open(folder / name, "rb") as f:
            f.seek(start)
            left = length
            while left > 0 and (block := f.read(min(left, 1 << 22))):
                h.update(block)
                left -= len(block)
        out[i] = h.hexdigest()
    return out


def by_file(folder: str | pathlib.Path, digests: dict[int, str]) -> dict[str, list[str]]:
    """Every slice's sha256 (gathered from all ranks' `hash_share`) grouped by file, in order."""
    out: dict[str, list[str]] = {}
    for i, (name, _, _) in enumerate(slices(folder)):
        out.setdefault(name, []).append(digests[i])
    return out
