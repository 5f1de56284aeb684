"""The prompt of a chat request: the chat template over its messages (and tools)."""

from __future__ import annotations

from openai_frontend.errors import OpenAIError
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.tool_calls import ToolChoice, messages_for_plain_template


def render_chat(tokenizer, body: ChatCompletionRequest, chat_template: str | None,
                 tools: ToolChoice | None = None, trust_request_template: bool = False) -> str:
    """The prompt text: the chat template (the request's ``chat_template``, the server's, or the tokenizer's)
    over the messages, with the generation prompt unless ``add_generation_prompt`` is false, the last message
    left open with ``continue_final_message``. A template that renders ``tools`` gets them; for one that does
    not, they (and earlier tool calls and results) are presented in the Hermes format
    (``openai_frontend.tool_calls``).

    A request's own template is Jinja code that runs in the frontend for as long as it likes (nested loops of
    100,000 each are allowed by Jinja's sandbox), so it is refused unless the operator trusts callers with it
    (``trust_request_template``; vLLM's ``--trust-request-chat-template`` makes the same choice).

    Raises:
        OpenAIError: 400 for a request's ``chat_template`` that is not trusted, or a template that fails.
    """
    if (body.chat_template is not None or "chat_template" in (body.chat_template_kwargs or {})) \
            and not trust_request_template:
        raise OpenAIError(400, "chat_template: a request may not bring its own chat template here (it would run "
                               "as code in the server); the operator allows it with --trust-request-chat-template",
                          "invalid_request", "chat_template")
    tools = tools or ToolChoice("none")
    chat_template = body.chat_template or chat_template
    messages = body.messages_for_template()
    template = chat_template or getattr(tokenizer, "chat_template", None) or ""
    kwargs = dict(body.chat_template_kwargs or {})
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if "tools" in template:
        if tools.active:
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools.tools]
    elif tools.active or has_tool_turns:
        messages = messages_for_plain_template(messages, tools.tools if tools.active else [])
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             chat_template=chat_template, **kwargs)
    except OpenAIError:
        raise
    except Exception as exc:  # a template that raises (e.g. roles it does not accept) is the request's fault
        raise OpenAIError(400, f"chat template failed: {exc}", "invalid_request", "messages") from None
