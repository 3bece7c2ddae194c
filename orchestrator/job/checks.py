"""The rules between fields and against the code a job names (components, layouts, sizes,
schedules): `check_job` runs them all, before Ray or any worker starts."""

from __future__ import annotations


from gearshift.orchestrator.job.fields import JobError, _READERS
from gearshift.orchestrator.job.spec import Job, _DATA_FORMS


def check_job(job: Job) -> None:
    """Checks that need more than one field, and the components the job names."""
    from gearshift.workers.build.components import ComponentError

    try:
        _check_components(job)
    except ComponentError as err:
        raise JobError(err.field_path, err.value, err.allowed, err.hint) from None
    _check_pretrained(job)
    _check_checkpoint_path(job)
    _check_reduce_dtype(job)
    _check_sizes(job)
    _check_elastic(job)
    _check_slow(job)
    _check_drop(job)


def _check_drop(job: Job) -> None:
    if job.adapt.stragglers == "drop" and job.on_node_loss != "elastic":
        raise JobError("adapt.stragglers", "drop", f"lets a slow replica go in memory, which needs fault.on_node_loss "
                       f"elastic (this run's is {job.on_node_loss})",
                       f"Set cluster.min_workers below num_workers ({job.cluster.num_workers}), or use rebalance.")


def _check_slow(job: Job) -> None:
    slow, n = job.inject.slow, job.cluster.num_workers
    if slow and max(slow["ranks"]) >= n:
        raise JobError("inject.slow.ranks", slow["ranks"], f"must name workers of the run: ranks 0 to {n - 1}")


def _check_elastic(job: Job) -> None:
    n, m = job.cluster.num_workers, job.cluster.min_workers
    if m is not None and m > n:
        raise JobError("cluster.min_workers", m, f"must be at most cluster.num_workers ({n})",
                       "It is the fewest workers the run goes on with after losing some.")
    top = job.cluster.max_workers
    if top is not None and top < n:
        raise JobError("cluster.max_workers", top, f"must be at least cluster.num_workers ({n})",
                       "It is the most workers an elastic run grows to.")
    if top is not None and top > n and job.on_node_loss != "elastic":
        raise JobError("cluster.max_workers", top, f"grows a run past num_workers ({n}) only under "
                       f"fault.on_node_loss elastic, not {job.on_node_loss}", "Set cluster.min_workers below "
                       "num_workers (elastic is then the default), or fault.on_node_loss: elastic.")
    if job.fault.on_node_loss == "elastic" and job.min_workers >= n and (top or n) <= n:
        raise JobError("fault.on_node_loss", "elastic",
                       f"needs room to shrink or grow: cluster.min_workers ({job.min_workers}) must be below "
                       f"num_workers ({n}), or cluster.max_workers above it",
                       f"Set cluster.min_workers, e.g. {max(1, n // 2)}.")


def _check_reduce_dtype(job: Job) -> None:
    """A bf16 reduction exists only where FSDP2 gathers in bf16 (workers/config.py says when)."""
    from gearshift.workers.config import fsdp_mixed_precision

    if job.parallel.reduce_dtype == "fp32":
        return
    if fsdp_mixed_precision(job.train.precision, job.parallel.reduce_dtype)[0] is None:
        raise JobError("parallel.reduce_dtype", job.parallel.reduce_dtype,
                       "applies only where fsdp, hsdp and hybrid dp_shard gather in bf16: train.precision bf16 "
                       "without fp32_warmup_steps or keep_fp32",
                       f"train.precision is {job.train.precision!r}; leave parallel.reduce_dtype at fp32.")


def _check_checkpoint_path(job: Job) -> None:
    """checkpoint.path must be writable from here (the driver commits every checkpoint there): an
    object store is probed with one small object (bounded in time), a folder created."""
    place = job.checkpoint.path
    if not place:
        return
    import pathlib

    from gearshift.workers.state import storage

    if storage.is_url(place):
        try:
            import fsspec

            fsspec.core.url_to_fs(place, **job.checkpoint.storage_options)
        except (ImportError, ValueError) as err:
            raise JobError("checkpoint.path", place, f"names storage fsspec cannot open here ({err}); an s3:// URL "
                           "needs the s3fs package, gs:// gcsfs") from None
        except TypeError as err:
            raise JobError("checkpoint.storage_options", job.checkpoint.storage_options,
                           f"are not what this storage takes ({err})") from None
        try:
            storage.probe(storage.location(place, job.checkpoint.storage_options), timeout_s=30.0)
        except Exception as err:  # noqa: BLE001 - whatever the storage says is the reason
            raise JobError("checkpoint.path", place, f"cannot be written from here ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else 'no reason given'}); check the bucket, the "
                           "endpoint and the credentials (checkpoint.storage_options)") from None
        return
    folder = pathlib.Path(job.base_dir).joinpath(pathlib.Path(place).expanduser())
    try:
        folder.mkdir(parents=True, exist_ok=True)
        storage.probe(folder, timeout_s=30.0)
    except OSError as err:
        raise JobError("checkpoint.path", place, f"cannot be written from here ({err.strerror or err}); give a "
                       "folder every node shares and this process may write, or an object-store URL") from None


def pretrained_folder(job: Job):
    """model.pretrained's folder as a path (relative ones are the job file's folder's), or None."""
    import pathlib

    if not job.model.pretrained:
        return None
    return pathlib.Path(job.base_dir).joinpath(pathlib.Path(job.model.pretrained["path"]).expanduser())


def _check_pretrained(job: Job) -> None:
    """The pretrained folder's files and tensor headers against the model built on the meta
    device: every tensor there, none extra, the same shapes. Reads no tensor data."""
    folder = pretrained_folder(job)
    if folder is None:
        return
    from gearshift.workers.build import components, pretrained

    model, _ = components.model_for_checks(job.to_dict()["model"], [job.base_dir])
    try:
        pretrained.check(model, pretrained.snapshot(folder), job.model.pretrained["prefix"])
    except pretrained.PretrainedError as err:
        raise JobError("model.pretrained", job.model.pretrained["path"], str(err)) from None


def _check_components(job: Job) -> None:
    from gearshift.workers.build import components  # the registry of built-ins lives with the code that builds them

    for section in ("model", "data", "loss"):
        spec = getattr(job, section)
        if spec.name and spec.entrypoint:
            raise JobError(f"{section}", {"name": spec.name, "entrypoint": spec.entrypoint},
                           "give either name (a built-in) or entrypoint (your own), not both")
    if not job.model.name and not job.model.entrypoint:
        raise JobError("model", None, "is required: a built-in name (" + ", ".join(components.MODELS) +
                       ') or entrypoint: "module:function"')

    search_paths = [job.base_dir]
    if job.model.name:
        components.check_builtin("model", job.model.name, job.model.kwargs, components.MODELS)
    else:
        components.check_entrypoint("model.entrypoint", job.model.entrypoint, search_paths, job.model.kwargs)

    if _check_streamed(job, "data", job.to_dict()["data"]):
        pass
    elif job.data.entrypoint:
        components.check_entrypoint("data.entrypoint", job.data.entrypoint, search_paths, job.data.kwargs)
    else:
        name = job.data.name or components.default_data_for(job.model.name)
        if name is None:
            raise JobError("data", None, "is required for a model given by entry point: a built-in name (" +
                           ", ".join(components.DATASETS) + ') or entrypoint: "module:function"')
        components.check_builtin("data", name, job.data.kwargs, components.DATASETS)

    if job.model.name and not (job.data.ray_dataset or job.data.read):
        spec = job.to_dict()
        components.check_builtin_fit(spec["model"], spec["data"])

    _check_eval(job, components)

    if job.loss.entrypoint:
        components.check_entrypoint("loss.entrypoint", job.loss.entrypoint, search_paths, job.loss.kwargs)
    elif job.loss.name:
        components.check_builtin("loss", job.loss.name, job.loss.kwargs, components.LOSSES)


def _check_eval(job: Job, components) -> None:
    """Eval data is checked as data is (it must load and fit the model), before anything starts."""
    ev, spec = job.eval, job.eval.data
    if job.checkpoint.keep_best and ev.every == 0:
        raise JobError("checkpoint.keep_best", True, "needs eval.every > 0: the best checkpoint is the one "
                       "with the lowest eval loss")
    if ev.every == 0:
        return
    if spec is None:
        raise JobError("eval.data", None, f"is required when eval.every > 0 ({ev.every}): {_DATA_FORMS}",
                       "Use held-out data, not the training data: for the built-ins, the same name with "
                       "another seed, e.g. {name: synthetic_digits, kwargs: {seed: 99, size: 1024}}.")
    if _check_streamed(job, "eval.data", spec):
        return
    if spec["name"] and spec["entrypoint"]:
        raise JobError("eval.data", {"name": spec["name"], "entrypoint": spec["entrypoint"]},
                       "give either name (a built-in) or entrypoint (your own), not both")
    if not spec["name"] and not spec["entrypoint"]:
        raise JobError("eval.data", spec, f"names no data: give {_DATA_FORMS}")
    with _renamed("data", "eval.data"):
        if spec["entrypoint"]:
            components.check_entrypoint("data.entrypoint", spec["entrypoint"], [job.base_dir], spec["kwargs"])
        else:
            components.check_builtin("data", spec["name"], spec["kwargs"], components.DATASETS)
            if job.model.name:
                components.check_builtin_fit(job.to_dict()["model"], spec)


def _check_streamed(job: Job, field: str, spec: dict) -> bool:
    """A Ray Dataset (ray_dataset or read) is complete and alone; False for map-style data.
    Its columns, rows and files are checked by its feeder once Ray runs, before any worker."""
    from gearshift.workers.build import components
    from gearshift.workers.step import streaming

    streamed = {k: spec[k] for k in ("ray_dataset", "read") if spec.get(k)}
    if not streamed:
        for key in ("paths", "input", "target"):
            if spec.get(key) is not None:
                raise JobError(f"{field}.{key}", spec[key], "applies to a Ray Dataset: give ray_dataset "
                               '("module:function") or read (' + ", ".join(_READERS) + ") with it")
        return False
    if len(streamed) > 1:
        raise JobError(field, streamed, "give either ray_dataset (your function) or read (files), not both")
    mapped = {k: spec[k] for k in ("name", "entrypoint") if spec.get(k)}
    if mapped:
        raise JobError(field, {**mapped, **streamed}, "give either a map-style dataset (name, entrypoint) or a "
                       "Ray Dataset (ray_dataset, read), not both")
    for key in ("input", "target"):
        if spec.get(key) is None:
            raise JobError(f"{field}.{key}", None, "is required with a Ray Dataset: the name of its "
                           f"{key} column", "For example {read: parquet, paths: data/, input: x, target: y}.")
    if not isinstance(spec["target"], str):
        raise JobError(f"{field}.target", spec["target"], "must be one column's name")
    if spec["read"]:
        if spec.get("paths") is None:
            raise JobError(f"{field}.paths", None, f"is required with read: {spec['read']}: the files to read")
        try:
            streaming.local_matches(streaming._rooted(spec["paths"], [job.base_dir]))
        except components.ComponentError as err:
            raise JobError(f"{field}.paths", err.value, err.allowed, err.hint) from None
    else:
        if spec.get("paths") is not None:
            raise JobError(f"{field}.paths", spec["paths"], "applies to read; a ray_dataset function finds its "
                           "own files (pass them in kwargs)")
        with _renamed("data", field):
            components.check_entrypoint("data.ray_dataset", spec["ray_dataset"], [job.base_dir], spec["kwargs"])
    if field == "data" and job.data.loader.workers:
        raise JobError("data.loader.workers", job.data.loader.workers, "must be 0 with a Ray Dataset: Ray Data "
                       "reads in its own tasks (data.loader.prefetch sets how many steps are kept ahead)")
    return True


class _renamed:
    """components' checks name the `data` section; for eval data the field is `eval.data`."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        from gearshift.workers.build.components import ComponentError

        if isinstance(err, ComponentError) and (err.field_path + ".").startswith(self.old + "."):
            raise ComponentError(self.new + err.field_path[len(self.old):], err.value, err.allowed,
                                 err.hint) from None
        return False


def _resolve_strategy(job: Job, field_path: str, name: str):
    """The registered strategy `name` ("auto" starts as data), importing a user's own
    "module:name" from the job's folder; JobError when it cannot be found."""
    from gearshift import strategies
    try:
        return strategies.lookup("data" if name == "auto" else name, [job.base_dir])
    except strategies.LayoutError as err:
        raise JobError(field_path, name, str(err)) from None


def _check_layout(job: Job) -> None:
    from gearshift.strategies.layout import LayoutError
    from gearshift.workers.build import components
    from gearshift.workers.build.components import ComponentError

    if job.parallel.strategy == "auto" and job.parallel.tp_size is not None:
        raise JobError("parallel.tp_size", job.parallel.tp_size, "is chosen by the policy under strategy auto; "
                       "leave it unset (or pin layouts with adapt.schedule)")
    _resolve_strategy(job, "parallel.strategy", job.parallel.strategy)
    try:
        layout = job.layout
    except LayoutError as err:
        text = str(err)
        field = (text.split(":", 1)[0] if text.startswith(("parallel.pp_size:", "parallel.tp_size:")) else
                 "parallel.pp_size" if "pp_size" in text else
                 "parallel.dp_shard" if "dp_shard" in text and job.parallel.dp_shard else
                 "parallel.shard_size" if "shard_size" in text and job.parallel.shard_size is not None else
                 "parallel.tp_size" if job.parallel.tp_size is not None else "parallel.strategy")
        raise JobError(field, getattr(job.parallel, field.split(".")[1]), text) from None
    if isinstance(job.train.activation_checkpointing, list):
        try:
            components.check_module_patterns(job.to_dict()["model"], job.train.activation_checkpointing,
                                             "train.activation_checkpointing", [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None
    if job.parallel.fsdp_units:
        try:
            components.check_module_patterns(job.to_dict()["model"], job.parallel.fsdp_units, "parallel.fsdp_units",
                                             [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None
    if job.parallel.tp_plan and job.parallel.strategy == "data" and not job.adapt.schedule:
        raise JobError("parallel.tp_plan", job.parallel.tp_plan, "only applies with tensor parallelism; "
                       "strategy data shards nothing")
    if _resolve_strategy(job, "parallel.strategy", layout.strategy).needs_plan or layout.tp > 1:  # a pipeline's tp
        try:
            components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, layout.tp, [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None


def _check_adapt(job: Job) -> None:
    """Every layout the run may switch to must fit the workers, the batch and the model."""
    from gearshift.strategies.layout import LayoutError
    from gearshift.workers.build import components
    from gearshift.workers.build.components import ComponentError

    w = job.cluster.num_workers
    if job.inject.nodes > 1 and w % job.inject.nodes:
        raise JobError("inject.nodes", job.inject.nodes, f"must divide cluster.num_workers ({w}): "
                       f"{w} % {job.inject.nodes} = {w % job.inject.nodes}")
    if job.inject.link is not None and job.inject.nodes < 2:
        raise JobError("inject.link", job.inject.link, "needs inject.nodes >= 2: a link joins simulated nodes")
    for i, entry in enumerate(job.adapt.schedule):
        where = f"adapt.schedule[{i}]"
        if entry["step"] >= job.train.steps:
            raise JobError(f"{where}.step", entry["step"], f"must be before the last step (train.steps = {job.train.steps})")
        _resolve_strategy(job, f"{where}.strategy", entry["strategy"])
        try:
            layout = scheduled(job, entry)
        except LayoutError as err:
            raise JobError(where, entry, str(err)) from None
        if job.train.global_batch_size % layout.dp:
            raise JobError(where, entry, f"dp({layout.dp}) must divide train.global_batch_size "
                                         f"({job.train.global_batch_size})")
        if _resolve_strategy(job, f"{where}.strategy", layout.strategy).needs_plan or layout.tp > 1:
            try:
                components.check_tp_plan(job.to_dict()["model"], job.parallel.tp_plan, layout.tp, [job.base_dir])
            except ComponentError as err:
                raise JobError(err.field_path, err.value, err.allowed, f"(needed by {where}) {err.hint}".strip()) from None


def _check_tune(job: Job) -> None:
    t = job.tune
    if t.start not in t.bucket_values:
        raise JobError("tune.start", t.start, f"must be one of tune.bucket_values {t.bucket_values}")


def _check_sizes(job: Job) -> None:
    _check_layout(job)
    _check_adapt(job)
    _check_tune(job)
    dp = job.dp_size
    if job.train.global_batch_size % dp:
        raise JobError("train.global_batch_size", job.train.global_batch_size,
                       f"must divide evenly across the data-parallel workers: "
                       f"{job.train.global_batch_size} % {dp} = {job.train.global_batch_size % dp}",
                       f"Use a multiple of {dp}, e.g. {dp * max(1, round(job.train.global_batch_size / dp))}.")
    _check_micro_batch(job, [("parallel.strategy", job.layout)] + _scheduled_layouts(job))
    _check_pipeline(job)
    _check_lr_schedule(job)
    _check_keep_fp32(job)
    _check_profile(job)
    if job.fault.on_nan == "rollback" and not job.checkpoint.every:
        raise JobError("fault.on_nan", "rollback", "goes back to a checkpoint: give checkpoint.every (steps between "
                       "checkpoints) with it", "checkpoint.every is 0; e.g. --set checkpoint.every=50")
    if job.optimizer.name != "sgd" and (job.optimizer.momentum or job.optimizer.nesterov):
        raise JobError("optimizer.momentum", job.optimizer.momentum,
                       f"applies to sgd only; {job.optimizer.name} uses betas")
    if job.optimizer.nesterov and job.optimizer.momentum <= 0:
        raise JobError("optimizer.nesterov", True, "needs optimizer.momentum > 0")


def _scheduled_layouts(job: Job) -> list:

    return [(f"adapt.schedule[{i}]", scheduled(job, e)) for i, e in enumerate(job.adapt.schedule)]


def scheduled(job: Job, entry: dict, workers: int | None = None):
    """The layout an adapt.schedule entry names (a resumed or shrunk run may have other `workers`)."""
    from gearshift.strategies.layout import Layout

    n = workers or job.cluster.num_workers
    shard = entry.get("shard_size")
    if entry["strategy"] == "hsdp" and shard is None:
        shard = job.shard_size("hsdp") if n == job.cluster.num_workers else n // max(1, job.inject.nodes)
    return Layout.for_workers(entry["strategy"], n, entry["tp_size"], shard, entry.get("dp_shard", False),
                              entry.get("pp_size"))


def accumulation(global_batch: int, micro: int | None, dp: int) -> int | None:
    """Micro-batches per update on each rank, or None when they do not divide the batch."""
    if micro is None:
        return 1
    share, rest = divmod(global_batch, micro * dp)
    return share if not rest and share >= 1 else None


def _check_micro_batch(job: Job, layouts: list) -> None:
    """Accumulation = global / (micro x dp) must be a whole number under every layout the run
    may take (a switch changes dp and keeps the micro-batch)."""
    g, b = job.train.global_batch_size, job.train.micro_batch_size
    for where, layout in layouts:
        if accumulation(g, b, layout.dp) is None:
            raise JobError("train.micro_batch_size", b,
                           f"global_batch_size({g}) must be a multiple of micro_batch_size({b}) x dp({layout.dp}) "
                           f"= {b * layout.dp} under {where} = {layout}: {g} % {b * layout.dp} = {g % (b * layout.dp)}",
                           "Accumulation steps = global_batch_size / (micro_batch_size x dp).")


def pp_microbatches(job: Job, dp: int) -> int:
    """parallel.pp_microbatches resolved: the job's, else the largest up to 2 x pp_size that
    divides a replica's share of one pass (its micro-batch under accumulation)."""
    from gearshift.strategies.pipeline import microbatches

    share = job.train.micro_batch_size or job.train.global_batch_size // dp
    return microbatches(share, job.parallel.pp_size or 1, job.parallel.pp_microbatches)


def _check_pipeline(job: Job) -> None:
    """What the pipeline layout needs, and what it does not do yet, before anything starts."""
    p, t = job.parallel, job.train
    piped = [("parallel.strategy", job.layout)] if p.strategy == "pipeline" else []
    piped += [(where, layout) for where, layout in _scheduled_layouts(job) if layout.pp > 1]
    if not piped:
        for name, value, default in (("pp_microbatches", p.pp_microbatches, None), ("pp_split", p.pp_split, []),
                                     ("pp_schedule", p.pp_schedule, "1f1b")):
            if value != default:
                raise JobError(f"parallel.{name}", value, f"applies to strategy pipeline, not {p.strategy}")
        return
    for where, layout in piped:
        _check_stages(job, where, layout)


def _check_stages(job: Job, where: str, layout) -> None:
    """One pipeline layout the run may take (`where` names it): its micro-batches, its cut."""
    p, t = job.parallel, job.train
    share = t.micro_batch_size or t.global_batch_size // layout.dp
    m = pp_microbatches(job, layout.dp)
    if share % m:
        raise JobError("parallel.pp_microbatches", m, f"must divide a replica's share of the step, "
                       f"{share} samples ({'train.micro_batch_size' if t.micro_batch_size else f'train.global_batch_size / dp({layout.dp})'}): "
                       f"{share} % {m} = {share % m}" + (f" (under {where})" if where != "parallel.strategy" else ""))
    _check_interleaved(job, layout, m, where)
    _check_cut(job, layout)
    if t.compile and job.parallel.pp_schedule == "interleaved_zb":
        raise JobError("train.compile", t.compile, "pp_schedule interleaved_zb runs the weights' backward apart from "
                       "the inputs', which a compiled block's backward does not allow: use pp_schedule 1f1b, gpipe "
                       "or interleaved_1f1b with train.compile" + (f" (under {where})" if where != "parallel.strategy" else ""))


def _check_interleaved(job: Job, layout, m: int, where: str) -> None:
    """An interleaved schedule's micro-batches: torch's runs them in rounds of pp_size, so they
    are fewer than 2 x pp_size or a multiple of the rounds (`m % (m // pp_size)`)."""
    from gearshift.strategies.pipeline import stages_per_rank

    if stages_per_rank(job.parallel.pp_schedule) == 1:
        return
    if layout.shard > 1 and job.parallel.pp_schedule == "interleaved_zb":
        raise JobError("parallel.dp_shard", True, f"a stage's blocks sharded over its replicas run under pp_schedule "
                       f"gpipe, 1f1b or interleaved_1f1b, not interleaved_zb (tried: its weights' backward run apart "
                       f"from the inputs' leaves sharded stages' weights wrong)"
                       + (f" (under {where})" if where != "parallel.strategy" else ""))
    rounds = max(1, m // layout.pp)
    if m % rounds:
        fits = sorted({k for k in range(1, 4 * layout.pp + 1) if k % max(1, k // layout.pp) == 0})
        raise JobError("parallel.pp_microbatches", m, f"{job.parallel.pp_schedule} runs the micro-batches in rounds "
                       f"of pp_size ({layout.pp}): {m} // {layout.pp} = {rounds} rounds must divide them; e.g. "
                       f"{fits}" + (f" (under {where})" if where != "parallel.strategy" else ""))


def _check_cut(job: Job, layout) -> None:
    """The pipeline's cut on a meta-device copy of the model (no memory): enough blocks for the
    stages, and parallel.pp_split naming blocks in order. (Whether the forward can be cut there
    is traced on a sample in the workers, before the first step.)"""
    from gearshift.strategies.pipeline import cut as cuts, stages_per_rank
    from gearshift.workers.build.components import model_for_checks

    model, _ = model_for_checks(job.to_dict()["model"], [job.base_dir])
    blocks = cuts.find_blocks(model, tuple(job.parallel.fsdp_units))
    field = "parallel.pp_split" if job.parallel.pp_split else "parallel.pp_size"
    if not blocks:
        raise JobError("parallel.strategy", "pipeline", "finds no repeated blocks to cut the model at (the entries "
                       "of a ModuleList, or a Hugging Face model's _no_split_modules)", "Name them with "
                       "parallel.fsdp_units, e.g. ['model.layers.*'].")
    try:
        cuts.choose(model, blocks, layout.pp, tuple(job.parallel.pp_split), stages_per_rank(job.parallel.pp_schedule))
    except cuts.CutError as err:
        text = str(err).split(": ", 1)[1] if str(err).startswith("parallel.") else str(err)
        raise JobError(field, job.parallel.pp_split or job.parallel.pp_size, text) from None


def _check_lr_schedule(job: Job) -> None:
    sched, steps = job.optimizer.schedule, job.train.steps
    if sched.warmup_steps and sched.warmup_steps >= steps:
        raise JobError("optimizer.schedule.warmup_steps", sched.warmup_steps,
                       f"must be shorter than the run (train.steps = {steps})")
    if ":" in sched.name:
        from gearshift.workers.step import schedules
        from gearshift.workers.build.components import ComponentError

        try:
            schedules.check_user_schedule(sched.name, job.optimizer.lr, steps, [job.base_dir])
        except ComponentError as err:
            raise JobError(err.field_path, err.value, err.allowed, err.hint) from None


def _check_profile(job: Job) -> None:
    """A window that runs past the last update would never finish: no trace would be written."""
    p, steps = job.train.profile, job.train.steps
    if p and p["start_step"] + p["steps"] - 1 > steps:
        raise JobError("train.profile", p, f"must end by the last update: start_step + steps - 1 = "
                       f"{p['start_step'] + p['steps'] - 1} > train.steps = {steps}",
                       f"With steps: {p['steps']}, start_step may be at most {steps - p['steps'] + 1}." if
                       p["steps"] <= steps else f"At most train.steps = {steps} updates can be profiled.")


def _check_keep_fp32(job: Job) -> None:
    """Each keep_fp32 pattern must name a module of the model, as a tp plan's patterns must."""
    p = job.train.precision
    if not isinstance(p, dict):
        return
    from gearshift.workers.step import precision
    from gearshift.workers.build.components import ComponentError

    for field in ("keep_fp32", "final_fp32"):
        if p.get(field):
            try:
                precision.check_patterns(job.to_dict()["model"], p[field], [job.base_dir], field)
            except ComponentError as err:
                raise JobError(err.field_path, err.value, err.allowed, err.hint) from None
