"""A finished run's model, whole, on this process's CPU: built from the run's own job, with the
weights of one verified checkpoint read into it tensor by tensor; and the run's data, for an
example input (its shape and dtype become the export's) and for the eval figure that compression
is judged by.

Everything here loads the model whole: an inference export is one graph on one device. A model
too big for one process is exported as safetensors shards instead (`gearshift export --format
safetensors`).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gearshift.orchestrator.errors import UsageError


@dataclass
class RunModel:
    """The run's model (eval mode, weights loaded), its job and where the job's code lives."""

    model: nn.Module
    job: dict
    base_dir: str
    step: int
    run_path: pathlib.Path
    name: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def search_paths(self) -> list[str]:
        return [self.base_dir]


def load(run_dir: str | pathlib.Path, step: int | None = None) -> RunModel:
    """The run in `run_dir` with its checkpoint at `step` (default: the newest that verifies)
    loaded into a freshly built model."""
    from gearshift.orchestrator.records.rundir import RunDir
    from gearshift.workers.build import components
    from gearshift.workers.state import checkpoint

    path = pathlib.Path(run_dir)
    if not (path / "job.yaml").is_file():
        raise UsageError(f"{path} is not a gearshift run directory (it has no job.yaml)")
    run = RunDir(path)
    job = read_job(run)
    recorded = _read_json(run.source) or {}
    base_dir = str(recorded.get("base_dir") or ".")
    source = model_tensors(run, step)
    try:
        torch.manual_seed(int((job.get("train") or {}).get("seed", 0)))
        model = components.build_model(job["model"], [base_dir])
    except components.ComponentError as err:
        raise UsageError(f"the run's model cannot be built here: {err}") from None
    own = model.state_dict()
    missing = [n for n in own if n not in source.names]
    if missing:
        raise UsageError(f"the checkpoint at step {source.step} of {run.path} lacks {len(missing)} of the model's "
                         f"tensors ({', '.join(missing[:4])}); it was written for another model")
    try:
        loaded = {n: source.read(n) for n in own}
    except checkpoint.CheckpointError as err:
        raise UsageError(str(err)) from None
    model.load_state_dict(loaded, strict=True)
    model.eval()
    return RunModel(model, job, base_dir, source.step, run.path, name=str(job.get("name") or run.path.name))


def read_job(run) -> dict:
    """The run's job.yaml, as the run resolved it."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        raw = yaml.load(run.job_file.read_text(), Loader=loader)
    except (OSError, yaml.YAMLError) as err:
        raise UsageError(f"{run.job_file} is unreadable ({str(err).splitlines()[0]}); the run directory is "
                         "damaged.") from None
    if not isinstance(raw, dict):
        raise UsageError(f"{run.job_file} does not hold a job mapping; the run directory is damaged.")
    return raw


def model_tensors(run, step: int | None = None):
    """The model's tensors of the run's checkpoint at `step`, else of the newest that verifies."""
    from gearshift.workers.state import checkpoint, export

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


def dataset(rm: RunModel, which: str = "eval"):
    """The job's held-out data (eval.data) when it has one and `which` is "eval", else its
    training data; map-style only."""
    from gearshift.workers.build import components
    from gearshift.workers.step import streaming

    spec = (rm.job.get("eval") or {}).get("data") if which == "eval" else None
    used = "eval.data" if spec else "data"
    spec = spec or rm.job.get("data") or {}
    if streaming.is_streamed(spec):
        raise UsageError(f"the run's {used} is read by Ray Data; export and compression need a map-style dataset "
                         "for an example input and the eval figure (a `data` entry point)")
    try:
        return components.build_dataset(spec, rm.job["model"], rm.search_paths), used
    except components.ComponentError as err:
        raise UsageError(f"the run's {used} cannot be built here: {err}") from None


def batch(data, n: int, start: int = 0) -> tuple[torch.Tensor, Any]:
    from gearshift.workers.step.data import load_batch

    n = min(n, len(data) - start)
    if n <= 0:
        raise UsageError(f"the run's data has {len(data)} samples; none left from sample {start}")
    return load_batch(data, list(range(start, start + n)))


def example(rm: RunModel, n: int = 2) -> torch.Tensor:
    """A batch of `n` of the job's own inputs: the export's example (its shape less the batch
    dimension and its dtype are what the exported model takes)."""
    data, _ = dataset(rm, "train")
    x, _ = batch(data, n)
    if not isinstance(x, torch.Tensor):
        raise UsageError(f"the run's data gives inputs of type {type(x).__name__}; export takes a model whose "
                         "input is one tensor")
    return x


def evaluate(forward, rm: RunModel, samples: int = 1024, batch_size: int = 256) -> dict:
    """The job's loss over the first `samples` of its eval data (its training data without one)
    through `forward` (a callable on an input batch, returning the output as a tensor), and for a
    classification loss the accuracy (argmax over the last dimension, targets flattened)."""
    from gearshift.workers.build import components

    data, used = dataset(rm, "eval")
    loss_fn = components.build_loss(rm.job.get("loss") or {"name": "cross_entropy"}, rm.search_paths)
    loss_name = (rm.job.get("loss") or {}).get("name", "cross_entropy")
    total, right, count, tokens = 0.0, 0, 0, 0
    samples = min(samples, len(data))
    with torch.no_grad():
        for lo in range(0, samples, batch_size):
            x, y = batch(data, min(batch_size, samples - lo), lo)
            out = forward(x)
            n = x.shape[0]
            total += float(loss_fn(out, y)) * n
            count += n
            if loss_name == "cross_entropy" and not y.is_floating_point():
                pred = out.reshape(-1, out.shape[-1]).argmax(-1)
                right += int((pred == y.reshape(-1)).sum())
                tokens += y.numel()
    result = {"loss": total / count, "samples": count, "data": used}
    if tokens:
        result["accuracy"] = right / tokens
    return result


def _read_json(path: pathlib.Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
