"""`gearshift inspect data JOB.yaml` and `gearshift inspect graph JOB.yaml`: see what trains before
it trains.

`inspect data` builds the job's dataset and takes the batch one rank trains on at step N through
the training loop's own path (workers/step/loader.py's StepBatches: the same global order, the same
per-step seed before the dataset's own transforms and augmentation draw), then prints a summary
table (shape, dtype, min/max/mean/std, NaN and Inf counts, the class histogram of integer
targets) and draws the samples: a grid of images for image-shaped inputs, decoded text for token
ids (with the dataset's `decode(ids)` when it offers one; ASCII otherwise).

`inspect graph` builds the model on the meta device (no memory for weights) and writes its module
tree, each module with its parameter count, its parameters' shapes and where the job's starting
layout puts them (replicated, split over tp by rows or columns, or sharded over the data-parallel
ranks), as SVG and PNG, with a JSON of the same rows. With `--compile` (or train.compile in the
job) it also runs torch._dynamo's explain on a batch of the job's data: how many graphs compile
makes of the model and why each graph break happens.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

from gearshift.orchestrator.errors import UsageError


def add_parser(sub):
    p = sub.add_parser("inspect", help="see the data a step trains on, or the model's module tree and layout")
    isub = p.add_subparsers(dest="inspect_command", metavar="WHAT")
    data = isub.add_parser("data", help="the samples a rank trains on at step N: a summary table and a picture")
    data.add_argument("job", help="the job file (YAML)")
    data.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    data.add_argument("--step", type=int, default=1, help="the training step (1 is the first; default 1)")
    data.add_argument("--rank", type=int, default=0, help="the worker rank whose share is shown (default 0)")
    data.add_argument("--count", type=int, default=16, help="samples drawn (default 16); the table covers them all")
    data.add_argument("--output", "-o", metavar="FILE", help="the picture (PNG; default: JOB-data-stepN.png)")
    data.add_argument("--save", metavar="FILE", help="also write the batch's tensors (torch.save) to FILE")
    graph = isub.add_parser("graph", help="the model's module tree with parameter counts, shapes and the layout's "
                                          "placement (SVG, PNG, JSON); with --compile, graph breaks")
    graph.add_argument("job", help="the job file (YAML)")
    graph.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    graph.add_argument("--output", "-o", metavar="FILE.svg", help="default: JOB-graph.svg (and .png, .json beside)")
    graph.add_argument("--depth", type=int, default=4, help="module levels drawn (default 4; the JSON has all)")
    graph.add_argument("--compile", action="store_true", help="count compile's graphs and graph breaks (explain), "
                                                              "as train.compile does")
    return isub


def cmd_inspect(args) -> int:
    if args.inspect_command == "data":
        return _data(args)
    if args.inspect_command == "graph":
        return _graph(args)
    raise UsageError("gearshift inspect: say what to inspect: `inspect data JOB.yaml`, `inspect graph JOB.yaml` or "
                     "`inspect memory JOB.yaml|RUN_DIR`")


def _job(args):
    from gearshift.api import load_job

    return load_job(args.job, args.overrides)


# ----------------------------------------------------------------------------- data


def step_batch(job, step: int, rank: int = 0):
    """(inputs, targets) of `rank` at training step `step` (1-based), as the loop loads them."""
    from gearshift.workers.build import components
    from gearshift.workers.step import streaming
    from gearshift.workers.step.data import GlobalBatches
    from gearshift.workers.step.loader import StepBatches

    spec = job.to_dict()
    if streaming.is_streamed(spec["data"]):
        raise UsageError("inspect data reads a map-style dataset here; this job's data is read by Ray Data "
                         "(data.ray_dataset / data.read): give a `data` entry point to inspect it")
    layout = job.layout
    if not 0 <= rank < layout.world:
        raise UsageError(f"--rank {rank} is not valid: the job starts with {layout.world} worker(s), ranks "
                         f"0..{layout.world - 1}")
    if step < 1:
        raise UsageError(f"--step {step} is not valid: steps count from 1")
    dataset = components.build_dataset(spec["data"], spec["model"], [job.base_dir])
    order = GlobalBatches(len(dataset), job.train.global_batch_size, job.train.seed)
    steps = StepBatches(dataset, order, layout.dp_rank(rank), layout.dp, job.train.seed,
                        per_sample=job.train.random_per == "sample")
    return steps[step - 1], dataset, layout


def summary(name: str, t) -> list[str]:
    import torch

    if not isinstance(t, torch.Tensor):
        return [f"{name}: {type(t).__name__} (not a tensor)"]
    row = f"{name:8} shape {list(t.shape)}  {str(t.dtype).replace('torch.', '')}"
    if t.numel():
        f = t.double()
        finite = f[torch.isfinite(f)]
        stats = (finite.min(), finite.max(), finite.mean(), finite.std() if finite.numel() > 1 else 0.0) \
            if finite.numel() else (math.nan,) * 4
        row += "  min {:.4g}  max {:.4g}  mean {:.4g}  std {:.4g}".format(*map(float, stats))
        row += f"  NaN {int(torch.isnan(f).sum())}  Inf {int(torch.isinf(f).sum())}"
    lines = [row]
    if not t.is_floating_point() and t.numel() and t.dim() <= 2 and int(t.max()) < 1000:
        counts = torch.bincount(t.reshape(-1).clamp(min=0))
        shown = {i: int(c) for i, c in enumerate(counts.tolist()) if c}
        if len(shown) <= 40:
            lines.append(f"{'':8} classes {shown}")
        else:
            lines.append(f"{'':8} {len(shown)} distinct values")
    return lines


def _data(args) -> int:
    import torch

    job = _job(args)
    if args.count < 1:
        raise UsageError(f"--count {args.count} is not valid: give 1 or more")
    out = pathlib.Path(args.output or f"{job.name}-data-step{args.step}.png")
    x, y = draw(job, args.step, args.rank, args.count, out, print)
    if args.save:
        torch.save({"inputs": x, "targets": y, "step": args.step, "rank": args.rank}, args.save)
    print(f"picture: {out}", file=sys.stderr)
    return 0


def draw(job, step: int, rank: int, count: int, out: pathlib.Path, say) -> tuple:
    """The table (through `say`) and the picture of `rank`'s batch at `step`; returns the batch."""
    (x, y), dataset, layout = step_batch(job, step, rank)
    say(f"step {step}, rank {rank} (data-parallel rank {layout.dp_rank(rank)} of {layout.dp}, "
        f"layout {layout.strategy}): {len(x)} samples of the global batch of {job.train.global_batch_size}")
    for line in summary("inputs", x) + summary("targets", y):
        say(line)
    n = min(count, len(x))
    if _is_images(x):
        _image_grid(x[:n], y[:n], out, f"{job.name}: step {step}, rank {rank}")
    elif not x.is_floating_point() and x.dim() == 2:
        texts = [_decode(dataset, row) for row in x[:n]]
        for i, text in enumerate(texts):
            say(f"[{i}] {text!r}")
        _text_picture(texts, out, f"{job.name}: step {step}, rank {rank} (decoded)")
    else:
        _rows_picture(x[:n], out, f"{job.name}: step {step}, rank {rank}")
    return x, y


def _is_images(x) -> bool:
    return x.is_floating_point() and ((x.dim() == 4 and x.shape[1] in (1, 3)) or
                                      (x.dim() == 3 and min(x.shape[1:]) >= 8))


def _decode(dataset, ids) -> str:
    decode = getattr(dataset, "decode", None)
    if callable(decode):
        return str(decode(ids.tolist()))
    return "".join(chr(i) if 32 <= i < 127 or i == 10 else "\ufffd" for i in ids.tolist())


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _image_grid(x, y, out: pathlib.Path, title: str) -> None:
    n = len(x)
    cols = min(8, n)
    rows = -(-n // cols)
    fig = _figure(1.6 * cols, 1.8 * rows + 0.4)
    for i in range(n):
        ax = fig.add_subplot(rows, cols, i + 1)
        img = x[i].float()
        img = img.permute(1, 2, 0) if img.dim() == 3 and img.shape[0] == 3 else img.reshape(img.shape[-2:])
        lo, hi = float(img.min()), float(img.max())
        ax.imshow(((img - lo) / (hi - lo + 1e-12)).numpy(), cmap=None if img.dim() == 3 else "gray")
        label = y[i].tolist() if hasattr(y[i], "tolist") else y[i]
        ax.set_title(f"#{i}: {label}" if not isinstance(label, list) else f"#{i}", fontsize=8)
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.savefig(out)


def _text_picture(texts: list[str], out: pathlib.Path, title: str) -> None:
    fig = _figure(12, 0.3 * len(texts) + 0.8)
    fig.text(0.01, 0.98, title, va="top", fontsize=10, weight="bold")
    for i, text in enumerate(texts):
        fig.text(0.01, 0.98 - (i + 1.5) * 0.3 / (0.3 * len(texts) + 0.8), f"[{i}] {text}".replace("\n", "⏎"),
                 va="top", family="monospace", fontsize=8)
    fig.savefig(out)


def _rows_picture(x, out: pathlib.Path, title: str) -> None:
    fig = _figure(10, 4)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(x.reshape(len(x), -1).float().numpy(), aspect="auto", cmap="viridis")
    fig.colorbar(im)
    ax.set_ylabel("sample")
    ax.set_xlabel("feature")
    ax.set_title(title, fontsize=10)
    fig.savefig(out)


# ----------------------------------------------------------------------------- graph


def module_rows(model, layout, plan: dict[str, str] | None) -> list[dict]:
    """One row per module, in named_modules order: name, type, depth, own and total parameters,
    the shapes of its own parameters, and the layout's placement of them."""
    rows = []
    for name, mod in model.named_modules():
        own = list(mod.named_parameters(recurse=False))
        total = sum(p.numel() for p in mod.parameters())
        rows.append({"name": name or "(model)", "type": type(mod).__name__, "depth": name.count(".") + 1 if name else 0,
                     "params": total, "own_params": sum(p.numel() for _, p in own),
                     "shapes": {n: list(p.shape) for n, p in own}, "placement": _placement(name, own, layout, plan)})
    return rows


def _placement(name: str, own, layout, plan: dict[str, str] | None) -> str:
    if not own:
        return ""
    parts = []
    style = (plan or {}).get(name)
    if style and layout.tp > 1:
        parts.append(f"tp {style}: weight {'rows' if style == 'colwise' else 'columns'} split over {layout.tp}")
    if layout.shard > 1:
        parts.append(f"dim 0 sharded over {layout.shard} data-parallel ranks")
    if layout.replicas > 1:
        parts.append(f"replicated on {layout.replicas} data-parallel replica(s)" if layout.shard > 1
                     else f"replicated on {layout.dp} data-parallel rank(s)")
    return "; ".join(parts) or "whole on every rank"


def _graph(args) -> int:
    import torch

    from gearshift.strategies import tp_plan as plans
    from gearshift.workers.build import components

    job = _job(args)
    spec = job.to_dict()
    layout = job.layout
    with components.on_meta():
        model, returned = components.build_model_and_plan(spec["model"], [job.base_dir])
    plan = None
    if layout.tp > 1:
        try:
            plan = plans.resolve(model, components.tp_plan(model, job.parallel.tp_plan, returned, layout.tp), layout.tp)
        except plans.PlanError as err:
            raise UsageError(f"parallel.tp_plan: {err}") from None
    rows = module_rows(model, layout, plan)
    out = pathlib.Path(args.output or f"{job.name}-graph.svg")
    result = {"job": job.name, "layout": layout.to_dict(), "modules": rows}
    if args.compile or job.train.compile:
        result["compile"] = explain(job)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    _draw_tree(rows, layout, out, args.depth, result.get("compile"), job.name)
    total = rows[0]["params"]
    print(f"{job.name}: {total:,} parameters in {len(rows)} modules; starting layout {layout.strategy} "
          f"dp={layout.dp} tp={layout.tp}" + (f" shard={layout.shard}" if layout.shard > 1 else ""))
    for r in rows[1:]:
        if r["depth"] <= min(args.depth, 2):
            print(f"{'  ' * r['depth']}{r['name']} ({r['type']}): {r['params']:,}"
                  + (f"  [{r['placement']}]" if r["placement"] and r["own_params"] else ""))
    if "compile" in result:
        c = result["compile"]
        print(f"compile: {c['graphs']} graph(s), {c['graph_breaks']} graph break(s)")
        for b in c["breaks"]:
            print(f"  break: {b['reason']}" + (f" at {b['where']}" if b.get("where") else ""))
    print(f"pictures: {out}, {out.with_suffix('.png')}; rows: {out.with_suffix('.json')}", file=sys.stderr)
    del torch
    return 0


def explain(job) -> dict:
    """torch._dynamo.explain on the real model and a batch of the job's data: graphs, breaks."""
    import torch

    from gearshift.workers.build import components

    spec = job.to_dict()
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], [job.base_dir]).eval()
    (x, _), _, _ = step_batch(job, 1, 0)
    import torch._dynamo

    from gearshift.serving.artifact import quiet

    torch._dynamo.reset()
    with quiet("torch._dynamo"):  # explain's own warnings: the breaks are listed
        result = torch._dynamo.explain(model)(x[:2])
    breaks = []
    for b in result.break_reasons:
        frame = b.user_stack[-1] if getattr(b, "user_stack", None) else None
        reason = " ".join(str(b.reason).split()).split(" Explanation:")[0]
        breaks.append({"reason": reason[:300],
                       "where": f"{frame.filename}:{frame.lineno}" if frame else ""})
    return {"graphs": result.graph_count, "graph_breaks": result.graph_break_count, "breaks": breaks}


def _draw_tree(rows: list[dict], layout, out: pathlib.Path, depth: int, compiled: dict | None, name: str) -> None:
    from matplotlib.patches import Rectangle

    shown = [r for r in rows if r["depth"] <= depth]
    extra = (2 + len(compiled["breaks"])) if compiled else 0
    height = 0.26 * (len(shown) + extra + 2)
    fig = _figure(15, max(2.0, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, 15)
    ax.set_ylim(height, 0)
    ax.axis("off")
    ax.text(0.1, 0.2, f"{name}: module tree, {layout.strategy} dp={layout.dp} tp={layout.tp} shard={layout.shard}",
            fontsize=10, weight="bold", va="center")
    top = max(r["params"] for r in rows) or 1
    for i, r in enumerate(shown):
        y = 0.26 * (i + 1.5)
        x = 0.1 + 0.3 * r["depth"]
        width = 2.5 * r["params"] / top
        colour = "#d9822b" if "tp " in r["placement"] else "#3b7dd8" if "sharded" in r["placement"] else "#9aa5b1"
        ax.add_patch(Rectangle((6.9, y - 0.09), max(width, 0.02), 0.18, color=colour if r["own_params"] else "#d0d5db"))
        ax.text(x, y, f"{r['name'].rsplit('.', 1)[-1]}  ({r['type']})", fontsize=7, va="center", family="monospace")
        ax.text(5.2, y, f"{r['params']:,}", fontsize=7, va="center", ha="right", family="monospace")
        shapes = ", ".join(f"{k} {v}" for k, v in r["shapes"].items())
        ax.text(5.4, y, (shapes[:48] + "…") if len(shapes) > 49 else shapes, fontsize=6, va="center",
                family="monospace")
        if r["own_params"]:
            ax.text(9.55, y, r["placement"][:90], fontsize=6, va="center", ha="left", color="#333")
    if compiled:
        y = 0.26 * (len(shown) + 2)
        ax.text(0.1, y, f"compile: {compiled['graphs']} graph(s), {compiled['graph_breaks']} break(s)", fontsize=8,
                weight="bold", va="center")
        for j, b in enumerate(compiled["breaks"]):
            ax.text(0.3, y + 0.26 * (j + 1), f"break: {b['reason'][:120]} {b['where']}", fontsize=6, va="center")
    fig.savefig(out)
    fig.savefig(out.with_suffix(".png"))
