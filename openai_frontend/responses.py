"""OpenAI's Responses API, ``POST /v1/responses``, served over the chat-completions route.

A request becomes a :class:`~openai_frontend.protocol.ChatCompletionRequest` (``instructions`` the first system
message, ``input`` items the messages, function tools in chat's shape, ``text.format`` the ``response_format``)
and runs through ``/v1/chat/completions`` itself: the same chat template, tool presentation and parsing
(``openai_frontend.tool_calls``), structured outputs, limits, metrics and disconnect handling. Its answer is
translated: a chat completion into a ``response`` object (a ``message`` item with one ``output_text`` part,
then one ``function_call`` item per tool call), a chat stream into the Responses event sequence
(``response.created``, ``response.in_progress``, per item ``response.output_item.added`` ...
``response.output_item.done``, ``response.completed``, each with its ``sequence_number``), as the official
``openai`` SDK's ``client.responses.stream`` accumulates it. The shapes follow OpenAI's API reference
(https://platform.openai.com/docs/api-reference/responses) and vLLM's ``/v1/responses``.

Nothing is stored: ``store`` true and ``previous_response_id`` are a 400 (send the whole conversation in
``input``). OpenAI's other fields that ask for something this server does not do are a 400 naming the field
(:data:`UNSUPPORTED`); fields OpenAI does not have are a 400 as ``Unrecognized request argument``.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from openai_frontend.errors import OpenAIError
from openai_frontend.protocol import ChatCompletionRequest, chat_completion_request
from openai_frontend.structured import JSON_SCHEMA_FIELDS
from openai_frontend.tool_calls import check_strict

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# OpenAI's request fields this server does not implement -> the values that ask for nothing (accepted).
UNSUPPORTED: dict[str, tuple] = {
    "background": (False,), "truncation": ("disabled",), "service_tier": ("auto", "default"), "include": ([],),
    "conversation": (), "prompt": (), "reasoning": (), "max_tool_calls": (), "top_logprobs": (0,),
    "stream_options": ({}, {"include_obfuscation": False}), "context_management": (), "prompt_cache_retention": (),
    "prompt_cache_options": (), "background_options": (), "moderation": (), "image": (), "access_programs": (),
}
FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status"},
             "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
             "function_call_output": {"type", "call_id", "output", "id", "status"}}
TEXT_PART_KEYS = {"input_text": {"type", "text"}, "output_text": {"type", "text", "annotations", "logprobs"}}


def _bad(message: str, param: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code, param)


# The chat request's field names that begin its error messages -> this request's (a response is computed as a chat
# completion); only a message's leading name and the param are renamed, never what a message quotes.
_CHAT_NAMES = [(re.compile(r"(max_completion_tokens|max_tokens)\b"), "max_output_tokens"),
               (re.compile(r"response_format json_schema\."), "text.format."),
               (re.compile(r"response_format\b"), "text.format"),
               (re.compile(r"tools\[(\d+)\]\.function\b"), r"tools[\1]")]


def responses_error(error: OpenAIError) -> OpenAIError:
    """``error`` of the chat request with the field it names as this request names it (``max_output_tokens``,
    ``text.format``, ``tools[i].name``)."""
    def rename(text: str | None) -> str | None:
        for pattern, name in _CHAT_NAMES:
            if text is not None and pattern.match(text):
                return pattern.sub(name, text, count=1)
        return text
    param = "input" if error.param == "messages" else rename(error.param)  # the prompt is built from input
    return OpenAIError(error.status, rename(error.message), error.code, param)


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses``: the fields served, the rest checked by :meth:`check`."""

    model_config = ConfigDict(extra="allow")  # sorted out in check(): OpenAI's unsupported fields or unknown
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None  # tokens; None = up to the context length
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None  # echoed
    store: bool | None = None  # false only: nothing is stored
    previous_response_id: str | None = None  # refused: nothing is stored
    user: str | None = None  # echoed, as OpenAI does; identifies the caller only
    safety_identifier: str | None = None  # echoed
    prompt_cache_key: str | None = None  # echoed; prefix caching needs no key here

    def check(self) -> None:
        """Raises: OpenAIError 400 naming the field for ``store`` true, ``previous_response_id``, an OpenAI field
        this server does not implement, or a field OpenAI does not have."""
        if self.store:
            raise _bad("store true is not supported: this server keeps no responses; send store false",
                       "store", "unsupported_parameter")
        if self.previous_response_id is not None:
            raise _bad("previous_response_id is not supported: this server keeps no responses; send the whole "
                       "conversation in input", "previous_response_id", "unsupported_parameter")
        if (self.model_extra or {}).get("stream_options") is not None and not self.stream:
            raise _bad("stream_options are only taken with stream true", "stream_options")  # as chat refuses them
        for name, value in (self.model_extra or {}).items():
            if name not in UNSUPPORTED:
                raise _bad(f"Unrecognized request argument supplied: {name}", name, "invalid_request")
            if value is not None and value not in UNSUPPORTED[name]:
                raise _bad(f"{name} is not supported by this server", name, "unsupported_parameter")
        if isinstance(self.input, list) and not self.input:
            raise _bad("input must not be empty", "input")

    def chat_request(self, request_id: str) -> ChatCompletionRequest:
        """The chat-completions request that computes this response (Triton request id ``request_id``).

        Raises: OpenAIError 400 for an input item, tool, tool choice or text format this server does not take.
        """
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise _bad(f"max_output_tokens must be at least 1, got {self.max_output_tokens}", "max_output_tokens")
        tool_choice = self._tool_choice()
        response_format = self._response_format()
        if response_format is not None and (tool_choice == "required" or isinstance(tool_choice, dict)):
            raise _bad("tool_choice required or a named function constrains the reply; drop text.format", "text")
        stream_options = {"include_usage": True} if self.stream else None
        return chat_completion_request(
            model=self.model, messages=self._messages(), max_completion_tokens=self.max_output_tokens,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream, stream_options=stream_options,
            tools=self._tools(), tool_choice=tool_choice, parallel_tool_calls=self.parallel_tool_calls,
            response_format=response_format, request_id=request_id)

    def _messages(self) -> list[dict]:
        """Chat messages: ``instructions`` as the first system message, then the ``input`` items (consecutive
        ``function_call`` items join the assistant message before them, as one turn's tool calls)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions is not None else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        for i, item in enumerate(items):
            where = f"input[{i}]"
            kind = item.get("type", "message")
            if not isinstance(kind, str) or kind not in ITEM_KEYS:
                raise _bad(f"{where}.type {kind!r} is not supported: send message, function_call or "
                           "function_call_output items", f"{where}.type", "unsupported_parameter")
            for key, value in item.items():  # null extras are the SDK's model_dump() of an output item
                if key not in ITEM_KEYS[kind] and value is not None:
                    raise _bad(f"{where}.{key} is not supported in a {kind} item", f"{where}.{key}",
                               "unsupported_parameter")
            if kind == "message":
                role = item.get("role")
                if not isinstance(role, str) or role not in ROLES:
                    raise _bad(f"{where}.role must be user, system, developer or assistant, got {role!r}",
                               f"{where}.role")
                messages.append({"role": ROLES[role], "content": _text(item.get("content"), f"{where}.content")})
            elif kind == "function_call":
                for key in ("call_id", "name", "arguments"):
                    if not isinstance(item.get(key), str):
                        raise _bad(f"{where}.{key} must be a string", f"{where}.{key}")
                if not item["name"]:
                    raise _bad(f"{where}.name must be a non-empty string", f"{where}.name")
                call = {"id": item["call_id"], "type": "function",
                        "function": {"name": item["name"], "arguments": item["arguments"]}}
                if messages and messages[-1]["role"] == "assistant":
                    messages[-1].setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                if not isinstance(item.get("call_id"), str):
                    raise _bad(f"{where}.call_id must be a string", f"{where}.call_id")
                messages.append({"role": "tool", "tool_call_id": item["call_id"],
                                 "content": _text(item.get("output"), f"{where}.output")})
        return messages

    def _tools(self) -> list[dict] | None:
        """Function tools in chat's shape. ``strict`` true is a 400 where the tool choice leaves the arguments to
        the model (``check_strict``), never a silent promise."""
        if self.tools is None:
            return None
        check_strict(self.tools, self.tool_choice, "tools[{}].strict")
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise _bad(f"tools[{i}].type {tool.get('type')!r} is not supported: only function tools",
                           f"tools[{i}].type", "unsupported_parameter")
            for key, value in tool.items():
                if key not in FUNCTION_TOOL_KEYS and value not in (None, False):
                    raise _bad(f"tools[{i}].{key} is not supported", f"tools[{i}].{key}", "unsupported_parameter")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise _bad(f"tools[{i}].name must be a non-empty string", f"tools[{i}].name")
            if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
                raise _bad(f"tools[{i}].parameters must be a JSON schema object", f"tools[{i}].parameters")
            out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                              "strict") if tool.get(k) is not None}})
        return out

    def _tool_choice(self) -> str | dict | None:
        """``none``, ``auto``, ``required`` or ``{"type": "function", "name"}`` (in chat's shape)."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        named = choice.get("type") == "function" and isinstance(choice.get("name"), str)
        if not named or set(choice) - {"type", "name"}:
            raise _bad('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                       "tool_choice", "unsupported_parameter")
        return {"type": "function", "function": {"name": choice["name"]}}

    def _response_format(self) -> dict | None:
        """``text.format`` as chat's ``response_format`` (None for free text)."""
        text = dict(self.text or {})
        fmt = text.pop("format", None)
        for key, value in text.items():
            if value is not None:
                raise _bad(f"text.{key} is not supported", f"text.{key}", "unsupported_parameter")
        if fmt is not None and not isinstance(fmt, dict):
            raise _bad(f"text.format must be an object with a type, got {fmt!r:.80}", "text.format")
        kind = "text" if fmt is None else fmt.get("type")
        known = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", *JSON_SCHEMA_FIELDS}}.get(
            kind if isinstance(kind, str) else None)
        if known is None:
            raise _bad(f"text.format.type must be text, json_object or json_schema, got {kind!r}", "text.format.type")
        unknown = sorted(set(fmt or {}) - known)
        if unknown:
            raise _bad(f"text.format type {kind} takes no {', '.join(unknown)}", "text.format")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if not isinstance(fmt.get("schema"), dict):
            raise _bad("text.format json_schema needs schema, a JSON schema object", "text.format.schema")
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise _bad("text.format json_schema needs name, a non-empty string", "text.format.name")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in JSON_SCHEMA_FIELDS if k in fmt}}


def _text(content, where: str) -> str:
    """A message's text: a string, or ``input_text`` / ``output_text`` parts joined with newlines (as chat's
    text parts are)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of input_text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in TEXT_PART_KEYS:
            raise _bad(f"{where}[{j}].type {kind!r} is not supported: only input_text and output_text parts",
                       f"{where}[{j}].type", "unsupported_parameter")
        if set(part) - TEXT_PART_KEYS[kind] or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}] must be {{\"type\": {kind!r}, \"text\": ...}}", f"{where}[{j}]")
        parts.append(part["text"])
    return "\n".join(parts)


class ResponseBuilder:
    """The ``response`` object of one request as its output items arrive, and the stream's events."""

    def __init__(self, body: ResponsesRequest, request_id: str) -> None:
        self.body = body
        self.id = f"resp_{request_id}"
        self.created_at = int(time.time())
        self.output: list[dict] = []
        self.open: dict | None = None  # the item being streamed
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.sequence_number = 0

    # -- the object -------------------------------------------------------------------------------------
    def status(self) -> str:
        """``incomplete`` when ``max_output_tokens`` cut the reply, else ``completed``."""
        return "incomplete" if self.finish_reason == "length" else "completed"

    def object(self, status: str | None = None, error: dict | None = None) -> dict:
        body = self.body
        status = status or self.status()
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": body.model,
            "output": self.output if status != "in_progress" else [],
            "parallel_tool_calls": body.parallel_tool_calls is not False, "previous_response_id": None,
            "store": False, "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": {"format": fmt}, "tool_choice": body.tool_choice or ("auto" if body.tools else "none"),
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled", "background": False, "usage": self.usage if status != "in_progress" else None,
            "metadata": body.metadata or {}, "user": body.user, "safety_identifier": body.safety_identifier,
            "prompt_cache_key": body.prompt_cache_key}

    def set_usage(self, usage: dict) -> None:
        self.usage = {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": (usage.get("prompt_tokens_details") or {})
                                               .get("cached_tokens", 0)},
                      "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}

    def from_completion(self, completion: dict) -> dict:
        """The whole response from a chat completion (the answer of ``stream`` false)."""
        choice = completion["choices"][0]
        message = choice["message"]
        self.finish_reason = choice["finish_reason"]
        if message.get("content") or not message.get("tool_calls"):
            self.output.append(self._message(message.get("content") or "", self.status()))
        for call in message.get("tool_calls") or []:
            item = self._call(call, "completed")
            item["status"] = self._call_status(item["arguments"])
            self.output.append(item)
        self.set_usage(completion["usage"])
        return self.object()

    def _message(self, text: str, status: str) -> dict:
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    def _call_status(self, arguments: str) -> str:
        """A function_call item's final status: ``incomplete`` when ``max_output_tokens`` cut its arguments
        (a named function's, which are the reply itself; they are then not whole JSON), else ``completed``.
        The calls of ``auto`` and ``required`` are only made of complete JSON, and one cut short is dropped."""
        if self.finish_reason != "length":
            return "completed"
        try:
            json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return "incomplete"
        return "completed"

    def _call(self, call: dict, status: str) -> dict:
        return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                "name": call["function"]["name"], "arguments": call["function"].get("arguments") or "",
                "status": status}

    # -- the stream -------------------------------------------------------------------------------------
    def event(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n"

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The Responses events of a chat stream (``chunks``: its server-sent events). An error after the
        stream began is an ``error`` event, then ``response.failed``. Closing this closes ``chunks`` (and with
        them the Triton request)."""
        try:
            yield self.event("response.created", response=self.object("in_progress"))
            yield self.event("response.in_progress", response=self.object("in_progress"))
            async for chunk in chunks:
                data = chunk.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    error = payload["error"]
                    yield self.event("error", code=error.get("code"), message=error["message"],
                                     param=error.get("param"))
                    yield self.event("response.failed", response=self.object(
                        "failed", {"code": "server_error", "message": error["message"]}))
                    return
                if payload.get("usage"):
                    self.set_usage(payload["usage"])
                for choice in payload.get("choices") or []:
                    for text in self._delta(choice["delta"]):
                        yield text
                    self.finish_reason = choice.get("finish_reason") or self.finish_reason
            if self.open is None and not self.output:  # no text and no call: an empty message, as non-streaming
                for text in self._open_message():
                    yield text
            for text in self._close():
                yield text
            status = self.status()
            yield self.event(f"response.{status}", response=self.object(status))
        finally:
            await chunks.aclose()

    def _delta(self, delta: dict) -> list[str]:
        """The events of one chat delta: text goes to the open message item (opened first if needed); a new
        tool call closes the open item and opens a function_call item; its arguments follow as deltas."""
        events = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._close() + self._open_message()
            self.open["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                     output_index=len(self.output) - 1, content_index=0, delta=delta["content"],
                                     logprobs=[]))
        for call in delta.get("tool_calls") or []:
            if call.get("id"):
                events += self._close()
                self.open = self._call({"id": call["id"], "function": {"name": call["function"]["name"]}},
                                       "in_progress")
                self.output.append(self.open)
                events.append(self.event("response.output_item.added", output_index=len(self.output) - 1,
                                         item=dict(self.open)))
            arguments = (call.get("function") or {}).get("arguments")
            if arguments and self.open is not None and self.open["type"] == "function_call":
                self.open["arguments"] += arguments
                events.append(self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                         output_index=len(self.output) - 1, delta=arguments))
        return events

    def _open_message(self) -> list[str]:
        self.open = self._message("", "in_progress")
        self.output.append(self.open)
        index, empty = len(self.output) - 1, {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [self.event("response.output_item.added", output_index=index, item={**self.open, "content": []}),
                self.event("response.content_part.added", item_id=self.open["id"], output_index=index,
                           content_index=0, part=empty)]

    def _close(self) -> list[str]:
        """The closing events of the open item, if any (its final status set)."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.output) - 1
        events = []
        if item["type"] == "message":
            item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                  content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                  content_index=0, part=part)]
        else:
            item["status"] = self._call_status(item["arguments"])
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"], arguments=item["arguments"]))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


def responses_routes(chat_completions: Callable[[ChatCompletionRequest, Request], Awaitable[Any]]) -> APIRouter:
    """``POST /v1/responses`` over ``chat_completions``, the ``/v1/chat/completions`` handler (it answers a
    chat completion dict, a streaming response of chat chunks, or a 499 response when the client left)."""
    router = APIRouter()

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        body.check()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            answer = await chat_completions(body.chat_request(request_id), request)
        except OpenAIError as error:
            raise responses_error(error) from None
        response = ResponseBuilder(body, request_id)
        if isinstance(answer, StreamingResponse):  # the chat route's own: disconnects still cancel the request
            answer.body_iterator = response.events(answer.body_iterator)
            return answer
        if not isinstance(answer, dict):  # the client disconnected
            return answer
        return response.from_completion(answer)

    return router
