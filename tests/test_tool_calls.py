"""Tool-call parsing and constraints (openai_frontend.tool_calls), without a server: the same reply, fed in
any pieces, gives the same content and calls."""

from __future__ import annotations

import json

import pytest

from fastapi.testclient import TestClient

from openai_frontend.app import FrontendConfig, create_app
from openai_frontend.errors import OpenAIError
from openai_frontend.tool_calls import ToolCallParser, ToolChoice, messages_for_plain_template
from openai_frontend.triton_stream import Delta

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}]</tool_call>\n')


def parse(choice: ToolChoice, text: str, piece: int) -> tuple[ToolCallParser, list[dict]]:
    parser = ToolCallParser(choice)
    deltas = []
    for i in range(0, len(text), piece):
        deltas += parser.feed(text[i:i + piece])
    return parser, deltas + parser.finish()


@pytest.mark.parametrize("piece", [1, 2, 7, 1000])
def test_hermes_and_smollm2_blocks_parse_the_same_in_any_pieces(piece):
    parser, deltas = parse(ToolChoice.from_request([WEATHER], "auto"), HERMES, piece)
    assert parser.content == "Let me look.\n" and parser.finish_reason == "tool_calls"
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"}),
                                                                         ("get_weather", {"city": "Rome"})]
    streamed = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert [s["index"] for s in streamed] == [0, 1] and all(s["id"].startswith("call_") for s in streamed)
    assert "".join(d.get("content", "") for d in deltas) == "Let me look.\n"


def test_text_that_only_looks_like_a_call_stays_content():
    for text in ("a < b and <tool", "<tool_call>not json</tool_call> done"):
        parser, _ = parse(ToolChoice.from_request([WEATHER], "auto"), text, 3)
        assert parser.content == text and not parser.calls and parser.finish_reason is None
    parser, _ = parse(ToolChoice.from_request([WEATHER], "auto"), '<tool_call>{"name": "get_weather"}', 4)
    assert parser.calls[0].arguments == "{}"  # an unclosed block whose JSON is complete


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_auto_without_parallel_calls_keeps_the_first_call_and_arguments_are_json_text(piece):
    serial = ToolChoice.from_request([WEATHER], "auto", parallel_tool_calls=False)
    parser, deltas = parse(serial, HERMES, piece)
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("get_weather", {"city": "Paris"})]
    assert [d["tool_calls"][0]["index"] for d in deltas if "tool_calls" in d] == [0]
    reply = ('<tool_call>{"name": "get_weather", "arguments": "not json at all"}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
             '<tool_call>{"name": "get_weather", "arguments": [1, "é"]}</tool_call>')
    parser, _ = parse(ToolChoice.from_request([WEATHER], "auto"), reply, piece)
    assert [c.arguments for c in parser.calls] == ['"not json at all"', '{"city": "Oslo"}', '[1, "é"]']


def test_named_choice_streams_arguments_and_required_keeps_complete_calls():
    named = ToolChoice.from_request([WEATHER], {"type": "function", "function": {"name": "get_weather"}})
    parser, deltas = parse(named, '{"city": "Oslo"}', 5)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city": "Oslo"}'
    required = ToolChoice.from_request([WEATHER], "required")
    cut = '[{"name": "get_weather", "arguments": {"city": "A"}}, {"name": "get_weather", "argu'
    parser, _ = parse(required, cut, 1000)
    assert [c.arguments for c in parser.calls] == ['{"city": "A"}']
    schema = json.loads(ToolChoice.from_request([WEATHER], "required", False).structured_outputs()["json"])
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "get_weather"}
    assert ToolChoice.from_request([WEATHER], "auto").structured_outputs() is None


def test_a_function_without_parameters_takes_none():
    """As at OpenAI, omitting ``parameters`` declares an empty parameter list: the only arguments are ``{}``."""
    import jsonschema

    ping = {"type": "function", "function": {"name": "ping"}}
    empty = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    assert ToolChoice.from_request([empty], "required").structured_outputs() == \
        ToolChoice.from_request([ping], "required").structured_outputs()
    named = json.loads(ToolChoice.from_request([ping], {"type": "function", "function": {"name": "ping"}})
                       .structured_outputs()["json"])
    required = json.loads(ToolChoice.from_request([ping], "required").structured_outputs()["json"])
    for schema, valid, wrong in ((named, {}, {"name": "f"}),
                                 (required, [{"name": "ping", "arguments": {}}],
                                  [{"name": "ping", "arguments": {"x": 1}}])):
        jsonschema.validate(valid, schema)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_bad_tool_choices_are_400_and_tool_turns_render_without_tool_support():
    for tools, choice in [([WEATHER], {"type": "function", "function": {"name": "x"}}), (None, "required"),
                          ([WEATHER], "sometimes"), ([{"type": "function", "function": {}}], None)]:
        with pytest.raises(OpenAIError) as bad:
            ToolChoice.from_request(tools, choice)
        assert bad.value.status == 400
    messages = messages_for_plain_template([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "5 C"}], [WEATHER["function"]])
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert messages[3] == {"role": "user", "content": "<tool_response>\n5 C\n</tool_response>"}


PERSON = {"type": "function", "function": {"name": "add_person", "parameters": {  # as pydantic writes nested models
    "$defs": {"Address": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False},
              "Node": {"type": "object", "properties": {"next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]}},
                       "required": ["next"], "additionalProperties": False}},
    "type": "object", "properties": {"name": {"type": "string"}, "home": {"$ref": "#/$defs/Address"},
                                     "chain": {"$ref": "#/$defs/Node"}, "same_as_home": {"$ref": "#/properties/home"}},
    "required": ["name", "home"], "additionalProperties": False}}}


def test_required_keeps_each_tools_references_and_compiles():
    """``required`` nests every tool's parameters under one root; their ``$defs`` and local ``$ref``s (pydantic's
    nested models, recursion, pointers into the tool's own root) are hoisted and still mean the same."""
    import jsonschema
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from backend.structured_output.compiler import GrammarCompiler
    from backend.structured_output.params import StructuredOutputsParams

    constraint = ToolChoice.from_request([WEATHER, PERSON], "required").structured_outputs()["json"]
    schema = json.loads(constraint)
    valid = [{"name": "add_person", "arguments": {"name": "Ada", "home": {"city": "London"},
                                                  "chain": {"next": {"next": None}},
                                                  "same_as_home": {"city": "Paris"}}},
             {"name": "get_weather", "arguments": {"city": "Rome"}}]
    jsonschema.validate(valid, schema)
    for args in ({"name": "Ada", "home": {"town": "London"}}, {"name": "Ada", "home": {"city": "x"}, "chain": {}},
                 {"name": "Ada", "home": {"city": "x"}, "same_as_home": {"city": 3}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "add_person", "arguments": args}], schema)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    GrammarCompiler(tokenizer, len(tokenizer)).compile(StructuredOutputsParams(json=constraint))


# -- the chat route, over a scripted Triton ---------------------------------------------------------------
SCRIPT = {"pieces": [], "finish": "stop"}  # what the scripted model answers: its text pieces, its finish reason
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def scripted():
    """The frontend with Triton replaced by :data:`SCRIPT`: every request is answered with its pieces as deltas
    (the last with its finish reason), whatever the prompt; model ``llm``, the default model's tokenizer."""
    app = create_app(FrontendConfig(triton_url="127.0.0.1:1"))
    triton = app.state.triton

    async def models():
        return [("llm", "")]

    async def generate(model, version, prompt, sampling, request_id):
        pieces = SCRIPT["pieces"]
        for i, piece in enumerate(pieces):
            yield Delta(0, piece, [i], SCRIPT["finish"] if i == len(pieces) - 1 else None, 9, i + 1, 0)

    triton.models, triton.generate = models, generate
    with TestClient(app) as http:
        yield http


def chat(http: TestClient, reply: str, piece: int, finish: str = "stop", **body) -> list[tuple]:
    """(content, [(name, arguments)], finish_reason) of the answer to ``body`` when the model writes ``reply``
    in pieces of ``piece`` characters: non-streaming, then streamed (the deltas joined)."""
    SCRIPT.update(pieces=[reply[i:i + piece] for i in range(0, len(reply), piece)], finish=finish)
    body = {"model": "llm", "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], **body}
    whole = http.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    answers = [(choice["message"]["content"], [(c["function"]["name"], c["function"]["arguments"])
                                               for c in choice["message"].get("tool_calls") or []],
                choice["finish_reason"])]
    content, calls, reasons = None, {}, []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        for line in stream.iter_lines():
            if not line.startswith("data: {"):
                continue
            for entry in json.loads(line[len("data: "):])["choices"]:
                delta, reasons = entry["delta"], reasons + [entry["finish_reason"]]
                if delta.get("content"):
                    content = (content or "") + delta["content"]
                for call in delta.get("tool_calls") or []:
                    name, arguments = calls.get(call["index"], ("", ""))
                    calls[call["index"]] = (name + call.get("function", {}).get("name", ""),
                                            arguments + call.get("function", {}).get("arguments", ""))
    assert [r for r in reasons if r] == [reasons[-1]]  # one finish reason, in the last chunk
    answers.append((content, [calls[i] for i in sorted(calls)], reasons[-1]))
    return answers


@pytest.mark.parametrize("tool_calls, param, words", [
    ([{"id": "c", "type": "function"}], "messages.1.tool_calls.0.function", "function must be an object"),
    ("oops", "messages.1.tool_calls", "must be a list of tool calls"),
    ([1], "messages.1.tool_calls.0", "must be a tool call object"),
    ([{"function": "x"}], "messages.1.tool_calls.0.function", "function must be an object"),
    ([{"function": {"arguments": "{}"}}], "messages.1.tool_calls.0.function.name", "name must be a non-empty string"),
    ([{"type": "web", "function": {"name": "f"}}], "messages.1.tool_calls.0.type", "type must be function"),
    ([{"function": {"name": "f", "arguments": 3}}], "messages.1.tool_calls.0.function.arguments", "JSON text"),
])
@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["no_tools", "tools"])
def test_malformed_assistant_tool_calls_are_a_400_naming_the_call(scripted, tool_calls, param, words, tools):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": tool_calls},
                {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    for route in ("/v1/chat/completions", "/v1/chat/completions/render"):
        reply = scripted.post(route, json={"model": "llm", "messages": messages, "tools": tools})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and f"messages[1].tool_calls" in error["message"] and words in error["message"]
    user_calls = [{"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f"}}]}]
    reply = scripted.post("/v1/chat/completions", json={"model": "llm", "messages": user_calls})
    assert reply.status_code == 400 and "only an assistant message carries tool calls" in reply.json()["error"]["message"]


def test_assistant_tool_calls_in_vllms_lenient_forms_render(scripted):
    """vLLM's forms: no ``id`` or ``type``, arguments as an object or left out (none)."""
    SCRIPT.update(pieces=["ok"], finish="stop")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}, {"function": {"name": "ping"}}]},
        {"role": "tool", "content": "5 C"}]
    reply = scripted.post("/v1/chat/completions", json={"model": "llm", "messages": messages})
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == "ok"
    rendered = messages_for_plain_template(messages, [])
    assert rendered[1]["content"] == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
                                      '\n<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>')


def test_arguments_nested_past_pythons_recursion_limit_are_text_not_a_500(scripted):
    """JSON deeper than Python's parser recurses (a 1 KB body) stays text: as sent in a history, and as a model
    writes it under ``auto``."""
    SCRIPT.update(pieces=["ok"], finish="stop")
    deep = "[" * 5000
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]},
        {"role": "tool", "tool_call_id": "c", "content": "ok"}]
    for route in ("/v1/chat/completions", "/v1/chat/completions/render"):
        reply = scripted.post(route, json={"model": "llm", "messages": messages})
        assert reply.status_code == 200, reply.text
    assert deep in messages_for_plain_template(messages, [])[1]["content"].replace("\\", "")
    SCRIPT.update(pieces=["<tool_call>\n", '{"name": "get_weather", "arguments": ' + deep, "\n</tool_call>"],
                  finish="stop")
    reply = scripted.post("/v1/chat/completions", json={"model": "llm", "tools": [WEATHER], "messages": [
        {"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text
    message = reply.json()["choices"][0]["message"]
    assert "tool_calls" not in message and deep in message["content"]  # not a call: text


def test_strict_must_be_a_boolean():
    with pytest.raises(OpenAIError, match=r"tools\[0\]\.function\.strict must be a boolean, got 'false'"):
        ToolChoice.from_request([{"type": "function", "function": {**WEATHER["function"], "strict": "false"}}], "auto")
    assert ToolChoice.from_request([{"type": "function", "function": {**WEATHER["function"], "strict": False}}],
                                   "auto").mode == "auto"


def test_histories_clients_send_back_are_taken(scripted):
    """An empty ``tool_calls`` on any message (some clients send one on each) and a reply the openai SDK
    serialized with ``model_dump()`` (it carries ``annotations``, ``refusal``, ``audio``)."""
    SCRIPT.update(pieces=["ok"], finish="stop")
    dumped = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": [], "audio": None,
              "function_call": None, "tool_calls": None}
    messages = [{"role": "user", "content": "hi", "tool_calls": []}, dumped, {"role": "user", "content": "again"}]
    reply = scripted.post("/v1/chat/completions", json={"model": "llm", "messages": messages})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"] == "ok"


def test_a_named_choice_finishes_with_stop_and_required_with_tool_calls(scripted):
    """As at OpenAI and vLLM: ``tool_calls`` where the model chose to call (auto, required), ``stop`` for the
    call a named choice asked for; ``length`` wherever max_tokens cut the reply."""
    named = chat(scripted, '{"city": "Paris"}', 4, tool_choice=NAMED)
    assert named == [(None, [("get_weather", '{"city": "Paris"}')], "stop")] * 2
    required = chat(scripted, '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', 4, tool_choice="required")
    assert required == [(None, [("get_weather", '{"city": "Paris"}')], "tool_calls")] * 2
    cut = chat(scripted, '{"city": "Par', 4, finish="length", tool_choice=NAMED)
    assert cut == [(None, [("get_weather", '{"city": "Par')], "length")] * 2


@pytest.mark.parametrize("piece", [1, 3, 1000])
@pytest.mark.parametrize("reply, content, calls", [
    # As vLLM's hermes parser: the text before the first call, as written; after it, no content.
    ("Sure." + CALL + "\nDone, anything else?", "Sure.", 1),
    ("Sure.\n" + CALL + "\n" + CALL + "\n", "Sure.\n", 2),
    ("\n" + CALL, None, 1),
    ("Use the <tool_call> tag", "Use the <tool_call> tag", 0),
    ("a <tool_call>not json</tool_call>  b " + CALL + " c", "a <tool_call>not json</tool_call>  b ", 1),
    ("  two spaces  ", "  two spaces  ", 0),
])
def test_auto_content_is_the_text_before_the_first_call_streamed_or_not(scripted, piece, reply, content, calls):
    whole, streamed = chat(scripted, reply, piece)
    assert whole == streamed
    assert whole == (content, [("get_weather", '{"city": "Paris"}')] * calls, "tool_calls" if calls else "stop")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add_person"}}],
                         ids=["required", "named"])
def test_parameters_without_type_or_with_a_root_id_are_enforced_as_an_object(choice):
    """Parameters without a root ``type`` are an object's (as the tools' check reads them), and a root ``$id``
    names the schema only: both compile under ``required`` and a named choice, and mean what they say."""
    import jsonschema
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from backend.structured_output.compiler import GrammarCompiler
    from backend.structured_output.params import StructuredOutputsParams

    untyped = {"properties": {"name": {"type": "string"}}, "required": ["name"], "additionalProperties": False}
    with_id = {"$id": "https://example.com/person.json", **PERSON["function"]["parameters"]}
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    for parameters, valid, wrong in ((untyped, {"name": "Ada"}, {"name": 3}),
                                     (with_id, {"name": "Ada", "home": {"city": "Rome"}}, {"name": "Ada"})):
        tool = {"type": "function", "function": {"name": "add_person", "parameters": parameters}}
        constraint = ToolChoice.from_request([tool], choice).structured_outputs()["json"]
        schema = json.loads(constraint)
        compiler.compile(StructuredOutputsParams(json=constraint))  # the engine's schema check passes it
        wrap = (lambda args: [{"name": "add_person", "arguments": args}]) if choice == "required" else (lambda a: a)
        jsonschema.validate(wrap(valid), schema)
        for bad in (wrong, "not an object"):
            with pytest.raises(jsonschema.ValidationError):
                jsonschema.validate(wrap(bad), schema)
