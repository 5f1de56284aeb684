"""The frontend's API key and request bounds, and the admin key's sources, without a tritonserver.

The frontend is served by uvicorn in-process on a free port and pointed at a Triton address where nothing
listens: every check here answers before Triton would be asked. With a server: tests/test_triton_security.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests

from openai_frontend.app import FrontendConfig, create_app
from openai_frontend.auth import load_api_key
from openai_frontend.limits import Limits
from serve import control
from serve.launch import REPO_ROOT
from triton_server import eventually, free_port, serve_app, status_before_the_body

KEY = "test-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 1 << 20


@pytest.fixture(scope="module")
def frontend():
    config = FrontendConfig(triton_url=f"127.0.0.1:{free_port()}", api_key=KEY,
                            limits=Limits(max_request_body_bytes=LIMIT, max_prompts_per_request=16))
    with serve_app(create_app(config)) as url:
        yield url


def test_api_key_missing_or_wrong_is_401_in_openai_shape(frontend):
    missing = requests.get(f"{frontend}/v1/models", timeout=10)
    wrong = requests.get(f"{frontend}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    raw = requests.get(f"{frontend}/v1/models", headers={"Authorization": KEY}, timeout=10)  # no "Bearer "
    for response in (missing, wrong, raw):
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
    assert "didn't provide an API key" in missing.json()["error"]["message"]
    assert wrong.json()["error"]["message"] == "Incorrect API key provided."


def test_right_key_passes_and_health_and_metrics_paths_stay_open(frontend):
    # Past the key, /v1/models asks Triton, which is not there: 503 from the route, not 401.
    assert requests.get(f"{frontend}/v1/models", headers=AUTH, timeout=30).status_code == 503
    for scheme in ("bearer", "BEARER"):  # the scheme's name is case-insensitive; the key is not
        assert requests.get(f"{frontend}/v1/models", headers={"Authorization": f"{scheme} {KEY}"},
                            timeout=30).status_code == 503
    assert requests.get(f"{frontend}/v1/models", headers={"Authorization": f"Bearer {KEY.upper()}"},
                        timeout=30).status_code == 401
    down = requests.get(f"{frontend}/health", timeout=30)
    assert down.status_code == 503 and down.headers["retry-after"] == "1"  # open: Triton is down
    assert requests.head(f"{frontend}/health", timeout=30).status_code == 503  # health checkers that use HEAD
    assert requests.get(f"{frontend}/metrics", timeout=10).status_code != 401


def test_docs_and_schema_need_the_key(frontend):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert requests.get(f"{frontend}{path}", timeout=10).status_code == 401, path
    assert requests.get(f"{frontend}/openapi.json", headers=AUTH, timeout=10).json()["openapi"]


def test_unauthenticated_large_body_is_refused_without_reading_it(frontend):
    status, _ = status_before_the_body(frontend, "/v1/chat/completions", 50 << 20, {})
    assert status == 401
    response = requests.post(f"{frontend}/v1/chat/completions", data=b"x" * (50 << 20), timeout=30)
    assert response.status_code == 401


def test_body_over_the_limit_is_413_from_content_length(frontend):
    headers = {**AUTH, "Content-Type": "application/json"}
    status, answer = status_before_the_body(frontend, "/v1/chat/completions", 50 << 20, headers)
    assert status == 413 and b"request_too_large" in answer, answer[:300]
    response = requests.post(f"{frontend}/v1/chat/completions", data=b"x" * (50 << 20), timeout=30, headers=headers)
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and f"{50 << 20} bytes; at most {LIMIT}" in error["message"]


def test_a_compressed_body_is_415_not_read_as_json(frontend):
    """Nothing here decodes a Content-Encoding: a gzip body once came back as "not valid UTF-8", a deflate header on
    a plain body was ignored."""
    import gzip

    body = json.dumps({"model": "llm", "prompt": "hi", "max_tokens": 1}).encode()
    for encoding, data in (("gzip", gzip.compress(body)), ("deflate", body), ("br", body)):
        response = requests.post(f"{frontend}/v1/completions", data=data, timeout=30, headers={
            **AUTH, "Content-Type": "application/json", "Content-Encoding": encoding})
        assert response.status_code == 415, (encoding, response.text)
        assert response.json()["error"]["message"] == (f"Content-Encoding '{encoding}' is not supported: send the "
                                                       "body uncompressed")
    identity = requests.post(f"{frontend}/v1/completions", data=body, timeout=30, headers={
        **AUTH, "Content-Type": "application/json", "Content-Encoding": "identity"})
    assert identity.status_code == 503  # past the gate, on to Triton (down here)


def test_chunked_body_over_the_limit_is_413_once_it_passes_the_limit(frontend):
    def chunks():
        for _ in range(64):  # 64 MiB offered in 1 MiB chunks, without Content-Length
            yield b"x" * (1 << 20)

    response = requests.post(f"{frontend}/v1/chat/completions", data=chunks(), timeout=30,
                             headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 413, response.text
    message = response.json()["error"]["message"]
    assert "request body is over" in message
    assert int(message.split()[4]) < LIMIT + (1 << 20)  # counted up to the chunk that passed the limit, no further


def test_chunked_body_under_the_limit_reaches_the_route(frontend):
    body = json.dumps({"model": "llm", "prompt": ["a"] * 17}).encode()
    response = requests.post(f"{frontend}/v1/completions", data=iter([body[:10], body[10:]]), timeout=30,
                             headers={**AUTH, "Content-Type": "application/json"})
    assert response.status_code == 400 and "17 completions" in response.json()["error"]["message"]


def test_too_many_completions_per_request_is_400(frontend):
    def post(path, **body):
        return requests.post(f"{frontend}{path}", json={"model": "llm", **body}, headers=AUTH, timeout=30)

    prompts = post("/v1/completions", prompt=["Hello"] * 2000)
    assert prompts.status_code == 400
    error = prompts.json()["error"]
    assert error["param"] == "prompt" and "2000 completions (2000 prompt(s) times n=1); at most 16" in \
        error["message"]
    assert post("/v1/completions", prompt=["Hello"] * 4, n=5).status_code == 400  # 20 > 16
    assert post("/v1/chat/completions", messages=[{"role": "user", "content": "hi"}], n=17).status_code == 400
    assert post("/v1/completions/render", prompt=["Hello"] * 17).status_code == 400
    assert post("/v1/completions", prompt=["Hello"] * 4, n=4).status_code == 503  # 16: on to Triton (down)


@pytest.mark.parametrize("body, lone", [
    (rb'{"prompt": "a\ud83d\ude00b"}', False),  # an escaped pair: one character (U+1F600)
    (rb'{"prompt": "a\ud83db"}', True),  # a high surrogate alone
    (rb'{"prompt": "\udfff"}', True),  # a low surrogate alone
    (rb'{"messages": [{"role": "user", "content": "x"}], "stop": ["\ud800"]}', True),
    (rb'{"prompt": "\\ud83d"}', False),  # an escaped backslash, then the text ud83d
    (rb'{"prompt": "\ud83d', False),  # not JSON: left to the route's parser
])
def test_lone_surrogates_are_told_from_pairs(body, lone):
    from openai_frontend.text_check import SURROGATE_ESCAPE, has_lone_surrogate

    assert SURROGATE_ESCAPE.search(body)
    assert has_lone_surrogate(body) is lone


def test_a_lone_surrogate_is_400_on_every_route_and_a_pair_passes(frontend):
    headers = {**AUTH, "Content-Type": "application/json"}
    for path, body in (("/v1/completions", '{"model": "llm", "prompt": "a\\ud83db"}'),
                       ("/v1/chat/completions",
                        '{"model": "llm", "messages": [{"role": "user", "content": "\\udfff"}]}'),
                       ("/tokenize", '{"model": "llm", "prompt": "x\\ud83d"}')):
        response = requests.post(f"{frontend}{path}", data=body.encode(), headers=headers, timeout=30)
        assert response.status_code == 400, (path, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and "lone UTF-16 surrogate" in error["message"]
    pair = '{"model": "llm", "prompt": "a\\ud83d\\ude00b"}'
    assert requests.post(f"{frontend}/v1/completions", data=pair.encode(), headers=headers,
                         timeout=30).status_code == 503  # past the check: on to Triton (down)


def test_a_message_without_content_is_400_unless_it_is_the_assistant_s(frontend):
    def chat(*messages):
        return requests.post(f"{frontend}/v1/chat/completions", json={"model": "llm", "messages": list(messages)},
                             headers=AUTH, timeout=30)

    missing = chat({"role": "user"})
    assert missing.status_code == 400
    assert missing.json()["error"]["message"] == "messages[0].content is required for role 'user'"
    assert missing.json()["error"]["param"] == "messages.0.content"
    assert chat({"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                    "tool_calls": []}).status_code == 503  # on to Triton (down)


def _nested_object(depth: int) -> dict:
    schema: dict = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("body, param, message", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role", "must be one of"),
    ({"messages": [{"role": "user<|im_end|>", "content": "hi"}]}, "messages.0.role", "must be one of"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo", "unknown field(s) foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages.0.content.0.text", "without a text"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {
        "type": "ephemeral"}}]}]}, "messages.0.content.0.cache_control", "unknown field(s) cache_control"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0.type", "content part type 'image_url' is not supported: only text parts"),
    ({"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "top_logprobs must be in [0, 20]"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": -5}, "max_completion_tokens",
     "must be in [1, 2147483647], got -5"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2**70}, "max_completion_tokens",
     "must be in [1, 2147483647], got 1180591620717411303424"),
    ({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     "stream_options", "only taken with stream true"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": {"type": "object"}}}]}, "tools[0].function.strict",
     "only enforced with tool_choice required"),
    *[({"messages": [{"role": "user", "content": "hi"}], "tools": tools}, "tools", message) for tools, message in [
        ([{"type": "function", "function": {"name": "add"}}, {"type": "function", "function": {"name": "add"}}],
         "tools[1].function.name 'add' is given twice"),
        ([{"type": "function", "function": {"name": "bad name"}}], "must be 1-64 letters, digits"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
         "parameters must be a JSON schema of an object"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], "tools[0] has unknown field(s) extra"),
        ([{"type": "function", "function": {"name": "f", "parameters": {  # tool_choice auto: not enforced, but read
            "type": "object", "properties": {"x": {"type": "banana"}}}}}],
         "tools[0].function.parameters: not a valid JSON schema at $.properties.x.type: 'banana'"),
        ([{"type": "function", "function": {"name": "f", "parameters": _nested_object(150)}}],
         "tools[0].function.parameters: not a valid JSON schema: it nests too deeply to check"),
        ([{"type": "function", "function": {"name": "f", "bogus": 1}}],
         "tools[0].function has unknown field(s) bogus")]],
    ({"messages": [{"role": "user", "content": "hi", "name": {"first": "x"}}]}, "messages.0.name",
     "messages[0].name must be a string, got dict"),
    ({"messages": [{"role": "tool", "content": "3", "tool_call_id": [1, 2]}]}, "messages.0.tool_call_id",
     "messages[0].tool_call_id must be a string, got list"),
    *[({"messages": [{"role": "user", "content": "hi"}], "response_format": fmt}, "response_format", message)
      for fmt, message in [
          ({"type": "json_object", "schema": "{}"}, "json_object's schema must be a JSON schema object"),
          ({"type": "text", "schema": {}}, "type text takes no schema"),
          ({}, "type must be text, json_object or json_schema, got None"),
          ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "needs json_schema.name"),
          ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "bogus": 1}},
           "json_schema has unknown field(s) bogus"),
          ({"type": "json_schema", "json_schema": {"name": "has space!", "schema": {}}},
           "json_schema.name must be 1-64 letters, digits, underscores or dashes, got 'has space!'"),
          ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "banana"}},
           "json_schema.strict must be a boolean, got 'banana'"),
          ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}, "foo": 1}, "takes no foo"),
          ({"type": ["json_object"]}, "type must be text, json_object or json_schema, got ['json_object']")]],
    *[({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": {"type": "function", "function": function}}, "tool_choice", "tool_choice must be none, auto")
      for function in ("f", [1], 5)],
])
def test_chat_requests_that_would_be_silently_misread_are_400_naming_the_field(frontend, body, param, message):
    response = requests.post(f"{frontend}/v1/chat/completions", json={"model": "llm", **body}, headers=AUTH,
                             timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path, body, param, code, message", [
    ("/v1/chat/completions", {"messages": HI, "reasoning_effort": "low"}, "reasoning_effort", "unsupported_parameter",
     "reasoning_effort is not supported by this server"),
    ("/v1/chat/completions", {"messages": HI, "use_beam_search": True}, "use_beam_search", "unsupported_parameter",
     "use_beam_search True is not supported: only its default, False"),
    ("/v1/chat/completions", {"messages": HI, "echo": True}, "echo", "unsupported_parameter", "echo is not supported"),
    ("/v1/completions", {"prompt": "hi", "return_token_ids": True}, "return_token_ids", "unsupported_parameter",
     "return_token_ids True is not supported"),
    ("/v1/chat/completions", {"messages": HI, "bogus": 1}, "bogus", "invalid_request",
     "Unrecognized request argument supplied: bogus"),
])
def test_fields_that_ask_for_what_is_not_done_are_400_saying_so(frontend, path, body, param, code, message):
    response = requests.post(f"{frontend}{path}", json={"model": "llm", **body}, headers=AUTH, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == (param, code) and message in error["message"], error


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": HI, "use_beam_search": False, "length_penalty": 1.0, "echo": False,
                              "include_reasoning": True, "return_token_ids": False, "add_special_tokens": True,
                              "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True}),
    ("/v1/completions", {"prompt": "hi", "use_beam_search": False, "add_special_tokens": True,
                         "return_token_ids": False}),
])
def test_vllm_fields_at_their_defaults_reach_the_model(frontend, path, body):
    # A client that sends every field of vLLM's request gets past the checks (to Triton, absent here: 503).
    response = requests.post(f"{frontend}{path}", json={"model": "llm", **body}, headers=AUTH, timeout=30)
    assert response.status_code == 503, response.text


@pytest.mark.parametrize("prompt", [[1.5], ["Hi", [1]], {"text": "Hi"}])
def test_a_completion_prompt_of_no_accepted_shape_is_400_listing_the_shapes(frontend, prompt):
    response = requests.post(f"{frontend}/v1/completions", json={"model": "llm", "prompt": prompt}, headers=AUTH,
                             timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["message"] == (
        "prompt: must be a string, a list of strings, a list of token ids (integers) or a list of token-id lists, "
        "one shape for the whole list")


@pytest.mark.parametrize("body, param, message", [
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be at least 1, got 0"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "text.format.name",
     "needs name"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "bogus": 1}}}, "text.format",
     "takes no bogus"),
    ({"text": {"format": {"type": "json_object", "schema": {}}}}, "text.format", "takes no schema"),
    ({"text": {"format": "json_object"}}, "text.format", "text.format must be an object with a type"),
    ({"text": {"format": {"type": ["json_object"]}}}, "text.format.type", "must be text, json_object or json_schema"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role", "must be user, system, developer or assistant"),
    ({"input": [{"type": ["message"], "role": "user", "content": "hi"}]}, "input[0].type", "is not supported"),
    ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input[0].content[0].type",
     "is not supported"),
])
def test_responses_requests_that_would_be_silently_misread_are_400_naming_the_field(frontend, body, param, message):
    response = requests.post(f"{frontend}/v1/responses", json={"model": "llm", "input": "hi", **body}, headers=AUTH,
                             timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]


@pytest.mark.parametrize("messages, param", [
    ([{"content": "Hi"}], "messages.0.role"), ([{"role": 5}], "messages.0.role"),
    ([{"role": "user", "content": 5}], "messages.0.content"),
])
def test_tokenize_refuses_messages_as_chat_does(frontend, messages, param):
    for route in ("/tokenize", "/v1/chat/completions"):
        response = requests.post(f"{frontend}{route}", json={"model": "llm", "messages": messages}, headers=AUTH,
                                 timeout=30)
        assert response.status_code == 400, (route, response.text)
        assert response.json()["error"]["param"] == param, (route, response.json())


def test_assistant_turns_without_content_render_and_strict_tools_pass_where_enforced(frontend, tokenizer):
    from openai_frontend.chat_template import render_chat
    from openai_frontend.protocol import ChatCompletionRequest

    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "refusal": "no"},
             {"role": "assistant"}, {"role": "user", "content": "ok"}]
    body = ChatCompletionRequest.model_validate({"model": "llm", "messages": turns})
    body.check()
    assert "<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n<|im_end|>" in render_chat(tokenizer, body, None)
    strict = {"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}, "none"):
        response = requests.post(f"{frontend}/v1/chat/completions", headers=AUTH, timeout=30, json={
            "model": "llm", "messages": turns, "tools": [strict], "tool_choice": choice})
        assert response.status_code == 503, response.text  # past the checks: on to Triton (down)


def test_open_render_leaves_only_the_render_routes_open():
    config = FrontendConfig(triton_url=f"127.0.0.1:{free_port()}", api_key=KEY, open_render=True)
    body = {"model": "llm", "prompt": "hi", "max_tokens": 1}
    with serve_app(create_app(config)) as url:
        assert requests.post(f"{url}/v1/completions/render", json=body, timeout=30).status_code == 503  # past it
        chat = {"model": "llm", "messages": [{"role": "user", "content": "hi"}]}
        assert requests.post(f"{url}/v1/chat/completions/render", json=chat, timeout=30).status_code == 503
        assert requests.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
        assert requests.post(f"{url}/tokenize", json=body, timeout=30).status_code == 401


def test_api_key_sources(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert load_api_key(env={}) is None
    assert load_api_key("flag", env={"LLM_API_KEY": "env"}) == "flag"
    assert load_api_key(None, key_file, env={"LLM_API_KEY": "env"}) == "from-file"
    assert load_api_key(env={"LLM_API_KEY": "env"}) == "env"
    assert load_api_key(env={"LLM_API_KEY_FILE": str(key_file)}) == "from-file"
    with pytest.raises(ValueError, match="both set"):
        load_api_key("flag", key_file, env={})
    with pytest.raises(ValueError, match="both set"):
        load_api_key(env={"LLM_API_KEY": "a", "LLM_API_KEY_FILE": str(key_file)})
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="empty"):
        load_api_key(None, tmp_path / "empty", env={})
    with pytest.raises(ValueError, match="whitespace"):
        load_api_key("two words", env={})
    with pytest.raises(ValueError, match="--api-key is empty"):  # not silently "no key": every route open
        load_api_key("", env={})
    assert load_api_key(env={"LLM_API_KEY": ""}) is None  # an empty variable is unset (Compose passes it so)


def test_admin_key_sources_and_the_flags_that_carry_it(tmp_path):
    key_file = tmp_path / "admin"
    key_file.write_text("admin-from-file\n")
    assert control.admin_key({"TRITON_ADMIN_KEY": "admin-env"}) == "admin-env"
    assert control.admin_key({"TRITON_ADMIN_KEY_FILE": str(key_file)}) == "admin-from-file"
    first, second = control.admin_key({}), control.admin_key({})
    assert first != second and len(first) == 43  # 32 random bytes per start
    for bad in ("a:b", "a=b", "a,b", "a b"):
        with pytest.raises(ValueError, match="must be non-empty"):
            control.admin_key({"TRITON_ADMIN_KEY": bad})
    assert control.restriction_args("k") == [
        "--http-restricted-api=model-repository,shared-memory,logging,trace:triton-admin-key=k",
        "--grpc-restricted-protocol=model-repository,shared-memory,logging,trace:triton-admin-key=k"]
    assert control.admin_headers("k", grpc=True) == {"triton-grpc-protocol-triton-admin-key": "k"}


@pytest.mark.parametrize("argv, env, message", [
    # tritonserver binds a port modulo 65536, where the launcher's drain and health requests would not find it.
    (["--http-port", "70000"], {}, "argument --http-port: 70000 is not a port: 1-65535"),
    (["--openai-port", "-1"], {}, "argument --openai-port: -1 is not a port: 0-65535"),
    ([], {"GRPC_PORT": "abc"}, "argument --grpc-port: 'abc' is not a port number"),
    # A wait that ends at once stops tritonserver with requests in flight (the drain is skipped).
    (["--drain-timeout-secs", "-1"], {}, "argument --drain-timeout-secs: -1 is not a wait"),
    (["--drain-timeout-secs", "nan"], {}, "argument --drain-timeout-secs: nan is not a wait"),
])
def test_launcher_flags_out_of_range_are_refused_before_anything_starts(argv, env, message):
    result = subprocess.run([sys.executable, "-m", "serve", *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={**os.environ, **env}, timeout=60)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert "+ " not in result.stdout  # no command was started


@pytest.mark.parametrize("argv, message", [
    (["--api-key="], "--api-key is empty"),  # not "no key": every route would be open
    (["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template: [Errno 2]"),
    (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: model '/nonexistent' is neither"),
])
def test_frontend_flags_that_cannot_work_are_refused_before_it_serves(argv, message):
    result = subprocess.run([sys.executable, "-m", "openai_frontend", "--port", str(free_port()), *argv],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                            env={k: v for k, v in os.environ.items() if k not in ("LLM_API_KEY", "LLM_API_KEY_FILE")})
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.parametrize("child, status", [
    # uvicorn's way: on SIGTERM, shut down, then re-raise the signal (killed by SIGTERM, status -15).
    ("import signal, time; signal.signal(signal.SIGTERM, lambda *a: (signal.signal(signal.SIGTERM, "
     "signal.SIG_DFL), signal.raise_signal(signal.SIGTERM))); time.sleep(60)", 0),
    ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(3)); time.sleep(60)", 3),
])
def test_sigterm_to_the_launcher_loop_exits_0_when_children_stop_cleanly(child, status):
    script = ("import sys; from serve.launch import run_together; "
              f"sys.exit(run_together([[sys.executable, '-c', {child!r}]], None))")
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT)
    try:
        # The launcher and its child both answer SIGTERM their own way: signal once both can. (The child is
        # known by its command line: forked but not yet exec'd, it still has the launcher's handlers.)
        eventually(lambda: catches_sigterm(process.pid), "the launcher never caught SIGTERM", timeout_s=30)
        eventually(lambda: any(c.cmdline()[-1:] == [child] and catches_sigterm(c.pid)
                               for c in psutil.Process(process.pid).children()),
                   "the launcher's child never caught SIGTERM", timeout_s=30)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == status
    finally:
        process.kill()
        process.wait()


def test_a_sigterm_while_the_launcher_starts_its_children_stops_it_cleanly():
    """The launcher catches SIGTERM before it starts its children: one that comes meanwhile starts no more of
    them, stops those started, and the launcher exits 0 without a drain."""
    from serve.supervise import Child, Supervisor

    class SignalledAtStart(Child):
        def start(self) -> None:
            super().start()
            os.kill(os.getpid(), signal.SIGTERM)

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    first, second = SignalledAtStart("first", sleeper), Child("second", sleeper)
    drains, handler = [], signal.getsignal(signal.SIGTERM)
    assert Supervisor([first, second], drain=drains.append).run() == 0
    assert first.process.returncode == -signal.SIGTERM and second.process is None and drains == []
    assert signal.getsignal(signal.SIGTERM) is handler  # the launcher's handlers are gone again


def catches_sigterm(pid: int) -> bool:
    """Whether process ``pid`` has a SIGTERM handler of its own (bit 15 of ``SigCgt`` in /proc/<pid>/status);
    False for a process that is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    except FileNotFoundError:
        return False
    return bool(caught & 1 << (signal.SIGTERM - 1))


DRAIN_SCRIPT = """
import sys, time
from serve.launch import run_together

def drain(cut_short):
    end = time.monotonic() + 3
    while time.monotonic() < end:
        if cut_short():
            print("cut short", flush=True)
            return False
        time.sleep(0.05)
    print("drained", flush=True)
    return True

sys.exit(run_together([[sys.executable, "-c", "import time; time.sleep(60)"]], None, drain=drain))
"""


@pytest.mark.parametrize("gap_s, outcome", [(0.01, "drained"), (1.5, "cut short")])
def test_a_repeated_sigterm_cuts_the_drain_short_only_when_it_comes_a_second_later(gap_s, outcome):
    """``make serve`` forwards its SIGTERM to the launcher, which a SIGTERM to the process group has reached
    already: two signals close together are one request to stop, and the drain runs to its end."""
    process = subprocess.Popen([sys.executable, "-c", DRAIN_SCRIPT], cwd=REPO_ROOT, stdout=subprocess.PIPE,
                               text=True)
    try:
        # A signal before the child starts would stop the launcher with nothing to drain.
        eventually(lambda: catches_sigterm(process.pid), "the launcher never caught SIGTERM", timeout_s=30)
        eventually(lambda: psutil.Process(process.pid).children(), "the launcher started no child", timeout_s=30)
        process.send_signal(signal.SIGTERM)
        time.sleep(gap_s)
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=30)
        assert out.split() == outcome.split() and process.returncode == 0
    finally:
        process.kill()
        process.wait()


def test_a_body_that_is_not_json_is_a_400_that_says_why(frontend):
    cut = requests.post(f"{frontend}/v1/chat/completions", data='{"model":"llm","messages":[{"role":"user"',
                        headers={**AUTH, "Content-Type": "application/json"}, timeout=10)
    assert cut.status_code == 400
    error = cut.json()["error"]
    assert error["message"].startswith("the body is not valid JSON (at character ") and error["param"] is None
    form = requests.post(f"{frontend}/v1/completions", data='{"model":"llm","prompt":"hi","max_tokens":2}',
                         headers={**AUTH, "Content-Type": "application/x-www-form-urlencoded"}, timeout=10)  # curl -d
    assert form.status_code == 400
    assert form.json()["error"]["message"] == ("the body must be a JSON object sent with Content-Type: "
                                               "application/json (got application/x-www-form-urlencoded)")
    for body in (b'{"model": "llm", "prompt": "\xff\xfe"}', b"[" * 100_000 + b"]" * 100_000,  # not UTF-8; too deep
                 b'{"model": "llm", "prompt": "hi", "max_tokens": 1' + b"0" * 5000 + b"}"):  # past int's digit limit
        response = requests.post(f"{frontend}/v1/completions", data=body,
                                 headers={**AUTH, "Content-Type": "application/json"}, timeout=10)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_request"
        assert "not valid UTF-8, or it nests too deeply, or it holds an integer of over 4300 digits" in \
            response.json()["error"]["message"]
    empty = requests.post(f"{frontend}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          timeout=10)
    assert empty.status_code == 400 and empty.json()["error"]["message"] == (
        "the request has no body: send a JSON object with Content-Type: application/json")


@pytest.mark.parametrize("argv, env, message", [
    (["--port", "99999"], {}, "argument --port: a port is 0-65535, got 99999"),
    ([], {"OPENAI_PORT": "abc"}, "argument --port: not a port number: 'abc'"),
])
def test_a_port_out_of_range_is_a_usage_error_not_a_traceback(argv, env, message):
    run = subprocess.run([sys.executable, "-m", "openai_frontend", *argv], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert run.returncode == 2 and message in run.stderr and "Traceback" not in run.stderr, run.stderr
