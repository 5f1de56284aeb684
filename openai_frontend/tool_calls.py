"""Tool calling in chat completions: presenting tools to the model, constraining ``required`` and named
choices, and parsing the reply into OpenAI ``tool_calls`` (whole, or as streamed deltas).

Formats parsed (``auto``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes,
Qwen 2/2.5/3), and the same tags around a JSON list of calls (SmolLM2's function-calling format,
``<tool_call>[{...}, ...]</tool_call>``); several blocks make several calls, text before the first is the
message's content; ``parameters`` is accepted for ``arguments``, and arguments that are not an object written as
JSON text are dumped as JSON (as vLLM's parsers do). A block left open when generation ends is parsed if its JSON
is complete. Anything else stays content. With ``parallel_tool_calls`` false only the reply's first call is kept.

Presenting: a chat template that takes ``tools`` renders them itself; for one that does not (SmolLM2's),
a system message lists the tools' signatures in ``<tools></tools>`` and asks for ``<tool_call>`` blocks
(:func:`tool_system_prompt`); earlier assistant tool calls are rendered as such blocks and ``tool`` results as
user turns in ``<tool_response></tool_response>``.

Enforcing (structured outputs in the engine): a named ``tool_choice`` constrains the reply to that
function's ``parameters`` schema (the reply is the arguments); ``required`` to a JSON list of one or more
``{"name", "arguments"}`` objects, each valid for one of the tools (exactly one with ``parallel_tool_calls``
false; a list cut short by ``max_tokens`` keeps its complete calls). ``none`` presents no tools.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from backend.structured_output.schema_check import metaschema_error
from openai_frontend.errors import OpenAIError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# A function without ``parameters`` takes none (as at OpenAI): its arguments are the empty object.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
TOOL_FIELDS = {"type", "function"}
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


# Root keywords that give the schema's type through other schemas: no "type" is added beside them.
COMPOSED = {"anyOf", "oneOf", "allOf", "$ref"}


def parameters(function: dict) -> dict:
    """A function's arguments schema: its ``parameters``, or none (:data:`NO_PARAMETERS`) where omitted or ``{}``
    (arguments are always an object). Parameters without a root ``type`` (``{"properties": ..., "required":
    ...}``) describe an object, as OpenAI reads them: ``"type": "object"`` is added, so that the constraint of
    ``required`` and named choices enforces their object keywords (the engine refuses them without a type)."""
    given = function.get("parameters")
    if given is None or given == {}:
        return NO_PARAMETERS
    if isinstance(given, dict) and "type" not in given and not COMPOSED & set(given):
        return {"type": "object", **given}
    return given


def check_strict(tools: list[dict], tool_choice, param: str) -> None:
    """Raises OpenAIError 400 for a tool whose ``strict`` is not a boolean (or null), or is true where
    ``tool_choice`` (None: ``auto``) leaves the arguments to the model, so nothing would enforce it: only
    ``required`` and named choices constrain the reply to the tools' schemas. ``param``: the field's name with
    ``{}`` for the tool's index."""
    for i, tool in enumerate(tools):
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise OpenAIError(400, f"{param.format(i)} must be a boolean, got {tool['strict']!r:.80}",
                              "invalid_value", param.format(i))
    if (tool_choice if tool_choice is not None else "auto") != "auto":
        return
    strict = next((i for i, tool in enumerate(tools) if tool.get("strict")), None)
    if strict is not None:
        raise OpenAIError(400, f"{param.format(strict)} true is only enforced with tool_choice required or a named "
                          "function; send strict false (arguments as the model writes them) or force the call",
                          "unsupported_parameter", param.format(strict))


@dataclass
class ToolChoice:
    """How a request uses its tools. ``mode``: ``none``, ``auto``, ``required`` or ``named`` (``name`` set)."""

    mode: str
    tools: list[dict] = field(default_factory=list)  # the ``function`` objects
    name: str | None = None
    parallel: bool = True  # ``required``: more than one call allowed (OpenAI's parallel_tool_calls)

    @classmethod
    def from_request(cls, tools: list[dict] | None, tool_choice: str | dict | None,
                     parallel_tool_calls: bool | None = None) -> "ToolChoice":
        """Raises: OpenAIError 400 for a malformed tool (unknown fields, a name outside OpenAI's
        ``[A-Za-z0-9_-]{1,64}``, a name given twice, parameters that are not an object schema), an unknown choice,
        a named function not in ``tools``, or a tool with ``strict`` true where the reply is not constrained to
        the tools' schemas (``auto``: the arguments are what the model writes, so strict would be a promise not
        kept)."""
        functions = []
        for i, tool in enumerate(tools or []):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                    or not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise OpenAIError(400, f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\", ...}}}}",
                                  "invalid_value", "tools")
            for where, given, known in ((f"tools[{i}]", tool, TOOL_FIELDS),
                                        (f"tools[{i}].function", function, FUNCTION_FIELDS)):
                unknown = sorted(set(given) - known)
                if unknown:
                    raise OpenAIError(400, f"{where} has unknown field(s) {', '.join(unknown)}; known: "
                                      f"{', '.join(sorted(known))}", "invalid_value", "tools")
            if not FUNCTION_NAME.fullmatch(function["name"]):
                raise OpenAIError(400, f"tools[{i}].function.name must be 1-64 letters, digits, underscores or "
                                  f"dashes, got {function['name']!r}", "invalid_value", "tools")
            if any(f["name"] == function["name"] for f in functions):
                raise OpenAIError(400, f"tools[{i}].function.name {function['name']!r} is given twice",
                                  "invalid_value", "tools")
            schema = parameters(function)
            if not isinstance(schema, dict) or schema.get("type", "object") != "object":
                raise OpenAIError(400, f"tools[{i}].function.parameters must be a JSON schema of an object "
                                  "(arguments are always an object)", "invalid_value", "tools")
            invalid = metaschema_error(schema)
            if invalid is not None:  # the model would read it in its prompt (auto), the grammar refuse it later
                raise OpenAIError(400, f"tools[{i}].function.parameters: {invalid}", "invalid_value", "tools")
            functions.append(function)
        choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
        check_strict(functions, choice, "tools[{}].function.strict")
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise OpenAIError(400, 'tool_choice must be none, auto, required or {"type": "function", '
                                  '"function": {"name": ...}}', "invalid_value", "tool_choice")
            if name not in {f["name"] for f in functions}:
                raise OpenAIError(400, f"tool_choice names function {name!r}, which is not in tools",
                                  "invalid_value", "tool_choice")
            return cls("named", functions, name, parallel=False)
        if choice not in ("none", "auto", "required"):
            raise OpenAIError(400, f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                              "invalid_value", "tool_choice")
        if choice != "none" and not functions:
            raise OpenAIError(400, f"tool_choice {choice} needs tools", "invalid_value", "tool_choice")
        return cls(choice, functions, parallel=parallel_tool_calls is not False)

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def structured_outputs(self) -> dict | None:
        """The engine's constraint for ``required`` and named choices (None for ``auto`` and ``none``)."""
        if self.mode == "named":
            function = next(f for f in self.tools if f["name"] == self.name)
            return {"json": json.dumps(parameters(function))}
        if self.mode == "required":
            defs: dict = {}
            calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                      "properties": {"name": {"const": f["name"]},
                                     "arguments": _hoisted(parameters(f), f"tool{i}", defs)}}
                     for i, f in enumerate(self.tools)]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if defs:
                array["$defs"] = defs
            if not self.parallel:
                array["maxItems"] = 1
            return {"json": json.dumps(array)}
        return None


def _hoisted(schema: dict, name: str, defs: dict) -> dict:
    """``schema`` (a tool's parameters) to be nested in the ``required`` constraint, whose root is not its
    root: its ``$defs`` / ``definitions`` move into the constraint's ``$defs`` as ``<name>__<key>``, and its
    local references are rewritten to point there (``#`` itself, and pointers into the tool's own root, to the
    tool's schema kept whole as ``$defs/<name>``). Pydantic writes nested models this way, so tools made
    from them (instructor, LangChain) keep their references. Returns a ``$ref`` to the tool's schema when the
    schema has references, else the schema itself. Remote references are left as they are (the schema
    check refuses them).

    A root ``$id`` is dropped: it names the tool's schema as a resource of its own, against which its local
    references resolve; nested, it would keep them resolving there, while they are rewritten here to point
    into the constraint's root (and the schema check refuses an ``$id`` below the root). References that
    name the ``$id`` itself (``urn:x#/...``) are not local, so they are refused, as with a named choice."""
    if isinstance(schema, dict) and "$id" in schema:
        schema = {k: v for k, v in schema.items() if k != "$id"}
    if not isinstance(schema, dict) or not _has_local_ref(schema):
        return schema

    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: rewrite(v) for k, v in node.items() if k not in ("$defs", "definitions") or node is not schema}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            parts = ref[2:].split("/") if ref != "#" else []
            if len(parts) >= 2 and parts[0] in ("$defs", "definitions"):
                out["$ref"] = "/".join([f"#/$defs/{name}__{parts[1]}", *parts[2:]])
            else:
                out["$ref"] = "/".join([f"#/$defs/{name}", *parts])
        return out

    for section in ("$defs", "definitions"):
        for key, sub in (schema.get(section) or {}).items():
            defs[f"{name}__{key}"] = rewrite(sub)
    defs[name] = rewrite(schema)
    return {"$ref": f"#/$defs/{name}"}


def _has_local_ref(node) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def tool_system_prompt(tools: list[dict]) -> str:
    """A system message presenting ``tools`` in the Hermes ``<tools>`` / ``<tool_call>`` format, for chat
    templates that do not render tools themselves."""
    signatures = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools)
    return ("You can call functions to answer. Their signatures, as JSON, are between <tools> and </tools>:\n"
            f"<tools>\n{signatures}\n</tools>\n"
            "To call one, reply with a JSON object holding its name and its arguments between <tool_call> and "
            "</tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n</tool_call>')


def messages_for_plain_template(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` for a template without tool support: the tools' system prompt first (joined with the
    request's own system message), assistant tool calls as ``<tool_call>`` blocks, tool results as user turns."""
    out: list[dict] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            # The calls' shape is checked with the request (protocol.ChatCompletionRequest.check); arguments left
            # out or empty are none, as vLLM renders them.
            blocks = [f"{OPEN}\n" + json.dumps({"name": c["function"]["name"],
                                                 "arguments": _loads_or_text(c["function"].get("arguments") or {})})
                      + f"\n{CLOSE}" for c in message["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join(filter(None, [content, *blocks]))})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({"role": role, "content": content})
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _loads_or_text(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except (json.JSONDecodeError, RecursionError):  # the latter: nested deeper than Python recurses
            return value
    return value


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_message(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def as_delta(self, index: int) -> dict:
        return {"index": index, **self.as_message()}


class ToolCallParser:
    """Splits one choice's reply into content and tool calls as its text arrives.

    ``feed(text)`` and, once the choice ends, ``finish()`` return OpenAI chat deltas: ``{"content": ...}`` and
    ``{"tool_calls": [...]}`` (a call's first delta carries ``index``, ``id``, ``type`` and the function's
    ``name``; its ``arguments`` may follow in pieces, as OpenAI streams them). ``calls`` and ``content`` hold
    the whole reply; ``finish_reason`` is ``tool_calls`` when the model made calls.

    ``auto``: as vLLM's hermes parser, the content is the reply's text before its first call, as written (a
    malformed block in it included); text after the first call is not content (OpenAI's message puts its
    content before its calls, and a later turn renders it so). Text that is only whitespace before a call is
    no content either. The same text gives the same content and calls whatever pieces it arrives in.
    """

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.calls: list[ToolCall] = []
        self.content = ""
        self._buffer = ""  # auto: text that may be (part of) a <tool_call> block; required: the whole reply
        self._inside = False
        self._blank = ""  # auto: whitespace before any call or content, held until it is followed by text

    def feed(self, text: str) -> list[dict]:
        if self.choice.mode == "named":
            deltas = []
            if not self.calls:
                self.calls.append(ToolCall(self.choice.name, ""))
                deltas.append({"tool_calls": [{**self.calls[0].as_delta(0), "function": {
                    "name": self.choice.name, "arguments": ""}}]})
            if text:
                self.calls[0].arguments += text
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        self._buffer += text
        if self.choice.mode == "required":
            return []
        return self._scan()

    def finish(self) -> list[dict]:
        if self.choice.mode == "named":
            return [] if self.calls else self.feed("")
        if self.choice.mode == "required":
            calls = _parse_calls(self._buffer) or _complete_calls(self._buffer)
            if calls is None:  # cut short (max_tokens) before one call was complete: what came is content
                return self._content(self._buffer)
            return self._add_calls(calls)
        deltas = self._scan()
        rest, self._buffer = self._buffer, ""
        if self._inside:
            self._inside = False
            calls = _parse_calls(rest[len(OPEN):])
            if calls is not None:
                return deltas + self._add_calls(calls)
        deltas += self._text(rest)
        if not self.calls:  # a reply of whitespace alone is its content
            deltas += self._content(self._blank)
        self._blank = ""
        return deltas

    @property
    def finish_reason(self) -> str | None:
        """``tool_calls`` when the model chose to call (``auto``, ``required``); a named choice's call was the
        request's, so its reply ends as any other (None: the model's reason), as at OpenAI and vLLM."""
        return "tool_calls" if self.calls and self.choice.mode != "named" else None

    def _scan(self) -> list[dict]:
        deltas = []
        while True:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:  # hold back a tail that could begin the tag
                    keep = next((k for k in range(min(len(OPEN) - 1, len(self._buffer)), 0, -1)
                                 if OPEN.startswith(self._buffer[-k:])), 0)
                    cut = len(self._buffer) - keep
                    deltas += self._text(self._buffer[:cut])
                    self._buffer = self._buffer[cut:]
                    return deltas
                deltas += self._text(self._buffer[:start])
                self._buffer = self._buffer[start:]
                self._inside = True
            end = self._buffer.find(CLOSE)
            if end < 0:
                return deltas
            block, self._buffer = self._buffer[len(OPEN):end], self._buffer[end + len(CLOSE):]
            self._inside = False
            calls = _parse_calls(block)
            deltas += self._add_calls(calls) if calls is not None else self._text(OPEN + block + CLOSE)

    def _text(self, text: str) -> list[dict]:
        """``auto``: text outside the calls, as it is; content only before the first call, and whitespace only
        once text follows it (see the class's doc)."""
        if self.calls:
            return []
        self._blank += text
        if not self.content and not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return self._content(text)

    def _content(self, text: str) -> list[dict]:
        if not text:
            return []
        self.content += text
        return [{"content": text}]

    def _add_calls(self, calls: list[ToolCall]) -> list[dict]:
        deltas = []
        for call in calls:
            if self.calls and not self.choice.parallel:  # parallel_tool_calls false: the first call only
                break
            deltas.append({"tool_calls": [call.as_delta(len(self.calls))]})
            self.calls.append(call)
        return deltas


def _parse_calls(text: str) -> list[ToolCall] | None:
    """``{"name", "arguments"}`` or a list of them (JSON) -> calls; None when it is not that."""
    try:
        value = json.loads(text.strip())
    except (json.JSONDecodeError, RecursionError):
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str) and isinstance(_loads_or_text(arguments), dict):
            calls.append(ToolCall(item["name"], arguments))  # the object already written as JSON text
        else:  # arguments are JSON text, whatever the model wrote (as vLLM's parsers dump them)
            calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _complete_calls(text: str) -> list[ToolCall] | None:
    """The complete calls at the start of a JSON list cut short (``[{...}, {...}, {"na``), or None."""
    decoder = json.JSONDecoder()
    calls, pos = [], text.find("[") + 1
    while pos > 0:
        while pos < len(text) and text[pos] in " \n\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            break
        parsed = _parse_calls(json.dumps(item))
        if parsed is None:
            break
        calls += parsed
    return calls or None
