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
    backward_share: float = 2 / 3            # of the compute: 2 of 3 units, 3 of 4 when backward
                                             # recomputes the forward (activation checkpointing)
    tp_divides: int = 0                      # tp must divide this (attention heads); 0: any tp
    name: str = ""

    def __post_init__(self):
        if not 0.0 <= self.tp_replicated <= 1.0:
            raise ValueError(f"tp_replicated is a share of the FLOPs, 0..1, not {self.tp_replicated}")
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
        return ModelShape(params=params if params is not None else 12 * layers * hidden ** 2 + vocab * hidden,
                          flops_per_sample=per_sample, boundary_bytes_per_sample=seq * hidden * act_bytes,
                          tp_boundaries=tp_allreduces_per_layer * layers, grad_bytes_per_param=grad_bytes,
                          tp_replicated=0.0 if head_parallel else 3 * head / per_sample,
                          backward_share=3 / 4 if recompute else 2 / 3, tp_divides=heads, name=name)


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
            bucket_cap_mb: float = 25.0, backward_share: float | None = None) -> Prediction:
    """One step of a dp x tp layout on `hw`, ranks contiguous per node (tp groups inside a node
    when tp divides the node's devices)."""
    if dp * tp > hw.devices:
        raise ValueError(f"dp({dp}) x tp({tp}) = {dp * tp} devices; the hardware has {hw.devices}")
    if global_batch % dp:
        raise ValueError(f"dp({dp}) must divide the global batch ({global_batch})")
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


def plan(model: ModelShape, hw: Hardware, global_batch: int,
         buckets_mb: tuple[float, ...] = (1, 5, 10, 25, 50, 100)) -> list[Prediction]:
    """Every layout at every bucket size, fastest first."""
    preds = [predict(model, hw, global_batch, dp, tp, b)
             for dp, tp in layouts(hw, global_batch, model_divides=model.tp_divides)
             for b in (buckets_mb if dp > 1 else buckets_mb[:1])]
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
    """The cost model's view of a job's model. The built-in GPT by its shape (its parameters
    counted exactly, on the meta device; its FLOPs by Megatron-LM's count); any other model by its
    parameter count (built once, on the meta device where it can be) at 6 FLOPs per parameter per
    sample, with no tensor-parallel activations modelled."""
    spec = job.to_dict()["model"]
    grad_bytes = 4.0  # parameters and their gradients stay fp32 under autocast
    act = 2.0 if job.train.precision in ("bf16", "fp16") else 4.0
    if spec.get("name") == "gpt":
        import inspect  # noqa: PLC0415

        from workers.models import gpt  # noqa: PLC0415

        import torch  # noqa: PLC0415

        defaults = {n: p.default for n, p in inspect.signature(gpt).parameters.items()}
        k = {**defaults, **(spec.get("kwargs") or {})}
        with torch.device("meta"):
            params = sum(p.numel() for p in gpt(**k).parameters())
        # the built-in GPT's q, k and v are separate column-parallel layers, its head is replicated
        # (workers/models.py)
        return ModelShape.transformer(k["n_layer"], k["n_embd"], k["block_size"], k["vocab_size"], act_bytes=act,
                                      grad_bytes=grad_bytes,
                                      recompute=bool(job.train.activation_checkpointing or k["activation_checkpointing"]),
                                      tp_allreduces_per_layer=6, head_parallel=False, ffn_mult=k["ffn_mult"],
                                      heads=k["n_head"], params=params, name="gpt")
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
        if not isinstance(spec["preset"], str) or spec["preset"] not in PRESETS:
            raise ValueError(f"preset {spec['preset']!r} is not one of {', '.join(PRESETS)}")
        base = PRESETS[spec["preset"]]
    else:
        missing = {"nodes", "per_node", "tflops", "intra_gb_s", "inter_gb_s"} - set(spec)
        if missing:
            raise ValueError(f"a cluster spec without a preset needs {sorted(missing)}")
        base = Hardware(1, 1, 1.0, Link(1.0), Link(1.0))

    def num(key, default, scale=1.0, zero_ok=False):
        v = spec.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 if zero_ok else v > 0):
            raise ValueError(f"{key} = {v!r} must be a number {'>= 0' if zero_ok else '> 0'}")
        return v * scale

    nodes = num("nodes", base.nodes)
    per_node = num("per_node", base.per_node)
    if int(nodes) != nodes or int(per_node) != per_node:
        raise ValueError(f"nodes ({nodes}) and per_node ({per_node}) must be whole numbers")
    return Hardware(nodes=int(nodes), per_node=int(per_node), flops=num("tflops", base.flops, 1e12),
                    intra=Link(num("intra_gb_s", base.intra.bandwidth, GB),
                               num("intra_latency_us", base.intra.latency, 1e-6, zero_ok=True)),
                    inter=Link(num("inter_gb_s", base.inter.bandwidth, GB),
                               num("inter_latency_us", base.inter.latency, 1e-6, zero_ok=True)),
                    name=spec.get("name") or base.name)


# ----------------------------------------------------------------------------- calibration

def steady(records: list[dict], skip: int = 10) -> list[dict]:
    """The step records past a run's first `skip` steps (allocator warm-up, lazy init); all of
    them if that would leave 5 or fewer. Records of several runs of the same layout may be pooled:
    each starts at step 1."""
    steps = sorted((r for r in records if r.get("type") == "step" and isinstance(r.get("step"), int)
                    and not isinstance(r.get("step"), bool)), key=lambda r: r["step"])
    if not steps:
        return []
    kept = [r for r in steps if r["step"] >= steps[0]["step"] + skip]
    return kept if len(kept) > 5 else steps


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return (xs[n // 2] + xs[(n - 1) // 2]) / 2 if xs else 0.0


_NEEDED = ("dp", "tp", "step_time_max", "compute_time_mean", "comm_wait_mean")


def run_steps(records: list[dict]) -> list[dict]:
    """A run's steady step records, checked for what calibration reads: every timing present and
    one layout throughout (a run that switched layouts calibrates nothing)."""
    rs = steady(records)
    if not rs:
        raise ValueError("no step records")
    if len(rs) == len([r for r in records if r.get("type") == "step"]) and len(rs) <= 15:
        raise ValueError(f"{len(rs)} steps; calibration needs more than 15 (it leaves out the first 10, warm-up)")
    for r in rs:
        for key in _NEEDED:
            v = r.get(key)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"step {r['step']}: {key} = {v!r}; calibration needs step records with "
                                 "telemetry (compute and comm-wait times)")
    seen = sorted({(r["dp"], r["tp"]) for r in rs})
    if len(seen) > 1:
        raise ValueError(f"the run changed layouts ({', '.join(f'{dp}x{tp}' for dp, tp in seen)}): calibrate "
                         "from a run with a fixed strategy")
    if _median([slowest_compute(r) for r in rs]) <= 0:
        raise ValueError("the run's compute time is 0: no rate can be fitted from it")
    return rs


def slowest_compute(record: dict) -> float:
    """The step's compute on its slowest rank: what the step waits for."""
    ranks = (record.get("ranks") or {}).get("compute_time")
    return max(ranks) if ranks else record["compute_time_mean"]


def transfer_wait(record: dict) -> float:
    """The comm wait of the rank that reached the collectives last: the transfers alone. The other
    ranks' longer waits are the skew between ranks, already in the slowest rank's compute."""
    ranks = (record.get("ranks") or {}).get("comm_wait")
    return min(ranks) if ranks else record["comm_wait_mean"]


def _solve(f, target: float, lo: float = 1e3, hi: float = 1e15) -> float:
    """x in [lo, hi] with f(x) = target, for f falling as x grows (bisection in log space); the
    bound nearest when the target is out of reach."""
    if f(hi) >= target:
        return hi
    if f(lo) <= target:
        return lo
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if f(mid) > target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    return math.sqrt(lo * hi)


def calibrate(model: ModelShape, records: list[dict], global_batch: int, per_node: int, nodes: int = 1,
              latency: float = 0.0) -> Hardware:
    """Hardware figures fitted from a data-parallel run's own telemetry: the device rate from its
    slowest rank's compute time, the link's bandwidth as the one with which `predict` gives the
    run's measured comm wait (its buckets overlapping backward as they did in the run), at the
    per-hop `latency` given. A link faster than the wait can show is set at 1e15 B/s."""
    rs = run_steps(records)
    dp = rs[0]["dp"]
    if rs[0]["tp"] != 1:
        raise ValueError(f"a data-parallel run (tp 1) calibrates the device and link, not dp {dp} tp {rs[0]['tp']}")
    flops = model.flops_per_sample * global_batch / dp / _median([slowest_compute(r) for r in rs])
    bandwidth = 1e15
    if dp > 1:
        bucket = rs[0].get("bucket_cap_mb") or 25.0
        wait = _median([transfer_wait(r) for r in rs])
        per_node = min(per_node, dp)
        nodes = max(nodes, math.ceil(dp / per_node))

        def exposed(bw: float) -> float:
            link = Link(bw, latency)
            hw = Hardware(nodes=nodes, per_node=per_node, flops=flops, intra=link, inter=link)
            return predict(model, hw, global_batch, dp, 1, bucket).exposed_wait_s

        bandwidth = _solve(exposed, wait)
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
    skew at every collective). A model whose tensor-parallel activations are not modelled keeps
    the latency it had."""
    rs = run_steps(records)
    dp, tp = rs[0]["dp"], rs[0]["tp"]
    if dp != 1 or tp < 2:
        raise ValueError(f"a tensor-parallel run (dp 1, tp >= 2) calibrates the sharded layouts, not dp {dp} tp {tp}")
    flops = model.flops_per_sample * global_batch * ((1 - model.tp_replicated) / tp + model.tp_replicated)
    overhead = max(0.0, _median([slowest_compute(r) for r in rs]) * hw.flops - flops)
    model = replace(model, tp_overhead_flops=overhead)
    hops = model.tp_boundaries * 2 * (tp - 1)
    if not hops:
        return model, hw
    zero = Link(hw.intra.bandwidth, 0.0)
    bandwidth_only = model.tp_boundaries * allreduce_time(model.boundary_bytes_per_sample * global_batch, tp, zero)
    wait = _median([transfer_wait(r) for r in rs])
    lat = max(0.0, (wait - bandwidth_only) / hops)
    return model, replace(hw, intra=Link(hw.intra.bandwidth, lat))


def calibrate_pair(model: ModelShape, data: list[dict], tensor: list[dict], global_batch: int, per_node: int,
                   latency: float = 0.0, rounds: int = 200) -> tuple[ModelShape, Hardware]:
    """A data run and a tensor run on the same node, fitted together: the bandwidth from the data
    run at the latency the tensor run gives, and that latency at the data run's bandwidth, until
    neither moves (the map is a contraction: each round shrinks the change)."""
    for _ in range(rounds):
        hw = calibrate(model, data, global_batch, per_node, latency=latency)
        fitted, hw = calibrate_tensor(model, hw, tensor, global_batch)
        if abs(hw.intra.latency - latency) <= 1e-6 * max(latency, 1e-9):
            break
        latency = hw.intra.latency
    return fitted, replace(hw, inter=Link(hw.inter.bandwidth, hw.intra.latency))


def nodes_of_run(records: list[dict]) -> int:
    """How many nodes a run's workers were placed on (its `starting` event), 1 if it says not."""
    for r in records:
        if r.get("type") == "event" and r.get("event") == "state" and isinstance(r.get("workers"), list):
            return max(1, len({w.get("node_id") or w.get("node_ip") for w in r["workers"]}))
    return 1


def _gb_s(bandwidth: float) -> str:
    return "no bandwidth limit in the waits" if bandwidth >= 1e15 else f"{bandwidth / GB:.3g} GB/s"


def fit_runs(model: ModelShape, hw: Hardware, runs: list[tuple[str, list[dict], int]]
             ) -> tuple[ModelShape, Hardware, list[str]]:
    """`hw` with the figures that runs of this model measured put in place of the spec's:
    [(name, telemetry records, global batch)]. A data-parallel run on one node gives the device
    rate and the link inside a node; with a tensor-parallel run on one node beside it, the two are
    fitted together (calibrate_pair) for the work sharding adds and the per-hop latency too. A
    data-parallel run across nodes gives the link between them. Returns the refitted model and
    hardware and a line per run saying what it gave; a run that cannot be used is a ValueError
    naming it."""
    checked = []
    for name, records, batch in runs:
        try:
            rs = run_steps(records)
        except ValueError as err:
            raise ValueError(f"{name}: {err}") from None
        checked.append((name, records, batch, rs[0]["dp"], rs[0]["tp"], nodes_of_run(records)))
    local = [c for c in checked if c[4] == 1 and c[3] > 1 and c[5] == 1]
    tensor = [c for c in checked if c[3] == 1 and c[4] > 1 and c[5] == 1]
    notes = []
    # the runs on one node first: a data run's rate is what the tensor run's work is measured by
    for name, records, batch, dp, tp, nodes in sorted(checked, key=lambda c: (c[4] > 1, c[5] > 1)):
        if tp == 1 and nodes == 1 and (dp == 1 or (local and name == local[0][0])):
            if dp > 1 and tensor:
                tname, trecords, tbatch = tensor[0][:3]
                if tbatch != batch:
                    raise ValueError(f"{tname}: its global batch ({tbatch}) differs from {name}'s ({batch}): "
                                     "calibrate from runs of the same batch")
                model, fitted = calibrate_pair(model, records, trecords, batch, per_node=dp,
                                               latency=hw.intra.latency)
            else:
                fitted = calibrate(model, records, batch, per_node=dp, latency=hw.intra.latency)
            hw = replace(hw, flops=fitted.flops)
            said = f"{name}: data {dp}x1 on one node: {fitted.flops / 1e12:.3g} TFLOP/s a device"
            if dp > 1:
                hw = replace(hw, intra=fitted.intra)
                bw = fitted.intra.bandwidth
                said += f"; the link inside a node: {_gb_s(bw)}" + (" a device" if bw < 1e15 else "")
                if tensor:
                    said += f", {fitted.intra.latency * 1e6:.4g} us a hop (fitted with {tensor[0][0]})"
        elif tp == 1 and nodes > 1:
            per_node = math.ceil(dp / nodes)
            fitted = calibrate(model, records, batch, per_node=per_node, nodes=nodes, latency=hw.inter.latency)
            hw = replace(hw, inter=Link(fitted.inter.bandwidth, hw.inter.latency))
            if not local:
                hw = replace(hw, flops=fitted.flops)
            said = (f"{name}: data {dp}x1 across {nodes} nodes: the link between nodes: {_gb_s(fitted.inter.bandwidth)}"
                    + (" a node" if fitted.inter.bandwidth < 1e15 else ""))
        elif dp == 1 and tp > 1 and nodes == 1 and name == tensor[0][0]:
            if not local:
                raise ValueError(f"{name}: a tensor-parallel run is fitted beside a data-parallel run of the same "
                                 "model on one node: give one too (--calibrate DATA_RUN --calibrate TENSOR_RUN)")
            said = (f"{name}: tensor 1x{tp}: sharding adds {model.tp_overhead_flops / hw.flops * 1e3:.3g} ms of "
                    "work a step" + ("" if model.tp_boundaries else
                                     " (this model's tensor-parallel activations are not modelled: no latency)"))
        else:
            said = (f"{name}: {'data' if tp == 1 else 'tensor' if dp == 1 else 'hybrid'} {dp}x{tp}"
                    + (" across nodes" if nodes > 1 else "") + ": not used (one data run and one tensor run on "
                    "one node, and data runs across nodes, are)")
        notes.append(said)
    return model, hw, notes
