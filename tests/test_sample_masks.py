"""Dropout masks per sample (train.random_per: sample, workers/step/sample_masks.py): a sample's
masks follow the sample, not the process or the micro-batch that computes it, so every layout, and
a run switched between layouts mid-way, ends where the plain loop ends when that loop draws the
same masks (tests/test_train_equivalence.py reference). The first tests need no workers."""

from __future__ import annotations

import pathlib
import shutil

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from gearshift.monitoring.telemetry import read
from gearshift.orchestrator.job import load_job
from gearshift.strategies import rows as sample_rows
from gearshift.workers.build import recompute
from gearshift.workers.step import sample_masks
from test_crossing_cells import LAYOUTS, TOLERANCE
from test_train_equivalence import max_diff, reference, run_gearshift

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _dropped(module, x, seed, step, lo):
    with sample_rows.rows(seed, step, sample_rows.places(lo, lo + len(x))):
        return module(x)


def test_a_samples_mask_is_the_same_however_the_rows_are_cut():
    drop = sample_masks.SampleDropout(0.4, False, key=11, name="drop").train()
    x = torch.randn(12, 3, 5)
    whole = _dropped(drop, x, 0, 5, 0)
    halves = torch.cat([_dropped(drop, x[:6], 0, 5, 0), _dropped(drop, x[6:], 0, 5, 6)])
    uneven = torch.cat([_dropped(drop, part, 0, 5, lo) for part, lo in ((x[:1], 0), (x[1:8], 1), (x[8:], 8))])
    torch.manual_seed(123)  # the process's generator plays no part
    assert torch.equal(whole, halves) and torch.equal(whole, uneven)
    assert torch.equal(whole, _dropped(drop, x, 0, 5, 0))
    # survivors scaled by 1 / (1 - p), as torch's dropout scales them
    kept = whole != 0
    assert torch.allclose(whole[kept], x[kept] / 0.6)
    # another step, seed, place or module draws another mask
    for other in (_dropped(drop, x, 0, 6, 0), _dropped(drop, x, 1, 5, 0), _dropped(drop, x, 0, 5, 12),
                  _dropped(sample_masks.SampleDropout(0.4, False, key=12, name="other").train(), x, 0, 5, 0)):
        assert not torch.equal(other != 0, kept)


def test_hashing_in_chunks_draws_the_same_mask(monkeypatch):
    """A large dropped tensor is hashed CHUNK elements at a time (bounded scratch memory); the
    chunks change nothing, down to a piece of one row (a row here is 300 elements)."""
    drop = sample_masks.SampleDropout(0.3, False, key=5, name="drop").train()
    x = torch.randn(64, 3, 100)
    whole = _dropped(drop, x, 1, 2, 0)
    for chunk in (1000, 10):
        monkeypatch.setattr(sample_masks, "CHUNK", chunk)
        assert torch.equal(_dropped(drop, x, 1, 2, 0), whole)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_each_element_is_kept_with_probability_one_minus_p_independently(p):
    drop = sample_masks.SampleDropout(p, False, key=3, name="drop").train()
    kept = (_dropped(drop, torch.ones(1024, 256), 7, 2, 0) != 0).float()
    n = kept.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(kept.mean().item() - (1 - p)) < 6 * sigma
    # neighbouring samples and neighbouring elements are uncorrelated
    for a, b in ((kept[:-1], kept[1:]), (kept[:, :-1], kept[:, 1:])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].item()
        assert abs(corr) < 6 / n ** 0.5, corr


def test_p_one_drops_everything_as_torchs_dropout_does():
    drop = sample_masks.SampleDropout(1.0, False, key=2, name="drop").train()
    x = torch.randn(3, 4, requires_grad=True)
    out = _dropped(drop, x, 0, 0, 0)
    assert torch.equal(out, torch.zeros_like(x))
    out.sum().backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_outside_a_step_it_is_torchs_dropout_and_in_evaluation_nothing():
    drop = sample_masks.SampleDropout(0.5, False, key=1, name="drop")
    x = torch.randn(4, 6)
    torch.manual_seed(0)
    want = nn.functional.dropout(x, 0.5, True)
    torch.manual_seed(0)
    assert torch.equal(drop.train()(x), want)
    with sample_rows.rows(0, 0, sample_rows.places(0, 4)):
        assert torch.equal(drop.eval()(x), x)


def test_the_build_swaps_dropout_by_name_and_leaves_the_rest():
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.2), nn.Sequential(nn.Dropout(0.0), nn.Dropout2d(0.3),
                                                                         nn.Dropout(0.1)))
    assert sample_masks.per_sample(model) == ["1", "2.2"]
    assert isinstance(model[1], sample_masks.SampleDropout) and model[1].p == 0.2
    assert type(model[2][0]) is nn.Dropout and type(model[2][1]) is nn.Dropout2d  # p = 0; not nn.Dropout
    assert model[1].key != model[2][2].key
    assert list(model.state_dict()) == ["0.weight", "0.bias"]


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.calls = nn.Linear(6, 6), nn.Dropout(0.5), 0

    def forward(self, x):
        self.calls += 1
        return torch.tanh(self.drop(self.fc(x)))


class _Net(nn.Module):
    def __init__(self, own_checkpoint: bool = False):
        super().__init__()
        self.body, self.out, self.own_checkpoint = _Body(), nn.Linear(6, 1), own_checkpoint

    def forward(self, x):
        return self.out(checkpoint(self.body, x, use_reentrant=False) if self.own_checkpoint else self.body(x))


def _grads(model, x):
    with sample_rows.rows(0, 3, sample_rows.places(0, len(x))):
        loss = model(x).square().sum()
    loss.backward()  # outside the rows, as a step's backward is
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_recomputation_in_backward_draws_the_forwards_masks():
    torch.manual_seed(0)
    plain, wrapped = _Net(), _Net()
    wrapped.load_state_dict(plain.state_dict())
    for m in (plain, wrapped):
        assert sample_masks.per_sample(m) == ["body.drop"]
    assert recompute.apply(wrapped, ["body"]) == ["body"]
    x = torch.randn(8, 6)
    want, got = _grads(plain, x), _grads(wrapped, x)
    assert all(torch.equal(want[n], got[n]) for n in want)
    assert wrapped.body.calls == 2 and plain.body.calls == 1  # forward, then again in backward


def test_a_models_own_checkpoint_is_refused_in_backward_not_given_other_masks():
    model = _Net(own_checkpoint=True)
    sample_masks.per_sample(model)
    with pytest.raises(RuntimeError, match="'body.drop' ran again in backward .* train.activation_checkpointing"):
        _grads(model, torch.randn(8, 6))


def test_a_samples_augmentation_is_the_same_whoever_reads_it():
    """A map-style dataset that adds fresh noise on every read (tests/fixtures/inspected.py): under
    random_per: sample a step's rows read by one replica, by two, or by uneven shares are the same
    rows; read from one stream per replica (replica) they are not."""
    import sys

    sys.path.insert(0, str(FIXTURES))
    from inspected import jittered

    from gearshift.workers.step.data import GlobalBatches
    from gearshift.workers.step.loader import StepBatches

    data = jittered(64)
    order = GlobalBatches(len(data), 16, seed=3)

    def read(per_sample, dp, shares=None):
        return torch.cat([StepBatches(data, order, r, dp, 3, shares, per_sample=per_sample)[5][0] for r in range(dp)])

    one = read(True, 1)
    assert torch.equal(read(True, 2), one) and torch.equal(read(True, 2, (5, 11)), one)
    assert torch.equal(read(True, 4), one)
    assert not torch.equal(read(False, 2), read(False, 1))  # one stream per replica: other noise


# --- runs: every layout, and a switch, against the plain loop with the same masks ----------------

def _job(tmp_path, layout: str, steps: int = 4, max_batch: int | None = None,
         micro_batch: int | None = 4) -> tuple[pathlib.Path, list[str]]:
    for name in ("dropout_blocks.py", "inspected.py"):
        shutil.copy(FIXTURES / name, tmp_path / name)
    pair = "true" if layout in ("tensor", "hybrid", "pipeline_tp") else "false"
    plan = ", tp_plan: {'blocks.*.up': colwise, 'blocks.*.down': rowwise}" if pair == "true" else ""
    (tmp_path / "job.yaml").write_text(
        "name: dropout\n"
        f"model: {{entrypoint: 'dropout_blocks:blocks', kwargs: {{pair: {pair}, max_batch: {max_batch or 'null'}}}}}\n"
        "data: {entrypoint: 'inspected:jittered', kwargs: {size: 256}}\n"  # fresh noise on every read
        "loss: mse\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        f"train: {{steps: {steps}, global_batch_size: 16, seed: 7}}\n"
        + (f"parallel: {{{plan[2:]}}}\n" if plan else "")
        + "checkpoint: {every: 0}\n")
    # a micro-batch of 4: each replica's share cut again (accumulation, or a pipeline's passes)
    piped = ["parallel.pp_microbatches=2"] if "parallel.strategy=pipeline" in LAYOUTS[layout] else []
    micro = [f"train.micro_batch_size={micro_batch}"] if micro_batch else []
    return tmp_path / "job.yaml", LAYOUTS[layout] + piped + micro


@pytest.mark.parametrize("layout", [
    pytest.param("data", marks=pytest.mark.crossing("dropout_sample", "data")),
    pytest.param("fsdp", marks=pytest.mark.crossing("dropout_sample", "fsdp")),
    pytest.param("hsdp", marks=pytest.mark.crossing("dropout_sample", "hsdp")),
    pytest.param("tensor", marks=pytest.mark.crossing("dropout_sample", "tensor")),
    pytest.param("hybrid", marks=pytest.mark.crossing("dropout_sample", "hybrid")),
    pytest.param("pipeline", marks=pytest.mark.crossing("dropout_sample", "pipeline")),
    pytest.param("interleaved", marks=pytest.mark.crossing("dropout_sample", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("dropout_sample", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("dropout_sample", "pipeline_tp")),
])
def test_every_layout_draws_the_plain_loops_masks(local_workers, tmp_path, layout):
    """Four residual blocks, each dropping 30 % of its input, on data that adds fresh noise to
    every sample it reads, trained under the layout with its shares cut into micro-batches: the
    run ends where the plain loop ends on the same batches with the same per-sample masks and
    noise. (torch's dropout, drawn per replica and position, ends elsewhere:
    the last test.)"""
    job_file, overrides = _job(tmp_path, layout)
    summary = run_gearshift(job_file, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 4
    ref, _ = reference(load_job(job_file, overrides))
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= TOLERANCE.get(layout, 1e-5)


@pytest.mark.crossing("dropout_sample", "data")
@pytest.mark.crossing("dropout_sample", "pipeline")
def test_a_run_switched_into_a_pipeline_and_out_draws_what_one_that_never_switched_draws(local_workers, tmp_path):
    """data(2) -> pipeline(2 stages, 2 micro-batches) at step 3 -> data at step 6, with dropout in
    every block and fresh noise on every sample read: the run equals the plain loop (so, one that
    never switched). With
    train.random_per: replica the same schedule ends elsewhere: after the switch the second
    stage's blocks draw from another stream than data parallelism's replica did."""
    job_file, overrides = _job(tmp_path, "data", steps=8)
    schedule = "adapt.schedule=[{step: 3, strategy: pipeline, pp_size: 2}, {step: 6, strategy: data}]"
    ref, _ = reference(load_job(job_file, overrides))
    summary = run_gearshift(job_file, overrides + [schedule], tmp_path / "sample")
    assert [s["strategy"] for s in summary["strategy_history"]] == ["data", "pipeline", "data"]
    assert max_diff(torch.load(tmp_path / "sample" / "final.pt", weights_only=True), ref) <= 1e-5

    replica = overrides + ["train.random_per=replica"]
    run_gearshift(job_file, replica, tmp_path / "fixed")
    run_gearshift(job_file, replica + [schedule], tmp_path / "switched")
    fixed, switched = (torch.load(tmp_path / n / "final.pt", weights_only=True) for n in ("fixed", "switched"))
    assert max_diff(fixed, switched) > 1e-3


def test_a_share_halved_after_running_out_of_memory_draws_the_same_masks(local_workers, tmp_path):
    """data(2), each share 8 rows, more than 4 at once out of memory: step 1 is dropped and done
    again in 2 micro-batches of 4, and the run equals the plain loop (which never ran out), masks
    and noise included: a sample's draws do not follow the micro-batch it is computed in."""
    job_file, overrides = _job(tmp_path, "data", steps=4, max_batch=4, micro_batch=None)
    summary = run_gearshift(job_file, overrides, tmp_path / "run")
    assert summary["status"] == "done" and summary["steps_done"] == 4
    ooms = [r for r in read(tmp_path / "run" / "telemetry.jsonl") if r.get("event") == "oom"]
    assert ooms and {(r["action"], r["micro_batch"]) for r in ooms} == {("accumulate", 8)}
    ref, _ = reference(load_job(job_file, overrides))
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref) <= 1e-5
