"""The CRD file: structural, documented, and in agreement with the pydantic spec types."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

from tfps.api import naming
from tfps.api import spec as spec_types

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "trainingjob.yaml"


@pytest.fixture(scope="module")
def crd() -> dict:
    docs = [d for d in yaml.safe_load_all(CRD_PATH.read_text()) if d]
    assert len(docs) == 1
    return docs[0]


@pytest.fixture(scope="module")
def version(crd) -> dict:
    (v,) = crd["spec"]["versions"]
    return v


@pytest.fixture(scope="module")
def schema(version) -> dict:
    return version["schema"]["openAPIV3Schema"]


def _walk(node: dict, path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_names_group_and_version(crd, version):
    names = crd["spec"]["names"]
    assert (crd["spec"]["group"], names["plural"], names["kind"]) == (
        spec_types.API_GROUP,
        spec_types.PLURAL,
        spec_types.KIND,
    )
    assert "tj" in names["shortNames"] and version["name"] == spec_types.API_VERSION
    assert crd["metadata"]["name"] == f"{spec_types.PLURAL}.{spec_types.API_GROUP}"


def test_every_field_is_typed_and_described(schema):
    for path, node in _walk(schema):
        if path in ("", ".apiVersion", ".kind", ".metadata"):
            continue
        assert node.get("description"), f"{path} has no description"
        assert "type" in node, f"{path} has no type (not structural)"


def _schema_at(schema: dict, *keys: str) -> dict:
    node = schema
    for key in keys:
        node = node["properties"][key]
    return node


def _model_nodes(model: type[BaseModel], node: dict, path: str):
    """Pair each pydantic field with its schema node, recursively."""
    for name, info in model.model_fields.items():
        alias = info.alias or name
        assert alias in node.get("properties", {}), f"{path}.{alias} missing from the CRD"
        child = node["properties"][alias]
        yield f"{path}.{alias}", info, child
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            yield from _model_nodes(ann, child, f"{path}.{alias}")


@pytest.mark.parametrize(
    "model,keys",
    [
        (spec_types.TrainingSpec, ("spec", "training")),
        (spec_types.RunPolicy, ("spec", "runPolicy")),
        (spec_types.ReplicaSpec, ("spec", "replicaSpecs", "Worker")),
    ],
)
def test_schema_has_every_spec_field_with_the_same_default(schema, model, keys):
    for path, info, node in _model_nodes(model, _schema_at(schema, *keys), ".".join(keys)):
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            assert node.get("default") == {}, f"{path}: nested defaults need default: {{}}"
        elif default is None:
            assert "default" not in node, f"{path}: optional field must have no default"
        elif isinstance(default, dict):
            assert node.get("default") == default, path
        else:
            expected = default.value if hasattr(default, "value") else default
            assert node.get("default") == expected, f"{path}: CRD default {node.get('default')!r} != {expected!r}"


@pytest.mark.parametrize(
    "enum,keys",
    [
        (spec_types.RestartPolicy, ("spec", "replicaSpecs", "PS", "restartPolicy")),
        (spec_types.CleanPodPolicy, ("spec", "runPolicy", "cleanPodPolicy")),
        (spec_types.SuccessPolicy, ("spec", "successPolicy")),
        (spec_types.OptimizerName, ("spec", "training", "optimizer", "name")),
        (spec_types.ConsistencyMode, ("spec", "training", "consistency", "mode")),
    ],
)
def test_enums_match(schema, enum, keys):
    assert sorted(_schema_at(schema, *keys)["enum"]) == sorted(e.value for e in enum)


def test_replica_types_and_bounds(schema):
    replica_specs = _schema_at(schema, "spec", "replicaSpecs")
    assert set(replica_specs["properties"]) == {t.value for t in spec_types.ReplicaType}
    for rtype, node in replica_specs["properties"].items():
        assert node["properties"]["replicas"]["maximum"] == (1 if rtype == "Chief" else naming.MAX_REPLICAS)
        assert node["properties"]["template"]["x-kubernetes-preserve-unknown-fields"] is True


def test_name_rules_match_naming(schema):
    name = _schema_at(schema, "metadata", "name")
    assert name["maxLength"] == naming.MAX_JOB_NAME_LENGTH and name["pattern"] == naming.JOB_NAME_PATTERN
    longest = "a" * naming.MAX_JOB_NAME_LENGTH
    assert len(naming.pod_name(longest, spec_types.ReplicaType.EVALUATOR, naming.MAX_REPLICAS - 1)) == 63


def test_subresources_and_printer_columns(schema, version):
    scale = version["subresources"]["scale"]
    assert scale["specReplicasPath"] == ".spec.replicaSpecs.Worker.replicas"
    for path in (scale["statusReplicasPath"], scale["labelSelectorPath"]):
        _schema_at(schema, *path.strip(".").split("."))
    assert "status" in version["subresources"]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert {"Phase", "PS", "Workers", "Step", "Loss", "Age"} <= set(columns)
    for path in columns.values():
        if path.startswith(".status"):
            _schema_at(schema, *re.sub(r"^\.", "", path).split("."))


def test_status_phases_are_the_operators(schema):
    from tfps.operator import status

    assert _schema_at(schema, "status", "phase")["enum"] == list(status.PHASES)


def test_top_level_spec_defaults(schema):
    spec_node = _schema_at(schema, "spec")
    field = spec_types.TrainingJobSpec.model_fields["success_policy"]
    assert spec_node["properties"]["successPolicy"]["default"] == field.default.value
    assert spec_node["properties"]["runPolicy"]["default"] == {}
    assert "default" not in spec_node["properties"]["training"]  # absent = the user's own program


def test_model_is_checked_at_admission_like_the_api_checks_it(schema):
    """The CRD's rule for spec.training.model names the built-ins tfps.api.spec declares (and the
    runtime builds), and the same function pattern; its message lists the built-ins."""
    from tfps.runtime.models import BUILTIN

    assert tuple(BUILTIN) == spec_types.BUILT_IN_MODELS
    (rule,) = _schema_at(schema, "spec", "training", "model")["x-kubernetes-validations"]
    listed = re.search(r"self in \[(.*?)\]", rule["rule"]).group(1)
    assert tuple(re.findall(r"'([^']+)'", listed)) == spec_types.BUILT_IN_MODELS
    assert f"self.matches('{spec_types.MODEL_FUNCTION_PATTERN}')" in rule["rule"]
    assert ", ".join(spec_types.BUILT_IN_MODELS) in rule["message"]
    for good in (*spec_types.BUILT_IN_MODELS, "my_models.vision:resnet", "m:f"):
        assert spec_types.TrainingSpec(model=good).model == good
    for bad in ("resnet9000", "my-models:f", "pkg.mod:", ":f", "a:b:c"):
        with pytest.raises(ValueError, match="digits-mlp, mlp, wide-deep"):
            spec_types.TrainingSpec(model=bad)
