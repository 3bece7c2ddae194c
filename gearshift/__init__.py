"""gearshift: distributed PyTorch training on Ray that shifts the model's layout while it trains.

    import gearshift
    result = gearshift.run("examples/mlp.yaml", overrides={"train.steps": 40})
    print(result.final_loss, result.model_path)

The API (gearshift/api.py) is imported on first use: a worker that imports `gearshift.workers`
or `gearshift.strategies` loads none of the driver's code.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# Installed, gearshift's four parts are subpackages in this folder (pyproject.toml's package-dir;
# an editable install maps them). Run in place from a checkout, with only its root on sys.path,
# they sit beside this folder: look for them there too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "orchestrator")) and all(
        _os.path.isfile(_os.path.join(_root, part, "__init__.py"))
        for part in ("orchestrator", "workers", "strategies", "monitoring")):
    __path__.append(_root)

_API = {
    "load_job": "gearshift.api", "check": "gearshift.api", "run": "gearshift.api", "submit": "gearshift.api",
    "Result": "gearshift.api", "Submission": "gearshift.api", "Check": "gearshift.api",
    "Job": "gearshift.orchestrator.job", "JobError": "gearshift.orchestrator.job",
    "RunFailed": "gearshift.orchestrator.errors", "GearshiftError": "gearshift.orchestrator.errors",
    "UsageError": "gearshift.orchestrator.errors",
}
_PARTS = ("api", "orchestrator", "workers", "strategies", "monitoring", "serving")
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        import importlib

        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value  # once: later lookups are plain attribute reads
        return value
    if name in _PARTS:  # `gearshift.api` without importing it first, as for a plain attribute
        import importlib

        return importlib.import_module(f"gearshift.{name}")
    raise AttributeError(f"module 'gearshift' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_API))
