"""vLLM's utility routes beside OpenAI's: one model by id, ``/tokenize`` and ``/detokenize``.

``/tokenize`` takes a completion's ``prompt`` or a chat's ``messages`` (rendered as ``/v1/chat/completions``
renders them) and answers the token ids the engine computes, with ``count`` and ``max_model_len``;
``/detokenize`` turns token ids back into text. Tokenizing runs on a worker thread, with the prompt bound
generation has, and the answer is written as JSON off the event loop (``openai_frontend.limits``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from openai_frontend.chat_template import chat_prompt_ids
from openai_frontend.errors import OpenAIError
from openai_frontend.limits import json_response, render_token_ids
from openai_frontend.models import ModelFiles, resolve
from openai_frontend.protocol import chat_completion_request
from openai_frontend.tool_calls import ToolChoice
from openai_frontend.triton_stream import TritonLLM


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` (``prompt``) or ``TokenizeChatRequest`` (``messages``)."""

    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # as vLLM: true for a prompt, false for messages (the template's own)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    tokens: list[int]


def token_routes(triton: TritonLLM, config, files: ModelFiles) -> APIRouter:
    """The routes, over ``triton``, the frontend's ``config`` (chat template settings) and the models' ``files``."""
    router = APIRouter()

    async def tokenizer(model: str):
        name, version = await resolve(triton, model)
        return await files.tokenizer(name, version), name, version

    @router.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        await resolve(triton, model_id)  # 404 for a model not served, 503 for one not ready
        return await files.card(model_id)

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "send prompt or messages, exactly one of them", "invalid_value", "prompt")
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        chat = tools = None
        if body.messages is not None:  # checked as /v1/chat/completions checks them, before the model is looked up
            chat = chat_completion_request(model=body.model, messages=body.messages, tools=body.tools,
                                           chat_template=body.chat_template,
                                           chat_template_kwargs=body.chat_template_kwargs,
                                           add_generation_prompt=body.add_generation_prompt,
                                           continue_final_message=body.continue_final_message,
                                           add_special_tokens=special)
            chat.check()
            tools = await asyncio.to_thread(ToolChoice.from_request, chat.tools, chat.tool_choice,  # checks schemas
                                            chat.parallel_tool_calls)
        tok, name, version = await tokenizer(body.model)
        limit = await files.max_model_len(name, version)
        if chat is not None:
            ids = await chat_prompt_ids(tok, chat, tools, config.chat_template, config.trust_request_chat_template,
                                        limit)
        else:
            [ids] = await render_token_ids(tok, [body.prompt], limit, add_special_tokens=special)
        answer = {"count": len(ids), "max_model_len": limit, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = await asyncio.to_thread(tok.convert_ids_to_tokens, ids)
        return await json_response(answer)

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok, _, _ = await tokenizer(body.model)
        if any(not 0 <= t < len(tok) for t in body.tokens):
            raise OpenAIError(400, f"token ids must be in [0, {len(tok)})", "invalid_value", "tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, body.tokens)}

    return router

