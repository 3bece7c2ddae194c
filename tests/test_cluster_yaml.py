"""cluster.yaml passes the checks `ray up` runs before it contacts the cloud.

`ray up` fills in the provider's defaults (prepare_config) and validates the result
against ray/autoscaler/ray-schema.json plus a few cross-field rules (validate_config);
both are Ray's own code, so a config that passes here is one `ray up` accepts.
"""

import copy
import re
from pathlib import Path

import pytest
import ray
import yaml

pytest.importorskip("jsonschema")  # validate_config needs it; ray[default] brings it
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


@pytest.fixture
def config():
    return yaml.safe_load(CLUSTER_YAML.read_text())


def ray_up_checks(config):
    validate_config(prepare_config(copy.deepcopy(config)))


def worker_types(config):
    head = config["head_node_type"]
    return {k: v for k, v in config["available_node_types"].items() if k != head}


def test_passes_ray_schema(config):
    ray_up_checks(config)


def _unknown_top_level_key(c):
    c["max_worker"] = 4  # a typo of max_workers


def _wrong_type(c):
    c["max_workers"] = "four"


def _gpu_count_not_integer(c):
    next(iter(worker_types(c).values()))["resources"]["GPU"] = "4"


def _node_type_without_node_config(c):
    del next(iter(worker_types(c).values()))["node_config"]


def _head_type_not_defined(c):
    c["head_node_type"] = "no-such-type"


def _min_workers_above_global_max(c):
    next(iter(worker_types(c).values()))["min_workers"] = c["max_workers"] + 1


@pytest.mark.parametrize(
    "breakage, reason",
    [
        (_unknown_top_level_key, "'max_worker' was unexpected"),
        (_wrong_type, "'four' is not of type 'integer'"),
        (_gpu_count_not_integer, "'4' is not of type 'integer'"),
        (_node_type_without_node_config, "'node_config' is a required property"),
        (_head_type_not_defined, "must be one of `available_node_types`"),
        (_min_workers_above_global_max, "smaller than the sum of `min_workers`"),
    ],
)
def test_broken_copy_is_rejected(config, breakage, reason):
    # Proves the check above can fail, and for the edit made, not by accident.
    breakage(config)
    with pytest.raises(Exception, match=re.escape(reason)):
        ray_up_checks(config)


def test_workers_declare_gpus(config):
    workers = worker_types(config)
    assert workers, "cluster.yaml has no worker node type"
    for name, node_type in workers.items():
        gpus = node_type.get("resources", {}).get("GPU", 0)
        assert isinstance(gpus, int) and gpus >= 1, f"{name}: resources.GPU={gpus!r}, want >= 1"
        assert 0 <= node_type.get("min_workers", 0) <= node_type["max_workers"] <= config["max_workers"]


def test_setup_installs_the_mounted_checkout(config):
    # The checkout goes up through file_mounts ("." = where `ray up` runs); the
    # install must point at the same remote path or nodes run without gearshift.
    remote = next(r for r, local in config["file_mounts"].items() if local == ".")
    assert f"pip install -e {remote}" in config["setup_commands"]


def test_ray_version_on_nodes_matches_client(config):
    pins = [m for cmd in config["setup_commands"] for m in re.findall(r"ray\[default\]==([\w.]+)", cmd)]
    assert pins == [ray.__version__], f"cluster.yaml pins ray {pins}, this client runs {ray.__version__}"
