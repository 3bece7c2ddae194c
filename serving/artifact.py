"""Inference artifacts: a model exported to ONNX (torch.onnx.export with dynamo=True) or as a
torch.export program, with a dynamic batch dimension; loading either back (or a run's eager
model) behind one interface; checking an export against eager PyTorch; and measuring size,
latency and the job's eval figure.

An artifact carries a `gearshift` record: the run, its step, the input's shape past the batch
dimension and its dtype, the compression applied, and a version name. `gearshift serve` reads it
to validate requests and to say which version answered. ONNX keeps it in the model's
metadata_props; a torch.export program in its extra file `gearshift.json`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import statistics
import time
import traceback
import warnings
from typing import Any

import numpy as np
import torch
from torch import nn

from gearshift.orchestrator.errors import UsageError

FORMATS = ("onnx", "torch-export")
RECORD = "gearshift"
_NP = {torch.float32: np.float32, torch.float16: np.float16, torch.int64: np.int64, torch.int32: np.int32,
       torch.bfloat16: None}


class ExportFailed(UsageError):
    """The model cannot be exported: one paragraph naming the operator or the graph break."""


def describe_failure(fmt: str, err: BaseException) -> str:
    """One paragraph: what the exporter said first, and the line of the model's code it was at."""
    text = " ".join(str(err).split())
    for marker in ("Explanation:", "Hint:", "Developer debug context:", "For more information"):
        text = text.split(marker)[0]
    text = text.strip()[:600]
    where = ""
    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        if "site-packages" not in frame.filename and "/torch/" not in frame.filename:
            where = f" (at {frame.filename}:{frame.lineno})"
            break
    operator = ""
    for token in str(err).replace("'", " ").replace('"', " ").split():
        if token.startswith(("aten::", "aten.", "torch.ops.", "prim::")):
            operator = f" The operator: {token.rstrip('.,:;')}."
            break
    return (f"the model cannot be exported as {fmt}: {type(err).__name__}: {text}{where}.{operator} "
            "torch.export traces the model's forward on one example input; data-dependent Python control flow "
            "(an `if` on a tensor's value), a call torch cannot trace, or an operator the exporter has no "
            "translation for stops it. Rewrite that part (torch.cond, a shape instead of a value), or export "
            "the weights instead (--format safetensors)")


@contextlib.contextmanager
def quiet(*names: str):
    """The named loggers ("" the root) at ERROR inside the block, as they were after it: the
    exporters' progress and advice are not the user's concern, and the process's own logging
    (a caller's warnings) must stay as it was."""
    import logging

    loggers = [logging.getLogger(n or None) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def export_onnx(model: nn.Module, example: torch.Tensor, path: pathlib.Path, record: dict) -> None:
    import onnx

    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), quiet("torch.onnx"):
            warnings.simplefilter("ignore")  # the exporter's progress lines and its own deprecation notes
            program = torch.onnx.export(model, (example,), dynamo=True, input_names=["input"],
                                        output_names=["output"], dynamic_shapes=({0: "batch"},), verbose=False,
                                        optimize=True)
    except Exception as err:  # noqa: BLE001 - whatever the exporter raised becomes one paragraph
        raise ExportFailed(describe_failure("onnx", err)) from None
    if program is None:
        raise ExportFailed("the model cannot be exported as onnx: torch.onnx.export returned nothing")
    proto = program.model_proto
    entry = proto.metadata_props.add()
    entry.key, entry.value = RECORD, json.dumps(record)
    _atomic(path, lambda tmp: onnx.save(proto, str(tmp)))


def export_program(model: nn.Module, example: torch.Tensor, path: pathlib.Path, record: dict) -> None:
    batch = torch.export.Dim("batch", min=1)
    try:
        program = torch.export.export(model, (example,), dynamic_shapes=({0: batch},), strict=False)
    except Exception as err:  # noqa: BLE001
        raise ExportFailed(describe_failure("torch-export", err)) from None
    _atomic(path, lambda tmp: torch.export.save(program, str(tmp), extra_files={f"{RECORD}.json": json.dumps(record)}))


def quantize_onnx(src: pathlib.Path, dst: pathlib.Path) -> None:
    """Dynamic int8 through onnxruntime's quantizer: int8 weights, activations quantized per batch."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with quiet(""):  # its advice to pre-process goes to the root logger
        _atomic(dst, lambda tmp: quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QInt8))


def _atomic(path: pathlib.Path, write) -> None:
    path = pathlib.Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix or '.pt2'}")
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


# ----------------------------------------------------------------------------- loading back


class Runtime:
    """A loaded model: call it on a batch (a tensor), get the output tensor."""

    kind = "eager"

    def __init__(self, record: dict):
        self.record = record
        self.version = str(record.get("version") or "v1")
        self.sample_shape = tuple(record.get("input_shape") or ())
        self.dtype = getattr(torch, str(record.get("input_dtype", "float32")))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class OnnxRuntime(Runtime):
    kind = "onnxruntime"

    def __init__(self, path: pathlib.Path, threads: int = 1):
        import onnx
        import onnxruntime as ort

        meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
        super().__init__(json.loads(meta.get(RECORD, "{}")))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        (out,) = self.session.run(None, {self.input: x.numpy()})[:1]
        return torch.from_numpy(out)


class ProgramRuntime(Runtime):
    kind = "torch-export"

    def __init__(self, path: pathlib.Path):
        extra = {f"{RECORD}.json": ""}
        program = torch.export.load(str(path), extra_files=extra)
        super().__init__(json.loads(extra[f"{RECORD}.json"] or "{}"))
        self.module = program.module()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module(x)


class EagerRuntime(Runtime):
    def __init__(self, model: nn.Module, record: dict):
        super().__init__(record)
        self.module = model.eval()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.module(x)


def open_artifact(path: str | os.PathLike, threads: int = 1) -> Runtime:
    """An exported file (.onnx, or a torch.export program), or a run (dir or fingerprint), eager."""
    p = pathlib.Path(path)
    if p.is_file():
        head = p.read_bytes()[:4]
        if head[:2] == b"PK":  # a zip: torch.export.save's format
            try:
                return ProgramRuntime(p)
            except Exception as err:  # noqa: BLE001
                raise UsageError(f"{p} is a zip file but not a torch.export program gearshift can load ({err})") from None
        try:
            return OnnxRuntime(p, threads)
        except Exception as err:  # noqa: BLE001
            raise UsageError(f"{p} is neither an ONNX model nor a torch.export program ({type(err).__name__}: "
                             f"{' '.join(str(err).split())[:200]}); give a file `gearshift export --format onnx` "
                             "or `--format torch-export` wrote, or a run directory") from None
    from gearshift.serving import source

    rm = source.load(str(path))
    x = source.example(rm, 1)
    return EagerRuntime(rm.model, record_for(rm, x, {}, "eager"))


def record_for(rm, example: torch.Tensor, compression: dict, fmt: str, version: str | None = None) -> dict:
    return {"run": str(rm.run_path), "job": rm.name, "step": rm.step, "format": fmt,
            "input_shape": list(example.shape[1:]), "input_dtype": str(example.dtype).replace("torch.", ""),
            "compression": compression, "version": version or default_version(rm, compression)}


def default_version(rm, compression: dict) -> str:
    """JOB-stepSTEP, with what compression did: -pruned30, -ft200 (fine-tuned steps), -int8."""
    name = f"{rm.name}-step{rm.step}"
    if "prune" in compression:
        name += f"-pruned{round(100 * compression['prune']['share'])}"
    if compression.get("finetune_steps"):
        name += f"-ft{compression['finetune_steps']}"
    if compression.get("quantize"):
        name += "-int8"
    return name


# ----------------------------------------------------------------------------- checks and figures


def max_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def latency_ms(call, x: torch.Tensor, repeats: int = 30) -> float:
    """The median of `repeats` timed calls after three untimed ones."""
    for _ in range(3):
        call(x)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call(x)
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def batch_of(example: torch.Tensor, n: int) -> torch.Tensor:
    reps = -(-n // example.shape[0])
    return example.repeat(reps, *([1] * (example.dim() - 1)))[:n].contiguous()


def figures(call, rm, example: torch.Tensor, size_bytes: int, eval_samples: int) -> dict[str, Any]:
    from gearshift.serving import source

    out = {"size_bytes": int(size_bytes),
           "latency_ms_batch1": latency_ms(call, batch_of(example, 1)),
           "latency_ms_batch32": latency_ms(call, batch_of(example, 32))}
    out.update({f"eval_{k}": v for k, v in source.evaluate(call, rm, eval_samples).items()})
    return out


def param_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def table(before: dict, after: dict, before_name: str, after_name: str) -> str:
    rows = [("size", "size_bytes", lambda v: f"{v / 1e6:.2f} MB"),
            ("latency, batch 1", "latency_ms_batch1", lambda v: f"{v:.3f} ms"),
            ("latency, batch 32", "latency_ms_batch32", lambda v: f"{v:.3f} ms"),
            ("eval loss", "eval_loss", lambda v: f"{v:.4f}"),
            ("eval accuracy", "eval_accuracy", lambda v: f"{100 * v:.2f} %")]
    lines = [f"{'':20} {before_name:>16} {after_name:>16}   after/before"]
    for label, key, fmt in rows:
        if key in before and key in after:
            ratio = after[key] / before[key] if before[key] else float("nan")
            lines.append(f"{label:20} {fmt(before[key]):>16} {fmt(after[key]):>16}   {ratio:.3f}")
    return "\n".join(lines)
