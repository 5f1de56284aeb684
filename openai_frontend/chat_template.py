"""The prompt of a chat request: the chat template over its messages (and tools)."""

from __future__ import annotations

import asyncio
import functools
import re
import uuid
from collections.abc import Callable

from tokenizers import Encoding, Tokenizer

from openai_frontend.errors import OpenAIError
from openai_frontend.limits import prompt_bytes_check, render_token_ids
from openai_frontend.protocol import ChatCompletionRequest
from openai_frontend.tool_calls import ToolChoice, messages_for_plain_template


def render_chat(tokenizer, body: ChatCompletionRequest, chat_template: str | None,
                 tools: ToolChoice | None = None, trust_request_template: bool = False,
                 add_special_tokens: bool = True, check_text: Callable[[str], None] | None = None) -> str | list[int]:
    """The prompt: the chat template (the request's ``chat_template``, the server's, or the tokenizer's)
    over the messages, with the generation prompt unless ``add_generation_prompt`` is false, the last message
    left open with ``continue_final_message``. A template that renders ``tools`` gets them; for one that does
    not, they (and earlier tool calls and results) are presented in the Hermes format
    (``openai_frontend.tool_calls``). ``developer`` messages are ``system`` ones for a template that does not name
    the developer role.

    The request's text is text: where a message, a tool or a template argument holds the text of a special token
    (``<|im_end|>``), that text becomes the ordinary tokens it spells, not the control token, so that a user
    cannot end their turn and open a system one (OpenAI's API treats such text the same way; vLLM's does not by
    default). Such a prompt is returned as its token ids (with the tokenizer's special tokens where
    ``add_special_tokens``); every other prompt as its text, which the chat route tokenizes the same way
    (``chat_prompt_ids``).

    A request's own template is Jinja code that runs in the frontend for as long as it likes (nested loops of
    100,000 each are allowed by Jinja's sandbox), so it is refused unless the operator trusts callers with it
    (``trust_request_template``; vLLM's ``--trust-request-chat-template`` makes the same choice).

    ``check_text`` (the prompt's byte bound, ``openai_frontend.limits.prompt_bytes_check``) sees the rendered text
    before anything tokenizes it.

    Raises:
        OpenAIError: 400 for a request's ``chat_template`` that is not trusted, ``chat_template_kwargs`` naming an
            argument of the request's own (``add_generation_prompt``, ...), a template that fails, or what
            ``check_text`` raises.
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
    taken = sorted(set(kwargs) & _RENDER_ARGUMENTS)
    if taken:
        raise OpenAIError(400, f"chat_template_kwargs.{taken[0]}: an argument of the rendering itself; send the "
                               "request's own field where it has one (add_generation_prompt, continue_final_message, "
                               "tools)", "invalid_value", "chat_template_kwargs")
    if "'developer'" not in template and '"developer"' not in template:
        # OpenAI's developer role is the system role of models trained before it: a template that does not name it
        # would render an unknown role (and add its default system prompt); vLLM converts it the same way.
        messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
    has_tool_turns = any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    if "tools" in template:
        if tools.active:
            kwargs["tools"] = [{"type": "function", "function": f} for f in tools.tools]
    elif tools.active or has_tool_turns:
        messages = messages_for_plain_template(messages, tools.tools if tools.active else [])
    hidden = _SpecialText(tokenizer)
    messages, kwargs = hidden.hide(messages), hidden.hide(kwargs)
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message,
                                             chat_template=chat_template, **kwargs)
    except OpenAIError:
        raise
    except Exception as exc:  # a template that raises (e.g. roles it does not accept) is the request's fault
        raise OpenAIError(400, f"chat template failed: {exc}", "invalid_request", "messages") from None
    if check_text is not None:
        check_text(text)
    return hidden.token_ids(text, add_special_tokens) if hidden.found else text


# apply_chat_template's own arguments: a chat_template_kwargs entry of one of these names would be passed twice.
_RENDER_ARGUMENTS = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                               "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                               "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class _SpecialText:
    """Special tokens' text in a request's data, swapped for placeholders before the template renders and
    tokenized as ordinary text after it (:func:`render_chat`)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.pattern = _special_pattern(tokenizer)
        self.nonce = uuid.uuid4().hex  # placeholders no request text can forge
        self.found: list[str] = []
        self.marks_in_text = False  # the request's own text holds a placeholder's delimiters (private-use chars)

    def hide(self, value):
        """``value`` (strings, lists and dicts of them) with each special token's text replaced by a placeholder."""
        if self.pattern is None:
            return value
        if isinstance(value, str):
            self.marks_in_text |= "\ue000" in value or "\ue001" in value
            return self.pattern.sub(self._placeholder, value)
        if isinstance(value, list):
            return [self.hide(item) for item in value]
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        return value

    def _placeholder(self, match: re.Match) -> str:
        self.found.append(match.group(0))
        return f"\ue000{self.nonce}:{len(self.found) - 1}\ue001"

    def token_ids(self, text: str, add_special_tokens: bool) -> list[int]:
        """The rendered ``text``'s token ids: the template's own markup tokenized as the engine tokenizes text
        (special tokens parsed), each placeholder as its special token's text spelled in ordinary tokens.

        Raises:
            OpenAIError: 400, the tokenizer has no Rust backend to do this with, or the template changed a
                placeholder (it transformed the message text) so that the text cannot be told from the markup.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise OpenAIError(400, f"the request's text holds the special token {self.found[0]!r}, which this "
                                   "model's tokenizer cannot take as plain text", "invalid_value", "messages")
        pieces = re.split(f"\ue000{self.nonce}:(\\d+)\ue001", text)
        # A placeholder the template changed (upper-cased, cut) is left in the text between the intact ones; its
        # delimiters show it unless the request's own text had them too, where the nonce (in any case) must.
        changed = (lambda piece: self.nonce in piece.lower()) if self.marks_in_text else \
            (lambda piece: "\ue000" in piece or "\ue001" in piece)
        if any(changed(piece) for piece in pieces[::2]):
            raise OpenAIError(400, f"the request's text holds the special token {self.found[0]!r}, and the chat "
                                   "template changes the text around it", "invalid_value", "messages")
        plain = _plain_text_tokenizer(backend)
        encodings = [plain.encode(self.found[int(piece)], add_special_tokens=False) if odd
                     else backend.encode(piece, add_special_tokens=False)
                     for odd, piece in ((i % 2 == 1, p) for i, p in enumerate(pieces)) if piece]
        return backend.post_process(Encoding.merge(encodings), add_special_tokens=add_special_tokens).ids


async def chat_prompt_ids(tokenizer, body: ChatCompletionRequest, tools: ToolChoice | None,
                          chat_template: str | None, trust_request_template: bool, limit: int) -> list[int]:
    """The chat prompt's token ids, as the model gets them (the chat route, the render route, ``/tokenize``):
    ``render_chat``'s text tokenized here, with the tokenizer's own special tokens only where the request's
    ``add_special_tokens`` asks (false by default, as at vLLM): a template that writes the BOS itself (Llama 3,
    Mistral, Gemma) would otherwise start with two. ``limit``: the model's max_model_len, in tokens; the
    rendered text is held to its byte bound before anything tokenizes it.

    Raises:
        OpenAIError: 400 for a template that fails or may not run (``render_chat``), or a prompt too long
            (param ``messages``).
    """
    prompt = await asyncio.to_thread(lambda: render_chat(
        tokenizer, body, chat_template, tools, trust_request_template, body.add_special_tokens,
        check_text=prompt_bytes_check(tokenizer, limit, "messages")))
    (ids,) = await render_token_ids(tokenizer, [prompt], limit, add_special_tokens=body.add_special_tokens,
                                    param="messages")
    return ids


@functools.lru_cache(maxsize=16)
def _special_pattern(tokenizer) -> re.Pattern | None:
    """A regex of the tokenizer's special tokens' text (longest first), or None when it has none."""
    texts = sorted({t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()
                    if t.special and t.content}, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


@functools.lru_cache(maxsize=16)
def _plain_text_tokenizer(backend: Tokenizer) -> Tokenizer:
    """A copy of ``backend`` that spells special tokens' text in ordinary tokens (``encode_special_tokens``); a
    copy, because the flag is the tokenizer's and other threads encode with it meanwhile."""
    plain = Tokenizer.from_str(backend.to_str())
    plain.encode_special_tokens = True
    return plain
