"""`gearshift report RUN_DIR`: PNG plots over steps and a text summary of a run's telemetry.

Reads `telemetry.jsonl` (see monitoring/schema.py) and writes throughput.png, comm_wait.png,
utilisation.png (only when the run has device samples), loss.png and report.txt. Plots are drawn
on a bare `Figure` with the Agg canvas, so nothing touches pyplot's global state or the backend
of a program that imports this module.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import warnings

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from gearshift.monitoring import telemetry
from gearshift.monitoring.telemetry import TelemetryError

THRESHOLD_PCT = 15.0  # the adaptive policy's default comm-wait threshold (docs/design.md)
RAW_LIMIT = 3000  # above this many points a series is drawn per bin: median line and min..max band
BINS = 1000
DENSE_MARKERS = 60  # more markers of one kind than this are drawn as short ticks
MARKER_STYLE = {  # event kind -> vertical line style; one legend entry per kind
    "checkpoint": dict(color="0.6", lw=0.6, ls="-"),
    "resumed": dict(color="tab:cyan", lw=1.4, ls="-."),
    "decision": dict(color="tab:purple", lw=1.4, ls=":"),
    "switch": dict(color="black", lw=1.4, ls="--"),
    "resize": dict(color="tab:orange", lw=1.6, ls="-"),
    "failed": dict(color="red", lw=2.0, ls="-"),
}


@dataclasses.dataclass
class Report:
    paths: list[pathlib.Path]
    summary_text: str
    summary: dict


def make_report(run_dir, out_dir=None) -> Report:
    run_dir = pathlib.Path(run_dir)
    records = _load(run_dir)
    if run_dir.is_file():  # a telemetry.jsonl named directly
        run_dir = run_dir.parent
    out = pathlib.Path(out_dir) if out_dir else run_dir / "report"
    summary = summarise(records, run_dir)
    marks = markers(records)
    steps = _steps(records)
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = [p for p in (_plot_throughput(steps, marks, out), _plot_comm_wait(steps, marks, out),
                             _plot_utilisation(records, marks, out), _plot_speeds(steps, marks, out),
                             _plot_loss(steps, marks, out, _evals(records))) if p]
        text = format_summary(summary)
        (out / "report.txt").write_text(text + "\n", encoding="utf-8")
    except OSError as err:
        raise TelemetryError(f"cannot write the report to {out}/: {err.strerror or err}. "
                             f"Choose another folder with --out DIR.") from None
    return Report(paths=paths, summary_text=text, summary=summary)


# ---------------------------------------------------------------- reading

def _load(run_dir: pathlib.Path) -> list[dict]:
    if not run_dir.exists():
        raise TelemetryError(f"{run_dir} does not exist. Name a run dir, e.g. gearshift report runs/NAME "
                             f"(runs are under runs/ unless --run-dir put them elsewhere).")
    path = run_dir if run_dir.is_file() else run_dir / "telemetry.jsonl"
    if not path.is_file():
        raise TelemetryError(f"{run_dir} has no telemetry.jsonl: it is not a gearshift run dir (or the run "
                             f"has not started yet). Name the folder `gearshift run` printed, under runs/.")
    try:
        raw = telemetry.read(path)
    except (OSError, UnicodeDecodeError) as err:
        raise TelemetryError(f"cannot read {path}: {err}. Is it a gearshift telemetry file?") from None
    records = [r for r in raw if isinstance(r, dict) and r.get("type") in ("step", "sample", "eval", "event")
               and isinstance(r.get("time"), (int, float)) and not isinstance(r.get("time"), bool)]
    if not records:
        raise TelemetryError(f"{path} holds no telemetry records yet: the run has not written anything "
                             f"(or stopped before placing its workers). Try again once it trains.")
    if not _steps(records):
        states = [r for r in _events(records, "state")]
        last = states[-1] if states else {}
        if last.get("state") == "failed":
            why = f"the run failed before its first step: {last.get('error', 'no error recorded')}"
        elif last.get("state") == "done":
            why = "the run ended without training a step"
        else:
            why = (f"the run is still {last['state']} (no step finished yet); try again once it trains, or "
                   f"follow it live with gearshift watch {run_dir}" if last.get("state") else
                   "no step has finished yet")
        raise TelemetryError(f"{path} has no step records, so there is nothing to plot: {why}.")
    return records


def _events(records, name=None):
    return [r for r in records if r.get("type") == "event" and (name is None or r.get("event") == name)]


def _steps(records) -> list[dict]:
    """Step records, one per step number in step order. A resumed run appends to the same file and
    re-runs the steps after its checkpoint; the later record of a step is the one that counts."""
    by_step = {r["step"]: r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)
               and not isinstance(r.get("step"), bool)}
    return [by_step[s] for s in sorted(by_step)]


def _evals(records) -> list[dict]:
    """Eval records by step, the later of any step evaluated twice (a restart repeats it)."""
    by_step = {r["step"]: r for r in records if r.get("type") == "eval" and isinstance(r.get("step"), int)
               and isinstance(r.get("loss"), (int, float))}
    return [by_step[s] for s in sorted(by_step)]


def _col(steps, name) -> np.ndarray:
    """A step field as floats; missing or null (older files, tokens of non-sequence models) -> nan."""
    return np.array([v if isinstance(v := r.get(name), (int, float)) else np.nan for r in steps], float)


# ---------------------------------------------------------------- time -> step

def _anchors(records):
    """(times, steps) to map a wall time onto the step axis: each step record's end, plus the start of
    each training leg (`state training` with `from_step`), sorted by time for numpy.interp."""
    pts = [(r["time"], r["step"]) for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    pts += [(r["time"], r["from_step"]) for r in _events(records, "state")
            if r.get("state") == "training" and isinstance(r.get("from_step"), int)]
    pts.sort()
    return np.array([p[0] for p in pts], float), np.array([p[1] for p in pts], float)


def time_to_step(times, anchor_times, anchor_steps, clamp=True) -> np.ndarray:
    """Fractional steps at wall `times`, interpolated between anchors. With `clamp` (markers) a time
    outside the anchors sits at the first/last step, and one in the gap before a resumed leg (where
    the step goes back) at the step the earlier leg reached; without it (samples) those are nan."""
    times, at, st = np.asarray(times, float), np.asarray(anchor_times, float), np.asarray(anchor_steps, float)
    edge = {} if clamp else dict(left=np.nan, right=np.nan)
    out = np.interp(times, at, st, **edge)
    i = np.clip(np.searchsorted(at, times, side="right"), 1, max(len(at) - 1, 1))
    gap = (len(at) > 1) & (st[i] < st[i - 1]) & (times < at[i])
    out[gap] = st[i - 1][gap] if clamp else np.nan
    return out


def markers(records) -> list[tuple[str, float, str]]:
    """(kind, step, label) per marked event. An event that names its `step` (checkpoint, resumed,
    switch) sits exactly there; others (decision, failure) are placed by their time."""
    at, steps = _anchors(records)
    out = []
    for r in _events(records):
        kind = r.get("event")
        if kind == "state":
            if r.get("state") != "failed":
                continue
            kind = "failed"
        if kind not in MARKER_STYLE:
            continue
        step = r.get("step")
        if not isinstance(step, (int, float)) or isinstance(step, bool):
            step = float(time_to_step([r["time"]], at, steps)[0])
        label = ""
        if kind == "switch":
            to = r.get("to")
            label = (to.get("kind") or to.get("strategy") or "") if isinstance(to, dict) else str(to or "")
        elif kind == "resize" and isinstance(r.get("world_size"), list):
            label = "->".join(str(n) for n in r["world_size"])
        out.append((kind, float(step), label))
    return out


# ---------------------------------------------------------------- summary

def _layout_runs(steps: list[dict]) -> list[dict]:
    """Consecutive runs of one layout: [{strategy, dp, tp, first_step, last_step}]."""
    runs: list[dict] = []
    for r in steps:
        key = (r.get("strategy"), r.get("dp"), r.get("tp"))
        if runs and runs[-1]["key"] == key:
            runs[-1]["last_step"] = r["step"]
        else:
            runs.append({"key": key, "first_step": r["step"], "last_step": r["step"]})
    return [{"strategy": s["key"][0], "dp": s["key"][1], "tp": s["key"][2], "first_step": s["first_step"],
             "last_step": s["last_step"]} for s in runs]


def _utilisation_while_training(records, samples: list[dict]) -> dict[int, list[float]]:
    """Device utilisation samples per rank, only those taken while training (not during start-up)."""
    at, st = _anchors(records)
    util = collections.defaultdict(list)
    for r, s in zip(samples, time_to_step([r["time"] for r in samples], at, st, clamp=False)):
        if isinstance(r.get("util_pct"), (int, float)) and not np.isnan(s):
            util[r["rank"]].append(r["util_pct"])
    return util


def summarise(records, run_dir) -> dict:
    steps = _steps(records)
    n = len(steps)
    all_steps = [r["step"] for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)]
    times = [r["time"] for r in records]
    sps, tps = _col(steps, "samples_per_s"), _col(steps, "tokens_per_s")
    cw_mean, cw_max = _col(steps, "comm_wait_frac_mean") * 100, _col(steps, "comm_wait_frac_max") * 100
    slow = collections.Counter(r["slowest_rank"] for r in steps if isinstance(r.get("slowest_rank"), int))
    slow_rank, slow_n = slow.most_common(1)[0] if slow else (None, 0)

    strategies = _layout_runs(steps)

    states = [r for r in _events(records, "state") if isinstance(r.get("state"), str)]
    final = states[-1]["state"] if states else None
    final_state = final if final in ("done", "failed") else "running or unknown"

    samples = [r for r in records if r.get("type") == "sample" and isinstance(r.get("rank"), int)]
    util = _utilisation_while_training(records, samples)
    notes = []
    if len(all_steps) > n:
        notes.append(f"{len(all_steps) - n} step records were re-runs after a resume; the later run of each "
                     f"step is used")
    if not samples:
        notes.append("no device samples in this run: no utilisation plot")
    if np.all(np.isnan(cw_mean)):
        notes.append("comm wait not recorded (telemetry.enabled: false, or an older file): no comm-wait plot")

    def stat(fn, x):
        x = x[~np.isnan(x)]
        return float(fn(x)) if x.size else None

    return {
        "run_dir": str(run_dir),
        "first_step": steps[0]["step"], "last_step": steps[-1]["step"], "steps": n,
        "wall_time_s": max(times) - min(times),
        "samples_per_s_median": stat(np.median, sps), "samples_per_s_p90": stat(lambda x: np.percentile(x, 90), sps),
        "tokens_per_s_median": stat(np.median, tps), "tokens_per_s_p90": stat(lambda x: np.percentile(x, 90), tps),
        "comm_wait_pct_mean": stat(np.mean, cw_mean), "comm_wait_pct_max": stat(np.max, cw_max),
        "bubble_pct_mean": stat(np.mean, _col(steps, "bubble_frac_mean") * 100),
        "link_wait_pct_mean": stat(np.mean, _col(steps, "link_wait_frac_mean") * 100),
        "step_time_median_s": stat(np.median, _col(steps, "step_time_max")),
        "slowest_rank": slow_rank, "slowest_rank_steps": slow_n,
        "strategies": strategies,
        "checkpoints": len(_events(records, "checkpoint")),
        "evals": [{"step": r["step"], "loss": r["loss"]} for r in _evals(records)],
        "profiles": _profiles(records),
        "decisions": len(_events(records, "decision")),
        "switches": len(_events(records, "switch")),
        "resizes": [{"step": r.get("step"), "world_size": r.get("world_size"), "from_checkpoint": r.get("from_checkpoint"),
                     "seconds": r.get("seconds")} for r in _events(records, "resize")],
        "grad_anomalies": [{k: r.get(k) for k in ("step", "kind", "module", "parameter", "norm", "ratio", "suggestions")}
                           for r in _events(records, "grad_anomaly")],
        "final_state": final_state,
        "last_state": final,
        "error": states[-1].get("error") if final == "failed" else None,
        "device_source": "/".join(sorted({str(r.get("source")) for r in samples})) or None,
        "util_pct_mean_by_rank": {rank: float(np.mean(v)) for rank, v in sorted(util.items())},
        "notes": notes,
    }


def _profiles(records) -> list[dict]:
    """train.profile's files, one entry per rank (a resumed run that profiled again: the latest)."""
    by_rank = {r["rank"]: r for r in _events(records, "profile")
               if isinstance(r.get("rank"), int) and r.get("trace") and r.get("table")}
    return [{"rank": k, "trace": r["trace"], "table": r["table"], "steps": r.get("steps")}
            for k, r in sorted(by_rank.items())]


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    h, rest = divmod(round(s), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d} (h:mm:ss)"


def _num(x, unit="") -> str:
    return "n/a" if x is None else f"{x:,.0f}{unit}" if abs(x) >= 100 else f"{x:,.3g}{unit}"


def _plural(n, word) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def format_summary(s: dict) -> str:
    rows = [("run", s["run_dir"]),
            ("steps", f"{s['first_step']}..{s['last_step']} ({s['steps']} steps), wall time "
                      f"{_duration(s['wall_time_s'])} from first to last record")]
    tp = f"median {_num(s['samples_per_s_median'])} samples/s, p90 {_num(s['samples_per_s_p90'])}"
    if s["tokens_per_s_median"] is not None:
        tp += f"; median {_num(s['tokens_per_s_median'])} tokens/s, p90 {_num(s['tokens_per_s_p90'])}"
    rows.append(("throughput", tp))
    if s["comm_wait_pct_mean"] is not None:
        rows.append(("comm wait", f"mean {s['comm_wait_pct_mean']:.1f} % of the step, max "
                                  f"{s['comm_wait_pct_max']:.1f} % (one rank, one step)"))
    if s.get("bubble_pct_mean") is not None:  # pipeline steps: their wait split
        rows.append(("pipeline wait", f"mean {s['bubble_pct_mean']:.1f} % of the step idle in the bubble, "
                                      f"{s['link_wait_pct_mean']:.1f} % on the link"))
    st = s["step_time_median_s"]
    rows.append(("step time", "n/a" if st is None else
                 f"median {st * 1000:.1f} ms" if st < 1 else f"median {st:.2f} s"))
    if s["slowest_rank"] is not None:
        rows.append(("slowest rank", f"rank {s['slowest_rank']} in {s['slowest_rank_steps']} of {s['steps']} steps "
                                     f"({100 * s['slowest_rank_steps'] / s['steps']:.0f} %)"))
    rows.append(("strategies", ", then ".join(
        f"{x['strategy']}" + (f" (dp={x['dp']} tp={x['tp']})" if x["dp"] is not None else "")
        + f" steps {x['first_step']}..{x['last_step']}" for x in s["strategies"] if x["strategy"] is not None)
        or "not recorded"))
    if s.get("evals"):
        last, best = s["evals"][-1], min(s["evals"], key=lambda e: e["loss"])
        rows.append(("eval loss", f"{last['loss']:.4g} at step {last['step']} (best {best['loss']:.4g} at step "
                                  f"{best['step']}; {_plural(len(s['evals']), 'evaluation')})"))
    rows.append(("events", f"{_plural(s['checkpoints'], 'checkpoint')}, {_plural(s['decisions'], 'decision')}, "
                           f"{_plural(s['switches'], 'switch').replace('switchs', 'switches')}"))
    if s.get("resizes"):
        rows.append(("world size", ", then ".join(
            f"{r['world_size'][0]} -> {r['world_size'][1]} workers at step {r['step']} "
            f"({'from the checkpoint' if r['from_checkpoint'] else 'in memory'}"
            + (f", {r['seconds']:.1f} s)" if isinstance(r.get("seconds"), (int, float)) else ")")
            for r in s["resizes"] if isinstance(r.get("world_size"), list))))
    for a in s.get("grad_anomalies") or []:
        size = (f"{a['norm']:.4g} ({a['ratio']:.0f}x its median)" if a.get("kind") == "explode" and a.get("ratio")
                else str(a.get("norm")))
        rows.append(("grad anomaly", f"step {a['step']}: {a['module']}.{a['parameter']} norm {size}; "
                                     + "; ".join(a.get("suggestions") or [])))
    final = s["final_state"]
    if final == "failed":
        final = f"failed: {s['error'] or 'no error recorded'}"
    elif final != "done":
        final = (f"still running, or it ended without a final record (last state: {s['last_state']})"
                 if s["last_state"] else "unknown (no state events)")
    rows.append(("final state", final))
    if s["device_source"]:
        what = {"nvml": "GPU utilisation", "psutil": "worker CPU"}.get(s["device_source"], "utilisation")
        util = ", ".join(f"rank {r} {u:.0f} %" for r, u in s["util_pct_mean_by_rank"].items()) or "no readings"
        rows.append(("devices", f"{s['device_source']}; mean {what} while training: {util}"))
    rows += [("note", n) for n in s["notes"]]
    return "\n".join(f"{k:<13}{v}" for k, v in rows) + _profile_section(s.get("profiles") or [])


def _profile_section(profiles: list[dict]) -> str:
    """The files train.profile wrote: a trace per rank for chrome://tracing or ui.perfetto.dev, and
    its table of the top operators and modules."""
    if not profiles:
        return ""
    steps = profiles[0]["steps"]
    lines = ["", "", "Profile" + (f" (updates {steps[0]}..{steps[1]})" if steps else "") +
             ": open a trace in ui.perfetto.dev or chrome://tracing"]
    for p in profiles:
        lines += [f"  rank {p['rank']:<4} trace {p['trace']}", f"  {'':<9} table {p['table']}"]
    return "\n".join(lines)


# ---------------------------------------------------------------- plots

def _figure(title: str, ylabel: str):
    fig = Figure(figsize=(10, 4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def _series(ax, x, y, label, color):
    """Noisy per-step series: faint raw points under a rolling median. Long ones are binned first
    (median line, min..max band), so 100k steps draw as fast as 1k and spikes stay visible."""
    x = np.asarray(x, float)
    ok = ~np.isnan(y) & ~np.isnan(x)
    x, y = x[ok], y[ok]
    if y.size == 0:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan windows at padded edges
        if y.size > RAW_LIMIT:
            k = -(-y.size // BINS)
            pad = k * BINS - y.size
            xb = np.pad(x, (0, pad), constant_values=np.nan).reshape(BINS, k)
            yb = np.pad(y, (0, pad), constant_values=np.nan).reshape(BINS, k)
            xm = np.nanmean(xb, axis=1)
            ax.fill_between(xm, np.nanmin(yb, axis=1), np.nanmax(yb, axis=1), color=color, alpha=0.15, lw=0)
            span = (x[-1] - x[0]) / BINS
            ax.plot(xm, np.nanmedian(yb, axis=1), color=color, lw=1.2, label=f"{label} (median per ~{span:,.0f} steps)")
        elif y.size >= 20:
            w = max(5, y.size // 30) | 1
            win = np.lib.stride_tricks.sliding_window_view(np.pad(y, w // 2, constant_values=np.nan), w)
            ax.plot(x, y, color=color, lw=0.6, alpha=0.35)
            ax.plot(x, np.nanmedian(win, axis=1), color=color, lw=1.5, label=f"{label} (rolling median)")
        else:
            ax.plot(x, y, color=color, lw=1.2, marker=".", label=label)


def _finish(fig, ax, marks, path, twin=None) -> pathlib.Path:
    trans = ax.get_xaxis_transform()  # x in steps, y in axes fraction: lines span the height
    for kind, style in MARKER_STYLE.items():
        xs = [s for k, s, _ in marks if k == kind]
        if xs:  # many (checkpoints every few steps of a long run) would hide the data: ticks at the bottom
            top, label = (1, kind) if len(xs) <= DENSE_MARKERS else (0.04, f"{kind} (ticks at the bottom)")
            ax.vlines(xs, 0, top, transform=trans, label=label, zorder=1.5, **style)
    switches = [(s, label) for k, s, label in marks if k == "switch" and label]
    for s, label in switches[:30]:  # beyond that they would overlap into a smudge
        ax.text(s, 0.98, f"to {label}", transform=trans, rotation=90, va="top", ha="left", fontsize="small",
                bbox=dict(fc="white", ec="none", alpha=0.8, pad=1))
    handles, labels = ax.get_legend_handles_labels()
    if twin is not None:
        h2, l2 = twin.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    # outside the axes: never covers data, and avoids loc="best", which is slow on long series
    fig.legend(handles, labels, loc="outside right upper", fontsize="small",
               ncols=1 if len(labels) <= 16 else 2)
    fig.savefig(path)
    return path


def _plot_throughput(steps, marks, out):
    x = _col(steps, "step")
    fig, ax = _figure("Throughput", "samples/s")
    _series(ax, x, _col(steps, "samples_per_s"), "samples/s", "tab:blue")
    ax.set_ylim(bottom=0)
    twin = None
    sps, tokens = _col(steps, "samples_per_s"), _col(steps, "tokens_per_s")
    ratio = tokens / sps
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size and np.ptp(ratio) <= 1e-6 * abs(ratio[0]):
        # fixed tokens per sample: a second line would lie exactly on the first; a second scale says it all
        r = float(ratio[0])
        ax.secondary_yaxis("right", functions=(lambda v: v * r, lambda v: v / r)).set_ylabel(
            f"tokens/s (= samples/s × {r:,.4g})")
    elif ratio.size:
        twin = ax.twinx()
        twin.set_ylabel("tokens/s")
        _series(twin, x, tokens, "tokens/s", "tab:green")
        twin.set_ylim(bottom=0)
    return _finish(fig, ax, marks, out / "throughput.png", twin)


def _plot_comm_wait(steps, marks, out):
    mean, mx = _col(steps, "comm_wait_frac_mean") * 100, _col(steps, "comm_wait_frac_max") * 100
    if np.all(np.isnan(mean)) and np.all(np.isnan(mx)):
        return None
    x = _col(steps, "step")
    fig, ax = _figure("Comm wait (time blocked on collectives, % of the step)", "comm wait %")
    _series(ax, x, mean, "mean over ranks", "tab:blue")
    _series(ax, x, mx, "max over ranks", "tab:orange")
    ax.axhline(THRESHOLD_PCT, color="tab:red", ls="--", lw=1, alpha=0.8,
               label=f"default adaptive threshold ({THRESHOLD_PCT:g} %)")
    ax.set_ylim(0, max(THRESHOLD_PCT * 1.5, np.nanmax(mx) * 1.05 if not np.all(np.isnan(mx)) else 0))
    return _finish(fig, ax, marks, out / "comm_wait.png")


def _plot_speeds(steps, marks, out):
    """Each rank's compute speed (its samples over its compute time) and, where the shares moved
    (adapt.stragglers), its share of the batch on a second scale. None before any rank's speed."""
    rows = [r for r in steps if isinstance((r.get("ranks") or {}).get("speed"), list)]
    if not rows:
        return None
    world = max(len(r["ranks"]["speed"]) for r in rows)
    x = np.array([r["step"] for r in rows], float)
    fig, ax = _figure("Compute speed per rank (samples over its compute time)", "samples/s of compute")
    for rank in range(world):
        y = [r["ranks"]["speed"][rank] if rank < len(r["ranks"]["speed"]) else None for r in rows]
        _series(ax, x, np.array([np.nan if v is None else v for v in y], float), f"rank {rank}", f"C{rank % 10}")
    ax.set_ylim(bottom=0)
    twin = None
    if any(r.get("shares") for r in rows):  # the shares moved: each rank's samples, dashed
        twin = ax.twinx()
        twin.set_ylabel("samples of the batch (dashed)")
        for rank in range(world):
            y = [r["ranks"]["share"][rank] if rank < len(r["ranks"].get("share") or []) else np.nan for r in rows]
            twin.plot(x, np.array(y, float), ls="--", lw=1, color=f"C{rank % 10}")
        twin.set_ylim(bottom=0)
    return _finish(fig, ax, marks, out / "speeds.png", twin)


def _plot_utilisation(records, marks, out):
    samples = [r for r in records if r.get("type") == "sample" and isinstance(r.get("rank"), int)
               and isinstance(r.get("util_pct"), (int, float))]
    if not samples:
        return None
    sources = sorted({str(r.get("source")) for r in samples})
    names = {"nvml": "GPU utilisation %", "psutil": "worker CPU %"}
    ylabel = " / ".join(f"{names.get(s, s)}" + (f" ({s})" if len(sources) > 1 else "") for s in sources)
    at, st = _anchors(records)
    fig, ax = _figure("Device utilisation per rank", ylabel)
    for i, rank in enumerate(sorted({r["rank"] for r in samples})):
        mine = [r for r in samples if r["rank"] == rank]
        x = time_to_step([r["time"] for r in mine], at, st, clamp=False)
        order = np.argsort(x, kind="stable")  # nan (outside training) sorts last and is dropped
        _series(ax, x[order], np.array([r["util_pct"] for r in mine], float)[order], f"rank {rank}", f"C{i % 10}")
    top = max((r["util_pct"] for r in samples if r.get("util_pct") is not None), default=100.0)
    ax.set_ylim(0, max(100.0, top * 1.05))  # a percentage: 100 in view (a busy worker's CPU % may pass it)
    return _finish(fig, ax, marks, out / "utilisation.png")


def _plot_loss(steps, marks, out, evals=()):
    loss = _col(steps, "loss")
    fig, ax = _figure("Loss", "loss (global batch)")
    _series(ax, _col(steps, "step"), loss, "loss", "tab:blue")
    if evals:  # held-out loss at its few steps: points joined, on the same axis as the training loss
        ev = np.array([r["loss"] for r in evals], float)
        ax.plot([r["step"] for r in evals], ev, "o-", color="tab:orange", label="eval loss (held-out)")
        loss = np.concatenate([loss, ev])
    finite = loss[np.isfinite(loss)]
    if finite.size and finite.min() > 0 and finite.max() / finite.min() > 100:  # decades of decline
        ax.set_yscale("log")
    return _finish(fig, ax, marks, out / "loss.png")
