"""`gearshift runs` (a table of runs), `gearshift runs diff A B` (the job fields two runs differ
in) and `gearshift replay RUN` (run a recorded job again, and say whether it ended bit-equal).

A run is named by its directory or by its fingerprint (any unique prefix of one) under the runs
root. The table reads each run's small JSON files; only runs without a summary, or running now,
have their telemetry glanced at (its first and last few kilobytes, never the whole file).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
import time

from gearshift.orchestrator.errors import UsageError

_GLANCE_BYTES = 64 * 1024  # of telemetry.jsonl, from each end, for a run without a summary
_NAMED = re.compile(r"-([0-9a-f]{8})-\d{8}-\d{6}(?:-\d+)?$")  # <name>-<fingerprint>-<time>[-n]
_COLUMNS = ("FINGERPRINT", "NAME", "STARTED", "STATUS", "STEPS", "FINAL LOSS", "BEST EVAL", "SAMPLES/S",
            "LAYOUTS", "RUN DIR")


def add_parsers(sub) -> None:
    runs = sub.add_parser("runs", help="a table of the runs under runs/; `runs diff A B`: the job fields two "
                                       "runs differ in")
    runs.add_argument("--root", help="where the runs are (default: GEARSHIFT_RUNS_ROOT, else ./runs)")
    actions = runs.add_subparsers(dest="runs_command", metavar="diff")
    diff = actions.add_parser("diff", help="the job fields in which run A and run B differ")
    diff.add_argument("a", metavar="A", help="a run dir, or a fingerprint (a unique prefix is enough)")
    diff.add_argument("b", metavar="B", help="as A")
    diff.add_argument("--root", default=argparse.SUPPRESS, help="as for runs")

    replay = sub.add_parser("replay", help="run a recorded run's resolved job again (same seed, entry points "
                                           "and layout) and compare its final.pt with the original's")
    replay.add_argument("run", metavar="RUN_DIR|FINGERPRINT", help="the run to replay")
    replay.add_argument("--run-dir", help="where the replay's files go (default: a new dir under runs/)")
    replay.add_argument("--root", help="where to look a fingerprint up, and where the replay goes (default: "
                                       "GEARSHIFT_RUNS_ROOT, else ./runs)")
    replay.add_argument("--address", help="join this Ray cluster (default: RAY_ADDRESS, else start one here)")
    replay.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="give back a credential the run's job.yaml masks, e.g. --set "
                             "'checkpoint.storage_options.secret=${S3_SECRET}'; other fields change the replay")


# ----------------------------------------------------------------------------- finding runs


def list_runs(root: str | None = None) -> list:
    """Every run dir (a folder holding job.yaml) directly under the runs root, oldest first."""
    from gearshift.orchestrator.records.rundir import RunDir, runs_root

    base = pathlib.Path(runs_root(root))
    if not base.is_dir():
        return []
    runs = [RunDir(p) for p in base.iterdir() if (p / "job.yaml").is_file()]
    return sorted(runs, key=_started)


def find_run(ident: str, root: str | None = None):
    """The run `ident` names: a run dir (or its name under the runs root), else a fingerprint or a
    unique prefix of one."""
    from gearshift.orchestrator.records.rundir import RunDir, runs_root

    path = pathlib.Path(ident)
    if not path.exists() and (pathlib.Path(runs_root(root)) / ident / "job.yaml").is_file():
        path = pathlib.Path(runs_root(root)) / ident  # the RUN DIR column's name
    if path.exists():
        if not (path / "job.yaml").is_file():
            raise UsageError(f"{path} is not a gearshift run directory: it has no job.yaml, which every run "
                             "directory holds from the moment its run starts. Name a run directory as "
                             "`gearshift runs` lists them, or a run's fingerprint (a unique prefix is enough).")
        return RunDir(path)
    where = runs_root(root)
    if not re.fullmatch(r"[0-9a-f]{1,64}", ident):
        raise UsageError(f"{ident!r} is neither a directory nor a fingerprint (hex digits, as `gearshift runs` "
                         f"lists them under {where}/).")
    runs = list_runs(root)
    matches = [r for r in runs if any(fp.startswith(ident) for fp in _fingerprints(r))]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        known = ", ".join(sorted({_fingerprints(r)[0] for r in runs if _fingerprints(r)})[:20]) or "none"
        raise UsageError(f"no run under {where}/ has a fingerprint starting {ident!r} (fingerprints there: "
                         f"{known}). Name the run by its directory, or look under another root with --root.")
    listed = "; ".join(f"{_fingerprints(r)[0]} {r.path}" for r in matches[:20])
    raise UsageError(f"fingerprint {ident!r} is ambiguous: {len(matches)} runs under {where}/ match ({listed}). "
                     "Name one by its run directory, or give more of the fingerprint.")


def _fingerprints(run) -> list[str]:
    """The run's fingerprints: as created, and as last run (a resume with more steps changes it)."""
    found = [(_read_json(run.meta) or {}).get("fingerprint"), (_read_json(run.summary) or {}).get("fingerprint")]
    named = _NAMED.search(run.path.name)
    found.append(named.group(1) if named else None)
    return list(dict.fromkeys(f for f in found if isinstance(f, str)))


def _started(run) -> float:
    created = (_read_json(run.meta) or {}).get("created")
    return created if isinstance(created, (int, float)) else run.path.stat().st_mtime


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _read_job(run) -> dict:
    from gearshift.serving.source import read_job

    return read_job(run)


# ----------------------------------------------------------------------------- the table


def cmd_runs(args) -> int:
    if getattr(args, "runs_command", None) == "diff":
        return cmd_diff(args)
    from gearshift.orchestrator.records.rundir import runs_root

    runs = list_runs(args.root)
    if not runs:
        print(f"no runs under {runs_root(args.root)}/", file=sys.stderr)
        return 0
    print(format_table([run_row(r) for r in runs]))
    return 0


def run_row(run) -> dict:
    """One line of the table, from run.json, summary.json and driver.json; from a glance at the
    telemetry only where the summary is missing or older than the run now going on."""
    meta = _read_json(run.meta) or {}
    summary = _read_json(run.summary)
    status = _status(run, summary)
    s = summary if isinstance(summary, dict) and status != "running" else {}
    glance = _glance(run.telemetry) if not s else {}
    fps = _fingerprints(run) or ["-"]
    name = meta.get("name") or (summary or {}).get("job") or _job_name(run)
    steps, target = s.get("steps_done", glance.get("step")), s.get("steps_target", glance.get("target"))
    history = s.get("strategy_history") or glance.get("layouts") or []
    return {"FINGERPRINT": s.get("fingerprint") or fps[0],
            "NAME": name,
            "STARTED": time.strftime("%Y-%m-%d %H:%M", time.localtime(_started(run))),
            "STATUS": status,
            "STEPS": "-" if steps is None else f"{steps}/{target}" if target else str(steps),
            "FINAL LOSS": _num(s.get("final_loss", glance.get("loss"))),
            "BEST EVAL": _num(s.get("best_eval_loss")),
            "SAMPLES/S": _num(s.get("samples_per_s"), "{:,.0f}"),
            "LAYOUTS": _layouts(history),
            "RUN DIR": run.path.name}


def _job_name(run) -> str:
    try:
        return str(_read_job(run).get("name", "?"))
    except UsageError:  # a damaged job.yaml: the table still lists the run
        return "?"


def _status(run, summary) -> str:
    """done / failed / interrupted as the summary says; running while its driver lives (a resumed
    run's old summary does not count); killed when the driver is gone and wrote no summary."""
    alive = run.driver_alive()
    driver = _read_json(run.driver) or {}
    if alive and (summary is None or run.summary.stat().st_mtime < driver.get("started", 0)):
        return "running"
    if isinstance(summary, dict) and summary.get("status"):
        return str(summary["status"])
    return {False: "killed", None: "unknown"}.get(alive, "running")


def _glance(telemetry: pathlib.Path) -> dict:
    """Last step and loss, target and layouts seen, from the first and last few kB of telemetry."""
    try:
        with telemetry.open("rb") as f:
            head = f.read(_GLANCE_BYTES)
            size = f.seek(0, 2)
            f.seek(max(len(head), size - _GLANCE_BYTES))
            tail = f.read()
    except OSError:
        return {}
    out: dict = {"layouts": []}
    for line in (head + tail).splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a line cut by the glance's edges, or being written
        if not isinstance(rec, dict):
            continue
        layout = rec.get("layout") if rec.get("state") == "starting" else None
        if rec.get("type") == "step":
            out.update(step=rec.get("step"), loss=rec.get("loss"))
            layout = {k: rec.get(k) for k in ("strategy", "dp", "tp")}
        elif rec.get("state") == "training" and rec.get("steps_target"):
            out["target"] = rec["steps_target"]
        last = out["layouts"][-1] if out["layouts"] else None
        if isinstance(layout, dict) and (last is None or _layout_text(last) != _layout_text(layout)):
            out["layouts"].append(layout)
    return out


def _layouts(history: list) -> str:
    seen: list[str] = []
    for h in history:
        text = _layout_text(h) if isinstance(h, dict) else "?"
        if text not in seen:
            seen.append(text)
    return ", ".join(seen) or "-"


def _layout_text(h: dict) -> str:
    return f"{h.get('strategy')} {h.get('dp')}x{h.get('tp')}" + (f" shard {h['shard']}" if h.get("shard") else "")


def _num(value, fmt: str = "{:.4f}") -> str:
    return fmt.format(value) if isinstance(value, (int, float)) else "-"


def format_table(rows: list[dict]) -> str:
    right = {"STEPS", "FINAL LOSS", "BEST EVAL", "SAMPLES/S"}
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in _COLUMNS}

    def line(values: dict) -> str:
        cells = [str(values[c]).rjust(widths[c]) if c in right else str(values[c]).ljust(widths[c]) for c in _COLUMNS]
        return "  ".join(cells).rstrip()

    return "\n".join([line({c: c for c in _COLUMNS})] + [line(r) for r in rows])


# ----------------------------------------------------------------------------- diff


def job_differences(a: dict, b: dict) -> list[tuple[str, object, object]]:
    """(field, value in a, value in b) for each job field in which the two differ."""
    from gearshift.orchestrator.records.rundir import _flatten

    fa, fb = _flatten(a), _flatten(b)
    out = []
    for key in sorted(set(fa) | set(fb), key=lambda k: [str(p) for p in k]):
        va, vb = fa.get(key, ABSENT), fb.get(key, ABSENT)
        if va != vb:
            out.append((".".join(map(str, key)), va, vb))
    return out


ABSENT = type("Absent", (), {"__repr__": lambda self: "(absent)"})()  # a field one of the jobs lacks


def _show(value) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value, default=str)


def cmd_diff(args) -> int:
    root = getattr(args, "root", None)
    a, b = find_run(args.a, root), find_run(args.b, root)
    rows = job_differences(_read_job(a), _read_job(b))
    print(f"A: {a.path}\nB: {b.path}")
    if not rows:
        print("the two runs' jobs are the same in every field")
        return 0
    cells = [(k, _show(va), _show(vb)) for k, va, vb in rows]
    w = [max(len(c[i]) for c in cells + [("FIELD", "A", "B")]) for i in range(3)]
    for c in [("FIELD", "A", "B")] + cells:
        print(f"{c[0].ljust(w[0])}  {c[1].ljust(w[1])}  {c[2]}".rstrip())
    return 0


# ----------------------------------------------------------------------------- replay


def cmd_replay(args) -> int:
    from gearshift import api
    from gearshift.monitoring.progress import ProgressView
    from gearshift.orchestrator.records.rundir import RunDir
    from gearshift.workers.state.checkpoint import write_file_atomic

    original = find_run(args.run, args.root)
    for line in source_warnings(original):
        print(f"gearshift: warning: {line}", file=sys.stderr)
    # validates, with the entry points looked up where the run found them and its ${VAR}s read here
    job = original.load_job(getattr(args, "overrides", None))
    for line in _caveats(original, job):
        print(f"gearshift: note: {line}", file=sys.stderr)
    script = _script(original)
    if script is not None and script.moves + (script.start is not None and job.parallel.strategy == "auto"):
        print(f"gearshift: replaying the original's decisions at their steps ({script.describe()}); "
              "no new one is taken", file=sys.stderr)
    run = RunDir.create(job, args.run_dir, args.root)
    meta = {**(_read_json(run.meta) or {}), "replay_of": str(original.path.resolve())}
    write_file_atomic(run.meta, json.dumps(meta, indent=2).encode())
    api.train(job, run, None, address=getattr(args, "address", None), view=ProgressView(), script=script)
    if original.final.is_file() and run.final.is_file():
        print(f"gearshift: replay of {original.path}: {compare_finals(original.final, run.final)}", file=sys.stderr)
    return 0


def source_warnings(run) -> list[str]:
    """One line per difference between what the run was recorded with and what is here now."""
    from gearshift.orchestrator.records import provenance

    recorded = provenance.read(run.source)
    if recorded is None:
        return [f"{run.source} is missing or unreadable: the code and package versions the run used are "
                "unknown, so the replay cannot check them"]
    base_dir = recorded.get("base_dir") or (_read_json(run.meta) or {}).get("base_dir", ".")
    return provenance.differences(recorded, provenance.collect(_read_job(run), base_dir))


def _script(original):
    """The original's decisions (orchestrator/control/script.py), or None where its records cannot
    be read (then the replay decides anew, and `_caveats` says so)."""
    from gearshift.orchestrator.control.script import Script, ScriptError

    try:
        return Script.of_run(original.telemetry, _read_json(original.summary))
    except ScriptError:
        return None


def _caveats(original, job) -> list[str]:
    out = []
    status = (_read_json(original.summary) or {}).get("status")
    if status != "done":
        out.append(f"{original.path} did not finish (status {status or 'unknown'}): there is no final "
                   "state to compare the replay with")
    if _script(original) is None:
        out.append(f"{original.telemetry} cannot be read: the original's decisions (switches, "
                   "shares, recuts) are unknown, so the replay takes its own, which follow this machine's timing, "
                   "and may end elsewhere")
    return out


def compare_finals(a: pathlib.Path, b: pathlib.Path) -> str:
    """Whether two final.pt files hold the same tensors bit for bit, in a line."""
    import torch

    sa = torch.load(a, map_location="cpu", weights_only=True, mmap=True)
    sb = torch.load(b, map_location="cpu", weights_only=True, mmap=True)
    if set(sa) != set(sb):
        return f"final.pt holds other tensors than the original's ({sorted(set(sa) ^ set(sb))[:5]})"
    differ = [k for k in sa if sa[k].dtype != sb[k].dtype or sa[k].shape != sb[k].shape
              or not torch.equal(sa[k], sb[k])]
    if not differ:
        return f"final.pt is bit-equal to the original's ({len(sa)} tensors)"
    gaps = [(sa[k].double() - sb[k].double()).abs().max().item() for k in differ
            if sa[k].shape == sb[k].shape and sa[k].is_floating_point()]
    largest = f"largest difference {max(gaps):.3g}, " if gaps else ""
    return f"final.pt differs from the original's in {len(differ)} of {len(sa)} tensors ({largest}first {differ[0]})"
