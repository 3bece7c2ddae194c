"""The path from the command to the first step, stage by stage.

Each stage is marked when it ends, in seconds since the command's process started (so Python's
own start and the imports count too): the job checked, Ray up, the workers placed, their
processes up (Python, Ray and torch imported), the process group joined, strategy auto's start
chosen (the workers' probe, where it chooses by prediction), the model built, the first step done. The controller reports them once, as the `startup` event and a terminal line.
"""

from __future__ import annotations

import time

_ORDER = ("imports", "job", "ray", "placement", "workers", "rendezvous", "start_layout", "build", "first_step")


def _process_start() -> float:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # no psutil, or no /proc: count from the first mark instead
        return time.time()


class Startup:
    def __init__(self) -> None:
        self.origin = _process_start()
        self.marks: dict[str, float] = {}
        self.reported = False

    def begin(self) -> None:
        """A new run in this process: the first counts from the process's start (its imports
        included), a later one (a test, a notebook) from now."""
        if self.marks or self.reported:
            self.origin = time.time()
        self.marks, self.reported = {}, False

    def mark(self, stage: str, at: float | None = None) -> None:
        """`stage` ended now (or at `at`, Unix seconds); the first mark of a stage counts."""
        self.marks.setdefault(stage, (at or time.time()) - self.origin)

    def stages(self) -> list[dict]:
        """[{stage, at, took}] in order, `took` since the stage before it."""
        out, before = [], 0.0
        for stage in _ORDER:
            if stage in self.marks:
                at = self.marks[stage]
                out.append({"stage": stage, "at": round(at, 3), "took": round(at - before, 3)})
                before = at
        return out

    def text(self) -> str:
        stages = self.stages()
        if not stages:
            return ""
        parts = ", ".join(f"{s['stage'].replace('_', ' ')} {s['took']:.1f}" for s in stages)
        return f"startup: {stages[-1]['at']:.1f} s to the first step ({parts})"


def build_lines(built: dict, loaded: bool) -> list[str]:
    """What the workers' first build (workers/build/builder.py, Builder.info) says at a run's start: a
    sharded layout built whole, and why; how the initial values are made (model.init), unless a
    checkpoint replaces them."""
    lines = []
    if built.get("why"):  # a sharded layout, yet every rank built the whole model
        lines.append(f"build: the whole model on every rank, not on the meta device: {built['why']}")
    if built.get("init") and not loaded:  # exact or per_shard (workers/build/shard_init.py)
        whole = len(built.get("drawn_whole") or ())
        lines.append(f"init: {built['init']} ({built['init_why']})" + (f", {whole} tensors drawn whole" if whole else ""))
    return lines


def load_pretrained(group, spec: dict, report, source) -> None:
    """A fresh start from model.pretrained: each rank reads its slices of the weights (and, under
    `hash: full`, hashes its share of every byte, recorded in the run's source.json at `source`);
    the `pretrained` event says what each read."""
    from gearshift.orchestrator.records import provenance

    loaded = group.call("load_pretrained")
    if spec["hash"] == "full":
        provenance.add_slices(source, loaded)
    cast, whole = loaded[0].get("cast") or {}, loaded[0].get("read_whole") or []
    if cast:  # a checkpoint in another dtype than the model trains in
        report.say("pretrained: " + ", ".join(f"{n} tensors {how}" for how, n in sorted(cast.items()))
                   + ", converted as they are read")
    if whole:  # a conversion that is not read by slices
        report.say("pretrained: read whole on every rank that holds a piece (their conversion is not read by slices): "
                   + ", ".join(f"{w['tensor']} ({w['bytes'] / 2**20:.1f} MiB)" for w in whole[:4]))
    report.event("pretrained", path=spec["path"], prefix=spec["prefix"], tensors=loaded[0].get("tensors"),
                 cast=cast, read_whole=whole,
                 seconds=max(p.get("seconds", 0.0) for p in loaded), rank_bytes=[p.get("bytes") for p in loaded],
                 device=[p.get("memory") for p in loaded], **({"hashed": "full"} if spec["hash"] == "full" else {}))


STARTUP = Startup()
