"""Cells of the crossings table (docs/crossings.md) that no scenario test decided: a layout met by
an event, each a real run (the controller and its TrainWorkers, on the warm processes of
tests/process_workers.py) of a small model, against plain single-process PyTorch on the same
global batches.

Each cell is a few steps of a model whose blocks every layout can cut, shard or split: the
built-in MLP with four hidden layers (a pipeline cuts it at its blocks, tensor parallelism splits
its layers by the built-in plan). The events are the job's own settings (an evaluation schedule,
precision phases, micro-batches, recomputation, a resume under another layout, a micro-batch a
device cannot hold), so that a cell costs a run of a second or two and the table adds little to
the suite's time.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from gearshift.orchestrator.job import load_job
from test_eval import HELD_OUT, check_against_checkpoints
from test_train_equivalence import MLP, max_diff, reference, run_gearshift, step_losses

ROOT = pathlib.Path(__file__).resolve().parents[1]

# four hidden layers: the blocks a pipeline is cut at
DEEP = MLP[1] + ["model.kwargs={in_features: 784, hidden: 32, out_features: 10, layers: 4}",
                 "train.steps=8", "train.global_batch_size=16", "train.grad_clip=1.0"]
PIPE = ["parallel.strategy=pipeline", "parallel.pp_size=2"]
LAYOUTS = {
    "data": ["cluster.num_workers=2", "parallel.strategy=data"],
    "fsdp": ["cluster.num_workers=2", "parallel.strategy=fsdp"],
    "hsdp": ["cluster.num_workers=4", "parallel.strategy=hsdp", "parallel.shard_size=2"],
    "tensor": ["cluster.num_workers=2", "parallel.strategy=tensor"],
    "hybrid": ["cluster.num_workers=4", "parallel.strategy=hybrid", "parallel.tp_size=2"],
    "pipeline": ["cluster.num_workers=2", *PIPE, "parallel.pp_schedule=1f1b"],
    "interleaved": ["cluster.num_workers=2", *PIPE, "parallel.pp_schedule=interleaved_1f1b"],
    "pipeline_dp_shard": ["cluster.num_workers=4", *PIPE, "parallel.pp_schedule=1f1b", "parallel.dp_shard=true"],
    "pipeline_tp": ["cluster.num_workers=4", *PIPE, "parallel.pp_schedule=1f1b", "parallel.tp_size=2"],
}
PIPELINES = ("pipeline", "interleaved", "pipeline_dp_shard", "pipeline_tp")
# what a resume under another layout first clears of the layout before it
UNSET = ["parallel.pp_size=1", "parallel.pp_schedule=1f1b", "parallel.tp_size=null", "parallel.shard_size=null", "parallel.dp_shard=false"]
# tensor parallelism (and a sharded reduction) sums in another order: 1e-4, as the issue allows
TOLERANCE = {"tensor": 1e-4, "hybrid": 1e-4, "pipeline_tp": 1e-4, "fsdp": 1e-4, "hsdp": 1e-4,
             "pipeline_dp_shard": 1e-4}


def final_of(run: pathlib.Path) -> dict:
    return torch.load(run / "final.pt", weights_only=True)


def check_exact(overrides: list[str], run: pathlib.Path, layout: str) -> None:
    """The run's final weights and every step's loss against the plain loop of the same job."""
    ref, ref_losses = reference(load_job(MLP[0], overrides))
    tol = TOLERANCE.get(layout, 1e-5)
    diff = max_diff(final_of(run), ref)
    assert diff <= tol, f"{layout}: max |final - plain PyTorch| = {diff:.3g} > {tol:g}"
    losses = step_losses(run)
    assert sorted(losses) == list(range(1, len(ref_losses) + 1))  # no step lost, none counted twice
    worst = max(abs(losses[i + 1] - want) for i, want in enumerate(ref_losses))
    assert worst <= tol, f"{layout}: a step's loss differs from plain PyTorch's by {worst:.3g}"


def records(run: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in (run / "telemetry.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------- evaluation

@pytest.mark.parametrize("layout", [
    pytest.param("fsdp", marks=pytest.mark.crossing("evaluation", "fsdp")),
    pytest.param("hsdp", marks=pytest.mark.crossing("evaluation", "hsdp")),
])
def test_evaluation_between_steps_equals_the_plain_loss_of_that_steps_weights(local_workers, tmp_path, layout):
    """eval.every 4: each eval record is the plain loss of its step's checkpoint over the held-out
    data, and the evaluation leaves the training where plain PyTorch ends."""
    overrides = DEEP + LAYOUTS[layout] + ["eval.every=4", HELD_OUT, "checkpoint.every=4", "checkpoint.keep=3"]
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    evals = check_against_checkpoints(load_job(MLP[0], overrides), tmp_path / "run", 1e-4)
    assert [r["step"] for r in evals] == [4, 8]
    check_exact(overrides, tmp_path / "run", layout)


# ---------------------------------------------------------------- gradient accumulation

@pytest.mark.parametrize("layout", [
    pytest.param("fsdp", marks=pytest.mark.crossing("accumulation", "fsdp")),
    pytest.param("hsdp", marks=pytest.mark.crossing("accumulation", "hsdp")),
    pytest.param("pipeline", marks=pytest.mark.crossing("accumulation", "pipeline")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("accumulation", "pipeline_tp")),
])
def test_micro_batches_accumulated_equal_the_whole_batch(local_workers, tmp_path, layout):
    """train.micro_batch_size 2: each replica's share of 16 in passes of 2 rows, accumulated."""
    overrides = DEEP + LAYOUTS[layout] + ["train.micro_batch_size=2"]
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    check_exact(overrides, tmp_path / "run", layout)


# ---------------------------------------------------------------- activation checkpointing

@pytest.mark.parametrize("layout", [
    pytest.param("pipeline", marks=pytest.mark.crossing("recompute", "pipeline")),
    pytest.param("interleaved", marks=pytest.mark.crossing("recompute", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("recompute", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("recompute", "pipeline_tp")),
])
def test_recomputed_blocks_change_nothing_in_the_math(local_workers, tmp_path, layout):
    """train.activation_checkpointing true: each stage's blocks recomputed in backward; the run
    equals the plain loop without recomputation."""
    overrides = DEEP + LAYOUTS[layout] + ["train.activation_checkpointing=true"]
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    [starting] = [r for r in records(tmp_path / "run") if r.get("event") == "state" and r["state"] == "starting"]
    assert starting["recomputed"] >= 1, starting  # gearshift wrapped the stage's blocks (not the model's own)
    check_exact([o for o in overrides if "activation_checkpointing" not in o], tmp_path / "run", layout)


# ---------------------------------------------------------------- precision phases

@pytest.mark.parametrize("layout", [
    pytest.param("fsdp", marks=pytest.mark.crossing("precision", "fsdp")),
    pytest.param("hsdp", marks=pytest.mark.crossing("precision", "hsdp")),
    pytest.param("interleaved", marks=pytest.mark.crossing("precision", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("precision", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("precision", "pipeline_tp")),
])
def test_an_fp32_warmup_then_bf16_stays_close_to_fp32_and_is_not_it(local_workers, tmp_path, layout):
    """train.precision bf16 after 3 fp32 steps: fp32 master weights, close to the fp32 loop (the
    tolerance every layout's reduced precision has), never equal to it; the first 3 steps' losses
    are the fp32 loop's."""
    overrides = DEEP + LAYOUTS[layout]
    run_gearshift(MLP[0], overrides + ["train.precision={dtype: bf16, fp32_warmup_steps: 3}"], tmp_path / "run")
    ref, ref_losses = reference(load_job(MLP[0], overrides))
    final = final_of(tmp_path / "run")
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in final.values())
    diff = max_diff(final, ref)
    assert 1e-6 < diff <= 0.03, diff
    losses = step_losses(tmp_path / "run")
    assert max(abs(losses[s + 1] - ref_losses[s]) for s in range(3)) <= TOLERANCE.get(layout, 1e-5)


# ---------------------------------------------------------------- a checkpoint resumed under another layout

@pytest.mark.parametrize("layout", [
    pytest.param("hsdp", marks=pytest.mark.crossing("resume", "hsdp")),
    pytest.param("interleaved", marks=pytest.mark.crossing("resume", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("resume", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("resume", "pipeline_tp")),
])
def test_a_checkpoint_resumed_into_and_out_of_the_layout_ends_where_plain_pytorch_ends(local_workers, tmp_path,
                                                                                      layout):
    """Steps 1-3 under data, 4-6 under the layout (its checkpoint read from data's), 7-8 under
    data again (data's read from the layout's): the plain loop's weights at the end."""
    from gearshift.orchestrator.commands import cli

    run = tmp_path / "run"
    base = DEEP + ["checkpoint.every=1", "checkpoint.keep=2"]
    run_gearshift(MLP[0], base + LAYOUTS["data"] + ["train.steps=3"], run)
    for steps, there in ((6, layout), (8, "data")):
        sets = [a for o in UNSET + LAYOUTS[there] + [f"train.steps={steps}"] for a in ("--set", o)]
        assert cli.main(["run", "--resume", str(run), *sets]) == 0
    check_exact(base, run, layout)


@pytest.mark.parametrize("layout", ["pipeline", "interleaved", "pipeline_dp_shard", "pipeline_tp"])
def test_a_full_format_checkpoint_of_a_pipeline_is_streamed_and_resumes_under_data(local_workers, tmp_path, layout):
    """checkpoint.format full under each pipeline layout: rank 0 writes state.pt as each
    position's owner sends it a tensor at a time (strategies/pipeline/gather.py); the file holds
    the whole model and optimizer, by the plain model's names, and a run resumed from it under
    data ends where the plain loop ends."""
    from gearshift.orchestrator.commands import cli
    from gearshift.workers.state import checkpoint

    run = tmp_path / "run"
    base = DEEP + ["checkpoint.every=2", "checkpoint.keep=2", "checkpoint.format=full"]
    run_gearshift(MLP[0], base + LAYOUTS[layout] + ["train.steps=4"], run)
    newest = checkpoint.list_checkpoints(run / "checkpoints")[-1]
    manifest, _ = checkpoint.verify(newest)
    assert newest.name == "step_00000004" and list(manifest["files"]) == ["state.pt"], manifest
    saved = torch.load(newest / "state.pt", weights_only=True)
    plain, _ = reference(load_job(MLP[0], base + ["train.steps=4"]))
    assert set(saved["model"]) == set(plain) and set(saved["optimizer"]["state"]) == set(plain)
    assert max_diff(saved["model"], plain) <= TOLERANCE.get(layout, 1e-5)
    sets = [a for o in UNSET + LAYOUTS["data"] + ["train.steps=8"] for a in ("--set", o)]
    assert cli.main(["run", "--resume", str(run), *sets]) == 0
    check_exact(base, run, layout)


# ---------------------------------------------------------------- dropout

@pytest.mark.parametrize("layout,same_as", [
    pytest.param("fsdp", "data", marks=pytest.mark.crossing("dropout", "fsdp")),
    pytest.param("hsdp", "data4", marks=pytest.mark.crossing("dropout", "hsdp")),
])
def test_dropout_masks_follow_the_data_replica_under_sharding(local_workers, tmp_path, layout, same_as):
    """A GPT with dropout 0.3: a sharded layout's replicas draw the masks data parallelism's
    replicas of the same ranks draw (fsdp(2) has two, hsdp(2 x 2) four), so the runs end equal."""
    from test_train_equivalence import GPT

    layouts = {**LAYOUTS, "data4": ["cluster.num_workers=4", "parallel.strategy=data"]}
    base = GPT[1] + ["train.global_batch_size=8", "train.steps=6",
                     "model.kwargs={vocab_size: 128, block_size: 32, n_layer: 2, n_head: 4, n_embd: 64, dropout: 0.3}",
                     "train.random_per=replica"]  # torch's dropout, a stream per replica
    finals = []
    for name in (layout, same_as):
        run_gearshift(GPT[0], base + layouts[name], tmp_path / name)
        finals.append(final_of(tmp_path / name))
    assert max_diff(*finals) <= 1e-3  # as tensor(2) against tensor(1): dropout's scaling amplifies rounding


@pytest.mark.parametrize("layout", [
    pytest.param("interleaved", marks=pytest.mark.crossing("dropout", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("dropout", "pipeline_dp_shard")),
    "pipeline_tp",  # decided by test_strategies' streams; here the masks a tp group draws, in a run
])
def test_each_pipeline_position_and_replica_draws_masks_of_its_own_and_a_tp_group_one(local_workers, tmp_path,
                                                                                       layout):
    """Four residual blocks, each dropping half its input and writing down the mask it drew
    (tests/fixtures/mask_model.py), run 3 steps under the pipeline. No mask is drawn twice across
    positions (a stage after a cut), replicas and steps; the ranks of a tensor-parallel group draw
    the same masks, block for block; every block runs on every replica."""
    import shutil

    from gearshift.strategies.layout import Layout
    from test_oom import FIXTURES

    for name in ("mask_model.py", "oom_model.py"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    masks = tmp_path / "masks"
    masks.mkdir()
    pair = layout == "pipeline_tp"
    plan = ", tp_plan: {'blocks.*.up': colwise, 'blocks.*.down': rowwise}" if pair else ""
    (tmp_path / "job.yaml").write_text(
        "name: masks\n"
        f"model: {{entrypoint: 'mask_model:blocks', kwargs: {{record_dir: '{masks}', pair: {str(pair).lower()}}}}}\n"
        "data: {entrypoint: 'oom_model:points', kwargs: {size: 256}}\n"
        "loss: {entrypoint: 'oom_model:mse'}\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        "train: {steps: 3, global_batch_size: 16, seed: 7}\n"
        f"parallel: {{pp_microbatches: 2{plan}}}\n"
        "checkpoint: {every: 0}\n")
    summary = run_gearshift(tmp_path / "job.yaml", LAYOUTS[layout], tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 3
    workers = 2 if layout == "interleaved" else 4
    lines = {r: [json.loads(line) for line in (masks / f"rank{r}.jsonl").read_text().splitlines()]
             for r in range(workers)}
    shape = Layout.for_workers("pipeline", workers, 2 if pair else None, pp_size=2,
                               dp_shard=layout == "pipeline_dp_shard")
    # the steps' micro-batches (7: the build's seed, under which a pipeline traces the model on one
    # sample; the stage's own pass to learn its shapes, at its first step, draws on a forked generator)
    rows = 16 // shape.dp // 2
    drawn = {r: [d for d in got if d["seed"] != 7 and not d["shapes_pass"]] for r, got in lines.items()}
    assert all(d["rows"] == rows for got in drawn.values() for d in got)
    import importlib.util

    spec = importlib.util.spec_from_file_location("mask_fixture", FIXTURES / "mask_model.py")
    fixture = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fixture)

    for r, got in drawn.items():  # each step's first micro-batch draws the step's stream from its start,
        for seed in sorted({d["seed"] for d in got}):  # the first step's too (no pass drew before it)
            torch.manual_seed(seed)
            first = fixture.digest(torch.nn.functional.dropout(torch.ones(rows, 16), 0.5, True))
            assert next(d["mask"] for d in got if d["seed"] == seed) == first, (r, seed)
    seeds = {r: [d["seed"] for d in got] for r, got in drawn.items()}
    for group in shape.tp_groups():  # one activation a group: one mask, block for block
        assert all(drawn[r] == drawn[group[0]] for r in group), group
    firsts = [drawn[group[0]] for group in shape.tp_groups()]
    steps = [sorted(set(seeds[group[0]])) for group in shape.tp_groups()]
    assert all(len(s) == 3 for s in steps) and len({s for each in steps for s in each}) == 3 * len(steps), steps
    digests = [d["mask"] for records in firsts for d in records]
    assert len(digests) == 3 * 2 * 4 * shape.dp  # steps x micro-batches x blocks x replicas
    assert len(set(digests)) == len(digests), "a mask drawn twice"
    for replica in range(shape.dp):  # each replica runs every block, each block at one position
        held = [{d["block"] for d in drawn[r]} for r in range(workers) if shape.dp_rank(r) == replica]
        assert set().union(*held) == {0, 1, 2, 3}


# ---------------------------------------------------------------- out of memory

TP_PLAN = "parallel.tp_plan={layers.0: colwise, layers.2: rowwise}"  # the bounded MLP's Megatron pair


@pytest.mark.parametrize("layout,max_batch,extra", [
    pytest.param("tensor", 4, [TP_PLAN], marks=pytest.mark.crossing("oom", "tensor")),      # a share of 16
    pytest.param("hybrid", 4, [TP_PLAN], marks=pytest.mark.crossing("oom", "hybrid")),      # of 8
    pytest.param("hsdp", 2, [], marks=pytest.mark.crossing("oom", "hsdp")),                 # of 4
])
def test_a_share_that_does_not_fit_is_accumulated_and_the_run_equals_plain_pytorch(local_workers, tmp_path, layout,
                                                                                 max_batch, extra):
    """The bounded MLP (tests/fixtures/oom_model.py) runs out of memory on more than `max_batch`
    rows: the step is dropped and done again in halves until it fits, every rank on a new group
    with the layout it held, and the run ends where plain PyTorch ends."""
    from test_oom import check_equal, oom_job, records as oom_records

    job = oom_job(tmp_path, max_batch=max_batch)
    overrides = LAYOUTS[layout] + extra
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 6
    ooms = [r for r in oom_records(tmp_path / "run") if r.get("event") == "oom"]
    assert ooms and {r["action"] for r in ooms} == {"accumulate"}, ooms
    assert all(r["layout"]["strategy"] == layout for r in ooms)
    check_equal(job, overrides, tmp_path / "run", TOLERANCE.get(layout, 1e-5))


@pytest.mark.parametrize("layout", [
    pytest.param("interleaved", marks=pytest.mark.crossing("oom", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("oom", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("oom", "pipeline_tp")),  # each block's pair split
])
def test_a_pipeline_of_any_schedule_that_runs_out_of_memory_keeps_its_stages(local_workers, tmp_path, layout):
    """Six residual blocks that run out of memory on more than 2 rows, cut over 2 stages: the
    passes are halved until they fit, each rank keeping the stage it holds (six blocks deep at the
    end), and the run equals plain PyTorch."""
    from test_oom import check_equal, pipeline_oom_job, records as oom_records

    pair = {"pair": True} if layout == "pipeline_tp" else {}
    job = pipeline_oom_job(tmp_path, max_rows=2, batch=16, micro=2, **pair)
    overrides = LAYOUTS[layout]
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 4
    ooms = [r for r in oom_records(tmp_path / "run") if r.get("event") == "oom"]
    assert ooms and {r["action"] for r in ooms} == {"accumulate"}, ooms
    final = final_of(tmp_path / "run")
    assert {k.split(".")[1] for k in final if k.startswith("blocks.") and k.endswith(".weight")} == {
        str(i) for i in range(6)}, sorted(final)
    check_equal(job, overrides, tmp_path / "run", TOLERANCE.get(layout, 1e-5))


# ---------------------------------------------------------------- out of memory at a switch's commit

@pytest.mark.parametrize("layout,bound,pair,extra", [
    # data holds the whole model: the switch to tensor allocates its half beside it, more than fits
    pytest.param("data", 1000, "beside", [TP_PLAN], marks=pytest.mark.crossing("oom_switch", "data")),
    pytest.param("tensor", 3000, None, [TP_PLAN], marks=pytest.mark.crossing("oom_switch", "tensor")),
    pytest.param("hybrid", 3000, None, [TP_PLAN], marks=pytest.mark.crossing("oom_switch", "hybrid")),
    pytest.param("hsdp", 3000, None, [], marks=pytest.mark.crossing("oom_switch", "hsdp")),
    pytest.param("pipeline", 4000, False, [], marks=pytest.mark.crossing("oom_switch", "pipeline")),
    pytest.param("interleaved", 4000, False, [], marks=pytest.mark.crossing("oom_switch", "interleaved")),
    pytest.param("pipeline_dp_shard", 4000, False, [], marks=pytest.mark.crossing("oom_switch", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", 14000, True, [], marks=pytest.mark.crossing("oom_switch", "pipeline_tp")),
])
def test_a_switch_that_cannot_be_allocated_leaves_every_rank_on_its_layout(local_workers, tmp_path, layout, bound,
                                                                          pair, extra):
    """Rank 0 cannot hold more than `bound` parameters: the layout holds fewer (split, sharded or
    cut into stages), data parallelism's whole model is more (under data itself: the switch to
    tensor cannot allocate its half beside the whole model). The forced switch at step 3 runs out
    of memory at its commit point on rank 0; every rank stays on the layout it held, its state
    untouched, and the run ends where plain PyTorch ends."""
    from test_oom import check_equal, oom_job, pipeline_oom_job, records as oom_records

    if pair is None:  # the bounded MLP (tests/fixtures/oom_model.py), bounded at allocation and forward
        job = oom_job(tmp_path, max_params=bound, ranks=[0])
    elif pair == "beside":  # the bounded MLP, bounded at an allocation beside the layout in force
        job = oom_job(tmp_path, beside_max_params=bound, ranks=[0])
    else:  # the six residual blocks a pipeline cuts, bounded at allocation
        job = pipeline_oom_job(tmp_path, batch=16, micro=2, max_params=bound, ranks=[0], pair=pair)
    to = "tensor" if layout == "data" else "data"
    switch = f"adapt.schedule=[{{step: 3, strategy: {to}}}]"
    overrides = LAYOUTS[layout] + extra + [switch]
    summary = run_gearshift(job, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["strategy_history"][-1]["strategy"] == (
        "pipeline" if layout in PIPELINES else layout), summary["strategy_history"]
    [oom] = [r for r in oom_records(tmp_path / "run") if r.get("event") == "oom"]
    assert (oom["rank"], oom["step"], oom["during"], oom["action"], oom["layout"]["strategy"]) == (
        0, 3, "switch", "stay", to), oom
    assert not [r for r in oom_records(tmp_path / "run") if r.get("event") == "switch"]
    check_equal(job, overrides, tmp_path / "run", TOLERANCE.get(layout, 1e-5))
