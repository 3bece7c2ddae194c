"""Which of a job's fields carry credentials, and their masked form.

A credential is a string under `checkpoint.storage_options` or `cluster.env`, or under any key
named like *key*, *secret*, *token* or *password* (any case, at any depth: `model.kwargs.hf_token`,
`storage_options.client_kwargs.aws_secret_access_key`), and the password of a URL written
`scheme://user:password@host`. Numbers, booleans and nulls are never credentials (`anon: true`,
`key_dim: 64` stay as they are). Imports nothing of gearshift's: fields.py's JobError masks what
it shows with it. A free text (an error a library or a worker raised) is scrubbed with `scrub`:
every URL's password masked, and the run's secrets (`secret_values` of the resolved job, which
secrets.run_secrets completes) wherever they appear.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote, unquote

MASK = "***"
_SECTIONS = (("checkpoint", "storage_options"), ("cluster", "env"))
_NAMED = re.compile(r"key|secret|token|password", re.IGNORECASE)
# a tokenizer's name says which vocabulary, not who may read what
_NOT_NAMED = re.compile(r"tokeniz", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:]*):([^/?#@]+)@")
_URL_IN_TEXT = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^/?#@:\s'\"]*):([^/?#@\s'\"]+)@")


def is_credential(path: tuple) -> bool:
    """Whether a string at `path` (the job's keys, list positions as ints) is a credential."""
    if any(path[:2] == section and len(path) > 2 for section in _SECTIONS):
        return True
    return any(isinstance(part, str) and _NAMED.search(part) and not _NOT_NAMED.search(part) for part in path)


def parse_path(dotted: str) -> tuple:
    """A JobError's field ("cluster.env.HF_TOKEN", "--set checkpoint.storage_options") as a path."""
    text = dotted.removeprefix("--set ").strip()
    return tuple(re.sub(r"\[\d+\]", "", part) for part in text.split("."))


def scrub(text: str, values: tuple[str, ...] = ()) -> str:
    """`text` (an error a library or a worker raised) with the password of every URL in it masked
    (one written as a `${VAR}` reference stays: it is the reference, not the value), then every
    one of `values` (a run's secrets, secret_values; longest first, so that one holding another
    goes whole)."""
    if "@" in text:
        text = _URL_IN_TEXT.sub(lambda m: m.group(0) if m.group(2).startswith("${") else f"{m.group(1)}:{MASK}@",
                                text)
    for value in values:
        if value in text:
            text = text.replace(value, MASK)
    return text


# A secret shorter than this is not looked for in a text: every cluster.env value counts as a
# credential, and masking its `1` or `0` would mask every such digit of the text, which no secret
# that short needs
MIN_SECRET_CHARS = 4


def secret_values(value: Any, path: tuple = ()) -> set[str]:
    """What a text must not show of the (resolved) job `value` at `path`: every credential's
    value and every URL's password, percent-encoded too (an fsspec URL carries it so)."""
    if isinstance(value, dict):
        return set().union(*(secret_values(v, path + (k,)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return set().union(*(secret_values(v, path + (i,)) for i, v in enumerate(value)))
    if not isinstance(value, str):
        return set()
    found = {m.group(2) for m in _URL_IN_TEXT.finditer(value) if not m.group(2).startswith("${")}
    if is_credential(path):
        found.add(value)
    return secret_forms(found)


def secret_forms(values) -> set[str]:
    """`values` as a text may show them (as they are, percent-encoded and -decoded: a URL holds a
    password encoded, a library may say it either way), the short ones left out."""
    return {form for v in values for form in (v, quote(v, safe=""), unquote(v)) if len(form) >= MIN_SECRET_CHARS}


def has_url_password(text: str) -> bool:
    return bool(_URL_PASSWORD.match(text))


def mask_url(text: str) -> str:
    """`https://user:pw@host/...` -> `https://user:***@host/...`; a password written as a
    `${VAR}` reference stays (it is the reference, not the value)."""
    found = _URL_PASSWORD.match(text)
    if not found or found.group(2) == MASK or found.group(2).startswith("${"):
        return text
    return f"{found.group(1)}:{MASK}@" + text[found.end():]


def mask(value: Any, path: tuple = (), keep: frozenset = frozenset()) -> Any:
    """A copy of `value` (at `path` in the job) with every credential string as MASK and every
    URL's password masked; strings at the paths in `keep` (references) are left as they are."""
    if isinstance(value, dict):
        return {k: mask(v, path + (k,), keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask(v, path + (i,), keep) for i, v in enumerate(value)]
    if not isinstance(value, str) or path in keep:
        return value
    return MASK if is_credential(path) else mask_url(value)


def is_masked(value: Any) -> bool:
    """A string that holds a mask where a credential was (a whole value, or a URL's password)."""
    if not isinstance(value, str):
        return False
    found = _URL_PASSWORD.match(value)
    return value == MASK or bool(found and found.group(2) == MASK)


def without(value: Any, path: tuple = ()) -> Any:
    """A copy of `value` with the credentials left out (what the fingerprint is made of): a
    rotated key is the same experiment."""
    if isinstance(value, dict):
        return {k: without(v, path + (k,)) for k, v in value.items()
                if not (isinstance(v, str) and is_credential(path + (k,)))}
    if isinstance(value, (list, tuple)):
        return [without(v, path + (i,)) for i, v in enumerate(value)]
    if isinstance(value, str):  # in a list, or the whole job: masked in place
        return MASK if is_credential(path) else mask_url(value)
    return value
