"""A transformers model's weight files read as `from_pretrained` reads them: the model's own
conversion mapping (transformers' `conversion_mapping`: renamed modules, per-expert weights fused
into one tensor, transposes, prefix changes) applied to the files' names, so that
`model.pretrained` takes the checkpoints people have, which name their tensors as the model's
earlier versions did (`vit.encoder.layer.0.attention.attention.query` for today's
`vit.layers.0.attention.q_proj`).

A renamed tensor is read as any other, by slices (workers/build/pretrained.py). A fused one (Mixtral's
`experts.*.w1` and `w3` stacked and concatenated into `experts.gate_up_proj`) is read by slices
too where its conversion is a stack of a module list along dim 0, then, optionally, a
concatenation: each rank reads, of each expert's tensor, only the rows and columns its piece of
the fused tensor covers. Any other conversion is run by transformers' own operations on the whole
source tensors, on the ranks that need the tensor, and the `pretrained` record names it with its
size (`read_whole`).
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Fused:
    """A model tensor made from several of the files' tensors by a transformers conversion."""
    target: str                  # the model's name, less the job's prefix
    converter: object            # transformers' WeightConverter
    sources: dict = field(default_factory=dict)  # source pattern -> [file names], in the order transformers stacks them
    shape: list | None = None
    dtype: str | None = None

    @property
    def by_slices(self) -> bool:
        from transformers.core_model_loading import Concatenate, MergeModulelist

        ops = list(self.converter.operations)
        return (len(self.converter.target_patterns) == 1 and bool(ops) and type(ops[0]) is MergeModulelist
                and ops[0].dim == 0 and all(type(op) is Concatenate for op in ops[1:]) and len(ops) <= 2)

    def files(self) -> list[str]:
        return [k for keys in self.sources.values() for k in keys]


def transformers_model(model: nn.Module, prefix: str):
    """The transformers model the job's names start at (the model itself, or the submodule the
    prefix names), or None: a model of the user's own, read by its own names."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return None
    name = prefix.rstrip(".")
    try:
        inner = model.get_submodule(name) if name else model
    except AttributeError:
        return None
    return inner if isinstance(inner, PreTrainedModel) else None


def mapped(model: nn.Module, saved: dict[str, tuple[str, list[int]]], prefix: str = "") -> dict[str, object]:
    """{name as the model says it, less the prefix: the file's name (str) or a Fused} for every
    tensor the files hold, through the model's conversion mapping where it has one."""
    hf = transformers_model(model, prefix)
    if hf is None:
        return {k: k for k in saved}
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    own = {k: True for k in hf.state_dict(keep_vars=True)}
    out: dict[str, object] = {}
    for key in sorted(saved, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix, own)
        if pattern is None:
            out[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        fused = out.setdefault(target, Fused(target, converter))
        fused.sources.setdefault(pattern, []).append(key)
    for fused in (v for v in out.values() if isinstance(v, Fused)):
        fused.sources = {p: fused.sources[p] for p in fused.converter.source_patterns if p in fused.sources}
        meta = _run(fused, {k: torch.empty(saved[k][1], device="meta") for k in fused.files()}, hf)
        fused.shape, fused.dtype = list(meta.shape), saved[fused.files()[0]][0]
    return out


def _run(fused: Fused, tensors: dict[str, torch.Tensor], hf) -> torch.Tensor:
    """The fused tensor from its sources (whole, or on the meta device for its shape), by
    transformers' own operations."""
    collected = {p: [tensors[k] for k in keys] for p, keys in fused.sources.items()}
    converter = fused.converter
    for op in converter.operations:
        collected = op.convert(collected, source_patterns=converter.source_patterns,
                               target_patterns=converter.target_patterns, full_layer_name=fused.target,
                               model=hf, config=hf.config)
    if len(collected) != 1:
        raise ValueError(f"{fused.target}: a conversion into {len(collected)} tensors")
    return next(iter(collected.values()))


def read(fused: Fused, folder: pathlib.Path, where: dict[str, str], region: list[tuple[int, int]],
         dtype: torch.dtype, hf) -> tuple[torch.Tensor, int]:
    """The part `region` ([(start, length)] per dim) of the fused tensor, and the bytes read:
    by slices of the sources where the conversion is a stack and a concatenation, else whole."""
    from safetensors import safe_open

    handles: dict[str, object] = {}

    def source(key):
        file = where[key]
        if file not in handles:
            handles[file] = safe_open(str(folder / file), "pt")
        return handles[file].get_slice(key)

    if not fused.by_slices:
        tensors = {k: source(k)[:] for k in fused.files()}
        value = _run(fused, tensors, hf)
        index = tuple(slice(s, s + n) for s, n in region)
        return value[index].to(dtype), sum(t.numel() * t.element_size() for t in tensors.values())
    ops = fused.converter.operations
    cat = ops[1].dim if len(ops) > 1 else None
    out = torch.empty([n for _, n in region], dtype=dtype)
    done, base = 0, 0
    for keys in fused.sources.values():
        shape = [len(keys), *source(keys[0]).get_shape()]  # this pattern's experts, stacked
        src = [(s, s + n) for s, n in region]  # in the stacked tensor
        dst = [(0, n) for _, n in region]  # in `out`
        if cat is not None:  # the part of the region this pattern covers along the concatenation
            span, (r0, n) = shape[cat], region[cat]
            a, b = max(r0, base), min(r0 + n, base + span)
            src[cat], dst[cat] = (a - base, b - base), (a - r0, b - r0)
            base += span
            if a >= b:
                continue
        for i, e in enumerate(range(*src[0])):
            piece = source(keys[e])[tuple(slice(*src[d]) for d in range(1, len(shape)))]
            done += piece.numel() * piece.element_size()
            out[(dst[0][0] + i, *(slice(*dst[d]) for d in range(1, len(shape))))] = piece.to(dtype)
    return out, done


_REGEX = re.compile(r"[\\^$\[\](){}|+?]")


def saved_names(model: nn.Module, prefix: str, names: dict[str, str], shapes: dict[str, list]) -> tuple[dict, list]:
    """The export's {output name: checkpoint name} renamed as `save_pretrained` of the same
    transformers model names its files (its conversion mapping reversed): {name on disk:
    checkpoint name, or (checkpoint name, index) for a piece of a fused tensor (an expert's `w1`
    out of `gate_up_proj`)}; and the model's names kept as they are (a conversion that cannot be
    reversed tensor by tensor). `shapes`: the checkpoint's {name: shape}."""
    hf = transformers_model(model, prefix)
    if hf is None:
        return dict(names), []
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, apply_renamings

    transforms = [t for t in get_model_conversion_mapping(hf, add_legacy=False) if not isinstance(t, PrefixChange)]
    back = [t.reverse_transform() for t in reversed(transforms) if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    out, kept = {}, []
    for name, src in names.items():
        converter = next((c for c in converters if len(c.target_patterns) == 1 and c.target_patterns[0] in name), None)
        if converter is None:
            out[apply_renamings(name, back)] = src
            continue
        fused = Fused(name, converter, {p: [] for p in converter.source_patterns})
        if not fused.by_slices or any(_REGEX.search(p) for p in [*converter.source_patterns, *converter.target_patterns]):
            out[name], kept = src, kept + [name]
            continue
        out.update({apply_renamings(n, back): (src, index) for n, index in _pieces(fused, name, shapes[src])})
    return out, kept


def _pieces(fused: Fused, name: str, shape: list) -> list[tuple[str, tuple]]:
    """(source name, index into the fused tensor) for every tensor it was made of: expert e of
    source pattern i is chunk i along the concatenation of row e."""
    ops, patterns = fused.converter.operations, list(fused.converter.source_patterns)
    cat = ops[1].dim if len(ops) > 1 else None
    target = fused.converter.target_patterns[0]
    out = []
    for i, pattern in enumerate(patterns):
        for e in range(shape[0]):
            index = [e] + [slice(None)] * (len(shape) - 1)
            if cat is not None:
                size = shape[cat] // len(patterns)
                index[cat] = slice(i * size, (i + 1) * size)
            out.append((name.replace(target, pattern.replace("*", str(e)), 1), tuple(index)))
    return out



def write_config(hf, out_dir: pathlib.Path) -> list[str]:
    """config.json (and generation_config.json, for a model that generates) of the model itself,
    for an export of a transformers model that did not start from a folder holding them."""
    hf.config.save_pretrained(out_dir)
    written = ["config.json"]
    if getattr(hf, "generation_config", None) is not None and hf.can_generate():
        hf.generation_config.save_pretrained(out_dir)
        written.append("generation_config.json")
    return written
