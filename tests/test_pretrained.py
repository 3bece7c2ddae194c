"""model.pretrained: a Hugging Face model saved with save_pretrained (sharded safetensors) is
loaded into any layout, each rank reading only its slices, and trains as single-process PyTorch
does from `from_pretrained`; folders that cannot give the model its weights are one-paragraph
job errors before anything starts."""

from __future__ import annotations

import json
import math
import pathlib
import shutil

import pytest
import torch
from torch.utils.data import default_collate

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from gearshift.orchestrator.commands import cli  # noqa: E402
from gearshift.orchestrator.job import JobError, load_job  # noqa: E402
from gearshift.workers.build import pretrained  # noqa: E402
from gearshift.workers.step.data import GlobalBatches  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
STEPS, BATCH = 5, 8
PIPELINED = ("interleaved", "pipeline_dp_shard", "pipeline_tp")


@pytest.fixture
def hf(tmp_path, monkeypatch):
    """A job folder: the Hugging Face fixture, its weights saved in 6 shards, and the job file."""
    shutil.copy(FIXTURES / "hf_model.py", tmp_path / "hf_model.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    import hf_model

    torch.manual_seed(123)  # other weights than the run's own seeded init would give
    hf_model.bare().save_pretrained(tmp_path / "weights", max_shard_size="20KB")
    (tmp_path / "job.yaml").write_text(
        "name: hf\n"
        "model: {entrypoint: 'hf_model:build', pretrained: {path: weights, prefix: 'lm.'}}\n"
        "data: {entrypoint: 'hf_model:tokens', kwargs: {size: 64}}\n"
        "loss: cross_entropy\n"
        "optimizer: {name: adam, lr: 0.01}\n"
        f"train: {{steps: {STEPS}, global_batch_size: {BATCH}, grad_clip: 1.0}}\n"
        "checkpoint: {every: 0}\n")
    return tmp_path, hf_model


def reference(folder: pathlib.Path, hf_model, moe: bool = False) -> tuple[dict, list[float]]:
    """Plain single-process PyTorch from `from_pretrained`, on the same global batches."""
    from transformers import LlamaForCausalLM, MixtralForCausalLM

    cls, weights = (MixtralForCausalLM, "weights_moe") if moe else (LlamaForCausalLM, "weights")
    model = hf_model.LM(cls.from_pretrained(folder / weights, dtype=torch.float32))
    data = hf_model.tokens(size=64)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    order, losses = GlobalBatches(len(data), BATCH, 0), []
    for step in range(STEPS):
        x, y = default_collate([data[i] for i in order.indices(step)])
        opt.zero_grad()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


def run_like_from_pretrained(folder: pathlib.Path, hf_model, overrides: list[str], layout: str):
    """`gearshift run` of the job with `overrides`, its final weights and every step's loss within
    1e-4 of single-process PyTorch from `from_pretrained`: (records, reference state, final state)."""
    args = ["run", str(folder / "job.yaml"), "--run-dir", str(folder / "run")]
    assert cli.main(args + [a for o in overrides for a in ("--set", o)]) == 0
    ref_state, ref_losses = reference(folder, hf_model)
    final = torch.load(folder / "run" / "final.pt", weights_only=True)
    assert final.keys() == ref_state.keys()
    diff = max((final[k] - ref_state[k]).abs().max().item() for k in final)
    assert diff <= 1e-4, f"{layout}: max |final - reference| = {diff:.3g}"
    records = [json.loads(line) for line in (folder / "run" / "telemetry.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r.get("type") == "step"}
    worst = max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses))
    assert worst <= 1e-4, f"per-step loss differs from the reference by {worst:.3g}"
    return records, ref_state, final


def test_the_saved_shards_are_what_the_test_means(hf):
    folder, _ = hf
    files = pretrained.weight_files(folder / "weights")
    assert len(files) > 1 and (folder / "weights" / pretrained.INDEX).is_file()
    assert "lm_head.weight" not in pretrained.saved_tensors(folder / "weights")  # tied: written once


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "hybrid2x2"])
@pytest.mark.crossing("pretrained", "fsdp")
@pytest.mark.crossing("pretrained", "hybrid")
def test_pretrained_trains_like_from_pretrained(local_workers, hf, layout):
    folder, hf_model = hf
    overrides = {"fsdp2": ["cluster.num_workers=2", "parallel.strategy=fsdp", "model.pretrained.hash=full"],
                 "hybrid2x2": ["cluster.num_workers=4", "parallel.strategy=hybrid", "parallel.tp_size=2",
                               "parallel.dp_shard=true", "parallel.tp_plan=" + json.dumps(hf_model.TP_PLAN)]}[layout]
    records, ref_state, final = run_like_from_pretrained(folder, hf_model, overrides, layout)
    # every rank read its slices only: under fsdp together they hold the model once
    event = next(r for r in records if r.get("event") == "pretrained")
    assert event["tensors"] == len(pretrained.saved_tensors(folder / "weights"))
    whole = sum(t.numel() * 4 for k, t in ref_state.items() if k != "lm.lm_head.weight")
    assert max(event["rank_bytes"]) <= whole / 2 + 1024
    assert sum(event["rank_bytes"]) == whole if layout == "fsdp2" else sum(event["rank_bytes"]) >= whole
    starting = next(r for r in records if r.get("event") == "state" and r.get("state") == "starting")
    assert starting["build"]["on_meta"] is True
    # the weights overwrite every parameter: the first build left them empty, drawing nothing for them
    assert starting["build"]["from_weights"] == len(pretrained.saved_tensors(folder / "weights"))
    if layout == "fsdp2":  # the export, streamed from the last checkpoint, loads back with from_pretrained
        from transformers import LlamaForCausalLM

        assert cli.main(["export", str(folder / "run"), "--output", str(folder / "export"),
                         "--max-shard-size", "20KB"]) == 0
        assert len(pretrained.weight_files(folder / "export")) > 1 and (folder / "export" / "config.json").is_file()
        back = LlamaForCausalLM.from_pretrained(folder / "export", dtype=torch.float32).state_dict()
        assert back.keys() == {k[len("lm."):] for k in final}
        assert all(torch.equal(back[k[len("lm."):]], v) for k, v in final.items())
    source = json.loads((folder / "run" / "source.json").read_text())
    assert sorted(source["pretrained"]["files"]) == sorted([p.name for p in pretrained.weight_files(folder / "weights")]
                                                           + [pretrained.INDEX])
    if layout == "fsdp2":  # hash: full: the two workers hashed every byte of the files between them
        import hashlib

        for f in pretrained.weight_files(folder / "weights"):
            assert source["pretrained"]["files"][f.name]["sha256_slices"] == [hashlib.sha256(f.read_bytes()).hexdigest()]


@pytest.mark.parametrize("layout", [
    pytest.param("hsdp", marks=pytest.mark.crossing("pretrained", "hsdp")),
    pytest.param("tensor", marks=pytest.mark.crossing("pretrained", "tensor")),
    pytest.param("interleaved", marks=pytest.mark.crossing("pretrained", "interleaved")),
    pytest.param("pipeline_dp_shard", marks=pytest.mark.crossing("pretrained", "pipeline_dp_shard")),
    pytest.param("pipeline_tp", marks=pytest.mark.crossing("pretrained", "pipeline_tp")),
])
def test_pretrained_weights_fine_tune_under_the_other_layouts(local_workers, hf, layout):
    """The same folder under the layouts the tests above leave out: each rank reads its slices or
    its stage's part, and the run equals single-process PyTorch from `from_pretrained` (1e-4)."""
    folder, hf_model = hf
    plan = "parallel.tp_plan=" + json.dumps(hf_model.TP_PLAN)
    pipe = ["parallel.strategy=pipeline", "parallel.pp_size=2"]
    overrides = {
        "hsdp": ["cluster.num_workers=4", "parallel.strategy=hsdp", "parallel.shard_size=2"],
        "tensor": ["cluster.num_workers=2", "parallel.strategy=tensor", plan],
        "interleaved": ["cluster.num_workers=2", *pipe, "parallel.pp_schedule=interleaved_1f1b"],
        "pipeline_dp_shard": ["cluster.num_workers=4", *pipe, "parallel.dp_shard=true"],
        "pipeline_tp": ["cluster.num_workers=4", *pipe, "parallel.tp_size=2", plan],
    }[layout]
    if layout == "interleaved":  # 2 stages a rank x 2 ranks: 4 decoder layers to cut
        shutil.rmtree(folder / "weights")
        torch.manual_seed(123)
        hf_model.bare(layers=4).save_pretrained(folder / "weights", max_shard_size="20KB")
        overrides.append("model.kwargs={layers: 4}")
    records, _, _ = run_like_from_pretrained(folder, hf_model, overrides, layout)
    event = next(r for r in records if r.get("event") == "pretrained")
    saved = len(pretrained.saved_tensors(folder / "weights"))
    # a stage reads its part of the files (rank 0's is recorded), every other rank its slices of all
    assert 0 < event["tensors"] < saved if layout in PIPELINED else event["tensors"] == saved


@pytest.mark.slow
@pytest.mark.crossing("pretrained", "pipeline")
def test_pretrained_fine_tunes_under_a_pipeline_each_stage_loading_its_part(local_workers, hf):
    """Each stage holds its blocks of the whole model; the files hold every tensor. A stage reads
    its part and takes the rest as other stages' (the driver checked the files against the whole
    model), and the run equals single-process PyTorch from `from_pretrained`."""
    folder, hf_model = hf
    overrides = ["cluster.num_workers=2", "parallel.strategy=pipeline", "parallel.pp_size=2"]
    records, ref_state, _ = run_like_from_pretrained(folder, hf_model, overrides, "pipeline")
    event = next(r for r in records if r.get("event") == "pretrained")
    whole = sum(t.numel() * 4 for k, t in ref_state.items() if k != "lm.lm_head.weight")
    assert all(0 < b < whole for b in event["rank_bytes"]), event["rank_bytes"]  # a part each, none the whole


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data2", "fsdp2"])
@pytest.mark.crossing("pretrained", "data")
def test_a_moe_checkpoint_fine_tunes_like_from_pretrained_its_experts_read_by_slices(local_workers, hf, layout):
    """Mixtral-style weights as save_pretrained writes them (experts one by one, the old module
    names), fused into the model's expert tensors as they are read: equal to fine-tuning from
    `from_pretrained` in one process; under fsdp each rank reads its half of every tensor."""
    folder, hf_model = hf
    torch.manual_seed(321)
    hf_model.bare_moe().save_pretrained(folder / "weights_moe", max_shard_size="20KB")
    overrides = ["model.entrypoint=hf_model:build_moe", "model.pretrained.path=weights_moe", "cluster.num_workers=2",
                 f"parallel.strategy={layout[:-1]}"]
    assert cli.main(["run", str(folder / "job.yaml"), "--run-dir", str(folder / "run")]
                    + [a for o in overrides for a in ("--set", o)]) == 0
    ref_state, ref_losses = reference(folder, hf_model, moe=True)
    final = torch.load(folder / "run" / "final.pt", weights_only=True)
    diff = max((final[k] - ref_state[k]).abs().max().item() for k in final)
    records = [json.loads(line) for line in (folder / "run" / "telemetry.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r.get("type") == "step"}
    worst = max(abs(losses[i + 1] - ref) for i, ref in enumerate(ref_losses))
    print(f"moe {layout}: max |final - reference| {diff:.3g}, per-step loss {worst:.3g}")
    # data: the losses to 1e-5; the weights to 2e-5 after 5 Adam steps at lr 0.01 (two ranks' gradients
    # averaged in another order than one process sums them: 1.2e-5 measured)
    assert final.keys() == ref_state.keys() and diff <= (2e-5 if layout == "data2" else 1e-4), (layout, diff)
    assert worst <= (1e-5 if layout == "data2" else 1e-4), f"per-step loss differs from the reference by {worst:.3g}"
    event = next(r for r in records if r.get("event") == "pretrained")
    files = sum(n * 4 for n in (math.prod(shape) for _, shape in pretrained.saved_tensors(folder / "weights_moe").values()))
    assert event["read_whole"] == [] and event["cast"] == {}, event
    if layout == "fsdp2":  # each rank its half, the fused experts included: the file's tensors read once in all
        assert sum(event["rank_bytes"]) == files and max(event["rank_bytes"]) <= files / 2 + 1024, (event, files)
    else:  # data: each rank holds, and reads, the whole
        assert event["rank_bytes"] == [files, files], (event, files)


def vit_reference(folder: pathlib.Path, hf_model, split: int) -> tuple[dict, list[float]]:
    """A ViT fine-tuned from `from_pretrained` in one process, each global batch taken in `split`
    equal parts (their gradients summed, as `split` data-parallel ranks average theirs)."""
    from transformers import ViTForImageClassification

    model = hf_model.Classifier(ViTForImageClassification.from_pretrained(folder / "weights_vit"))
    data, opt = hf_model.images(size=64), torch.optim.Adam(model.parameters(), lr=0.01)
    order, losses = GlobalBatches(64, BATCH, 0), []
    for step in range(STEPS):
        x, y = default_collate([data[i] for i in order.indices(step)])
        opt.zero_grad()
        total = 0.0
        for xs, ys in zip(x.chunk(split), y.chunk(split)):
            loss = torch.nn.functional.cross_entropy(model(xs), ys) / split
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(total)
    return model.state_dict(), losses


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data2", "fsdp2"])
def test_a_vit_checkpoint_under_its_old_names_fine_tunes_like_from_pretrained(local_workers, hf, layout):
    """A ViT saved with save_pretrained (its files name the layers as earlier transformers versions
    did: encoder.layer.N.attention.attention.query), fine-tuned from those files: equal to
    fine-tuning `from_pretrained`'s model in one process on the same batches, and its export loads
    back with from_pretrained."""
    from transformers import ViTForImageClassification

    folder, hf_model = hf
    torch.manual_seed(77)
    hf_model.bare_vit().save_pretrained(folder / "weights_vit", max_shard_size="20KB")
    overrides = ["model.entrypoint=hf_model:build_vit", "model.pretrained.path=weights_vit",
                 "data.entrypoint=hf_model:images", "cluster.num_workers=2",
                 "parallel.strategy=" + layout[:-1]]
    assert cli.main(["run", str(folder / "job.yaml"), "--run-dir", str(folder / "run")]
                    + [a for o in overrides for a in ("--set", o)]) == 0
    final = torch.load(folder / "run" / "final.pt", weights_only=True)
    records = [json.loads(line) for line in (folder / "run" / "telemetry.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if r.get("type") == "step"}
    whole, want = vit_reference(folder, hf_model, split=1)
    halves, _ = vit_reference(folder, hf_model, split=2)
    assert final.keys() == whole.keys()
    # Adam moves a parameter by about lr whatever the size of its gradient, so where a gradient is
    # nearly or exactly zero (the key projection's bias: softmax ignores it) a parameter moves by
    # rounding noise. The yardstick: the same process with each batch taken in halves, as the two
    # ranks take it, is this far from itself. A start from other weights, or a step on other
    # samples, lands orders of magnitude further (the parameters move by up to lr * STEPS = 0.05).
    noise = max((whole[k] - halves[k]).abs().max().item() for k in whole)
    diff = max((final[k] - halves[k]).abs().max().item() for k in final)
    worst = max(abs(losses[i + 1] - ref) for i, ref in enumerate(want))
    print(f"vit {layout}: |final - reference in halves| {diff:.3g}, the reference against itself in halves "
          f"{noise:.3g}, per-step loss {worst:.3g}")
    assert worst <= 1e-5 and noise <= 1e-3 and diff <= 2 * noise, (diff, noise, worst)
    if layout == "fsdp2":
        assert cli.main(["export", str(folder / "run"), "--output", str(folder / "export")]) == 0
        back = ViTForImageClassification.from_pretrained(folder / "export").state_dict()
        assert back.keys() == {k[len("lm."):] for k in final}
        assert all(torch.equal(back[k[len("lm."):]], v) for k, v in final.items())


def test_the_driver_tells_weight_files_apart_by_their_headers_and_the_workers_hash_every_byte_by_slices(
        hf, monkeypatch, tmp_path):
    import hashlib

    from gearshift.orchestrator.records import provenance

    folder, hf_model = hf
    weights = folder / "weights"
    job = {"model": {"pretrained": {"path": "weights"}}}
    before = provenance.pretrained_weights(job, str(folder))
    files = pretrained.weight_files(weights)
    assert all(set(before["files"][f.name]) == {"bytes", "header_sha256"} for f in files)
    # hash: full: three workers hash their shares of 7 KB slices; the driver reads no tensor byte
    monkeypatch.setattr(pretrained, "SLICE_BYTES", 7000)
    source = tmp_path / "source.json"
    source.write_text(json.dumps({"pretrained": provenance.pretrained_weights(
        {"model": {"pretrained": {"path": "weights", "hash": "full"}}}, str(folder))}))
    shares = [pretrained.hash_share(weights, rank, 3) for rank in range(3)]
    assert all(shares) and sum(map(len, shares)) == len(pretrained.slices(weights))
    provenance.add_slices(source, [{"slices": {str(i): d for i, d in share.items()}} for share in shares])
    full = json.loads(source.read_text())["pretrained"]
    for f in files:
        data = f.read_bytes()
        assert full["files"][f.name]["sha256_slices"] == [hashlib.sha256(data[i:i + 7000]).hexdigest()
                                                          for i in range(0, len(data), 7000)]
    assert provenance.differences({"pretrained": before}, {"pretrained": full}) == []  # the same files
    assert provenance.differences({"pretrained": {"files": {f.name: "0" * 64 for f in files}}},
                                  {"pretrained": before}) == []  # an older record: nothing to compare
    # another model's weights under the same file names: the headers say so
    shutil.rmtree(weights)
    hf_model.bare(layers=3).save_pretrained(weights, max_shard_size="20KB")
    after = provenance.pretrained_weights(job, str(folder))
    [line] = provenance.differences({"pretrained": before}, {"pretrained": after})
    assert "differ from the run's" in line and ".safetensors" in line


def test_a_file_in_another_dtype_is_converted_as_it_loads(hf):
    folder, hf_model = hf
    model = hf_model.bare()
    model.to(torch.bfloat16).save_pretrained(folder / "bf16")
    into = hf_model.build()
    got = pretrained.load(into, folder / "bf16", "lm.")
    assert got["cast"] == {"BF16 -> float32": len(pretrained.saved_tensors(folder / "bf16"))}, got["cast"]
    assert into.lm.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(into.lm.model.embed_tokens.weight, model.model.embed_tokens.weight.float())
    assert into.lm.lm_head.weight is into.lm.model.embed_tokens.weight  # still tied


def _job_error(folder: pathlib.Path, pretrained_value) -> str:
    with pytest.raises(JobError) as err:
        load_job(folder / "job.yaml", ["model.pretrained=" + json.dumps(pretrained_value)])
    text = str(err.value)
    assert "\n" not in text.strip() and "model.pretrained = " in text
    return text


def test_an_empty_folder_is_a_job_error(hf):
    folder, _ = hf
    (folder / "empty").mkdir()
    assert "holds no .safetensors files" in _job_error(folder, {"path": "empty", "prefix": "lm."})
    assert "is not a folder" in _job_error(folder, "nowhere")


def test_other_tensors_are_a_job_error_naming_them(hf):
    folder, hf_model = hf
    from transformers import LlamaForCausalLM

    LlamaForCausalLM(hf_model.config(layers=3)).save_pretrained(folder / "deeper")  # one layer more
    text = _job_error(folder, {"path": "deeper", "prefix": "lm."})
    assert "are not the model's" in text and "model.layers.2." in text
    from safetensors.torch import save_file

    (folder / "wide").mkdir()
    state = {k: v.clone() for k, v in hf_model.bare().state_dict().items() if k != "lm_head.weight"}
    state["model.norm.weight"] = torch.ones(48)
    save_file(state, folder / "wide" / "model.safetensors")
    assert "model.norm.weight is [32] in the model, [48] in the file" in _job_error(folder, {"path": "wide",
                                                                                            "prefix": "lm."})


def test_a_prefix_matching_nothing_is_a_job_error(hf):
    folder, _ = hf
    text = _job_error(folder, {"path": "weights", "prefix": "model."})
    assert "begins none of the model's names" in text and "lm." in text
    # without the prefix the wrapper's names are all missing: the error says to give one
    assert "give prefix: 'lm.'" in _job_error(folder, "weights")


def test_an_index_naming_a_file_that_is_not_there_is_a_job_error(hf):
    folder, _ = hf
    (folder / "weights" / "model-00002-of-00006.safetensors").unlink()
    assert "does not hold" in _job_error(folder, {"path": "weights", "prefix": "lm."})


def test_the_field_takes_a_path_or_path_and_prefix():
    from gearshift.orchestrator.job.fields import _pretrained

    assert _pretrained("w", "model.pretrained") == {"path": "w", "prefix": "", "hash": "header"}
    assert _pretrained({"path": "w", "prefix": "lm."}, "x") == {"path": "w", "prefix": "lm.", "hash": "header"}
    assert _pretrained({"path": "w", "hash": "full"}, "x")["hash"] == "full"
    for bad in ({"prefix": "lm."}, {"path": "w", "dtype": "bf16"}, 3, "", {"path": "w", "prefix": 1}):
        with pytest.raises(JobError):
            _pretrained(bad, "model.pretrained")
    with pytest.raises(JobError, match=r"model.pretrained.hash = 'sha1' is not valid: must be header"):
        _pretrained({"path": "w", "hash": "sha1"}, "model.pretrained")
