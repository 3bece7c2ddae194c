"""The training loop a real job needs: learning-rate schedules, gradient accumulation and a loader
that reads ahead, each checked against plain single-process PyTorch on the same batches."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from torch.utils.data import default_collate

from gearshift.orchestrator.job import load_job
from test_train_equivalence import FIXTURES, MLP, max_diff, run_gearshift, step_losses
from gearshift.workers.build import components
from gearshift.workers.step import schedules
from gearshift.workers.step.data import GlobalBatches


def expected_lr(name: str, s: int, total: int, lr: float, warmup: int, m: float) -> float:
    """The schedules as the job file documents them, written out independently of gearshift's."""
    if s <= warmup:
        return lr * s / warmup
    if name == "constant":
        return lr
    frac = (s - warmup) / (total - warmup)
    if name == "linear":
        return lr * (1 - (1 - m) * frac)
    return lr * (m + (1 - m) * 0.5 * (1 + math.cos(math.pi * frac)))


@pytest.mark.parametrize("name", ["constant", "linear", "warmup_cosine"])
def test_schedules_follow_their_formula(name):
    total, lr, warmup, m = 50, 0.3, 7, 0.1
    got = [schedules.builtin(name, s, total, lr, warmup, m) for s in range(1, total + 1)]
    assert got == pytest.approx([expected_lr(name, s, total, lr, warmup, m) for s in range(1, total + 1)], rel=1e-12)
    assert got[warmup - 1] == pytest.approx(lr)  # the warm-up ends at the full rate
    if name != "constant":
        assert got[-1] == pytest.approx(m * lr)  # and the decay at min_lr_ratio x lr


def reference(job) -> tuple[dict, list[float], list[float]]:
    """Plain PyTorch: the whole global batch at once (accumulation changes nothing in the math),
    the learning rate of each update set by hand, clipping as torch does it."""
    spec, paths = job.to_dict(), [job.base_dir]
    torch.manual_seed(job.train.seed)
    model = components.build_model(spec["model"], paths)
    dataset = components.build_dataset(spec["data"], spec["model"], paths)
    loss_fn = components.build_loss(spec["loss"], paths)
    o, sched = job.optimizer, job.optimizer.schedule
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    order = GlobalBatches(len(dataset), job.train.global_batch_size, job.train.seed)
    losses, lrs = [], []
    for step in range(job.train.steps):
        x, y = default_collate([dataset[i] for i in order.indices(step)])
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.train.grad_clip)
        lr = expected_lr(sched.name, step + 1, job.train.steps, o.lr, sched.warmup_steps, sched.min_lr_ratio)
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        losses.append(loss.item())
        lrs.append(lr)
    return model.state_dict(), losses, lrs


LOOP = MLP[1] + ["train.steps=10", "train.global_batch_size=32", "train.grad_clip=0.5", "optimizer.lr=0.002",
                 "optimizer.schedule={name: warmup_cosine, warmup_steps: 3, min_lr_ratio: 0.1}"]
LAYOUTS = {
    "data": ["cluster.num_workers=2", "train.micro_batch_size=4"],  # 32 / (4 x 2): 4 micro-batches
    "tensor": ["cluster.num_workers=2", "parallel.strategy=tensor", "train.micro_batch_size=8"],  # 4
    "hybrid": ["cluster.num_workers=4", "parallel.strategy=hybrid", "parallel.tp_size=2",
               "train.micro_batch_size=8"],  # 32 / (8 x 2): 2
    # dp 4 -> 2 -> 1 -> 4 at the same micro-batch: 2, then 4, then 8, then 2 micro-batches a step
    "switching": ["cluster.num_workers=4", "train.micro_batch_size=4",
                  "adapt.schedule=[{step: 3, strategy: hybrid, tp_size: 2}, {step: 5, strategy: tensor}, "
                  "{step: 8, strategy: data}]"],
}


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.crossing("accumulation", "data")
@pytest.mark.crossing("accumulation", "tensor")
@pytest.mark.crossing("accumulation", "hybrid")
def test_schedule_accumulation_and_clipping_match_plain_pytorch(local_workers, tmp_path, layout):
    overrides = LOOP + LAYOUTS[layout]
    job = load_job(MLP[0], overrides)
    ref_state, ref_losses, ref_lrs = reference(job)
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    assert summary["status"] == "done"
    tol = 1e-5 if layout == "data" else 1e-4
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= tol
    losses = step_losses(tmp_path / "run")
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses)) <= tol
    steps = [r for r in records(tmp_path / "run") if r["type"] == "step"]
    assert [r["lr"] for r in steps] == pytest.approx(ref_lrs, rel=1e-9)
    if layout == "switching":
        assert [s["to"]["dp"] for s in summary["switches"]] == [2, 1, 4]
    if layout == "data":  # the first 3 micro-batches skip the all-reduce: 1-2 buckets a step, not 4+
        assert all(r["comm_calls"] <= 2 for r in steps), [r["comm_calls"] for r in steps]


def test_a_resume_landing_mid_schedule_ends_where_the_uninterrupted_run_ends(local_workers, tmp_path):
    base = LOOP + LAYOUTS["data"] + ["checkpoint.every=4", "checkpoint.keep=5"]
    run_gearshift(MLP[0], base, tmp_path / "whole")
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)  # the same run, stopped after step 4: inside the decay
    for path in (cut / "checkpoints").iterdir():
        if path.name != "step_00000004":
            shutil.rmtree(path)
    (cut / "final.pt").unlink()
    summary = run_gearshift(MLP[0], base, cut, "--resume")
    assert summary["resumed_from_step"] == 4
    a = torch.load(cut / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "whole" / "final.pt", weights_only=True)
    assert max_diff(a, b) == 0.0
    second_leg = [r["lr"] for r in records(cut) if r["type"] == "step"][-6:]
    assert second_leg == [r["lr"] for r in records(tmp_path / "whole") if r["type"] == "step"][-6:]


def test_a_users_schedule_function_sets_each_update(local_workers, tmp_path):
    shutil.copy(FIXTURES / "user_model.py", tmp_path / "user_model.py")
    shutil.copy(MLP[0], tmp_path / "mlp.yaml")
    run_gearshift(tmp_path / "mlp.yaml", MLP[1] + ["train.steps=6", "optimizer.lr=0.02",
                                                   "optimizer.schedule=user_model:half_then_quarter"], tmp_path / "run")
    assert [r["lr"] for r in records(tmp_path / "run") if r["type"] == "step"] == [0.01] * 3 + [0.005] * 3


def test_loader_processes_read_the_same_batches(local_workers, tmp_path):
    """The loader reads ahead in 2 processes and gives the very batches the step loop reads
    itself: the runs end bit for bit equal."""
    base = MLP[1] + ["train.steps=8", "cluster.num_workers=2"]
    run_gearshift(MLP[0], base, tmp_path / "inline")
    run_gearshift(MLP[0], base + ["data.loader={workers: 2, prefetch: 2}"], tmp_path / "ahead")
    a = torch.load(tmp_path / "inline" / "final.pt", weights_only=True)
    b = torch.load(tmp_path / "ahead" / "final.pt", weights_only=True)
    assert max_diff(a, b) == 0.0
    assert step_losses(tmp_path / "inline") == step_losses(tmp_path / "ahead")


# ---------------------------------------------------------------- precision phases and compile


def test_keep_fp32_modules_compute_in_fp32_under_autocast():
    from gearshift.workers.build.models import gpt
    from gearshift.workers.step.precision import keep_fp32

    torch.manual_seed(0)
    model = gpt(n_layer=1, n_embd=32, n_head=4, block_size=8)
    kept = keep_fp32(model, ["*ln*", "tok_emb"], "cpu")
    assert set(kept) == {n for n, _ in model.named_modules() if "ln" in n} | {"tok_emb"}
    dtypes = {}
    for name, module in model.named_modules():
        if name in ("tok_emb", "blocks.0.ln1", "blocks.0.attn.q"):
            module.register_forward_hook(lambda m, a, out, name=name: dtypes.__setitem__(name, out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 128, (2, 8)))
    assert dtypes == {"tok_emb": torch.float32, "blocks.0.ln1": torch.float32, "blocks.0.attn.q": torch.bfloat16}


@pytest.mark.crossing("precision", "data")
def test_fp32_warmup_covering_every_step_equals_fp32(local_workers, tmp_path):
    from test_train_equivalence import reference as plain

    overrides = MLP[1] + ["train.steps=6", "train.precision={dtype: bf16, fp32_warmup_steps: 6, keep_fp32: [hidden.0]}"]
    ref_state, _ = plain(load_job(MLP[0], overrides))
    run_gearshift(MLP[0], overrides, tmp_path / "all-fp32")
    final = torch.load(tmp_path / "all-fp32" / "final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-5
    # the same phases with the warm-up over after 3 steps: bf16 from step 4 on changes the numbers
    run_gearshift(MLP[0], MLP[1] + ["train.steps=6", "train.precision={dtype: bf16, fp32_warmup_steps: 3}"],
                  tmp_path / "bf16-after-3")
    later = torch.load(tmp_path / "bf16-after-3" / "final.pt", weights_only=True)
    assert 1e-6 < max_diff(later, ref_state) < 0.03


def test_the_final_fp32_phase_trains_those_steps_as_fp32_does(local_workers, tmp_path):
    """bf16 for steps 1-3, fp32 for 4-6: the run's end equals plain fp32 PyTorch continuing from the
    run's own checkpoint at step 3 (its weights and momentum), and the bf16 steps before differ
    from fp32 training."""
    from test_train_equivalence import continued, reference as plain
    from test_elastic import SGD

    from gearshift.workers.state import dcp

    phases = "train.precision={dtype: bf16, fp32_final_steps: 3}"
    overrides = MLP[1] + SGD + ["train.steps=6", "checkpoint.every=3", phases]
    run_gearshift(MLP[0], overrides, tmp_path / "run")
    final = torch.load(tmp_path / "run" / "final.pt", weights_only=True)
    state = dcp.load_full(tmp_path / "run" / "checkpoints" / "step_00000003")
    assert max_diff(final, continued(load_job(MLP[0], overrides), state, 3, 6)) <= 1e-5
    fp32_at_3, _ = plain(load_job(MLP[0], MLP[1] + SGD + ["train.steps=3"]))
    assert max_diff(state["model"], fp32_at_3) > 1e-5  # the steps before the phase ran in bf16
    # the phase covering every step is fp32 training
    every = MLP[1] + SGD + ["train.steps=4", "train.precision={dtype: bf16, fp32_final_steps: 4, final_fp32: []}"]
    run_gearshift(MLP[0], every, tmp_path / "all")
    ref_state, _ = plain(load_job(MLP[0], every))
    assert max_diff(torch.load(tmp_path / "all" / "final.pt", weights_only=True), ref_state) <= 1e-5


def test_final_fp32_modules_switch_to_fp32_only_in_the_final_phase():
    from gearshift.workers.build.models import gpt
    from gearshift.workers.step.precision import fp32_when

    torch.manual_seed(0)
    model = gpt(n_layer=1, n_embd=32, n_head=4, block_size=8)
    final = {"on": False}
    assert fp32_when(model, ["head"], "cpu", lambda: final["on"]) == ["head"]
    dtypes = []
    model.head.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, 128, (2, 8)))
        final["on"] = True
        model(torch.randint(0, 128, (2, 8)))
    assert dtypes == [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("layout", [[], ["parallel.strategy=tensor"],
                                    ["adapt.schedule=[{step: 2, strategy: tensor}]"]],  # compiled again
                         ids=["data", "tensor", "switch"])
@pytest.mark.crossing("compile", "data")
@pytest.mark.crossing("compile", "tensor")
def test_compile_stays_within_1e_4_of_eager(local_workers, tmp_path, layout):
    from test_train_equivalence import reference as plain

    overrides = MLP[1] + ["train.steps=4", "train.compile=true", *layout]
    ref_state, ref_losses = plain(load_job(MLP[0], overrides))
    summary = run_gearshift(MLP[0], overrides, tmp_path / "run")
    assert summary["status"] == "done"
    [starting] = [r for r in records(tmp_path / "run") if r.get("event") == "state" and r["state"] == "starting"]
    assert all(w["compiled"] for w in starting["workers"])  # torch.compile's wrapper is what forward runs
    assert max_diff(torch.load(tmp_path / "run" / "final.pt", weights_only=True), ref_state) <= 1e-4
    losses = step_losses(tmp_path / "run")
    assert max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses)) <= 1e-4


def test_a_killed_worker_mid_schedule_with_accumulation_ends_where_an_uninterrupted_run_ends(local_workers, tmp_path):
    """The learning rate, accumulation and the loader's position all come back after a worker
    is SIGKILLed mid-run and the group restarts from the last checkpoint."""
    from test_fault import SLOW, Killer, events

    overrides = MLP[1] + SLOW + ["cluster.num_workers=2", "train.micro_batch_size=8", "train.global_batch_size=32",
                                 "optimizer.schedule={name: warmup_cosine, warmup_steps: 10, min_lr_ratio: 0.1}",
                                 "data.loader={workers: 1, prefetch: 2}", "train.grad_clip=0.5"]
    killer = Killer(tmp_path / "killed", rank=1, at_step=15, checkpointed=10)
    killer.start()
    summary = run_gearshift(MLP[0], overrides, tmp_path / "killed")
    killer.join(timeout=5)
    assert killer.killed and summary["status"] == "done" and len(events(tmp_path / "killed", "restored")) == 1
    # where an uninterrupted run ends: the plain loop (test_schedule_accumulation_and_clipping_match_plain_pytorch)
    ref_state, _, ref_lrs = reference(load_job(MLP[0], overrides))
    assert max_diff(torch.load(tmp_path / "killed" / "final.pt", weights_only=True), ref_state) <= 1e-5
    lrs = {r["step"]: r["lr"] for r in records(tmp_path / "killed") if r["type"] == "step"}
    assert [lrs[s] for s in sorted(lrs)] == pytest.approx(ref_lrs, rel=1e-9) and sorted(lrs) == list(range(1, 41))
