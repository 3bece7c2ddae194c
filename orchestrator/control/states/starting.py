"""STARTING: the placed workers are told what they are (announced once, with what they built and
how they reach the checkpoints), the checkpoint loaded into them (the resume point, or after a
failure the one a restart chose), and the layout and bucket in force when they were lost put
back; then training begins at the loaded step."""

from __future__ import annotations

import dataclasses

from gearshift.orchestrator.control import startup
from gearshift.orchestrator.control.bucket_tuning import initial_bucket
from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.control.states.placing import node_sizes
from gearshift.orchestrator.records.rundir import earlier_history
from gearshift.strategies.layout import Layout

_ANNOUNCED = ("rank", "dp_rank", "node_ip", "node_id", "pid", "gpu_ids", "backend", "compiled")


class StartingState:
    name = State.STARTING

    def __init__(self, ctl):
        self.ctl = ctl

    def run(self) -> State:
        """Restore the checkpoint into the started workers, and the layout and bucket in force."""
        ctl = self.ctl
        infos, restart = ctl.infos, ctl.restart
        started = Layout.from_dict(infos[0]["layout"]) if infos[0].get("layout") else None
        if started is not None and started != ctl.job.layout and ctl.job.layout.strategy == "hsdp":
            ctl.job = dataclasses.replace(ctl.job, parallel=dataclasses.replace(  # hsdp's group, by placement
                ctl.job.parallel, shard_size=infos[0]["layout"].get("shard", 1)))
        self._announce(infos, restart)
        ctl.tokens_per_sample = infos[0].get("tokens_per_sample")
        start_step = self._load(restart)
        self._restore_layout(start_step, restart)
        ctl.summary.update(world_size=len(infos), backend=infos[0].get("backend"),
                           nodes=sorted({i["node_ip"] for i in infos}), parameters=infos[0].get("parameters"),
                           strategy_history=ctl.history, switches=ctl.switches, tuning=ctl.tuning.rounds,
                           failures=ctl.recovery.failures, non_finite_steps=ctl.report.skipped,
                           oom=ctl.memory.records, resizes=ctl.elastic.resizes,
                           rollbacks=ctl.nan_rollback.rollbacks)
        ctl.summary.setdefault("resumed_from_step", start_step if ctl.load and not restart else None)
        ctl.node_sizes = node_sizes(ctl.job, infos)
        ctl.enter(State.TRAINING, from_step=start_step, steps_target=ctl.job.train.steps)
        ctl.report.start_view(start_step)
        ctl.start_step = start_step
        ctl.states[State.TRAINING].begin(start_step)
        return State.TRAINING

    def _announce(self, infos: list[dict], restart: bool) -> None:
        """The `state` event of STARTING; on a run's first start, what the workers built that a
        user may want to change, and each rank's sampler."""
        ctl = self.ctl
        job, first = ctl.job, infos[0]
        ctl.enter(State.STARTING, workers=[{k: i.get(k) for k in _ANNOUNCED} for i in infos],
                  layout=job.layout.to_dict(), tp_groups=job.layout.tp_groups() if job.layout.tp > 1 else [],
                  **({"fsdp_units": first["fsdp_units"]} if first.get("fsdp_units") else {}),
                  **({"build": first["build"]} if first.get("build") else {}),
                  **({"recomputed": first["recomputed"]} if first.get("recomputed") is not None else {}),
                  **({"checkpoint_format": first["checkpoint_format"]} if first.get("checkpoint_format") else {}),
                  **({"checkpoint_served": True} if first.get("checkpoint_served") else {}))
        if restart:  # said at the run's start already
            return
        units = first.get("fsdp_units") or {}
        if units.get("found_by") == "none" and job.layout.shard > 1:  # sharded, one unit
            ctl.report.say(f"fsdp units: {units['note']}")
        if job.train.activation_checkpointing is True and job.model.entrypoint and first.get("recomputed") == 0:
            ctl.report.say("activation checkpointing: the model has no blocks to checkpoint (no FSDP units found); "
                           "name them in train.activation_checkpointing")
        self._say_how_checkpoints_go(first, next((i["checkpoint_unreached"] for i in infos
                                                  if i.get("checkpoint_unreached")), None))
        for line in startup.build_lines(first.get("build") or {}, loaded=bool(ctl.load)):
            ctl.report.say(line)
        for info in infos:
            if info.get("sampler"):
                ctl.report.event("sampler", rank=info["rank"], **info["sampler"])

    def _say_how_checkpoints_go(self, info: dict, unreached: str | None = None) -> None:
        """At a run's start: how the workers reach the checkpoints, where it costs, and, where a
        worker's probe of the place failed, what it said."""
        ctl = self.ctl
        if info.get("checkpoint_served"):
            ctl.report.say(f"checkpoints: the workers do not all see {ctl.checkpoint_root}; they write and read "
                           "their shards there through a file server on this node (give checkpoint.path a folder "
                           "every node shares, or an object store, to spare this node's network)")
        if info.get("checkpoint_format") == "full" and ctl.job.checkpoint.format == "auto":
            # some worker reaches the checkpoints' place by no route: the full format, gathered a tensor at a time
            ctl.report.say("checkpoints: not every worker reaches " + str(ctl.checkpoint_root) + ", so each "
                           "checkpoint is gathered whole, a tensor at a time, into one file (format full); "
                           "give checkpoint.path an object store or a folder every node shares to write shards"
                           + (f" (a worker's probe of it said: {unreached})" if unreached else ""))

    def _load(self, restart: bool) -> int:
        """The checkpoint, or pretrained weights, into the workers; the step they start at."""
        ctl = self.ctl
        if ctl.load:
            start_step, name = ctl.checkpoints.load_into(ctl.group, ctl.load)  # each worker checks its share
            ctl.finishing.loaded(start_step)
            ctl.report.event("restored" if restart else "resumed", checkpoint=name, step=start_step)
            return start_step
        if ctl.job.model.pretrained:  # a fresh start from pretrained weights: each rank reads its slices
            startup.load_pretrained(ctl.group, ctl.job.model.pretrained, ctl.report, ctl.run_dir.source)
        return 0

    def _restore_layout(self, start_step: int, restart: bool) -> None:
        """The workers start in the job's layout; after a failure the layout and bucket in force
        when they were lost come back."""
        ctl = self.ctl
        layout = self._start_layout()
        before = ctl.layout if restart else None
        ctl.layout = layout
        if restart:
            ctl.tuning.bucket = initial_bucket(ctl.job)
            if before is not None and before != layout and before.world == layout.world:
                ctl.switch(before, start_step, "restore")
            ctl.history = [h for h in ctl.history if h["step"] < start_step]
            ctl.history.append(ctl.history_entry(start_step, ctl.layout))
        else:
            earlier = earlier_history(ctl.run_dir, start_step) if ctl.resume else []
            ctl.history = earlier + [ctl.history_entry(start_step, layout)]

    def _start_layout(self) -> Layout:
        """The layout the workers were built in: the job's, or where strategy auto started."""
        chosen = (self.ctl.start_choice or {}).get("layout")
        return Layout.from_dict(chosen) if chosen else self.ctl.job.layout
