"""strategy auto's first layout by prediction: on a run that spans nodes and decides by
prediction, the workers measure their device's rate and the link between nodes before the model
is built (workers/group/probe.py), and the run starts on the layout the cost model predicts
fastest among those predicted to fit, rather than on the least sharded one, which it would
otherwise leave only after its first window (`choose`).

The probe is short and rough: a matmul's rate is more than a model's step reaches, so every
layout's compute is predicted low; it is predicted again at 2 and 4 times less. A layout whose
costs the run cannot know before it has run (tensor parallelism, sharding, stages) carries the
policy's `unseen_error`. A layout other than the memory choice is taken only where its
pessimistic prediction beats the memory choice's own prediction at every one of those rates. What the run then measures refits the model, and the policy leaves a start that
was wrong like any other layout (its review, adaptive.md)."""

from __future__ import annotations

from dataclasses import replace
from statistics import median

from gearshift.orchestrator.policy.costmodel import Link
from gearshift.orchestrator.policy.online import FREE, OnlineModel
from gearshift.strategies.layout import Layout


def applies(job, node_sizes: list[int]) -> bool:
    """Whether the run's start is chosen by the probe (`adapt.start: probe`): auto, deciding by
    prediction, over nodes."""
    return job.adapt.start == "probe" and job.adapt.decide == "predict" and len(node_sizes) >= 2


BACK_TO_BACK = 6  # the probe's last timings: the largest size and its half, 3 times each, alternating


def fitted_link(results: list[dict]) -> dict:
    """The link a world-wide all-reduce crossed, from the ranks' probes (each holds the same
    timings: the slowest rank's): {"bandwidth", "latency", "bound"}. The bandwidth is the ring's
    (costmodel.allreduce_time's), from the slope between the largest size and its half; where
    the time did not grow with the size, the largest size's own rate, a bound below the link."""
    times, world = results[0]["allreduce"], results[0]["world"]
    ring = 2 * (world - 1) / world
    small = times[0][1]
    top = max(s for s, _ in times)
    last = times[-BACK_TO_BACK:]
    big = median(t for s, t in last if s == top)
    half = median(t for s, t in last if s < top)
    slope = (big - half) / (top - top / 2)
    bound = slope <= 0 or big <= small
    bandwidth = ring * top / big if bound else ring / slope
    latency = max(0.0, small / (2 * (world - 1)))
    return {"bandwidth": min(bandwidth, FREE), "latency": latency, "bound": bound}


COMPUTE_SCALES = (1.0, 2.0, 4.0)


def choose(model: OnlineModel, fitting: list[Layout], default: Layout, results: list[dict],
           scales: tuple[float, ...] = COMPUTE_SCALES) -> tuple[Layout, dict]:
    """The layout to start on among `fitting` (the candidates predicted to fit, in the policy's
    order), and the evidence. `model`: the policy's online model before any step; the probes
    give it the link between nodes and a bound on the device's rate (the slowest rank's matmul):
    a model's step reaches less of it, by a factor no probe shows (a few times on a CPU, more
    for small layers). So the layouts are predicted at the matmul's rate and at `scales` times
    less, and the start leaves the memory choice only for a layout that wins at every one."""
    link = fitted_link(results)
    flops = min(r["flops"] for r in results)
    rounds = [_fastest(model, fitting, default, flops / k, link) for k in scales]
    winners = {r[0] for r in rounds}
    chosen = winners.pop() if len(winners) == 1 else default
    evidence = {"probe": {"device_tflops": flops / 1e12, "inter_link_gb_s": link["bandwidth"] / 1e9,
                          "inter_latency_us": link["latency"] * 1e6, "link_bound": link["bound"],
                          "allreduce": results[0]["allreduce"]},
                "by": "prediction" if chosen != default else "memory",
                "compute_scales": list(scales),
                "step_predictions": rounds[0][1],
                "step_predictions_slowest": rounds[-1][1]}
    return chosen, evidence


def _fastest(model: OnlineModel, fitting: list[Layout], default: Layout, flops: float,
             link: dict) -> tuple[Layout, list[dict]]:
    """The layout predicted fastest at a device rate of `flops`: the memory choice at its
    prediction, every other layout at its pessimistic one (its unseen error added)."""
    model.hw = replace(model.hw, flops=flops, inter=Link(link["bandwidth"], link["latency"]))
    seen: set[tuple[int, int]] = set()
    estimates = []
    for layout in fitting:  # at each (tp, pp) its least sharded layout that fits, as the policy weighs them
        if (layout.tp, layout.pp) in seen and layout != default:
            continue
        seen.add((layout.tp, layout.pp))
        estimates.append(model.predict(layout))
    best = min(estimates, key=lambda e: e.step_s if e.layout == default else e.pessimistic_s)
    return best.layout, [e.to_dict() for e in estimates]
