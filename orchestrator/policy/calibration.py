"""The cost model fitted to measured runs: the device rate, the links and the fixed overhead
of a layout, from the step records of a job's own runs (`gearshift plan --calibrate`)."""

from __future__ import annotations

import math
from dataclasses import replace

from gearshift.orchestrator.policy.costmodel import Hardware, Link, ModelShape, allreduce_time, predict
from gearshift.orchestrator.policy.hardware import GB


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

