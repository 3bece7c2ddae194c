"""Every bench under bench/ can start: pyflakes finds no undefined name, unused import or other
mistake in any of them, and each one's command line answers `--help` (its imports and its
argument parser), run here in this process. A bench that cannot start fails this test rather
than the next person who runs it (bench/costmodel.py once stopped at its first line for months:
a parameter shadowed the module it called, then a module it used was no longer imported).
Running each bench through its first measurement is more than this: some need root and the
testbed, and bench/costmodel.py --quick alone takes two minutes."""

from __future__ import annotations

import contextlib
import io
import pathlib
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHES = sorted(p for p in [*ROOT.glob("bench/*.py"), *ROOT.glob("bench/testbed/*.py")] if p.name != "__init__.py")
# the benches' own helpers, imported by the benches: no command line of their own
HELPERS = {"ingest_data.py", "local_group.py", "slow_data.py", "cores.py"}


def test_every_bench_reads_clean_under_pyflakes():
    from pyflakes import api, reporter

    out, err = io.StringIO(), io.StringIO()
    found = sum(api.checkPath(str(p), reporter.Reporter(out, err)) for p in [*BENCHES, *ROOT.glob("tools/*.py")])
    assert BENCHES and found == 0, out.getvalue() + err.getvalue()


def test_the_installer_hands_pip_settings_to_uv(monkeypatch):
    """tools/install.py: what pip would read (here its environment variables) reaches uv, lists
    as uv reads them; a setting of uv's own is left as it is."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("install", ROOT / "tools" / "install.py")
    install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(install)
    monkeypatch.setenv("PIP_FIND_LINKS", "/a/wheels /b/wheels")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "file:///x/simple  file:///y/simple")
    monkeypatch.setenv("PIP_CONSTRAINT", "/c.txt")
    monkeypatch.setenv("UV_INDEX_URL", "https://mine.example/simple")
    monkeypatch.setenv("PIP_INDEX_URL", "https://theirs.example/simple")
    env = install.uv_env()
    assert env["UV_FIND_LINKS"] == "/a/wheels,/b/wheels" and env["UV_CONSTRAINT"] == "/c.txt"
    assert env["UV_EXTRA_INDEX_URL"] == "file:///x/simple file:///y/simple"
    assert env["UV_INDEX_URL"] == "https://mine.example/simple" and env["UV_INDEX_STRATEGY"] == "unsafe-best-match"


def test_the_helpers_listed_are_the_benches_without_a_command_line():
    """A new bench with no `__main__` is either a helper (listed above) or a bench that cannot run."""
    without = {p.name for p in BENCHES if "__main__" not in p.read_text()}
    assert without == HELPERS


@pytest.mark.parametrize("path", [p for p in BENCHES if p.name not in HELPERS], ids=lambda p: p.stem)
def test_every_bench_answers_help(path, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(path), "--help"])
    monkeypatch.setattr(sys, "path", [str(path.parent), str(ROOT), *sys.path])
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown), pytest.raises(SystemExit) as done:
        runpy.run_path(str(path), run_name="__main__")
    assert done.value.code == 0, shown.getvalue()
    assert "usage:" in shown.getvalue()
