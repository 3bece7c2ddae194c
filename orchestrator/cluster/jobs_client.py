"""The connection to a head's Job Submission API: its address (argument, else the environment),
the token a head with token auth wants, and every failure a user can cause (nothing listening,
wrong port, bad token, unknown job id) as one JobsApiError that says what to check."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from typing import Iterator, Mapping, Sequence
from urllib.parse import urlsplit
import aiohttp  # a dependency of ray[default]; tail_job_logs speaks websocket through it
import requests
from ray.job_submission import JobSubmissionClient



# (connect, read) seconds for every HTTP request. Read is generous because the head
# answers a package upload only after storing it; connect is short because a head that
# does not accept a connection within seconds is not going to.
HTTP_TIMEOUT_S: tuple[float, float] = (5.0, 60.0)


# Environment variables consulted, in order, when no address is given. RAY_JOB_ADDRESS is
# gearshift's own; RAY_API_SERVER_ADDRESS is what `ray job` reads; RAY_ADDRESS is shared
# with ray.init() and often holds "auto" or a ray:// address, which is skipped.
ADDRESS_ENV_VARS = ("RAY_JOB_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


# JobSubmissionClient's constructor replaces the address it is given with these.
_RAY_ADDRESS_OVERRIDES = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


_HOST_PORT = re.compile(r"^(?P<host>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-_]*):(?P<port>\d{1,5})$")


_DASHBOARD_HINT = (
    "Check that it is the Ray dashboard on the head node (port 8265 by default, not the "
    "GCS port 6379), that the dashboard runs there (`ray start --head --dashboard-host "
    "0.0.0.0`, then `ray status` on the head), and that the port is reachable from here "
    "(for a cluster started with `ray up cluster.yaml`, `ray dashboard cluster.yaml` "
    "forwards it to http://localhost:8265)."
)


class JobsApiError(Exception):
    """A failure the user can act on; str(error) is the whole explanation."""


def resolve_address(address: str | None = None, environ: Mapping[str, str] | None = None) -> str:
    """Return the job API's base URL, e.g. ``http://10.0.0.5:8265``.

    An explicit ``address`` (or RAY_JOB_ADDRESS) must be an http(s) URL or ``host:port``;
    in RAY_API_SERVER_ADDRESS / RAY_ADDRESS, values that are neither (``auto``,
    ``ray://...``) are skipped rather than rejected: ray.init() gives them a meaning.
    """
    if address is not None:
        url = _as_url(address)
        if url is None:
            raise JobsApiError(
                f"address {address!r} is not one gearshift can use: give the Ray dashboard's "
                "HTTP address, as http://HOST:PORT, https://HOST[:PORT][/PATH] or HOST:PORT "
                "(e.g. http://10.0.0.5:8265)."
            )
        return url
    environ = os.environ if environ is None else environ
    skipped = []
    for name in ADDRESS_ENV_VARS:
        value = environ.get(name, "").strip()
        if not value:
            continue
        url = _as_url(value)
        if url is not None:
            return url
        if name == "RAY_JOB_ADDRESS":  # gearshift's own: a bad value is a mistake, not a skip
            raise JobsApiError(
                f"RAY_JOB_ADDRESS={value!r} is not an http(s) URL or HOST:PORT; set it to "
                "the Ray dashboard's address, e.g. http://10.0.0.5:8265."
            )
        skipped.append(f"{name}={value!r}")
    why = f" ({', '.join(skipped)} set, but not an http(s) URL or HOST:PORT)" if skipped else ""
    raise JobsApiError(
        f"no Ray job address{why}: pass --address http://HEAD:8265 or set RAY_JOB_ADDRESS. "
        "For a cluster started with `ray up cluster.yaml`, run `ray dashboard cluster.yaml` "
        "and use http://localhost:8265."
    )


def _as_url(value: str) -> str | None:
    value = value.strip()
    if "://" in value:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        return value.rstrip("/")
    match = _HOST_PORT.match(value)
    if match is None or not 0 < int(match["port"]) < 65536:
        return None
    return f"http://{value}"


class _HttpStatusError(Exception):
    def __init__(self, status_code: int, text: str):
        lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()] or ["(no body)"]
        # Ray answers some failures with a whole server-side traceback; its last line
        # is the part that says what went wrong.
        summary = lines[-1] if lines[0].startswith("Traceback") else lines[0]
        super().__init__(f"HTTP {status_code}: {summary[:300]}")
        self.status_code = status_code


class _Client(JobSubmissionClient):
    """JobSubmissionClient with a timeout on every request and typed HTTP errors.

    Both hooks are private methods of Ray's SubmissionClient (stable through Ray 2.x);
    tests/test_jobs_api.py exercises them against a real dashboard.
    """

    def _do_request(self, method, endpoint, **kwargs):
        # Ray's client calls requests without a timeout; a head that accepts the
        # connection but never answers would hang the CLI forever.
        kwargs.setdefault("timeout", HTTP_TIMEOUT_S)
        return super()._do_request(method, endpoint, **kwargs)

    def _raise_error(self, r):
        # Ray raises a bare RuntimeError with the code in its text; keep the code.
        raise _HttpStatusError(r.status_code, r.text)


def _connect(address: str | None) -> tuple[_Client, str]:
    url = resolve_address(address)
    with _translate_errors(url):
        headers = _auth_headers(url)
        with _environ_without(_RAY_ADDRESS_OVERRIDES):
            return _Client(url, headers=headers), url


def _auth_headers(url: str) -> dict[str, str]:
    # Public endpoint: answers without a token, so it tells us whether one is needed.
    r = requests.get(f"{url}/api/authentication_mode", timeout=HTTP_TIMEOUT_S)
    if r.status_code == 404:
        return {}  # a dashboard from before Ray 2.52, which has no token auth
    if r.status_code != 200:
        raise _HttpStatusError(r.status_code, r.text)
    if r.json().get("authentication_mode") != "token":
        return {}
    headers = _load_token_header()
    if not headers:
        raise JobsApiError(
            f"the Ray cluster at {url} requires an authentication token and none was found "
            "here. On the head node run `ray get-auth-token`, then on this machine either "
            "`export RAY_AUTH_TOKEN=<token>` or save it to ~/.ray/auth_token."
        )
    return headers


def _load_token_header() -> dict[str, str]:
    # Ray's own loader, so the token sources and their precedence match every other Ray
    # client: RAY_AUTH_TOKEN, then RAY_AUTH_TOKEN_PATH, then ~/.ray/auth_token.
    from ray._raylet import AuthenticationTokenLoader

    return AuthenticationTokenLoader.instance().get_token_for_http_header(ignore_auth_mode=True)


@contextlib.contextmanager
def _environ_without(names: Sequence[str]) -> Iterator[None]:
    saved = {n: os.environ.pop(n) for n in names if n in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


@contextlib.contextmanager
def _translate_errors(url: str, job_id: str | None = None) -> Iterator[None]:
    """Turn everything a bad address, token or job id can raise into JobsApiError."""
    from ray.exceptions import AuthenticationError

    try:
        yield
    except JobsApiError:
        raise
    except AuthenticationError as exc:
        raise JobsApiError(
            f"the Ray cluster at {url} rejected the request ({_first_line(exc)}). Get the "
            "head's token with `ray get-auth-token` (on the head) and set RAY_AUTH_TOKEN "
            "or ~/.ray/auth_token here to it."
        ) from None
    except _HttpStatusError as exc:
        if exc.status_code == 404 and job_id is not None:
            raise JobsApiError(
                f"no job with id {job_id!r} on the Ray cluster at {url}; "
                "`gearshift status` lists the jobs there."
            ) from None
        if exc.status_code >= 500:
            raise JobsApiError(
                f"the Ray job API at {url} failed: {exc}. The head answered, so the address "
                "is right; if the cluster has just started, try again in a few seconds, else "
                "see the dashboard's log on the head (/tmp/ray/session_latest/logs/dashboard.log)."
            ) from None
        if exc.status_code in (404, 405):
            raise JobsApiError(
                f"{url} answered {exc}, which the Ray job API would not. {_DASHBOARD_HINT}"
            ) from None
        raise JobsApiError(f"the Ray job API at {url} refused the request: {exc}.") from None
    except (OSError, asyncio.TimeoutError, aiohttp.ClientError, ValueError, RuntimeError) as exc:
        # OSError covers requests' and the builtin ConnectionError; ValueError a non-JSON
        # answer from something that is not a dashboard; RuntimeError what Ray raises
        # for a failed version check, a refused package or a broken log stream.
        raise JobsApiError(
            f"cannot use the Ray job API at {url}: {_describe(exc)}. {_DASHBOARD_HINT}"
        ) from None


def _describe(exc: BaseException) -> str:
    chain = list(_causes(exc))
    if any(isinstance(e, ConnectionRefusedError) for e in chain):
        return "connection refused (nothing is listening on that port)"
    if any(isinstance(e, socket.gaierror) for e in chain):
        return "the host name does not resolve"
    if any(isinstance(e, (requests.Timeout, TimeoutError, asyncio.TimeoutError)) for e in chain):
        connect_s, read_s = HTTP_TIMEOUT_S
        return f"no answer in time (timeouts: connect {connect_s:g} s, read {read_s:g} s)"
    return _first_line(exc)


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        reason = getattr(exc, "reason", None)  # urllib3 keeps the cause here
        exc = exc.__cause__ or exc.__context__ or (reason if isinstance(reason, BaseException) else None)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]

