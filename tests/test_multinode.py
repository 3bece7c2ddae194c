"""A real multi-node Ray cluster on one machine (ray.cluster_utils.Cluster): `gearshift run
--address` joins it, spreads the workers over both nodes, numbers ranks node by node, and
still matches the single-process reference."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from gearshift.orchestrator.job import load_job

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_nodes():
    from ray._private.authentication.authentication_token_setup import (
        _enable_token_auth,
        ensure_token_if_auth_enabled,
    )
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_AUTH_MODE")
    # as `ray.init()` does for a cluster it starts: token auth on, token under ~/.ray
    _enable_token_auth()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        cluster.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def run_on_cluster(cluster, job_file, overrides, run_dir) -> dict:
    """`gearshift run --address` in its own process; returns the run's "starting" event."""
    args = [sys.executable, "-m", "gearshift", "run", str(job_file), "--address", cluster.address,
            "--run-dir", str(run_dir)] + [a for o in overrides for a in ("--set", o)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in (run_dir / "telemetry.jsonl").read_text().splitlines()]
    (starting,) = [e for e in events if e.get("state") == "starting"]
    return starting


def test_spread_job_on_two_nodes_matches_the_reference(two_nodes, tmp_path):
    from test_train_equivalence import MLP, max_diff, reference

    overrides = MLP[1] + ["cluster.num_workers=4", "cluster.placement=spread", "train.steps=8"]
    starting = run_on_cluster(two_nodes, MLP[0], overrides, tmp_path / "run")
    nodes = [w["node_id"] for w in sorted(starting["workers"], key=lambda w: w["rank"])]
    assert len(set(nodes)) == 2, "spread placement must use both nodes"
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], f"ranks must be contiguous per node: {nodes}"

    ref_state, _ = reference(load_job(MLP[0], overrides))
    final = torch.load(tmp_path / "run/final.pt", weights_only=True)
    assert max_diff(final, ref_state) <= 1e-5


def test_hybrid_tensor_groups_stay_inside_a_node(two_nodes, tmp_path):
    """dp 2 x tp 2 spread over two 2-CPU nodes: each tensor-parallel pair is one node's workers,
    the data-parallel pairs cross nodes, and the result equals the reference."""
    from test_train_equivalence import GPT, max_diff, reference

    overrides = GPT[1] + ["cluster.num_workers=4", "cluster.placement=spread", "parallel.strategy=hybrid",
                          "parallel.tp_size=2", "train.global_batch_size=8"]
    starting = run_on_cluster(two_nodes, GPT[0], overrides, tmp_path / "run")
    node_of = {w["rank"]: w["node_id"] for w in starting["workers"]}
    assert starting["tp_groups"] == [[0, 1], [2, 3]]
    for group in starting["tp_groups"]:
        assert len({node_of[r] for r in group}) == 1, f"tp group {group} crosses nodes"
    assert node_of[0] != node_of[2], "the data-parallel replicas are on different nodes"

    ref_state, _ = reference(load_job(GPT[0], overrides))
    assert max_diff(torch.load(tmp_path / "run/final.pt", weights_only=True), ref_state) <= 1e-4


def test_a_tensor_group_across_nodes_is_refused():
    """Placement gave 3 workers to one node and 1 to the other: tp pairs [0,1],[2,3] would put
    rank 2 and 3 on different nodes. This is checked before any process group exists."""
    from gearshift.orchestrator.errors import GearshiftError
    from gearshift.orchestrator.cluster.worker_group import RayWorkerGroup

    job = load_job(ROOT / "examples/gpt.yaml", ["cluster.num_workers=4", "parallel.strategy=hybrid",
                                                "parallel.tp_size=2"])
    group = RayWorkerGroup(job, embedded=False)
    group.infos = [{"node_id": n, "node_ip": "10.0.0." + n} for n in ("1", "1", "1", "2")]
    with pytest.raises(GearshiftError, match=r"ranks \[2, 3\] would span 2 nodes"):
        group._check_tp_groups_are_node_local()
    group.infos = [{"node_id": n, "node_ip": "10.0.0." + n} for n in ("1", "1", "2", "2")]
    group._check_tp_groups_are_node_local()
