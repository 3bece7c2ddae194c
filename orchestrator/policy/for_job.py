"""The policy a job asks for: its candidate layouts (those the workers can take, the model can be
split into and this process can build) and the Policy built from the job's `adapt` section, the
cost model fitted as the run goes, and the devices' memory."""

from __future__ import annotations

from gearshift.orchestrator.job import Job, accumulation
from gearshift.orchestrator.policy.adaptive import AdaptConfig, Policy, candidate_layouts
from gearshift.orchestrator.policy.online import OnlineModel
from gearshift.strategies.layout import Layout


def pipeline_stages(job: Job, shape, node_sizes: list[int]) -> list[int]:
    """The pipelines a run deciding by prediction may move to: stages of whole nodes (as many as
    divide the nodes, nodes of one size), at most one a block, where the cost model knows what
    crosses a cut (the built-in GPT's shape: `boundary_bytes_per_sample`)."""
    nodes, world = len(node_sizes), sum(node_sizes)
    if nodes < 2 or len(set(node_sizes)) != 1 or not shape.boundary_bytes_per_sample or shape.blocks < 2:
        return []
    return [pp for pp in range(2, nodes + 1) if nodes % pp == 0 and pp <= shape.blocks
            and job.train.global_batch_size % (world // pp) == 0
            and accumulation(job.train.global_batch_size, job.train.micro_batch_size, world // pp) is not None]


def layout_candidates(job: Job, node_sizes: list[int], sharded: bool, pipelines: list[int] = ()) -> list[Layout]:
    """The layouts the workers (per node) can take that the model can be split into and this
    process can build, data first (adaptive.candidate_layouts says the order)."""
    from gearshift import strategies
    from gearshift.workers.build import components
    from gearshift.workers.build.components import ComponentError

    def shardable(tp: int) -> bool:  # a model that cannot be split tp ways is not a candidate
        dp = job.cluster.num_workers // tp  # nor a layout whose dp the micro-batches do not fit
        if tp > 1 and accumulation(job.train.global_batch_size, job.train.micro_batch_size, dp) is None:
            return False
        try:
            components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, tp, [job.base_dir])
            return True
        except ComponentError:
            return False

    candidates = candidate_layouts(job.cluster.num_workers, node_sizes, tp_ok=shardable, sharded=sharded,
                                   pipelines=pipelines)
    # only layouts whose strategy this process can build (fsdp and hsdp are named before they exist)
    return [c for c in candidates if c.strategy in strategies.STRATEGIES]


def adapt_config(job: Job) -> AdaptConfig:
    a = job.adapt
    return AdaptConfig(threshold=a.threshold, window=a.window, cooldown=a.cooldown, decide=a.decide,
                       memory_threshold=a.memory_threshold)


def online_model(job: Job, shape, node_sizes: list[int], config: AdaptConfig) -> OnlineModel:
    """The cost model, fitted as the run goes from its own records (no prior: a live run's
    hardware is what it measures)."""
    return OnlineModel(shape, job.train.global_batch_size, node_sizes, predict_error=config.predict_error,
                       unseen_error=config.unseen_error, pp_microbatches=job.parallel.pp_microbatches,
                       pp_schedule=job.parallel.pp_schedule)


def job_policy(job: Job, layout: Layout, node_sizes: list[int], device_memory_bytes: int | None = None) -> Policy:
    """The policy a job's `adapt` section asks for, starting on `layout`. Its candidates are the
    layouts the workers (per node) can take that the model can be split into. Given the devices'
    memory, layouts with sharded state join them and no layout predicted not to fit is switched
    to (job_shape.memory_check); without it memory is not judged, and sharded state, whose only
    gain is memory, is not offered."""
    from gearshift.orchestrator.policy import job_shape, pipeline_cost

    a, config = job.adapt, adapt_config(job)
    shape = job_shape.shape_of_job(job)
    fits = None if device_memory_bytes is None else job_shape.memory_check(job, device_memory_bytes, model=shape)
    candidates = layout_candidates(job, node_sizes, sharded=fits is not None,
                                   pipelines=pipeline_stages(job, shape, node_sizes) if a.decide == "predict" else ())
    model = online_model(job, shape, node_sizes, config)
    need = None
    if device_memory_bytes is not None:
        settings = job_shape.memory_settings(job)
        need = lambda lay: pipeline_cost.memory_of(shape, lay, global_batch=job.train.global_batch_size,  # noqa: E731
                                                   **settings)["total"]
    return Policy(config, candidates, layout, fits=fits, model=model, total_steps=job.train.steps,
                  memory=(need, device_memory_bytes) if need else None)
