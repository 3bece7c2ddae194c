"""Tensor-parallel plans: module-name patterns mapped to "colwise" or "rowwise".

A plan is data, checked against the model before anything is sharded: a pattern that matches
nothing, a matched module that is not nn.Linear, or a sharded width that tp does not divide is
an error that names the pattern, the module and the equation.
"""

from __future__ import annotations

import fnmatch

from torch import nn

STYLES = ("colwise", "rowwise")


class PlanError(ValueError):
    pass


def resolve(model: nn.Module, plan: dict[str, str], tp: int) -> dict[str, str]:
    """{module name: style} for every module the plan shards; PlanError when it does not fit."""
    if not plan:
        raise PlanError("the model has no tensor-parallel plan: give parallel.tp_plan (module-name pattern -> "
                        "colwise | rowwise), or return (model, plan) from the model entry point")
    modules = dict(model.named_modules())
    out: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise PlanError(f"pattern {pattern!r}: style {style!r} is not one of {', '.join(STYLES)}")
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise PlanError(f"pattern {pattern!r} matches no module; modules are: "
                            + ", ".join(n for n in list(modules)[1:20] if n) + (" ..." if len(modules) > 20 else ""))
        for name in names:
            mod = modules[name]
            parent = modules[name.rsplit(".", 1)[0]] if "." in name else model
            if isinstance(parent, nn.MultiheadAttention):
                raise PlanError(f"pattern {pattern!r} matches {name!r} inside nn.MultiheadAttention, which uses "
                                "its weights without calling the layer, so sharding it would be silently wrong; "
                                "shard your own q/k/v/out projections instead")
            if not isinstance(mod, nn.Linear):
                raise PlanError(f"pattern {pattern!r} matches {name!r}, a {type(mod).__name__}; "
                                "only nn.Linear layers can be sharded colwise or rowwise")
            dim, what = (mod.out_features, "out_features") if style == "colwise" else (mod.in_features, "in_features")
            if dim % tp:
                raise PlanError(f"{name} ({style}): {what}({dim}) % tp({tp}) = {dim % tp}; "
                                f"a {style} shard needs {what} divisible by tp")
            out[name] = style
    return out
