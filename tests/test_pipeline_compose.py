"""A pipelined step composed with torch.compile (each block of a worker's stages compiled in
place), with each stage sharded over its replicas (parallel.dp_shard, FSDP2) and with tensor
parallelism inside a stage (parallel.tp_size), on gloo
processes against plain single-process PyTorch on the same batches (tests/test_pipeline.py's
cases and checks; a file of its own so that the two files run side by side)."""

from __future__ import annotations

import pytest

from test_pipeline import _ids, check_case

COMPOSED = [  # model, workers, pp, schedule, micro-batches, accumulation, optimizer, clip, composed with
    # train.compile: each block of a rank's stages compiled in place
    ("gpt", 2, 2, "1f1b", 4, 1, "adam", 0.5, {"compiled": True}),
    ("llama", 2, 2, "interleaved_1f1b", 2, 1, "adam", 0.5, {"compiled": True}),  # the gate outside the graphs
    # parallel.dp_shard: each stage sharded over its replicas by FSDP2
    ("gpt", 4, 2, "1f1b", 2, 2, "adam", 0.5, {"dp_shard": True, "compiled": True}),  # blocks compiled, then sharded
    ("llama", 4, 2, "gpipe", 2, 1, "sgd", 0.5, {"dp_shard": True}),  # the tied head: shards summed between stages
    ("llama", 4, 2, "interleaved_1f1b", 2, 2, "adam", 0.5, {"dp_shard": True}),  # two stages a worker: the model the root
    # parallel.tp_size: each stage's blocks split over its tp group (pp x tp, pp x dp x tp, with dp_shard)
    ("gpt", 4, 2, "1f1b", 2, 1, "adam", 0.5, {"tp": 2, "compiled": True}),  # blocks compiled over DTensor
    ("llama", 8, 2, "interleaved_1f1b", 2, 1, "sgd", 0.5, {"tp": 2}),  # GQA: 2 of 4 query heads, 1 of 2 kv a rank
    ("gpt", 8, 2, "1f1b", 2, 1, "adam", 0.5, {"tp": 2, "dp_shard": True}),
]


@pytest.mark.parametrize("case", COMPOSED, ids=_ids)
@pytest.mark.crossing("compile", "pipeline")
@pytest.mark.crossing("compile", "interleaved")
@pytest.mark.crossing("compile", "pipeline_dp_shard")
@pytest.mark.crossing("compile", "pipeline_tp")
@pytest.mark.crossing("accumulation", "pipeline_dp_shard")
@pytest.mark.crossing("evaluation", "pipeline_dp_shard")
@pytest.mark.crossing("evaluation", "pipeline_tp")
def test_a_composed_pipelined_step_equals_plain_pytorch(tmp_path, case):
    check_case(tmp_path, case)
