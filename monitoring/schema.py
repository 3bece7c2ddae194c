"""The telemetry record schema: what each line of `telemetry.jsonl` holds.

One source of truth for the writers (controller, workers), the readers (`gearshift watch`,
`gearshift report`, the policy) and `docs/telemetry.md`; `validate` is what the tests hold
real records to. Times are seconds, sizes bytes, fractions 0..1, percentages 0..100. With
`telemetry.enabled: false` the timing fields of step records (data, compute, comm wait) are null.
"""

from __future__ import annotations

from typing import Any

NUM = (int, float)
OPT_NUM = (int, float, type(None))

# name -> (allowed types, meaning). Every field listed is present in every record of its type.
COMMON = {
    "type": (str, "'step', 'sample', 'eval' or 'event'"),
    "time": (NUM, "wall-clock time the record was made (Unix seconds)"),
}

STEP = {
    "step": (int, "optimizer steps completed, counting from 1"),
    "strategy": (str, "the layout the step ran under: data, tensor or hybrid"),
    "dp": (int, "data-parallel degree"),
    "tp": (int, "tensor-parallel degree"),
    "bucket_cap_mb": (NUM, "DDP gradient bucket size in force"),
    "ended_at": (OPT_NUM, "wall clock (Unix seconds) when rank 0 finished the step; `time` is when the "
                          "controller merged it"),
    "loss": (NUM, "loss over the whole global batch (mean of the ranks' losses)"),
    "lr": (OPT_NUM, "the learning rate of this step's update (optimizer.schedule)"),
    "step_time_max": (NUM, "step time of the slowest rank: the step's wall time"),
    "step_time_mean": (NUM, "step time averaged over ranks"),
    "slowest_rank": (int, "the rank with the longest step time"),
    "data_time_mean": (OPT_NUM, "time loading the batch and moving it to the device, mean over ranks"),
    "data_time_max": (OPT_NUM, "the same, slowest rank"),
    "compute_time_mean": (OPT_NUM, "step time minus comm wait minus data time, mean over ranks"),
    "comm_wait_mean": (OPT_NUM, "comm wait (time blocked on collectives), mean over ranks"),
    "comm_wait_max": (OPT_NUM, "comm wait of the rank that waited longest"),
    "comm_wait_frac_mean": (OPT_NUM, "comm wait / step time, mean over ranks"),
    "comm_wait_frac_max": (OPT_NUM, "comm wait / step time, largest over ranks"),
    "comm_calls": (int, "collectives timed on one rank in this step (buckets for data)"),
    "comm_hidden_mean": (OPT_NUM, "seconds the data-parallel all-reduces ran behind backward instead of being "
                                  "waited for, mean over ranks (hybrid's overlapped average, host-timed on CPU); "
                                  "null where not measured"),
    "comm_hidden_frac_mean": (OPT_NUM, "the share of those all-reduces' time hidden behind backward: hidden / "
                                       "(hidden + the wait for them after backward), mean over ranks; null where "
                                       "not measured"),
    "bubble_frac_mean": (OPT_NUM, "pipeline: the share of the step a stage's comm wait was idle for lack of work "
                                  "(the schedule's bubble), mean over ranks; null under other layouts"),
    "link_wait_frac_mean": (OPT_NUM, "pipeline: the share of the step a stage waited on the link (activations and "
                                     "their gradients in transfer), mean over ranks; null under other layouts"),
    "samples_per_s": (NUM, "global batch / step_time_max"),
    "tokens_per_s": (OPT_NUM, "samples_per_s x tokens per sample, for sequence models; else null"),
    "peak_mem_bytes": (OPT_NUM, "peak memory of the rank that used most since its previous report (device "
                                 "memory on GPU, the process's resident set on CPU; on CPU outside Linux the "
                                 "process's lifetime peak); null if unknown"),
    "ranks": (dict, "per-rank lists indexed by rank: step_time, data_time, compute_time, comm_wait, "
                    "comm_wait_frac, samples_per_s (the rank's samples over its step time; the timing lists are "
                    "null when telemetry is off), share (the rank's samples of the step: its data-parallel "
                    "replica's), speed (its samples over its compute time: what tells a straggler; null when telemetry "
                    "is off); under a pipeline also bubble and link_wait, seconds"),
}
STEP_RANK_LISTS = ("step_time", "data_time", "compute_time", "comm_wait", "comm_wait_frac", "samples_per_s")

SAMPLE = {
    "rank": (int, "the worker the reading is from"),
    "node_ip": (str, "the worker's node"),
    "source": (str, "'nvml' (NVIDIA GPU through nvidia-ml-py) or 'psutil' (host without one)"),
    "device": (str, "what was read: 'cuda:N <name>' or 'cpu'"),
    "util_pct": (OPT_NUM, "GPU utilisation (nvml) or this worker process's CPU use (psutil), percent"),
    "mem_used_bytes": (OPT_NUM, "GPU memory used (nvml) or the worker's resident memory (psutil)"),
    "mem_total_bytes": (OPT_NUM, "GPU memory total (nvml) or host memory total (psutil)"),
    "power_w": (OPT_NUM, "board power draw in watts (nvml); null for psutil"),
    "sm_clock_mhz": (OPT_NUM, "SM clock (nvml); null for psutil"),
    "host_cpu_pct": (OPT_NUM, "whole-host CPU use, percent (psutil); null for nvml"),
}

EVAL = {
    "step": (int, "the step boundary evaluated at: the model after that many optimizer steps"),
    "loss": (NUM, "mean loss over the held-out samples (eval.data), the training loss function, under "
                  "the layout in force and the run's precision"),
    "perplexity": (OPT_NUM, "exp(loss) when the targets are token ids (a language model); else null"),
    "samples": (int, "held-out samples evaluated (eval.batches batches of train.global_batch_size, the last "
                     "possibly short)"),
    "batches": (int, "eval batches evaluated"),
    "seconds": (NUM, "wall time of the evaluation, as the controller saw it"),
    "strategy": (str, "the layout evaluated under: data, tensor or hybrid"),
    "dp": (int, "data-parallel degree (the held-out batches are split over the dp ranks)"),
    "tp": (int, "tensor-parallel degree"),
}

EVENT = {
    "event": (str, "what happened; see EVENTS"),
}
EVENTS = {
    "state": "the controller entered a state (field `state`: placing, starting, training, switching, finishing, done, failed; "
             "`error` when failed; `workers`, `layout`, `tp_groups` and `fsdp_units` (how the FSDP units were "
             "found: `found_by`, `count`, `first`, `note`) and `build` (`on_meta`: whether the ranks built the model on "
             "the meta device and allocated only their pieces; `why` when a sharded layout could not) and `recomputed` (how many modules "
             "train.activation_checkpointing wrapped) and `checkpoint_format` (dcp: every rank writes its shards; full: "
             "gathered, as some worker cannot reach the checkpoints' place) when starting)",
    "resumed": "training continues from a checkpoint (`checkpoint`, `step`)",
    "pretrained": "model.pretrained's weights were read into the laid-out model before the first step (`path`, "
                  "`prefix`, `tensors`, `seconds`: the slowest rank's; `rank_bytes`: the bytes each rank read and "
                  "holds; `device`: each rank's memory after the load: allocated_bytes, reserved_bytes, free_bytes, "
                  "total_bytes)",
    "checkpoint": "a checkpoint was written (`step`, `path`)",
    "best": "checkpoint.keep_best: the checkpoint of `step` has the lowest eval loss so far (`eval_loss`, "
            "`path`); checkpoints/best.json names it and pruning keeps it",
    "startup": "the path from the command to the first step (`stages`: [{stage, at, took}] in seconds since the "
               "command's process started: imports, job, ray, placement, workers, rendezvous, build, first_step; "
               "`seconds`: to the first step)",
    "sampler": "which device sampler a worker uses (`rank`, `source`, `reason` when it fell back to psutil)",
    "metrics": "the /metrics endpoint is serving (`url`)",
    "policy": "the adaptive policy's set-up (`candidates` in order, `node_sizes`, `threshold`, `window`, `cooldown`, "
              "`decide`: predict or trial; `start`: where strategy auto started, with `available_bytes` and every "
              "candidate's `predictions`)",
    "oom": "a step or a switch ran out of memory on a rank (`rank`, `step`, `during`: step or switch, `layout` and "
           "`micro_batch` it ran out at, `allocated_bytes`, `reserved_bytes`, `free_bytes`, `total_bytes`, `error`, "
           "`action`: accumulate, shard, retry, stay or stop, `to_layout`, `to_micro_batch`, `why`)",
    "decision": "an automatic decision with its evidence (`step` = `seen_step`: the step whose record brought it, "
                "`applied_step`: the step boundary it was carried out at, null when it was not; `decision`: switch, revert, keep (a switch "
                "that helped), hold (over the threshold or after a change of the link, no move predicted to "
                "pay), straggler or input_bound, rebalance (adapt.stragglers: `shares` from the applied step on, one count "
                "per data-parallel replica; `evidence`: the slow `replica`, its first `rank`, `node` and `device`, "
                "`speed_ratio`, `since_step`, every replica's `speeds` (samples per second of compute) and "
                "`compute_s`, `shares_before`, `shares_after`, `measured_step_s`, `predicted_step_s`, "
                "`predicted_gain`, `noise`), rebalanced (a window after it: `measured_step_s` against "
                "`predicted_step_s`); `to` for switch/revert; `evidence`: window means, threshold, "
                "`reason` (comm_wait, link_changed, review), every candidate's `predictions`, the gain over "
                "`steps_left` against `switch_cost_s`, the fitted `model`; after a move, throughput "
                "before/after with `noise_samples_per_s`, `steps_before`, `steps_judged`, and `predicted_step_s` "
                "against `measured_step_s`; `reason` memory_pressure: `peak_mem_bytes` against "
                "`device_memory_bytes`)",
    "switch": "the layout changed (`step`, `from`, `to`, `seconds`, `reason`: schedule, switch, revert or tune)",
    "tune_start": "a bucket_cap_mb tuning round begins (`step`, `mode`: search or grid, `space`, `pinned`, "
                  "`layout`, `warmup_steps`, `trial_steps`, `max_trials`)",
    "tune_trial": "one setting was timed (`step`, `setting`, `score` in samples/s, `steps` timed, `step_time`, "
                  "`comm_wait_frac`)",
    "tuned": "a tuning round ended (`step`, `started`, `mode`, `layout`, `best` trial, every one of its `trials`)",
    "tune_abandoned": "a layout switch cut a tuning round short (`step`, `started`, `trials` so far)",
    "bucket": "bucket_cap_mb changed on the running workers (`step`, `bucket_cap_mb`, `previous`, `seconds`)",
    "failure": "a worker died, went silent or lost a collective's peer (`step` reached, `rank`, `kind`: died, silent "
               "or raised, `error`, `failures` so far, `max_failures`, `lost_nodes`, `action` taken, "
               "`steps_to_recompute`)",
    "restored": "a new worker group restarted from a checkpoint after a failure (`checkpoint`, `step`)",
    "recovered": "the first step trained after a failure (`step`, `restored_step`, `seconds_since_detected`, "
                 "`steps_recomputed`, `world_size`)",
    "profile": "train.profile's window ended on a rank and its files were written under RUN_DIR/profile/ (`rank`, "
               "`trace`: the Chrome/Perfetto trace, `table`: top operators and modules by time and memory, `steps`: "
               "[first, last] profiled update, 1-based)",
    "tracking": "an experiment tracker (`tracker`: mlflow or tensorboard) at the start (`status`: started, with "
                "`uri` and the MLflow `run_id`; unreachable or connecting, with `error`: training goes on and records "
                "are buffered and retried) and at the end (`status`: done or incomplete; `sent`, `unsent` and "
                "`dropped` records, `artifacts` sent or not, the last `error`)",
    "module_memory": "rank 0's memory by module on its first update, the `top` three modules by their own bytes "
                     "(each: `module`, `type`, `bytes`, `parameters`, `gradients`, `optimizer`, `activations` kept "
                     "for backward); `step`, `rank` (not under train.compile)",
    "rollback": "fault.on_nan rollback went back to a checkpoint after nan_patience non-finite steps (`step` reached, "
                "`to_step`, `checkpoint`, `bad_steps`, `lr` from now on, `previous_lr`, `rollbacks` so far, `action`; "
                "with `checkpoint` null and action stop when none came before the first bad step)",
    "grad_anomaly": "train.grad_check found a parameter's gradient norm NaN/Inf or `explode_ratio` times its own "
                    "median (`step`, `kind`: nonfinite or explode, `module`, `module_type`, `parameter`, `norm`, "
                    "`median`, `ratio`, `loss`, `lr`, `suggestions`: what the evidence supports, `samples`: the "
                    "batch's sample indices on rank 0 when the loss jumped with it, else null)",
    "non_finite": "a step's loss or gradient norm was NaN or Inf: its update was not applied and its batch skipped "
                  "(`step`, `loss`, `grad_norm`, `layer`: the first module whose output was not finite, `action`; where a fused optimizer skipped it on the device, `checked` says so and `grad_norm` and `layer` are null)",
}

BY_TYPE = {"step": STEP, "sample": SAMPLE, "eval": EVAL, "event": EVENT}


def validate(record: Any) -> list[str]:
    """What is wrong with `record` as a telemetry record; [] when it conforms."""
    if not isinstance(record, dict):
        return [f"record is {type(record).__name__}, not an object"]
    kind = record.get("type")
    if kind not in BY_TYPE:
        return [f"type = {kind!r} is not one of {sorted(BY_TYPE)}"]
    problems = []
    for name, (types, _) in {**COMMON, **BY_TYPE[kind]}.items():
        if name not in record:
            problems.append(f"{kind}: missing field {name!r}")
        elif isinstance(record[name], bool) or not isinstance(record[name], types):
            problems.append(f"{kind}: {name} = {record[name]!r} has type {type(record[name]).__name__}")
    if kind == "step" and isinstance(record.get("ranks"), dict):
        for name in STEP_RANK_LISTS:
            values = record["ranks"].get(name, "missing")
            if name in ("step_time", "samples_per_s") and values is None:
                problems.append(f"step: ranks.{name} is null")
            elif values is not None and (not isinstance(values, list) or not all(isinstance(v, NUM) for v in values)):
                problems.append(f"step: ranks.{name} = {values!r} is not a list of numbers")
    return problems
