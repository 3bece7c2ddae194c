"""`${VAR}` in a job file: read from the environment where the job is loaded, never written.

`expand(raw)` replaces every `${NAME}` and `${NAME:-default}` in the string values of a raw job
mapping with the environment's value (the default when NAME is unset or empty; `$${` is a literal
`${`), and returns the resolved mapping with the references it read, by path. The job keeps
those references (`Job.refs`) beside its resolved values, so that what is written (job.yaml,
MLflow, `gearshift check`) is `written(...)`: each reference as it was typed, a credential typed
as it is masked (credentials.py), never a value read from the environment. A run's job.yaml
therefore loads again wherever the same variables are set (`replay`, `--resume`), and a mask
where a typed credential was is a JobError saying how to give it again.
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any, Mapping

from gearshift.orchestrator.job import credentials
from gearshift.orchestrator.job.fields import JobError

# ${NAME} or ${NAME:-default}; the default runs to the first "}"
_REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_ESCAPE = "$${"
_FORMS = "${NAME} or ${NAME:-default} (NAME: letters, digits and '_'), or $${ for a literal ${"


def dotted(path: tuple) -> str:
    return ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in path).replace(".[", "[")


def _expand_one(text: str, path: tuple, environ: Mapping[str, str], unset: list) -> str:
    out, i = [], 0
    while True:
        start = text.find("$", i)
        if start < 0:
            return "".join(out) + text[i:]
        out.append(text[i:start])
        if text.startswith(_ESCAPE, start):
            out.append("${")
            i = start + len(_ESCAPE)
            continue
        found = _REFERENCE.match(text, start)
        if found is None:
            if text.startswith("${", start):  # a reference gone wrong, not a value with a "$" in it
                raise JobError(dotted(path), text, f"has a malformed reference: write {_FORMS}")
            out.append("$")
            i = start + 1
            continue
        name, default = found.group(1), found.group(2)
        value = environ.get(name) or None
        if value is None and default is None:
            unset.append((path, name))
            value = ""
        out.append(value if value is not None else default)
        i = found.end()


def expand(raw: Any, environ: Mapping[str, str] | None = None) -> tuple[Any, dict]:
    """(raw with its references read from `environ` (default os.environ), {path: the string as
    typed}). Raises one JobError naming every field whose variable is unset without a default,
    and every credential that holds only a mask (a run's job.yaml, where it was typed)."""
    environ = os.environ if environ is None else environ
    refs: dict[tuple, str] = {}
    unset: list[tuple[tuple, str]] = []
    masked: list[tuple] = []

    def walk(value, path):
        if isinstance(value, dict):
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, path + (i,)) for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value
        out = _expand_one(value, path, environ, unset) if "$" in value else value
        # a credential is kept as typed only where it names a variable: "pa$$word" is a password
        if _REFERENCE.search(value) or (_ESCAPE in value and not credentials.is_credential(path)):
            refs[path] = value
        if (credentials.is_credential(path) or credentials.has_url_password(out)) and credentials.is_masked(out):
            masked.append(path)
        return out

    resolved = walk(raw, ())
    if unset:
        raise _unset_error(unset)
    if masked:
        raise _masked_error(masked)
    return resolved, refs


def _unset_error(unset: list) -> JobError:
    (path, name), rest = unset[0], unset[1:]
    also = "; also unset: " + ", ".join(f"${{{n}}} in {dotted(p)}" for p, n in rest) if rest else ""
    return JobError(dotted(path), f"${{{name}}}", f"reads the environment variable {name}, which is not set here"
                    f"{also}", f"Set it (export {name}=...) before gearshift starts, or give a default: "
                    f"${{{name}:-value}}.")


def _masked_error(masked: list) -> JobError:
    fields = [dotted(p) for p in masked]
    others = f" (and {', '.join(fields[1:])})" if len(fields) > 1 else ""
    return JobError(fields[0], credentials.MASK, f"is a credential that was typed into the job file{others}, so "
                    "the run's job.yaml keeps only a mask", f"Give it again: --set '{fields[0]}=${{VAR}}' with VAR "
                    "set in the environment, or write it as ${VAR} in the job file so that replay and --resume "
                    "read it again.")


def _written_reference(path: tuple, text: str) -> str:
    """A reference as written: in a credential, a default is a typed credential, so masked."""
    if not credentials.is_credential(path):
        return credentials.mask_url(text)
    return _REFERENCE.sub(lambda m: f"${{{m.group(1)}:-{credentials.MASK}}}" if m.group(2) else m.group(0), text)


def _place(tree: Any, path: tuple, value: Any) -> bool:
    """Put `value` at `path` in `tree` where that path still exists; False where it does not."""
    node = tree
    for part in path[:-1]:
        if isinstance(node, dict) and part in node or isinstance(node, list) and isinstance(part, int) \
                and part < len(node):
            node = node[part]
        else:
            return False
    last = path[-1]
    if isinstance(node, dict) or (isinstance(node, list) and isinstance(last, int) and last < len(node)):
        node[last] = value
        return True
    return False


def written(resolved: dict, refs: Mapping[tuple, str]) -> dict:
    """The job as it may be written: `resolved` (Job.to_dict()) with each reference back as typed
    and every other credential masked. A shorthand typed as a reference (`model: ${MODEL}`) goes
    back as the shorthand, over the mapping it became. A reference a checker moved elsewhere is
    not found: its field is written resolved, and masked if it is a credential."""
    out = copy.deepcopy(resolved)
    kept = {path for path, text in refs.items() if _place(out, path, _written_reference(path, text))}
    return credentials.mask(out, (), frozenset(kept))


def source(resolved: dict, refs: Mapping[tuple, str]) -> dict:
    """The job as typed (references back, typed credentials as they are): what a Job is rebuilt
    from with overrides, so that its references are read again. In memory only, never written."""
    out = copy.deepcopy(resolved)
    for path, text in refs.items():
        _place(out, path, text)
    return out
