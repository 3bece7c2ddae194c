"""A step-time model for data, tensor and hybrid layouts: pure Python, no torch, no Ray.

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

Collectives cost the standard ring figures: all-reduce 2(n-1)/n x bytes / bandwidth + 2(n-1) x
latency; all-gather (n-1)/n x bytes / bandwidth + (n-1) x latency. A group that spans nodes runs at
the slower link between nodes: a ring is as fast as its slowest hop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


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
    name: str = ""

    def __post_init__(self):
        if not 0.0 <= self.tp_replicated <= 1.0:
            raise ValueError(f"tp_replicated is a share of the FLOPs, 0..1, not {self.tp_replicated}")
        if self.tp_overhead_flops < 0:
            raise ValueError(f"tp_overhead_flops must be >= 0, not {self.tp_overhead_flops}")

    @staticmethod
    def transformer(layers: int, hidden: int, seq: int, vocab: int, act_bytes: float = 2.0,
                    grad_bytes: float = 2.0, recompute: bool = True, tp_allreduces_per_layer: int = 4,
                    head_parallel: bool = True, name: str = "") -> ModelShape:
        """A GPT: parameters 12 l h^2 + V h; FLOPs per sample from Megatron-LM (arXiv 1909.08053,
        appendix): 96 s l h^2 (1 + s/(6h) + V/(16 l h)) with recompute (72 without). Under tensor
        parallelism a layer all-reduces its activations `tp_allreduces_per_layer` times: 4 with
        Megatron's fused q, k, v projection (2 forward, 2 backward), 6 when q, k and v are separate
        column-parallel layers (each one's input gradient is all-reduced on its own). Megatron
        splits the output head over the vocabulary; a replicated head (`head_parallel=False`) is
        the FLOPs' V/(16 l h) term that tensor parallelism leaves whole."""
        params = 12 * layers * hidden ** 2 + vocab * hidden
        head = vocab / (16 * layers * hidden)
        per_sample = (96 if recompute else 72) * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + head)
        return ModelShape(params=params, flops_per_sample=per_sample, boundary_bytes_per_sample=seq * hidden * act_bytes,
                          tp_boundaries=tp_allreduces_per_layer * layers, grad_bytes_per_param=grad_bytes,
                          tp_replicated=0.0 if head_parallel else head / (1 + seq / (6 * hidden) + head), name=name)


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

    @property
    def comm_wait_frac(self) -> float:
        return self.exposed_wait_s / self.step_s if self.step_s > 0 else 0.0

    def to_dict(self) -> dict:
        return {**{k: getattr(self, k) for k in self.__dataclass_fields__}, "comm_wait_frac": self.comm_wait_frac}


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
            bucket_cap_mb: float = 25.0, backward_share: float = 2 / 3) -> Prediction:
    """One step of a dp x tp layout on `hw`, ranks contiguous per node (tp groups inside a node
    when tp divides the node's devices)."""
    if dp * tp > hw.devices:
        raise ValueError(f"dp({dp}) x tp({tp}) = {dp * tp} devices; the hardware has {hw.devices}")
    if global_batch % dp:
        raise ValueError(f"dp({dp}) must divide the global batch ({global_batch})")
    per_dp = global_batch / dp
    compute = (model.flops_per_sample * per_dp * ((1 - model.tp_replicated) / tp + model.tp_replicated)
               + (model.tp_overhead_flops if tp > 1 else 0.0)) / hw.flops
    backward = compute * backward_share
    tp_spans = tp > hw.per_node or hw.per_node % tp != 0
    # a tp group that leaves its node: its ring crosses out of the node once, beside the rings of the
    # node's other tp groups (one group per node once a group spans nodes)
    tp_comm = model.tp_boundaries * allreduce_time(model.boundary_bytes_per_sample * per_dp, tp,
                                                     group_link(hw, tp_spans, max(1, hw.per_node // tp))) if tp > 1 else 0.0
    # a dp group takes one rank from each tp group: it spans nodes once the model's replicas do,
    # and the node's NICs are shared by the dp groups with ranks on it (one per tp index)
    dp_spans = dp * tp > hw.per_node
    grad_bytes = model.params * model.grad_bytes_per_param / tp
    sizes = buckets(grad_bytes, bucket_cap_mb * 2**20)
    link = group_link(hw, dp_spans, min(tp, hw.per_node))
    per_bucket = [allreduce_time(b, dp, link) for b in sizes] if dp > 1 else [0.0] * len(sizes)
    dp_comm, left = overlap(backward, sizes, per_bucket)
    exposed = tp_comm + left
    step = compute + exposed
    return Prediction(dp, tp, bucket_cap_mb, compute, tp_comm, dp_comm, exposed, step,
                      global_batch / step if step > 0 else 0.0)


def layouts(hw: Hardware, global_batch: int, devices: int | None = None) -> list[tuple[int, int]]:
    """(dp, tp) pairs over all devices: tp a power of two that divides a node (or spans whole
    nodes), dp dividing the batch."""
    n = devices or hw.devices
    out = []
    tp = 1
    while tp <= n:
        if n % tp == 0 and global_batch % (n // tp) == 0:
            out.append((n // tp, tp))
        tp *= 2
    return out


def plan(model: ModelShape, hw: Hardware, global_batch: int,
         buckets_mb: tuple[float, ...] = (1, 5, 10, 25, 50, 100)) -> list[Prediction]:
    """Every layout at every bucket size, fastest first."""
    preds = [predict(model, hw, global_batch, dp, tp, b) for dp, tp in layouts(hw, global_batch) for b in
             (buckets_mb if dp > 1 else buckets_mb[:1])]
    return sorted(preds, key=lambda p: p.step_s)


# ----------------------------------------------------------------------------- presets

GB = 1e9
PRESETS: dict[str, Hardware] = {
    # 8 x H100 SXM per node, NVLink 4 (~450 GB/s per GPU each way, ~360 achieved in a ring), 8 x
    # 400 Gb/s InfiniBand per node (400 GB/s, ~360 achieved); ~400 TFLOP/s sustained in bf16
    "h100-ib400": Hardware(nodes=16, per_node=8, flops=400e12, intra=Link(360 * GB, 3e-6),
                           inter=Link(360 * GB, 8e-6), name="16 nodes x 8 H100, NVLink + 8 x 400 Gb/s InfiniBand"),
    # 8 x A100 SXM per node, NVLink 3 (~300 GB/s, ~230 achieved), 8 x 200 Gb/s HDR per node
    "a100-ib200": Hardware(nodes=16, per_node=8, flops=150e12, intra=Link(230 * GB, 3e-6),
                           inter=Link(180 * GB, 8e-6), name="16 nodes x 8 A100, NVLink + 8 x 200 Gb/s InfiniBand"),
    # Megatron-LM's cluster (arXiv 1909.08053): 32 DGX-2H nodes of 16 V100, NVSwitch (300 GB/s per
    # GPU both ways: 150 each way), 8 x 100 Gb/s InfiniBand per node (100 GB/s); 39 TFLOP/s
    # sustained on one GPU (their single-GPU baseline)
    "v100-dgx2h": Hardware(nodes=32, per_node=16, flops=39e12, intra=Link(150 * GB, 5e-6),
                           inter=Link(100 * GB, 10e-6), name="32 DGX-2H nodes x 16 V100, Megatron-LM's cluster"),
}


def with_nodes(hw: Hardware, nodes: int) -> Hardware:
    return replace(hw, nodes=nodes)


# ----------------------------------------------------------------------------- from a job and a spec

def shape_of_job(job) -> ModelShape:
    """The cost model's view of a job's model. The built-in GPT is described exactly; any other
    model by its parameter count (built once, on CPU) at 6 FLOPs per parameter per sample, with
    no tensor-parallel activations modelled."""
    spec = job.to_dict()["model"]
    grad_bytes = 4.0  # parameters and their gradients stay fp32 under autocast
    act = 2.0 if job.train.precision in ("bf16", "fp16") else 4.0
    if spec.get("name") == "gpt":
        import inspect  # noqa: PLC0415

        from workers.models import gpt  # noqa: PLC0415

        defaults = {n: p.default for n, p in inspect.signature(gpt).parameters.items()}
        k = {**defaults, **(spec.get("kwargs") or {})}
        # the built-in GPT's q, k and v are separate column-parallel layers (workers/models.py)
        m = ModelShape.transformer(k["n_layer"], k["n_embd"], k["block_size"], k["vocab_size"], act_bytes=act,
                                   grad_bytes=grad_bytes, recompute=job.train.activation_checkpointing,
                                   tp_allreduces_per_layer=6, head_parallel=False, name="gpt")
        return m
    from workers import components  # noqa: PLC0415

    model = components.build_model(spec, [job.base_dir])
    params = sum(p.numel() for p in model.parameters())
    return ModelShape(params=params, flops_per_sample=6.0 * params, grad_bytes_per_param=grad_bytes,
                      name=spec.get("name") or spec.get("entrypoint") or "model")


def hardware_from_spec(spec: dict | str) -> Hardware:
    """A preset name, or {preset: NAME, nodes: N} to resize one, or the figures themselves:
    {nodes, per_node, tflops, intra_gb_s, inter_gb_s, intra_latency_us, inter_latency_us}."""
    if isinstance(spec, str):
        spec = {"preset": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"a cluster spec is a preset name or a mapping, not {spec!r}")
    unknown = set(spec) - {"preset", "nodes", "per_node", "tflops", "intra_gb_s", "inter_gb_s", "intra_latency_us",
                           "inter_latency_us", "name"}
    if unknown:
        raise ValueError(f"unknown cluster spec keys {sorted(unknown)}; allowed: preset, nodes, per_node, tflops, "
                         "intra_gb_s, inter_gb_s, intra_latency_us, inter_latency_us")
    if "preset" in spec:
        if spec["preset"] not in PRESETS:
            raise ValueError(f"preset {spec['preset']!r} is not one of {', '.join(PRESETS)}")
        base = PRESETS[spec["preset"]]
    else:
        missing = {"nodes", "per_node", "tflops", "intra_gb_s", "inter_gb_s"} - set(spec)
        if missing:
            raise ValueError(f"a cluster spec without a preset needs {sorted(missing)}")
        base = Hardware(1, 1, 1.0, Link(1.0), Link(1.0))

    def num(key, default, scale=1.0, lo=0.0):
        v = spec.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > lo:
            raise ValueError(f"{key} = {v!r} must be a number > {lo:g}")
        return v * scale

    nodes = num("nodes", base.nodes)
    per_node = num("per_node", base.per_node)
    if int(nodes) != nodes or int(per_node) != per_node:
        raise ValueError(f"nodes ({nodes}) and per_node ({per_node}) must be whole numbers")
    return Hardware(nodes=int(nodes), per_node=int(per_node), flops=num("tflops", base.flops, 1e12),
                    intra=Link(num("intra_gb_s", base.intra.bandwidth, GB),
                               num("intra_latency_us", base.intra.latency, 1e-6, -1e-30)),
                    inter=Link(num("inter_gb_s", base.inter.bandwidth, GB),
                               num("inter_latency_us", base.inter.latency, 1e-6, -1e-30)),
                    name=spec.get("name") or base.name)


# ----------------------------------------------------------------------------- calibration

def steady(records: list[dict], skip: int = 10) -> list[dict]:
    """The step records past a run's first `skip` steps (allocator warm-up, lazy init). Records of
    several runs of the same layout may be pooled: each starts at step 1."""
    steps = sorted((r for r in records if r.get("type") == "step"), key=lambda r: r["step"])
    if not steps:
        return []
    kept = [r for r in steps if r["step"] >= steps[0]["step"] + skip]
    return kept if len(kept) > 5 else steps


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if xs else 0.0


def slowest_compute(record: dict) -> float:
    """The step's compute on its slowest rank: what the step waits for."""
    ranks = (record.get("ranks") or {}).get("compute_time")
    return max(ranks) if ranks else record["compute_time_mean"]


def transfer_wait(record: dict) -> float:
    """The comm wait of the rank that reached the collectives last: the transfers alone. The other
    ranks' longer waits are the skew between ranks, already in the slowest rank's compute."""
    ranks = (record.get("ranks") or {}).get("comm_wait")
    return min(ranks) if ranks else record["comm_wait_mean"]


def calibrate(model: ModelShape, records: list[dict], global_batch: int, per_node: int, nodes: int = 1,
              latency: float = 0.0) -> Hardware:
    """Hardware figures fitted from a data-parallel run's own telemetry: the device rate from its
    compute time per step, the link from its comm wait (gradients in one bucket, all exposed,
    as for a model whose gradients fit one bucket; else a lower bound on the bandwidth)."""
    rs = steady(records)
    if not rs or rs[0].get("compute_time_mean") is None:
        raise ValueError("calibration needs step records with telemetry (compute and comm-wait times)")
    dp = rs[0]["dp"]
    compute = _median([slowest_compute(r) for r in rs])
    flops = model.flops_per_sample * global_batch / dp / compute
    wait = _median([transfer_wait(r) for r in rs])
    grad = model.params * model.grad_bytes_per_param
    hops = 2 * (dp - 1)
    usable = max(wait - hops * latency, 1e-9)
    bandwidth = hops / dp * grad / usable if dp > 1 else 1e12
    link = Link(bandwidth, latency)
    return Hardware(nodes=nodes, per_node=per_node, flops=flops, intra=link, inter=link, name="calibrated")


def measured_step(records: list[dict]) -> float:
    return _median([r["step_time_max"] for r in steady(records)])


def calibrate_tensor(model: ModelShape, hw: Hardware, records: list[dict],
                     global_batch: int) -> tuple[ModelShape, Hardware]:
    """From a tensor-parallel run (dp = 1) on hardware already calibrated by a data run: the work a
    sharded layout adds on each rank (its measured compute beyond its FLOPs at the data run's
    rate), and the per-hop latency of the link inside a node (its measured comm wait beyond the
    bandwidth term, spread over its collectives' ring hops; on a CPU this also takes in the ranks'
    skew at every collective)."""
    rs = steady(records)
    if not rs or rs[0].get("compute_time_mean") is None:
        raise ValueError("calibration needs step records with telemetry (compute and comm-wait times)")
    dp, tp = rs[0]["dp"], rs[0]["tp"]
    if dp != 1 or tp < 2:
        raise ValueError(f"a tensor-parallel run (dp 1, tp >= 2) calibrates the sharded layouts, not dp {dp} tp {tp}")
    flops = model.flops_per_sample * global_batch * ((1 - model.tp_replicated) / tp + model.tp_replicated)
    overhead = max(0.0, _median([slowest_compute(r) for r in rs]) * hw.flops - flops)
    zero = Link(hw.intra.bandwidth, 0.0)
    bandwidth_only = model.tp_boundaries * allreduce_time(model.boundary_bytes_per_sample * global_batch, tp, zero)
    hops = model.tp_boundaries * 2 * (tp - 1)
    wait = _median([transfer_wait(r) for r in rs])
    lat = max(0.0, (wait - bandwidth_only) / hops) if hops else 0.0
    return replace(model, tp_overhead_flops=overhead), replace(hw, intra=Link(hw.intra.bandwidth, lat))


def nodes_of_run(records: list[dict]) -> int:
    """How many nodes a run's workers were placed on (its `starting` event), 1 if it says not."""
    for r in records:
        if r.get("type") == "event" and r.get("event") == "state" and isinstance(r.get("workers"), list):
            return max(1, len({w.get("node_id") or w.get("node_ip") for w in r["workers"]}))
    return 1


def fit_runs(model: ModelShape, hw: Hardware, runs: list[tuple[str, list[dict], int]]
             ) -> tuple[ModelShape, Hardware, list[str]]:
    """`hw` with the figures that runs of this model measured put in place of the spec's:
    [(name, telemetry records, global batch)]. A data-parallel run gives the device rate and the
    link it ran over (inside a node, or between nodes when it spanned them); a tensor-parallel run
    on one node then gives the replicated share of the compute and the per-hop latency. Returns the
    refitted model and hardware and a line per run saying what it gave."""
    notes = []
    order = sorted(runs, key=lambda r: (steady(r[1]) or [{"tp": 0}])[0].get("tp", 0))  # data runs first
    for name, records, batch in order:
        rs = steady(records)
        if not rs:
            raise ValueError(f"{name}: no step records to calibrate from")
        dp, tp, nodes = rs[0]["dp"], rs[0]["tp"], nodes_of_run(records)
        if tp == 1:
            fitted = calibrate(model, records, batch, per_node=hw.per_node,
                               latency=(hw.inter if nodes > 1 else hw.intra).latency)
            hw = replace(hw, flops=fitted.flops)
            said = f"{name}: data {dp}x1 on {nodes} node(s): {fitted.flops / 1e12:.3g} TFLOP/s a device"
            if dp > 1 and nodes > 1:
                hw = replace(hw, inter=Link(fitted.inter.bandwidth, hw.inter.latency))
                said += f", {fitted.inter.bandwidth / GB:.3g} GB/s a node between nodes"
            elif dp > 1:
                hw = replace(hw, intra=Link(fitted.intra.bandwidth, hw.intra.latency))
                said += f", {fitted.intra.bandwidth / GB:.3g} GB/s a device inside a node"
        elif dp == 1 and nodes == 1:
            model, hw = calibrate_tensor(model, hw, records, batch)
            said = (f"{name}: tensor 1x{tp}: sharding adds {model.tp_overhead_flops / hw.flops * 1e3:.3g} ms of "
                    f"work a step, {hw.intra.latency * 1e6:.3g} us a hop")
        else:
            said = f"{name}: a {dp}x{tp} layout" + (" across nodes" if nodes > 1 else "") + \
                   " calibrates nothing (use a data run, and a tensor run on one node)"
        notes.append(said)
    return model, hw, notes
