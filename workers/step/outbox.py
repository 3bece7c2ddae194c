"""A step loop's reports, taken by the controller in long polls (TrainWorker.run_train and
take_reports).

The loop runs as one plain call on the worker's training thread; each report it makes goes into
this outbox at once, and the controller takes what is there with a call on a thread of its own
that waits up to `wait_s` for the first report and says whether the loop has ended. A report
reaches the controller as soon as it is made, as a streamed call's would, but the driver holds
no streaming generator: Ray's leaves an I/O thread behind in the driver, and a process that
exits while it runs can crash (-11) after its work is done.

Each loop is numbered by its caller (`call`), so a poll that arrives before its loop has started,
or after it, never reads another loop's reports or end.
"""

from __future__ import annotations

import threading
from typing import Iterator


class ReportOutbox:
    def __init__(self):
        self._cond = threading.Condition()
        self._call: int | None = None  # the loop whose reports are held
        self._reports: list[dict] = []
        self._ended = False

    def run(self, call: int, reports: Iterator[dict]) -> None:
        """Drain the loop `reports` (call number `call`) into the outbox; its failure is raised
        to the caller once every report it made before is in."""
        with self._cond:
            self._call, self._reports, self._ended = call, [], False
        try:
            for report in reports:
                with self._cond:
                    self._reports.append(report)
                    self._cond.notify_all()
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def take(self, call: int, wait_s: float) -> tuple[list[dict], bool]:
        """(the reports of loop `call` made since the last take, whether that loop has ended),
        waiting up to `wait_s` for one. A loop not started yet has none and has not ended."""
        def ready() -> bool:
            return self._call == call and (bool(self._reports) or self._ended)

        with self._cond:
            self._cond.wait_for(ready, timeout=wait_s)
            if self._call != call:
                return [], False
            taken, self._reports = self._reports, []
            return taken, self._ended
