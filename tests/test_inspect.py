"""`gearshift inspect data` shows the very batch a rank trains on at a step (augmentation
included), with a summary table and a picture; `gearshift inspect graph` lists every module with
its parameter count and the layout's placement, and names compile's graph breaks."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import shutil

import pytest
import torch

import gearshift
from gearshift.orchestrator.commands import cli, inspect
from gearshift.workers.build import components

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def _cli(*args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(map(str, args)))
    return code, out.getvalue(), err.getvalue()


def _job(folder: pathlib.Path, recorded: pathlib.Path, at_step: int) -> pathlib.Path:
    shutil.copy(FIXTURES / "inspected.py", folder / "inspected.py")
    job = folder / "job.yaml"
    job.write_text(f"name: jitter\nmodel: {{entrypoint: 'inspected:recorder', kwargs: {{path: '{recorded}', "
                   f"at_step: {at_step}}}}}\ndata: {{entrypoint: 'inspected:jittered', kwargs: {{size: 256}}}}\n"
                   "loss: mse\noptimizer: {name: sgd, lr: 0.01}\n"
                   "train: {steps: 4, global_batch_size: 16, seed: 3}\ncluster: {num_workers: 2}\n"
                   "checkpoint: {every: 0}\n")
    return job


def test_the_inspected_batch_is_what_rank_0_trains_on_at_that_step(local_workers, tmp_path):
    recorded, at = tmp_path / "seen.pt", 3
    job = _job(tmp_path, recorded, at)
    gearshift.run(job, run_dir=tmp_path / "run")
    trained = torch.load(recorded, weights_only=True)
    code, out, err = _cli("inspect", "data", job, "--step", at, "--save", tmp_path / "shown.pt",
                          "--output", tmp_path / "shown.png")
    assert code == 0, err
    shown = torch.load(tmp_path / "shown.pt", weights_only=True)
    assert shown["inputs"].shape == (8, 8) and torch.equal(shown["inputs"], trained)  # augmentation included
    code, _, _ = _cli("inspect", "data", job, "--step", at + 1, "--save", tmp_path / "next.pt",
                      "--output", tmp_path / "next.png")
    assert code == 0 and not torch.equal(torch.load(tmp_path / "next.pt", weights_only=True)["inputs"], trained)
    assert "step 3, rank 0 (data-parallel rank 0 of 2" in out and "NaN 0" in out
    assert (tmp_path / "shown.png").stat().st_size > 1000
    records = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    [memory] = [r for r in records if r.get("event") == "module_memory"]  # what `watch` lists for a live run
    [top] = [m for m in memory["top"] if m["module"] == "lin"]  # the model's layer (the loss's tensors: "(model)")
    assert (top["module"], top["parameters"], top["gradients"]) == ("lin", (8 * 2 + 2) * 4, (8 * 2 + 2) * 4)
    assert top["optimizer"] == 0 and top["activations"] >= 8 * 8 * 4  # plain SGD keeps no state; its input kept


def test_images_draw_as_a_grid_and_token_batches_decode(tmp_path):
    code, out, err = _cli("inspect", "data", ROOT / "examples" / "mlp.yaml", "--count", 8, "--output",
                          tmp_path / "digits.png")
    assert code == 0, err
    assert "inputs   shape [64, 1, 28, 28]  float32" in out and "classes {" in out
    import matplotlib.image

    assert matplotlib.image.imread(tmp_path / "digits.png").shape[1] > 600  # a grid, 8 across
    code, out, err = _cli("inspect", "data", ROOT / "examples" / "gpt.yaml", "--count", 2, "--output",
                          tmp_path / "text.png")
    assert code == 0, err
    texts = [line for line in out.splitlines() if line.startswith("[0] ") or line.startswith("[1] ")]
    assert len(texts) == 2 and all(" the " in t.lower() or "." in t for t in texts), texts


def test_the_summary_counts_nans_and_the_class_histogram():
    lines = inspect.summary("inputs", torch.tensor([[1.0, float("nan")], [float("inf"), 3.0]]))
    assert "NaN 1  Inf 1" in lines[0] and "min 1  max 3" in lines[0]
    lines = inspect.summary("targets", torch.tensor([0, 2, 2, 5]))
    assert lines[1].split("classes ")[1] == "{0: 1, 2: 2, 5: 1}"


@pytest.mark.parametrize("args,words", [(["--rank", "7"], "--rank 7 is not valid"),
                                        (["--step", "0"], "steps count from 1"),
                                        (["--count", "0"], "--count 0 is not valid")])
def test_bad_arguments_say_what_is_allowed(tmp_path, args, words):
    code, _, err = _cli("inspect", "data", ROOT / "examples" / "mlp.yaml", *args, "--output", tmp_path / "x.png")
    assert code == 2 and words in err


def test_the_graph_lists_every_gpt_module_with_its_parameters_and_placement(tmp_path):
    out = tmp_path / "gpt.svg"
    code, text, err = _cli("inspect", "graph", ROOT / "examples" / "gpt.yaml", "--set", "parallel.strategy=hybrid",
                           "--set", "cluster.num_workers=4", "--set", "parallel.tp_size=2", "--output", out)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["modules"]}
    job = gearshift.load_job(ROOT / "examples" / "gpt.yaml")
    model = components.build_model(job.to_dict()["model"], [job.base_dir])
    named = dict(model.named_modules())
    assert set(rows) == {n or "(model)" for n in named}
    for name, mod in named.items():
        r = rows[name or "(model)"]
        assert r["params"] == sum(p.numel() for p in mod.parameters()), name
        assert r["shapes"] == {n: list(p.shape) for n, p in mod.named_parameters(recurse=False)}
    assert rows["blocks.0.attn.q"]["placement"].startswith("tp colwise: weight rows split over 2")
    assert rows["blocks.1.mlp.proj"]["placement"].startswith("tp rowwise: weight columns split over 2")
    assert rows["ln_f"]["placement"] == "replicated on 2 data-parallel rank(s)"
    assert out.read_text().lstrip().startswith("<?xml") and out.with_suffix(".png").stat().st_size > 10_000
    code, _, err = _cli("inspect", "graph", ROOT / "examples" / "gpt.yaml", "--set", "parallel.strategy=fsdp",
                        "--set", "cluster.num_workers=4", "--output", tmp_path / "fsdp.svg")
    rows = {r["name"]: r for r in json.loads((tmp_path / "fsdp.json").read_text())["modules"]}
    assert code == 0 and rows["head"]["placement"] == "dim 0 sharded over 4 data-parallel ranks"


def test_compile_s_graph_breaks_are_named_with_where_they_happen(tmp_path):
    shutil.copy(FIXTURES / "inspected.py", tmp_path / "inspected.py")
    (tmp_path / "job.yaml").write_text("name: breaky\nmodel: 'inspected:breaky'\n"
                                       "data: {entrypoint: 'inspected:jittered', kwargs: {size: 64}}\nloss: mse\n"
                                       "train: {steps: 2, global_batch_size: 8}\n")
    code, out, err = _cli("inspect", "graph", tmp_path / "job.yaml", "--compile", "--output", tmp_path / "g.svg")
    assert code == 0, err
    compiled = json.loads((tmp_path / "g.json").read_text())["compile"]
    assert compiled["graphs"] == 2 and compiled["graph_breaks"] == 1
    [brk] = compiled["breaks"]
    assert "item()" in brk["reason"] and brk["where"].endswith("inspected.py:55")
    assert "1 graph break(s)" in out and "inspected.py:55" in out


def test_memory_by_module_counts_each_modules_parameters_gradients_and_adam_state(tmp_path):
    out = tmp_path / "mem.svg"
    code, text, err = _cli("inspect", "memory", ROOT / "examples" / "gpt.yaml", "--output", out)
    assert code == 0, err
    rows = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["modules"]}
    job = gearshift.load_job(ROOT / "examples" / "gpt.yaml")
    model = components.build_model(job.to_dict()["model"], [job.base_dir])
    for name, mod in model.named_modules():
        own = sum(p.numel() * p.element_size() for p in mod.parameters(recurse=False))
        r = rows[name or "(model)"]
        assert r["own"]["parameters"] == own and r["own"]["gradients"] == own, name
        assert r["own"]["optimizer"] == 2 * own, name  # AdamW: two moments of the parameter's size
        assert r["total"]["parameters"] == sum(p.numel() * p.element_size() for p in mod.parameters()), name
    # a Linear keeps its input for backward: at least the (rows x in_features) floats of this batch
    fc = rows["blocks.0.mlp.fc"]["own"]["activations"]
    assert fc >= 16 * 64 * 128 * 4  # 16 rows (examples/gpt.yaml's batch of 32 over 2 ranks) x 64 tokens x 128 wide
    assert sum(r["own"]["activations"] for r in rows.values()) == rows["(model)"]["total"]["activations"]
    assert "blocks.0.mlp.proj" in text and out.with_suffix(".png").stat().st_size > 10_000


def test_the_report_draws_the_first_batch_when_data_inspect_is_on(tmp_path):
    import yaml

    job = gearshift.load_job(ROOT / "examples" / "mlp.yaml", {"data.inspect": True})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.to_dict()))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        paths = cli._inspected_data(tmp_path, None)
    assert paths == [tmp_path / "report" / "data-step1.png"] and paths[0].stat().st_size > 10_000
    assert "step 1, rank 0" in out.getvalue()
    off = tmp_path / "off"
    off.mkdir()
    (off / "job.yaml").write_text(yaml.safe_dump(gearshift.load_job(ROOT / "examples" / "mlp.yaml").to_dict()))
    assert cli._inspected_data(off, None) == []


def test_a_live_runs_memory_by_module_ranks_the_modules_by_their_own_bytes():
    from gearshift.workers.step.module_memory import ModuleMemory

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.Adam(model.parameters())
    probe = ModuleMemory()
    with probe.watching(model):
        model(torch.randn(32, 16)).sum().backward()
    opt.step()
    with probe.watching(model):  # measured once: later steps pass through
        model(torch.randn(32, 16)).sum().backward()
    top = probe.take(model, opt)
    # the ReLU keeps its 32 x 64 output, which the last layer takes without keeping it again
    assert [t["module"] for t in top] == ["0", "1", "2"] and not probe.ready
    assert top[1]["activations"] == 32 * 64 * 4 and top[2]["activations"] == 0
    first = top[0]
    assert first["parameters"] == (16 * 64 + 64) * 4 == first["gradients"] and first["optimizer"] == 2 * first["parameters"]
    assert first["activations"] == 32 * 16 * 4  # its input, kept for the weight's gradient
