"""What a run was made with, beyond its job: `source.json` in the run dir.

gearshift's version and git commit (with a hash of any uncommitted change), the versions of
Python, torch, Ray and NumPy, the job's folder, and a hash of each module file the job's
`module:function` entry points name in that folder. `gearshift replay` compares it with what is
installed now and warns, one line per difference, before it runs the job again.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import platform
import re
import subprocess

_PACKAGES = ("torch", "ray", "numpy")
# "module:function" or "package.module:name", as job.py's entry points are written
_ENTRYPOINT = re.compile(r"^([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*):[A-Za-z_]\w*$")
_CHECKOUT = pathlib.Path(__file__).resolve().parents[1]


def collect(job_dict: dict, base_dir: str) -> dict:
    """The record for a run of the job `job_dict` (as job.yaml holds it) whose entry points are
    looked up in `base_dir`, made now. Local only: no network; git only when gearshift runs from
    a checkout."""
    return {"gearshift": {"version": _version("gearshift"), **_git(_CHECKOUT)},
            "python": platform.python_version(),
            "packages": {name: _version(name) for name in _PACKAGES},
            "base_dir": base_dir,
            "modules": user_modules(job_dict, base_dir),
            **({"pretrained": pretrained_weights(job_dict, base_dir)} if (job_dict.get("model") or {}).get("pretrained")
               else {})}


def pretrained_weights(job_dict: dict, base_dir: str) -> dict:
    """model.pretrained's folder and what identifies each weight file in it: its size and its
    header's sha256 (the driver reads no tensor data; under `model.pretrained.hash: full` the
    workers hash every byte by slices as they load, and `add_slices` records it)."""
    from gearshift.workers.build import pretrained

    spec = job_dict["model"]["pretrained"]
    folder = pathlib.Path(base_dir).joinpath(pathlib.Path(spec["path"]).expanduser())
    try:
        folder = pretrained.snapshot(folder)
        files = pretrained.identity(folder)
    except pretrained.PretrainedError as err:
        return {"path": str(folder), "prefix": spec.get("prefix", ""), "error": str(err)}
    return {"path": str(folder), "prefix": spec.get("prefix", ""), "files": files}


def add_slices(path: pathlib.Path, loaded: list[dict]) -> None:
    """Record in source.json (at `path`) the sha256 of every slice of the weight files, as the
    workers hashed them while they loaded (`loaded`: each rank's `load_pretrained` answer):
    `sha256_slices` per file, slices of `slice_bytes`."""
    from gearshift.workers.build import pretrained
    from gearshift.workers.state.checkpoint import write_file_atomic

    source = read(path) or {}
    weights = source.get("pretrained") or {}
    digests = {int(i): d for got in loaded for i, d in (got.get("slices") or {}).items()}
    if "files" not in weights:
        return
    for name, sliced in pretrained.by_file(weights["path"], digests).items():
        weights["files"].setdefault(name, {}).update(sha256_slices=sliced, slice_bytes=pretrained.SLICE_BYTES)
    write_file_atomic(path, json.dumps(source, indent=2).encode())


def write(path: pathlib.Path, job) -> None:
    from gearshift.workers.state.checkpoint import write_file_atomic

    write_file_atomic(path, json.dumps(collect(job.to_dict(), job.base_dir), indent=2).encode())


def read(path: pathlib.Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def user_modules(job_dict: dict, base_dir: str) -> dict[str, dict]:
    """{module: {path, sha256}} for each entry-point module that is a file in the job's folder
    (a module installed elsewhere is versioned by its package, not here)."""
    out = {}
    for value in _strings(job_dict):
        m = _ENTRYPOINT.match(value)
        if not m or m.group(1) in out:
            continue
        file = _module_file(pathlib.Path(base_dir), m.group(1))
        if file is not None:
            out[m.group(1)] = {"path": str(file), "sha256": _sha256(file)}
    return out


def differences(recorded: dict, current: dict) -> list[str]:
    """One line per way in which `current` differs from `recorded`."""
    lines = []
    was, now = recorded.get("gearshift", {}), current.get("gearshift", {})
    for key, what in (("version", "gearshift version"), ("commit", "gearshift git commit"),
                      ("uncommitted", "gearshift's uncommitted changes (hash)")):
        if was.get(key) != now.get(key):
            lines.append(f"{what}: {_short(was.get(key))} then, {_short(now.get(key))} now")
    if recorded.get("python") != current.get("python"):
        lines.append(f"python: {recorded.get('python')} then, {current.get('python')} now")
    for name in sorted(set(recorded.get("packages", {})) | set(current.get("packages", {}))):
        a, b = recorded.get("packages", {}).get(name), current.get("packages", {}).get(name)
        if a != b:
            lines.append(f"{name}: {a or 'not installed'} then, {b or 'not installed'} now")
    lines += _module_differences(recorded.get("modules", {}), current.get("modules", {}))
    was, now = (recorded.get("pretrained") or {}).get("files"), (current.get("pretrained") or {}).get("files")
    if was is not None and was != now:
        legacy = all(isinstance(v, str) for v in was.values())  # an older run's: weight files only, by sha256
        names = set(was) if legacy else set(was) | set(now or {})
        changed = sorted(n for n in names if not _same_file(was.get(n), (now or {}).get(n)))
        if changed or now is None:
            lines.append(f"pretrained weights in {current.get('pretrained', {}).get('path')}: "
                         f"{', '.join(changed[:4]) or 'unreadable'} differ from the run's (size, header or sha256)")
    return lines


def _same_file(a, b) -> bool:
    """Whether two records of a weight file agree on what both say: a full hash taken once and not
    the other time is no difference (nor is an older run's record, the sha256 alone, against a
    header's: nothing to compare)."""
    a, b = ({"sha256": x} if isinstance(x, str) else x for x in (a, b))
    if a is None or b is None:
        return a is b
    return all(a[k] == b[k] for k in set(a) & set(b))


def _module_differences(was: dict, now: dict) -> list[str]:
    lines = []
    for name in sorted(set(was) | set(now)):
        a, b = was.get(name), now.get(name)
        if b is None:
            lines.append(f"module {name}: {a['path']} is gone")
        elif a is None:
            lines.append(f"module {name}: {b['path']} was not recorded with the run")
        elif a["sha256"] != b["sha256"]:
            lines.append(f"module {name}: {b['path']} has changed since the run (sha256 "
                         f"{a['sha256'][:12]} then, {b['sha256'][:12]} now)")
    return lines


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def _module_file(base: pathlib.Path, module: str) -> pathlib.Path | None:
    stem = base.joinpath(*module.split("."))
    for file in (stem.with_suffix(".py"), stem / "__init__.py"):
        if file.is_file():
            return file
    return None


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(root: pathlib.Path) -> dict:
    """The commit of the gearshift checkout and a hash of its uncommitted changes to tracked
    files (None when clean); {} when gearshift is not run from a git checkout."""
    if not (root / ".git").exists():
        return {}
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                                text=True, timeout=10, check=True).stdout.strip()
        diff = subprocess.run(["git", "-C", str(root), "diff", "HEAD", "--no-color", "--no-ext-diff"],
                              capture_output=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": commit, "uncommitted": hashlib.sha256(diff).hexdigest() if diff else None}


def _short(value) -> str:
    if value is None:
        return "none"
    return value[:12] if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{40,64}", value) else str(value)
