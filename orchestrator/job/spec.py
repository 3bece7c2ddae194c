"""The job as frozen dataclasses, one per section, and how a raw mapping becomes one: unknown
keys get a "did you mean", each value goes through its field's checker (fields.py)."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from gearshift.orchestrator.job import credentials, secrets
from gearshift.orchestrator.job.fields import JobError, _READERS, _betas, _bool, _bool_or_auto, _bucket, _checkpointing, _bucket_values, _builtin, _choice, _columns, _compile, _entrypoint, _env, _eval_batches, _f, _float, _fsdp_units, _grad_check, _grad_clip, _host, _int, _link, _lr_schedule, _mapping, _max_failures, _micro_batch, _min_workers, _name, _nullable, _on_node_loss, _num_gpus, _port, _precision, _pretrained, _profile, _reader, _schedule, _schema, _section, _slow, _str_or_none, _strategy, _stragglers, _tp_plan, _tp_size


@dataclass(frozen=True)
class ModelSpec:
    name: str | None = _f(None, _builtin("MODELS"), "a built-in model: mlp, gpt")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning an nn.Module')
    kwargs: dict = _f({}, _mapping, "passed to the built-in or the entry point")
    pretrained: dict | None = _f(None, _pretrained, "weights to start from: a folder of safetensors (Hugging Face "
                                 "save_pretrained, or gearshift export), or {path, prefix}; each worker reads only "
                                 "its slices. prefix: what the model's names carry in front of the file's")
    init: str = _f("auto", _choice("auto", "exact", "per_shard"),
                   "initial values from scratch. exact: a plain single-process build's after train.seed (every "
                   "rank replays the whole model's random draws); per_shard: each rank draws only its pieces, "
                   "the same for a seed whatever the layout, not a plain build's; auto: exact under 1B "
                   "parameters, else per_shard")


@dataclass(frozen=True)
class LoaderSpec:
    """Batches read ahead by loader processes (a torch DataLoader over gearshift's own order, so
    the batches are the same whatever the number of processes, and resume is exact)."""

    workers: int = _f(0, _int(0, 64), "loader processes per worker reading batches ahead; 0 reads in the "
                                      "step loop")
    prefetch: int = _f(2, _int(1, 64), "batches each loader process keeps ready (with workers > 0)")
    pin_memory: bool | str = _f("auto", _bool_or_auto, "page-locked batches for faster, asynchronous copies to a "
                                "GPU; auto: on where the worker has a GPU (with workers > 0; ignored on CPU)")


@dataclass(frozen=True)
class DataSpec:
    """Map-style data (name or entrypoint), or a Ray Dataset streamed to the workers (ray_dataset
    or read, with input and target naming its columns)."""

    name: str | None = _f(None, _builtin("DATASETS"), "a built-in dataset; default: the one for the built-in model")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning a map-style Dataset')
    ray_dataset: str | None = _f(None, _entrypoint, '"module:function" returning a ray.data.Dataset, streamed '
                                                    "to the workers")
    read: str | None = _f(None, _reader, "read files with Ray Data and stream them: " + ", ".join(_READERS))
    paths: Any = _f(None, _columns, "the files read reads: a path, a glob, a folder, or a list of them (relative "
                                    "to the job file)")
    input: Any = _f(None, _columns, "the Ray Dataset's input column (a list: columns stacked as features)")
    target: str | None = _f(None, _str_or_none, "the Ray Dataset's target column")
    shuffle_buffer: int = _f(8192, _int(0), "Ray Dataset: rows shuffled together within a pass (after the "
                                            "blocks' order is shuffled); 0: the dataset's own order")
    kwargs: dict = _f({}, _mapping, "passed to the built-in, the entry point, or Ray Data's reader")
    inspect: bool = _f(False, _bool, "gearshift report also draws the batch rank 0 trained at step 1 (as "
                                     "gearshift inspect data does)")
    loader: LoaderSpec = _section(LoaderSpec, "reading batches ahead in loader processes (map-style data); "
                                              "prefetch also sets how many steps a streamed dataset keeps ahead")


@dataclass(frozen=True)
class LossSpec:
    name: str | None = _f(None, _builtin("LOSSES"), "cross_entropy or mse")
    entrypoint: str | None = _f(None, _entrypoint, '"module:function" returning loss_fn(output, target)')
    kwargs: dict = _f({}, _mapping, "passed to the built-in or the entry point")


@dataclass(frozen=True)
class ScheduleSpec:
    """The learning rate of the s-th update (1-based) of a run of T = train.steps updates:
    lr * s / W during the warm-up (s <= W), then constant, falling linearly (linear), or along a
    half cosine (warmup_cosine) to min_lr_ratio * lr at s = T."""

    name: str = _f("constant", _lr_schedule, 'constant, linear, warmup_cosine, or "module:function" taking '
                                            "(step, total_steps, base_lr) and returning the learning rate")
    warmup_steps: int = _f(0, _int(0), "updates with the learning rate rising linearly to optimizer.lr")
    min_lr_ratio: float = _f(0.0, _float(0.0, 1.0), "linear and warmup_cosine end at min_lr_ratio x optimizer.lr")


@dataclass(frozen=True)
class OptimizerSpec:
    name: str = _f("adamw", _choice("sgd", "adam", "adamw"), "the torch.optim optimizer")
    lr: float = _f(1e-3, _float(0.0, lo_open=True), "learning rate")
    weight_decay: float = _f(0.0, _float(0.0), "decoupled for adamw, L2 for sgd and adam")
    momentum: float = _f(0.0, _float(0.0, 0.999999), "sgd only")
    nesterov: bool = _f(False, _bool, "sgd only")
    betas: tuple = _f((0.9, 0.999), _betas, "adam and adamw")
    eps: float = _f(1e-8, _float(0.0, lo_open=True), "adam and adamw")
    fused: bool | str = _f("auto", _bool_or_auto, "torch's fused update kernels; they also skip a step whose "
                           "gradients are not finite on the device, so the step never waits on the host to "
                           "decide; auto: on GPU")
    schedule: ScheduleSpec = _section(ScheduleSpec, "the learning rate over the run: warm-up and decay")


@dataclass(frozen=True)
class TrainSpec:
    steps: int = _f(100, _int(1), "optimizer steps to train")
    global_batch_size: int = _f(64, _int(1), "samples per optimizer step, over all data-parallel workers")
    micro_batch_size: int | None = _f(None, _micro_batch, "samples one worker computes at once; gradients "
                                      "accumulate over global_batch_size / (micro_batch_size x dp) of them; "
                                      "null: the whole share of the global batch at once")
    seed: int = _f(0, _int(0, 2**31 - 1), "seeds the model's initial weights, the data order and dropout")
    random_per: str = _f("sample", _choice("sample", "replica"), "sample: each nn.Dropout's mask of a sample, and "
                         "a map-style dataset's augmentation of it, follow the sample (the seed, the step, its place "
                         "in the global batch): the same under every layout, share, micro-batch and switch; replica: "
                         "torch's dropout and the step's generator, one stream per data replica and pipeline position "
                         "(a switch or a rebalance draws other numbers)")
    precision: str | dict = _f("fp32", _precision, "fp32, bf16 or fp16 (autocast; fp16 adds loss scaling), or "
                               "phases: {dtype: bf16 | fp16, fp32_warmup_steps: N, keep_fp32: [module patterns], "
                               "fp32_final_steps: N, final_fp32: [module patterns]}")
    grad_clip: float | None = _f(None, _grad_clip, "max gradient norm; null or 0 turns clipping off")
    grad_check: dict | None = _f(None, _grad_check, "per-parameter gradient norms every N updates: {every: N, "
                                 "explode_ratio: R}; a NaN/Inf norm, or one R times its own median, is a "
                                 "grad_anomaly record with a diagnosis; null: off")
    log_every: int = _f(10, _int(1), "steps between progress lines")
    activation_checkpointing: bool | list = _f(False, _checkpointing, "recompute activations in backward: true "
                                               "(the built-ins' blocks; any other model's FSDP units) or a list "
                                               "of module-name patterns or class names")
    compile: bool | dict = _f(False, _compile, "torch.compile the model under its layout: true, or {mode, "
                                               "fullgraph}; compiled again after a switch")
    on_oom: str = _f("adapt", _choice("adapt", "fail"), "a step out of device memory: adapt (drop the step, go on "
                     "at it with half the micro-batch, then a more sharded layout) or fail (stop, saying where)")
    profile: dict | None = _f(None, _profile, "record updates start_step..start_step+steps-1 (1-based) with "
                              "torch.profiler on every rank: {start_step: S, steps: K}; null: no profiling. "
                              "Traces and tables land in RUN_DIR/profile/")


@dataclass(frozen=True)
class ClusterSpec:
    num_workers: int = _f(2, _int(1, 4096), "worker actors, one per device")
    cpus_per_worker: float = _f(1.0, _float(0.0, lo_open=True), "Ray CPUs reserved for each worker")
    gpus_per_worker: float = _f(0.0, _num_gpus, "0: train on CPU; 1: one GPU per worker")
    placement: str = _f("pack", _choice("pack", "spread"), "Ray placement group strategy: pack workers onto "
                                                           "few nodes, or spread them")
    placement_timeout_s: float = _f(60.0, _float(0.0, lo_open=True), "fail when the cluster cannot fit the job by then")
    env: dict = _f({}, _env, "environment variables set in every worker before any process group exists "
                             "(NCCL_*, ...): {NAME: value}, values strings or numbers")
    min_workers: int | None = _f(None, _min_workers, "the fewest workers the run goes on with after losing some "
                                 "(fault.on_node_loss elastic or shrink). Below num_workers, the survivors of a loss "
                                 "go on in memory (elastic is the default); null: no bound for shrink, and a lost "
                                 "worker is restarted from the checkpoint")
    max_workers: int | None = _f(None, _min_workers, "elastic: the most workers the run grows to when the cluster "
                                 "has room (a node joins, a lost worker's place comes back), taken in at a step "
                                 "boundary without a restart; null: num_workers")


@dataclass(frozen=True)
class ParallelSpec:
    strategy: str = _f("data", _strategy(allow_auto=True),
                       "auto starts in the least-sharded layout predicted to fit the devices and lets the "
                       "adaptive policy switch (see adapt)")
    tp_size: int | None = _f(None, _tp_size, "tensor-parallel group size; hybrid: dp = num_workers / tp_size; "
                                                "pipeline: inside each stage, dp = num_workers / (pp_size x tp_size)")
    tp_plan: dict = _f({}, _tp_plan, "module-name pattern -> colwise | rowwise, for models without a plan")
    bucket_cap_mb: float | str = _f(25.0, _bucket, "gradient bucket size in MB, or auto: tuned while training "
                                                    "(see tune)")
    tp_across_nodes: bool = _f(False, _bool, "allow tensor-parallel groups that span nodes (slow: for comparisons)")
    shard_size: int | None = _f(None, _tp_size, "hsdp: workers per shard group (state sharded inside a group, "
                                                "replicated across groups); null: the workers of one node")
    dp_shard: bool = _f(False, _bool, "hybrid, pipeline (not interleaved_zb): shard the data dimension's state (FSDP "
                                      "over dp; a pipeline's blocks over each stage's replicas) instead of "
                                      "replicating it")
    dp_overlap: bool = _f(True, _bool, "hybrid: all-reduce the data-parallel gradients bucket by bucket while "
                                       "backward still computes (false: after backward, one bucket after the "
                                       "other; for comparisons)")
    fsdp_units: list = _f([], _fsdp_units, "fsdp, hsdp, hybrid dp_shard: the modules sharded as units of their own "
                          "(module-name patterns such as model.layers.*, or class names); empty: a Hugging Face "
                          "model's _no_split_modules, else the blocks of the outermost ModuleList at any depth")
    pp_size: int | None = _f(None, _tp_size, "pipeline: the stages the model is cut into, one after the other "
                             "(dp = num_workers / pp_size)")
    pp_microbatches: int | None = _f(None, _tp_size, "pipeline: the micro-batches a replica's share of the step "
                                     "flows through the stages in; null: the largest up to 2 x pp_size that divides "
                                     "the share")
    pp_schedule: str = _f("1f1b", _choice("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb"), "pipeline: gpipe "
                          "(every forward, then every backward), 1f1b (one forward, one backward: fewer micro-batches' "
                          "activations held), interleaved_1f1b (2 stages a rank, the model cut in 2 x pp_size: half "
                          "the bubble, twice the activations crossing) or interleaved_zb (that, with the weights' "
                          "backward apart from the inputs', filling the bubble)")
    pp_split: list = _f([], _fsdp_units, "pipeline: the first block of every stage after the first (e.g. "
                        "['blocks.4']); empty: cut where the stages hold about equal parameters")
    reduce_dtype: str = _f("fp32", _choice("fp32", "bf16"), "fsdp, hsdp, hybrid dp_shard with train.precision bf16: "
                           "the dtype gradients are reduced in (parameters are gathered in bf16; the optimizer "
                           "updates fp32 master weights either way); bf16 halves the reduce-scatter's bytes")


@dataclass(frozen=True)
class CheckpointSpec:
    every: int = _f(0, _int(0), "steps between checkpoints; 0 keeps only the final state")
    keep: int = _f(3, _int(1), "how many recent checkpoints to keep")
    keep_best: bool = _f(False, _bool, "also keep the checkpoint with the lowest eval loss (needs eval.every > 0); "
                                       "checkpoints/best.json names it")
    format: str = _f("auto", _choice("auto", "dcp", "full"), "dcp: every worker writes its own shards "
                     "(torch.distributed.checkpoint), nothing gathered; full: one state.pt of whole tensors, gathered a "
                     "tensor at a time and written by the first worker; auto: dcp when every worker reaches the "
                     "checkpoints' place (through the driver's file server where needed), else full")
    path: str | None = _f(None, _str_or_none, "where checkpoints go instead of the run directory's checkpoints/: a "
                          "folder every node shares, or an object-store or other fsspec URL (s3://bucket/prefix, "
                          "gs://..., memory://...); each run writes into its own <run dir name>/ there")
    storage_options: dict = _f({}, _mapping, "passed to fsspec for checkpoint.path: an S3-compatible endpoint_url, "
                               "key and secret, a region, ...")
    final: str = _f("auto", _choice("auto", "full", "none"), "final.pt at the end, the model's full fp32 tensors in "
                    "one file: full always, none never, auto when the model's fp32 size is under 2 GiB (above it the "
                    "run says how to export: gearshift export writes safetensors shards from the last checkpoint)")
    async_save: bool = _f(True, _bool, "dcp format: each worker copies its state to CPU memory at a checkpoint step "
                          "and writes it while training goes on (torch.distributed.checkpoint.async_save); false: the "
                          "step waits for the write. The full format is always written in the step")


@dataclass(frozen=True)
class AdaptSpec:
    enabled: bool = _f(True, _bool, "with strategy auto: let the policy switch layouts")
    threshold: float = _f(0.15, _float(0.0, 1.0, lo_open=True), "comm-wait fraction of the step that calls for a switch")
    window: int = _f(20, _int(2, 100000), "steps averaged before each decision")
    cooldown: int = _f(40, _int(0), "steps after a switch before the next one")
    memory_threshold: float = _f(0.92, _float(0.0, 1.0, lo_open=True), "a rank whose peak memory in a window "
                                 "passes this share of its device's moves to a layout predicted to need less")
    decide: str = _f("predict", _choice("predict", "trial"),
                     "predict: move to the layout an online cost model predicts best, when it pays; trial: try "
                     "the next candidate and keep it if it helped")
    start: str = _f("probe", _choice("probe", "memory"),
                    "the layout auto starts on. probe: on a run over nodes deciding by prediction, the workers "
                    "measure their device and the link before the build, and the run starts on the layout "
                    "predicted fastest among those that fit; memory: the least sharded layout that fits")
    stragglers: str = _f("rebalance", _stragglers,
                         "a data-parallel replica (or a pipeline stage) computing slower than the others. "
                         "rebalance: each replica takes a share of the global batch in proportion to its measured "
                         "speed (the update stays exact), a slow stage's blocks move to the others; drop: as rebalance, and a "
                         "replica past straggler_drop_ratio, or one no share makes fast enough, is let go in memory "
                         "(needs fault.on_node_loss elastic) and taken back after a hold-out; report: say so in a "
                         "decision record, change nothing; off: not watched")
    straggler_drop_ratio: float = _f(3.0, _float(1.0, None, lo_open=True),
                                     "adapt.stragglers drop: a replica this many times slower than the fastest "
                                     "is let go whatever its share would be")
    schedule: list = _f([], _schedule, "forced switches: [{step: N, strategy: S, tp_size: K, shard_size: G, "
                                       "dp_shard: B}, ...]")


@dataclass(frozen=True)
class TuneSpec:
    """Online tuning of parallel.bucket_cap_mb (when it is auto): a climb over `bucket_values`."""

    bucket_values: list = _f([1.0, 5.0, 10.0, 25.0, 50.0, 100.0], _bucket_values, "bucket sizes (MB) to choose from")
    start: float = _f(25.0, _float(0.0, 4096.0, lo_open=True), "the value training starts with; one of bucket_values")
    warmup_steps: int = _f(3, _int(0, 10000), "steps discarded after each change (the new buckets warm up)")
    trial_steps: int = _f(10, _int(1, 100000), "steps timed per trial; the score is their samples/s")
    max_trials: int = _f(6, _int(1, 1000), "trials per tuning round (one round at the start, one per layout)")


@dataclass(frozen=True)
class TelemetrySpec:
    enabled: bool = _f(True, _bool, "per-step timing of data, compute and comm wait, and device sampling")
    sample_period_s: float = _f(1.0, _float(0.2, 3600.0), "device sampling period (NVML takes a driver lock)")
    metrics_port: int | None = _f(None, _port, "serve Prometheus /metrics on this port; 0 picks a free one")
    metrics_host: str = _f("127.0.0.1", _host, "address the /metrics endpoint binds")
    ray_metrics: bool = _f(True, _bool, "also export through ray.util.metrics (Ray's Prometheus endpoint)")


@dataclass(frozen=True)
class MlflowSpec:
    tracking_uri: str | None = _f(None, _str_or_none, "where runs go: sqlite:///PATH or file:PATH (no server), or "
                                  "http://HOST:PORT (an `mlflow server`); null: $MLFLOW_TRACKING_URI, else "
                                  "sqlite:///RUNS_ROOT/mlflow.db")
    experiment: str = _f("gearshift", _name, "the MLflow experiment the run is logged under (created if missing)")


@_schema(_nullable({"anyOf": [{"type": "boolean"}, {
    "type": "object", "additionalProperties": False,
    "properties": {"tracking_uri": _nullable({"type": "string"}), "experiment": _name.schema}}]}))
def _mlflow(v, path):
    """null or false (off), true (the defaults), or {tracking_uri, experiment}; normalised to None
    or the mapping. A value rather than a section: its absence, not a default, means off."""
    if v is None or v is False:
        return None
    if v is True:
        v = {}
    if not isinstance(v, dict):
        raise JobError(path, v, "must be true, false, null, or {tracking_uri: URI, experiment: NAME}")
    return dataclasses.asdict(_build(MlflowSpec, v, path))


@dataclass(frozen=True)
class TrackingSpec:
    """Experiment trackers fed from the controller, off the workers' hot path (orchestrator/tracking.py).
    A tracker that is down or slow never stops or slows training."""

    mlflow: dict | None = _f(None, _mlflow, "log the run to MLflow: true, or {tracking_uri, experiment}; null: off")
    tensorboard: bool = _f(False, _bool, "write TensorBoard event files to RUN_DIR/tensorboard/")
    buffer: int = _f(10000, _int(100, 10_000_000), "records held for a slow or unreachable tracker; beyond it the "
                     "oldest are dropped (and counted)")
    close_timeout_s: float = _f(30.0, _float(0.0, 3600.0), "at the end of the run, how long to wait for the "
                                "trackers to catch up and take the artifacts")


@dataclass(frozen=True)
class InjectSpec:
    """A simulated network, for trying adaptive mode on one machine (workers/group/simnet.py): the
    workers grouped into simulated nodes, a slow link between them, a delay on every collective."""

    comm_delay_ms: float = _f(0.0, _float(0.0, 60000.0), "extra latency added to every timed collective")
    nodes: int = _f(1, _int(1, 4096), "group the workers into this many simulated nodes (consecutive ranks)")
    link: dict | None = _f(None, _link, "a simulated slow link between simulated nodes: {mb_per_s, latency_ms}")
    slow: dict | None = _f(None, _slow, "simulated stragglers: {ranks: [R, ...], factor: F, from_step: A, to_step: B}: "
                           "those workers compute F times as long (a sleep after each step's forward and backward, "
                           "in proportion to their time) over steps [A, B), B null: to the end")
    unshared_storage: bool = _f(False, _bool, "the workers act as if their nodes did not share the driver's file "
                                              "system: they reach the run's checkpoints through the driver's file "
                                              "server")


@dataclass(frozen=True)
class FaultSpec:
    """What happens when a worker, a node or a step goes wrong."""

    max_failures: int = _f(3, _max_failures, "worker or node failures to recover from (restart from the latest "
                                             "checkpoint); -1: no limit")
    collective_timeout_s: float = _f(300.0, _float(1.0, 86400.0), "a collective, or a worker answering neither "
                                     "with a step nor a heartbeat, this long (plus 5 s) is a failure")
    progress_timeout_s: float = _f(3600.0, _float(1.0, 604800.0), "workers that all answer their heartbeats but "
                                   "finish no step for this long are taken for hung (a slow step, a first compile "
                                   "or a checkpoint counts as alive until then)")
    on_node_loss: str | None = _f(None, _on_node_loss, "elastic: the survivors go on in memory from the step that "
                                  "failed, on fewer workers, where they hold every piece of the state (else restart "
                                  "from the checkpoint); shrink: restart from the checkpoint on the workers that still "
                                  "fit; wait: restart when a replacement node joins; null: elastic when "
                                  "cluster.min_workers is below num_workers or cluster.max_workers above it, else shrink")
    replacement_timeout_s: float = _f(600.0, _float(0.0, 86400.0), "on_node_loss wait: how long, then fail")
    on_nan: str = _f("skip", _choice("skip", "stop", "rollback"), "a step with a non-finite loss or gradient norm: "
                     "skip its batch (the update is not applied), stop the run, or rollback: skip it, and after "
                     "nan_patience of them within 100 steps go back to the newest checkpoint before the first, at "
                     "rollback_lr_factor times the learning rate")
    nan_patience: int = _f(3, _int(1, 10_000), "on_nan rollback: non-finite steps within 100 steps that roll back")
    rollback_lr_factor: float = _f(0.5, _float(1e-6, 1.0), "on_nan rollback: the learning rate is multiplied by this "
                                                          "at each rollback")


_DATA_FORMS = 'a built-in name, "module:function", or {name | entrypoint, kwargs}'


@_schema(_nullable({"anyOf": [
    {"type": "string", "pattern": r"\S"},
    {"type": "object", "additionalProperties": False,
     "properties": {"name": _nullable({"type": "string"}), "entrypoint": _entrypoint.schema,
                    "kwargs": _mapping.schema}}]}))
def _eval_data(v, path):
    """The same forms as the top-level data, normalised to {name, entrypoint, kwargs}. One field
    rather than a nested section: eval.data is a value of eval, as inject.link is of inject."""
    if v is None:
        return None
    if not isinstance(v, (str, dict)):
        raise JobError(path, v, f"must be {_DATA_FORMS}")
    spec = _build(DataSpec, _shorthand(DataSpec, v), path)
    return dataclasses.asdict(spec)


@dataclass(frozen=True)
class EvalSpec:
    """Held-out loss while training: at every `every`-th step and at the end, the mean loss over
    eval.data under the layout in force, in batches of train.global_batch_size, in order."""

    every: int = _f(0, _int(0), "steps between evaluations (and one at the end); 0: no evaluation")
    data: dict | None = _f(None, _eval_data, f"the held-out data: {_DATA_FORMS}; required when every > 0")
    batches: int | None = _f(None, _eval_batches, "evaluate the first K batches of eval.data; null: all of it")


@dataclass(frozen=True)
class Job:
    name: str = _f("job", _name, "names the run and its directory; default: the job file's name",
                   schema_default=False)
    model: ModelSpec = _section(ModelSpec, 'required: a built-in name (mlp, gpt), "module:function", or '
                                           "{name | entrypoint, kwargs}")
    data: DataSpec = _section(DataSpec, 'a built-in name, "module:function", or {name | entrypoint, kwargs}; '
                                        "default: the built-in model's own data")
    loss: LossSpec = _section(LossSpec, 'a built-in name, "module:function", or {name | entrypoint, kwargs}; '
                                        "default: cross_entropy")
    optimizer: OptimizerSpec = _section(OptimizerSpec, "sgd (momentum, nesterov), adam or adamw (betas, eps)")
    train: TrainSpec = _section(TrainSpec, "how long, how big a batch, which seed and precision")
    cluster: ClusterSpec = _section(ClusterSpec, "how many workers and what each takes from Ray")
    parallel: ParallelSpec = _section(ParallelSpec, "the layout training starts with: data, tensor, hybrid, or auto")
    adapt: AdaptSpec = _section(AdaptSpec, "when the layout changes while training: the policy, or a schedule")
    tune: TuneSpec = _section(TuneSpec, "online tuning of parallel.bucket_cap_mb when it is auto")
    fault: FaultSpec = _section(FaultSpec, "what happens when a worker, a node or a step goes wrong")
    checkpoint: CheckpointSpec = _section(CheckpointSpec, "how often the training state is saved")
    eval: EvalSpec = _section(EvalSpec, "held-out loss while training: every N steps and at the end")
    telemetry: TelemetrySpec = _section(TelemetrySpec, "per-step timing, device sampling and metrics endpoints")
    tracking: TrackingSpec = _section(TrackingSpec, "experiment tracking: MLflow and TensorBoard")
    inject: InjectSpec = _section(InjectSpec, "for tests: make a fast machine behave like a slow cluster")
    # Where the job file lies: entry-point modules next to it are importable. Not a YAML key.
    base_dir: str = field(default=".", metadata={"internal": True}, compare=False)
    # The `${VAR}` references the job file typed, by path: what is written instead of the values
    # read for them (secrets.py). Not a YAML key.
    refs: tuple = field(default=(), metadata={"internal": True}, compare=False)

    @property
    def layout(self):
        from gearshift.strategies.layout import Layout

        # auto: data parallel until the workers' devices are known (the controller then starts it
        # where the model fits, Controller._starting_layout); the policy moves it from there
        strategy = "data" if self.parallel.strategy == "auto" else self.parallel.strategy
        p = self.parallel
        return Layout.for_workers(strategy, self.cluster.num_workers, p.tp_size, self.shard_size(strategy), p.dp_shard,
                                  p.pp_size)

    def shard_size(self, strategy: str) -> int | None:
        """hsdp's shard group: parallel.shard_size, else the workers of one node (the simulated
        nodes' size here; the placement's own node size once the workers are placed)."""
        if strategy != "hsdp" or self.parallel.shard_size is not None:
            return self.parallel.shard_size
        return self.cluster.num_workers // max(1, self.inject.nodes)

    @property
    def on_node_loss(self) -> str:
        """fault.on_node_loss resolved: elastic where cluster.min_workers leaves room below
        num_workers, else shrink, unless the job names one."""
        if self.fault.on_node_loss is not None:
            return self.fault.on_node_loss
        n = self.cluster.num_workers
        return "elastic" if self.min_workers < n or (self.cluster.max_workers or n) > n else "shrink"

    @property
    def min_workers(self) -> int:
        """cluster.min_workers resolved (null: num_workers)."""
        m = self.cluster.min_workers
        return self.cluster.num_workers if m is None else min(m, self.cluster.num_workers)

    @property
    def dp_size(self) -> int:
        return self.layout.dp

    def to_dict(self) -> dict:
        """The resolved job as plain data, credentials and values read from the environment
        included: what the code uses. Never write it down: `written()` is for that."""
        out = dataclasses.asdict(self)
        out.pop("base_dir")
        out.pop("refs")
        out["optimizer"]["betas"] = list(out["optimizer"]["betas"])
        return out

    def written(self) -> dict:
        """The job as job.yaml, MLflow and `gearshift check` show it: each `${VAR}` as typed, any
        other credential masked (secrets.written)."""
        return secrets.written(self.to_dict(), dict(self.refs))

    def source_dict(self) -> dict:
        """The job as typed, references unread: what it is rebuilt from with overrides. In memory
        only (it holds a credential typed into the file as it is)."""
        return secrets.source(self.to_dict(), dict(self.refs))

    def secret_values(self) -> tuple[str, ...]:
        """What no text a worker sends may show (secrets.run_secrets): the credentials' values, the
        URLs' passwords, the values read for variables named like credentials. In memory only."""
        return secrets.run_secrets(self.to_dict(), dict(self.refs))

    def fingerprint(self) -> str:
        """A short hash of everything that changes the result; same config, same fingerprint.
        Values read for `${VAR}` count, credentials do not: a rotated key is the same experiment."""
        data = credentials.without(self.to_dict())
        data.pop("name")
        data.pop("tracking")  # where the run is reported, not what it computes
        blob = json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:8]


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}


def _build(cls, raw: Any, path: str):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise JobError(path or "(top level)", raw, f"must be a mapping with keys {', '.join(_fields(cls))}")
    known = _fields(cls)
    values = {}
    for key, value in raw.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.5)
            hint = f"Did you mean {(path + '.' if path else '') + close[0]!r}?" if close else ""
            raise JobError(sub, value, f"unknown key; {path or 'the top level'} takes {', '.join(known)}", hint)
        f = known[key]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            values[key] = _build(f.default_factory, _shorthand(f.default_factory, value), sub)
        else:
            values[key] = f.metadata["check"](value, sub)
    return cls(**values)


def _shorthand(cls, value):
    """`model: mlp`, `loss: cross_entropy` and `loss: "mod:fn"` are short for the mapping form."""
    if isinstance(value, str) and cls in (ModelSpec, DataSpec, LossSpec):
        return {"entrypoint": value} if ":" in value else {"name": value}
    if isinstance(value, str) and cls is ScheduleSpec:  # `schedule: warmup_cosine`
        return {"name": value}
    return value
