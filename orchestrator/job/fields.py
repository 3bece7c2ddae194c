"""The job file's field checkers: each turns one raw YAML value into a checked one or raises a
JobError that names the field, the bad value and what is allowed, and carries the JSON Schema
fragment `gearshift schema` shows for it."""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import field
from typing import Any

from gearshift.orchestrator.job import credentials


class JobError(ValueError):
    """A problem with the job file or an override, reported as one paragraph."""

    def __init__(self, field_path: str, value: Any, allowed: str, hint: str = "", source: str = ""):
        self.field_path = field_path
        # a credential's value is never shown, in the message or to a caller that prints err.value
        self.value = value if value is _MISSING else credentials.mask(value, credentials.parse_path(field_path))
        self.allowed = allowed
        self.hint = hint
        self.source = source
        super().__init__(self.message())

    @property
    def field(self) -> str:
        """The dotted job field (or argument) that is wrong, e.g. "train.global_batch_size"."""
        return self.field_path

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


@_schema({"enum": ["rebalance", "drop", "report", "off", False]})
def _stragglers(v, path):
    """adapt.stragglers; YAML reads a bare `off` as false, which means off."""
    return "off" if v is False else _choice("rebalance", "drop", "report", "off")(v, path)


@_schema({"anyOf": [{"type": "boolean"}, {"type": "string", "enum": ["auto"]}]})
def _bool_or_auto(v, path):
    if not isinstance(v, bool) and v != "auto":
        raise JobError(path, v, "must be true, false or 'auto'")
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
                   "keep_fp32": {"type": "array", "items": {"type": "string", "minLength": 1}},
                   "fp32_final_steps": _number("integer", 0),
                   "final_fp32": {"type": "array", "items": {"type": "string", "minLength": 1}}}}]})
def _precision(v, path):
    """fp32 | bf16 | fp16, or phases: {dtype, fp32_warmup_steps, keep_fp32: [module patterns],
    fp32_final_steps, final_fp32: [module patterns]}."""
    if not isinstance(v, dict):
        return _choice(*_PRECISIONS)(v, path)
    unknown = set(v) - {"dtype", "fp32_warmup_steps", "keep_fp32", "fp32_final_steps", "final_fp32"}
    if unknown or "dtype" not in v:
        raise JobError(path, v, "must be fp32, bf16 or fp16, or {dtype: bf16 | fp16, fp32_warmup_steps: N, "
                                "keep_fp32: [module patterns], fp32_final_steps: N, final_fp32: [module patterns]}"
                       + (f" (unknown key {sorted(unknown)[0]!r})" if unknown else " (dtype is required)"))
    lists = {}
    for key in ("keep_fp32", "final_fp32"):
        patterns = v.get(key) or []
        if not isinstance(patterns, list) or not all(isinstance(k, str) and k.strip() for k in patterns):
            raise JobError(f"{path}.{key}", patterns, "must be a list of module-name patterns, e.g. ['head', '*.ln*']")
        lists[key] = list(patterns)
    final = _int(0)(v.get("fp32_final_steps", 0), f"{path}.fp32_final_steps")
    if lists["final_fp32"] and not final:
        raise JobError(f"{path}.final_fp32", lists["final_fp32"], "applies to the last fp32_final_steps steps: give "
                                                                   "fp32_final_steps: N with it")
    return {"dtype": _choice("bf16", "fp16")(v["dtype"], f"{path}.dtype"),
            "fp32_warmup_steps": _int(0)(v.get("fp32_warmup_steps", 0), f"{path}.fp32_warmup_steps"),
            "keep_fp32": lists["keep_fp32"], "fp32_final_steps": final, "final_fp32": lists["final_fp32"]}


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


@_schema(_nullable(_number("integer", 1)))
def _min_workers(v, path):
    return None if v is None else _int(1)(v, path)


@_schema(_nullable({"type": "string", "enum": ["elastic", "shrink", "wait"]}))
def _on_node_loss(v, path):
    return None if v is None else _choice("elastic", "shrink", "wait")(v, path)


@_schema(_nullable({"type": "object", "additionalProperties": False,
                    "properties": {"every": _number("integer", 1), "explode_ratio": _number("number", 1.0)}}))
def _grad_check(v, path):
    """null (off) or {every: N >= 1, explode_ratio: R > 1}; normalised with the defaults (1, 100)."""
    if v is None:
        return None
    if not isinstance(v, dict) or set(v) - {"every", "explode_ratio"}:
        raise JobError(path, v, "must be null or {every: N, explode_ratio: R}, e.g. {every: 10, explode_ratio: 100}")
    ratio = _float(0.0)(v.get("explode_ratio", 100.0), f"{path}.explode_ratio")
    if ratio <= 1:
        raise JobError(f"{path}.explode_ratio", ratio, "must be more than 1: a norm that many times its own median "
                                                        "is an anomaly")
    return {"every": _int(1)(v.get("every", 1), f"{path}.every"), "explode_ratio": ratio}


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
    gearshift.workers.build.components' `registry`, which the schema offers as its list (imported only when
    the schema is made: the registries import torch)."""

    def names():
        from gearshift.workers.build import components

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


@_schema({"anyOf": [{"type": "boolean"}, {"type": "array", "items": {"type": "string", "minLength": 1}}]})
def _checkpointing(v, path):
    if isinstance(v, bool):
        return v
    if not isinstance(v, list) or not v or not all(isinstance(p, str) and p for p in v):
        raise JobError(path, v, "must be true, false, or a list of module-name patterns or class names, "
                                "e.g. ['model.layers.*'] or ['LlamaDecoderLayer']")
    return list(v)


@_schema({"type": ["array", "null"], "items": {"type": "string", "minLength": 1}})
def _fsdp_units(v, path):
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(p, str) and p for p in v):
        raise JobError(path, v, "must be a list of module-name patterns or class names, e.g. ['model.layers.*'] "
                                "or ['LlamaDecoderLayer']")
    return list(v)


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
BUILTIN_STRATEGIES = ("data", "tensor", "hybrid", "fsdp", "hsdp", "pipeline")


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
                   "tp_size": _tp_size.schema, "shard_size": _tp_size.schema, "dp_shard": {"type": "boolean"},
                   "pp_size": _tp_size.schema}}})
def _schedule(v, path):
    if v is None:
        return []
    if not isinstance(v, list):
        raise JobError(path, v, "must be a list of {step: N, strategy: S, tp_size: K, shard_size: G, dp_shard: B, pp_size: P}")
    out, last = [], 0
    for i, entry in enumerate(v):
        where = f"{path}[{i}]"
        if not isinstance(entry, dict) or set(entry) - {"step", "strategy", "tp_size", "shard_size", "dp_shard", "pp_size"} \
                or not {"step", "strategy"} <= set(entry):
            raise JobError(where, entry, "must be {step: N, strategy: S} with tp_size for hybrid, shard_size for "
                                         "hsdp, dp_shard: true for a sharded hybrid and pp_size for pipeline")
        step = _int(1)(entry["step"], f"{where}.step")
        if step <= last:
            raise JobError(f"{where}.step", step, f"must be later than the entry before it (step {last})")
        last = step
        strategy = _strategy(allow_auto=False)(entry["strategy"], f"{where}.strategy")
        out.append({"step": step, "strategy": strategy, "tp_size": _tp_size(entry.get("tp_size"), f"{where}.tp_size"),
                    "shard_size": _tp_size(entry.get("shard_size"), f"{where}.shard_size"),
                    "dp_shard": _bool(entry.get("dp_shard", False), f"{where}.dp_shard"),
                    "pp_size": _tp_size(entry.get("pp_size"), f"{where}.pp_size")})
    return out


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


@_schema(_nullable({"type": "object", "required": ["ranks", "factor"], "additionalProperties": False,
                    "properties": {"ranks": {"type": "array", "items": _number("integer", 0), "minItems": 1},
                                   "factor": _number("number", 1.0),
                                   "from_step": {**_number("integer", 0), "default": 0},
                                   "to_step": {**_nullable(_number("integer", 1)), "default": None}}}))
def _slow(v, path):
    """inject.slow: {ranks: [R, ...], factor: F, from_step: A, to_step: B}: those ranks compute F times
    as long over steps [A, B) (B null: to the end)."""
    if v is None:
        return None
    keys = {"ranks", "factor", "from_step", "to_step"}
    if not isinstance(v, dict) or set(v) - keys or not {"ranks", "factor"} <= set(v):
        raise JobError(path, v, "must be {ranks: [R, ...], factor: F, from_step: A, to_step: B} (the steps "
                                "optional) or null")
    ranks = v["ranks"]
    if not isinstance(ranks, list) or not ranks or any(isinstance(r, bool) or not isinstance(r, int) or r < 0
                                                       for r in ranks):
        raise JobError(f"{path}.ranks", ranks, "must be a non-empty list of worker ranks (integers >= 0)")
    first = _int(0)(v.get("from_step", 0), f"{path}.from_step")
    last = v.get("to_step")
    if last is not None and _int(1)(last, f"{path}.to_step") <= first:
        raise JobError(f"{path}.to_step", last, f"must be after from_step ({first}), or null")
    return {"ranks": sorted(set(ranks)), "factor": _float(1.0)(v["factor"], f"{path}.factor"),
            "from_step": first, "to_step": last}


@_schema(_number("integer", -1))
def _max_failures(v, path):
    if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise JobError(path, v, "must be an integer >= 0, or -1 for no limit")
    return v


@_schema(_nullable(_number("integer", 1)))
def _eval_batches(v, path):
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise JobError(path, v, "must be an integer >= 1 (evaluate the first that many batches of eval.data), "
                                "or null (all of it)")
    return v


_PRETRAINED_HASH = ("header", "full")


@_schema({"anyOf": [{"type": "null"}, {"type": "string", "minLength": 1},
                    {"type": "object", "required": ["path"], "additionalProperties": False,
                     "properties": {"path": {"type": "string", "minLength": 1}, "prefix": {"type": "string"},
                                    "hash": {"enum": list(_PRETRAINED_HASH)}}}]})
def _pretrained(v, path):
    """model.pretrained: a folder, or {path, prefix, hash}; normalised to {path, prefix, hash}
    (None: none). hash: what source.json records of each file, its safetensors header (and size)
    and, `full`, the sha256 of every slice too (hashed by the workers as they load)."""
    if v is None:
        return None
    if isinstance(v, str):
        v = {"path": v}
    if not isinstance(v, dict) or set(v) - {"path", "prefix", "hash"} or not isinstance(v.get("path"), str) \
            or not v["path"].strip() or not isinstance(v.get("prefix", ""), str):
        raise JobError(path, v, "must be a folder of safetensors weights (a Hugging Face save_pretrained folder or a "
                                "gearshift export), or {path: FOLDER, prefix: STR, hash: header | full} where prefix "
                                "is what the model's names carry in front of the file's, e.g. 'lm.'")
    if v.get("hash", "header") not in _PRETRAINED_HASH:
        raise JobError(f"{path}.hash", v["hash"], "must be header (each file told apart by its size and safetensors "
                                                  "header) or full (also the sha256 of every byte, by slices, hashed by the workers)")
    return {"path": v["path"], "prefix": v.get("prefix", ""), "hash": v.get("hash", "header")}


_ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# set by Ray for the GPUs it assigns (and shared within a node by gearshift): a job's own value
# would hand a worker GPUs that are not its
_ENV_RESERVED = ("CUDA_VISIBLE_DEVICES",)


@_schema({"type": ["object", "null"], "propertyNames": {"pattern": _ENV_NAME, "not": {"enum": list(_ENV_RESERVED)}},
          "additionalProperties": {"type": ["string", "number"]}})
def _env(v, path):
    """{NAME: value} set in every worker's environment; values become strings (1 -> "1")."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise JobError(path, v, "must be a mapping of environment variable names to values, e.g. "
                                "{NCCL_DEBUG: INFO, NCCL_IB_DISABLE: 1}")
    out = {}
    for name, value in v.items():
        if not isinstance(name, str) or not re.fullmatch(_ENV_NAME, name):
            raise JobError(f"{path}.{name}", value, "is not an environment variable name: a name is letters, digits "
                                                    "and '_', not starting with a digit (e.g. NCCL_DEBUG)")
        if name in _ENV_RESERVED:
            raise JobError(f"{path}.{name}", value, "is set by Ray for the GPUs it assigns to each worker, not by the "
                                                    "job", "gearshift lets the workers of a node see each other's GPUs "
                                                           "itself.")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)) or \
                (isinstance(value, float) and not math.isfinite(value)):
            raise JobError(f"{path}.{name}", value, "must be a string or a number (quote anything else: 'true', "
                                                    "'a,b')")
        out[name] = value if isinstance(value, str) else str(value)
    return out
