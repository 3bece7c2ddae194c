"""`gearshift watch`: a live terminal view of a run, built from its telemetry records.

Records come from a run dir's `telemetry.jsonl` (`follow_file`, like `tail -f`) or from a submitted
job's log (`records_from_log_lines`). `WatchState` folds them one at a time; `render` draws the
state; `watch` ties the two together, on a terminal as a rich Live view, elsewhere as one final print.
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import statistics
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Callable, Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from gearshift.monitoring.telemetry import LOG_PREFIX, TelemetryError

COMM_WAIT_HIGH_PCT = 15.0  # the adaptive policy's default threshold (docs/design.md)
NOTABLE = ("decision", "switch", "checkpoint", "resumed", "failed", "resize")
ENDED = ("done", "failed")
WINDOW = 10  # per-rank figures are a mean over this many steps: one step's figures flicker too much to read
REFRESH_S = 0.25
MAX_REPLAY_SLEEP_S = 0.5
STATE_STYLE = {"placing": "yellow", "starting": "yellow", "training": "bold cyan", "finishing": "cyan", "done": "bold green",
               "failed": "bold red"}
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>]")


class WatchState:
    def __init__(self) -> None:
        self.step: dict | None = None
        self.eval: dict | None = None  # the latest eval record
        self.recent: collections.deque = collections.deque(maxlen=WINDOW)  # the last step records
        self.samples: dict[int, dict] = {}
        self.state: str | None = None
        self.error: str | None = None
        self.steps_target: int | None = None
        self.from_step: int | None = None
        self.workers: dict[int, dict] = {}
        self.layout: dict | None = None
        self.events: collections.deque = collections.deque(maxlen=6)
        self.first_time: float | None = None
        self.last_time: float | None = None
        self.count = 0

    def add(self, record: Any) -> None:
        if not isinstance(record, dict):
            return
        kind = record.get("type")
        t = record.get("time")
        if isinstance(t, (int, float)):
            self.first_time = self.first_time if self.first_time is not None else t
            self.last_time = t
        self.count += 1
        if kind == "step" and isinstance(record.get("step"), int):
            self.step = record
            self.recent.append(record)
        elif kind == "sample" and isinstance(record.get("rank"), int):
            self.samples[record["rank"]] = record
        elif kind == "eval" and isinstance(record.get("step"), int):
            self.eval = record
        elif kind == "event":
            name = record.get("event")
            if name == "state":
                self._state(record)
            elif name == "resize":
                self._resized(record)
            # a sampler event matters only when a worker fell back to psutil (it says why)
            if name in NOTABLE or (name == "state" and record.get("state") == "failed") or \
                    (name == "sampler" and record.get("reason")):
                self.events.append(record)

    def _resized(self, record: dict) -> None:
        """An elastic resize: the ranks past the new world are gone, and the recent steps' per-rank
        figures belong to the old one."""
        sizes = record.get("world_size")
        if isinstance(sizes, list) and len(sizes) == 2 and isinstance(sizes[1], int):
            for table in (self.samples, self.workers):
                for rank in [r for r in table if isinstance(r, int) and r >= sizes[1]]:
                    del table[rank]
            self.recent.clear()

    def _state(self, record: dict) -> None:
        self.state = record.get("state")
        self.error = record.get("error") if self.state == "failed" else None
        if self.state == "placing":  # a resumed run appends a new leg to the same file
            self.samples.clear()
            self.workers.clear()
        elif self.state == "starting":
            workers = record.get("workers")
            if isinstance(workers, list):
                self.workers = {w["rank"]: w for w in workers if isinstance(w, dict) and isinstance(w.get("rank"), int)}
            if isinstance(record.get("layout"), dict):
                self.layout = record["layout"]
        elif self.state == "training":
            self.steps_target = record.get("steps_target", self.steps_target)
            self.from_step = record.get("from_step")

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def rank_means(self) -> dict[str, list[float]]:
        """Per-rank lists (as in a step's `ranks`), each entry the mean over the recent steps."""
        out: dict[str, list[float]] = {}
        for name in ("step_time", "comm_wait_frac", "samples_per_s", "share", "speed"):
            rows = [r["ranks"][name] for r in self.recent
                    if isinstance(r.get("ranks"), dict) and isinstance(r["ranks"].get(name), list)]
            world = len(rows[-1]) if rows else 0
            rows = [row for row in rows if len(row) == world and None not in row]  # a leg with another world size
            out[name] = [statistics.fmean(row[i] for row in rows) for i in range(world)] if rows else []
        # a pipeline's wait split: each rank's share of its step idle in the bubble and on the link
        split = [r["ranks"] for r in self.recent if isinstance(r.get("ranks"), dict)
                 and isinstance(r["ranks"].get("bubble"), list) and len(r["ranks"]["bubble"]) == len(out["step_time"])]
        for name in ("bubble", "link_wait"):
            out[name] = [statistics.fmean(row[name][i] / row["step_time"][i] if row["step_time"][i] > 0 else 0.0
                                          for row in split) for i in range(len(out["step_time"]))] if split else []
        return out


def _share_note(means: dict, r: int) -> list[str]:
    """A rank whose compute is slower than the fastest's by a tenth or more: by how much, and its
    share of the batch (adapt.stragglers moves the shares to match the speeds)."""
    speed, share = means.get("speed") or [], means.get("share") or []
    if r >= len(speed) or not speed[r] or max(speed) < 1.1 * speed[r]:
        return []
    return [f"{max(speed) / speed[r]:.2f}x slower" + (f", share {share[r]:.0f}" if r < len(share) else "")]


def _num(value: Any, fmt: str, missing: str = "-") -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else missing


def _bytes(used: Any, total: Any) -> str:
    ref = total if isinstance(total, (int, float)) else used
    if not isinstance(ref, (int, float)):
        return "-"
    unit, name = next(((u, n) for u, n in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))
                       if ref >= u), (1, "B"))
    fmt = ".1f" if unit > 1 else ".0f"
    used_s = _num(used / unit if isinstance(used, (int, float)) else None, fmt, "?")
    return f"{used_s}/{_num(total / unit, fmt)} {name}" if isinstance(total, (int, float)) else f"{used_s} {name}"


def _duration(seconds: float) -> str:
    s = max(0, int(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _layout(d: Any) -> str:
    if not isinstance(d, dict):
        return str(d)
    text = " ".join([str(d.get("strategy") or d.get("kind") or "?")] +
                    [f"{k}={d[k]}" for k in ("dp", "tp") if d.get(k) is not None])
    return text + (f" bucket={_short(d['bucket_cap_mb'])}MB" if d.get("bucket_cap_mb") is not None else "")


def _short(value: Any, depth: int = 0) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        inner = ", ".join(f"{k}={_short(v, depth + 1)}" for k, v in value.items())
        return f"{{{inner}}}" if depth else inner
    if isinstance(value, (list, tuple)):
        items = [_short(v, depth + 1) for v in value[:6]]
        return "[" + ", ".join(items + (["…"] if len(value) > 6 else [])) + "]"
    text = str(value)
    return text if len(text) <= 60 else text[:59] + "…"


def _event_text(e: dict) -> tuple[str, str]:
    name = e.get("event")
    if name == "decision":
        text = _short(e.get("decision"))
        return "decision", text + (f"  evidence: {_short(e['evidence'])}" if e.get("evidence") else "")
    if name == "switch":
        took = f" in {e['seconds']:.1f} s" if isinstance(e.get("seconds"), (int, float)) else ""
        return "switch", f"at step {e.get('step', '?')}: {_layout(e.get('from'))} -> {_layout(e.get('to'))}{took}"
    if name == "checkpoint":
        return "checkpoint", f"step {e.get('step', '?')}: {e.get('path', '')}"
    if name == "resize":
        sizes = e.get("world_size") or ["?", "?"]
        how = "from the checkpoint" if e.get("from_checkpoint") else "in memory"
        took = f" in {e['seconds']:.1f} s" if isinstance(e.get("seconds"), (int, float)) else ""
        return "resize", (f"at step {e.get('step', '?')}: {sizes[0]} -> {sizes[1]} workers, {_layout(e.get('from'))} -> "
                          f"{_layout(e.get('to'))} {how}{took}")
    if name == "module_memory":
        top = ", ".join(f"{m.get('module')} {m.get('bytes', 0) / 2**20:.1f} MiB" for m in e.get("top") or [])
        return "memory", f"top modules on rank 0 (first update): {top}"
    if name == "grad_anomaly":
        return "grad anomaly", (f"step {e.get('step', '?')}: {e.get('module')}.{e.get('parameter')} "
                                f"({e.get('kind')}, norm {_short(e.get('norm'))}); {_short((e.get('suggestions') or [''])[0])}")
    if name == "resumed":
        return "resumed", f"from {e.get('checkpoint', '?')} at step {e.get('step', '?')}"
    if name == "state":
        return "failed", str(e.get("error") or "")
    rest = {k: v for k, v in e.items() if k not in ("type", "event", "time")}
    return str(name), _short(rest)


def _header(state: WatchState) -> Group:
    step = state.step or {}
    done = step.get("step", state.from_step or 0)
    line = Text.assemble(("state ", "dim"), (state.state or "waiting for records", STATE_STYLE.get(state.state, "dim")))
    total = state.steps_target if isinstance(state.steps_target, int) and state.steps_target > 0 else None
    if step or total:
        line.append(f"   step {done}/{total}" if total else f"   step {done}")
    bar = ProgressBar(total=total, completed=min(done, total), width=30) if total else Text("")
    pct = Text(f"{100 * done / total:.0f}%" if total else "")
    figures = [] if step else [Text("no steps yet", "dim")]
    if step:
        figures.append(f"loss {_num(step.get('loss'), '.4f')}")
        if state.eval:
            figures.append(f"eval loss {_num(state.eval.get('loss'), '.4f')} @ step {state.eval['step']}")
        times = [r.get("step_time_max") for r in state.recent if isinstance(r.get("step_time_max"), (int, float))]
        rates = [(r.get("samples_per_s"), r.get("step_time_max")) for r in state.recent]
        rates = [(s, t) for s, t in rates if isinstance(s, (int, float)) and isinstance(t, (int, float))]
        if rates and sum(t for _, t in rates) > 0:  # samples over time across the window, not a mean of rates
            figures.append(f"{sum(s * t for s, t in rates) / sum(t for _, t in rates):,.0f} samples/s")
        if isinstance(step.get("tokens_per_s"), (int, float)):
            figures.append(f"{step['tokens_per_s']:,.0f} tokens/s")
        if total and times and state.state == "training":
            figures.append(f"ETA {_duration((total - done) * statistics.fmean(times))}")
    if state.first_time is not None and state.last_time is not None:
        figures.append(f"elapsed {_duration(state.last_time - state.first_time)}")
    top = Table.grid(padding=(0, 2))
    top.add_column(ratio=1)
    top.add_row(line, bar, pct)
    lines = [top, Text("   ").join(Text(f) if isinstance(f, str) else f for f in figures)]

    layout = {**(state.layout or {}), **{k: step[k] for k in ("strategy", "dp", "tp") if k in step}}
    where = []
    if layout:
        where.append(_layout(layout))
    if isinstance(step.get("bucket_cap_mb"), (int, float)):
        where.append(f"bucket_cap_mb {_short(step['bucket_cap_mb'])}")
    ranks = set(state.workers) | set(state.samples)
    if ranks:
        nodes = {w.get("node_ip") for w in [*state.workers.values(), *state.samples.values()]} - {None}
        where.append(f"{len(ranks)} worker(s) on {len(nodes)} node(s)")
    devices = collections.Counter(re.sub(r"^cuda:\d+\s*", "", s.get("device", "")) or "cpu"
                                  for s in state.samples.values())
    if devices:
        where.append(", ".join(f"{n}x {d}" for d, n in devices.items()))
    if where:
        lines.append(Text("   ".join(where)))
    if state.error:
        lines.append(Text(f"error: {state.error}", "bold red"))
    return Group(*lines)


def _workers(state: WatchState, max_rows: int | None) -> Table | Text:
    means = state.rank_means()
    step_time, comm, rate = means["step_time"], means["comm_wait_frac"], means["samples_per_s"]
    ranks = sorted(set(state.workers) | set(state.samples) | set(range(len(step_time))))
    if not ranks:
        return Text("no workers yet", "dim")
    slowest = max(range(len(step_time)), key=lambda r: step_time[r]) if len(set(step_time)) > 1 else None
    high = {r for r in range(len(comm)) if comm[r] * 100 > COMM_WAIT_HIGH_PCT}
    shown = ranks
    if max_rows is not None and len(ranks) > max(3, max_rows):
        # too many to fit: keep the ranks worth a look (slowest, most comm wait), then the lowest ones
        budget = max(3, max_rows)
        keep = {slowest} - {None} | set(sorted(high, key=lambda r: -comm[r])[: budget // 2])
        keep |= set([r for r in ranks if r not in keep][: max(0, budget - len(keep))])
        shown = sorted(keep)
    n = len(state.recent)
    caption = [f"{len(ranks) - len(shown)} more ranks not shown"] if len(shown) < len(ranks) else []
    caption += [f"per-rank figures: mean of the last {n} steps"] if n > 1 and step_time else []
    # no rules, two spaces between columns: the eight columns fit an 80-column terminal
    table = Table(title="workers", title_justify="left", caption_justify="left", expand=False,
                  caption="; ".join(caption) or None, box=None, padding=(0, 1),
                  header_style="bold underline")
    for name in ("rank", "node", "util", "memory", "comm %", "step ms", "samples/s", ""):
        table.add_column(name, justify="right" if name not in ("node", "memory", "") else "left", no_wrap=True)
    for r in shown:
        s, w = state.samples.get(r, {}), state.workers.get(r, {})
        source = {"nvml": "GPU", "psutil": "CPU"}.get(s.get("source"), s.get("source") or "")
        util = f"{_num(s.get('util_pct'), '.0f')}% {source}" if s else "-"
        notes = (["slowest"] if r == slowest else []) + (["comm-bound"] if r in high else [])
        notes += _share_note(means, r)
        if r < len(means["bubble"]):  # pipeline: where the stage's wait went
            notes.append(f"bubble {means['bubble'][r]:.0%} link {means['link_wait'][r]:.0%}")
        table.add_row(
            str(r), s.get("node_ip") or w.get("node_ip") or "-", util,
            _bytes(s.get("mem_used_bytes"), s.get("mem_total_bytes")) if s else "-",
            Text(f"{comm[r] * 100:.1f}%", "bold red" if r in high else "") if r < len(comm) else "-",
            Text(f"{step_time[r] * 1000:.1f}", "bold yellow" if r == slowest else "") if r < len(step_time) else "-",
            _num(rate[r] if r < len(rate) else None, ",.0f"),
            Text(" ".join(notes), "bold red" if r in high else "bold yellow"))
    return table


def render(state: WatchState, title: str = "", max_rows: int | None = None):
    """The view of `state`; `max_rows` caps the worker rows (a live view must fit the terminal)."""
    parts = [Panel(_header(state), title=f"gearshift watch {title}".strip(), title_align="left"),
             _workers(state, max_rows)]
    if state.events:
        events = Table.grid(padding=(0, 1))
        events.add_column(style="dim", no_wrap=True)
        events.add_column(no_wrap=True)
        events.add_column()
        for e in state.events:
            kind, text = _event_text(e)
            t = e.get("time")
            when = f"+{t - state.first_time:.1f}s" if isinstance(t, (int, float)) and state.first_time else ""
            events.add_row(when, Text(kind, "bold red" if kind == "failed" else "bold"), text)
        parts += [Text("last decisions and events", "bold"), events]
    return Group(*parts)


def _parse(line: bytes | str) -> dict | None:
    try:
        record = json.loads(line)
    except ValueError:  # also a line torn by a crash of the writer
        return None
    return record if isinstance(record, dict) else None


def follow_file(path, poll_s: float = 0.25, idle_timeout_s: float | None = None,
                alive: Callable[[], bool] | None = None) -> Iterator[dict]:
    """The records of a telemetry.jsonl, including those appended later, until the run ends
    (its last record says done or failed), `idle_timeout_s` passes without new data, or
    `alive()` says the process writing it is gone (killed before it could record its end)."""
    path = pathlib.Path(path)
    if not path.exists() and not (path.parent / "job.yaml").is_file():
        raise TelemetryError(
            f"{path} does not exist: {path.parent} is not a gearshift run dir, or its run has not started yet. "
            f"Pass a run dir (runs/NAME-FINGERPRINT-TIME, with telemetry.jsonl in it), its telemetry.jsonl, "
            f"or a submitted job's id.")
    if path.is_file():  # checked now rather than on the first next(), so nothing is drawn before the error
        with open(path, "rb") as f:
            first = f.readline()
        if first.endswith(b"\n") and (_parse(first) or {}).get("type") is None:
            raise TelemetryError(f"{path} is not a gearshift telemetry file (its first line is not a record); "
                                 f"pass a run dir or its telemetry.jsonl.")
    return _follow(path, poll_s, idle_timeout_s, alive)


def _follow(path: pathlib.Path, poll_s: float, idle_timeout_s: float | None,
            alive: Callable[[], bool] | None = None) -> Iterator[dict]:
    last_data = time.monotonic()

    def idle() -> bool:
        quiet = time.monotonic() - last_data
        if alive is not None and quiet >= 1.0 and not alive():
            return True
        return idle_timeout_s is not None and quiet >= idle_timeout_s

    while not path.exists():  # the run dir is there, the run has not written its first record
        if idle():
            return
        time.sleep(poll_s)
    ended = False
    buf = b""
    with open(path, "rb") as f:  # bytes: a read may end inside a multi-byte character
        while True:
            chunk = f.read(1 << 20)
            if not chunk:
                # stop at the end state only at the end of the file: a resumed run appends another leg
                if ended or idle():
                    return
                time.sleep(poll_s)
                continue
            last_data = time.monotonic()
            *lines, buf = (buf + chunk).split(b"\n")
            for line in lines:
                record = _parse(line)
                if record is not None:
                    if record.get("type") == "event" and record.get("event") == "state":
                        ended = record.get("state") in ENDED
                    yield record


def records_from_log_lines(lines: Iterable[str]) -> Iterator[dict]:
    """The telemetry records a submitted job's driver printed into its log; other lines are skipped."""
    for line in lines:
        line = _ANSI.sub("", line).strip()
        if line.startswith(LOG_PREFIX):
            record = _parse(line[len(LOG_PREFIX):])
            if record is not None:
                yield record


def _paced(records: Iterable[dict], speed: float | None) -> Iterator[dict]:
    previous = None
    for record in records:
        t = record.get("time")
        if speed and speed > 0 and isinstance(t, (int, float)):
            if previous is not None:
                time.sleep(min(max(0.0, t - previous) / speed, MAX_REPLAY_SLEEP_S))
            previous = t
        yield record


def watch(records: Iterable[dict], console: Console, replay_speed: float | None = None, title: str = "") -> int:
    """Show the run behind `records` until they end. 0, or 1 when the run failed; 130 on Ctrl-C."""
    state = WatchState()
    try:
        if console.is_terminal:
            _live(state, records, console, replay_speed, title)
        else:
            for record in records:  # no one sees a replay in a file: no pacing
                state.add(record)
            console.print(render(state, title))
    except KeyboardInterrupt:
        if not console.is_terminal:  # a log of the watch still says where the run was
            console.print(render(state, title))
        console.print("[dim]stopped watching; the run itself is not affected.[/]")
        return 130
    if state.count == 0:
        console.print("[dim]no telemetry records arrived; stopped waiting.[/]")
    elif not state.ended:
        console.print("[dim]no end-of-run record yet; stopped waiting (the run, if still going, is not affected).[/]")
    return 1 if state.state == "failed" else 0


def _live(state: WatchState, records: Iterable[dict], console: Console, speed: float | None, title: str) -> None:
    # a reader thread folds records as they come (the source may block: a growing file, a job log);
    # this thread redraws at most every REFRESH_S, so a fast source is never drawn once per record
    lock, finished, failure = threading.Lock(), threading.Event(), []

    def reader() -> None:
        try:
            for record in _paced(records, speed):
                with lock:
                    state.add(record)
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            failure.append(err)
        finally:
            finished.set()

    def view(limit: bool):
        with lock:
            rows = max(3, console.size.height - 16 - len(state.events)) if limit else None
            return render(state, title, rows)

    threading.Thread(target=reader, name="gearshift-watch-reader", daemon=True).start()
    with Live(console=console, auto_refresh=False, transient=False) as live:
        try:
            while not finished.wait(REFRESH_S):
                live.update(view(True), refresh=True)
        finally:
            live.update(view(False), refresh=True)  # the whole final view stays on screen
    if failure:
        raise failure[0]
