"""OpenAI's ``response_format`` (and vLLM's ``structured_outputs`` extra) -> the model's ``structured_outputs``.

The engine enforces the constraint while sampling (``backend.structured_output``), and refuses (a 400) a
schema keyword it would not enforce, whatever ``strict`` says; this only maps the request's fields. The schema goes as JSON text, so its depth never counts against the nesting limit of
``sampling_parameters``.
"""

from __future__ import annotations

import json
from typing import Any

from openai_frontend.errors import OpenAIError


def structured_outputs(response_format: dict[str, Any] | None, extra: dict[str, Any] | None) -> dict | None:
    """The ``structured_outputs`` sampling parameter for a request, or None for free text.

    Args:
        response_format: OpenAI's ``{"type": "text" | "json_object" | "json_schema", "json_schema":
            {"name", "schema", "strict"}}``.
        extra: vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
            passed through for the engine to check.

    Raises:
        OpenAIError: 400 for an unknown ``type``, a ``json_schema`` without a schema object, or both fields.
    """
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        constraint = None
    elif kind == "json_object":
        constraint = {"json_object": True}
    elif kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if not isinstance(schema, dict):
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema, a JSON schema object",
                              "invalid_value", "response_format")
        constraint = {"json": json.dumps(schema)}
    else:
        raise OpenAIError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                          "invalid_value", "response_format")
    if extra is not None:
        if constraint is not None:
            raise OpenAIError(400, "send response_format or structured_outputs, not both", "invalid_value",
                              "structured_outputs")
        constraint = dict(extra)
        if isinstance(constraint.get("json"), dict):
            constraint["json"] = json.dumps(constraint["json"])
    return constraint
