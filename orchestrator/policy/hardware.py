"""Hardware for the cost model: presets of real clusters, and specs (a preset resized, or the
figures themselves) as `gearshift plan --cluster` takes them."""

from __future__ import annotations

from dataclasses import replace

from gearshift.orchestrator.policy.costmodel import GiB, Hardware, Link, MemoryOverhead


GB = 1e9


PRESETS: dict[str, Hardware] = {
    # 8 x H100 SXM per node, NVLink 4 (~450 GB/s per GPU each way, ~360 achieved in a ring), 8 x
    # 400 Gb/s InfiniBand per node (400 GB/s, ~360 achieved); ~400 TFLOP/s sustained in bf16; 80 GB each
    "h100-ib400": Hardware(nodes=16, per_node=8, flops=400e12, intra=Link(360 * GB, 3e-6),
                           inter=Link(360 * GB, 8e-6), name="16 nodes x 8 H100, NVLink + 8 x 400 Gb/s InfiniBand",
                           device_memory=80 * GiB),
    # 8 x A100 SXM per node, NVLink 3 (~300 GB/s, ~230 achieved), 8 x 200 Gb/s HDR per node; the
    # 80 GB A100 of a DGX A100 640GB (the 40 GB one: device_memory_gb: 40 in a spec)
    "a100-ib200": Hardware(nodes=16, per_node=8, flops=150e12, intra=Link(230 * GB, 3e-6),
                           inter=Link(180 * GB, 8e-6), name="16 nodes x 8 A100, NVLink + 8 x 200 Gb/s InfiniBand",
                           device_memory=80 * GiB),
    # Megatron-LM's cluster (arXiv 1909.08053): 32 DGX-2H nodes of 16 V100, NVSwitch (300 GB/s per
    # GPU both ways: 150 each way), 8 x 100 Gb/s InfiniBand per node (100 GB/s); 39 TFLOP/s
    # sustained on one GPU (their single-GPU baseline); the DGX-2H's V100 holds 32 GB
    "v100-dgx2h": Hardware(nodes=32, per_node=16, flops=39e12, intra=Link(150 * GB, 5e-6),
                           inter=Link(100 * GB, 10e-6), name="32 DGX-2H nodes x 16 V100, Megatron-LM's cluster",
                           device_memory=32 * GiB),
}


def with_nodes(hw: Hardware, nodes: int) -> Hardware:
    return replace(hw, nodes=nodes)


SPEC_KEYS = ("preset", "nodes", "per_node", "tflops", "intra_gb_s", "inter_gb_s", "intra_latency_us",
             "inter_latency_us", "device_memory_gb", "memory_overhead_gb", "memory_overhead_frac", "name")


def hardware_from_spec(spec: dict | str) -> Hardware:
    """A preset name, or {preset: NAME, nodes: N} to resize one, or the figures themselves:
    {nodes, per_node, tflops, intra_gb_s, inter_gb_s, intra_latency_us, inter_latency_us}, and
    optionally device_memory_gb (as devices are sold: an "80 GB" A100 holds 80 GiB, so GiB) and the
    memory overhead (memory_overhead_gb fixed, memory_overhead_frac on top of the tensors)."""
    if isinstance(spec, str):
        spec = {"preset": spec}
    if not isinstance(spec, dict):
        raise ValueError(f"a cluster spec is a preset name or a mapping, not {spec!r}")
    unknown = set(spec) - set(SPEC_KEYS)
    if unknown:
        raise ValueError(f"unknown cluster spec keys {sorted(unknown)}; allowed: {', '.join(SPEC_KEYS[:-1])}")
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
    overhead = MemoryOverhead(num("memory_overhead_gb", base.memory_overhead.fixed, GiB, zero_ok=True),
                              num("memory_overhead_frac", base.memory_overhead.fraction, zero_ok=True))
    return Hardware(nodes=int(nodes), per_node=int(per_node), flops=num("tflops", base.flops, 1e12),
                    intra=Link(num("intra_gb_s", base.intra.bandwidth, GB),
                               num("intra_latency_us", base.intra.latency, 1e-6, zero_ok=True)),
                    inter=Link(num("inter_gb_s", base.inter.bandwidth, GB),
                               num("inter_latency_us", base.inter.latency, 1e-6, zero_ok=True)),
                    name=spec.get("name") or base.name,
                    device_memory=num("device_memory_gb", base.device_memory, GiB), memory_overhead=overhead)

