"""How a refusal's status survives Triton's gRPC stream, which carries only its text: the engine's messages for
"try again" begin as ``backend.errors.UNAVAILABLE_MESSAGE_STARTS`` say, and the frontend reads nothing else; and
an error nothing expected still answers in OpenAI's shape."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from backend.errors import UNAVAILABLE_MESSAGE_STARTS
from openai_frontend.app import FrontendConfig, create_app
from openai_frontend.errors import error_from_triton
from openai_frontend.triton_stream import Delta

REPO = Path(__file__).resolve().parent.parent
UNAVAILABLE_ERRORS = {"EngineUnavailableError", "EngineOverloadedError", "EngineDeadError"}


def _leading_text(node: ast.expr) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return node.values[0].value
    return None  # a variable: its own assignment is a message of this kind (checked where it is built)


def test_every_unavailable_message_raised_begins_as_the_frontend_expects():
    raised = []
    for path in [*REPO.glob("backend/**/*.py"), *REPO.glob("serve/*.py"), REPO / "model_repository/llm/1/model.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in UNAVAILABLE_ERRORS
                    and node.args and (text := _leading_text(node.args[0])) is not None):
                raised.append((path.name, text))
    assert len(raised) >= 5, raised
    for where, text in raised:
        assert text.startswith(UNAVAILABLE_MESSAGE_STARTS), (where, text)


@pytest.mark.parametrize("message, status, code", [
    ("Request for unknown model: 'llm' is not found", 503, "model_not_ready"),
    ("server is full: 9 requests (90 tokens) already waiting, at most 8 requests and 4096 tokens; retry later",
     503, "service_unavailable"),
    ("server is shutting down (the model is being unloaded); retry later", 503, "service_unavailable"),
    ("engine is dead: 3 steps failed in a row (last: forward pass failed: boom)", 503, "service_unavailable"),
    ("the grammar compiler was busy for 10 s (compile_timeout); try again later", 503, "service_unavailable"),
    ("internal error: forward pass failed: boom", 500, "internal_error"),
    # A client's own words quoted in a 400 never make it a 503 (which clients and gateways retry).
    ('invalid structured_outputs.grammar: EBNF parser error at line 1, column 1: The root rule with name "root" '
     "is not found", 400, "invalid_request"),
    ("invalid structured_outputs.json: properties.retry: keyword 'if' is not supported", 400, "invalid_request"),
    ("stop must be non-empty strings, got ['Retry', '']", 400, "invalid_request"),
    ("invalid structured_outputs.json: properties.model x is not found.type: unavailable", 400, "invalid_request"),
])
def test_status_is_read_from_how_the_message_begins(message, status, code):
    error = error_from_triton(message)
    assert (error.status, error.code) == (status, code)


INTERNAL = {"error": {"message": "internal error: the server failed on this request (the details are in its log)",
                      "type": "internal_server_error", "param": None, "code": "internal_error"}}


def test_an_unexpected_exception_is_a_json_500_or_an_error_event_without_its_details():
    app = create_app(FrontendConfig(triton_url="127.0.0.1:1"))

    async def broken():
        raise KeyError("function")  # what a route's bug raises

    async def models():
        return [("llm", "")]

    async def generate(model, version, prompt, sampling, request_id):  # fails after its first delta
        yield Delta(0, "Hel", [1], None, 3, 1, 0)
        raise KeyError("function")

    app.add_api_route("/broken", broken, methods=["POST"])
    app.state.triton.models, app.state.triton.generate = models, generate
    with TestClient(app, raise_server_exceptions=False) as http:
        reply = http.post("/broken", json={})
        assert reply.status_code == 500 and reply.headers["content-type"] == "application/json"
        assert reply.json() == INTERNAL
        body = {"model": "llm", "prompt": "Hi", "max_tokens": 5}
        assert http.post("/v1/completions", json=body).json() == INTERNAL
        events = http.post("/v1/completions", json={**body, "stream": True}).text.split("\n\n")
    assert json.loads(events[0][len("data: "):])["choices"][0]["text"] == "Hel"  # the status line went out
    assert json.loads(events[1][len("data: "):]) == INTERNAL and events[2] == "data: [DONE]"
