"""The registry itself: layout name -> Strategy, filled with the built-ins by the package and by
`register` with a user's own. It imports nothing, so that `layout` can read it."""

from __future__ import annotations

from typing import Any

STRATEGIES: dict[str, Any] = {}  # name -> strategies.base.Strategy


def register(strategy, name: str | None = None):
    """Make `strategy` available under `name` (default: its own) in this process."""
    STRATEGIES[name or strategy.name] = strategy
    return strategy
