"""What the terminal shows while a run trains: step, loss, samples/s and ETA.

On a terminal it is a live rich progress bar; in a log file or CI it is one plain line every
`log_every` steps, so logs stay readable.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressView:
    def __init__(self, stream=None, quiet: bool = False):
        # quiet: nothing is shown (the Python API's default; the run's files have it all)
        self.console = Console(file=stream or sys.stderr, highlight=False, soft_wrap=True, quiet=quiet)
        self.live = self.console.is_terminal and not quiet
        self._progress = None

    def start(self, total_steps: int, global_batch: int, start_step: int = 0, log_every: int = 10) -> None:
        self.total = total_steps
        self.global_batch = global_batch
        self.log_every = log_every
        if self.live:
            self._progress = Progress(
                TextColumn("[bold]step[/]"), MofNCompleteColumn(), BarColumn(),
                TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[rate]} samples/s"),
                TextColumn("{task.fields[wait]}"),
                TextColumn("ETA"), TimeRemainingColumn(), console=self.console, transient=False)
            self._task = self._progress.add_task("train", total=total_steps, completed=start_step,
                                                 loss="-", rate="-", wait="")
            self._progress.start()

    def update(self, step: int, loss: float, samples_per_s: float, comm_wait_frac: float | None = None,
               pipe: tuple[float, float] | None = None) -> None:
        """`comm_wait_frac`: the recent mean comm-wait fraction over ranks (None: not measured);
        `pipe`: a pipeline's share of the step idle in its bubble and waiting on the link."""
        wait = f"comm wait {comm_wait_frac:.0%}" if comm_wait_frac is not None else ""
        if wait and pipe is not None:
            wait += f" (bubble {pipe[0]:.0%}, link {pipe[1]:.0%})"
        if self._progress is not None:
            self._progress.update(self._task, completed=step, loss=f"{loss:.4f}", rate=f"{samples_per_s:,.0f}",
                                  wait=wait)
        elif step % self.log_every == 0 or step == self.total:
            eta = (self.total - step) * self.global_batch / samples_per_s if samples_per_s > 0 else 0.0
            self.console.print(f"step {step}/{self.total}  loss {loss:.4f}  {samples_per_s:,.0f} samples/s  "
                               + (f"{wait}  " if wait else "") + f"ETA {_eta(eta)}")

    def say(self, text: str) -> None:
        # plain text: messages carry paths and error texts ("[/path/file.cc:537]") that are not markup
        self.console.print(text, markup=False, highlight=False)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
