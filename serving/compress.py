"""Compression of a trained model before export: l1-structured pruning that really shrinks the
matrices, int8 weights, and fine-tuning the pruned model as a gearshift run.

**Pruning** (`l1_structured:S`). The model is traced once with torch.export on one of the job's
own inputs. A Linear layer whose output reaches exactly one other Linear layer, through nothing
but elementwise functions (relu, gelu, silu, dropout, ...), is a pair: removing output channel c
of the first removes input column c of the second and changes nothing else in the graph. Each
such first layer keeps the (1 - S) share of its output channels with the largest L1 norm of their
weight rows; both layers are replaced by smaller nn.Linear modules. Layers whose output goes
anywhere else (a residual sum, a reshape into attention heads, the model's output) keep their
width, as do layers whose weight is shared with another module.

**int8 weights** for a torch.export program: each Linear layer's weight becomes int8 with one fp32
scale per output channel (symmetric, max |w| / 127), dequantized inside the layer's forward, so the
program holds a quarter of the fp32 weight bytes. ONNX exports are quantized by onnxruntime's
dynamic quantizer instead (int8 matrix products, artifact.py).

**Fine-tuning** runs the job again on the cluster for N steps (`finetune`), its own loop, data,
loss and optimizer, from the pruned weights: the model is this module's `pruned` entry point (the
job's model rebuilt with the pruned widths) and `model.pretrained` the pruned weights.
"""

from __future__ import annotations

import copy
import pathlib
import re

import torch
import torch.nn.functional as F
from torch import nn

from gearshift.orchestrator.errors import UsageError

_ELEMENTWISE = {"relu", "relu_", "gelu", "silu", "silu_", "sigmoid", "tanh", "leaky_relu", "elu", "selu",
                "mish", "hardswish", "hardtanh", "dropout", "clone", "alias", "detach"}


def parse_prune(text: str) -> float:
    m = re.fullmatch(r"l1_structured:([0-9]*\.?[0-9]+)", text or "")
    if not m or not 0.0 < float(m.group(1)) < 1.0:
        raise UsageError(f"--prune {text!r} is not valid: give l1_structured:S with S the share of each Linear "
                         "layer's output channels to remove, between 0 and 1 (e.g. l1_structured:0.3)")
    return float(m.group(1))


def prunable_pairs(model: nn.Module, example: torch.Tensor) -> list[tuple[str, str]]:
    """(producer, consumer) Linear module names, in graph order, where the producer's output
    reaches only the consumer, through elementwise functions only."""
    ep = torch.export.export(model, (example,), strict=False)
    params = dict(ep.graph_signature.inputs_to_parameters)
    linear = torch.ops.aten.linear.default
    shared = _shared_weights(model)
    names, seen = {}, {}
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target == linear and node.args[1].op == "placeholder":
            fqn = params.get(node.args[1].name, "")
            mod = fqn.rsplit(".", 1)[0]
            if fqn.endswith(".weight") and isinstance(_get(model, mod), nn.Linear) and fqn not in shared:
                names[node] = mod
                seen[mod] = seen.get(mod, 0) + 1
    pairs = []
    for node, mod in names.items():
        cur = node
        while len(cur.users) == 1:
            (user,) = cur.users
            if user in names and user.args[0] is cur:
                if seen[mod] == 1 and seen[names[user]] == 1:  # each layer called once
                    pairs.append((mod, names[user]))
                break
            op = getattr(user.target, "__name__", str(user.target)).split(".")[0]
            if user.op == "call_function" and op in _ELEMENTWISE and user.args[0] is cur:
                cur = user
                continue
            break
    return pairs


def prune(model: nn.Module, example: torch.Tensor, share: float) -> tuple[nn.Module, dict, list]:
    """A copy of `model` with `share` of the output channels of every prunable pair's producer
    removed. Returns (model, {layer: [in_features, out_features]} for every layer that changed,
    the pairs)."""
    pairs = prunable_pairs(model, example)
    if not pairs:
        raise UsageError("--prune: the model has no Linear layer whose output feeds only another Linear layer "
                         "(through elementwise functions), so no channel can be removed without changing the "
                         "model's other shapes; export it without --prune")
    model = copy.deepcopy(model)
    with torch.no_grad():
        for first, second in pairs:
            a, b = _get(model, first), _get(model, second)
            keep = max(1, int(round(a.out_features * (1.0 - share))))
            idx = a.weight.abs().sum(dim=1).topk(keep).indices.sort().values
            _set(model, first, _linear(a.weight[idx], a.bias[idx] if a.bias is not None else None))
            _set(model, second, _linear(b.weight[:, idx], b.bias))
    shapes = {n: [m.in_features, m.out_features] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    changed = {n for p in pairs for n in p}
    return model, {n: s for n, s in shapes.items() if n in changed}, pairs


def pruned(base: dict, shapes: dict, search_paths: list | None = None) -> nn.Module:
    """Entry point of a fine-tuning run: the job's model (`base`, its model spec) built as the job
    builds it, with the named Linear layers replaced by ones of the given [in, out] widths (their
    weights then come from model.pretrained)."""
    from gearshift.workers.build import components

    model = components.build_model(base, search_paths or [])
    for name, (fan_in, fan_out) in shapes.items():
        old = _get(model, name)
        _set(model, name, nn.Linear(fan_in, fan_out, bias=old.bias is not None, device=old.weight.device,
                                    dtype=old.weight.dtype))
    return model


class Int8Linear(nn.Module):
    """A Linear layer holding its weight as int8 with an fp32 scale per output channel."""

    def __init__(self, layer: nn.Linear):
        super().__init__()
        w = layer.weight.detach().float()
        scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        self.register_buffer("weight_int8", torch.round(w / scale).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = None if layer.bias is None else nn.Parameter(layer.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = layer.in_features, layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype), self.bias)


def int8_weights(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of `model` with every Linear layer (whose weight it does not share) as Int8Linear;
    returns it and how many layers changed."""
    model = copy.deepcopy(model)
    shared = _shared_weights(model)
    count = 0
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and f"{name}.weight" not in shared:
            _set(model, name, Int8Linear(mod))
            count += 1
    return model, count


def finetune(rm, model: nn.Module, shapes: dict, steps: int, workdir: pathlib.Path, address: str | None = None,
             progress: bool = False) -> tuple[nn.Module, pathlib.Path]:
    """Train the pruned `model` for `steps` steps as a gearshift run of the job (on the cluster
    at `address`, else an embedded Ray): the job's loop, data, loss and optimizer, data parallel on
    its workers, starting from the pruned weights. Returns the model with the run's final weights
    and the run's directory."""
    import gearshift
    from safetensors.torch import save_model

    workdir.mkdir(parents=True, exist_ok=True)
    weights = workdir / "pruned"
    weights.mkdir(exist_ok=True)
    save_model(model, str(weights / "model.safetensors"))
    job = copy.deepcopy(rm.job)
    spec = {k: v for k, v in job["model"].items() if k != "pretrained"}
    job["model"] = {"entrypoint": "gearshift.serving.compress:pruned",
                    "kwargs": {"base": spec, "shapes": shapes, "search_paths": rm.search_paths},
                    "pretrained": str(weights.resolve())}
    job.setdefault("train", {})["steps"] = int(steps)
    job["train"].pop("max_time_s", None)
    job.setdefault("checkpoint", {})["every"] = 0
    job["checkpoint"].pop("path", None)
    job["eval"] = {"every": 0}
    job["name"] = f"{job.get('name', 'job')}-finetune"
    # the pruned widths need not divide a tensor-parallel size: data parallel on the job's workers
    job["parallel"] = {"strategy": "data"}
    job["adapt"] = {}
    try:
        result = gearshift.run(job, run_dir=workdir / "run", address=address, progress=progress)
    except gearshift.GearshiftError as err:
        raise UsageError(f"fine-tuning the pruned model failed: {err}") from None
    state = torch.load(result.model_path, weights_only=True)
    tuned = copy.deepcopy(model)
    tuned.load_state_dict(state, strict=True)
    return tuned.eval(), workdir / "run"


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, dtype=weight.dtype)
    layer.weight.data.copy_(weight)
    if bias is not None:
        layer.bias.data.copy_(bias)
    return layer


def _shared_weights(model: nn.Module) -> set[str]:
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {n for names in by_id.values() if len(names) > 1 for n in names}


def _get(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
