"""`gearshift export RUN --output DIR`: a run's model as Hugging Face-style safetensors shards
(or one torch file), streamed from its checkpoint so that no process holds more than about one
tensor (workers/state/export.py).

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
    p.add_argument("--format", choices=("safetensors", "torch", "onnx", "torch-export"), default="safetensors",
                   help="safetensors: shards plus model.safetensors.index.json (default); torch: one model.pt; "
                        "onnx: an ONNX model (--output FILE), checked under onnxruntime; torch-export: a "
                        "torch.export program (--output FILE). onnx and torch-export have a dynamic batch "
                        "dimension and take the compression options")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), help="convert floating tensors (default: as trained)")
    p.add_argument("--max-shard-size", default="5GB", help="the largest shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument("--prefix", help="taken off the front of every name (default: the run's model.pretrained.prefix, "
                                    "else none); names without it are left out")
    p.add_argument("--root", help="where to look a fingerprint up (default: GEARSHIFT_RUNS_ROOT, else ./runs)")
    p.add_argument("--quantize", choices=("dynamic_int8",),
                   help="onnx, torch-export: int8 weights for Linear layers (onnx: onnxruntime's dynamic "
                        "quantizer; torch-export: int8 weights with a scale per output channel)")
    p.add_argument("--prune", metavar="l1_structured:S",
                   help="onnx, torch-export: remove the share S of each prunable Linear layer's output channels "
                        "by L1 norm (really smaller matrices)")
    p.add_argument("--finetune-steps", type=int, default=0, metavar="N",
                   help="with --prune: train the pruned model N steps as a run of the job (its loop, data and "
                        "optimizer, on the cluster) before export")
    p.add_argument("--address", help="with --finetune-steps: the Ray cluster to fine-tune on (default: RAY_ADDRESS, "
                                     "else an embedded Ray)")
    p.add_argument("--eval-samples", type=int, default=1024, metavar="N",
                   help="compression figures: the eval loss and accuracy over the first N samples of the job's "
                        "eval.data (its data without one); default 1024")
    p.add_argument("--version", help="onnx, torch-export: the version name `gearshift serve` answers with "
                                     "(default: JOB-stepSTEP)")


def cmd_export(args) -> int:
    from gearshift.workers.build import hf_conversion
    from gearshift.workers.state import checkpoint, export

    if args.format in ("onnx", "torch-export"):
        return cmd_inference_export(args)
    for flag, value in (("--quantize", args.quantize), ("--prune", args.prune),
                        ("--finetune-steps", args.finetune_steps)):
        if value:
            raise UsageError(f"{flag} applies to --format onnx or torch-export, not {args.format}")
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
    hf, kept = _transformers_model(job, recorded, prefix), []
    try:
        if args.format == "safetensors":  # a transformers model's tensors named as its save_pretrained names them
            names, kept = hf_conversion.saved_names(hf, "", names, {n: s for n, (_, s) in source.names.items()}) \
                if hf is not None else (names, [])
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
    made = hf_conversion.write_config(hf, out) if hf is not None and "config.json" not in copied else []
    print(f"exported step {source.step} of {run.path}: {len(names)} tensors, {total / 1e6:.1f} MB "
          f"({args.dtype or 'as trained'}) in {files} file(s) to {out}"
          + (f"; copied {', '.join(copied)}" if copied else "") + (f"; wrote the model's {', '.join(made)}" if made else "")
          + (f"; kept the model's own names for {', '.join(kept[:4])} (their conversion is not reversed tensor by "
             "tensor)" if kept else ""), file=sys.stderr)
    return 0


def _transformers_model(job: dict, recorded: dict, prefix: str):
    """The run's transformers model (built on the meta device from the job) the export's names
    start at, or None: a model of the user's own, or one that cannot be built here."""
    from gearshift.workers.build import components, hf_conversion

    try:
        model, _ = components.model_for_checks(job.get("model") or {}, [recorded.get("base_dir", ".")])
    except Exception:  # noqa: BLE001 - not built here (its code elsewhere): the export keeps the model's names
        return None
    return hf_conversion.transformers_model(model, prefix)


def _find(ident: str, root: str | None):
    from gearshift.orchestrator.commands.runs import find_run

    return find_run(ident, root)


def _checkpoint(run, step: int | None):
    from gearshift.serving.source import model_tensors

    return model_tensors(run, step)


def _job(run) -> dict:
    from gearshift.orchestrator.commands.runs import _read_job

    return _read_job(run)


def _aliases(job: dict, recorded: dict) -> list[list[str]] | None:
    """The model's groups of names for one tensor (a tied head), from the model built on the meta
    device; None when it cannot be built here (then every name is written)."""
    from gearshift.workers.build import components, pretrained

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


def cmd_inference_export(args) -> int:
    """An ONNX model or a torch.export program of the run's model, optionally pruned (and
    fine-tuned) and with int8 weights; checked against eager PyTorch on the job's own inputs, with
    the compression's figures before and after printed side by side."""
    import tempfile

    from gearshift.serving import artifact, source

    out = pathlib.Path(args.output)
    share = _check_inference_args(args, out)
    _ready(args.format)
    rm = source.load(_find(args.run, args.root).path, args.step)
    example = source.example(rm, 2)
    check_x, _ = source.batch(source.dataset(rm, "train")[0], 32)
    model, eager, compression = _compressed(args, rm, example, out, share)
    record = artifact.record_for(rm, example, compression, args.format, args.version)
    write = artifact.export_onnx if args.format == "onnx" else artifact.export_program
    with tempfile.TemporaryDirectory(prefix="gearshift-export-") as tmp:
        tmp = pathlib.Path(tmp)
        if args.format == "onnx" and args.quantize:
            write(model, example, tmp / "fp32.onnx", record)
            artifact.quantize_onnx(tmp / "fp32.onnx", out)
        else:
            write(model, example, out, record)
        runtime = artifact.open_artifact(out)
        diff = _checked(args, rm, out, record, runtime, eager, check_x)
        if compression:
            _compare(args, rm, example, check_x, compression, runtime, write, out, tmp, diff)
    return 0


def _check_inference_args(args, out: pathlib.Path) -> float | None:
    """The options' mistakes, before anything is read; returns --prune's share."""
    from gearshift.serving import compress

    if out.exists() or out.is_symlink():
        raise UsageError(f"--output {out} exists; give a new file name, so that no earlier export is overwritten")
    if not out.parent.is_dir():
        raise UsageError(f"--output {out}: the folder {out.parent} does not exist")
    if args.finetune_steps and not args.prune:
        raise UsageError("--finetune-steps N fine-tunes a pruned model: give --prune l1_structured:S with it")
    if args.finetune_steps < 0 or args.eval_samples < 1:
        raise UsageError("--finetune-steps must be 0 or more and --eval-samples 1 or more")
    if args.dtype:
        raise UsageError(f"--dtype applies to --format safetensors or torch; {args.format} exports fp32 (give "
                         "--quantize dynamic_int8 for a smaller model)")
    return compress.parse_prune(args.prune) if args.prune else None


def _compressed(args, rm, example, out: pathlib.Path, share: float | None):
    """The model to export (pruned, fine-tuned, int8 weights for torch-export, as asked), the eager
    model it must equal (before int8), and what was done to it."""
    from gearshift.serving import compress

    model, compression = rm.model, {}
    if share is not None:
        model, shapes, pairs = compress.prune(rm.model, example, share)
        compression["prune"] = {"method": "l1_structured", "share": share, "layers": shapes}
        _say(f"pruned {share:.0%} of the output channels of {len(pairs)} layer(s): "
             + ", ".join(f"{a} {rm.model.get_submodule(a).out_features}->{shapes[a][1]}" for a, _ in pairs))
        if args.finetune_steps:
            workdir = out.parent / f"{out.name}.finetune"
            _say(f"fine-tuning the pruned model for {args.finetune_steps} steps as a run of the job in {workdir}")
            model, _ = compress.finetune(rm, model, shapes, args.finetune_steps, workdir, args.address)
            compression["finetune_steps"] = args.finetune_steps
    eager = model
    if args.quantize:
        compression["quantize"] = args.quantize
        if args.format == "torch-export":
            model, count = compress.int8_weights(model)
            _say(f"int8 weights for {count} Linear layer(s)")
    return model, eager, compression


def _checked(args, rm, out: pathlib.Path, record: dict, runtime, eager, check_x) -> float:
    """The export run on 32 of the job's inputs against eager PyTorch: the largest difference, said."""
    import torch

    from gearshift.serving import artifact

    with torch.no_grad():
        want = eager(check_x)
    diff = artifact.max_difference(runtime(check_x), want)
    against = "eager PyTorch before int8" if args.quantize else "eager PyTorch"
    _say(f"exported step {rm.step} of {rm.run_path} as {args.format} to {out} ({out.stat().st_size / 1e6:.2f} MB, "
         f"version {record['version']}); run under {runtime.kind} on 32 of the job's inputs, the largest "
         f"difference from {against} is {diff:.3g}")
    if not args.quantize and diff > 1e-4:
        _say(f"gearshift: warning: {diff:.3g} is more than the 1e-4 an fp32 export should keep to")
    return diff


def _compare(args, rm, example, check_x, compression: dict, runtime, write, out: pathlib.Path,
             tmp: pathlib.Path, diff: float) -> None:
    """The uncompressed model exported beside it, both measured under the same runtime: a table
    printed, and OUTPUT.figures.json."""
    from gearshift.serving import artifact

    base_path = tmp / f"uncompressed.{'onnx' if args.format == 'onnx' else 'pt2'}"
    write(rm.model, example, base_path, artifact.record_for(rm, example, {}, args.format))
    before = artifact.figures(artifact.open_artifact(base_path), rm, check_x, base_path.stat().st_size,
                              args.eval_samples)
    after = artifact.figures(runtime, rm, check_x, out.stat().st_size, args.eval_samples)
    _say(f"compression ({', '.join(_describe(compression))}), both under {runtime.kind}, eval on "
         f"{after['eval_samples']} samples of the job's {after['eval_data']}:")
    _say(artifact.table(before, after, "uncompressed", "compressed"))
    (out.parent / f"{out.name}.figures.json").write_text(json.dumps(
        {"before": before, "after": after, "compression": compression, "max_difference": diff}, indent=1))


def _say(text: str) -> None:
    print(text, file=sys.stderr)


def _describe(compression: dict) -> list[str]:
    parts = []
    if "prune" in compression:
        parts.append(f"l1_structured:{compression['prune']['share']}"
                     + (f", fine-tuned {compression['finetune_steps']} steps" if compression.get("finetune_steps")
                        else ""))
    if "quantize" in compression:
        parts.append(compression["quantize"])
    return parts


def _ready(fmt: str) -> None:
    import importlib.util

    need = ["onnx", "onnxscript", "onnxruntime"] if fmt == "onnx" else []
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing:
        raise UsageError(f"--format {fmt} needs {', '.join(missing)}: pip install 'gearshift[serve]'")
