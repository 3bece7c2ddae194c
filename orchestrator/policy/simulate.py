"""`gearshift simulate JOB.yaml --cluster SPEC --scenario FILE`: the adaptive policy at cluster
scale, fed by the cost model.

Each simulated step, the layout in force is priced by `costmodel.predict` on the hardware as the
scenario has it at that step (the link between nodes scaled by a factor), turned into the step
record the controller would merge, and given to the same `Policy` object the controller uses.
A switch or revert it asks for is carried out at once and costs `switch_steps` steps of the layout
left (measured: 1 to 2 steps, bench/switch.py). The run's simulated time is compared with every
static layout's over the same scenario.

Scenario file (YAML):

    steps: 5000
    inter_link:            # factor on the link between nodes, from a step on
      - {step: 0, factor: 1.0}
      - {step: 1000, factor: 0.25}
      - {step: 3000, factor: 1.0}
"""

from __future__ import annotations

import dataclasses
import json

from gearshift.orchestrator.policy import costmodel
from gearshift.orchestrator.policy import job_shape
from gearshift.orchestrator.errors import UsageError
from gearshift.orchestrator.policy.online import OnlineModel
from gearshift.orchestrator.policy.adaptive import AdaptConfig, Policy, Report, Revert, Switch, candidate_layouts
from gearshift.strategies.layout import Layout


@dataclasses.dataclass(frozen=True)
class Scenario:
    steps: int
    factors: tuple[tuple[int, float], ...]  # (from step, factor on the inter-node link), sorted

    def factor(self, step: int) -> float:
        f = 1.0
        for start, value in self.factors:
            if step >= start:
                f = value
        return f

    @staticmethod
    def from_dict(d) -> Scenario:
        if not isinstance(d, dict) or set(d) - {"steps", "inter_link"} or "steps" not in d:
            raise ValueError("a scenario is {steps: N, inter_link: [{step: S, factor: F}, ...]}")
        steps = d["steps"]
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps = {steps!r} must be an integer >= 1")
        out = []
        for i, e in enumerate(d.get("inter_link") or []):
            if not isinstance(e, dict) or set(e) != {"step", "factor"}:
                raise ValueError(f"inter_link[{i}] = {e!r} must be {{step: S, factor: F}}")
            if isinstance(e["step"], bool) or isinstance(e["factor"], bool) or not isinstance(e["step"], int) \
                    or e["step"] < 0 or not isinstance(e["factor"], (int, float)) \
                    or not e["factor"] > 0:
                raise ValueError(f"inter_link[{i}]: step must be an integer >= 0 and factor a number > 0")
            out.append((e["step"], float(e["factor"])))
        return Scenario(steps, tuple(sorted(out)))


def _at(hw: costmodel.Hardware, factor: float) -> costmodel.Hardware:
    return dataclasses.replace(hw, inter=costmodel.Link(hw.inter.bandwidth * factor, hw.inter.latency))


def record(step: int, layout: Layout, pred: costmodel.Prediction, global_batch: int) -> dict:
    """The merged step record the controller would emit for this prediction (every rank alike)."""
    world = layout.world
    frac = pred.comm_wait_frac
    compute = pred.step_s - pred.exposed_wait_s
    return {
        "type": "step", "step": step, **layout.to_dict(),
        "bucket_cap_mb": pred.bucket_cap_mb, "loss": 0.0, "lr": None,
        "step_time_max": pred.step_s, "step_time_mean": pred.step_s, "slowest_rank": 0,
        "data_time_mean": 0.0, "data_time_max": 0.0, "compute_time_mean": compute,
        "comm_wait_mean": pred.exposed_wait_s, "comm_wait_max": pred.exposed_wait_s,
        "comm_wait_frac_mean": frac, "comm_wait_frac_max": frac, "comm_calls": 0,
        "comm_hidden_mean": None, "comm_hidden_frac_mean": None, "bubble_frac_mean": None, "link_wait_frac_mean": None,
        "samples_per_s": global_batch / pred.step_s, "tokens_per_s": None, "peak_mem_bytes": None,
        "ranks": {"step_time": [pred.step_s] * world, "data_time": [0.0] * world, "compute_time": [compute] * world,
                  "comm_wait": [pred.exposed_wait_s] * world, "comm_wait_frac": [frac] * world,
                  "samples_per_s": [global_batch / layout.dp / pred.step_s] * world},
    }


def simulate(model_shape: costmodel.ModelShape, hw: costmodel.Hardware, global_batch: int, scenario: Scenario,
             config: AdaptConfig = AdaptConfig(), bucket_cap_mb: float = 25.0, switch_steps: float = 2.0,
             pipelines: bool = True) -> dict:
    from gearshift.orchestrator.policy import pipeline_cost

    candidates = _candidates(model_shape, hw, global_batch, config, pipelines)
    price = {}

    def step_time(layout: Layout, factor: float) -> costmodel.Prediction:
        key = (layout, factor)
        if key not in price:
            if layout.pp > 1:
                price[key] = pipeline_cost.predict(model_shape, _at(hw, factor), global_batch, layout.pp, layout.dp,
                                                   tp=layout.tp)
            else:
                price[key] = costmodel.predict(model_shape, _at(hw, factor), global_batch, layout.dp, layout.tp,
                                               bucket_cap_mb, shard=layout.shard)
        return price[key]

    steps = range(1, scenario.steps + 1)
    static = {c: sum(step_time(c, scenario.factor(s)).step_s for s in steps) for c in candidates}
    # the oracle knows the scenario: the best layout at every step, switched to at no cost
    oracle = sum(min(step_time(c, scenario.factor(s)).step_s for c in candidates) for s in steps)
    # the policy knows the cluster as the spec says (its prior) and fits the rest from the records
    model = OnlineModel(model_shape, global_batch, [hw.per_node] * hw.nodes, prior=hw,
                        predict_error=config.predict_error, unseen_error=config.unseen_error,
                        switch_steps=switch_steps)
    policy = Policy(config, candidates, candidates[0], model=model, total_steps=scenario.steps)
    layout, clock, decisions = candidates[0], 0.0, []
    for step in steps:
        pred = step_time(layout, scenario.factor(step))
        clock += pred.step_s
        decision = policy.observe(record(step, layout, pred, global_batch))
        if isinstance(decision, (Switch, Revert)):
            clock += switch_steps * pred.step_s
            decisions.append({"step": step, "decision": decision.name, "to": _name(decision.to),
                              "comm_wait_frac": decision.evidence.get("comm_wait_frac"),
                              "reason": decision.evidence.get("reason"), "said": _said(decision)})
            layout = decision.to
            policy.switched(layout, step, switch_steps * pred.step_s)
        elif isinstance(decision, Report):
            decisions.append({"step": step, "decision": decision.kind, "reason": decision.evidence.get("reason"),
                              "said": _said(decision)})
    compute = sum(step_time(c, 1.0).compute_s for c in candidates[:1]) * scenario.steps
    best = min(static.values())
    return {"seconds": clock, "decisions": decisions,
            "static": {_name(c): t for c, t in static.items()},
            "best_static": best, "data_static": static[candidates[0]], "oracle": oracle,
            "auto_vs_oracle": oracle / clock, "auto_vs_best_static": best / clock,
            "auto_vs_data": static[candidates[0]] / clock,
            "switches": sum(d["decision"] == "switch" for d in decisions),
            "reverted_switches": sum(d["decision"] == "revert" for d in decisions),
            "deciding_by": "prediction" if policy.predicting else "trial",
            "utilisation": compute / clock, "utilisation_oracle": compute / oracle,
            "utilisation_static": {_name(c): compute / t for c, t in static.items()}}


def _candidates(model_shape: costmodel.ModelShape, hw: costmodel.Hardware, global_batch: int, config: AdaptConfig,
                pipelines: bool) -> list[Layout]:
    """The layouts the policy would choose among without a memory figure (for_job.job_policy):
    sharded state only saves memory, which the simulation does not judge; pipelines of whole
    nodes a stage where the policy predicts and the model's cut is modelled (for_job.pipeline_stages)."""
    from gearshift.orchestrator.policy import pipeline_cost

    stages = [pp for pp, _ in pipeline_cost.layouts(hw, global_batch, model_shape)] \
        if pipelines and config.decide == "predict" and model_shape.boundary_bytes_per_sample else []
    return [c for c in candidate_layouts(hw.devices, [hw.per_node] * hw.nodes, sharded=False, pipelines=stages)
            if global_batch % c.dp == 0 and (not model_shape.tp_divides or model_shape.tp_divides % c.tp == 0)]


def _said(decision) -> str | None:
    """What the decision was weighed on, as the run's terminal line says it."""
    from gearshift.orchestrator.control.reporting import describe

    text = describe(decision)
    return text.split(": ", 1)[1] if ": " in text else None


def _name(layout: Layout) -> str:
    """As plan's table names a layout: hsdp with its group size, a hybrid with sharded state as hybrid:fsdp."""
    kind = layout.strategy
    if layout.pp > 1:
        return f"pipeline:{layout.pp} {layout.dp}x{layout.tp}"
    if layout.shard > 1:
        kind = "hybrid:fsdp" if layout.tp > 1 else f"hsdp:{layout.shard}" if kind == "hsdp" else kind
    return f"{kind} {layout.dp}x{layout.tp}"


def load_scenario(text: str) -> Scenario:
    from gearshift.orchestrator.commands.plan import read_yaml_arg

    doc = read_yaml_arg("--scenario", text)
    try:
        return Scenario.from_dict(doc)
    except ValueError as err:
        raise UsageError(f"--scenario {text}: {err}") from None


def cmd_simulate(args) -> int:
    from gearshift.orchestrator.job import load_job
    from gearshift.orchestrator.commands.plan import calibrated, global_batch, load_cluster

    job = load_job(args.job, args.overrides)
    hw = load_cluster(args.cluster, args.nodes)
    model, hw, notes = calibrated(job, job_shape.shape_of_job(job), hw, args.calibrate)
    for note in notes:
        print(note)
    scenario = load_scenario(args.scenario)
    batch = global_batch(args, job)
    if batch % hw.devices:
        raise UsageError(f"the global batch ({batch}) must divide over {hw.devices} devices for data parallel: "
                         f"use --global-batch")
    a = job.adapt
    result = simulate(model, hw, batch, scenario,
                      AdaptConfig(threshold=a.threshold, window=a.window, cooldown=a.cooldown, decide=a.decide),
                      bucket_cap_mb=25.0 if job.parallel.bucket_cap_mb == "auto" else job.parallel.bucket_cap_mb,
                      pipelines=getattr(args, "pipelines", True))
    if args.json:
        print(json.dumps({"steps": scenario.steps, "nodes": hw.nodes, "per_node": hw.per_node,
                          "inter_link": [list(f) for f in scenario.factors], **result}))
        return 0
    print(f"{scenario.steps} steps on {hw.nodes} x {hw.per_node} devices; inter-node link factors "
          f"{list(scenario.factors) or [(0, 1.0)]}")
    for d in result["decisions"]:
        print(f"  step {d['step']}: {d['decision']}" + (f" -> {d['to']}" if "to" in d else "")
              + (f": {d['said']}" if d.get("said") else f" ({d['reason']})" if d.get("reason") else ""))
    width = max(18, max(len(name) for name in result["static"]) + 8)
    print(f"{'':<{width}}{'time s':>10}{'utilisation':>13}")
    for name, t in sorted(result["static"].items(), key=lambda kv: kv[1]):
        print(f"{'static ' + name:<{width}}{t:>10.1f}{result['utilisation_static'][name]:>13.1%}")
    print(f"{'oracle':<{width}}{result['oracle']:>10.1f}{result['utilisation_oracle']:>13.1%}")
    print(f"{'auto':<{width}}{result['seconds']:>10.1f}{result['utilisation']:>13.1%}")
    print(f"auto / oracle: {result['auto_vs_oracle']:.3f}; auto / best static: {result['auto_vs_best_static']:.3f} "
          f"(speed); auto / static data: {result['auto_vs_data']:.3f}; {result['switches']} switches, "
          f"{result['reverted_switches']} reverted; deciding by {result['deciding_by']} at the end")
    return 0
