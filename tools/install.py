"""`python tools/install.py ARGS...`: `pip install ARGS` into this interpreter's environment,
through uv where it can be had (the Makefile's installs).

uv installs what pip would, resolved the same way from the places pip's own configuration names
(find-links, index and extra index URLs, constraints: read from pip, so a machine set up for pip
needs nothing more), in a fraction of pip's time. Where uv cannot be installed or fails, pip does
the install, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

PIP = [sys.executable, "-m", "pip"]
# pip's settings uv is told of: (pip's key, pip's environment variable, uv's environment variable)
SETTINGS = (("find-links", "PIP_FIND_LINKS", "UV_FIND_LINKS"),
            ("index-url", "PIP_INDEX_URL", "UV_INDEX_URL"),
            ("extra-index-url", "PIP_EXTRA_INDEX_URL", "UV_EXTRA_INDEX_URL"),
            ("constraint", "PIP_CONSTRAINT", "UV_CONSTRAINT"))


def pip_setting(key: str, variable: str) -> str:
    """A pip setting as pip would read it: its environment variable, else its configuration."""
    if os.environ.get(variable):
        return os.environ[variable]
    out = subprocess.run([*PIP, "config", "get", f"global.{key}"], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() if out.returncode == 0 else ""


def uv_env() -> dict:
    env = dict(os.environ)
    for key, pip_var, uv_var in SETTINGS:
        value = pip_setting(key, pip_var)
        if value and uv_var not in env:
            env[uv_var] = " ".join(value.split()) if uv_var != "UV_FIND_LINKS" else ",".join(value.split())
    env.setdefault("UV_INDEX_STRATEGY", "unsafe-best-match")  # pip's rule: the best version over every index
    env.setdefault("UV_LINK_MODE", "copy")  # the cache may lie on another file system than the environment
    # bytecode compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set, a process
    # could not write it and every one (each Ray worker) would compile torch's sources again
    env.setdefault("UV_COMPILE_BYTECODE", "1")
    return env


def with_uv(args: list[str]) -> bool:
    got = subprocess.run([*PIP, "install", "--quiet", "--disable-pip-version-check", "uv"], timeout=600)
    uv = shutil.which("uv", path=os.path.dirname(sys.executable))
    if got.returncode != 0 or uv is None:
        return False
    done = subprocess.run([uv, "pip", "install", "--quiet", "--python", sys.executable, *args], env=uv_env(),
                          timeout=3600)
    return done.returncode == 0


def main(args: list[str]) -> int:
    if with_uv(args):
        return 0
    print("tools/install.py: uv could not install this; pip does", file=sys.stderr)
    return subprocess.run([*PIP, "install", "--quiet", "--disable-pip-version-check", *args], timeout=3600).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
