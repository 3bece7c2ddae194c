"""PLACING: the worker group is made and its workers placed and started (a fresh run, or after
a restart), and, under strategy auto, the layout they build the model in chosen from what their
devices hold. Also what the placed workers say of themselves that the other states ask again:
the memory one may use (`device_memory`) and how many share each node (`node_sizes`)."""

from __future__ import annotations

from gearshift.orchestrator.control.states import State
from gearshift.orchestrator.errors import GearshiftError
from gearshift.orchestrator.policy import start_probe
from gearshift.orchestrator.policy.for_job import adapt_config, layout_candidates, online_model, pipeline_stages
from gearshift.orchestrator.job import Job
from gearshift.strategies.layout import Layout


class PlacingState:
    name = State.PLACING

    def __init__(self, ctl):
        self.ctl = ctl

    def run(self) -> State:
        ctl = self.ctl
        job = ctl.job
        ctl.enter(State.PLACING, workers=job.cluster.num_workers, placement=job.cluster.placement)
        ctl.group = ctl.group_factory(job)
        if job.parallel.strategy == "auto" and job.adapt.enabled and ctl.tuning.grid is None:
            # auto starts where the model fits; a replay where the original started
            replayed = ctl.script.start if ctl.script is not None else None
            ctl.group.choose_layout = self.starting_layout if replayed is None else (lambda infos: replayed)
        ctl.infos = ctl.group.start()
        return State.STARTING

    def starting_layout(self, infos: list[dict]) -> Layout:
        """strategy auto: the least-sharded layout (the first in the candidates' order: data, hsdp,
        fsdp, larger tp) the memory model predicts fits the workers' devices (free memory, each worker's
        share of its host's on CPU), given the workers' `device_memory` before the model is built.
        On a run over nodes deciding by prediction, the layout the cost model predicts fastest
        among those that fit, from the workers' probe of their devices and the link
        (policy/start_probe.py). Nothing fits: a GearshiftError with every layout's prediction."""
        from gearshift.orchestrator.policy import job_shape

        ctl = self.ctl
        job, device = ctl.job, device_memory(infos)
        if device is None:
            return job.layout
        shape, nodes = job_shape.shape_of_job(job), node_sizes(job, infos)
        check = job_shape.memory_check(job, device, model=shape)
        probing = start_probe.applies(job, nodes)
        pipelines = pipeline_stages(job, shape, nodes) if probing else ()
        table = []
        for layout in layout_candidates(job, nodes, sharded=True, pipelines=pipelines):
            ok, said = check(layout)
            table.append((layout, ok, said["predicted_bytes"]))
        fitting = [row for row in table if row[1]]
        ctl.start_choice = {"available_bytes": device,
                            "predictions": [{**lay.to_dict(), "predicted_bytes": need, "fits": ok}
                                            for lay, ok, need in table]}
        if not fitting:
            raise GearshiftError(nothing_fits(table, device))
        # the candidates' order, not the most bytes that fit: a larger tp's replica computes more
        # samples, so its activations may need more than data's whole replica does
        chosen = fitting[0][0]
        if probing:
            chosen = self.by_prediction(shape, nodes, [row[0] for row in fitting], chosen)
        ctl.start_choice["layout"] = chosen.to_dict()
        return chosen

    def by_prediction(self, shape, nodes: list[int], fitting: list[Layout], default: Layout) -> Layout:
        """The workers probe their devices and the link; the layout predicted fastest, with the
        evidence kept in start_choice."""
        ctl = self.ctl
        config = adapt_config(ctl.job)
        results = ctl.group.call("probe")
        chosen, evidence = start_probe.choose(online_model(ctl.job, shape, nodes, config), fitting, default, results)
        ctl.start_choice.update(evidence)
        return chosen


def nothing_fits(table: list[tuple[Layout, bool, float]], device: int) -> str:
    from gearshift.orchestrator.policy import costmodel

    rows = "; ".join(f"{lay}: {need / costmodel.GiB:.2f} GiB" for lay, _, need in table)
    return (f"strategy auto: the model fits no layout the workers can take. Predicted memory per worker "
            f"against {device / costmodel.GiB:.2f} GiB free: {rows}. Use more workers, a smaller "
            "micro-batch (train.micro_batch_size), activation checkpointing, or bigger devices.")


def device_memory(infos: list[dict]) -> int | None:
    """The memory one worker may use, the least over the workers: its GPU's, or on CPU its share
    of the host's (the workers on a node divide it). None when the workers did not say."""
    if not infos or any(not i.get("device_memory") for i in infos):
        return None
    per_node: dict[str, int] = {}
    for i in infos:
        per_node[i.get("node_id") or i.get("node_ip")] = per_node.get(i.get("node_id") or i.get("node_ip"), 0) + 1
    return min(i["device_memory"]["bytes"] // (per_node[i.get("node_id") or i.get("node_ip")]
                                               if i["device_memory"]["shared"] else 1) for i in infos)


def node_sizes(job: Job, infos: list[dict]) -> list[int]:
    """Workers per node in rank order: simulated nodes (inject.nodes) when the job asks for them."""
    w, k = job.cluster.num_workers, job.inject.nodes
    if k > 1:
        return [w // k] * k
    sizes: list[int] = []
    last = None
    for info in infos:
        node = info.get("node_id") or info.get("node_ip")
        if node != last:
            sizes.append(0)
            last = node
        sizes[-1] += 1
    return sizes or [w]
