"""`gearshift schema`: the job file's JSON Schema for editors, made from orchestrator/job.py.

The schema must say what the checkers say: the job files gearshift ships and the jobs it
resolves validate, the mistakes the checkers refuse field by field are refused by the schema
too, and a field added to the job without a doc or a schema fragment stops the generator.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import pathlib
import re

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings

from gearshift.orchestrator.commands import cli
from gearshift.orchestrator.job import fields as jobmod
from gearshift.orchestrator.job import Job, JobError, job_from_dict, load_job
from gearshift.orchestrator.job.schema import SchemaError, _object, job_schema
from test_fuzz import job_documents  # the fuzz test's job files: valid examples with fields changed

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@functools.cache
def schema() -> dict:
    # made on first use, not at import: a generator error fails the tests that use it, not collection
    return job_schema()


def validator():
    return jsonschema.validators.validator_for(schema())(schema())


def schema_errors(doc) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator().iter_errors(doc)]


def with_(**sections) -> dict:
    """A valid job (`model: mlp`) with these top-level keys set."""
    return {"model": "mlp", **sections}


def test_the_schema_is_a_valid_schema():
    assert schema()["$schema"] == "http://json-schema.org/draft-07/schema#"
    jsonschema.validators.validator_for(schema()).check_schema(schema())
    jsonschema.Draft202012Validator.check_schema(schema())  # the keywords used mean the same in 2020-12


def job_examples() -> list[pathlib.Path]:
    # examples/ also holds cluster specs (for plan/simulate) and scenarios: those are not jobs
    return sorted(p for p in (ROOT / "examples").glob("*.yaml") if not p.name.startswith(("cluster-", "scenario-")))


def test_the_example_jobs_validate():
    names = [p.name for p in job_examples()]
    assert {"mlp.yaml", "gpt.yaml"} <= set(names), names  # the list cannot silently become empty
    for path in job_examples():
        load_job(path)  # a job, by gearshift's own word
        assert schema_errors(yaml.safe_load(path.read_text())) == [], path.name


def test_resolved_and_default_jobs_validate():
    assert schema_errors(Job().to_dict()) == []
    resolved = load_job(ROOT / "examples/gpt.yaml", ["adapt.schedule=[{step: 10, strategy: tensor}]",
                                                      "parallel.bucket_cap_mb=auto"]).to_dict()
    assert resolved["optimizer"]["betas"] and resolved["adapt"]["schedule"][0]["tp_size"] is None
    assert schema_errors(resolved) == []
    assert schema_errors(json.loads(json.dumps(resolved))) == []  # as an editor would read the run's job.yaml


def _section_class(f: dataclasses.Field):
    factory = f.default_factory
    return factory if factory is not dataclasses.MISSING and dataclasses.is_dataclass(factory) else None


def _job_fields(cls, prefix=""):
    """Every key a job file may hold, dotted, from the dataclasses themselves."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        yield prefix + f.name
        if _section_class(f):
            yield from _job_fields(_section_class(f), f"{prefix}{f.name}.")


def _sections(cls, prefix=""):
    """The dotted names of the job's sections (dataclasses), at any depth."""
    for f in dataclasses.fields(cls):
        if _section_class(f):
            yield prefix + f.name
            yield from _sections(_section_class(f), f"{prefix}{f.name}.")


def _schema_fields(node, prefix="", sections=None):
    """Every key the schema describes, dotted, with its description: the top level and its
    sections, at any depth (a mapping-valued field such as inject.link is one key, as in the
    dataclasses)."""
    sections = set(_sections(Job)) if sections is None else sections
    if "properties" not in node:  # a section with shorthand forms: the mapping form comes first
        node = node["anyOf"][0]
    for name, sub in node["properties"].items():
        yield prefix + name, sub.get("description", "")
        if prefix + name in sections:
            yield from _schema_fields(sub, f"{prefix}{name}.", sections)


def test_every_job_field_is_in_the_schema_with_a_description():
    fields = list(_job_fields(Job))
    assert len(fields) > 50 and "parallel.bucket_cap_mb" in fields and "inject.link" in fields
    described = dict(_schema_fields(schema()))
    assert sorted(described) == sorted(fields)  # nothing missing, nothing extra (base_dir is internal)
    assert [f for f, doc in described.items() if not doc.strip()] == []


def test_a_field_without_doc_or_fragment_stops_the_generator():
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        size: int = jobmod._f(1, jobmod._int(1))

    @dataclasses.dataclass(frozen=True)
    class NoFragment:
        size: int = jobmod._f(1, lambda v, path: v, "a size")

    with pytest.raises(SchemaError, match="size has no doc"):
        _object(Undocumented, "")
    with pytest.raises(SchemaError, match="size: its checker has no JSON-Schema fragment"):
        _object(NoFragment, "")


# Each is refused by the checkers (naming the field given) and by the schema (at that path).
BAD = [
    ("unknown-top-key", with_(modle="gpt"), "modle"),
    ("unknown-nested-key", with_(train={"stpes": 5}), "train.stpes"),
    ("wrong-type-int", with_(train={"steps": "ten"}), "train.steps"),
    ("wrong-type-bool", with_(telemetry={"enabled": "yes"}), "telemetry.enabled"),
    ("section-not-mapping", with_(train=[1, 2]), "train"),
    ("zero-steps", with_(train={"steps": 0}), "train.steps"),
    ("threshold-open-at-0", with_(adapt={"threshold": 0}), "adapt.threshold"),
    ("threshold-over-1", with_(adapt={"threshold": 1.5}), "adapt.threshold"),
    ("too-many-workers", with_(cluster={"num_workers": 5000}), "cluster.num_workers"),
    ("two-gpus", with_(cluster={"gpus_per_worker": 2}), "cluster.gpus_per_worker"),
    ("beta-1", with_(optimizer={"betas": [0.9, 1.0]}), "optimizer.betas[1]"),
    ("three-betas", with_(optimizer={"betas": [0.9, 0.99, 0.999]}), "optimizer.betas"),
    ("bucket-0", with_(parallel={"bucket_cap_mb": 0}), "parallel.bucket_cap_mb"),
    ("bucket-huge", with_(parallel={"bucket_cap_mb": 5000}), "parallel.bucket_cap_mb"),
    ("bucket-word", with_(parallel={"bucket_cap_mb": "big"}), "parallel.bucket_cap_mb"),
    ("bad-optimizer", with_(optimizer={"name": "adamw2"}), "optimizer.name"),
    ("bad-precision", with_(train={"precision": "fp64"}), "train.precision"),
    ("bad-strategy", with_(parallel={"strategy": "zigzag"}), "parallel.strategy"),
    ("bad-tp-style", {"model": "mlp", "parallel": {"strategy": "tensor", "tp_plan": {"fc1": "diagonal"}}},
     "parallel.tp_plan.fc1"),
    ("bad-model-name", {"model": "mlpp"}, "model.name"),
    ("bad-data-name", with_(data={"name": "mnist"}), "data.name"),
    ("entrypoint-space", {"model": "my models:build"}, "model.entrypoint"),
    ("entrypoint-two-colons", {"model": "a:b:c"}, "model.entrypoint"),
    ("entrypoint-no-colon", with_(loss={"entrypoint": "smooth_l1"}), "loss.entrypoint"),
    ("entrypoint-digit", with_(data={"entrypoint": "1data:load"}), "data.entrypoint"),
    ("job-name-space", with_(name="my job"), "name"),
    ("schedule-not-list", with_(adapt={"schedule": "often"}), "adapt.schedule"),
    ("schedule-step-0", with_(adapt={"schedule": [{"step": 0, "strategy": "data"}]}), "adapt.schedule[0].step"),
    ("schedule-no-strategy", with_(adapt={"schedule": [{"step": 5}]}), "adapt.schedule[0]"),
    ("schedule-bad-strategy", with_(adapt={"schedule": [{"step": 5, "strategy": "zigzag"}]}),
     "adapt.schedule[0].strategy"),
    ("schedule-extra-key", with_(adapt={"schedule": [{"step": 5, "strategy": "data", "when": 1}]}),
     "adapt.schedule[0]"),
    ("link-without-bandwidth", with_(cluster={"num_workers": 2}, inject={"nodes": 2, "link": {"latency_ms": 1}}),
     "inject.link"),
    ("port-too-big", with_(telemetry={"metrics_port": 70000}), "telemetry.metrics_port"),
    ("max-failures-below-minus-1", with_(fault={"max_failures": -2}), "fault.max_failures"),
    ("bucket-values-repeat", with_(tune={"bucket_values": [5, 5]}), "tune.bucket_values"),
]


@pytest.mark.parametrize("doc,field", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_input_is_refused_by_both(doc, field):
    with pytest.raises(JobError) as err:
        job_from_dict(doc, FIXTURES)
    assert err.value.field_path == field, str(err.value)
    errors = list(validator().iter_errors(doc))
    assert errors, f"the schema accepts what gearshift refuses: {err.value}"
    # ... at the same place: the schema's error sits at the field or at a section above it
    # (an unknown key is the section's fault; a bad shorthand string is the whole section's)
    parts = [int(p) if p.isdigit() else p for p in re.split(r"[.\[\]]+", field) if p]
    assert any(list(e.absolute_path) == parts[:len(e.absolute_path)] for e in errors), \
        (parts, schema_errors(doc))


GOOD = [
    ("shorthand-name", {"model": "gpt", "data": "chars", "loss": "cross_entropy"}),
    ("shorthand-entrypoints", {"model": "user_model:build", "data": "user_model:waves",
                               "loss": {"entrypoint": "user_model:smooth_l1", "kwargs": {"beta": 0.2}}}),
    ("mapping-forms", {"model": {"name": "mlp", "kwargs": {"hidden": 32}}, "data": {"name": "synthetic_digits"},
                       "loss": {"name": "mse", "kwargs": None}}),
    ("bucket-auto", with_(parallel={"bucket_cap_mb": "auto"})),
    ("bucket-int", with_(parallel={"bucket_cap_mb": 100})),
    ("grad-clip-null", with_(train={"grad_clip": None})),
    ("grad-clip-0", with_(train={"grad_clip": 0})),
    ("empty-sections", with_(adapt=None, train={}, telemetry=None)),
    ("sgd", with_(optimizer={"name": "sgd", "lr": 1, "momentum": 0.9, "nesterov": True})),
    ("schedule", with_(train={"steps": 50}, adapt={"schedule": [{"step": 10, "strategy": "tensor"},
                                                                  {"step": 20, "strategy": "data", "tp_size": None}]})),
    ("hybrid", with_(cluster={"num_workers": 4}, parallel={"strategy": "hybrid", "tp_size": 2})),
    ("strategy-auto", with_(parallel={"strategy": "auto"}, adapt={"threshold": 1.0, "window": 2})),
    ("slow-link", with_(cluster={"num_workers": 2}, inject={"nodes": 2, "link": {"mb_per_s": 100}})),
    ("metrics-any-port", with_(telemetry={"metrics_port": 0, "metrics_host": "0.0.0.0"})),
    ("no-failure-limit", with_(fault={"max_failures": -1, "on_node_loss": "wait"})),
    ("one-device-per-worker", with_(cluster={"gpus_per_worker": 1})),
    ("dotted-name", with_(name="gpt-2.small_v1")),
]


@pytest.mark.parametrize("doc", [c[1] for c in GOOD], ids=[c[0] for c in GOOD])
def test_good_input_is_accepted_by_both(doc):
    job_from_dict(doc, FIXTURES)
    assert schema_errors(doc) == []


def _numeric_string(value) -> bool:
    # the checkers take "1e-3" (what YAML 1.1 makes of 1e-3) as a number; editors read YAML 1.2,
    # where it is a number already, so the schema asks for a number
    try:
        float(value)
        return isinstance(value, str)
    except (TypeError, ValueError):
        return False


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(doc=job_documents())
def test_what_gearshift_accepts_the_schema_accepts(doc):
    """Over the fuzz test's documents: never a job that runs but that the editor marks wrong."""
    if not isinstance(doc, dict):
        return
    try:
        job_from_dict(copy.deepcopy(doc), ROOT / "examples")
    except JobError:
        return
    wrong = [e for e in validator().iter_errors(doc)
             if not (e.validator in ("type", "anyOf") and _numeric_string(e.instance))]
    assert not wrong, [f"{list(e.absolute_path)}: {e.message}" for e in wrong]


def test_cli_prints_the_schema(capsys):
    assert cli.main(["schema"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out) == schema()


def test_cli_writes_the_schema_to_a_file(tmp_path, capsys):
    path = tmp_path / "gearshift-job.schema.json"
    path.write_text("old")
    assert cli.main(["schema", "--output", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and f"$schema={path}" in captured.err
    assert json.loads(path.read_text()) == schema()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind


@pytest.mark.parametrize("where", ["missing/dir/s.json", "."])
def test_cli_output_that_cannot_be_written_is_bad_input(tmp_path, capsys, where):
    target = tmp_path / where
    assert cli.main(["schema", "--output", str(target)]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("gearshift: --output ") and "Traceback" not in err and len(err.strip().splitlines()) == 1
