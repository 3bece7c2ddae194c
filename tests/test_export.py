"""final.pt and `gearshift export` are written one tensor at a time out of a checkpoint, and hold
exactly the checkpoint's tensors: torch files load with weights_only, safetensors shards with
safetensors and (tests/test_pretrained.py) Hugging Face's from_pretrained."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from gearshift.orchestrator.commands import cli
from gearshift.workers.state import checkpoint, export


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(8, 9, generator=g)
    return {"lm.embed.weight": torch.randn(50, 8, generator=g), "lm.block.w": whole[:, 1:],  # a view into more
            "lm.block.w2": whole[:, 0].clone(),
            "lm.block.b": torch.randn(8, generator=g).to(torch.bfloat16),
            "lm.count": torch.arange(5, dtype=torch.int64), "extra.scale": torch.tensor(2.0)}


@pytest.fixture
def full_checkpoint(tmp_path) -> pathlib.Path:
    """A full-format checkpoint (state.pt) as the driver writes one."""
    return checkpoint.save(tmp_path / "checkpoints", 7, {"model": _state(), "optimizer": {}, "step": 7}, keep=2)


def test_a_torch_file_written_tensor_by_tensor_equals_the_checkpoint(full_checkpoint, tmp_path):
    source = export.ModelTensors(full_checkpoint)
    assert source.step == 7 and list(source.names) == list(_state())
    written = export.write_torch(source, tmp_path / "final.pt")
    back = torch.load(tmp_path / "final.pt", weights_only=True)
    want = _state()
    assert list(back) == list(want) and all(torch.equal(back[k], want[k]) and back[k].dtype == want[k].dtype
                                            for k in want)
    assert written == sum(t.numel() * t.element_size() for t in want.values())
    assert not list(tmp_path.glob(".final.pt.tmp-*"))  # the temporary name is gone


def test_safetensors_shards_with_an_index_a_prefix_and_a_dtype(full_checkpoint, tmp_path):
    from safetensors.torch import load_file

    source = export.ModelTensors(full_checkpoint)
    names = export.output_names(source, "lm.", aliases=[["lm.embed.weight", "lm.head.weight"]])
    assert names == {"embed.weight": "lm.embed.weight", "block.w": "lm.block.w", "block.w2": "lm.block.w2",
                     "block.b": "lm.block.b", "count": "lm.count"}
    index = export.write_safetensors(source, tmp_path / "out", names, torch.float16, max_shard_bytes=900)
    files = sorted(set(index["weight_map"].values()))
    assert len(files) == 2 and files[0] == "model-00001-of-00002.safetensors"  # 800 bytes of embedding alone
    got = {}
    for f in files:
        got.update(load_file(tmp_path / "out" / f))
    want = _state()
    for out, src in names.items():
        expect = want[src].to(torch.float16) if want[src].is_floating_point() else want[src]
        assert got[out].dtype == expect.dtype and torch.equal(got[out], expect), out
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in got.values())
    assert json.loads((tmp_path / "out" / export.INDEX).read_text()) == index


def test_shards_split_like_save_pretrained():
    assert export.shard_plan({"a": 4, "b": 4, "c": 10, "d": 1}, 8) == [["a", "b"], ["c"], ["d"]]
    assert export.parse_size("5GB") == 5 * 10**9 and export.parse_size("64MiB") == 64 << 20
    assert export.parse_size("1024") == 1024
    for bad in ("five", "0MB", "-1GB"):
        with pytest.raises(export.ExportError):
            export.parse_size(bad)


def _run_dir(tmp_path: pathlib.Path, with_checkpoint: bool) -> pathlib.Path:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "job.yaml").write_text("name: x\nmodel: {name: mlp}\n")
    if with_checkpoint:
        checkpoint.save(run / "checkpoints", 3, {"model": _state(), "optimizer": {}, "step": 3}, keep=2)
    return run


def test_export_of_a_run_without_a_checkpoint_is_a_usage_error(tmp_path, capsys):
    run = _run_dir(tmp_path, with_checkpoint=False)
    assert cli.main(["export", str(run), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "has no checkpoint to export" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_full_folder_a_missing_step_and_a_bad_size(tmp_path, capsys):
    run = _run_dir(tmp_path, with_checkpoint=True)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert cli.main(["export", str(run), "--output", str(tmp_path / "full")]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert cli.main(["export", str(run), "--output", str(tmp_path / "o"), "--step", "9"]) == 2
    assert "has checkpoints at steps 3" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--output", str(tmp_path / "o"), "--max-shard-size", "big"]) == 2
    assert "is not a size" in capsys.readouterr().err
    assert cli.main(["export", str(run), "--output", str(tmp_path / "o"), "--prefix", "nothing."]) == 2
    assert "begins with the prefix" in capsys.readouterr().err


def test_export_of_a_damaged_checkpoint_says_so(tmp_path, capsys):
    run = _run_dir(tmp_path, with_checkpoint=True)
    state = next((run / "checkpoints").glob("step_*")) / "state.pt"
    state.write_bytes(state.read_bytes()[:-10] + b"0123456789")
    assert cli.main(["export", str(run), "--output", str(tmp_path / "o")]) == 2
    assert "does not match its manifest" in capsys.readouterr().err


def _sharded_full() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"rows": torch.randn(5, 4, generator=g), "cols": torch.randn(4, 6, generator=g),
            "rep": torch.randn(3, generator=g)}


def _write_sharded(rank: int, world: int, folder: str) -> None:
    """Each rank writes its shards of _sharded_full() as DCP: by rows (uneven), by columns, replicated."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _sharded_full()
    state = {"rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
             "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
             "rep": distribute_tensor(full["rep"], mesh, [Replicate()])}
    dcp.save({"model": state}, storage_writer=dcp.FileSystemWriter(folder))


def test_a_tensor_sharded_by_rows_is_written_a_shard_at_a_time(tmp_path, monkeypatch):
    """From a DCP checkpoint whose shards of a tensor are blocks of rows, the export reads one
    shard at a time (never the whole tensor); shards cut across columns are read whole; a mapped
    state.pt goes in blocks of rows. Every way writes exactly the full tensors."""
    from test_fsdp import spawn_gloo

    root = tmp_path / "checkpoints"
    tmp = root / ".step_00000004.tmp-dcp"
    spawn_gloo(_write_sharded, 2, (str(tmp / checkpoint.DCP_DIR),))
    checkpoint.write_file_atomic(tmp / checkpoint.EXTRA, checkpoint.torch_bytes({"step": 4}))
    files = {str(p.relative_to(tmp)): {"bytes": p.stat().st_size, "sha256": checkpoint.sha256_file(p)}
             for p in tmp.rglob("*") if p.is_file()}
    source = export.ModelTensors(checkpoint.commit(root, 4, tmp, files, keep=2))
    full = _sharded_full()
    rows = list(source.pieces("rows"))
    assert [tuple(p.shape) for p in rows] == [(3, 4), (2, 4)]  # one piece per rank's shard, in order
    assert torch.equal(torch.cat(rows), full["rows"])
    assert [tuple(p.shape) for p in source.pieces("cols")] == [(4, 6)]  # across columns: whole
    export.write_torch(source, tmp_path / "final.pt")
    back = torch.load(tmp_path / "final.pt", weights_only=True)
    assert all(torch.equal(back[k], full[k]) for k in full)
    export.write_safetensors(source, tmp_path / "st", dtype=torch.bfloat16)
    from safetensors.torch import load_file

    st = load_file(str(tmp_path / "st" / "model-00001-of-00001.safetensors"))
    assert all(torch.equal(st[k], full[k].to(torch.bfloat16)) for k in full)
    # a mapped full-format file, in pieces of at most two rows' bytes
    monkeypatch.setattr(export, "PIECE", 2 * 4 * 4)
    saved = checkpoint.save(tmp_path / "full", 4, {"model": full, "optimizer": {}, "step": 4}, keep=2)
    mapped = export.ModelTensors(saved)
    assert [tuple(p.shape) for p in mapped.pieces("rows")] == [(2, 4), (2, 4), (1, 4)]
    export.write_torch(mapped, tmp_path / "final-full.pt")
    back = torch.load(tmp_path / "final-full.pt", weights_only=True, mmap=True)
    assert all(torch.equal(back[k], full[k]) for k in full)
