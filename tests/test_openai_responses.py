"""``POST /v1/responses`` (openai_frontend/responses.py) with the official ``openai`` SDK, against the test run's
real tritonserver and SmolLM2; the refusals, checked before anything is generated, on the app alone.

Answers compared across calls address ``llm/1``, which runs fp32 (greedy output independent of batching)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
import requests
from fastapi.testclient import TestClient

from openai_frontend.app import FrontendConfig, create_app
from openai_frontend.responses import ResponseBuilder, ResponsesRequest
from test_openai_frontend import wait_idle
from test_tool_calls import SCRIPT, scripted  # noqa: F401  (a module-scoped fixture: the app over a scripted model)
from triton_server import settled

FP32 = "llm/1"
ASK = "Name three primary colors."
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.server
def test_text_response_is_the_chat_answer_with_usage_and_echoed_fields(client):
    response = client.responses.create(model=FP32, instructions="Answer briefly.", input=ASK, max_output_tokens=12,
                                       temperature=0, metadata={"case": "text"})
    chat = client.chat.completions.create(model=FP32, max_completion_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": ASK}])
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == chat.choices[0].message.content and response.output_text
    message = response.output[0]
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert response.metadata == {"case": "text"} and response.store is False
    assert response.instructions == "Answer briefly." and response.max_output_tokens == 12
    # input as message items: the same prompt, so the same greedy answer
    items = client.responses.create(model=FP32, max_output_tokens=12, temperature=0, input=[
        {"role": "developer", "content": "Answer briefly."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK}]}])
    assert items.output_text == response.output_text


@pytest.mark.server
def test_stream_events_build_the_final_response_the_sdk_returns(client, frontend):
    kwargs = dict(model=FP32, input="Say hello.", max_output_tokens=120, temperature=0)
    deltas, types = [], []
    with client.responses.stream(**kwargs) as stream:
        for event in stream:
            types.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == "".join(deltas) and len(deltas) > 1
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    whole = client.responses.create(**kwargs)
    assert whole.output_text == final.output_text and whole.usage.output_tokens == final.usage.output_tokens

    # On the wire: one event per SSE message, sequence numbers 0, 1, 2, ...; cut short, it ends incomplete.
    body = {"model": FP32, "input": "Say hello.", "max_output_tokens": 3, "temperature": 0, "stream": True}
    with requests.post(f"{frontend}/v1/responses", json=body, stream=True, timeout=60) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[len("data: "):]) for line in reply.iter_lines(decode_unicode=True)
                  if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["usage"]["output_tokens"] == 3
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


@pytest.mark.server
def test_client_disconnect_mid_stream_cancels_the_triton_request(frontend, triton_server):
    aborts = settled(lambda: triton_server.metric("llm_request_finished_total", finish_reason="abort", version="2"))
    body = {"model": "llm", "input": "Write a very long story about a dragon.", "max_output_tokens": 1000,
            "temperature": 0, "stream": True}
    with requests.post(f"{frontend}/v1/responses", json=body, stream=True, timeout=60) as reply:
        deltas = 0
        for line in reply.iter_lines(decode_unicode=True):  # leaving the loop disconnects
            deltas += "response.output_text.delta" in line
            if deltas >= 6 and triton_server.metric("llm_kv_cache_blocks_used", version="2") > 0:
                break
        else:
            pytest.fail("the story ended before the disconnect")
    assert wait_idle(triton_server) < 2.0
    assert triton_server.metric("llm_request_finished_total", finish_reason="abort", version="2") == aborts + 1


@pytest.mark.server
def test_forced_function_call_round_trip(client):
    ask = {"role": "user", "content": "What is the weather in Paris right now?"}
    forced = dict(model=FP32, input=[ask], tools=[WEATHER], temperature=0, max_output_tokens=60,
                  tool_choice={"type": "function", "name": "get_weather"})
    first = client.responses.create(**forced)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])

    arguments_streamed = []
    with client.responses.stream(**forced) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments_streamed.append(event.delta)
        streamed = stream.get_final_response()
    assert json.loads("".join(arguments_streamed)) == arguments
    assert streamed.output[0].type == "function_call" and json.loads(streamed.output[0].arguments) == arguments

    # The next turn: the call (as the SDK returned it) and its output go back in input.
    result = '{"temperature": 21, "unit": "celsius"}'
    second = client.responses.create(model=FP32, tools=[WEATHER], tool_choice="none", temperature=0,
                                     max_output_tokens=20, input=[
                                         ask, call, {"type": "function_call_output", "call_id": call.call_id,
                                                     "output": result}])
    assert second.output[0].type == "message" and second.output_text
    chat = client.chat.completions.create(
        model=FP32, tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                     "parameters")}}],
        tool_choice="none", temperature=0, max_completion_tokens=20, messages=[
            ask, {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": result}])
    assert second.output_text == chat.choices[0].message.content  # the same prompt: the call and its result
    assert second.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.server
def test_json_schema_text_format_validates(client):
    response = client.responses.create(
        model="llm", input="Describe a person as JSON.", temperature=1.0, max_output_tokens=100,
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


def test_input_items_become_chat_messages_and_tools_chat_tools():
    body = ResponsesRequest(model="llm", instructions="Be brief.", tools=[WEATHER], input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"},
                                     {"type": "input_text", "text": "In Oslo."}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed", "phase": None,
         "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",  # null extras: the
         "arguments": '{"city": "Oslo"}', "status": "completed", "namespace": None},  # SDK's model_dump()
        {"type": "function_call_output", "call_id": "call_1", "output": "5 C"}])
    body.check()
    chat = body.chat_request("abc")
    assert [m.model_dump(exclude_none=True) for m in chat.messages] == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?\nIn Oslo."},
        {"role": "assistant", "content": "Checking.", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5 C"}]
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                      "parameters")}}]
    assert chat.request_id == "abc" and chat.response_format is None


@pytest.mark.parametrize("extra, param, words", [
    ({"store": True}, "store", "keeps no responses"),
    ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "not supported"),
    ({"background": True}, "background", "not supported"),
    ({"truncation": "auto"}, "truncation", "not supported"),
    ({"include": ["message.output_text.logprobs"]}, "include", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "not supported"),
    ({"stream_options": {}}, "stream_options", "only taken with stream true"),
    ({"seed": 1}, "seed", "Unrecognized request argument"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema", "schema"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type", "only function tools"),
    ({"tools": [{**WEATHER, "strict": True}]}, "tools[0].strict", "only enforced"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice", "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "input_text"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "not supported"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "user, system, developer or assistant"),
    ({"input": []}, "input", "must not be empty"),
    ({"tools": [{**WEATHER, "strict": "false"}]}, "tools[0].strict", "must be a boolean"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, "tools", "tools[0].name must be"),
    ({"max_output_tokens": 2 ** 31}, "max_output_tokens", "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "a person", "schema": {"type": "object"}}}}, "text.format",
     "text.format.name"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "", "arguments": "{}"}]}, "input[0].name",
     "non-empty string"),
])
def test_unsupported_fields_are_a_400_naming_the_field(extra, param, words):
    app = create_app(FrontendConfig(triton_url="127.0.0.1:1"))  # refused before Triton is asked anything
    with TestClient(app) as http:
        reply = http.post("/v1/responses", json={"model": "llm", "input": "hi", **extra})
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"]


def test_chat_chunks_become_ordered_items_and_an_error_fails_the_response():
    """The translation of a chat stream (chunks as ``/v1/chat/completions`` sends them): text, then a tool
    call, closes the message before the call's item opens; an error after the first event ends in
    ``response.failed``."""
    def chunk(payload) -> str:
        return f"data: {json.dumps(payload)}\n\n"

    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                         "arguments": '{"city": "Oslo"}'}}
    usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12,
             "prompt_tokens_details": {"cached_tokens": 0}}

    def delta(finish_reason=None, **fields) -> str:
        return chunk({"choices": [{"index": 0, "delta": fields, "finish_reason": finish_reason}]})

    chunks = [delta(role="assistant", content="Let me"), delta(content=" look."),
              delta("tool_calls", tool_calls=[call]), chunk({"choices": [], "usage": usage}), "data: [DONE]\n\n"]

    async def run(pieces) -> list[dict]:
        async def source():
            for piece in pieces:
                yield piece
        body = ResponsesRequest(model="llm", input="Weather?", tools=[WEATHER])
        events = ResponseBuilder(body, "r1").events(source())
        return [json.loads(text.split("data: ", 1)[1]) async for text in events]

    events = asyncio.run(run(chunks))
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert final["id"] == "resp_r1" and final["status"] == "completed" and final["usage"]["total_tokens"] == 12
    message, function_call = final["output"]
    assert message["content"][0]["text"] == "Let me look." and message["status"] == "completed"
    assert function_call["call_id"] == "call_1" and function_call["arguments"] == '{"city": "Oslo"}'
    assert events[9]["output_index"] == 1 and events[9]["item"]["arguments"] == ""

    error = {"error": {"message": "engine is dead", "type": "service_unavailable", "param": None,
                       "code": "service_unavailable"}}
    events = asyncio.run(run(chunks[:1] + [chunk(error), "data: [DONE]\n\n"]))
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-2]["message"] == "engine is dead" and events[-1]["response"]["status"] == "failed"


@pytest.mark.parametrize("finish, status", [("stop", "completed"), ("length", "incomplete")])
def test_a_function_call_cut_by_max_output_tokens_is_incomplete_as_the_response(scripted, finish, status):
    """A named function's arguments are the reply itself: cut by ``max_output_tokens`` they are not whole JSON,
    and the item says so (``incomplete``, as a message cut short), streamed or not; the response agrees."""
    arguments = '{"city": "Paris", "unit": "celsius"}' if finish == "stop" else '{"city": "Par'
    SCRIPT.update(pieces=[arguments[:5], arguments[5:]], finish=finish)
    body = {"model": "llm", "input": "Weather in Paris?", "tools": [WEATHER], "max_output_tokens": 40,
            "tool_choice": {"type": "function", "name": "get_weather"}}
    whole = scripted.post("/v1/responses", json=body).json()
    events = [json.loads(line[len("data: "):]) for line in
              scripted.post("/v1/responses", json={**body, "stream": True}).text.splitlines()
              if line.startswith("data: ")]
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert events[-1]["type"] == f"response.{status}"
    for response in (whole, events[-1]["response"]):
        assert response["status"] == status
        assert response["incomplete_details"] == ({"reason": "max_output_tokens"} if finish == "length" else None)
        (call,) = response["output"]
        assert (call["type"], call["name"], call["arguments"], call["status"]) == (
            "function_call", "get_weather", arguments, status)
    assert [item["status"] for item in done] == [status]
