"""Out of memory, survived: a step that runs out of memory on any rank is dropped on every rank and
done again, with more accumulation or a more sharded layout, and the run ends where plain
single-process PyTorch ends on the same global batches. The model (tests/fixtures/oom_model.py)
raises torch.OutOfMemoryError as a device would when a rank's micro-batch or the parameters it
holds whole pass a bound."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch

import gearshift
from gearshift.orchestrator.job import load_job
from test_train_equivalence import max_diff, reference, run_gearshift, step_losses

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def oom_job(tmp_path: pathlib.Path, **bounds) -> pathlib.Path:
    shutil.copy(FIXTURES / "oom_model.py", tmp_path / "oom_model.py")
    kwargs = ", ".join(f"{k}: {json.dumps(v)}" for k, v in {"width": 64, **bounds}.items())
    job = tmp_path / "oom.yaml"
    job.write_text(
        "name: oom\n"
        f"model: {{entrypoint: 'oom_model:build', kwargs: {{{kwargs}}}}}\n"
        "data: {entrypoint: 'oom_model:points', kwargs: {size: 256}}\n"
        "loss: {entrypoint: 'oom_model:mse'}\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        "train: {steps: 6, global_batch_size: 16}\n"
        "cluster: {num_workers: 2, cpus_per_worker: 1}\n"
        "checkpoint: {every: 0}\n")
    return job


def records(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]


def check_equal(job_file, overrides, run, tol):
    ref_state, ref_losses = reference(load_job(job_file, overrides))
    final = torch.load(run / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= tol, max_diff(final, ref_state)
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, len(ref_losses) + 1))  # no step lost, none counted twice
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses)) <= tol


@pytest.mark.crossing("oom", "data")
def test_a_batch_that_does_not_fit_moves_to_accumulation_at_the_first_step(local_workers, tmp_path):
    """Each rank's share is 8 samples; more than 4 at once runs out of memory. Step 1 is dropped,
    done again 4 at a time (2 micro-batches), and the run equals plain PyTorch."""
    job = oom_job(tmp_path, max_batch=4)
    summary = run_gearshift(job, [], tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 6
    ooms = [r for r in records(tmp_path / "run") if r.get("event") == "oom"]
    assert {r["rank"] for r in ooms} == {0, 1} and {r["step"] for r in ooms} == {1}
    assert {(r["action"], r["micro_batch"]) for r in ooms} == {("accumulate", 8)}
    assert all(r["allocated_bytes"] > 0 and "test bound" in r["error"] for r in ooms)
    check_equal(job, [], tmp_path / "run", 1e-5)


@pytest.mark.crossing("oom", "fsdp")
def test_a_model_only_a_sharded_layout_fits_moves_there(local_workers, tmp_path):
    """Data parallelism holds all 4866 parameters on a rank; the bound is 3000. Halving the
    micro-batch cannot help (8, 4, 2, 1 all run out), so the run moves to fsdp, which holds about
    half, and ends equal to plain PyTorch."""
    job = oom_job(tmp_path, max_params=3000)
    summary = run_gearshift(job, [], tmp_path / "run")
    assert summary["status"] == "done" and summary["strategy_history"][-1]["strategy"] == "fsdp"
    actions = [(r["action"], r["micro_batch"], r["layout"]["strategy"]) for r in records(tmp_path / "run")
               if r.get("event") == "oom" and r["rank"] == 0]
    assert actions == [("accumulate", 8, "data"), ("accumulate", 4, "data"), ("accumulate", 2, "data"),
                       ("shard", 1, "data")], actions
    [switch] = [r for r in records(tmp_path / "run") if r.get("event") == "switch"]
    assert (switch["step"], switch["reason"], switch["to"]["strategy"]) == (0, "oom", "fsdp")
    check_equal(job, [], tmp_path / "run", 1e-4)


def test_an_oom_on_one_rank_only_is_survived_the_same_way(local_workers, tmp_path):
    """Only rank 1 runs out; rank 0 is blocked in the gradient all-reduce when rank 1 leaves the
    group, drops its step too, and both go on at step 1 with half the micro-batch."""
    job = oom_job(tmp_path, max_batch=4, ranks=[1])
    summary = run_gearshift(job, [], tmp_path / "run")
    assert summary["status"] == "done"
    ooms = [r for r in records(tmp_path / "run") if r.get("event") == "oom"]
    assert [(r["rank"], r["step"], r["action"]) for r in ooms] == [(1, 1, "accumulate")]
    check_equal(job, [], tmp_path / "run", 1e-5)


@pytest.mark.crossing("oom_switch", "fsdp")
def test_an_oom_in_the_middle_of_a_switch_returns_to_the_previous_layout(local_workers, tmp_path):
    """On fsdp each rank holds about half the parameters; a forced switch to data at step 3 must
    allocate them whole, which rank 0 cannot. Every rank stays on fsdp, whole, and the run ends
    equal to plain PyTorch."""
    job = oom_job(tmp_path, max_params=3000, ranks=[0])
    overrides = ["parallel.strategy=fsdp", "adapt.schedule=[{step: 3, strategy: data}]"]
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["strategy_history"][-1]["strategy"] == "fsdp"
    [oom] = [r for r in records(tmp_path / "run") if r.get("event") == "oom"]
    assert (oom["rank"], oom["step"], oom["during"], oom["action"], oom["layout"]["strategy"]) == (
        0, 3, "switch", "stay", "data")
    assert not [r for r in records(tmp_path / "run") if r.get("event") == "switch"]
    check_equal(job, overrides, tmp_path / "run", 1e-4)


def test_on_oom_fail_stops_with_one_paragraph_naming_the_step_the_rank_and_the_memory(local_workers, tmp_path):
    job = oom_job(tmp_path, max_batch=4, ranks=[1])
    with pytest.raises(gearshift.RunFailed) as err:
        gearshift.run(job, overrides={"train.on_oom": "fail"}, run_dir=tmp_path / "run")
    text = str(err.value)
    assert "Out of memory at step 1 on rank 1" in text and "GiB allocated" in text, text
    assert "train.on_oom is fail" in text and "\n" not in text.strip()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "failed"


def pipeline_oom_job(tmp_path: pathlib.Path, batch: int, micro: int, **bounds) -> pathlib.Path:
    """Six residual blocks (oom_model.blocks) bounded by `bounds` (max_rows, max_params, ranks), cut
    over 2 stages; `pair=True` gives each block a Megatron pair and the job its tp plan."""
    shutil.copy(FIXTURES / "oom_model.py", tmp_path / "oom_model.py")
    kwargs = ", ".join(f"{k}: {json.dumps(v)}" for k, v in bounds.items())
    plan = "tp_plan: {'blocks.*.up': colwise, 'blocks.*.down': rowwise}, " if bounds.get("pair") else ""
    job = tmp_path / "pipe_oom.yaml"
    job.write_text(
        "name: pipe-oom\n"
        f"model: {{entrypoint: 'oom_model:blocks', kwargs: {{{kwargs}}}}}\n"
        "data: {entrypoint: 'oom_model:points', kwargs: {size: 256}}\n"
        "loss: {entrypoint: 'oom_model:mse'}\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        f"train: {{steps: 4, global_batch_size: {batch}}}\n"
        f"parallel: {{strategy: pipeline, pp_size: 2, pp_microbatches: {micro}, {plan}pp_schedule: 1f1b}}\n"
        "cluster: {num_workers: 2, cpus_per_worker: 1}\n"
        "checkpoint: {every: 0}\n")
    return job


@pytest.mark.crossing("oom", "pipeline")
def test_a_pipeline_that_runs_out_of_memory_keeps_its_stages_and_cuts_each_pass_evenly(local_workers, tmp_path):
    """Six residual blocks cut 3 + 3 over 2 workers; a block runs out of memory on more than 1 row.
    The share of 24 flows in 4 micro-batches of 6 rows: out of memory; then passes of 12 (4 x 3),
    of 6 (4 does not divide it: 3 x 2) and of 3 (3 x 1), which fits. Each rank keeps the stage it
    holds on the new group (no block re-cut: the model stays six blocks deep), and the run equals
    plain PyTorch."""
    job = pipeline_oom_job(tmp_path, max_rows=1, batch=24, micro=4)
    summary = run_gearshift(job, [], tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 4
    ooms = [(r["micro_batch"], r["action"]) for r in records(tmp_path / "run") if r.get("event") == "oom"
            and r["rank"] == 0]
    assert [m for m, _ in ooms] == [24, 12, 6] and {a for _, a in ooms} == {"accumulate"}, ooms
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert sum(k.startswith("blocks.") and k.endswith(".lin.weight") for k in final) == 6
    check_equal(job, [], tmp_path / "run", 1e-5)
