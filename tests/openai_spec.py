"""OpenAI's OpenAPI document, the part Tandem serves (``tests/data/openai-openapi/``, vendored:
see its SOURCE.md), as the tests use it: JSON Schema validators for its component schemas and
the property names of its request bodies.

The document is OpenAPI 3.1 but still writes OpenAPI 3.0's ``nullable: true`` in places, which
JSON Schema 2020-12 ignores; ``validator`` reads it as 3.0 meant it (null allowed), as OpenAI's
own SDK generators do.
"""
from __future__ import annotations

import copy
import functools
from pathlib import Path

import jsonschema
import yaml

SPEC_DIR = Path(__file__).resolve().parent / "data" / "openai-openapi"
SPEC_PATH = SPEC_DIR / "openapi.yaml"


@functools.cache
def spec() -> dict:
    return yaml.safe_load(SPEC_PATH.read_text())


def _nullable_as_null(node):
    """``{..., nullable: true}`` -> ``{anyOf: [{...}, {type: null}]}``, recursively."""
    if isinstance(node, list):
        return [_nullable_as_null(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable_as_null(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def _root() -> dict:
    return {"components": _nullable_as_null(spec()["components"])}


def validator(schema_name: str, patch: dict | None = None) -> jsonschema.Draft202012Validator:
    """A validator for ``#/components/schemas/{schema_name}``. ``patch``: properties of that
    schema replaced (a test's documented relaxation), {property: schema}."""
    root = _root()
    if patch:
        schema = dict(root["components"]["schemas"][schema_name])
        schema["properties"] = {**schema["properties"], **_nullable_as_null(patch)}
        root = {"components": {**root["components"],
                               "schemas": {**root["components"]["schemas"], schema_name: schema}}}
    return jsonschema.Draft202012Validator({**root, "$ref": f"#/components/schemas/{schema_name}"})


def properties(schema_name: str) -> set[str]:
    """Every property name of a component schema, through ``allOf`` and ``$ref``."""
    schemas = spec()["components"]["schemas"]
    names: set[str] = set()

    def walk(node: dict) -> None:
        if "$ref" in node:
            walk(schemas[node["$ref"].rsplit("/", 1)[1]])
        names.update(node.get("properties", {}))
        for part in node.get("allOf", []):
            walk(part)

    walk(schemas[schema_name])
    return names


def echo_logprobs(logprobs: dict) -> dict:
    """``CreateCompletionResponse``'s ``choices[].logprobs`` schema with null allowed among the
    ``token_logprobs`` and ``top_logprobs`` items. With ``echo``, OpenAI (and vLLM) give the
    prompt's first token null in both (no token precedes it to condition on), though the
    specification's item schemas are a number and an object."""
    out = copy.deepcopy(logprobs)
    fields = out["anyOf"][0]["properties"]
    for key in ("token_logprobs", "top_logprobs"):
        fields[key]["items"] = {"anyOf": [fields[key]["items"], {"type": "null"}]}
    return out


def completion_validator() -> jsonschema.Draft202012Validator:
    """``CreateCompletionResponse`` with ``echo_logprobs``' relaxation."""
    return _completion_validator()


def completion_chunk_validator() -> jsonschema.Draft202012Validator:
    """``completion_validator``'s schema with ``finish_reason`` nullable, for streamed chunks:
    OpenAI (and vLLM) send null until a choice's last chunk, though the specification reuses the
    whole response's schema, where it is required and not nullable, for its chunks."""
    reason = _completion_choice()["properties"]["finish_reason"]
    return _completion_validator(finish_reason={**reason, "nullable": True})


def _completion_choice() -> dict:
    return spec()["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]


def _completion_validator(**choice_properties: dict) -> jsonschema.Draft202012Validator:
    """``CreateCompletionResponse`` whose choices have ``echo_logprobs``' logprobs and
    ``choice_properties`` replaced."""
    choice = _completion_choice()
    properties = {**choice["properties"], "logprobs": echo_logprobs(choice["properties"]["logprobs"]),
                  **choice_properties}
    return validator("CreateCompletionResponse", {"choices": {"type": "array", "items": {
        **choice, "properties": properties}}})
