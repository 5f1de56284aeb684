"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions`` (OpenAI's fields, plus vLLM's
sampling extras), and their mapping onto the ``llm`` model's ``sampling_parameters``.

Only types are checked here; ranges (temperature >= 0, n >= 1, top_logprobs <= 20, ...) are the engine's to
check, and its message comes back as a 400 (so is an invalid JSON schema, regex or grammar). Unknown fields
are a 400, as at OpenAI; fields OpenAI has but this server does not implement are a 400 naming the field
when they ask for something (``logit_bias``, ``suffix``, ...), and ignored when they do not change the output
(``user``, ``store``, ``metadata``, ...). ``response_format`` and ``tools`` are mapped in
``openai_frontend.structured`` and ``openai_frontend.tool_calls``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from backend.sampling_params import MAX_LOGPROBS
from serve.request_parsing import INT32_MAX
from openai_frontend.errors import OpenAIError
from openai_frontend.structured import structured_outputs


# OpenAI's request fields that ask for what this server does not do: a 400 that says so, not "unrecognized".
OPENAI_UNSUPPORTED = {"reasoning_effort": "the models served here do not reason", "verbosity": "no reasoning models",
                      "prediction": "predicted outputs", "audio": "audio output",
                      "web_search_options": "web search"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # Ignored, as they do not change the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias in [-100, 100]
    # vLLM's sampling extras (OpenAI SDK: extra_body).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top-N at its position
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None
    priority: int | None = None  # lower runs first (vLLM's priority scheduling)
    request_id: str | None = None  # the answer's id and Triton's request id (or the X-Request-Id header)
    cache_salt: str | None = None  # prefix-cache blocks shared only among requests with the same salt
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar, json_object
    response_format: dict[str, Any] | None = None  # text, json_object, json_schema (openai_frontend.structured)
    # vLLM's fields this server takes at their defaults only (check_defaults): clients that send every field of
    # vLLM's request send them.
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    include_reasoning: bool | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    spaces_between_special_tokens: bool | None = None

    DEFAULT_ONLY: ClassVar[dict[str, Any]] = {
        "use_beam_search": False, "length_penalty": 1.0, "include_reasoning": True, "return_token_ids": False,
        "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True}

    def check_defaults(self) -> None:
        """Raises: OpenAIError 400 naming a field of :attr:`DEFAULT_ONLY` sent with another value than its default
        (beam search, token ids in the answer, ...: what it asks for is not implemented)."""
        for name, default in self.DEFAULT_ONLY.items():
            value = getattr(self, name)
            if value is not None and value != default:
                raise OpenAIError(400, f"{name} {value!r} is not supported: only its default, {default!r}",
                                  "unsupported_parameter", name)

    def sampling_parameters(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """The model's ``sampling_parameters``: the fields that were sent (``max_tokens`` None = up to the
        context length).

        Raises:
            OpenAIError: 400 for an empty string among ``bad_words``.
        """
        if self.bad_words is not None and "" in self.bad_words:  # Triton's path drops them (TensorRT-LLM's "none")
            raise OpenAIError(400, "bad_words must be non-empty strings", "invalid_value", "bad_words")
        values = {"max_tokens": max_tokens, "logprobs": logprobs,
                  "stop": [self.stop] if isinstance(self.stop, str) else self.stop}
        for name in ("n", "seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k",
                     "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "bad_words",
                     "skip_special_tokens", "prompt_logprobs", "logit_bias", "allowed_token_ids",
                     "include_stop_str_in_output", "truncate_prompt_tokens", "priority", "cache_salt"):
            values[name] = getattr(self, name)
        values["structured_outputs"] = structured_outputs(self.response_format, self.structured_outputs)
        return {k: v for k, v in values.items() if v is not None or k == "max_tokens"}

    def check_streaming(self) -> None:
        """Raises: OpenAIError 400 for prompt_logprobs with stream true, or stream_options without it (as vLLM)."""
        if self.stream and self.prompt_logprobs is not None:  # as vLLM: they belong to the whole answer
            raise OpenAIError(400, "prompt_logprobs are not available when stream is true", "invalid_value",
                              "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError(400, "stream_options are only taken with stream true", "invalid_value",
                              "stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats``: usage so far in every chunk (with include_usage)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Sampling):
    # A string, a list of strings, token ids, or a list of token-id lists (one request per prompt).
    prompt: str | list[int] | list[list[int]] | list[str]
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool | None = None  # vLLM's: false tokenizes text prompts without the tokenizer's BOS

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _prompt_shape(cls, value, handler):
        """One error that names the four accepted shapes, instead of pydantic's first of four."""
        try:
            return handler(value)
        except ValidationError:
            raise ValueError("must be a string, a list of strings, a list of token ids (integers) or a list of "
                             "token-id lists, one shape for the whole list") from None

    def check(self) -> None:
        if self.suffix:
            raise OpenAIError(400, "suffix is not supported", "unsupported_parameter", "suffix")
        self.check_defaults()
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise OpenAIError(400, "best_of other than n is not supported", "unsupported_parameter", "best_of")
        if isinstance(self.prompt, list) and (not self.prompt or any(p == [] or p == "" for p in self.prompt)):
            raise OpenAIError(400, "prompt must not be empty", "invalid_value", "prompt")
        for prompt in self.prompts:
            if isinstance(prompt, list) and not all(0 <= t < 2**31 for t in prompt):
                raise OpenAIError(400, "prompt token ids must be in [0, vocab size)", "invalid_value", "prompt")
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError(400, "max_tokens 0 is only meaningful with echo (scoring the prompt)", "invalid_value",
                              "max_tokens")
        self.check_streaming()

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: its text or its token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


# OpenAI's message roles (``function``: its deprecated tool role); the role is pasted into the chat template's
# markup, so no other string is taken.
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Message fields besides role and content, passed to the chat template: OpenAI's, and vLLM's reasoning text.
# ``annotations`` (a reply's URL citations) comes back in a reply the openai SDK serializes (``model_dump()``).
CHAT_MESSAGE_FIELDS = {"name", "tool_calls", "tool_call_id", "function_call", "refusal", "audio", "annotations",
                       "reasoning", "reasoning_content"}
CHAT_MESSAGE_TEXT_FIELDS = ("name", "tool_call_id", "refusal", "reasoning", "reasoning_content")  # string or null


def _check_tool_calls(tool_calls: Any, i: int, role: str) -> None:
    """An assistant message's earlier ``tool_calls``, which the chat template renders: a list of
    ``{"id", "type": "function", "function": {"name", "arguments"}}``. As vLLM takes them, ``id`` and ``type`` may
    be left out and ``arguments`` may be an object or left out (no arguments); OpenAI's form has them all.

    Raises: OpenAIError 400 for tool calls on a message that is not the assistant's (the template would not
    render them; an empty list, which some clients send on every message, is taken), or naming the first call,
    or part of it, that is not of that shape."""
    if tool_calls is None or tool_calls == []:
        return
    where = f"messages[{i}].tool_calls"
    if role != "assistant":
        raise OpenAIError(400, f"{where}: only an assistant message carries tool calls, not a {role!r} one",
                          "invalid_value", f"messages.{i}.tool_calls")
    if not isinstance(tool_calls, list):
        raise OpenAIError(400, f"{where} must be a list of tool calls", "invalid_value", f"messages.{i}.tool_calls")
    shape = '{"id": ..., "type": "function", "function": {"name": ..., "arguments": "<JSON text>"}}'
    for j, call in enumerate(tool_calls):
        at, param = f"{where}[{j}]", f"messages.{i}.tool_calls.{j}"
        if not isinstance(call, dict):
            raise OpenAIError(400, f"{at} must be a tool call object, {shape}", "invalid_value", param)
        if call.get("type") not in (None, "function"):
            raise OpenAIError(400, f"{at}.type must be function, got {call['type']!r}", "invalid_value",
                              f"{param}.type")
        if call.get("id") is not None and not isinstance(call["id"], str):
            raise OpenAIError(400, f"{at}.id must be a string", "invalid_value", f"{param}.id")
        function = call.get("function")
        if not isinstance(function, dict):
            raise OpenAIError(400, f"{at}.function must be an object with a name and its arguments as JSON text",
                              "invalid_value", f"{param}.function")
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise OpenAIError(400, f"{at}.function.name must be a non-empty string", "invalid_value",
                              f"{param}.function.name")
        if not isinstance(function.get("arguments"), (str, dict, type(None))):
            raise OpenAIError(400, f"{at}.function.arguments must be JSON text (or an object)", "invalid_value",
                              f"{param}.function.arguments")


def _check_text_part(part: dict, i: int, j: int) -> None:
    """A content part of ``messages[i]``: ``{"type": "text", "text": "..."}``, nothing else (as at OpenAI, whose
    API refuses other fields of a part; a hint such as ``cache_control`` would otherwise be silently ignored).

    Raises: OpenAIError 400 for another part type (images, audio, files: this server serves text models), a
    text part without a text string, or a field beside ``type`` and ``text``."""
    where, param = f"messages[{i}].content[{j}]", f"messages.{i}.content.{j}"
    if part.get("type") != "text":
        raise OpenAIError(400, f"{where}: content part type {part.get('type')!r} is not supported: only text parts",
                          "unsupported_parameter", f"{param}.type")
    if not isinstance(part.get("text"), str):
        raise OpenAIError(400, f"{where} is a text part without a text string", "invalid_value", f"{param}.text")
    unknown = sorted(set(part) - {"type", "text"})
    if unknown:
        raise OpenAIError(400, f"{where} has unknown field(s) {', '.join(unknown)}; a text part has type and text",
                          "invalid_value", f"{param}.{unknown[0]}")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # CHAT_MESSAGE_FIELDS, checked in ChatCompletionRequest.check
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's: a Jinja template for this request instead of the model's
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    modalities: list[Literal["text"]] | None = None
    # vLLM's: the template writes the special tokens it wants (a BOS); true adds the tokenizer's as well.
    add_special_tokens: bool = False
    echo: bool | None = None  # vLLM's chat echo: false only (check)

    def check(self) -> None:
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError(400, "top_logprobs requires logprobs true", "invalid_value", "top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise OpenAIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}",
                              "invalid_value", "top_logprobs")
        if self.max_completion_tokens is not None and not 1 <= self.max_completion_tokens <= INT32_MAX:
            raise OpenAIError(400, f"max_completion_tokens must be in [1, {INT32_MAX}], got {self.max_completion_tokens}",
                              "invalid_value", "max_completion_tokens")
        if not self.messages:
            raise OpenAIError(400, "messages must not be empty", "invalid_value", "messages")
        if self.echo:
            raise OpenAIError(400, "echo is not supported in chat (completions echo the prompt)",
                              "unsupported_parameter", "echo")
        self.check_defaults()
        for i, message in enumerate(self.messages):
            if message.role not in CHAT_ROLES:
                raise OpenAIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got "
                                  f"{message.role!r}", "invalid_value", f"messages.{i}.role")
            unknown = sorted(set(message.model_extra or {}) - CHAT_MESSAGE_FIELDS)
            if unknown:
                raise OpenAIError(400, f"messages[{i}] has unknown field(s) {', '.join(unknown)}", "invalid_value",
                                  f"messages.{i}.{unknown[0]}")
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                _check_text_part(part, i, j)
            # As at OpenAI: only an assistant message (one that carries tool calls or a refusal) may have no
            # content; the template sees an empty one.
            if message.content is None and message.role != "assistant":
                raise OpenAIError(400, f"messages[{i}].content is required for role {message.role!r}",
                                  "invalid_value", f"messages.{i}.content")
            for field in CHAT_MESSAGE_TEXT_FIELDS:  # rendered into the prompt by templates that use them
                value = (message.model_extra or {}).get(field)
                if value is not None and not isinstance(value, str):
                    raise OpenAIError(400, f"messages[{i}].{field} must be a string, got {type(value).__name__}",
                                      "invalid_value", f"messages.{i}.{field}")
            _check_tool_calls((message.model_extra or {}).get("tool_calls"), i, message.role)
        if self.continue_final_message and self.add_generation_prompt:
            raise OpenAIError(400, "continue_final_message needs add_generation_prompt false", "invalid_value",
                              "continue_final_message")
        self.check_streaming()

    def messages_for_template(self) -> list[dict]:
        """The messages as the chat template wants them: a list of text parts joined into one string, a newline
        between parts (as vLLM joins them for templates that take a string)."""
        out = []
        for message in self.messages:
            item = message.model_dump(exclude_none=True)
            item.setdefault("content", "")
            if isinstance(message.content, list):
                parts = []
                for part in message.content:
                    if part.get("type") != "text":
                        raise OpenAIError(400, f"content part type {part.get('type')!r} is not supported",
                                          "unsupported_parameter", "messages")
                    parts.append(part["text"])
                item["content"] = "\n".join(parts)
            out.append(item)
        return out


def chat_completion_request(**fields: Any) -> ChatCompletionRequest:
    """A ChatCompletionRequest built from another route's body (``/tokenize``'s messages, a Responses request):
    a field it refuses is the same 400 as when a client sends it to ``/v1/chat/completions`` (the app's handler
    of RequestValidationError names the field).

    Raises:
        RequestValidationError: a field of the wrong type or shape.
    """
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as exc:
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]) from None
