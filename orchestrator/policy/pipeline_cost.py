"""The cost model's pipeline layouts (strategies/pipeline/): a step's time and a rank's memory
when the model is cut into `pp` stages of consecutive blocks, one stage per node or group of
nodes, `dp` replicas of each stage inside its nodes, micro-batches flowing through under GPipe
or 1F1B. Pure Python, like costmodel.py.

The step, with `m` micro-batches of `b` samples each (a replica's share of the global batch,
`G / dp`, cut in `m`), per stage:

- compute `c` a micro-batch, forward and backward: the model's FLOPs for `b` samples over `pp`
  (the blocks are cut evenly), the head's share (`ModelShape.tp_replicated`) on the last stage
  whole: the slowest stage sets the pace;
- the link `t` a micro-batch, each way: the activation at a cut (`boundary_bytes_per_sample` x
  `b`) over the link between the stages' nodes, and its gradient back;
- the step is `m x max(c, 2t) + (pp - 1) x (c + 2t)`: the slower of compute and link paces the
  steady state, and filling and draining the pipeline costs `pp - 1` micro-batches more (the
  bubble, `(pp - 1) / (m + pp - 1)` of the step when compute paces it);
- under an interleaved schedule each position holds `v` (2) stages of `c / v` each: a
  micro-batch crosses every link `v` times each way, and the fill costs `pp - 1` of the smaller
  stages, `m x max(c, 2vt) + (pp - 1) x (c / v + 2t)` (the bubble `(pp - 1) / (v m + pp - 1)`);
  under zero bubble the weights' backward fills the bubble but for the forward, `f = 1/3` of a
  stage's work where forward, input and weight backward cost alike (strategies/pipeline FILL_SHARE):
  `(pp - 1) x (f c / v + 2t)`;
- then each stage's replicas all-reduce its gradients (a `1/pp` share of the model's) inside its
  node, after the schedule (not overlapped);
- with tensor parallelism inside a stage (`tp`, its ranks inside a node), a stage's blocks are
  split `tp` ways (`c` over `tp`, the head whole) and each micro-batch all-reduces its
  activations `tp_boundaries / pp` times over the tp group, inside the stage's compute; the
  replicas' gradients are a `1/(pp tp)` share.

A rank's memory: its stage's parameters, gradients and optimizer state (`1/pp` of the model's,
the tensor-parallel plan's share of them split `tp` ways;
with parallel.dp_shard split over the stage's `dp` replicas, and the stage's parameters and
gradients whole beside them during the step), and the activations of the micro-batches in flight at once on the first stage (all `m` under
GPipe, at most `pp` under 1F1B), each `b` samples of `1/pp` of the model's layers; interleaved,
at most `(v - 1) pp + 2 pp - 1` stage-passes of `1/(v pp)` of the layers (torch's warm-up).
"""

from __future__ import annotations

from gearshift.orchestrator.policy import costmodel
from gearshift.strategies.pipeline import FILL_SHARE, stages_per_rank
from gearshift.orchestrator.policy.costmodel import (PARAM_BYTES, Hardware, Link, MemoryOverhead, ModelShape, Prediction,
                                                     allreduce_time, group_link)


def microbatches(share: int, pp: int) -> int:
    """As a job resolves parallel.pp_microbatches left null (one rule: strategies/pipeline/__init__.py)."""
    from gearshift.strategies.pipeline import microbatches as resolved

    return resolved(share, pp)


def stage_link(hw: Hardware, pp: int) -> Link:
    """The link between two stages: between nodes when the stages are a node or more each,
    inside a node when a node holds several stages."""
    return group_link(hw, pp <= hw.nodes and hw.nodes > 1, 1)


def predict(model: ModelShape, hw: Hardware, global_batch: int, pp: int, dp: int,
            microbatches_: int | None = None, schedule: str = "1f1b", tp: int = 1) -> Prediction:
    """One step of a pipeline of `pp` stages and `dp` replicas (of `tp` tensor-parallel ranks
    each) on `hw`."""
    if pp * dp * tp > hw.devices:
        raise ValueError(f"pp({pp}) x dp({dp}) x tp({tp}) = {pp * dp * tp} devices; the hardware has {hw.devices}")
    if global_batch % dp:
        raise ValueError(f"dp({dp}) must divide the global batch ({global_batch})")
    share = global_batch // dp
    m = microbatches_ or microbatches(share, pp)
    b = share / m
    head = model.tp_replicated  # a replicated head: on the last stage, whole
    c = (model.flops_per_sample * b * ((1 - head) / (pp * tp) + head) + (model.tp_overhead_flops if tp > 1 else 0.0)
         ) / hw.flops
    tp_mb = stage_tp(model, hw, b, pp, tp)
    c += tp_mb
    link = stage_link(hw, pp)
    t = model.boundary_bytes_per_sample * b / link.bandwidth + link.latency if pp > 1 else 0.0
    v, f = stages_per_rank(schedule), FILL_SHARE.get(schedule, 1.0)
    steady = m * max(c, 2 * v * t)
    fill = (pp - 1) * (f * c / v + 2 * t)
    grads = model.params * model.grad_bytes_per_param / (pp * tp)
    dp_comm = allreduce_time(grads, dp, group_link(hw, dp * tp > hw.per_node, min(tp, hw.per_node))) if dp > 1 else 0.0
    compute = m * (c - tp_mb)
    step = steady + fill + dp_comm
    return Prediction(dp, tp, 0.0, compute, m * tp_mb, dp_comm, step - compute, step,
                      global_batch / step if step > 0 else 0.0, 1, pp, m,
                      bubble_s=(pp - 1) * f * c / v, link_s=(v * m + pp - 1) * 2 * t)


def stage_tp(model: ModelShape, hw: Hardware, samples: float, pp: int, tp: int) -> float:
    """Seconds a stage's tensor-parallel all-reduces take for a micro-batch of `samples`: its
    `1/pp` share of the model's, over a tp group inside a node."""
    if tp == 1:
        return 0.0
    link = group_link(hw, tp > hw.per_node or hw.per_node % tp != 0, max(1, hw.per_node // tp))
    return model.tp_boundaries / pp * allreduce_time(model.boundary_bytes_per_sample * samples, tp, link)


def memory(model: ModelShape, pp: int, dp: int, *, global_batch: int, microbatches_: int | None = None,
           schedule: str = "1f1b", optimizer_states: int = 2, overhead: MemoryOverhead = MemoryOverhead(),
           shard: int = 1, tp: int = 1, **_ignored) -> dict:
    """Bytes one rank of the first stage holds at its peak (the most micro-batches in flight).
    `shard` (parallel.dp_shard: dp): the stage's state split over its replicas, and during the
    step its parameters gathered whole (from a block's first forward until the schedule's end)
    and its gradients accumulated whole over the micro-batches, beside the shards (`gathered`):
    the peak falls below the unsharded stage's only where the optimizer state's share saved,
    `(1 - 1/shard)` of it, exceeds the shards' `1/shard` of the parameters and gradients."""
    share = global_batch // dp
    m = microbatches_ or microbatches(share, pp)
    b = share / m
    stage = model.params / pp * (model.tp_param_share / tp + 1 - model.tp_param_share)
    local = stage / shard
    out = {"params": local * PARAM_BYTES, "grads": local * model.grad_bytes_per_param,
           "optimizer": local * 4.0 * optimizer_states, "gathered": 0.0, "cast_weights": 0.0}
    if shard > 1:
        out["gathered"] = stage * (PARAM_BYTES + model.grad_bytes_per_param)
    v = stages_per_rank(schedule)
    in_flight = m if schedule == "gpipe" else min(m, pp) if v == 1 else min(v * m, (v - 1) * pp + 2 * pp - 1)
    per_sample = model.activations.per_sample(tp) if model.activations else 0.0
    out["activations"] = in_flight * b * per_sample / (pp * v)
    tensors = sum(out.values())
    out["overhead"] = overhead.fixed + overhead.fraction * tensors
    out["total"] = tensors + out["overhead"]
    out["micro_batch"] = b
    return out


def memory_of(model: ModelShape, layout, *, global_batch: int, **settings) -> dict:
    """`memory` of any layout (anything with dp, tp, shard and pp): a pipeline's here, the
    others' costmodel.memory."""
    if getattr(layout, "pp", 1) > 1:
        return memory(model, layout.pp, layout.dp, global_batch=global_batch, shard=layout.shard, tp=layout.tp,
                      **settings)
    return costmodel.memory(model, layout.dp, layout.tp, layout.shard, global_batch=global_batch, **settings)


def layouts(hw: Hardware, global_batch: int, model: ModelShape) -> list[tuple[int, int]]:
    """(pp, dp) over all devices: stages of whole nodes (pp dividing the nodes), at most one a
    block, each replica's share of the batch whole."""
    out = []
    for pp in range(2, hw.nodes + 1):
        dp = hw.devices // pp
        if hw.nodes % pp == 0 and (not model.blocks or pp <= model.blocks) and global_batch % dp == 0:
            out.append((pp, dp))
    return out


def pipelines(model: ModelShape, hw: Hardware, global_batch: int) -> list[Prediction]:
    """Each pipeline layout of `layouts`, at its default micro-batches, and with tensor
    parallelism inside its stages: tp a power of two dividing a node's devices (and the model's
    heads), dp the rest."""
    out = []
    for pp, dp in layouts(hw, global_batch, model):
        tp = 1
        while tp <= min(dp, hw.per_node):
            if dp % tp == 0 and hw.per_node % tp == 0 and (not model.tp_divides or model.tp_divides % tp == 0) \
                    and global_batch % (dp // tp) == 0:
                out.append(predict(model, hw, global_batch, pp, dp // tp, tp=tp))
            tp *= 2
    return out


def plan(model: ModelShape, hw: Hardware, global_batch: int, **kwargs) -> list[Prediction]:
    """costmodel.plan's layouts (`kwargs` go to it) and the pipelines, fastest first."""
    preds = costmodel.plan(model, hw, global_batch, **kwargs)
    if model.blocks >= 2:
        preds = sorted(preds + pipelines(model, hw, global_batch), key=lambda p: p.step_s)
    return preds
