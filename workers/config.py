"""What a worker is told about the job: one typed, frozen value, read from the resolved job
(the mapping the run dir's `job.yaml` holds) in one place.

The orchestrator validated every field before a worker started; this only picks what the
step loop needs and names it. Component specs (model, data, loss, optimizer) stay mappings:
they are what `gearshift.workers.build.components` builds from, the same on the driver and the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping


_CONSTANT = {"name": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0}
_IN_LOOP = {"workers": 0, "prefetch": 2, "pin_memory": "auto"}


@dataclass(frozen=True)
class WorkerConfig:
    name: str
    model: Mapping[str, Any]
    data: Mapping[str, Any]
    loss: Mapping[str, Any]
    optimizer: Mapping[str, Any]
    seed: int
    global_batch_size: int
    precision: str  # fp32 | bf16 | fp16
    grad_clip: float | None
    activation_checkpointing: bool | tuple[str, ...]  # train.activation_checkpointing (workers/build/recompute.py)
    strategy: str  # the layout training starts in (strategy auto starts data parallel)
    tp_size: int | None
    shard_size: int | None  # hsdp's group (None: resolved from the placement, see worker.build)
    dp_shard: bool  # hybrid: the data dimension sharded
    tp_plan: Mapping[str, str]
    fsdp_units: tuple[str, ...]  # parallel.fsdp_units: the FSDP units' patterns (empty: found)
    dp_overlap: bool  # parallel.dp_overlap: hybrid's data-parallel average overlaps backward
    bucket_cap_mb: float  # the value training starts with (bucket_cap_mb auto: the tuner's start)
    gpu: bool  # one GPU per worker; otherwise CPU and gloo
    telemetry: bool
    sample_period_s: float
    ray_metrics: bool
    on_nan: str  # skip | stop
    comm_delay_ms: float = 0.0  # the simulated network (workers/group/simnet.py)
    sim_nodes: int = 1
    sim_link: Mapping[str, float] | None = None
    sim_slow: Mapping[str, object] | None = None  # inject.slow: ranks computing `factor` times as long
    search_paths: tuple[str, ...] = field(default=(".",))
    micro_batch_size: int | None = None  # None: a rank's whole share of the global batch at once
    lr: float = 1e-3
    total_steps: int = 1  # T, for the learning-rate schedule
    schedule: Mapping[str, Any] = field(default_factory=lambda: dict(_CONSTANT))
    loader: Mapping[str, Any] = field(default_factory=lambda: dict(_IN_LOOP))
    fp32_warmup_steps: int = 0  # precision phases: updates before autocast starts
    keep_fp32: tuple[str, ...] = ()  # module patterns that compute in fp32 under autocast
    grad_check: Mapping[str, Any] | None = None  # train.grad_check: {every, explode_ratio}, or None
    fp32_final_steps: int = 0  # precision phases: the last updates computed in fp32 (all, or final_fp32's)
    final_fp32: tuple[str, ...] = ()  # module patterns switched to fp32 for those steps; (): the whole model
    compile: Mapping[str, Any] | None = None  # torch.compile options, or None
    eval_data: Mapping[str, Any] | None = None  # held-out data (eval.data) when eval.every > 0
    profile: tuple[int, int] | None = None  # train.profile: (start_step 1-based, steps), or None
    checkpoint_dir: str | None = None  # the run's checkpoints/ (every rank writes its shards there)
    checkpoint_format: str = "full"  # dcp: each rank writes its shards; full: rank 0 sends whole tensors
    checkpoint_options: Mapping[str, Any] = field(default_factory=dict)  # checkpoint.storage_options (fsspec)
    checkpoint_server: str | None = None  # the driver's FileServer actor, for nodes that do not see checkpoint_dir
    unshared_storage: bool = False  # inject.unshared_storage: act as if checkpoint_dir were not visible here
    feeders: Mapping[str, str] = field(default_factory=dict)  # streamed data, eval.data: feeder actor names
    # FSDP2's (param_dtype, reduce_dtype) under fsdp, hsdp and hybrid dp_shard; None: fp32 gathers
    # and reductions (see fsdp_mixed_precision)
    fsdp_mixed_precision: tuple[str, str] | None = None
    # strategy pipeline: {"microbatches", "schedule", "split", "pp_size"} (orchestrator/job/checks.py pp_microbatches)
    pipeline: Mapping[str, Any] = field(default_factory=dict)
    random_per: str = "sample"  # train.random_per: sample (workers/step/sample_masks.py) | replica

    @classmethod
    def from_job(cls, job: Mapping[str, Any], search_paths=(".",), checkpoint_dir: str | None = None,
                 feeders: Mapping[str, str] | None = None, checkpoint_server: str | None = None) -> "WorkerConfig":
        train, par, tel, inject = job["train"], job["parallel"], job["telemetry"], job["inject"]
        return cls(
            name=job["name"], model=job["model"], data=job["data"], loss=job["loss"], optimizer=job["optimizer"],
            seed=train["seed"], random_per=train.get("random_per", "sample"), global_batch_size=train["global_batch_size"], precision=_dtype(train["precision"]),
            grad_clip=train["grad_clip"], activation_checkpointing=_checkpointing(train.get("activation_checkpointing", False)),
            strategy="data" if par["strategy"] == "auto" else par["strategy"], tp_size=par.get("tp_size"),
            shard_size=par.get("shard_size"), dp_shard=bool(par.get("dp_shard", False)),
            checkpoint_dir=checkpoint_dir, checkpoint_format=(job.get("checkpoint") or {}).get("format", "auto"),
            checkpoint_options=dict((job.get("checkpoint") or {}).get("storage_options") or {}),
            tp_plan=par.get("tp_plan") or {}, fsdp_units=tuple(par.get("fsdp_units") or ()),
            dp_overlap=bool(par.get("dp_overlap", True)),
            bucket_cap_mb=job["tune"]["start"] if par["bucket_cap_mb"] == "auto" else par["bucket_cap_mb"],
            gpu=job["cluster"]["gpus_per_worker"] > 0, telemetry=tel["enabled"],
            sample_period_s=tel["sample_period_s"], ray_metrics=tel["ray_metrics"], on_nan=job["fault"]["on_nan"],
            comm_delay_ms=inject["comm_delay_ms"], sim_nodes=inject["nodes"], sim_link=inject.get("link"),
            sim_slow=inject.get("slow"),
            search_paths=tuple(search_paths), micro_batch_size=train.get("micro_batch_size"),
            lr=job["optimizer"]["lr"], total_steps=train["steps"],
            schedule=job["optimizer"].get("schedule") or dict(_CONSTANT),
            loader=job["data"].get("loader") or dict(_IN_LOOP),
            fp32_warmup_steps=_phases(train["precision"])[0], keep_fp32=_phases(train["precision"])[1],
            grad_check=train.get("grad_check"), fp32_final_steps=_final(train["precision"])[0], final_fp32=_final(train["precision"])[1],
            compile=train.get("compile") or None, eval_data=_eval_data(job), profile=_profile(train),
            checkpoint_server=checkpoint_server, unshared_storage=bool(inject.get("unshared_storage", False)),
            feeders=dict(feeders or {}),
            fsdp_mixed_precision=fsdp_mixed_precision(train["precision"], par.get("reduce_dtype", "fp32"))[0],
            pipeline=_pipeline(job))


def fsdp_mixed_precision(precision, reduce_dtype: str = "fp32") -> tuple[tuple[str, str] | None, str | None]:
    """The (param_dtype, reduce_dtype) FSDP2 shards with for train.precision, and a note for the
    run's start when bf16 is asked for but FSDP2 keeps fp32 gathers.

    bf16: parameters gathered in bf16 for forward and backward, reduced in `reduce_dtype`
    (parallel.reduce_dtype), the optimizer updating the fp32 shards. Not with precision phases:
    FSDP2's policy is fixed when a layout is built, and a layout built before the fp32 warm-up
    ends would compute those fp32 steps in bf16; a module kept in fp32 would get bf16 weights
    with its fp32 inputs. There, as with fp16 and fp32, the shards are gathered in fp32 and
    autocast computes in the job's dtype, as under the other layouts."""
    dtype = _dtype(precision)
    if dtype != "bf16":
        return None, None
    warmup, kept = _phases(precision)
    final = _final(precision)[0]
    if not warmup and not kept and not final:
        return ("bf16", reduce_dtype), None
    why = " and ".join(w for w in ("fp32_warmup_steps" if warmup else "", "keep_fp32" if kept else "",
                                   "fp32_final_steps" if final else "") if w)
    return None, (f"train.precision sets {why}: fsdp, hsdp and hybrid dp_shard gather parameters in fp32 and "
                  "compute under bf16 autocast for the whole run (FSDP2's bf16 gathers are fixed when a layout is "
                  "built, for every step and module); parallel.reduce_dtype does not apply")


def _checkpointing(setting) -> bool | tuple[str, ...]:
    return tuple(setting) if isinstance(setting, list) else bool(setting)


def _dtype(precision) -> str:
    """fp32, bf16 or fp16, whether the job gave the name or the phases."""
    return precision["dtype"] if isinstance(precision, Mapping) else precision


def _phases(precision) -> tuple[int, tuple[str, ...]]:
    if isinstance(precision, Mapping):
        return precision.get("fp32_warmup_steps", 0), tuple(precision.get("keep_fp32") or ())
    return 0, ()


def _final(precision) -> tuple[int, tuple[str, ...]]:
    if isinstance(precision, Mapping):
        return precision.get("fp32_final_steps", 0), tuple(precision.get("final_fp32") or ())
    return 0, ()


def _eval_data(job: Mapping[str, Any]) -> Mapping[str, Any] | None:
    ev = job.get("eval") or {}  # a run dir written before eval existed has no eval section
    return ev.get("data") if ev.get("every") else None


def _profile(train: Mapping[str, Any]) -> tuple[int, int] | None:
    p = train.get("profile")  # a run dir written before profiling existed has no train.profile
    return (p["start_step"], p["steps"]) if p else None


def _pipeline(job: Mapping[str, Any]) -> dict:
    """What a pipeline stage needs of the job: the micro-batches it names (None: resolved for
    the layout, workers/build/builder.py), the schedule and the cuts."""
    par = job["parallel"]
    return {"microbatches": par.get("pp_microbatches"), "schedule": par.get("pp_schedule", "1f1b"),
            "split": tuple(par.get("pp_split") or ()), "pp_size": par.get("pp_size")}
