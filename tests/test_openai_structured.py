"""Structured outputs and tool calls through the OpenAI frontend, with the official SDK, the real tritonserver
and the real SmolLM2 (shares test_openai_frontend's frontend and the test run's server)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from test_openai_frontend import client  # noqa: F401  (a module-scoped fixture; frontend comes from conftest)

pytestmark = pytest.mark.server

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "required": ["timezone"], "properties": {"timezone": {"type": "string", "maxLength": 30}}}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def test_json_schema_completions_at_temperature_1_all_validate(client):
    choices = []
    for seed in (7, 8):  # 2 x n=10 (the engine's n is at most 16)
        reply = client.chat.completions.create(
            model="llm", messages=[{"role": "user", "content": "Describe a person as JSON."}], n=10,
            temperature=1.0, seed=seed, max_completion_tokens=200,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
        choices += reply.choices
    assert len(choices) == 20
    for choice in choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_with_a_schema_enforces_that_schema(client):
    """llama.cpp's form, which instructor's JSON_SCHEMA mode sends."""
    reply = client.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "Describe a person as JSON."}], n=4, temperature=1.0,
        seed=11, max_completion_tokens=200, response_format={"type": "json_object", "schema": PERSON})
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_regex_and_choice_hold(client):
    reply = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "A JSON object about cats."}],
                                           response_format={"type": "json_object"}, max_completion_tokens=60,
                                           temperature=0.8, seed=3)
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut at max tokens: still the start of an object
        assert reply.choices[0].message.content.startswith("{")
    out = client.completions.create(model="llm", prompt="My phone number is", max_tokens=20, n=3, temperature=1.0,
                                    seed=5, extra_body={"structured_outputs": {"regex": r" \d{3}-\d{4}"}})
    for choice in out.choices:
        assert re.fullmatch(r" \d{3}-\d{4}", choice.text), choice.text
    out = client.completions.create(model="llm", prompt="The capital of Italy is", max_tokens=10, n=3,
                                    temperature=1.0, seed=6,
                                    extra_body={"structured_outputs": {"choice": [" Rome", " Milan", " Turin"]}})
    assert {c.text for c in out.choices} <= {" Rome", " Milan", " Turin"}


def test_invalid_schema_is_a_400_and_the_server_keeps_serving(client):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=ASK_WEATHER, max_completion_tokens=5,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nonsense"}}})
    assert "invalid structured_outputs.json" in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="llm", prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "(["}})
    assert client.completions.create(model="llm", prompt="Hello", max_tokens=3).choices[0].text


def _arguments_valid(call, tool) -> dict:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_call_is_valid_and_streams_to_the_same_call(client, tool_choice):
    kwargs = dict(model="llm/1", messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice=tool_choice,
                  temperature=0, max_completion_tokens=80, parallel_tool_calls=False)
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    finish_reason = "tool_calls" if tool_choice == "required" else "stop"  # as OpenAI and vLLM
    assert choice.finish_reason == finish_reason and len(choice.message.tool_calls) >= 1
    call = choice.message.tool_calls[0]
    tool = WEATHER if call.function.name == "get_weather" else TIME
    arguments = _arguments_valid(call, tool)
    if tool_choice != "required":
        assert call.function.name == "get_weather"

    calls: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = delta.id or entry["id"]
                entry["name"] += (delta.function.name or "") if delta.function else ""
                entry["arguments"] += (delta.function.arguments or "") if delta.function else ""
    assert reasons[-1] == finish_reason and [r for r in reasons if r] == [finish_reason]
    assert calls[0]["name"] == call.function.name and json.loads(calls[0]["arguments"]) == arguments
    assert calls[0]["id"].startswith("call_")


def test_sdk_stream_helper_assembles_every_choices_forced_call_with_its_logprobs(client):
    """Every choice's role chunk first (index order), the calls' logprobs kept while the parser holds the reply,
    the finish reason in an empty delta of its own: what the SDK's stream helper needs (it fires
    ``arguments.done`` on the finish chunk, and indexes choices by their first chunks)."""
    kwargs = dict(model="llm/1", messages=ASK_WEATHER, tools=[WEATHER, TIME], tool_choice="required", temperature=0,
                  max_completion_tokens=80, parallel_tool_calls=False, logprobs=True, top_logprobs=1)
    whole = client.chat.completions.create(**kwargs).choices[0]
    expected = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    chunks = list(client.chat.completions.create(**kwargs, n=2, stream=True))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]] == [(0, "assistant"), (1, "assistant")]
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[-1].finish_reason == "tool_calls" and not mine[-1].delta.tool_calls
        streamed = [entry for c in mine if c.logprobs for entry in c.logprobs.content]
        assert [e.token for e in streamed] == [e.token for e in whole.logprobs.content]
    with client.chat.completions.stream(**kwargs, n=2) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert events.count("tool_calls.function.arguments.done") == 2
    assert [c.index for c in final.choices] == [0, 1]
    for choice in final.choices:
        assert choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == expected


def test_auto_tool_choice_parses_hermes_blocks_or_answers_in_text(client):
    reply = client.chat.completions.create(model="llm/1", messages=ASK_WEATHER, tools=[WEATHER], temperature=0,
                                           max_completion_tokens=80)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_weather"
        json.loads(choice.message.tool_calls[0].function.arguments)
    else:
        assert choice.message.content and "<tool_call>" not in choice.message.content
    # The answer to a tool call goes back as a tool message and is rendered for the model.
    follow = client.chat.completions.create(
        model="llm/1", max_completion_tokens=20, temperature=0, tools=[WEATHER], tool_choice="none",
        messages=[*ASK_WEATHER, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                  {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}])
    assert follow.choices[0].message.content and follow.choices[0].finish_reason in ("stop", "length")


def test_bad_tool_requests_are_400(client):
    for kwargs, word in [(dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "nope"),
                         (dict(tool_choice="required"), "needs tools"),
                         (dict(tools=[{"type": "function", "function": {}}]), "tools[0]"),
                         (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
                          "drop response_format")]:
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="llm", messages=ASK_WEATHER, max_completion_tokens=5, **kwargs)
        assert word in bad.value.body["message"]


@pytest.mark.parametrize("keyword, path, schema", [
    ("uniqueItems", "$.properties.tags", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3, "uniqueItems": True}}}),
    ("multipleOf", "$", {"type": "number", "multipleOf": 0.5}),
    ("pattern", "$.properties.code", {"type": "object", "properties": {"code": {
        "type": "string", "pattern": "^(?=.*\\d)[a-z0-9]{6}$"}}, "required": ["code"]}),
    ("allOf", "$", {"allOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 9}]}),
    ("if", "$", {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 6}}),
    ("contains", "$.items", {"type": "array", "items": {"type": "array", "items": {"type": "integer"},
                                                         "contains": {"const": 7}}}),
])
def test_unenforced_keyword_is_a_400_naming_it_and_its_path(client, keyword, path, schema):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model="llm", messages=ASK_WEATHER, max_completion_tokens=5,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "x", "strict": True, "schema": schema}})
    assert f"invalid structured_outputs.json: {keyword} at {path}: " in bad.value.body["message"]
    with pytest.raises(openai.BadRequestError) as bad:  # vLLM's field: the same check
        client.completions.create(model="llm", prompt="x", max_tokens=5, extra_body={"structured_outputs": {"json": schema}})
    assert f"{keyword} at {path}: " in bad.value.body["message"]


def test_deep_or_huge_schema_is_a_quick_400(client):
    import time

    deep = {"type": "integer"}
    for _ in range(200):
        deep = {"type": "array", "items": deep}
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 100} for i in range(1000)}}
    for schema, message in [(deep, "nests deeper than 32"), (huge, "bytes; at most 65536")]:
        start = time.monotonic()
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model="llm", messages=ASK_WEATHER, max_completion_tokens=5,
                                           response_format={"type": "json_schema",
                                                            "json_schema": {"name": "x", "schema": schema}})
        assert message in bad.value.body["message"]
        assert time.monotonic() - start < 5.0


def test_a_schema_within_the_documented_limit_is_enforced_and_the_sampling_json_cap_names_its_field(client):
    """structured_outputs_max_schema_bytes (65536 by default) is the limit a schema meets, not the JSON around it."""
    from openai_frontend.errors import OpenAIError
    from openai_frontend.triton_stream import _sampling_json

    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "d" * 60} for i in range(600)},
              "required": ["p0"], "additionalProperties": False}
    assert 60_000 < len(json.dumps(schema)) < 65_536
    answer = client.chat.completions.create(model="llm", messages=ASK_WEATHER, max_completion_tokens=4,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "x", "schema": schema}})
    assert re.match(r'\{"p\d', answer.choices[0].message.content), answer.choices[0].message.content  # a property
    with pytest.raises(OpenAIError, match="the largest is logit_bias, 5") as refused:
        _sampling_json({"max_tokens": 5, "logit_bias": {str(i): 1.5 for i in range(400_000)}})
    assert refused.value.status == 400 and refused.value.param == "logit_bias"
