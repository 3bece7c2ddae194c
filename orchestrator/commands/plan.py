"""`gearshift plan JOB.yaml --cluster SPEC`: predicted step time per layout and bucket size on
hardware described by a preset or a small YAML, and a recommendation (orchestrator/costmodel.py);
with `--slow RANKS@SPEED`, ranks at a share of full speed, each layout on even shares and
rebalanced to the speeds (orchestrator/policy/speeds.py)."""

from __future__ import annotations

import pathlib

import yaml

from gearshift.orchestrator.policy import costmodel
from gearshift.orchestrator.policy import job_shape
from gearshift.orchestrator.policy import calibration
from gearshift.orchestrator.policy import hardware
from gearshift.orchestrator.policy import speeds as uneven
from gearshift.orchestrator.errors import UsageError


def read_yaml_arg(flag: str, text: str, what: str = "a file"):
    """The YAML document in the file an option names; a clear error for a missing or broken one."""
    path = pathlib.Path(text)
    if not path.is_file():
        raise UsageError(f"{flag} {text!r} is not {what}")
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UsageError(f"{flag} {text}: not valid YAML ({str(err).splitlines()[0]})") from None


def load_cluster(text: str, nodes: int | None = None) -> costmodel.Hardware:
    """A preset name, or a YAML file holding a spec (see hardware.hardware_from_spec); `nodes`
    resizes it."""
    spec = text if text in hardware.PRESETS else read_yaml_arg(
        "--cluster", text, f"a preset ({', '.join(hardware.PRESETS)}) nor a file")
    try:
        hw = hardware.hardware_from_spec(spec)
    except ValueError as err:
        raise UsageError(f"--cluster {text}: {err}") from None
    if nodes is not None:
        if nodes < 1:
            raise UsageError(f"--nodes {nodes}: at least 1")
        hw = hardware.with_nodes(hw, nodes)
    return hw


def _differences(ours, theirs) -> list[str]:
    """What of the model and its arithmetic differs between two jobs, as `field: ours vs theirs`."""
    out = []
    from gearshift.orchestrator.job import credentials  # noqa: PLC0415

    a, b = credentials.mask(ours.to_dict()), credentials.mask(theirs.to_dict())  # printed: no credential
    for section, key in (("model", None), ("train", "activation_checkpointing"), ("train", "precision")):
        x, y = (a[section], b[section]) if key is None else (a[section].get(key), b[section].get(key))
        if x != y:
            out.append(f"{section if key is None else f'{section}.{key}'}: {x!r} here, {y!r} in the run")
    return out


def calibrated(job, model: costmodel.ModelShape, hw: costmodel.Hardware, run_dirs: list[str]
               ) -> tuple[costmodel.ModelShape, costmodel.Hardware, list[str]]:
    """The cluster's figures with what runs of the job's model measured in their place
    (calibration.fit_runs), and a line per run saying what it gave."""
    if not run_dirs:
        return model, hw, []
    import json  # noqa: PLC0415

    from gearshift.orchestrator.job import JobError, load_job  # noqa: PLC0415

    runs = []
    for text in run_dirs:
        run_dir = pathlib.Path(text)
        telemetry, job_file = run_dir / "telemetry.jsonl", run_dir / "job.yaml"
        if not telemetry.is_file() or not job_file.is_file():
            raise UsageError(f"--calibrate {text}: not a run directory (it needs telemetry.jsonl and job.yaml)")
        try:
            theirs = load_job(job_file)
        except JobError as err:
            raise UsageError(f"--calibrate {text}: its job.yaml does not load ({err})") from None
        differ = _differences(job, theirs)
        if differ:
            raise UsageError(f"--calibrate {text}: that run trained a different model or arithmetic "
                             f"({'; '.join(differ)}): calibrate from runs of this job's model")
        records = []
        for line in telemetry.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash
        runs.append((text, records, theirs.train.global_batch_size))
    try:
        model, hw, notes = calibration.fit_runs(model, hw, runs)
    except ValueError as err:
        raise UsageError(f"--calibrate: {err}") from None
    return model, hw, [f"calibrated from {note}" for note in notes]


def global_batch(args, job) -> int:
    if args.global_batch is None:
        return job.train.global_batch_size
    if args.global_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch}: at least 1")
    return args.global_batch


def with_device_memory(hw: costmodel.Hardware, gib: float | None) -> costmodel.Hardware:
    """`hw` with --device-memory's figure (GiB, as devices are sold) in place of the spec's."""
    if gib is None:
        return hw
    if not gib > 0:
        raise UsageError(f"--device-memory {gib}: a size in GiB > 0")
    return costmodel.replace(hw, device_memory=gib * costmodel.GiB)


def slow_speeds(texts: list[str], world: int) -> tuple[float, ...] | None:
    """--slow RANKS@SPEED (repeatable, a later one winning for a rank both name): every rank's share
    of full speed; None where no --slow is given."""
    if not texts:
        return None
    speeds = [1.0] * world
    for text in texts:
        ranks, speed = _slow_entry(text, world)
        for r in ranks:
            speeds[r] = speed
    return tuple(speeds)


def _slow_entry(text: str, world: int) -> tuple[list[int], float]:
    allowed = (f"allowed: RANKS@SPEED, RANKS ranks of 0-{world - 1} as a rank, a range or a list (3, 8-15, 0,4-5), "
               "SPEED a share of full speed in (0, 1] (0.5: half speed)")
    head, _, tail = text.partition("@")
    try:
        speed = float(tail)
        ranks = []
        for part in head.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if first > last:
                raise UsageError(f"--slow {text}: the range {first}-{last} runs backwards; {allowed}")
            ranks += range(first, last + 1)
    except ValueError:
        raise UsageError(f"--slow {text}: not RANKS@SPEED; {allowed}") from None
    if not 0 < speed <= 1:
        raise UsageError(f"--slow {text}: speed {tail} is not a share of full speed; {allowed}")
    if max(ranks) >= world:
        raise UsageError(f"--slow {text}: rank {max(ranks)} is past the cluster's {world} devices; {allowed}")
    return ranks, speed


def at_speeds(preds: list[costmodel.Prediction], batch: int, speeds: tuple[float, ...] | None, job
              ) -> list[tuple[costmodel.Prediction, uneven.Priced | None]]:
    """Each prediction as the run would have it at `speeds` (rebalanced where the job's
    adapt.stragglers rebalances and that moves samples, else on even shares) with both figures,
    fastest first; as they are where no speeds are given."""
    if speeds is None:
        return [(p, None) for p in preds]
    mode = job.adapt.stragglers
    priced = [uneven.price(p, batch, speeds, job.train.micro_batch_size) for p in preds]
    return sorted(((q.run(mode), q) for q in priced), key=lambda pq: pq[0].step_s)


def layout_memory(job, model: costmodel.ModelShape, hw: costmodel.Hardware, batch: int,
                  preds: list[costmodel.Prediction]) -> dict[tuple[int, int, int, int], tuple[dict, bool, dict]]:
    """(dp, tp, shard, pp) -> (memory breakdown per rank, whether it fits the device, what fits says)."""
    from gearshift.orchestrator.policy import pipeline_cost

    settings = job_shape.memory_settings(job)
    out = {}
    for p in preds:
        key = layout_key(p)
        if key not in out:
            if p.pp > 1:
                mem = pipeline_cost.memory(model, p.pp, p.dp, global_batch=batch, microbatches_=p.microbatches, tp=p.tp,
                                           overhead=hw.memory_overhead, **settings)
            else:
                mem = costmodel.memory(model, p.dp, p.tp, p.shard, global_batch=batch, overhead=hw.memory_overhead,
                                       **settings)
            out[key] = (mem, *costmodel.fits(mem, hw.device_memory))
    return out


def layout_key(p: costmodel.Prediction) -> tuple[int, int, int, int]:
    return (p.dp, p.tp, p.shard, p.pp)


def recommendation(best: costmodel.Prediction, hw: costmodel.Hardware) -> str:
    """The job settings that ask for `best`."""
    words = [f"strategy {best.strategy}"]
    if best.pp > 1:
        words.append(f"pp_size {best.pp}, pp_microbatches {best.microbatches}")
    if best.tp > 1:
        words.append(f"tp_size {best.tp}")
    if best.strategy == "hsdp":
        words.append(f"shard_size {best.shard}")
    if best.tp > 1 and best.shard > 1:
        words.append("dp_shard true")
    if best.dp > 1 and best.shard == 1 and best.pp == 1:
        words.append(f"bucket_cap_mb {best.bucket_cap_mb:g}")
    if best.tp > hw.per_node or hw.per_node % best.tp:
        words.append("tp_across_nodes true")
    return ", ".join(words)


def _rebalanced(q: uneven.Priced | None) -> dict:
    """What --json says of a layout at unequal speeds beside its even-share figures."""
    if q is None:
        return {}
    if q.rebalanced is None:
        return {"rebalanced": None}
    r = q.rebalanced
    return {"rebalanced": {"shares": list(q.shares), "step_s": r.step_s, "compute_s": r.compute_s,
                           "comm_wait_frac": r.comm_wait_frac, "samples_per_s": r.samples_per_s}}


def _print_json(model, hw, batch, notes, rows, memory, best, speeds, mode) -> None:
    import json  # noqa: PLC0415

    def row(pq):
        _, q = pq
        p = q.even if q is not None else pq[0]
        mem, ok, said = memory[layout_key(p)]
        # sharded state has no all-reduce buckets: FSDP moves a unit at a time (nor has a pipeline's average)
        bucket = {"bucket_cap_mb": None} if p.shard > 1 or p.pp > 1 else {}
        return {"strategy": p.strategy, "layout": p.label, **p.to_dict(), **bucket, **_rebalanced(q), "memory": mem,
                "fits": ok, **said}

    print(json.dumps({"model": {"name": model.name, "params": model.params, "flops_per_sample": model.flops_per_sample,
                                "tp_overhead_flops": model.tp_overhead_flops,
                                "activations_modelled": model.activations is not None},
                      "cluster": {"name": hw.name, "nodes": hw.nodes, "per_node": hw.per_node, "flops": hw.flops,
                                  "intra": vars(hw.intra), "inter": vars(hw.inter),
                                  "device_memory": hw.device_memory or None,
                                  "memory_overhead": vars(hw.memory_overhead)},
                      "speeds": list(speeds) if speeds else None, "stragglers": mode if speeds else None,
                      "global_batch": batch, "calibration": notes,
                      "recommended": row(best) if best is not None else None,
                      "predictions": [row(pq) for pq in rows]}))


def _print_table(model, hw, batch, rows, memory) -> None:
    """A row per layout at its best bucket size, in `rows`' order; at unequal speeds the step on
    even shares and rebalanced."""
    best_per_layout: dict[tuple[int, int, int, int], tuple] = {}
    for pq in rows:
        best_per_layout.setdefault(layout_key(pq[0]), pq)
    device = f", {hw.device_memory / costmodel.GiB:.3g} GiB each" if hw.device_memory else ""
    print(f"{model.name}: {model.params / 1e6:,.1f} M parameters, {model.flops_per_sample / 1e9:,.1f} GFLOP per "
          f"sample; global batch {batch}; {hw.name or 'cluster'}: {hw.nodes} x {hw.per_node} devices at "
          f"{hw.flops / 1e12:.3g} TFLOP/s{device}")
    names = {key: f"{p.label} {p.dp}x{p.tp}" if p.pp == 1 else f"pipeline {p.pp}x{p.dp} m{p.microbatches}"
             for key, (p, _) in best_per_layout.items()}
    width = max(16, max(len(n) for n in names.values()) + 1)
    priced = rows[0][1] is not None
    print(f"{'layout':<{width}}{'bucket MB':>10}" + (f"{'even ms':>10}{'rebalanced':>12}" if priced else
                                                      f"{'step ms':>10}")
          + f"{'compute':>9}{'comm wait':>11}{'samples/s':>12}{'GiB/rank':>10}")
    for key, (p, q) in best_per_layout.items():
        mem, ok, said = memory[key]
        p = q.even if q is not None else p
        bucket = f"{p.bucket_cap_mb:g}" if p.dp > 1 and p.shard == 1 and p.pp == 1 else "-"
        rebalanced = "" if q is None else f"{q.rebalanced.step_s * 1e3:>12.1f}" if q.rebalanced else f"{'-':>12}"
        print(f"{names[key]:<{width}}{bucket:>10}{p.step_s * 1e3:>10.1f}{rebalanced}{p.compute_s * 1e3:>9.1f}"
              f"{p.comm_wait_frac:>11.1%}{p.samples_per_s:>12,.1f}{mem['total'] / costmodel.GiB:>10.1f}"
              + ("" if ok else f"  {said['reason']}"))


def _speeds_lines(speeds: tuple[float, ...], mode: str, pipelines: bool) -> list[str]:
    """What the table at unequal speeds shows, said under it."""
    slow = sorted(set(speeds) - {1.0})
    said = "; ".join(f"ranks {uneven.ranks_text([r for r, s in enumerate(speeds) if s == v])} at {v:g} of full speed"
                     for v in slow) or "every rank at full speed"
    lines = [f"speeds: {said}. even ms: equal shares of the batch, the step waiting for the slowest replica; "
             "rebalanced: shares in proportion to the replicas' speeds (-: nothing to move)"]
    if mode in uneven.REBALANCING:
        lines.append(f"ranked by the rebalanced step (this job's adapt.stragglers: {mode})")
    else:
        lines.append(f"ranked by the even-share step (this job's adapt.stragglers: {mode}: its shares stay even)")
    if pipelines:
        lines.append("pipelines: the slowest stage holds the step, cut as for equal devices (a run moves a slow stage's blocks live; not priced here)")
    return lines


def _recommended(best, q, hw, memory) -> str:
    step = f"{best.step_s * 1e3:.1f} ms a step"
    if q is not None and q.rebalanced is best:
        step += f" rebalanced, {q.even.step_s * 1e3:.1f} on even shares"
    return (f"recommended: {recommendation(best, hw)} ({step}, comm wait {best.comm_wait_frac:.0%}, "
            f"{memory[layout_key(best)][0]['total'] / costmodel.GiB:.1f} GiB a rank)")


def cmd_plan(args) -> int:
    from gearshift.orchestrator.job import load_job

    job = load_job(args.job, args.overrides)
    hw = with_device_memory(load_cluster(args.cluster, args.nodes), getattr(args, "device_memory", None))
    model, hw, notes = calibrated(job, job_shape.shape_of_job(job), hw, args.calibrate)
    batch = global_batch(args, job)
    speeds = slow_speeds(getattr(args, "slow", None) or [], hw.devices)
    from gearshift.orchestrator.policy import pipeline_cost

    preds = pipeline_cost.plan(model, hw, batch)  # every layout, the pipelines too
    if not preds:
        raise UsageError(f"no layout of {hw.devices} devices divides the global batch {batch}: use "
                         f"--global-batch with a multiple of {hw.devices}")
    memory = layout_memory(job, model, hw, batch, preds)
    rows = at_speeds(preds, batch, speeds, job)
    # a layout predicted not to fit the device is never recommended, however fast
    best = next((pq for pq in rows if memory[layout_key(pq[0])][1]), None)
    if args.json:
        _print_json(model, hw, batch, notes, rows, memory, best, speeds, job.adapt.stragglers)
        return 0
    for note in notes:
        print(note)
    _print_table(model, hw, batch, rows, memory)
    if speeds is not None:
        print("\n".join(_speeds_lines(speeds, job.adapt.stragglers, any(p.pp > 1 for p in preds))))
    if best is None:
        least = min(m["total"] for m, _, _ in memory.values())
        print(f"recommended: none: no layout fits {hw.device_memory / costmodel.GiB:.3g} GiB a device (the "
              f"smallest needs {least / costmodel.GiB:.1f} GiB); use more devices, a smaller micro-batch or "
              "activation checkpointing")
    else:
        print(_recommended(*best, hw, memory))
    if model.tp_boundaries == 0:
        print("note: this model's tensor-parallel activations are not modelled (only the built-in GPT's are): "
              "tensor and hybrid rows count their compute and gradient traffic only")
    if model.activations is None:
        print("note: this model's activations are not modelled (only the built-in GPT's and MLP's are): "
              "GiB/rank counts parameters, gradients, optimizer state and overhead only")
    return 0
