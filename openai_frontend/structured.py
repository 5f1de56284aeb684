"""OpenAI's ``response_format`` (and vLLM's ``structured_outputs`` extra) -> the model's ``structured_outputs``.

The engine enforces the constraint while sampling (``backend.structured_output``), and refuses (a 400) a
schema keyword it would not enforce, whatever ``strict`` says; this only maps the request's fields. The schema goes as JSON text, so its depth never counts against the nesting limit of
``sampling_parameters``.
"""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.errors import OpenAIError
from openai_frontend.tool_calls import FUNCTION_NAME  # OpenAI gives schema names the same rule

# json_object's schema: llama.cpp's server takes one there, and instructor's JSON_SCHEMA mode sends it.
FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
JSON_SCHEMA_FIELDS = {"name", "schema", "strict", "description"}


def structured_outputs(response_format: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict | None:
    """The ``structured_outputs`` sampling parameter for a request, or None for free text.

    Args:
        response_format: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema":
            {"name", "schema", "strict"}}``.
        extra: vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
            passed through for the engine to check.

    Raises:
        OpenAIError: 400 for a missing or unknown ``type``, a field the type does not take, a ``json_schema``
            without a ``name`` or a schema object, a ``json_object`` schema that is not an object, or both fields.
    """
    kind = "text" if response_format is None else response_format.get("type")
    if not isinstance(kind, str) or kind not in FORMAT_FIELDS:
        raise OpenAIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "invalid_value", "response_format")
    unknown = sorted(set(response_format or {}) - FORMAT_FIELDS[kind])
    if unknown:
        raise OpenAIError(400, f"response_format type {kind} takes no {', '.join(unknown)}", "invalid_value",
                          "response_format")
    if kind == "text":
        constraint = None
    elif kind == "json_object" and "schema" in response_format:  # as llama.cpp's server: that schema's JSON
        if not isinstance(response_format["schema"], dict):
            raise OpenAIError(400, "response_format json_object's schema must be a JSON schema object",
                              "invalid_value", "response_format")
        constraint = {"json": json.dumps(response_format["schema"])}
    elif kind == "json_object":
        constraint = {"json_object": True}
    else:
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                              "invalid_value", "response_format")
        unknown = sorted(set(spec) - JSON_SCHEMA_FIELDS)
        if unknown:
            raise OpenAIError(400, f"response_format.json_schema has unknown field(s) {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(JSON_SCHEMA_FIELDS))}", "invalid_value", "response_format")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise OpenAIError(400, "response_format json_schema needs json_schema.name, a non-empty string",
                              "invalid_value", "response_format")
        if not FUNCTION_NAME.fullmatch(spec["name"]):
            raise OpenAIError(400, f"response_format json_schema.name must be 1-64 letters, digits, underscores or "
                              f"dashes, got {spec['name'][:80]!r}", "invalid_value", "response_format")
        for field in ("strict", "description"):
            if spec.get(field) is not None and not isinstance(spec[field], bool if field == "strict" else str):
                raise OpenAIError(400, f"response_format json_schema.{field} must be a "
                                  f"{'boolean' if field == 'strict' else 'string'}, got {spec[field]!r:.80}",
                                  "invalid_value", "response_format")
        constraint = {"json": json.dumps(spec["schema"])}
    if extra is not None:
        if constraint is not None:
            raise OpenAIError(400, "send response_format or structured_outputs, not both", "invalid_value",
                              "structured_outputs")
        constraint = dict(extra)
        if isinstance(constraint.get("json"), dict):
            constraint["json"] = json.dumps(constraint["json"])
    return constraint
