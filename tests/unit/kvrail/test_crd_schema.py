"""The generated CRD: structural, documented, and identical to the committed `crds/` file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from kvrail.crd.gen import CRD_FILENAME, crd, main, openapi_schema, render
from kvrail.testing.cel import apply_defaults, violations

REPO = Path(__file__).resolve().parents[3]


def _nodes(schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, schema
    for name, sub in schema.get("properties", {}).items():
        yield from _nodes(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _nodes(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"], f"{path}{{}}")


def _lookup(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_committed_crd_is_regenerated_from_the_models() -> None:
    committed = (REPO / "crds" / CRD_FILENAME).read_text()
    assert committed == render(), "crds/ is stale: run `.venv/bin/python -P -m kvrail.crd.gen`"


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    (tmp_path / CRD_FILENAME).write_text("stale\n")
    assert main(["--check", "--out", str(tmp_path)]) == 1
    assert main(["--out", str(tmp_path)]) == 0
    assert main(["--check", "--out", str(tmp_path)]) == 0


def test_schema_is_structural_every_node_typed_without_refs_or_unions() -> None:
    for path, node in _nodes(openapi_schema()):
        assert not {"$ref", "anyOf", "allOf", "oneOf"} & node.keys(), path
        assert "title" not in node, path
        assert node.get("type") or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_every_spec_and_status_field_has_a_description() -> None:
    schema = openapi_schema()
    for root in ("spec", "status"):
        for path, node in _nodes(schema["properties"][root], f".{root}"):
            if not path.endswith(("[]", "{}")):
                assert node.get("description"), f"{path} has no description"


def test_object_defaults_are_complete_and_pass_their_own_rules() -> None:
    # The API server validates a default against its node's CEL rules without filling in the
    # nested defaults first: a bare {} fails any rule reading a field ("no such key").
    schema = openapi_schema()
    spec = schema["properties"]["spec"]
    assert spec["properties"]["decode"]["default"]["parallelism"] == {}
    assert spec["properties"]["decode"]["default"]["maxNumSeqs"] == 256
    assert "default" not in spec["properties"]["prefill"]
    assert "default" not in spec, "no default spec: the defaults alone are not a valid pool"
    assert schema["required"] == ["spec"]
    for path, node in _nodes(schema):
        if isinstance(node.get("default"), dict) and "properties" in node:
            assert apply_defaults(node, {}) == node["default"], path
            assert violations(node["default"], node) == [], path


def test_names_avoid_the_gateway_inference_extension_kind() -> None:
    spec = crd()["spec"]
    assert crd()["metadata"]["name"] == "inferencepools.kvrail.dev"
    assert spec["names"]["shortNames"] == ["kvpool"]
    assert spec["names"]["categories"] == ["kvrail"]
    assert spec["group"] == "kvrail.dev"
    assert spec["versions"][0]["name"] == "v1alpha1"


def test_printer_columns_and_scale_paths_point_at_schema_fields() -> None:
    version = crd()["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    for column in version["additionalPrinterColumns"]:
        path = column["jsonPath"].split("[")[0]
        if not path.startswith(".metadata"):
            _lookup(schema, path)
    scale = version["subresources"]["scale"]
    assert _lookup(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _lookup(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _lookup(schema, scale["labelSelectorPath"])["type"] == "string"
    assert version["subresources"]["status"] == {}


def test_every_cel_field_path_names_a_schema_field() -> None:
    for _path, node in _nodes(openapi_schema()):
        for entry in node.get("x-kubernetes-validations", []):
            assert entry["message"], entry
            if "fieldPath" in entry:
                _lookup(node, entry["fieldPath"])


def test_conditions_are_a_map_list_keyed_by_type() -> None:
    conditions = openapi_schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["x-kubernetes-list-map-keys"] == ["type"]
    assert set(conditions["items"]["required"]) >= {"type", "status", "reason"}


def test_rendered_yaml_has_no_anchors_and_parses_back() -> None:
    text = render()
    assert "&id" not in text
    assert "*id" not in text
    assert yaml.safe_load(text) == crd()


def test_api_version_is_group_and_version() -> None:
    from kvrail.crd.pool import API_VERSION, GROUP, VERSION

    assert f"{GROUP}/{VERSION}" == API_VERSION
