"""A step-time and memory model for data, tensor, hybrid and sharded (fsdp, hsdp) layouts: pure
Python, no torch, no Ray.

It predicts, for one training step of a layout dp x tp:

- compute: the step's FLOPs over the devices, at the device's sustained rate; the share of them
  that tensor parallelism leaves whole on every rank of a group (`ModelShape.tp_replicated`, a
  replicated head) is not divided by tp, and a sharded layout adds a fixed amount of work a step
  (`tp_overhead_flops`: op dispatch and resharding, fitted from a tensor run);
- tensor-parallel comm: the activation all-reduces at every tensor-parallel boundary (two in the
  forward and two in the backward of each transformer layer, Megatron-style; six a layer for the
  built-in GPT, whose q, k and v are separate layers), which nothing overlaps: they are all exposed;
- data-parallel comm: the gradient all-reduce in buckets of `bucket_cap_mb`. A bucket is ready
  when backward has produced its gradients (backward runs from the last layer to the first, at an
  even rate over the parameters); its all-reduce starts then, or when the one before it ends.
  What is left after backward ends is the exposed wait.

- sharded state (fsdp, hsdp, hybrid with dp_shard): FSDP's traffic instead of the all-reduce: each
  unit's parameters all-gathered before its forward and again before its backward, its gradients
  reduce-scattered after (1.5x the bytes of an all-reduce), over the shard group; hsdp then
  all-reduces the reduce-scattered shard across the groups. Forward's gathers run one unit ahead
  of compute; backward's overlap it as DDP's buckets do.

`memory` predicts the bytes one rank holds at its peak (the start of backward), term by term.
What a job's model is to the cost model (its shape, its memory settings) job_shape.py reads.

Collectives cost the standard ring figures: all-reduce 2(n-1)/n x bytes / bandwidth + 2(n-1) x
latency; all-gather (n-1)/n x bytes / bandwidth + (n-1) x latency. A group that spans nodes runs at
the slower link between nodes: a ring is as fast as its slowest hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace  # noqa: F401 (callers take replace from here)



@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s each device can push through this link in a ring (bus bandwidth)
    latency: float = 0.0  # seconds per ring hop

    def __post_init__(self):
        if self.bandwidth <= 0 or self.latency < 0:
            raise ValueError(f"a link needs bandwidth > 0 and latency >= 0, not {self}")


def allreduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce of `nbytes` over `n` ranks."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def allgather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather ending with `nbytes` on every rank."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


GiB = 2**30


PARAM_BYTES = 4.0  # parameters and their master copy stay fp32: the job's bf16 and fp16 are autocast


@dataclass(frozen=True)
class MemoryOverhead:
    """Device memory that no tensor of the model accounts for, as an explicit term to calibrate
    (`fit_memory_overhead`) or set in a cluster spec."""

    fixed: float = 1.0 * GiB  # the CUDA context, NCCL's buffers, cuBLAS workspaces: taken before the first tensor
    fraction: float = 0.10    # the caching allocator's rounding and fragmentation, on top of what tensors take

    def __post_init__(self):
        if self.fixed < 0 or self.fraction < 0:
            raise ValueError(f"memory overhead must be >= 0, not {self}")


@dataclass(frozen=True)
class Activations:
    """Bytes one sample's forward leaves for backward, by where they are (see `per_sample`)."""

    layers: int             # repeated layers
    per_layer: float        # of one layer, the part tensor parallelism leaves whole on every rank (norms'
                            # inputs, the inputs of column-parallel layers)
    per_layer_split: float  # of one layer, the part tp ranks split (q, k, v, attention's output, the MLP's width)
    layer_input: float      # a layer's input: all that activation checkpointing keeps of it
    outside: float = 0.0    # outside the layers: the head's logits, the loss's fp32 copy, the final norm's input
    recompute: bool = False

    def per_sample(self, tp: int = 1) -> float:
        layer = self.per_layer + self.per_layer_split / tp
        if self.recompute:  # every layer's input kept, one layer's activations rebuilt at a time in backward
            return self.layers * self.layer_input + layer + self.outside
        return self.layers * layer + self.outside


@dataclass(frozen=True)
class Hardware:
    """Devices per node, nodes, the device's sustained FLOP/s, and the two links."""

    nodes: int
    per_node: int
    flops: float              # sustained FLOP/s of one device on this model's math
    intra: Link               # per device, inside a node (NVLink, NVSwitch; loopback on one machine)
    inter: Link               # per node: all its NICs together (InfiniBand, Ethernet), shared by the
                              # rings that leave the node at once
    name: str = ""
    device_memory: float = 0.0  # bytes one device holds; 0: not known (no layout is judged on memory)
    memory_overhead: MemoryOverhead = field(default_factory=lambda: MemoryOverhead())

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class ModelShape:
    """What the model's size means for the step: parameters, FLOPs per sample (forward and
    backward, recompute included when the job checkpoints activations), the activation bytes one
    sample sends at each tensor-parallel boundary, and how many such boundaries a step crosses."""

    params: float
    flops_per_sample: float
    boundary_bytes_per_sample: float = 0.0   # activations at one tp boundary, per sample
    tp_boundaries: int = 0                   # all-reduces per step under tp (4 per transformer layer)
    grad_bytes_per_param: float = 4.0        # gradient dtype (fp32 4, fp16/bf16 2)
    tp_replicated: float = 0.0               # share of the FLOPs that tensor parallelism does not
                                             # split (a replicated output head)
    tp_overhead_flops: float = 0.0           # work a sharded layout adds on each rank a step, as
                                             # FLOPs at the device's rate (op dispatch, resharding)
    backward_share: float = 2 / 3            # of the compute: 2 of 3 units, 3 of 4 when backward
                                             # recomputes the forward (activation checkpointing)
    tp_divides: int = 0                      # tp must divide this (attention heads); 0: any tp
    name: str = ""
    # for memory and FSDP's traffic
    tp_param_share: float = 1.0              # of the parameters, the share tensor parallelism splits (the
                                             # plan's Linear layers); embeddings and norms stay whole
    blocks: int = 0                          # units FSDP gathers one at a time (transformer layers); 0: the
                                             # whole model is one unit
    block_params: float = 0.0                # parameters of one such unit; the rest (embeddings, head) is
                                             # the root unit, gathered for the whole step
    outside_units: int = 0                   # the rest sharded as this many units of their own instead (the
                                             # embedding and the head: strategies/fsdp.py _large_outside),
                                             # an even share each, the first before the blocks, the others after
    activations: Activations | None = None   # None: not modelled (counted as 0 bytes)
    cast_share: float = 1.0                  # of the parameters, those whose autocast copies autograd keeps
                                             # for backward: Linear weights whose input needs a gradient

    def __post_init__(self):
        if not 0.0 <= self.tp_replicated <= 1.0:
            raise ValueError(f"tp_replicated is a share of the FLOPs, 0..1, not {self.tp_replicated}")
        if not 0.0 <= self.tp_param_share <= 1.0:
            raise ValueError(f"tp_param_share is a share of the parameters, 0..1, not {self.tp_param_share}")
        if self.blocks * self.block_params > self.params:
            raise ValueError(f"blocks({self.blocks}) x block_params({self.block_params:g}) > params({self.params:g})")
        if self.tp_overhead_flops < 0:
            raise ValueError(f"tp_overhead_flops must be >= 0, not {self.tp_overhead_flops}")

    @staticmethod
    def transformer(layers: int, hidden: int, seq: int, vocab: int, act_bytes: float = 2.0,
                    grad_bytes: float = 2.0, recompute: bool = True, tp_allreduces_per_layer: int = 4,
                    head_parallel: bool = True, ffn_mult: int = 4, heads: int = 0, params: float | None = None,
                    name: str = "") -> ModelShape:
        """A GPT of `layers` layers of width `hidden` over `seq` tokens. Parameters 12 l h^2 + V h
        unless counted exactly (`params`). FLOPs per sample as Megatron-LM counts them (Narayanan
        et al., arXiv 2104.04473, appendix): forward (8 + 4 m) s h^2 + 4 s^2 h a layer (m the
        MLP's width multiple) and 2 s h V for the head, backward twice the forward, and with
        recompute the layers' forward once more: 96 s l h^2 (1 + s/(6h) + V/(16 l h)) for m = 4
        (72 s l h^2 (...) without recompute). Under tensor parallelism a layer all-reduces its
        activations `tp_allreduces_per_layer` times: 4 with Megatron's fused q, k, v projection
        (2 forward, 2 backward), 6 when q, k and v are separate column-parallel layers (each one's
        input gradient is all-reduced on its own). Megatron splits the output head over the
        vocabulary; a replicated head (`head_parallel=False`) is FLOPs tensor parallelism leaves
        whole. Attention splits by whole heads: tp must divide `heads` (0: not checked)."""
        layer = (8 + 4 * ffn_mult) * seq * hidden ** 2 + 4 * seq ** 2 * hidden
        head = 2 * seq * hidden * vocab
        per_sample = (4 if recompute else 3) * layers * layer + 3 * head
        block = (4 + 2 * ffn_mult) * hidden ** 2  # q, k, v, proj and the MLP's two layers (biases, norms: noise)
        params = params if params is not None else layers * block + vocab * hidden
        return ModelShape(params=params, flops_per_sample=per_sample,
                          boundary_bytes_per_sample=seq * hidden * act_bytes,
                          tp_boundaries=tp_allreduces_per_layer * layers, grad_bytes_per_param=grad_bytes,
                          tp_replicated=0.0 if head_parallel else 3 * head / per_sample,
                          backward_share=3 / 4 if recompute else 2 / 3, tp_divides=heads, name=name,
                          tp_param_share=min(1.0, layers * block / params), blocks=layers,
                          block_params=min(block, params / max(1, layers)),
                          activations=transformer_activations(layers, hidden, seq, vocab, act_bytes, ffn_mult,
                                                              recompute))


def transformer_activations(layers: int, hidden: int, seq: int, vocab: int, act_bytes: float = 2.0,
                            ffn_mult: int = 4, recompute: bool = False) -> Activations:
    """What a GPT layer saves for backward, per sample (Korthikanti et al., arXiv 2205.05198, counted
    for the built-in GPT: no dropout, attention by scaled_dot_product_attention, whose fused kernels
    keep no seq x seq scores). The residual stream is fp32 under autocast, so the two norms' inputs
    and a checkpointed layer's input are 4 bytes an element; what goes into a matmul is in the
    compute dtype (`act_bytes`). Whole on every tp rank: the two norms' inputs and the inputs of the
    column-parallel q, k, v and fc; split: q, k, v, attention's output, the projection's input and
    the MLP's inner width twice (its activation's input and output). Outside the layers: the logits
    in the compute dtype, the loss's fp32 copy of them and the final norm's input."""
    sh = seq * hidden
    return Activations(layers=layers, per_layer=sh * (2 * 4 + 2 * act_bytes),
                       per_layer_split=sh * act_bytes * (5 + 2 * ffn_mult), layer_input=sh * 4,
                       outside=seq * vocab * (act_bytes + 4) + sh * 4, recompute=recompute)


@dataclass(frozen=True)
class Prediction:
    dp: int
    tp: int
    bucket_cap_mb: float
    compute_s: float
    tp_comm_s: float
    dp_comm_s: float          # the gradient all-reduces' total time
    exposed_wait_s: float     # comm that no compute hides: tp comm + dp comm left after backward
    step_s: float
    samples_per_s: float
    shard: int = 1            # dp ranks that split each replica's state (1: replicated)
    pp: int = 1               # pipeline stages (orchestrator/policy/pipeline_cost.py)
    microbatches: int = 0     # a pipeline's micro-batches a step
    bubble_s: float = 0.0     # a pipeline stage's time idle filling and draining the pipeline
    link_s: float = 0.0       # a pipeline stage's time its activations spend on the link, both ways

    @property
    def comm_wait_frac(self) -> float:
        return self.exposed_wait_s / self.step_s if self.step_s > 0 else 0.0

    @property
    def strategy(self) -> str:
        return strategy_of(self.dp, self.tp, self.shard, self.pp)

    @property
    def label(self) -> str:
        """How a table names the layout: the strategy, hsdp's group size, hybrid's sharded data
        dimension, a pipeline's stages."""
        if self.pp > 1:
            return f"pipeline:{self.pp}" + (f"xtp{self.tp}" if self.tp > 1 else "")
        if self.shard > 1 and self.tp > 1:
            return "hybrid:fsdp"
        return f"hsdp:{self.shard}" if self.strategy == "hsdp" else self.strategy

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "comm_wait_frac": self.comm_wait_frac}


def strategy_of(dp: int, tp: int, shard: int = 1, pp: int = 1) -> str:
    """The built-in strategy a (dp, tp, shard, pp) layout is: a hybrid with dp_shard stays `hybrid`."""
    if pp > 1:
        return "pipeline"
    if tp > 1:
        return "tensor" if dp == 1 else "hybrid"
    if shard == 1 or dp == 1:
        return "data"
    return "fsdp" if shard == dp else "hsdp"


def buckets(total_bytes: float, cap_bytes: float) -> list[float]:
    """Sizes of the gradient buckets, in the order backward fills them."""
    if total_bytes <= 0:
        return []
    n = max(1, math.ceil(total_bytes / cap_bytes))
    return [cap_bytes] * (n - 1) + [total_bytes - cap_bytes * (n - 1)]


def overlap(backward_s: float, sizes: list[float], per_bucket_s: list[float]) -> tuple[float, float]:
    """(all-reduce time in total, time left after backward ends) for buckets that become ready as
    backward produces their share of the gradients and run one after another."""
    total = sum(sizes)
    done, ready, comm_end = 0.0, 0.0, 0.0
    for size, t in zip(sizes, per_bucket_s):
        done += size
        ready = backward_s * done / total
        comm_end = max(comm_end, ready) + t
    return sum(per_bucket_s), max(0.0, comm_end - backward_s)


def group_link(hw: Hardware, span_nodes: bool, streams: int = 1) -> Link:
    """The link a ring runs at: inside a node, the device's own; across nodes, the node's share
    for each of the `streams` rings leaving it at once (a ring is as fast as its slowest hop)."""
    if not span_nodes:
        return hw.intra
    return Link(min(hw.intra.bandwidth, hw.inter.bandwidth / max(1, streams)), hw.inter.latency)


def predict(model: ModelShape, hw: Hardware, global_batch: int, dp: int, tp: int,
            bucket_cap_mb: float = 25.0, backward_share: float | None = None, shard: int = 1) -> Prediction:
    """One step of a dp x tp layout on `hw`, ranks contiguous per node (tp groups inside a node
    when tp divides the node's devices); `shard` > 1: each replica's state split over groups of
    that many dp ranks (fsdp: dp; hsdp: a node), which `bucket_cap_mb` then does not apply to."""
    if dp * tp > hw.devices:
        raise ValueError(f"dp({dp}) x tp({tp}) = {dp * tp} devices; the hardware has {hw.devices}")
    if global_batch % dp:
        raise ValueError(f"dp({dp}) must divide the global batch ({global_batch})")
    if shard < 1 or dp % shard:
        raise ValueError(f"shard({shard}) must divide dp({dp})")
    per_dp = global_batch / dp
    compute = (model.flops_per_sample * per_dp * ((1 - model.tp_replicated) / tp + model.tp_replicated)
               + (model.tp_overhead_flops if tp > 1 else 0.0)) / hw.flops
    backward = compute * (model.backward_share if backward_share is None else backward_share)
    tp_spans = tp > hw.per_node or hw.per_node % tp != 0
    # a tp group that leaves its node: its ring crosses out of the node once, beside the rings of the
    # node's other tp groups (one group per node once a group spans nodes)
    tp_comm = model.tp_boundaries * allreduce_time(model.boundary_bytes_per_sample * per_dp, tp,
                                                     group_link(hw, tp_spans, max(1, hw.per_node // tp))) if tp > 1 else 0.0
    # a dp group takes one rank from each tp group: it spans nodes once the model's replicas do,
    # and the node's NICs are shared by the dp groups with ranks on it (one per tp index)
    if shard > 1:
        dp_comm, left = sharded_comm(model, hw, dp, tp, shard, compute - backward, backward)
    else:
        dp_spans = dp * tp > hw.per_node
        grad_bytes = model.params * model.grad_bytes_per_param / tp
        sizes = buckets(grad_bytes, bucket_cap_mb * 2**20)
        link = group_link(hw, dp_spans, min(tp, hw.per_node))
        per_bucket = [allreduce_time(b, dp, link) for b in sizes] if dp > 1 else [0.0] * len(sizes)
        dp_comm, left = overlap(backward, sizes, per_bucket)
    exposed = tp_comm + left
    step = compute + exposed
    return Prediction(dp, tp, bucket_cap_mb, compute, tp_comm, dp_comm, exposed, step,
                      global_batch / step if step > 0 else 0.0, shard)


def units(model: ModelShape, tp: int = 1) -> list[float]:
    """Parameters of each unit FSDP gathers at once, on one tp rank, in forward order: the root
    (embeddings, final norm, head: what is not in a block) first, then the blocks. A block is
    nearly all tensor-parallel Linear weights; the root keeps the rest of this rank's slice."""
    split = model.tp_param_share
    local = model.params * (1 - split + split / tp)
    if model.blocks == 0:
        return [local]
    block = model.block_params / tp
    rest = max(0.0, local - model.blocks * block)
    if model.outside_units > 0:
        share = rest / model.outside_units
        return [share] + [block] * model.blocks + [share] * (model.outside_units - 1)
    return [rest] + [block] * model.blocks


def prefetched(compute_s: float, gathers: list[float]) -> float:
    """Time a pass over units waits for their parameters: each unit's compute (an even share)
    needs its own all-gather done; the gathers run one after another, each starting once the unit
    before it has started computing (FSDP prefetches one unit ahead)."""
    if not gathers:
        return 0.0
    per = compute_s / len(gathers)
    gather_end, compute_end, started = 0.0, 0.0, 0.0
    for t in gathers:
        gather_end = max(gather_end, started) + t
        started = max(compute_end, gather_end)
        compute_end = started + per
    return max(0.0, compute_end - compute_s)


def sharded_comm(model: ModelShape, hw: Hardware, dp: int, tp: int, shard: int, forward_s: float,
                 backward_s: float) -> tuple[float, float]:
    """(FSDP's traffic in total, the part no compute hides) for state split over groups of
    `shard` dp ranks: a unit's parameters all-gathered for forward and again for backward, its
    gradients reduce-scattered after (a ring reduce-scatter costs what an all-gather does); with
    dp / shard replicas (hsdp) the reduce-scattered shard is then all-reduced across them. Forward's
    gathers are prefetched; backward's unit traffic overlaps backward as DDP's buckets do."""
    sizes = [u * model.grad_bytes_per_param for u in units(model, tp)]
    # a shard group is `shard` dp ranks tp apart; the node's NICs are shared by the tp groups' rings
    link = group_link(hw, shard * tp > hw.per_node, min(tp, hw.per_node))
    gather = [allgather_time(b, shard, link) for b in sizes]
    replicas = dp // shard
    # one replica ring per rank of a group that leaves the node: each carries a 1/shard share
    cross = group_link(hw, dp * tp > hw.per_node, min(shard * tp, hw.per_node))
    reduce = [allreduce_time(b / shard, replicas, cross) if replicas > 1 else 0.0 for b in sizes]
    forward_wait = prefetched(forward_s, gather)
    per_unit = [2 * g + r for g, r in zip(gather, reduce)]  # gather again, reduce-scatter, (all-reduce)
    backward_total, left = overlap(backward_s, sizes[::-1], per_unit[::-1])
    return sum(gather) + backward_total, forward_wait + left


OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0}  # fp32 tensors per parameter (sgd: 1 with momentum)


def micro_batch_of(global_batch: int, dp: int, micro_batch: int | None = None) -> int:
    """Samples a rank computes at once: the job's micro-batch, or its whole share when none is
    given or the micro-batch does not fit the share."""
    share = max(1, global_batch // dp)
    return micro_batch if micro_batch and micro_batch <= share else share


def memory(model: ModelShape, dp: int, tp: int = 1, shard: int = 1, *, global_batch: int,
           micro_batch: int | None = None, optimizer_states: int = 2, compute_bytes: float = 4.0,
           overhead: MemoryOverhead = MemoryOverhead()) -> dict:
    """Bytes one rank holds at its peak, the start of backward: {params, grads, optimizer,
    gathered, cast_weights, activations, overhead, total} and the micro-batch (samples) the
    activations are for.

    Parameters, gradients and `optimizer_states` fp32 tensors per parameter (Adam 2, SGD with
    momentum 1) are this rank's tensor-parallel slice (the plan's Linear weights split by tp, the
    rest whole), divided by `shard` when state is sharded (fsdp: dp, hsdp: the group, hybrid with
    dp_shard: dp). Sharded state is gathered a unit at a time (`gathered`): the root unit
    (embeddings, head) stays gathered from forward into backward, and two blocks are whole at once
    (the one computing and the one prefetched) with one block's unsharded gradients. Under bf16 or
    fp16 autocast (`compute_bytes` 2) the Linear weights' casts live until backward uses them
    (`cast_weights`): those of `cast_share` for replicated state without checkpointing; with checkpointing
    or sharded state (gathered in the compute dtype), the root's and two blocks'. Activations are
    one micro-batch's (global / (dp x accumulation)). `overhead` adds the runtime and allocator."""
    b = micro_batch_of(global_batch, dp, micro_batch)
    parts = units(model, tp)
    local = sum(parts)
    out = {"params": local / shard * PARAM_BYTES, "grads": local / shard * model.grad_bytes_per_param,
           "optimizer": local / shard * 4.0 * optimizer_states, "gathered": 0.0, "cast_weights": 0.0}
    # what a layout holds whole for a while: one unit when the model is one, else the root (or, sharded
    # as units of their own, the largest of the embedding and the head) and two blocks
    transient = local if len(parts) == 1 else parts[0] + 2 * (parts[1] if len(parts) > 1 else 0.0)
    if shard > 1:
        block = parts[-1]
        out["gathered"] = (transient * PARAM_BYTES + block * model.grad_bytes_per_param) * (1 - 1 / shard)
    if compute_bytes < PARAM_BYTES:
        recompute = model.activations is not None and model.activations.recompute
        out["cast_weights"] = (transient if shard > 1 or recompute else local * model.cast_share) * compute_bytes
    out["activations"] = b * model.activations.per_sample(tp) if model.activations else 0.0
    tensors = sum(out.values())
    out["overhead"] = overhead.fixed + overhead.fraction * tensors
    out["total"] = tensors + out["overhead"]
    out["micro_batch"] = b
    return out


def fits(breakdown: dict, device_memory: float) -> tuple[bool, dict]:
    """Whether a predicted breakdown fits a device of `device_memory` bytes (0: not known, so it
    does), with what a decision's evidence says about it."""
    ok = not device_memory or breakdown["total"] <= device_memory
    return ok, {"predicted_bytes": breakdown["total"], "available_bytes": device_memory or None,
                "reason": None if ok else does_not_fit(breakdown["total"], device_memory)}


def does_not_fit(predicted: float, available: float) -> str:
    return f"does not fit: {predicted / GiB:.1f} > {available / GiB:.3g} GiB"


def fit_memory_overhead(breakdown: dict, measured_bytes: float, fixed: float = 1.0 * GiB) -> MemoryOverhead:
    """The overhead fraction that makes `memory`'s prediction (its breakdown) the peak a run
    measured on the device (memory the process reserved, not only what tensors took), at a given
    fixed part; 0 when the tensors alone reach the measurement."""
    tensors = breakdown["total"] - breakdown["overhead"]
    return MemoryOverhead(fixed, max(0.0, (measured_bytes - fixed - tensors) / tensors) if tensors > 0 else 0.0)


def layouts(hw: Hardware, global_batch: int, devices: int | None = None, model_divides: int = 0
            ) -> list[tuple[int, int]]:
    """(dp, tp) pairs over all devices: tp a power of two dividing the devices (inside a node, or
    spanning whole nodes) and, for a model that splits by heads, its head count; dp dividing the
    batch."""
    n = devices or hw.devices
    out = []
    tp = 1
    while tp <= n:
        if n % tp == 0 and global_batch % (n // tp) == 0 and (not model_divides or model_divides % tp == 0):
            out.append((n // tp, tp))
        tp *= 2
    return out


def sharded_layouts(hw: Hardware, global_batch: int, model_divides: int = 0) -> list[tuple[int, int, int]]:
    """(dp, tp, shard) for every layout over all devices: each of `layouts` with replicated state,
    and where there are dp ranks to split it over, with sharded state: fsdp (over all of them),
    hsdp (over the devices of a node, replicated across nodes: two nodes or more of two devices or
    more) and hybrid with dp_shard (over the data dimension)."""
    out = []
    for dp, tp in layouts(hw, global_batch, model_divides=model_divides):
        out.append((dp, tp, 1))
        if dp < 2:
            continue
        if tp == 1 and hw.nodes >= 2 and hw.per_node >= 2 and dp % hw.per_node == 0:
            out.append((dp, 1, hw.per_node))
        out.append((dp, tp, dp))
    return out


def plan(model: ModelShape, hw: Hardware, global_batch: int,
         buckets_mb: tuple[float, ...] = (1, 5, 10, 25, 50, 100), sharded: bool = True) -> list[Prediction]:
    """Every layout at every bucket size (one for those without a data-parallel all-reduce: no dp,
    or sharded state), fastest first; `sharded=False` leaves out fsdp, hsdp and hybrid dp_shard.
    (Pipelines: pipeline_cost.plan, which adds them.)"""
    preds = [predict(model, hw, global_batch, dp, tp, b, shard=shard)
             for dp, tp, shard in sharded_layouts(hw, global_batch, model_divides=model.tp_divides)
             if sharded or shard == 1
             for b in (buckets_mb if dp > 1 and shard == 1 else buckets_mb[:1])]
    return sorted(preds, key=lambda p: p.step_s)
