"""`${VAR}` in a job file: read from the environment where the job is loaded, never written.

`expand(raw)` replaces every `${NAME}` and `${NAME:-default}` in the string values of a raw job
mapping with the environment's value (the default when NAME is unset or empty; `$${` is a literal
`${`), and returns the resolved mapping with the references it read, by path. The job keeps
those references (`Job.refs`) beside its resolved values, so that what is written (job.yaml,
MLflow, `gearshift check`) is `written(...)`: each reference as it was typed, a credential typed
as it is masked (credentials.py), never a value read from the environment. A run's job.yaml
therefore loads again wherever the same variables are set (`replay`, `--resume`), and a mask
where a typed credential was is a JobError saying how to give it again.

The same goes for a submitted job's overrides, which travel as typed on the Ray job's command line
(`refuse_in_clear`: a credential there only as a reference, read on the head). And the values
read stay in the driver: `Scrubber` masks the run's secrets (`run_secrets`) in whatever a worker
sends before the driver writes, prints or raises it (orchestrator/cluster/scrubbed.py).
"""

from __future__ import annotations

import copy
import os
import re
from typing import Any, Mapping

from gearshift.orchestrator.errors import WorkerFailed
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


# ------------------------------------------------------------------ a submitted job's overrides


def typed_in_clear(pairs: list[tuple[list[str], Any]]) -> list[str]:
    """The fields among overrides (key parts, value) that hold a credential as it is, not as a
    `${VAR}` reference: whatever would be masked where the job is written (a credential without a
    reference, a default typed into a credential's reference, a URL's password)."""
    found: list[str] = []

    def walk(value, path):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(v, path + (k,))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                walk(v, path + (i,))
        elif isinstance(value, str):
            shown = (_written_reference(path, value) if _REFERENCE.search(value)
                     else credentials.mask(value, path))
            if shown != value or credentials.scrub(value) != value:
                found.append(dotted(path))

    for parts, value in pairs:
        walk(value, tuple(parts))
    return found


def refuse_in_clear(pairs: list[tuple[list[str], Any]]) -> None:
    """A JobError naming the first override that carries a credential in clear (its value never
    shown): a submitted job's overrides are its Ray job's command line, which `ray job list`, the
    dashboard and the head's process table show to anyone who can see the cluster."""
    fields = typed_in_clear(pairs)
    if fields:
        others = f" (and {', '.join(fields[1:])})" if len(fields) > 1 else ""
        raise JobError(fields[0], credentials.MASK, f"is a credential given in clear{others}: submit puts "
                       "overrides on the Ray job's command line, which `ray job list` and the dashboard show, so "
                       "its value is hidden here and refused", f"Give it as a reference: --set "
                       f"'{fields[0]}=${{VAR}}' (quoted, so the shell leaves it), with VAR set where the job runs "
                       "(the head) and here, where it is checked.")


# ------------------------------------------------------------------ what a worker says


def run_secrets(resolved: dict, refs: Mapping[tuple, str], environ: Mapping[str, str] | None = None) -> tuple:
    """What no text a worker sends may show, longest first: every credential's value and every
    URL's password in the resolved job (credentials.secret_values), and the value read for a
    reference to a variable named like a credential wherever it is (`auth: ${HF_TOKEN}`)."""
    environ = os.environ if environ is None else environ
    found = credentials.secret_values(resolved)
    for path, text in refs.items():
        value = _at(resolved, path)
        for ref in _REFERENCE.finditer(text) if isinstance(value, str) else ():
            if not credentials.is_credential((ref.group(1),)):
                continue
            read = environ.get(ref.group(1)) or ""
            # what was read where the job loaded: the environment may have changed since
            found |= credentials.secret_forms([read] if read and read in value else
                                              [value] if ref.group(0) == text else [])
    return tuple(sorted(found, key=len, reverse=True))


def _at(tree: Any, path: tuple) -> Any:
    for part in path:
        try:
            tree = tree[part]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


class Scrubber:
    """The run's secrets (run_secrets) masked out of whatever a worker sends the driver, before
    the driver writes, prints or raises any of it: texts, the strings inside results and reports,
    and errors (in place, so that whoever holds one holds it scrubbed)."""

    def __init__(self, values: tuple = ()):
        self.values = tuple(sorted(values, key=len, reverse=True))  # one holding another goes whole

    def text(self, text: str) -> str:
        out = credentials.scrub(text, self.values)
        return text if out == text else out  # the same object where nothing changed (value() tells so)

    def value(self, value: Any) -> Any:
        """`value` with every string in it scrubbed (mapping keys are names, kept); the same object
        where nothing changed, so that what the driver hands back keeps its identity."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            out = {k: self.value(v) for k, v in value.items()}
            return out if any(out[k] is not v for k, v in value.items()) else value
        if type(value) in (list, tuple):
            items = [self.value(v) for v in value]
            return type(value)(items) if any(a is not b for a, b in zip(items, value)) else value
        return value

    def error(self, err: BaseException) -> BaseException:
        """`err` and the exceptions chained to it, scrubbed in place (a WorkerFailed's reason,
        traceback and cause too); `err`, for `raise`."""
        seen: set[int] = set()
        todo = [err]
        while todo:
            e = todo.pop()
            if e is None or id(e) in seen:
                continue
            seen.add(id(e))
            if isinstance(e, WorkerFailed):
                e.scrub(self.text)
            e.args = tuple(self.text(a) if isinstance(a, str) else a for a in e.args)
            for name in ("strerror", "filename", "filename2"):  # what an OSError says is not its args
                if isinstance(getattr(e, name, None), str):
                    setattr(e, name, self.text(getattr(e, name)))
            todo += [e.__cause__, e.__context__]
        return err
