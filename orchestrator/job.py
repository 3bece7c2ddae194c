"""The job file: YAML in, frozen dataclasses out, or a JobError that names the field.

`load_job(path, overrides)` is the only way a job enters gearshift. It reads the YAML, applies
`--set a.b=value` overrides, checks every key and value, and returns a `Job`. Nothing else in
gearshift re-validates a Job, so everything that can be wrong with a file is caught here,
before Ray or any worker starts.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

import yaml


class JobError(ValueError):
    """A problem with the job file or an override, reported as one paragraph."""

    def __init__(self, field_path: str, value: Any, allowed: str, hint: str = "", source: str = ""):
        self.field_path = field_path
        self.value = value
        self.allowed = allowed
        self.hint = hint
        self.source = source
        super().__init__(self.message())

    def message(self) -> str:
        where = f"{self.source}: " if self.source else ""
        shown = _show(self.value)
        # a key made of odd characters (a newline, a tab) is shown escaped: the message stays one line
        field_path = self.field_path if self.field_path.isprintable() else \
            self.field_path.encode("unicode_escape").decode("ascii")
        text = f"{where}{field_path} = {shown} is not valid: {self.allowed}."
        if self.hint:
            text += f" {self.hint}"
        return text


_MISSING = object()


def _show(value: Any) -> str:
    if value is _MISSING:
        return "(missing)"
    text = json.dumps(value, default=str) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ----------------------------------------------------------------------------- the schema
# Each field carries its checker in metadata["check"]: (value, path) -> normalised value,
# raising JobError. Defaults are plain values so a job file can be as short as `model: mlp`.
# Each checker also carries `check.schema`, the JSON-Schema fragment of what it accepts, so that
# `gearshift schema` (orchestrator/job_schema.py) is made from these same definitions and cannot
# drift from them. The checkers stay the authority: the schema is what an editor can check as you
# type, not the cross-field rules of check_job.


def _schema(fragment):
    """Attach `fragment` (a dict, or a function returning one for facts known only when the
    schema is made, like the built-in registries) to the checker it decorates."""

    def attach(check):
        check.schema = fragment
        return check

    return attach


def _number(kind: str, lo=None, hi=None, lo_open: bool = False) -> dict:
    out = {"type": kind}
    if lo is not None:
        out["exclusiveMinimum" if lo_open else "minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _nullable(fragment: dict) -> dict:
    if "type" in fragment and not ({"enum", "const", "anyOf"} & set(fragment)):
        types = fragment["type"] if isinstance(fragment["type"], list) else [fragment["type"]]
        return {**fragment, "type": types + ["null"]}
    return {"anyOf": [fragment, {"type": "null"}]}


# module.path:function, ASCII identifiers (the checker also takes other Unicode identifiers)
_ENTRYPOINT_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


def _int(lo: int | None = None, hi: int | None = None):
    @_schema(_number("integer", lo, hi))
    def check(v, path):
        if isinstance(v, bool) or not isinstance(v, int):
            raise JobError(path, v, f"must be an integer{_range_text(lo, hi)}")
        _in_range(v, path, lo, hi, "an integer")
        return v

    return check


def _float(lo: float | None = None, hi: float | None = None, lo_open: bool = False):
    # the schema says number only: editors read YAML 1.2, where 1e-3 is a number already
    @_schema(_number("number", lo, hi, lo_open))
    def check(v, path):
        # YAML 1.1 reads `1e-3` as a string; accept it as the number users meant.
        if isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                raise JobError(path, v, f"must be a number{_range_text(lo, None, lo_open)}") from None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise JobError(path, v, f"must be a finite number{_range_text(lo, hi, lo_open)}")
        _in_range(float(v), path, lo, hi, "a number", lo_open)
        return float(v)

    return check


def _range_text(lo, hi, lo_open: bool = False) -> str:
    if lo is not None and hi is not None:
        return f" between {lo} and {hi}"
    if lo is not None:
        return f" {'>' if lo_open else '>='} {lo}"
    if hi is not None:
        return f" <= {hi}"
    return ""


def _in_range(v, path, lo, hi, noun, lo_open=False):
    if (lo is not None and (v < lo or (lo_open and v == lo))) or (hi is not None and v > hi):
        raise JobError(path, v, f"must be {noun}{_range_text(lo, hi, lo_open)}")


def _choice(*allowed: str):
    @_schema({"type": "string", "enum": list(allowed)})
    def check(v, path):
        if v not in allowed:
            close = difflib.get_close_matches(str(v), allowed, n=1)
            hint = f"Did you mean {close[0]!r}?" if close else ""
            raise JobError(path, v, "must be one of " + ", ".join(map(repr, allowed)), hint)
        return v

    return check


@_schema({"type": "boolean"})
def _bool(v, path):
    if not isinstance(v, bool):
        raise JobError(path, v, "must be true or false")
    return v


@_schema({"type": ["string", "null"], "pattern": r"\S"})
def _str_or_none(v, path):
    if v is not None and (not isinstance(v, str) or not v.strip()):
        raise JobError(path, v, "must be a non-empty string")
    return v


@_schema({"type": ["string", "null"], "pattern": _ENTRYPOINT_PATTERN})
def _entrypoint(v, path):
    if v is None:
        return v
    if not isinstance(v, str) or v.count(":") != 1 or not all(p.strip() for p in v.split(":")):
        raise JobError(path, v, 'must be "module:function", for example "my_models:build"')
    module, func = v.split(":")
    if not all(part.isidentifier() for part in module.split(".")) or not func.isidentifier():
        raise JobError(path, v, 'must be "module:function" with Python identifiers on both sides')
    return v


@_schema({"type": ["object", "null"]})
def _mapping(v, path):
    if v is None:
        return {}
    if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
        raise JobError(path, v, "must be a mapping of names to values")
    return dict(v)


@_schema({"type": "array", "items": _number("number", 0.0, 0.999999), "minItems": 2, "maxItems": 2})
def _betas(v, path):
    if not isinstance(v, (list, tuple)) or len(v) != 2:
        raise JobError(path, v, "must be a list of two numbers in [0, 1), for example [0.9, 0.999]")
    return tuple(_float(0.0, 0.999999)(b, f"{path}[{i}]") for i, b in enumerate(v))


_PRECISIONS = ("fp32", "bf16", "fp16")


@_schema({"anyOf": [{"type": "string", "enum": list(_PRECISIONS)}, {
    "type": "object", "additionalProperties": False, "required": ["dtype"],
    "properties": {"dtype": {"type": "string", "enum": ["bf16", "fp16"]},
                   "fp32_warmup_steps": _number("integer", 0),
                   "keep_fp32": {"type": "array", "items": {"type": "string", "minLength": 1}}}}]})
def _precision(v, path):
    """fp32 | bf16 | fp16, or phases: {dtype, fp32_warmup_steps, keep_fp32: [module patterns]}."""
    if not isinstance(v, dict):
        return _choice(*_PRECISIONS)(v, path)
    unknown = set(v) - {"dtype", "fp32_warmup_steps", "keep_fp32"}
    if unknown or "dtype" not in v:
        raise JobError(path, v, "must be fp32, bf16 or fp16, or {dtype: bf16 | fp16, fp32_warmup_steps: N, "
                                "keep_fp32: [module patterns]}" + (f" (unknown key {sorted(unknown)[0]!r})"
                                                                    if unknown else " (dtype is required)"))
    keep = v.get("keep_fp32") or []
    if not isinstance(keep, list) or not all(isinstance(k, str) and k.strip() for k in keep):
        raise JobError(f"{path}.keep_fp32", keep, "must be a list of module-name patterns, e.g. ['embed*', '*.ln*']")
    return {"dtype": _choice("bf16", "fp16")(v["dtype"], f"{path}.dtype"),
            "fp32_warmup_steps": _int(0)(v.get("fp32_warmup_steps", 0), f"{path}.fp32_warmup_steps"),
            "keep_fp32": list(keep)}


_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


@_schema({"anyOf": [{"type": "boolean"}, {
    "type": "object", "additionalProperties": False,
    "properties": {"mode": {"type": "string", "enum": list(_COMPILE_MODES)}, "fullgraph": {"type": "boolean"}}}]})
def _compile(v, path):
    """false, true (mode default) or {mode, fullgraph}; normalised to false or the mapping."""
    if isinstance(v, bool):
        return {"mode": "default", "fullgraph": False} if v else False
    if not isinstance(v, dict) or set(v) - {"mode", "fullgraph"}:
        raise JobError(path, v, "must be true, false, or {mode: " + " | ".join(_COMPILE_MODES) + ", fullgraph: bool}")
    return {"mode": _choice(*_COMPILE_MODES)(v.get("mode", "default"), f"{path}.mode"),
            "fullgraph": _bool(v.get("fullgraph", False), f"{path}.fullgraph")}


@_schema(_nullable({"type": "object", "additionalProperties": False, "required": ["start_step", "steps"],
                    "properties": {"start_step": _number("integer", 1), "steps": _number("integer", 1)}}))
def _profile(v, path):
    """null (no profiling) or {start_step: S, steps: K}: updates S..S+K-1 (1-based) under
    torch.profiler. A mapping rather than a section: its absence, not a default window, means off."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) != {"start_step", "steps"}:
        extra = sorted(set(v) - {"start_step", "steps"}) if isinstance(v, dict) else []
        missing = sorted({"start_step", "steps"} - set(v)) if isinstance(v, dict) else []
        why = f" (unknown key {extra[0]!r})" if extra else f" ({missing[0]} is required)" if missing else ""
        raise JobError(path, v, "must be null (no profiling) or {start_step: S, steps: K}: profile the K updates "
                                "from the S-th (1-based)" + why)
    return {"start_step": _int(1)(v["start_step"], f"{path}.start_step"), "steps": _int(1)(v["steps"], f"{path}.steps")}


@_schema(_nullable(_number("integer", 1)))
def _micro_batch(v, path):
    return None if v is None else _int(1)(v, path)


@_schema(_nullable(_number("number", 0.0)))
def _grad_clip(v, path):
    return None if v is None else _float(0.0)(v, path) or None


@_schema({"type": "number", "enum": [0, 1]})
def _num_gpus(v, path):
    v = _float(0.0)(v, path)
    if v not in (0.0, 1.0):
        raise JobError(path, v, "must be 0 (train on CPU) or 1 (one GPU per worker)",
                       "gearshift runs one worker per device; use more workers for more GPUs.")
    return v


@_schema({"type": "string", "pattern": r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"})
def _name(v, path):
    # the name becomes part of a directory name: keep it to one safe path component
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}", v):
        raise JobError(path, v, "must be 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")
    return v


def _builtin(registry: str):
    """A built-in's name. Any non-empty string passes here; check_job then looks it up in
    workers.components' `registry`, which the schema offers as its list (imported only when
    the schema is made: the registries import torch)."""

    def names():
        from workers import components

        return _nullable({"type": "string", "enum": list(getattr(components, registry))})

    # a checker of its own: the fragment differs per registry, and _str_or_none is shared
    return _schema(names)(lambda v, path: _str_or_none(v, path))


def _f(default, check, doc="", schema_default=True):
    # schema_default=False: the default depends on more than the field (name: the file's name)
    metadata = {"check": check, "doc": doc, "schema_default": schema_default}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _section(cls, doc: str):
    return field(default_factory=cls, metadata={"doc": doc})


@dataclass(frozen=True)
class ModelSpec:
    name: str | None = _f(None, _builtin("MODELS"), "a built-in model: mlp, gpt")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning an nn.Module')
    kwargs: dict = _f({}, _mapping, "passed to the built-in or the entry point")


@dataclass(frozen=True)
class LoaderSpec:
    """Batches read ahead by loader processes (a torch DataLoader over gearshift's own order, so
    the batches are the same whatever the number of processes, and resume is exact)."""

    workers: int = _f(0, _int(0, 64), "loader processes per worker reading batches ahead; 0 reads in the "
                                      "step loop")
    prefetch: int = _f(2, _int(1, 64), "batches each loader process keeps ready (with workers > 0)")
    pin_memory: bool = _f(False, _bool, "page-locked batches for faster copies to a GPU (ignored on CPU)")


_READERS = ("parquet", "json", "csv", "images")


@_schema({"anyOf": [{"type": "string", "pattern": r"\S"},
                    {"type": "array", "items": {"type": "string", "pattern": r"\S"}, "minItems": 1},
                    {"type": "null"}]})
def _columns(v, path):
    """One name, or (data.paths, data.input) a list of them."""
    if v is None or (isinstance(v, str) and v.strip()):
        return v
    if isinstance(v, list) and v and all(isinstance(c, str) and c.strip() for c in v):
        return list(v)
    raise JobError(path, v, "must be a non-empty string or a non-empty list of them")


@_schema(_nullable({"type": "string", "enum": list(_READERS)}))
def _reader(v, path):
    return None if v is None else _choice(*_READERS)(v, path)


@dataclass(frozen=True)
class DataSpec:
    """Map-style data (name or entrypoint), or a Ray Dataset streamed to the workers (ray_dataset
    or read, with input and target naming its columns)."""

    name: str | None = _f(None, _builtin("DATASETS"), "a built-in dataset; default: the one for the built-in model")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning a map-style Dataset')
    ray_dataset: str | None = _f(None, _entrypoint, '"module:function" returning a ray.data.Dataset, streamed '
                                                    "to the workers")
    read: str | None = _f(None, _reader, "read files with Ray Data and stream them: " + ", ".join(_READERS))
    paths: Any = _f(None, _columns, "the files read reads: a path, a glob, a folder, or a list of them (relative "
                                    "to the job file)")
    input: Any = _f(None, _columns, "the Ray Dataset's input column (a list: columns stacked as features)")
    target: str | None = _f(None, _str_or_none, "the Ray Dataset's target column")
    shuffle_buffer: int = _f(8192, _int(0), "Ray Dataset: rows shuffled together within a pass (after the "
                                            "blocks' order is shuffled); 0: the dataset's own order")
    kwargs: dict = _f({}, _mapping, "passed to the built-in, the entry point, or Ray Data's reader")
    loader: LoaderSpec = _section(LoaderSpec, "reading batches ahead in loader processes (map-style data); "
                                              "prefetch also sets how many steps a streamed dataset keeps ahead")


@dataclass(frozen=True)
class LossSpec:
    name: str | None = _f(None, _builtin("LOSSES"), "cross_entropy or mse")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning loss_fn(output, target)')
    kwargs: dict = _f({}, _mapping, "passed to the built-in or the entry point")


SCHEDULES = ("constant", "linear", "warmup_cosine")


@_schema({"anyOf": [{"type": "string", "enum": list(SCHEDULES)}, {"type": "string", "pattern": _ENTRYPOINT_PATTERN}]})
def _lr_schedule(v, path):
    if isinstance(v, str) and ":" in v:
        try:
            return _entrypoint(v, path)
        except JobError:
            pass
    try:
        return _choice(*SCHEDULES)(v, path)
    except JobError as err:
        raise JobError(path, v, err.allowed + ', or "module:function" taking (step, total_steps, base_lr) '
                       "and returning the learning rate", err.hint) from None


@dataclass(frozen=True)
class ScheduleSpec:
    """The learning rate of the s-th update (1-based) of a run of T = train.steps updates:
    lr * s / W during the warm-up (s <= W), then constant, falling linearly (linear), or along a
    half cosine (warmup_cosine) to min_lr_ratio * lr at s = T."""

    name: str = _f("constant", _lr_schedule, 'constant, linear, warmup_cosine, or "module:function" taking '
                                            "(step, total_steps, base_lr) and returning the learning rate")
    warmup_steps: int = _f(0, _int(0), "updates with the learning rate rising linearly to optimizer.lr")
    min_lr_ratio: float = _f(0.0, _float(0.0, 1.0), "linear and warmup_cosine end at min_lr_ratio x optimizer.lr")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = _f("adamw", _choice("sgd", "adam", "adamw"), "the torch.optim optimizer")
    lr: float = _f(1e-3, _float(0.0, lo_open=True), "learning rate")
    weight_decay: float = _f(0.0, _float(0.0), "decoupled for adamw, L2 for sgd and adam")
    momentum: float = _f(0.0, _float(0.0, 0.999999), "sgd only")
    nesterov: bool = _f(False, _bool, "sgd only")
    betas: tuple = _f((0.9, 0.999), _betas, "adam and adamw")
    eps: float = _f(1e-8, _float(0.0, lo_open=True), "adam and adamw")
    schedule: ScheduleSpec = _section(ScheduleSpec, "the learning rate over the run: warm-up and decay")


@dataclass(frozen=True)
class TrainSpec:
    steps: int = _f(100, _int(1), "optimizer steps to train")
    global_batch_size: int = _f(64, _int(1), "samples per optimizer step, over all data-parallel workers")
    micro_batch_size: int | None = _f(None, _micro_batch, "samples one worker computes at once; gradients "
                                      "accumulate over global_batch_size / (micro_batch_size x dp) of them; "
                                      "null: the whole share of the global batch at once")
    seed: int = _f(0, _int(0, 2**31 - 1), "seeds the model's initial weights, the data order and dropout")
    precision: str | dict = _f("fp32", _precision, "fp32, bf16 or fp16 (autocast; fp16 adds loss scaling), or "
                               "phases: {dtype: bf16 | fp16, fp32_warmup_steps: N, keep_fp32: [module patterns]}")
    grad_clip: float | None = _f(None, _grad_clip, "max gradient norm; null or 0 turns clipping off")
    log_every: int = _f(10, _int(1), "steps between progress lines")
    activation_checkpointing: bool = _f(False, _bool, "recompute activations in backward (built-in models)")
    compile: bool | dict = _f(False, _compile, "torch.compile the model under its layout: true, or {mode, "
                                               "fullgraph}; compiled again after a switch")
    profile: dict | None = _f(None, _profile, "record updates start_step..start_step+steps-1 (1-based) with "
                              "torch.profiler on every rank: {start_step: S, steps: K}; null: no profiling. "
                              "Traces and tables land in RUN_DIR/profile/")


@dataclass(frozen=True)
class ClusterSpec:
    num_workers: int = _f(2, _int(1, 4096), "worker actors, one per device")
    cpus_per_worker: float = _f(1.0, _float(0.0, lo_open=True), "Ray CPUs reserved for each worker")
    gpus_per_worker: float = _f(0.0, _num_gpus, "0: train on CPU; 1: one GPU per worker")
    placement: str = _f("pack", _choice("pack", "spread"), "Ray placement group strategy: pack workers onto "
                                                           "few nodes, or spread them")
    placement_timeout_s: float = _f(60.0, _float(0.0, lo_open=True), "fail when the cluster cannot fit the job by then")


@_schema(_nullable(_number("integer", 1, 4096)))
def _tp_size(v, path):
    return None if v is None else _int(1, 4096)(v, path)


@_schema({"type": ["object", "null"], "additionalProperties": {"type": "string", "enum": ["colwise", "rowwise"]}})
def _tp_plan(v, path):
    plan = _mapping(v, path)
    for pattern, style in plan.items():
        if style not in ("colwise", "rowwise"):
            raise JobError(f"{path}.{pattern}", style, "must be 'colwise' or 'rowwise'")
    return plan


@_schema({"anyOf": [_number("number", 0.0, 4096.0, lo_open=True), {"type": "string", "const": "auto"}]})
def _bucket(v, path):
    if v == "auto":
        return v
    try:
        return _float(0.0, 4096.0, lo_open=True)(v, path)
    except JobError:
        raise JobError(path, v, "must be a number of MB in (0, 4096], or 'auto' to tune it while training") from None


@_schema({"type": "array", "items": _number("number", 0.0, 4096.0, lo_open=True), "minItems": 1,
          "uniqueItems": True})
def _bucket_values(v, path):
    if not isinstance(v, list) or not v:
        raise JobError(path, v, "must be a non-empty list of bucket sizes in MB, e.g. [1, 5, 10, 25, 50, 100]")
    out = [_float(0.0, 4096.0, lo_open=True)(x, f"{path}[{i}]") for i, x in enumerate(v)]
    if len(set(out)) != len(out):
        raise JobError(path, v, "must not repeat a value")
    return sorted(out)


# strategies.builtin_names(), written out: importing strategies imports torch, and the CLI reads
# and checks a job file's fields before torch is needed (tests/test_job.py holds them equal)
BUILTIN_STRATEGIES = ("data", "tensor", "hybrid", "fsdp", "hsdp")


def _strategy(allow_auto: bool):
    """A built-in layout by name (or auto), or "module:name" naming the user's own
    strategies.Strategy (imported and checked with the other components)."""
    names = BUILTIN_STRATEGIES + (("auto",) if allow_auto else ())

    @_schema({"anyOf": [{"type": "string", "enum": list(names)},
                        {"type": "string", "pattern": _ENTRYPOINT_PATTERN}]})
    def check(v, path):
        if isinstance(v, str) and ":" in v:
            try:
                return _entrypoint(v, path)
            except JobError:
                raise JobError(path, v, 'must be one of ' + ", ".join(map(repr, names)) +
                               ', or "module:name" naming your own strategies.Strategy') from None
        try:
            return _choice(*names)(v, path)
        except JobError as err:
            raise JobError(path, v, err.allowed + ', or "module:name" naming your own strategies.Strategy',
                           err.hint) from None

    check.choices = names
    return check


@dataclass(frozen=True)
class ParallelSpec:
    strategy: str = _f("data", _strategy(allow_auto=True),
                       "auto starts data parallel and lets the adaptive policy switch (see adapt)")
    tp_size: int | None = _f(None, _tp_size, "tensor-parallel group size; hybrid: dp = num_workers / tp_size")
    tp_plan: dict = _f({}, _tp_plan, "module-name pattern -> colwise | rowwise, for models without a plan")
    bucket_cap_mb: float | str = _f(25.0, _bucket, "gradient bucket size in MB, or auto: tuned while training "
                                                    "(see tune)")
    tp_across_nodes: bool = _f(False, _bool, "allow tensor-parallel groups that span nodes (slow: for comparisons)")
    shard_size: int | None = _f(None, _tp_size, "hsdp: workers per shard group (state sharded inside a group, "
                                                "replicated across groups); null: the workers of one node")
    dp_shard: bool = _f(False, _bool, "hybrid: shard the data dimension's state (FSDP over dp) instead of "
                                      "replicating it")


@dataclass(frozen=True)
class CheckpointSpec:
    every: int = _f(0, _int(0), "steps between checkpoints; 0 keeps only the final state")
    keep: int = _f(3, _int(1), "how many recent checkpoints to keep")
    keep_best: bool = _f(False, _bool, "also keep the checkpoint with the lowest eval loss (needs eval.every > 0); "
                                       "checkpoints/best.json names it")
    format: str = _f("auto", _choice("auto", "dcp", "full"), "dcp: every worker writes its own shards "
                     "(torch.distributed.checkpoint), nothing gathered; full: whole tensors gathered to one worker "
                     "and written by the driver; auto: dcp when every worker sees the run directory, else full")


@_schema(_nullable(_number("integer", 0, 65535)))
def _port(v, path):
    return None if v is None else _int(0, 65535)(v, path)


@_schema({"type": "string", "pattern": r"^[A-Za-z0-9.:_-]{1,253}$"})
def _host(v, path):
    if not isinstance(v, str) or not re.fullmatch(r"[A-Za-z0-9.:_-]{1,253}", v):
        raise JobError(path, v, "must be a host name or IP address to bind, e.g. 127.0.0.1 or 0.0.0.0")
    return v


# steps must also increase and come before train.steps: the checkers say so, a schema cannot
@_schema({"type": ["array", "null"], "items": {
    "type": "object", "required": ["step", "strategy"], "additionalProperties": False,
    "properties": {"step": _number("integer", 1), "strategy": _strategy(allow_auto=False).schema,
                   "tp_size": _tp_size.schema, "shard_size": _tp_size.schema, "dp_shard": {"type": "boolean"}}}})
def _schedule(v, path):
    if v is None:
        return []
    if not isinstance(v, list):
        raise JobError(path, v, "must be a list of {step: N, strategy: S, tp_size: K, shard_size: G, dp_shard: B}")
    out, last = [], 0
    for i, entry in enumerate(v):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"step", "strategy", "tp_size", "shard_size", "dp_shard"} or \
                not {"step", "strategy"} <= set(entry):
            raise JobError(where, entry, "must be {step: N, strategy: S} with tp_size for hybrid, shard_size for "
                                         "hsdp and dp_shard: true for a sharded hybrid")
        step = _int(1)(entry["step"], f"{where}.step")
        if step <= last:
            raise JobError(f"{where}.step", step, f"must be later than the entry before it (step {last})")
        last = step
        strategy = _strategy(allow_auto=False)(entry["strategy"], f"{where}.strategy")
        out.append({"step": step, "strategy": strategy, "tp_size": _tp_size(entry.get("tp_size"), f"{where}.tp_size"),
                    "shard_size": _tp_size(entry.get("shard_size"), f"{where}.shard_size"),
                    "dp_shard": _bool(entry.get("dp_shard", False), f"{where}.dp_shard")})
    return out


@dataclass(frozen=True)
class AdaptSpec:
    enabled: bool = _f(True, _bool, "with strategy auto: let the policy switch layouts")
    threshold: float = _f(0.15, _float(0.0, 1.0, lo_open=True), "comm-wait fraction of the step that calls for a switch")
    window: int = _f(20, _int(2, 100000), "steps averaged before each decision")
    cooldown: int = _f(40, _int(0), "steps after a switch before the next one")
    decide: str = _f("predict", _choice("predict", "trial"),
                     "predict: move to the layout an online cost model predicts best, when it pays; trial: try "
                     "the next candidate and keep it if it helped")
    schedule: list = _f([], _schedule, "forced switches: [{step: N, strategy: S, tp_size: K, shard_size: G, "
                                       "dp_shard: B}, ...]")


@dataclass(frozen=True)
class TuneSpec:
    """Online tuning of parallel.bucket_cap_mb (when it is auto): a climb over `bucket_values`."""

    bucket_values: list = _f([1.0, 5.0, 10.0, 25.0, 50.0, 100.0], _bucket_values, "bucket sizes (MB) to choose from")
    start: float = _f(25.0, _float(0.0, 4096.0, lo_open=True), "the value training starts with; one of bucket_values")
    warmup_steps: int = _f(3, _int(0, 10000), "steps discarded after each change (the new buckets warm up)")
    trial_steps: int = _f(10, _int(1, 100000), "steps timed per trial; the score is their samples/s")
    max_trials: int = _f(6, _int(1, 1000), "trials per tuning round (one round at the start, one per layout)")


@_schema(_nullable({"type": "object", "required": ["mb_per_s"], "additionalProperties": False,
                    "properties": {"mb_per_s": _number("number", 0.0, lo_open=True),
                                   "latency_ms": {**_number("number", 0.0, 60000.0), "default": 0.0}}}))
def _link(v, path):
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"mb_per_s", "latency_ms"} or "mb_per_s" not in v:
        raise JobError(path, v, "must be {mb_per_s: B, latency_ms: L} (latency optional) or null")
    return {"mb_per_s": _float(0.0, lo_open=True)(v["mb_per_s"], f"{path}.mb_per_s"),
            "latency_ms": _float(0.0, 60000.0)(v.get("latency_ms", 0.0), f"{path}.latency_ms")}


@dataclass(frozen=True)
class TelemetrySpec:
    enabled: bool = _f(True, _bool, "per-step timing of data, compute and comm wait, and device sampling")
    sample_period_s: float = _f(1.0, _float(0.2, 3600.0), "device sampling period (NVML takes a driver lock)")
    metrics_port: int | None = _f(None, _port, "serve Prometheus /metrics on this port; 0 picks a free one")
    metrics_host: str = _f("127.0.0.1", _host, "address the /metrics endpoint binds")
    ray_metrics: bool = _f(True, _bool, "also export through ray.util.metrics (Ray's Prometheus endpoint)")


@dataclass(frozen=True)
class MlflowSpec:
    tracking_uri: str | None = _f(None, _str_or_none, "where runs go: sqlite:///PATH or file:PATH (no server), or "
                                  "http://HOST:PORT (an `mlflow server`); null: $MLFLOW_TRACKING_URI, else "
                                  "sqlite:///RUNS_ROOT/mlflow.db")
    experiment: str = _f("gearshift", _name, "the MLflow experiment the run is logged under (created if missing)")


@_schema(_nullable({"anyOf": [{"type": "boolean"}, {
    "type": "object", "additionalProperties": False,
    "properties": {"tracking_uri": _nullable({"type": "string"}), "experiment": _name.schema}}]}))
def _mlflow(v, path):
    """null or false (off), true (the defaults), or {tracking_uri, experiment}; normalised to None
    or the mapping. A value rather than a section: its absence, not a default, means off."""
    if v is None or v is False:
        return None
    if v is True:
        v = {}
    if not isinstance(v, dict):
        raise JobError(path, v, "must be true, false, null, or {tracking_uri: URI, experiment: NAME}")
    return dataclasses.asdict(_build(MlflowSpec, v, path))


@dataclass(frozen=True)
class TrackingSpec:
    """Experiment trackers fed from the controller, off the workers' hot path (orchestrator/tracking.py).
    A tracker that is down or slow never stops or slows training."""

    mlflow: dict | None = _f(None, _mlflow, "log the run to MLflow: true, or {tracking_uri, experiment}; null: off")
    tensorboard: bool = _f(False, _bool, "write TensorBoard event files to RUN_DIR/tensorboard/")
    buffer: int = _f(10000, _int(100, 10_000_000), "records held for a slow or unreachable tracker; beyond it the "
                     "oldest are dropped (and counted)")
    close_timeout_s: float = _f(30.0, _float(0.0, 3600.0), "at the end of the run, how long to wait for the "
                                "trackers to catch up and take the artifacts")


@dataclass(frozen=True)
class InjectSpec:
    """A simulated network, for trying adaptive mode on one machine (workers/simnet.py): the
    workers grouped into simulated nodes, a slow link between them, a delay on every collective."""

    comm_delay_ms: float = _f(0.0, _float(0.0, 60000.0), "extra latency added to every timed collective")
    nodes: int = _f(1, _int(1, 4096), "group the workers into this many simulated nodes (consecutive ranks)")
    link: dict | None = _f(None, _link, "a simulated slow link between simulated nodes: {mb_per_s, latency_ms}")


@_schema(_number("integer", -1))
def _max_failures(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise JobError(path, v, "must be an integer >= 0, or -1 for no limit")
    return v


@dataclass(frozen=True)
class FaultSpec:
    """What happens when a worker, a node or a step goes wrong."""

    max_failures: int = _f(3, _max_failures, "worker or node failures to recover from (restart from the latest "
                                             "checkpoint); -1: no limit")
    collective_timeout_s: float = _f(300.0, _float(1.0, 86400.0), "a collective or a worker silent this long is "
                                                                 "a failure")
    on_node_loss: str = _f("shrink", _choice("shrink", "wait"), "shrink: continue on the workers that still fit; "
                                                              "wait: wait for a replacement node")
    replacement_timeout_s: float = _f(600.0, _float(0.0, 86400.0), "on_node_loss wait: how long, then fail")
    on_nan: str = _f("skip", _choice("skip", "stop"), "a step with a non-finite loss or gradient norm: skip its "
                                                    "batch (the update is not applied) or stop the run")


_DATA_FORMS = 'a built-in name, "module:function", or {name | entrypoint, kwargs}'


@_schema(_nullable({"anyOf": [
    {"type": "string", "pattern": r"\S"},
    {"type": "object", "additionalProperties": False,
     "properties": {"name": _nullable({"type": "string"}), "entrypoint": _entrypoint.schema,
                    "kwargs": _mapping.schema}}]}))
def _eval_data(v, path):
    """The same forms as the top-level data, normalised to {name, entrypoint, kwargs}. One field
    rather than a nested section: eval.data is a value of eval, as inject.link is of inject."""
    if v is None:
        return None
    if not isinstance(v, (str, dict)):
        raise JobError(path, v, f"must be {_DATA_FORMS}")
    spec = _build(DataSpec, _shorthand(DataSpec, v), path)
    return dataclasses.asdict(spec)


@_schema(_nullable(_number("integer", 1)))
def _eval_batches(v, path):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise JobError(path, v, "must be an integer >= 1 (evaluate the first that many batches of eval.data), "
                                "or null (all of it)")
    return v


@dataclass(frozen=True)
class EvalSpec:
    """Held-out loss while training: at every `every`-th step and at the end, the mean loss over
    eval.data under the layout in force, in batches of train.global_batch_size, in order."""

    every: int = _f(0, _int(0), "steps between evaluations (and one at the end); 0: no evaluation")
    data: dict | None = _f(None, _eval_data, f"the held-out data: {_DATA_FORMS}; required when every > 0")
    batches: int | None = _f(None, _eval_batches, "evaluate the first K batches of eval.data; null: all of it")


@dataclass(frozen=True)
class Job:
    name: str = _f("job", _name, "names the run and its directory; default: the job file's name",
                   schema_default=False)
    model: ModelSpec = _section(ModelSpec, 'required: a built-in name (mlp, gpt), "module:function", or '
                                           "{name | entrypoint, kwargs}")
    data: DataSpec = _section(DataSpec, 'a built-in name, "module:function", or {name | entrypoint, kwargs}; '
                                        "default: the built-in model's own data")
    loss: LossSpec = _section(LossSpec, 'a built-in name, "module:function", or {name | entrypoint, kwargs}; '
                                        "default: cross_entropy")
    optimizer: OptimizerSpec = _section(OptimizerSpec, "sgd (momentum, nesterov), adam or adamw (betas, eps)")
    train: TrainSpec = _section(TrainSpec, "how long, how big a batch, which seed and precision")
    cluster: ClusterSpec = _section(ClusterSpec, "how many workers and what each takes from Ray")
    parallel: ParallelSpec = _section(ParallelSpec, "the layout training starts with: data, tensor, hybrid, or auto")
    adapt: AdaptSpec = _section(AdaptSpec, "when the layout changes while training: the policy, or a schedule")
    tune: TuneSpec = _section(TuneSpec, "online tuning of parallel.bucket_cap_mb when it is auto")
    fault: FaultSpec = _section(FaultSpec, "what happens when a worker, a node or a step goes wrong")
    checkpoint: CheckpointSpec = _section(CheckpointSpec, "how often the training state is saved")
    eval: EvalSpec = _section(EvalSpec, "held-out loss while training: every N steps and at the end")
    telemetry: TelemetrySpec = _section(TelemetrySpec, "per-step timing, device sampling and metrics endpoints")
    tracking: TrackingSpec = _section(TrackingSpec, "experiment tracking: MLflow and TensorBoard")
    inject: InjectSpec = _section(InjectSpec, "for tests: make a fast machine behave like a slow cluster")
    # Where the job file lies: entry-point modules next to it are importable. Not a YAML key.
    base_dir: str = field(default=".", metadata={"internal": True}, compare=False)

    @property
    def layout(self):
        from strategies.layout import Layout

        # auto starts data parallel; the policy moves it from there
        strategy = "data" if self.parallel.strategy == "auto" else self.parallel.strategy
        p = self.parallel
        return Layout.for_workers(strategy, self.cluster.num_workers, p.tp_size, self.shard_size(strategy), p.dp_shard)

    def shard_size(self, strategy: str) -> int | None:
        """hsdp's shard group: parallel.shard_size, else the workers of one node (the simulated
        nodes' size here; the placement's own node size once the workers are placed)."""
        if strategy != "hsdp" or self.parallel.shard_size is not None:
            return self.parallel.shard_size
        return self.cluster.num_workers // max(1, self.inject.nodes)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    def to_dict(self) -> dict:
        """The resolved job as plain data: what `job.yaml` in the run dir holds."""
        out = dataclasses.asdict(self)
        out.pop("base_dir")
        out["optimizer"]["betas"] = list(out["optimizer"]["betas"])
        return out

    def fingerprint(self) -> str:
        """A short hash of everything that changes the result; same config, same fingerprint."""
        data = self.to_dict()
        data.pop("name")
        data.pop("tracking")  # where the run is reported, not what it computes
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:8]


# ----------------------------------------------------------------------------- building


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _build(cls, raw: Any, path: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(path or "(top level)", raw, f"must be a mapping with keys {', '.join(_fields(cls))}")
    known = _fields(cls)
    values = {}
    for key, value in raw.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
            hint = f"Did you mean {(path + '.' if path else '') + close[0]!r}?" if close else ""
            raise JobError(sub, value, f"unknown key; {path or 'the top level'} takes {', '.join(known)}", hint)
        f = known[key]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            values[key] = _build(f.default_factory, _shorthand(f.default_factory, value), sub)
        else:
            values[key] = f.metadata["check"](value, sub)
    return cls(**values)


def _shorthand(cls, value):
    """`model: mlp`, `loss: cross_entropy` and `loss: "mod:fn"` are short for the mapping form."""
    if isinstance(value, str) and cls in (ModelSpec, DataSpec, LossSpec):
        return {"entrypoint": value} if ":" in value else {"name": value}
    if isinstance(value, str) and cls is ScheduleSpec:  # `schedule: warmup_cosine`
        return {"name": value}
    return value


def parse_overrides(overrides: list[str]) -> list[tuple[list[str], Any]]:
    """`a.b=value` pairs; values parse as YAML so lists, mappings and numbers work."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p.strip() for p in parts):
            raise JobError("--set", item, "must be KEY=VALUE with a dotted key, for example train.steps=50")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise JobError(f"--set {key}", text, f"must be a YAML value ({_yaml_problem(err)})") from None
        parsed.append(([p.strip() for p in parts], value))
    return parsed


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = json.loads(json.dumps(raw, default=str)) if raw else {}
    for parts, value in parse_overrides(overrides):
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            elif isinstance(child, str) and part in ("model", "data", "loss"):
                child = node[part] = _shorthand({"model": ModelSpec, "data": DataSpec, "loss": LossSpec}[part], child)
            if not isinstance(child, dict):
                dotted = ".".join(parts[: i + 1])
                raise JobError(f"--set {'.'.join(parts)}", value, f"cannot set a key inside {dotted}, which is {_show(child)}")
            node = child
        node[parts[-1]] = value
    return raw


def _yaml_problem(err: yaml.YAMLError) -> str:
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return problem


def read_yaml(path: pathlib.Path) -> dict:
    if not path.is_file():
        raise JobError("job file", str(path), "must be an existing YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise JobError("job file", str(path), f"must be valid YAML ({_yaml_problem(err)})") from None
    except (OSError, UnicodeDecodeError) as err:
        raise JobError("job file", str(path), f"must be a readable UTF-8 text file ({err})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError("(top level)", raw, "must be a mapping with keys " + ", ".join(_fields(Job)))
    return raw


def job_from_dict(raw: Mapping, base_dir: str | pathlib.Path = ".", default_name: str = "job") -> Job:
    raw = dict(raw)
    raw.setdefault("name", default_name)
    job = _build(Job, raw, "")
    job = dataclasses.replace(job, base_dir=str(pathlib.Path(base_dir).resolve()))
    check_job(job)
    return job


def load_job(path: str | pathlib.Path, overrides: list[str] | None = None) -> Job:
    """Read, override, validate. Raises JobError naming the file and the field."""
    path = pathlib.Path(path)
    try:
        raw = apply_overrides(read_yaml(path), overrides or [])
        default_name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("._-")[:64] or "job"
        return job_from_dict(raw, path.parent, default_name=default_name)
    except JobError as err:
        if not err.source:
            err.source = str(path)
            err.args = (err.message(),)
        raise


# ----------------------------------------------------------------------------- cross-field checks


def check_job(job: Job) -> None:
    """Checks that need more than one field, and the components the job names."""
    from workers.components import ComponentError

    try:
        _check_components(job)
    except ComponentError as err:
        raise JobError(err.field_path, err.value, err.allowed, err.hint) from None
    _check_sizes(job)


def _check_components(job: Job) -> None:
    from workers import components  # the registry of built-ins lives with the code that builds them

    for section in ("model", "data", "loss"):
        spec = getattr(job, section)
        if spec.name and spec.entrypoint:
            raise JobError(f"{section}", {"name": spec.name, "entrypoint": spec.entrypoint},
                           "give either name (a built-in) or entrypoint (your own), not both")
    if not job.model.name and not job.model.entrypoint:
        raise JobError("model", None, "is required: a built-in name (" + ", ".join(components.MODELS) +
                       ') or entrypoint: "module:function"')

    search_paths = [job.base_dir]
    if job.model.name:
        components.check_builtin("model", job.model.name, job.model.kwargs, components.MODELS)
    else:
        components.check_entrypoint("model.entrypoint", job.model.entrypoint, search_paths, job.model.kwargs)

    if _check_streamed(job, "data", job.to_dict()["data"]):
        pass
    elif job.data.entrypoint:
        components.check_entrypoint("data.entrypoint", job.data.entrypoint, search_paths, job.data.kwargs)
    else:
        name = job.data.name or components.default_data_for(job.model.name)
        if name is None:
            raise JobError("data", None, "is required for a model given by entry point: a built-in name (" +
                           ", ".join(components.DATASETS) + ') or entrypoint: "module:function"')
        components.check_builtin("data", name, job.data.kwargs, components.DATASETS)

    if job.model.name and not (job.data.ray_dataset or job.data.read):
        spec = job.to_dict()
        components.check_builtin_fit(spec["model"], spec["data"])

    _check_eval(job, components)

    if job.loss.entrypoint:
        components.check_entrypoint("loss.entrypoint", job.loss.entrypoint, search_paths, job.loss.kwargs)
    elif job.loss.name:
        components.check_builtin("loss", job.loss.name, job.loss.kwargs, components.LOSSES)


def _check_eval(job: Job, components) -> None:
    """Eval data is checked as data is (it must load and fit the model), before anything starts."""
    ev, spec = job.eval, job.eval.data
    if job.checkpoint.keep_best and ev.every == 0:
        raise JobError("checkpoint.keep_best", True, "needs eval.every > 0: the best checkpoint is the one "
                       "with the lowest eval loss")
    if ev.every == 0:
        return
    if spec is None:
        raise JobError("eval.data", None, f"is required when eval.every > 0 ({ev.every}): {_DATA_FORMS}",
                       "Use held-out data, not the training data: for the built-ins, the same name with "
                       "another seed, e.g. {name: synthetic_digits, kwargs: {seed: 99, size: 1024}}.")
    if _check_streamed(job, "eval.data", spec):
        return
    if spec["name"] and spec["entrypoint"]:
        raise JobError("eval.data", {"name": spec["name"], "entrypoint": spec["entrypoint"]},
                       "give either name (a built-in) or entrypoint (your own), not both")
    if not spec["name"] and not spec["entrypoint"]:
        raise JobError("eval.data", spec, f"names no data: give {_DATA_FORMS}")
    with _renamed("data", "eval.data"):
        if spec["entrypoint"]:
            components.check_entrypoint("data.entrypoint", spec["entrypoint"], [job.base_dir], spec["kwargs"])
        else:
            components.check_builtin("data", spec["name"], spec["kwargs"], components.DATASETS)
            if job.model.name:
                components.check_builtin_fit(job.to_dict()["model"], spec)


def _check_streamed(job: Job, field: str, spec: dict) -> bool:
    """A Ray Dataset (ray_dataset or read) is complete and alone; False for map-style data.
    Its columns, rows and files are checked by its feeder once Ray runs, before any worker."""
    from workers import components, streaming

    streamed = {k: spec[k] for k in ("ray_dataset", "read") if spec.get(k)}
    if not streamed:
        for key in ("paths", "input", "target"):
            if spec.get(key) is not None:
                raise JobError(f"{field}.{key}", spec[key], "applies to a Ray Dataset: give ray_dataset "
                               '("module:function") or read (' + ", ".join(_READERS) + ") with it")
        return False
    if len(streamed) > 1:
        raise JobError(field, streamed, "give either ray_dataset (your function) or read (files), not both")
    mapped = {k: spec[k] for k in ("name", "entrypoint") if spec.get(k)}
    if mapped:
        raise JobError(field, {**mapped, **streamed}, "give either a map-style dataset (name, entrypoint) or a "
                       "Ray Dataset (ray_dataset, read), not both")
    for key in ("input", "target"):
        if spec.get(key) is None:
            raise JobError(f"{field}.{key}", None, "is required with a Ray Dataset: the name of its "
                           f"{key} column", "For example {read: parquet, paths: data/, input: x, target: y}.")
    if not isinstance(spec["target"], str):
        raise JobError(f"{field}.target", spec["target"], "must be one column's name")
    if spec["read"]:
        if spec.get("paths") is None:
            raise JobError(f"{field}.paths", None, f"is required with read: {spec['read']}: the files to read")
        try:
            streaming.local_matches(streaming._rooted(spec["paths"], [job.base_dir]))
        except components.ComponentError as err:
            raise JobError(f"{field}.paths", err.value, err.allowed, err.hint) from None
    else:
        if spec.get("paths") is not None:
            raise JobError(f"{field}.paths", spec["paths"], "applies to read; a ray_dataset function finds its "
                           "own files (pass them in kwargs)")
        with _renamed("data", field):
            components.check_entrypoint("data.ray_dataset", spec["ray_dataset"], [job.base_dir], spec["kwargs"])
    if field == "data" and job.data.loader.workers:
        raise JobError("data.loader.workers", job.data.loader.workers, "must be 0 with a Ray Dataset: Ray Data "
                       "reads in its own tasks (data.loader.prefetch sets how many steps are kept ahead)")
    return True


class _renamed:
    """components' checks name the `data` section; for eval data the field is `eval.data`."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        from workers.components import ComponentError

        if isinstance(err, ComponentError) and (err.field_path + ".").startswith(self.old + "."):
            raise ComponentError(self.new + err.field_path[len(self.old):], err.value, err.allowed,
                                 err.hint) from None
        return False


def _resolve_strategy(job: Job, field_path: str, name: str):
    """The registered strategy `name` ("auto" starts as data), importing a user's own
    "module:name" from the job's folder; JobError when it cannot be found."""
    import strategies

    try:
        return strategies.lookup("data" if name == "auto" else name, [job.base_dir])
    except strategies.LayoutError as err:
        raise JobError(field_path, name, str(err)) from None


def _check_layout(job: Job) -> None:
    from strategies.layout import LayoutError
    from workers import components
    from workers.components import ComponentError

    if job.parallel.strategy == "auto" and job.parallel.tp_size is not None:
        raise JobError("parallel.tp_size", job.parallel.tp_size, "is chosen by the policy under strategy auto; "
                       "leave it unset (or pin layouts with adapt.schedule)")
    _resolve_strategy(job, "parallel.strategy", job.parallel.strategy)
    try:
        layout = job.layout
    except LayoutError as err:
        text = str(err)
        field = ("parallel.dp_shard" if "dp_shard" in text and job.parallel.dp_shard else
                 "parallel.shard_size" if "shard_size" in text and job.parallel.shard_size is not None else
                 "parallel.tp_size" if job.parallel.tp_size is not None else "parallel.strategy")
        raise JobError(field, getattr(job.parallel, field.split(".")[1]), text) from None
    if job.train.activation_checkpointing and not job.model.name:
        raise JobError("train.activation_checkpointing", True, "is available for the built-in models only; "
                       "a model given by entry point can use torch.utils.checkpoint itself")
    if job.parallel.tp_plan and job.parallel.strategy == "data" and not job.adapt.schedule:
        raise JobError("parallel.tp_plan", job.parallel.tp_plan, "only applies with tensor parallelism; "
                       "strategy data shards nothing")
    if _resolve_strategy(job, "parallel.strategy", layout.strategy).needs_plan:
        try:
            components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, layout.tp, [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None


def _check_adapt(job: Job) -> None:
    """Every layout the run may switch to must fit the workers, the batch and the model."""
    from strategies.layout import Layout, LayoutError
    from workers import components
    from workers.components import ComponentError

    w = job.cluster.num_workers
    if job.inject.nodes > 1 and w % job.inject.nodes:
        raise JobError("inject.nodes", job.inject.nodes, f"must divide cluster.num_workers ({w}): "
                       f"{w} % {job.inject.nodes} = {w % job.inject.nodes}")
    if job.inject.link is not None and job.inject.nodes < 2:
        raise JobError("inject.link", job.inject.link, "needs inject.nodes >= 2: a link joins simulated nodes")
    for i, entry in enumerate(job.adapt.schedule):
        where = f"adapt.schedule[{i}]"
        if entry["step"] >= job.train.steps:
            raise JobError(f"{where}.step", entry["step"], f"must be before the last step (train.steps = {job.train.steps})")
        _resolve_strategy(job, f"{where}.strategy", entry["strategy"])
        try:
            layout = scheduled(job, entry)
        except LayoutError as err:
            raise JobError(where, entry, str(err)) from None
        if job.train.global_batch_size % layout.dp:
            raise JobError(where, entry, f"dp({layout.dp}) must divide train.global_batch_size "
                                         f"({job.train.global_batch_size})")
        if _resolve_strategy(job, f"{where}.strategy", layout.strategy).needs_plan:
            try:
                components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, layout.tp, [job.base_dir])
            except ComponentError as err:
                raise JobError(err.field_path, err.value, err.allowed, f"(needed by {where}) {err.hint}".strip()) from None


def _check_tune(job: Job) -> None:
    t = job.tune
    if t.start not in t.bucket_values:
        raise JobError("tune.start", t.start, f"must be one of tune.bucket_values {t.bucket_values}")


def _check_sizes(job: Job) -> None:
    _check_layout(job)
    _check_adapt(job)
    _check_tune(job)
    dp = job.dp_size
    if job.train.global_batch_size % dp:
        raise JobError("train.global_batch_size", job.train.global_batch_size,
                       f"must divide evenly across the data-parallel workers: "
                       f"{job.train.global_batch_size} % {dp} = {job.train.global_batch_size % dp}",
                       f"Use a multiple of {dp}, e.g. {dp * max(1, round(job.train.global_batch_size / dp))}.")
    _check_micro_batch(job, [("parallel.strategy", job.layout)] + _scheduled_layouts(job))
    _check_lr_schedule(job)
    _check_keep_fp32(job)
    _check_profile(job)
    if job.optimizer.name != "sgd" and (job.optimizer.momentum or job.optimizer.nesterov):
        raise JobError("optimizer.momentum", job.optimizer.momentum,
                       f"applies to sgd only; {job.optimizer.name} uses betas")
    if job.optimizer.nesterov and job.optimizer.momentum <= 0:
        raise JobError("optimizer.nesterov", True, "needs optimizer.momentum > 0")


def _scheduled_layouts(job: Job) -> list:
    from strategies.layout import Layout

    return [(f"adapt.schedule[{i}]", scheduled(job, e)) for i, e in enumerate(job.adapt.schedule)]


def scheduled(job: Job, entry: dict, workers: int | None = None):
    """The layout an adapt.schedule entry names (a resumed or shrunk run may have other `workers`)."""
    from strategies.layout import Layout

    n = workers or job.cluster.num_workers
    shard = entry.get("shard_size")
    if entry["strategy"] == "hsdp" and shard is None:
        shard = job.shard_size("hsdp") if n == job.cluster.num_workers else n // max(1, job.inject.nodes)
    return Layout.for_workers(entry["strategy"], n, entry["tp_size"], shard, entry.get("dp_shard", False))


def accumulation(global_batch: int, micro: int | None, dp: int) -> int | None:
    """Micro-batches per update on each rank, or None when they do not divide the batch."""
    if micro is None:
        return 1
    share, rest = divmod(global_batch, micro * dp)
    return share if not rest and share >= 1 else None


def _check_micro_batch(job: Job, layouts: list) -> None:
    """Accumulation = global / (micro x dp) must be a whole number under every layout the run
    may take (a switch changes dp and keeps the micro-batch)."""
    g, b = job.train.global_batch_size, job.train.micro_batch_size
    for where, layout in layouts:
        if accumulation(g, b, layout.dp) is None:
            raise JobError("train.micro_batch_size", b,
                           f"global_batch_size({g}) must be a multiple of micro_batch_size({b}) x dp({layout.dp}) "
                           f"= {b * layout.dp} under {where} = {layout}: {g} % {b * layout.dp} = {g % (b * layout.dp)}",
                           "Accumulation steps = global_batch_size / (micro_batch_size x dp).")


def _check_lr_schedule(job: Job) -> None:
    sched, steps = job.optimizer.schedule, job.train.steps
    if sched.warmup_steps and sched.warmup_steps >= steps:
        raise JobError("optimizer.schedule.warmup_steps", sched.warmup_steps,
                       f"must be shorter than the run (train.steps = {steps})")
    if ":" in sched.name:
        from workers import schedules
        from workers.components import ComponentError

        try:
            schedules.check_user_schedule(sched.name, job.optimizer.lr, steps, [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None


def _check_profile(job: Job) -> None:
    """A window that runs past the last update would never finish: no trace would be written."""
    p, steps = job.train.profile, job.train.steps
    if p and p["start_step"] + p["steps"] - 1 > steps:
        raise JobError("train.profile", p, f"must end by the last update: start_step + steps - 1 = "
                       f"{p['start_step'] + p['steps'] - 1} > train.steps = {steps}",
                       f"With steps: {p['steps']}, start_step may be at most {steps - p['steps'] + 1}." if
                       p["steps"] <= steps else f"At most train.steps = {steps} updates can be profiled.")


def _check_keep_fp32(job: Job) -> None:
    """Each keep_fp32 pattern must name a module of the model, as a tp plan's patterns must."""
    p = job.train.precision
    if not isinstance(p, dict) or not p["keep_fp32"]:
        return
    from workers import precision
    from workers.components import ComponentError

    try:
        precision.check_patterns(job.to_dict()["model"], p["keep_fp32"], [job.base_dir])
    except ComponentError as err:
        raise JobError(err.field_path, err.value, err.allowed, err.hint) from None


def dump_job(job: Job) -> str:
    return yaml.safe_dump(job.to_dict(), sort_keys=False)
