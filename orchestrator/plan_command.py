"""`gearshift plan JOB.yaml --cluster SPEC`: predicted step time per layout and bucket size on
hardware described by a preset or a small YAML, and a recommendation (orchestrator/costmodel.py)."""

from __future__ import annotations

import pathlib

import yaml

from orchestrator import costmodel
from orchestrator.errors import UsageError


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
    """A preset name, or a YAML file holding a spec (see costmodel.hardware_from_spec); `nodes`
    resizes it."""
    spec = text if text in costmodel.PRESETS else read_yaml_arg(
        "--cluster", text, f"a preset ({', '.join(costmodel.PRESETS)}) nor a file")
    try:
        hw = costmodel.hardware_from_spec(spec)
    except ValueError as err:
        raise UsageError(f"--cluster {text}: {err}") from None
    if nodes is not None:
        if nodes < 1:
            raise UsageError(f"--nodes {nodes}: at least 1")
        hw = costmodel.with_nodes(hw, nodes)
    return hw


def _differences(ours, theirs) -> list[str]:
    """What of the model and its arithmetic differs between two jobs, as `field: ours vs theirs`."""
    out = []
    a, b = ours.to_dict(), theirs.to_dict()
    for section, key in (("model", None), ("train", "activation_checkpointing"), ("train", "precision")):
        x, y = (a[section], b[section]) if key is None else (a[section].get(key), b[section].get(key))
        if x != y:
            out.append(f"{section if key is None else f'{section}.{key}'}: {x!r} here, {y!r} in the run")
    return out


def calibrated(job, model: costmodel.ModelShape, hw: costmodel.Hardware, run_dirs: list[str]
               ) -> tuple[costmodel.ModelShape, costmodel.Hardware, list[str]]:
    """The cluster's figures with what runs of the job's model measured in their place
    (costmodel.fit_runs), and a line per run saying what it gave."""
    if not run_dirs:
        return model, hw, []
    import json  # noqa: PLC0415

    from orchestrator.job import JobError, load_job  # noqa: PLC0415

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
        model, hw, notes = costmodel.fit_runs(model, hw, runs)
    except ValueError as err:
        raise UsageError(f"--calibrate: {err}") from None
    return model, hw, [f"calibrated from {note}" for note in notes]


def global_batch(args, job) -> int:
    if args.global_batch is None:
        return job.train.global_batch_size
    if args.global_batch < 1:
        raise UsageError(f"--global-batch {args.global_batch}: at least 1")
    return args.global_batch


def cmd_plan(args) -> int:
    from orchestrator.job import load_job

    job = load_job(args.job, args.overrides)
    hw = load_cluster(args.cluster, args.nodes)
    model, hw, notes = calibrated(job, costmodel.shape_of_job(job), hw, args.calibrate)
    batch = global_batch(args, job)
    preds = costmodel.plan(model, hw, batch)
    if not preds:
        raise UsageError(f"no layout of {hw.devices} devices divides the global batch {batch}: use "
                         f"--global-batch with a multiple of {hw.devices}")
    if args.json:
        import json  # noqa: PLC0415

        def kind(p):
            return "data" if p.tp == 1 else "tensor" if p.dp == 1 else "hybrid"

        print(json.dumps({"model": {"name": model.name, "params": model.params, "flops_per_sample": model.flops_per_sample,
                                    "tp_overhead_flops": model.tp_overhead_flops},
                          "cluster": {"name": hw.name, "nodes": hw.nodes, "per_node": hw.per_node, "flops": hw.flops,
                                      "intra": vars(hw.intra), "inter": vars(hw.inter)},
                          "global_batch": batch, "calibration": notes,
                          "recommended": {"strategy": kind(preds[0]), **preds[0].to_dict()},
                          "predictions": [{"strategy": kind(p), **p.to_dict()} for p in preds]}))
        return 0
    for note in notes:
        print(note)
    best_per_layout: dict[tuple[int, int], costmodel.Prediction] = {}
    for p in preds:
        best_per_layout.setdefault((p.dp, p.tp), p)
    print(f"{model.name}: {model.params / 1e6:,.1f} M parameters, {model.flops_per_sample / 1e9:,.1f} GFLOP per "
          f"sample; global batch {batch}; {hw.name or 'cluster'}: {hw.nodes} x {hw.per_node} devices at "
          f"{hw.flops / 1e12:.3g} TFLOP/s")
    print(f"{'layout':<16}{'bucket MB':>10}{'step ms':>10}{'compute':>9}{'comm wait':>11}{'samples/s':>12}")
    for (dp, tp), p in sorted(best_per_layout.items(), key=lambda kv: kv[1].step_s):
        kind = "data" if tp == 1 else "tensor" if dp == 1 else "hybrid"
        bucket = f"{p.bucket_cap_mb:g}" if dp > 1 else "-"
        print(f"{kind + f' {dp}x{tp}':<16}{bucket:>10}{p.step_s * 1e3:>10.1f}{p.compute_s * 1e3:>9.1f}"
              f"{p.comm_wait_frac:>11.1%}{p.samples_per_s:>12,.1f}")
    best = preds[0]
    kind = "data" if best.tp == 1 else "tensor" if best.dp == 1 else "hybrid"
    print(f"recommended: strategy {kind}" + (f", tp_size {best.tp}" if best.tp > 1 else "")
          + (f", bucket_cap_mb {best.bucket_cap_mb:g}" if best.dp > 1 else "")
          + (", tp_across_nodes true" if best.tp > hw.per_node or hw.per_node % best.tp else "")
          + f" ({best.step_s * 1e3:.1f} ms a step, comm wait {best.comm_wait_frac:.0%})")
    if model.tp_boundaries == 0:
        print("note: this model's tensor-parallel activations are not modelled (only the built-in GPT's are): "
              "tensor and hybrid rows count their compute and gradient traffic only")
    return 0
