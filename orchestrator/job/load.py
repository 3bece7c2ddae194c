"""The job file: YAML in, frozen dataclasses out, or a JobError that names the field.

`load_job(path, overrides)` is the only way a job enters gearshift. It reads the YAML, applies
`--set a.b=value` overrides, checks every key and value, and returns a `Job`. Nothing else in
gearshift re-validates a Job, so everything that can be wrong with a file is caught here,
before Ray or any worker starts.
"""


from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Any, Mapping
import yaml

from gearshift.orchestrator.job import secrets
from gearshift.orchestrator.job.fields import JobError, _show
from gearshift.orchestrator.job.spec import DataSpec, Job, LossSpec, ModelSpec, _build, _fields, _shorthand
from gearshift.orchestrator.job.checks import check_job


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


def override_pairs(overrides: list[str] | Mapping[str, Any] | None) -> list[tuple[list[str], Any]]:
    """Overrides as (key parts, value): `--set` strings (values parsed as YAML), or a mapping of
    dotted keys to values as they are ({"train.steps": 4}, from the Python API)."""
    if not overrides:
        return []
    if not isinstance(overrides, Mapping):
        return parse_overrides(list(overrides))
    pairs = []
    for key, value in overrides.items():
        parts = str(key).strip().split(".")
        if not isinstance(key, str) or not all(p.strip() for p in parts):
            raise JobError("overrides", key, "keys must be dotted job fields, for example \"train.steps\"")
        pairs.append(([p.strip() for p in parts], value))
    return pairs


def apply_overrides(raw: dict, overrides: list[str] | Mapping[str, Any] | None) -> dict:
    raw = json.loads(json.dumps(raw, default=str)) if raw else {}
    for parts, value in override_pairs(overrides):
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
    resolved, refs = secrets.expand(raw)  # before any check: a check sees the values the run uses
    job = _build(Job, resolved, "")
    job = dataclasses.replace(job, base_dir=str(pathlib.Path(base_dir).resolve()), refs=tuple(refs.items()))
    check_job(job)
    return job


def load_job(path: str | pathlib.Path, overrides: list[str] | Mapping[str, Any] | None = None) -> Job:
    """Read, override, validate. Raises JobError naming the file and the field."""
    path = pathlib.Path(path)
    try:
        raw = apply_overrides(read_yaml(path), overrides)
        default_name = re.sub(r"[^A-Za-z0-9._-]", "-", path.stem).lstrip("._-")[:64] or "job"
        return job_from_dict(raw, path.parent, default_name=default_name)
    except JobError as err:
        if not err.source:
            err.source = str(path)
            err.args = (err.message(),)
        raise


def dump_job(job: Job) -> str:
    """The job as job.yaml holds it: references as typed, credentials masked (Job.written)."""
    return yaml.safe_dump(job.written(), sort_keys=False)
