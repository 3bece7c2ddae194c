"""Ray Datasets streamed to the workers (data.ray_dataset, data.read): training equals plain
PyTorch, the order is fixed by the seed alone, resume and switches land on the exact sample,
and bad data is a one-paragraph error before any worker starts."""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest
import torch

from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import load_job
from gearshift.workers.build import components

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
pytestmark = [pytest.mark.ray]

ROWS = 96
JOB = """\
name: streamed
model: {entrypoint: 'streamed:model'}
data: {ray_dataset: 'streamed:ray_style', kwargs: {size: 96}, input: x, target: label, shuffle_buffer: 40}
loss: cross_entropy
optimizer: {name: sgd, lr: 0.1}
train: {steps: 8, global_batch_size: 96}
checkpoint: {every: 0}
cluster: {num_workers: 2}
"""


@pytest.fixture(autouse=True)
def _fixture_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))


def job_file(tmp_path: pathlib.Path, text: str = JOB) -> pathlib.Path:
    shutil.copy(FIXTURES / "streamed.py", tmp_path / "streamed.py")
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def run(job, run_dir, *overrides, extra=()) -> dict:
    args = ["run", str(job), "--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    assert cli.main(args + list(extra)) == 0
    return json.loads((run_dir / "summary.json").read_text())


def final(run_dir) -> dict:
    return torch.load(run_dir / "final.pt", weights_only=True)


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def full_batch_reference(job, x, y, steps: int) -> dict:
    """Plain single-process PyTorch: the same model, every step on the whole data."""
    torch.manual_seed(job.train.seed)
    model = components.build_model(job.to_dict()["model"], [job.base_dir])
    opt = torch.optim.SGD(model.parameters(), lr=job.optimizer.lr)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model.state_dict()


# one worker is an extended variant (make test-extended): two split the same stream, and equal the same reference
@pytest.mark.parametrize("workers", [pytest.param(1, marks=pytest.mark.extended), 2])
def test_a_ray_dataset_trains_like_single_process_pytorch(ray_cluster, tmp_path, workers):
    from streamed import tensors  # noqa: E402  (copied next to the job by job_file)

    path = job_file(tmp_path)
    summary = run(path, tmp_path / "run", f"cluster.num_workers={workers}")
    assert summary["status"] == "done" and summary["world_size"] == workers
    x, y = tensors(size=ROWS)
    ref = full_batch_reference(load_job(path), x, y, steps=8)
    assert max_diff(final(tmp_path / "run"), ref) <= 1e-5
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    [startup] = [r for r in records if r.get("event") == "startup"]
    stages = [s["stage"] for s in startup["stages"]]
    assert stages[0] == "imports" and stages[-1] == "first_step" and "build" in stages, stages
    assert all(s["took"] >= 0 for s in startup["stages"]) and startup["seconds"] == startup["stages"][-1]["at"]


def test_same_seed_is_bit_equal_and_the_worker_count_does_not_change_the_batches(ray_cluster, tmp_path):
    path = job_file(tmp_path)
    small = ["train.global_batch_size=16", "train.steps=10"]
    run(path, tmp_path / "a", *small)
    run(path, tmp_path / "b", *small)
    a, b = final(tmp_path / "a"), final(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a), "two runs with the same seed differ"
    run(path, tmp_path / "one", *small, "cluster.num_workers=1")
    assert max_diff(a, final(tmp_path / "one")) <= 1e-5  # same batches; only the sum's order differs


def test_resume_after_one_and_a_half_passes_equals_the_uninterrupted_run(ray_cluster, tmp_path):
    path = job_file(tmp_path)
    # 6 steps a pass; the checkpoint at step 9 is in the middle of the second pass
    base = ["train.global_batch_size=16", "train.steps=15", "checkpoint.every=9", "checkpoint.keep=3"]
    run(path, tmp_path / "whole", *base)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "whole", cut)  # the same run, stopped after its checkpoint at step 9
    for ckpt in (cut / "checkpoints").iterdir():
        if ckpt.name != "step_00000009":
            shutil.rmtree(ckpt)
    (cut / "final.pt").unlink()
    summary = run(path, cut, *base, extra=["--resume"])
    assert summary["resumed_from_step"] == 9
    assert max_diff(final(tmp_path / "whole"), final(cut)) <= 1e-6


def _steps_seen(log_dir: pathlib.Path) -> list[list[list[int]]]:
    """Per process, per loss call (one a step), the ids it computed on."""
    return [[[int(i) for i in line.split()] for line in f.read_text().splitlines()]
            for f in sorted(log_dir.glob("*.ids"))]


def test_a_switch_that_changes_dp_mid_pass_keeps_every_sample_once_a_pass(ray_cluster, tmp_path):
    path = job_file(tmp_path, JOB.replace("loss: cross_entropy", "loss: {entrypoint: 'streamed:logged'}")
                    .replace("input: x, target: label", "input: x, target: id"))
    common = ["train.global_batch_size=16", "train.steps=18"]
    logs = {}
    for name, extra in (("switched", ["adapt.schedule=[{step: 4, strategy: tensor}, {step: 13, strategy: data}]",
                                      "parallel.tp_plan={'0': colwise, '2': rowwise}"]),
                        ("plain", [])):
        log_dir = tmp_path / f"{name}-ids"
        log_dir.mkdir()
        run(path, tmp_path / name, *common, *extra, f"loss.kwargs={{log_dir: '{log_dir}'}}")
        logs[name] = _steps_seen(log_dir)
    events = [json.loads(line) for line in (tmp_path / "switched" / "telemetry.jsonl").read_text().splitlines()]
    switches = [e["step"] for e in events if e.get("event") == "switch"]
    assert switches == [4, 13], f"the schedule's switches: {switches}"

    a, b = logs["switched"]
    assert len(a) == len(b) == 18
    per_step = []
    for s in range(18):
        if 4 <= s < 13:  # tensor parallel (dp 1): both ranks compute the whole batch
            assert a[s] == b[s] and len(a[s]) == 16
            per_step.append(sorted(a[s]))
        else:  # data parallel (dp 2): each rank half of it
            assert len(a[s]) == len(b[s]) == 8 and not set(a[s]) & set(b[s])
            per_step.append(sorted(a[s] + b[s]))
    for p in range(3):  # 6 steps a pass
        seen = sorted(i for s in range(6 * p, 6 * p + 6) for i in per_step[s])
        assert seen == list(range(ROWS)), f"pass {p} did not see every sample exactly once"
    plain = [sorted(x + y) for x, y in zip(*logs["plain"], strict=True)]
    assert per_step == plain, "the switch changed which samples a step trains on"
    assert per_step[:6] != per_step[6:12], "each pass is shuffled afresh"


def test_read_parquet_trains_like_single_process_pytorch(ray_cluster, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from streamed import tensors

    x, y = tensors(size=ROWS)
    folder = tmp_path / "parquet"
    folder.mkdir()
    for i, lo in enumerate(range(0, ROWS, 40)):  # three files, as a list column (a plain Arrow writer's)
        xs = x[lo:lo + 40].numpy()
        pq.write_table(pa.table({"features": pa.array(list(xs), type=pa.list_(pa.float32())),
                                 "label": pa.array(y[lo:lo + 40].numpy())}), folder / f"part-{i}.parquet")
    path = job_file(tmp_path, JOB.replace(
        "{ray_dataset: 'streamed:ray_style', kwargs: {size: 96}, input: x, target: label, shuffle_buffer: 40}",
        "{read: parquet, paths: 'parquet/*.parquet', input: features, target: label}"))
    summary = run(path, tmp_path / "run")
    assert summary["status"] == "done"
    ref = full_batch_reference(load_job(path), x, y, steps=8)
    assert max_diff(final(tmp_path / "run"), ref) <= 1e-5


def test_eval_data_may_be_a_ray_dataset(ray_cluster, tmp_path):
    path = job_file(tmp_path)
    base = ["train.global_batch_size=16", "train.steps=6", "eval.every=3"]
    run(path, tmp_path / "ray", *base, "eval.data={ray_dataset: 'streamed:ray_style', "
        "kwargs: {size: 40, seed: 5}, input: x, target: label}")
    run(path, tmp_path / "map", *base, "eval.data={entrypoint: 'streamed:map_style', kwargs: {size: 40, seed: 5}}")

    def evals(d):
        recs = [json.loads(line) for line in (d / "telemetry.jsonl").read_text().splitlines()]
        return {e["step"]: e["loss"] for e in recs if e.get("type") == "eval" or e.get("event") == "eval"}

    ray_evals, map_evals = evals(tmp_path / "ray"), evals(tmp_path / "map")
    assert sorted(ray_evals) == sorted(map_evals) and len(ray_evals) >= 2
    assert all(abs(ray_evals[s] - map_evals[s]) <= 1e-6 for s in ray_evals)


@pytest.mark.parametrize("data,expect", [
    ("{ray_dataset: 'streamed:not_a_dataset', input: x, target: label}",
     ["data.ray_dataset", "must return a ray.data.Dataset", "list"]),
    ("{ray_dataset: 'streamed:ray_style', input: pixels, target: label}",
     ["data.input", "'pixels'", "not a column", "x, label, id"]),
    ("{ray_dataset: 'streamed:empty', input: x, target: label}", ["data", "empty", "0 rows"]),
    ("{read: parquet, paths: 'nowhere/*.parquet', input: x, target: y}", ["data.paths", "matches no file"]),
])
def test_bad_streamed_data_is_one_paragraph_and_exit_2(ray_cluster, tmp_path, capsys, data, expect):
    import ray

    path = job_file(tmp_path)
    code = cli.main(["run", str(path), "--run-dir", str(tmp_path / "run"), "--set", f"data={data}"])
    # lines that Ray forwards from other tests' actors being torn down ("(TrainWorker pid=...)")
    # share this process's stderr; gearshift's own output is the rest
    err = "\n".join(x for x in capsys.readouterr().err.splitlines() if "pid=" not in x)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "Traceback" not in err and all(e in line for e in expect), line
    assert not [a for a in ray.util.list_named_actors() if a.startswith("gearshift-")], "a feeder was left running"


def test_the_stream_from_any_step_is_the_stream_from_the_start(ray_cluster):
    """Resume, recovery and a dp change start the stream at a step: it must read exactly what an
    uninterrupted stream has there, also when a batch straddles two passes (50 rows, batch 16)."""
    from streamed import ray_style

    from gearshift.workers.step.streaming import Stream

    ds = ray_style(size=50, blocks=4)
    stream = Stream(ds, 50, "x", "id", batch=16, seed=3, shuffle_buffer=20)
    whole = []
    for step, _, ids in stream.batches(0):
        whole.append(ids.tolist())
        if step == 11:
            break
    flat = [i for b in whole for i in b]
    passes = [flat[p * 50:(p + 1) * 50] for p in range(3)]
    assert all(sorted(p) == list(range(50)) for p in passes), "a pass is a permutation of the rows"
    assert passes[0] != passes[1] != passes[2] and passes[0] != list(range(50)), "each pass shuffled afresh"
    for start in (1, 3, 4, 7):  # 3 and 6..7 straddle a pass boundary
        got = []
        for step, _, ids in stream.batches(start):
            got.append(ids.tolist())
            if step == start + 2:
                break
        assert got == whole[start:start + 3], f"the stream from step {start} differs"
    again = Stream(ray_style(size=50, blocks=4), 50, "x", "id", batch=16, seed=3, shuffle_buffer=20)
    assert next(iter(again.batches(0)))[2].tolist() == whole[0], "the same seed gives the same order"
    other = Stream(ray_style(size=50, blocks=4), 50, "x", "id", batch=16, seed=4, shuffle_buffer=20)
    assert next(iter(other.batches(0)))[2].tolist() != whole[0], "another seed gives another order"


def test_columns_become_tensors_torch_losses_take():
    from gearshift.workers.step.streaming import to_arrays

    batch = {"a": np.arange(3, dtype=np.float64), "b": np.ones(3, dtype=np.float64), "y": np.arange(3, dtype=np.int32),
             "img": np.full((3, 4, 5, 3), 255, dtype=np.uint8)}
    x, y = to_arrays(batch, ["a", "b"], "y")  # CSV features: columns stacked, float32
    assert x.shape == (3, 2) and x.dtype == np.float32 and x[2, 0] == 2 and y.dtype == np.int64
    x, _ = to_arrays(batch, "img", "y")  # images: C x H x W in [0, 1]
    assert x.shape == (3, 3, 4, 5) and x.dtype == np.float32 and x.max() == 1.0
    lists = {"f": np.array([np.zeros(4), np.ones(4), np.ones(4)], dtype=object), "y": np.zeros(3)}
    x, y = to_arrays(lists, "f", "y")  # a column of arrays (a list column): stacked
    assert x.shape == (3, 4) and y.dtype == np.float32


@pytest.mark.parametrize("data,expect", [
    ("{ray_dataset: 'streamed:ray_style', input: x}", ["data.target", "is required with a Ray Dataset"]),
    ("{ray_dataset: 'streamed:ray_style', read: parquet, input: x, target: y}", ["either ray_dataset", "or read"]),
    ("{name: chars, read: csv, paths: x.csv, input: x, target: y}", ["map-style", "not both"]),
    ("{entrypoint: 'streamed:map_style', input: x}", ["data.input", "applies to a Ray Dataset"]),
    ("{read: parquet, input: x, target: y}", ["data.paths", "is required with read"]),
    ("{read: feather, paths: x, input: x, target: y}", ["data.read", "'feather'", "'parquet'"]),
    ("{ray_dataset: 'streamed:nothing_here', input: x, target: y}", ["data.ray_dataset", "nothing_here"]),
    ("{ray_dataset: 'streamed:ray_style', input: x, target: y, loader: {workers: 2}}", ["data.loader.workers"]),
])
def test_streamed_data_mistakes_found_when_the_job_loads(tmp_path, data, expect):
    from gearshift.orchestrator.job import JobError

    path = job_file(tmp_path)
    with pytest.raises(JobError) as err:
        load_job(path, [f"data={data}"])
    assert all(e in str(err.value) for e in expect), str(err.value)


def test_a_killed_worker_recovers_at_the_exact_sample(ray_cluster, tmp_path):
    """A worker SIGKILLed mid-pass: the run restores the last checkpoint, the stream restarts at
    its step, and the run ends where an uninterrupted one ends."""
    from test_fault import Killer, events

    path = job_file(tmp_path)
    slow = ["train.global_batch_size=16", "train.steps=40", "checkpoint.every=10", "inject.comm_delay_ms=30",
            "fault.max_failures=2"]
    run(path, tmp_path / "clean", *slow)
    killer = Killer(tmp_path / "killed", rank=1, at_step=15, checkpointed=10)
    killer.start()
    summary = run(path, tmp_path / "killed", *slow)
    killer.join(timeout=5)
    assert killer.killed, f"the worker was never killed ({killer.error!r})"
    assert summary["status"] == "done" and summary["steps_done"] == 40
    [restored] = events(tmp_path / "killed", "restored")
    assert restored["step"] % 6, "the restored step is inside a pass (6 steps a pass)"
    assert max_diff(final(tmp_path / "clean"), final(tmp_path / "killed")) <= 1e-6


def test_read_images_labels_each_file_by_its_folder(ray_cluster, tmp_path):
    from PIL import Image

    from gearshift.workers.step.streaming import Stream, build_ray_dataset

    for label, (name, shade) in enumerate((("cat", 40), ("dog", 200))):
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (6, 4), (shade, shade, shade)).save(tmp_path / "images" / name / f"{i}.png")
    spec = {"read": "images", "paths": "images", "input": "image", "target": "label", "kwargs": {}}
    ds = build_ray_dataset(spec, [str(tmp_path)])
    [(step, x, y)] = list(Stream(ds, 6, "image", "label", batch=6, seed=0, shuffle_buffer=0, cycle=False).batches(0))
    assert x.shape == (6, 3, 4, 6) and x.dtype == np.float32 and y.dtype == np.int64
    for image, label in zip(x, y, strict=True):  # cat (0) is dark, dog (1) light: the label follows the folder
        assert round(float(image.mean()) * 255) == (40, 200)[label]
    assert sorted(y.tolist()) == [0, 0, 0, 1, 1, 1]


def test_a_slice_travels_in_pieces_small_enough_to_come_back_inline(ray_cluster):
    """A rank's slice is cut into pieces under Ray's inline limit, so it never passes through
    the shared object store (whose mapped pages would count in a worker's memory), and joined
    again it is the slice itself."""
    from gearshift.workers.step.streaming import PIECE_BYTES, Feeder, _joined, parts_for

    spec = {"ray_dataset": "streamed:ray_style", "kwargs": {"size": 96}, "input": "x", "target": "label",
            "shuffle_buffer": 40}
    feeder = Feeder(spec, [str(FIXTURES)], batch=96, seed=0, cycle=True, ahead=4)
    assert feeder.describe()["row_bytes"] == 8 * 4 + 8
    whole = feeder.take(1, 10, 58)
    pieces = feeder.take(1, 10, 58, parts=5)
    assert len(pieces) == 5 and all(len(y) in (9, 10) for _, y in pieces)
    x, y = _joined(list(pieces), 5)
    assert np.array_equal(x, whole[0]) and np.array_equal(y, whole[1])
    assert parts_for(512, 4096 + 8) == -(-512 * 4104 // PIECE_BYTES) and parts_for(10, 8) == 1
    assert parts_for(3, 10 * PIECE_BYTES) == 3, "never more pieces than rows"
