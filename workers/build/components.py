"""What a job names, turned into objects: built-in registries and `module:function` entry points.

The orchestrator calls the `check_*` functions while validating a job (before anything starts);
workers call the `build_*` functions. Both go through the same registries, so a name that
validates is a name that builds.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import inspect
import sys
from typing import Any, Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from gearshift.workers.build import models
from gearshift.workers.step import data


class ComponentError(ValueError):
    """A job names something that does not exist or does not fit; the orchestrator reports it
    with the same field/value/allowed shape as any other job error."""

    def __init__(self, field_path: str, value: Any, allowed: str, hint: str = ""):
        self.field_path, self.value, self.allowed, self.hint = field_path, value, allowed, hint
        super().__init__(f"{field_path} = {value!r} is not valid: {allowed}. {hint}".strip())

    def __reduce__(self):  # raised inside a worker, it must survive the trip back to the driver
        return type(self), (self.field_path, self.value, self.allowed, self.hint)


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # (batch, seq, vocab) logits against (batch, seq) ids are flattened to plain classification
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), target.reshape(-1))


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output.float(), target.to(torch.float32))


MODELS: dict[str, Callable[..., nn.Module]] = {"mlp": models.mlp, "gpt": models.gpt}
DATASETS: dict[str, Callable[..., Any]] = {"synthetic_digits": data.synthetic_digits, "chars": data.chars}
LOSSES: dict[str, Callable[..., Callable]] = {"cross_entropy": lambda: cross_entropy, "mse": lambda: mse}
_DEFAULT_DATA = {"mlp": "synthetic_digits", "gpt": "chars"}


def default_data_for(model_name: str | None) -> str | None:
    return _DEFAULT_DATA.get(model_name or "")


@contextlib.contextmanager
def _on_path(paths: Iterable[str]):
    added = [p for p in paths if p and p not in sys.path]
    sys.path[:0] = added
    try:
        yield
    finally:
        for p in added:
            with contextlib.suppress(ValueError):
                sys.path.remove(p)


def resolve(field_path: str, entrypoint: str, search_paths: Iterable[str] = ()) -> Callable:
    """Import `module:function`, looking next to the job file first."""
    module_name, func_name = entrypoint.split(":")
    search_paths = list(search_paths)
    with _on_path(search_paths):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name and module_name.startswith(err.name):
                where = ", ".join(search_paths) or "the job file's folder"
                raise ComponentError(field_path, entrypoint, f"module {module_name!r} was not found in {where} "
                                     "or on the Python path") from None
            raise ComponentError(field_path, entrypoint, f"importing {module_name!r} failed: {err}") from None
        except Exception as err:  # the user's module raised while importing
            raise ComponentError(field_path, entrypoint,
                                 f"importing {module_name!r} failed: {type(err).__name__}: {err}") from None
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        close = difflib.get_close_matches(func_name, names, n=1)
        hint = f"Did you mean {module_name}:{close[0]}?" if close else ""
        raise ComponentError(field_path, entrypoint, f"module {module_name!r} has no callable {func_name!r}", hint)
    return func


def check_entrypoint(field_path: str, entrypoint: str, search_paths: Iterable[str], kwargs: dict) -> None:
    _check_kwargs(field_path.rsplit(".", 1)[0], entrypoint, resolve(field_path, entrypoint, search_paths), kwargs)


def _check_kwargs(section: str, what: str, func: Callable, kwargs: dict) -> None:
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):  # a builtin or C function: nothing to check against
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for key in kwargs:
        if key not in params:
            close = difflib.get_close_matches(key, list(params), n=1)
            raise ComponentError(f"{section}.kwargs.{key}", kwargs[key],
                                 f"unknown option for {section} {what!r}; it takes " + (", ".join(params) or "none"),
                                 f"Did you mean {close[0]!r}?" if close else "")


# Built-in models this small are checked on real tensors (64 MB of fp32), larger ones on meta.
REAL_CHECK_PARAMS = 16_000_000
_INITIALISERS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_")


@contextlib.contextmanager
def on_meta():
    """Build on the meta device without running torch.nn.init's initialisers (in this thread
    only). On meta they compute nothing, yet torch runs them through its reference kernels,
    which import torch._dynamo: 1.4 s of CPU in a driver that only checks the job's shapes."""
    import threading

    owner = threading.get_ident()
    saved = {name: getattr(nn.init, name) for name in _INITIALISERS if hasattr(nn.init, name)}

    def skipping(original):
        @functools.wraps(original)
        def init(tensor, *args, **kwargs):
            if threading.get_ident() == owner and tensor.is_meta:
                return tensor
            return original(tensor, *args, **kwargs)
        return init

    for name, original in saved.items():
        setattr(nn.init, name, skipping(original))
    try:
        with torch.device("meta"):
            yield
    finally:
        for name, original in saved.items():
            setattr(nn.init, name, original)


def check_builtin_fit(model_spec: dict, data_spec: dict) -> None:
    """Build a built-in model on the meta device (no memory, no compute) and the built-in data,
    and run one two-sample batch through: bad sizes and a model/data mismatch fail here, on the
    driver, instead of in every worker after the cluster was taken. A model of at most
    REAL_CHECK_PARAMS parameters is built and run for real instead, which takes less: torch's
    meta kernels import torch._dynamo (1.4 s of CPU) on the first call."""
    with on_meta():
        model = build_model(model_spec)
    if data_spec.get("entrypoint"):
        return
    device = "meta"
    if sum(p.numel() for p in model.parameters()) <= REAL_CHECK_PARAMS:
        model, device = build_model(model_spec), "cpu"
    dataset = build_dataset(data_spec, model_spec)
    name = data_spec.get("name") or default_data_for(model_spec.get("name"))
    if len(dataset) < 1:
        raise ComponentError("data.kwargs", data_spec.get("kwargs") or {}, f"the built-in {name!r} came out empty")
    x, y = data.load_batch(dataset, [0, min(1, len(dataset) - 1)])
    try:
        with torch.no_grad():
            cross_entropy(model.eval()(x.to(device)), y.to(device))
    except (RuntimeError, ValueError, TypeError, IndexError) as err:
        raise ComponentError("data", name, f"its samples do not fit model {model_spec['name']!r} "
                             f"({str(err).splitlines()[0]})", "Check model.kwargs against data.kwargs.") from None


def check_builtin(section: str, name: str, kwargs: dict, registry: dict[str, Callable]) -> None:
    if name not in registry:
        close = difflib.get_close_matches(name, list(registry), n=1)
        raise ComponentError(f"{section}.name", name, "must be one of " + ", ".join(map(repr, registry)),
                             f"Did you mean {close[0]!r}?" if close else "")
    _check_kwargs(section, name, registry[name], kwargs)


def _call(field_path: str, what: str, func: Callable, kwargs: dict):
    try:
        return func(**kwargs)
    except Exception as err:  # bad sizes surface as TypeError, ValueError or RuntimeError from torch
        raise ComponentError(f"{field_path}.kwargs", kwargs,
                             f"{what} failed with these arguments: {type(err).__name__}: "
                             f"{str(err).splitlines()[0] if str(err) else ''}") from None


def build_model(spec: dict, search_paths: Iterable[str] = ()) -> nn.Module:
    return build_model_and_plan(spec, search_paths)[0]


def build_model_and_plan(spec: dict, search_paths: Iterable[str] = (), activation_checkpointing=False
                         ) -> tuple[nn.Module, dict | None]:
    """The model, and the tensor-parallel plan its entry point returned with it, if any
    (an entry point may return `model` or `(model, plan)`)."""
    kwargs = dict(spec.get("kwargs") or {})
    if activation_checkpointing is True and not spec.get("entrypoint"):
        kwargs["activation_checkpointing"] = True  # the built-ins checkpoint their own blocks (workers/build/recompute.py)
    if spec.get("entrypoint"):
        func = resolve("model.entrypoint", spec["entrypoint"], search_paths)
        with _on_path(search_paths):
            model = _call("model", spec["entrypoint"], func, kwargs)
    else:
        model = _call("model", spec["name"], MODELS[spec["name"]], kwargs)
    plan = None
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[1], dict):
        model, plan = model
    if not isinstance(model, nn.Module):
        raise ComponentError("model", spec.get("entrypoint") or spec.get("name"),
                             f"must return a torch.nn.Module or (module, tp_plan), got {type(model).__name__}")
    return model, plan


def tp_plan(model: nn.Module, job_plan: dict | None, returned_plan: dict | None, tp: int) -> dict | None:
    """The plan to shard with: the job's parallel.tp_plan, else the entry point's, else the
    model's own `tp_plan(tp)` (the built-ins ship one)."""
    if job_plan:
        return dict(job_plan)
    if returned_plan:
        return dict(returned_plan)
    own = getattr(model, "tp_plan", None)
    if callable(own):
        try:
            return own(tp)
        except ValueError as err:
            raise ComponentError("parallel.tp_size", tp, str(err)) from None
    return None


def build_dataset(spec: dict, model_spec: dict, search_paths: Iterable[str] = ()):
    kwargs = dict(spec.get("kwargs") or {})
    if spec.get("entrypoint"):
        func = resolve("data.entrypoint", spec["entrypoint"], search_paths)
        with _on_path(search_paths):
            dataset = _call("data", spec["entrypoint"], func, kwargs)
    else:
        name = spec.get("name") or default_data_for(model_spec.get("name"))
        if name == "chars" and "seq_len" not in kwargs:
            kwargs["seq_len"] = (model_spec.get("kwargs") or {}).get("block_size", 64)
        dataset = _call("data", name, DATASETS[name], kwargs)
    if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
        raise ComponentError("data", spec.get("entrypoint") or spec.get("name"),
                             f"must return a map-style Dataset (with __len__ and __getitem__), "
                             f"got {type(dataset).__name__}")
    return dataset


def build_loss(spec: dict, search_paths: Iterable[str] = ()) -> Callable:
    if spec.get("entrypoint"):
        func = resolve("loss.entrypoint", spec["entrypoint"], search_paths)
        with _on_path(search_paths):
            loss = _call("loss", spec["entrypoint"], func, spec.get("kwargs") or {})
    else:
        loss = _call("loss", spec.get("name") or "cross_entropy", LOSSES[spec.get("name") or "cross_entropy"],
                     spec.get("kwargs") or {})
    if not callable(loss):
        raise ComponentError("loss.entrypoint", spec.get("entrypoint"),
                             f"must return a callable loss_fn(output, target), got {type(loss).__name__}")
    return loss


def build_optimizer(params, spec: dict, device: torch.device | None = None) -> torch.optim.Optimizer:
    """The job's optimizer; fused (optimizer.fused, auto: on CUDA), whose kernels take the
    step's found-inf flag and skip the update on the device (workers/worker.py)."""
    name, lr, wd = spec["name"], spec["lr"], spec["weight_decay"]
    fused = spec.get("fused", "auto")
    fused = (device is not None and device.type == "cuda") if fused == "auto" else bool(fused)
    extra = {"fused": True} if fused else {}  # left out otherwise: torch picks foreach or the loop itself
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=spec["momentum"], nesterov=spec["nesterov"],
                               weight_decay=wd, **extra)
    cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[name]
    return cls(params, lr=lr, betas=tuple(spec["betas"]), eps=spec["eps"], weight_decay=wd, **extra)


def model_for_checks(model_spec: dict, search_paths: Iterable[str] = ()) -> tuple[nn.Module, dict | None]:
    """The model (and the plan its entry point returned) on the meta device, which takes no
    memory; built for real when the meta device cannot hold it."""
    try:
        with on_meta():
            return build_model_and_plan(model_spec, search_paths)
    except ComponentError:
        raise
    except Exception:
        return build_model_and_plan(model_spec, search_paths)


def check_tp_plan(model_spec: dict, job_plan: dict | None, tp: int, search_paths: Iterable[str] = ()) -> None:
    """The plan that would shard this model over `tp` ranks, checked on a meta-device copy."""
    from gearshift.strategies.tp_plan import PlanError, resolve

    model, returned = model_for_checks(model_spec, search_paths)
    plan = tp_plan(model, job_plan, returned, tp)
    try:
        resolve(model, plan or {}, tp)
    except PlanError as err:
        raise ComponentError("parallel.tp_plan", job_plan or plan or {}, str(err)) from None


def check_module_patterns(model_spec: dict, patterns: list[str], field_path: str,
                          search_paths: Iterable[str] = ()) -> None:
    """Every pattern (parallel.fsdp_units, train.activation_checkpointing) names a module of the
    model, by name or class (checked on a meta-device copy: no memory)."""
    import fnmatch

    model, _ = model_for_checks(model_spec, search_paths)
    named = [(n, m) for n, m in model.named_modules() if n]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(n, pattern) or type(m).__name__ == pattern for n, m in named):
            names = [n for n, _ in named][:12]
            classes = sorted({type(m).__name__ for _, m in named})[:12]
            raise ComponentError(field_path, pattern,
                                 "matches no module of the model, by name or by class; names are: "
                                 + ", ".join(names) + (" ..." if len(named) > 12 else "")
                                 + "; classes: " + ", ".join(classes))
