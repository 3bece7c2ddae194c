"""`gearshift export RUN --output DIR`: a run's model as Hugging Face-style safetensors shards
(or one torch file), streamed from its checkpoint so that no process holds more than about one
tensor (workers/export.py).

The names are the model's own, less the prefix the run's model.pretrained gave (a wrapper
holding a Hugging Face model as `lm` exports the Hugging Face model's names, which
`from_pretrained` reads); a tensor the model shares under two names (a tied head) is written
once, as `save_pretrained` does. The folder the weights came from lends its config.json.
"""

from __future__ import annotations

import json
import pathlib
import sys

from gearshift.orchestrator.errors import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a run's model as safetensors shards (Hugging Face style) or a torch "
                                      "file, streamed from its checkpoint")
    p.add_argument("run", metavar="RUN_DIR|FINGERPRINT", help="the run to export")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="the folder to write (new, or empty)")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the newest that verifies)")
    p.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                   help="safetensors: shards plus model.safetensors.index.json (default); torch: one model.pt")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="convert floating tensors (default: as trained)")
    p.add_argument("--max-shard-size", default="5GB", help="the largest shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--prefix", help="taken off the front of every name (default: the run's model.pretrained.prefix, "
                                    "else none); names without it are left out")
    p.add_argument("--root", help="where to look a fingerprint up (default: GEARSHIFT_RUNS_ROOT, else ./runs)")


def cmd_export(args) -> int:
    from gearshift.workers import checkpoint, export

    run = _find(args.run, args.root)
    source = _checkpoint(run, args.step)
    job = _job(run)
    recorded = _read_json(run.source) or {}
    spec = (job.get("model") or {}).get("pretrained") or {}
    prefix = args.prefix if args.prefix is not None else spec.get("prefix", "")
    names = export.output_names(source, prefix, _aliases(job, recorded))
    if not names:
        raise UsageError(f"no tensor of the checkpoint at step {source.step} begins with the prefix {prefix!r} "
                         f"(its names begin {', '.join(sorted({n.split('.')[0] + '.' for n in source.names})[:6])}); "
                         "give --prefix '' to export them all")
    out = pathlib.Path(args.output)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--output {out} exists and is not an empty folder; give a new folder, so that no earlier "
                         "export's files mix with this one's")
    dtype = export.DTYPES[args.dtype] if args.dtype else None
    try:
        if args.format == "safetensors":
            index = export.write_safetensors(source, out, names, dtype, export.parse_size(args.max_shard_size))
            total, files = index["metadata"]["total_size"], len(set(index["weight_map"].values()))
        else:
            out.mkdir(parents=True, exist_ok=True)
            total, files = export.write_torch(source, out / "model.pt", names, dtype), 1
    except (export.ExportError, checkpoint.CheckpointError) as err:
        raise UsageError(str(err)) from None
    folder = (recorded.get("pretrained") or {}).get("path") or (
        str(pathlib.Path(recorded.get("base_dir", ".")) / spec["path"]) if spec.get("path") else None)
    copied = export.copy_config(pathlib.Path(folder) if folder else None, out)
    print(f"exported step {source.step} of {run.path}: {len(names)} tensors, {total / 1e6:.1f} MB "
          f"({args.dtype or 'as trained'}) in {files} file(s) to {out}"
          + (f"; copied {', '.join(copied)}" if copied else ""), file=sys.stderr)
    return 0


def _find(ident: str, root: str | None):
    from gearshift.orchestrator.commands.runs import find_run

    return find_run(ident, root)


def _checkpoint(run, step: int | None):
    from gearshift.workers import checkpoint, export

    root = run.checkpoint_root()
    found = checkpoint.list_checkpoints(root)
    if not found:
        raise UsageError(f"{run.path} has no checkpoint to export ({root} holds none): a run writes one "
                         "when it finishes and every checkpoint.every steps; run or resume it to the end first")
    steps = [int(p.name.split("_")[1]) for p in found]
    if step is not None and step not in steps:
        raise UsageError(f"--step {step}: {run.path} has checkpoints at steps {', '.join(map(str, steps))}")
    errors = []
    for path in reversed(found):
        if step is not None and int(path.name.split("_")[1]) != step:
            continue
        try:
            return export.ModelTensors(path)
        except checkpoint.CheckpointError as err:
            errors.append(str(err))
            if step is not None:
                break
    raise UsageError(f"no checkpoint of {run.path} verifies: {errors[0]}")


def _job(run) -> dict:
    from gearshift.orchestrator.commands.runs import _read_job

    return _read_job(run)


def _aliases(job: dict, recorded: dict) -> list[list[str]] | None:
    """The model's groups of names for one tensor (a tied head), from the model built on the meta
    device; None when it cannot be built here (then every name is written)."""
    from gearshift.workers import components, pretrained

    try:
        model, _ = components.model_for_checks(job["model"], [recorded.get("base_dir", ".")])
    except Exception as err:  # noqa: BLE001 - the user's module may not import here; every name is written then
        print(f"gearshift: the model could not be built here to find its tied tensors ({type(err).__name__}: {err}); "
              "every tensor is written under each of its names", file=sys.stderr)
        return None
    return [g for g in pretrained._aliases(model) if len(g) > 1]


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
