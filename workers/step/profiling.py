"""train.profile: a window of updates recorded with torch.profiler on one rank.

`StepProfiler` knows the window and nothing of the step loop: the worker calls `before_step`
and `after_step` around each update and `take()` when it builds a report. The trace and the
tables travel back in that report as text, because a worker may run on another machine than the
driver that owns the run dir (orchestrator/reporting.py writes them there).

Modules: torch.profiler's `with_modules` only records TorchScript module hierarchies, so for an
eager model each top-level child module's forward is wrapped in a `record_function` scope
("module: name (Type)") by forward pre/post hooks, attached for the window only. Backward time is
in the aten rows, not in the module rows. A layout switch inside the window builds a new model
without the hooks: its module rows stop there, its operators are still recorded.
"""

from __future__ import annotations

import os
import tempfile

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile

ROWS = 15  # rows per table: enough to see where the time goes, short enough to read
MODULE_PREFIX = "module: "


class StepProfiler:
    """Profiles updates start_step..start_step+steps-1 (1-based), i.e. the steps with 0-based
    index start_step-1 to start_step+steps-2. Without a window every call is a no-op."""

    def __init__(self, window: tuple[int, int] | None, cuda: bool = False):
        self.window, self.cuda = window, cuda
        self.prof: profile | None = None
        self.hooks: list = []
        self.scopes: list = []  # open record_function scopes, innermost last
        self.done = False  # recorded once per worker: a later chunk or a resumed step leaves it be
        self.result: dict | None = None

    @property
    def first(self) -> int | None:  # 0-based index of the first profiled step
        return self.window[0] - 1 if self.window else None

    @property
    def last(self) -> int | None:  # 0-based index of the last profiled step
        return self.window[0] + self.window[1] - 2 if self.window else None

    def before_step(self, step: int, model: torch.nn.Module | None = None) -> None:
        """`step` is the 0-based index of the step about to run."""
        if self.window is None or self.done or self.prof is not None or step != self.first:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=activities, record_shapes=False, profile_memory=True, with_stack=False)
        if model is not None:
            self._hook_modules(model)
        self.prof.__enter__()

    def after_step(self, steps_done: int) -> bool:
        """`steps_done` counts the updates so far (the step just run was steps_done - 1).
        True when this call closed the window: the caller flushes a report carrying `take()`."""
        if self.prof is None or steps_done - 1 != self.last:
            return False
        if self.cuda:
            torch.cuda.synchronize()  # the kernels of the window's last step belong to it
        self.prof.__exit__(None, None, None)
        self._unhook()
        self.result = self._collect(self.prof)
        self.prof, self.done = None, True
        return True

    def take(self) -> dict:
        """{"profile": {steps, trace, table}} once, after the window ended; {} before and after.
        The rank is the report's own."""
        out, self.result = self.result, None
        return {"profile": out} if out else {}

    # ------------------------------------------------------------------ module scopes

    def _hook_modules(self, model: torch.nn.Module) -> None:
        for name, child in model.named_children():
            scope = f"{MODULE_PREFIX}{name} ({type(child).__name__})"
            self.hooks.append(child.register_forward_pre_hook(self._enter(scope)))
            self.hooks.append(child.register_forward_hook(self._exit))

    def _enter(self, scope: str):
        def hook(module, args):
            rf = record_function(scope)
            rf.__enter__()
            self.scopes.append(rf)
        return hook

    def _exit(self, module, args, output) -> None:
        if self.scopes:
            self.scopes.pop().__exit__(None, None, None)

    def _unhook(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        while self.scopes:  # a forward that raised inside a scope: close it
            self.scopes.pop().__exit__(None, None, None)

    # ------------------------------------------------------------------ results

    def _collect(self, prof: profile) -> dict:
        fd, path = tempfile.mkstemp(prefix="gearshift-profile-", suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path, encoding="utf-8") as f:
                trace = f.read()
        finally:
            os.unlink(path)
        return {"steps": [self.window[0], self.window[0] + self.window[1] - 1], "trace": trace,
                "table": tables(prof, self.cuda, self.window)}


def tables(prof: profile, cuda: bool, window: tuple[int, int]) -> str:
    """Top operators and top modules, by self time and by self memory, as text."""
    from torch.autograd.profiler_util import EventList

    events = prof.key_averages()
    # a sub-list prints the memory columns only when told the profile recorded memory
    like = {"use_device": getattr(events, "_use_device", None), "profile_memory": True}
    ops = EventList([e for e in events if not e.key.startswith(MODULE_PREFIX)], **like)
    # a module scope's self time is the Python between its ops: its total time says what it costs
    modules = EventList([e for e in events if e.key.startswith(MODULE_PREFIX)], **like)
    dev = "cuda" if cuda else "cpu"
    first, last = window[0], window[0] + window[1] - 1
    parts = [f"updates {first}..{last} (1-based), torch.profiler {'CPU + CUDA' if cuda else 'CPU'}"]
    sections = [("operators by self time", ops, f"self_{dev}_time_total"),
                ("operators by self memory", ops, f"self_{dev}_memory_usage"),
                ("modules by time (forward)", modules, f"{dev}_time_total"),
                ("modules by memory (forward)", modules, f"{dev}_memory_usage")]
    for title, rows, key in sections:
        parts.append(f"\n== {title} (sorted by {key}) ==")
        parts.append(rows.table(sort_by=key, row_limit=ROWS) if len(rows) else "(none recorded)")
    return "\n".join(parts) + "\n"
