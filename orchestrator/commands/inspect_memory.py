"""`gearshift inspect memory JOB.yaml|RUN_DIR`: where a training step's memory goes, by module.

The job's model (the run's job, for a run directory) is built on this process's CPU with the job's
optimizer, and one update is run on rank 0's share of the batch of step 1 (the loop's own batch:
`inspect data`'s). Measured, per module:

- parameters: the bytes of the module's own parameters (a shared one counted once, where it is
  first met);
- gradients: the bytes of those parameters' `.grad` after backward;
- optimizer state: the bytes of the optimizer's state for those parameters after the update
  (Adam's two moments, SGD's momentum);
- activations: the bytes autograd keeps for backward while the module's own code runs (each
  saved tensor's storage counted once, for the innermost module running when it was saved, by
  torch.autograd.graph.saved_tensors_hooks), less the parameters themselves.

The figures are for the whole model and one rank's batch share; a sharded layout divides the
first three by its shard count (and the tensor-parallel layers' by tp). The picture is a flame
graph (an icicle: the model at the top, each module as wide as its bytes, its children beneath
it), written as SVG and PNG, with a JSON of the rows; the terminal lists the top modules.
"""

from __future__ import annotations

import json
import pathlib
import sys

from gearshift.orchestrator.errors import UsageError

KINDS = ("parameters", "gradients", "optimizer", "activations")
COLOURS = {"parameters": "#3b7dd8", "gradients": "#d9822b", "optimizer": "#8e5bd0", "activations": "#3aa676"}


def add_parser(isub) -> None:
    mem = isub.add_parser("memory", help="one update's memory by module (parameters, gradients, optimizer state, "
                                         "activations kept for backward) as a flame graph (SVG, PNG, JSON)")
    mem.add_argument("job", metavar="JOB.yaml|RUN_DIR", help="a job file, or a run directory (its job)")
    mem.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    mem.add_argument("--output", "-o", metavar="FILE.svg", help="default: JOB-memory.svg (and .png, .json beside)")
    mem.add_argument("--top", type=int, default=10, help="modules listed (default 10)")


def measure(job) -> list[dict]:
    """One update of the job's model on rank 0's share of step 1's batch; a row per module (in
    named_modules order) with its own bytes of each kind and `total` (its own and its children's)."""
    import torch

    from gearshift.orchestrator.commands.inspect import step_batch
    from gearshift.workers.build import components
    from gearshift.workers.step.module_memory import ModuleMemory

    spec = job.to_dict()
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], [job.base_dir]).train()
    loss_fn = components.build_loss(spec["loss"], [job.base_dir])
    optimizer = components.build_optimizer(model.parameters(), spec["optimizer"], torch.device("cpu"))
    (x, y), _, _ = step_batch(job, 1, 0)
    if job.train.micro_batch_size:
        x, y = x[:job.train.micro_batch_size], y[:job.train.micro_batch_size]
    probe = ModuleMemory()  # what a live run measures on its first update: the same hooks
    with probe.watching(model):
        loss = loss_fn(model(x), y)
    saved = probe.saved
    loss.backward()
    optimizer.step()
    own: dict[str, dict] = {}
    counted = set()
    for name, module in model.named_modules():
        row = dict.fromkeys(KINDS, 0)
        for p in module.parameters(recurse=False):
            if id(p) in counted:
                continue
            counted.add(id(p))
            row["parameters"] += p.numel() * p.element_size()
            row["gradients"] += p.grad.numel() * p.grad.element_size() if p.grad is not None else 0
            row["optimizer"] += sum(v.numel() * v.element_size() for v in optimizer.state.get(p, {}).values()
                                    if isinstance(v, torch.Tensor) and v.dim() > 0)
        row["activations"] = saved[name]
        own[name] = row
    rows = []
    for name, module in model.named_modules():
        inside = [n for n in own if n == name or not name or n.startswith(name + ".")]
        total = {k: sum(own[n][k] for n in inside) for k in KINDS}
        rows.append({"name": name or "(model)", "type": type(module).__name__, "depth": name.count(".") + 1 if name else 0,
                     "own": own[name], "total": total, "bytes": sum(total.values())})
    return rows


def cmd_inspect_memory(args) -> int:
    from gearshift.api import load_job

    path = pathlib.Path(args.job)
    job_file = path / "job.yaml" if path.is_dir() else path
    if path.is_dir() and not job_file.is_file():
        raise UsageError(f"{path} is neither a job file nor a run directory (it has no job.yaml)")
    job = load_job(job_file, args.overrides)
    rows = measure(job)
    out = pathlib.Path(args.output or f"{job.name}-memory.svg")
    out.with_suffix(".json").write_text(json.dumps({"job": job.name, "modules": rows}, indent=1))
    flame(rows, out, f"{job.name}: one update's memory by module ({job.optimizer.name}; rank 0's share of "
                     "step 1's batch; the whole model, before any sharding)")
    whole = rows[0]["total"]
    print(f"{job.name}: " + ", ".join(f"{k} {_mb(whole[k])}" for k in KINDS) + f"; {_mb(rows[0]['bytes'])} in all")
    leaves = sorted((r for r in rows[1:] if sum(r["own"].values())), key=lambda r: -sum(r["own"].values()))
    for r in leaves[:args.top]:
        own = r["own"]
        print(f"  {r['name']:30} {r['type']:14} {_mb(sum(own.values())):>10}  " +
              "  ".join(f"{k[:5]} {_mb(own[k])}" for k in KINDS))
    print(f"pictures: {out}, {out.with_suffix('.png')}; rows: {out.with_suffix('.json')}", file=sys.stderr)
    return 0


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 1024:.1f} KiB"


def flame(rows: list[dict], out: pathlib.Path, title: str) -> None:
    """An icicle: depth downwards, each module as wide as its bytes within its parent, its own
    bytes split by kind along the bottom strip of its box."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    depth = max(r["depth"] for r in rows)
    fig = Figure(figsize=(16, 1.2 + 0.55 * (depth + 1)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.01, 0.02, 0.98, 0.86))
    ax.set_xlim(0, 1)
    ax.set_ylim(depth + 1, 0)
    ax.axis("off")
    by_name = {r["name"]: r for r in rows}
    children: dict[str, list[str]] = {}
    for r in rows[1:]:
        parent = r["name"].rsplit(".", 1)[0] if "." in r["name"] else "(model)"
        children.setdefault(parent, []).append(r["name"])

    def draw(name: str, x0: float, width: float) -> None:
        r = by_name[name]
        d = r["depth"]
        ax.add_patch(Rectangle((x0, d + 0.05), width, 0.9, facecolor="#eef1f5", edgecolor="#888", linewidth=0.5))
        own = r["own"]
        base = max(r["bytes"], 1)
        x = x0
        for k in KINDS:  # the module's own bytes, by kind, along its box's bottom
            w = width * own[k] / base
            if w > 0:
                ax.add_patch(Rectangle((x, d + 0.7), w, 0.25, facecolor=COLOURS[k], linewidth=0))
            x += w
        if width > 0.03:
            label = f"{name.rsplit('.', 1)[-1]} {_mb(r['bytes'])}"
            ax.text(x0 + width / 2, d + 0.4, label if width > 0.012 * len(label) else label.split()[0],
                    ha="center", va="center", fontsize=7, clip_on=True)
        left = x0 + width * sum(own.values()) / base
        for child in children.get(name, []):
            w = width * by_name[child]["bytes"] / base
            draw(child, left, w)
            left += w

    draw("(model)", 0.0, 1.0)
    fig.legend(handles=[Patch(color=COLOURS[k], label=k) for k in KINDS], loc="upper right", ncol=4, fontsize=8)
    fig.suptitle(title, x=0.01, ha="left", fontsize=10)
    fig.savefig(out)
    fig.savefig(out.with_suffix(".png"))
