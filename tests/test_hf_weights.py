"""model.pretrained reads what `from_pretrained` reads: checkpoints saved with transformers'
`save_pretrained` name their tensors as the model's earlier versions did (ViT's
`encoder.layer.N.attention.attention.query`, BERT's, Mixtral's per-expert `w1`/`w2`/`w3`), and the
model's own conversion mapping turns them into today's names and fused tensors. Against
`from_pretrained` of the same folder, single-process and under fsdp, tensor and hybrid layouts;
Mixtral's fused expert weights read by slices (each fsdp rank its quarter of the bytes). A Hugging
Face cache folder (`models--org--name/snapshots/REV`, files linked into `blobs/`) works as well."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import sys

import pytest
import torch

pytest.importorskip("transformers")

from gearshift.workers.build import pretrained  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
ROOT = str(pathlib.Path(__file__).parent.parent)
FAMILIES = ("vit", "bert", "llama", "mixtral")
sys.path.insert(0, str(FIXTURES))


def _builder(family):
    import first_build

    def build():
        made = getattr(first_build, family)()
        return made[0] if isinstance(made, tuple) else made  # (model, tensor-parallel plan), or the model

    return build


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family saved with save_pretrained in shards, as transformers names them on disk."""
    root = tmp_path_factory.mktemp("hf")
    for family in FAMILIES:
        torch.manual_seed(5)
        _builder(family)().save_pretrained(root / family, max_shard_size="20KB")
    return root


def _reference(family, folder) -> dict:
    model = _builder(family)()
    return {k: v.detach().clone() for k, v in type(model).from_pretrained(folder).state_dict().items()}


def test_the_files_name_tensors_otherwise_than_the_model(saved):
    """What the test is about: the files hold the old names (and Mixtral's experts one by one)."""
    names = {f: set(pretrained.saved_tensors(saved / f)) for f in FAMILIES}
    model_names = {f: set(_builder(f)().state_dict()) for f in FAMILIES}
    assert not names["vit"] & {n for n in model_names["vit"] if ".layers." in n}
    assert any(".encoder.layer." in n for n in names["vit"])
    assert any(".experts.0.w1." in n for n in names["mixtral"])
    assert any(n.endswith("experts.gate_up_proj") for n in model_names["mixtral"])


@pytest.mark.parametrize("family", FAMILIES)
def test_one_process_loads_what_from_pretrained_loads(saved, family):
    with torch.device("meta"):
        meta = _builder(family)()
    pretrained.check(meta, saved / family)  # the driver's check passes, reading headers only
    torch.manual_seed(6)
    model = _builder(family)()
    got = pretrained.load(model, saved / family)
    want = _reference(family, saved / family)
    wrong = [k for k, v in want.items() if not torch.equal(model.state_dict()[k], v)]
    assert not wrong and got["read_whole"] == [], (wrong, got)


def test_a_hugging_face_cache_folder_is_read_through_its_snapshot(saved, tmp_path):
    cache = tmp_path / "models--org--tiny"
    rev = "0123abcd"
    (cache / "blobs").mkdir(parents=True)
    (cache / "snapshots" / rev).mkdir(parents=True)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(rev)
    for i, file in enumerate(sorted((saved / "llama").iterdir())):
        blob = cache / "blobs" / f"blob{i}"
        blob.write_bytes(file.read_bytes())
        os.symlink(os.path.relpath(blob, cache / "snapshots" / rev), cache / "snapshots" / rev / file.name)
    assert pretrained.snapshot(cache) == cache / "snapshots" / rev
    model = _builder("llama")()
    pretrained.load(model, pretrained.folder({"path": str(cache)}, [str(tmp_path)]))
    want = _reference("llama", saved / "llama")
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    (cache / "refs" / "main").unlink()
    (cache / "snapshots" / "fedcba98").mkdir()
    with pytest.raises(pretrained.PretrainedError, match="2 snapshots.*refs/main.*nothing is downloaded"):
        pretrained.snapshot(cache)


# --- under the layouts: each rank reads its pieces, fused tensors by slices ----------------

def _load_under(worker, family: str, folder: str, layout: dict) -> dict:
    from gearshift.strategies.layout import Layout
    from gearshift.strategies.state import full

    spec = {"entrypoint": f"first_build:{family}", "pretrained": {"path": folder, "prefix": "", "hash": "header"}}
    worker.config = dataclasses.replace(worker.config, model=spec)
    worker.builder.lay_out(Layout.from_dict(layout))
    got = worker.load_pretrained()
    want = _reference(family, folder)
    state = worker.parallel.model.state_dict()
    wrong = [k for k, v in want.items() if not torch.equal(full(state[k].detach()), v)]
    fused = sum(v.numel() * v.element_size() for k, v in want.items() if "experts" in k)
    return {"wrong": wrong, "bytes": got["bytes"], "read_whole": got["read_whole"], "fused": fused,
            "from_weights": worker.builder.info.get("from_weights")}


@pytest.fixture(scope="module")
def group():
    sys.path.insert(0, ROOT)
    from process_workers import PooledGroup
    from gearshift.orchestrator.job import job_from_dict

    job = job_from_dict({"model": {"name": "gpt", "kwargs": {"vocab_size": 128, "block_size": 8, "n_layer": 1,
                                                             "n_head": 2, "n_embd": 16}},
                         "data": "chars", "train": {"steps": 1, "global_batch_size": 8, "seed": 11},
                         "cluster": {"num_workers": 4}, "parallel": {"strategy": "fsdp"},
                         "telemetry": {"ray_metrics": False}}).to_dict()
    with PooledGroup(job, 4, search_paths=[str(FIXTURES), ROOT], cpus=0.5) as g:
        yield g


@pytest.mark.parametrize("layout", ["fsdp", "tensor", "hybrid_dp_shard"])
def test_each_rank_reads_its_pieces_of_renamed_and_fused_weights(group, saved, layout):
    from gearshift.strategies.layout import Layout

    strategy, tp, dp_shard = {"fsdp": ("fsdp", None, False), "tensor": ("tensor", 4, False),
                              "hybrid_dp_shard": ("hybrid", 2, True)}[layout]
    as_dict = Layout.for_workers(strategy, 4, tp, None, dp_shard).to_dict()
    for family in FAMILIES:
        ranks = group.apply(_load_under, family, str(saved / family), as_dict)
        for rank, got in enumerate(ranks):
            assert not got["wrong"] and got["read_whole"] == [], (family, layout, rank, got)
            assert got["from_weights"], (family, got)  # the build drew nothing the weights give
        if layout == "fsdp":  # every element read once over the ranks, about a quarter each
            whole = sum(os.path.getsize(f) for f in pretrained.weight_files(saved / family))
            total = sum(got["bytes"] for got in ranks)
            assert total <= whole and max(got["bytes"] for got in ranks) < 0.3 * whole + 4096, (family, total, whole)


# --- export: what save_pretrained writes, loadable with from_pretrained -----------------------

@pytest.mark.parametrize("family", ["vit", "mixtral"])
def test_an_export_is_named_as_save_pretrained_names_it_and_loads_with_from_pretrained(family, tmp_path, capsys):
    """A run of a transformers model trained from scratch (no folder to copy config.json from):
    its export holds the names and layouts save_pretrained writes (ViT's old names, Mixtral's
    experts one by one, split out of the fused tensors), the model's config, and loads back."""
    import json

    from safetensors import safe_open

    from gearshift.orchestrator.commands import cli
    from gearshift.workers.state import checkpoint

    torch.manual_seed(8)
    model = _builder(family)()
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "job.yaml").write_text(f"name: x\nmodel: {{entrypoint: 'first_build:{family}'}}\n")
    (run / "source.json").write_text(json.dumps({"base_dir": str(FIXTURES)}))
    checkpoint.save(run / "checkpoints", 3, {"model": model.state_dict(), "optimizer": {}, "step": 3}, keep=2)
    assert cli.main(["export", str(run), "--output", str(tmp_path / "out")]) == 0
    assert "wrote the model's config.json" in capsys.readouterr().err
    model.save_pretrained(tmp_path / "hf")
    names = lambda folder: {k for f in pretrained.weight_files(folder) for k in safe_open(str(f), "pt").keys()}  # noqa: E731
    assert names(tmp_path / "out") == names(tmp_path / "hf")
    back = type(model).from_pretrained(tmp_path / "out").state_dict()
    assert back.keys() == model.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in model.state_dict().items())


def test_a_tied_head_may_be_in_the_files_once_or_twice(tmp_path):
    """GPT-2's head is its embedding: save_pretrained writes it once; other tools write both names."""
    from safetensors.torch import save_file

    torch.manual_seed(9)
    model = _builder("gpt2")()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state and torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
    for name, held in (("twice", state), ("once", {k: v for k, v in state.items() if k != "lm_head.weight"})):
        (tmp_path / name).mkdir()
        save_file(held, str(tmp_path / name / "model.safetensors"))
        torch.manual_seed(10)
        into = _builder("gpt2")()
        pretrained.load(into, tmp_path / name)
        assert into.lm_head.weight is into.transformer.wte.weight  # still one tensor
        assert all(torch.equal(into.state_dict()[k], v) for k, v in state.items()), name
