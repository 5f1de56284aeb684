"""The ASGI app: OpenAI's routes over :class:`TritonLLM`.

Every request goes to Triton as one streaming request per prompt (``n`` completions each, told apart by the
model's ``index`` output); non-streaming answers are the deltas joined. A streaming answer is only started
once the first delta arrived, so a request the model rejects gets its error status, not a 200 stream.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import re
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from backend.fan_in import Completion, FanIn
from backend.prompt_limits import encode_prompt
from openai_frontend import metrics
from openai_frontend.auth import protect
from openai_frontend.chat_template import chat_prompt_ids
from openai_frontend.errors import OpenAIError, internal_error
from openai_frontend.limits import (Limits, check_completion_count, install_limits, json_response, render_token_ids,
                                    warm_tokenizers)
from openai_frontend.models import ModelFiles, model_ids, resolve
from openai_frontend.protocol import OPENAI_UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from openai_frontend.responses import responses_routes
from openai_frontend.text_check import LoneSurrogateMiddleware
from openai_frontend.token_bytes import TextOffsets, TokenBytes
from openai_frontend.token_routes import token_routes
from openai_frontend.tool_calls import ToolCallParser, ToolChoice
from openai_frontend.triton_stream import Delta, TritonLLM

DEFAULT_MODEL_REPOSITORY = Path(__file__).resolve().parent.parent / "model_repository"
RETRY_AFTER_S = 1  # the Retry-After of every 503 answer
log = logging.getLogger("openai_frontend")


@dataclass
class FrontendConfig:
    """Args: triton_url: Triton's gRPC ``host:port``. model_repository: where each model's tokenizer is
    found (config.pbtxt's ``model`` parameter, overridden by ``<version>/engine.json``). tokenizer: one
    tokenizer (directory or .gguf) for every model instead. chat_template: a Jinja template (text) used
    instead of the tokenizer's. api_key: required as ``Authorization: Bearer`` when set
    (``openai_frontend.auth``). limits: request bounds (``openai_frontend.limits``). open_render: the render
    endpoints need no key (``openai_frontend.auth.RENDER_PATHS``). trust_request_chat_template: a request's own
    ``chat_template`` is rendered instead of refused (``openai_frontend.chat_template.render_chat``)."""

    triton_url: str = "localhost:8001"
    model_repository: Path = DEFAULT_MODEL_REPOSITORY
    tokenizer: str | None = None
    chat_template: str | None = None
    api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    triton_metrics_url: str | None = "http://localhost:8002/metrics"  # re-exposed on /metrics (metrics.py)
    open_render: bool = False
    trust_request_chat_template: bool = False


# pydantic names the member of a union it tried in an error's location (messages.0.content.str): not a field
_UNION_MEMBER = re.compile(r"str|int|float|bool|none|[a-z-]+\[.*\]")

def create_app(config: FrontendConfig) -> FastAPI:
    triton = TritonLLM(config.triton_url, config.model_repository)
    files = ModelFiles(config.model_repository, config.tokenizer)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await asyncio.to_thread(warm_tokenizers, config.model_repository, config.tokenizer)  # before serving
        # The startup heap (libraries, tokenizers: ~400k objects) leaves the collector's view: a full collection
        # of it took 0.2 s, on the event loop, whenever the objects of heavy requests set one off.
        gc.freeze()
        yield
        await triton.close()

    app = FastAPI(title="Triton LLM, OpenAI API", lifespan=lifespan)
    app.state.triton = triton
    metrics.install(app, triton, config.triton_metrics_url)  # GET /metrics, vLLM names
    app.add_middleware(LoneSurrogateMiddleware)  # inside the body limit: no body over it is read
    install_limits(app, config.limits)
    protect(app, config.api_key, config.open_render)  # added last: the outermost, so an unauthenticated body is never read

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError):
        # A 503 is temporary (overload, a model not ready, Triton away): clients and gateways may retry.
        headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    # Starlette hands a handler of Exception to its outermost middleware, so this answers whatever a route or
    # middleware raised unexpectedly (without it the answer is a plain-text 500); the middleware then raises the
    # exception again, and the server logs its traceback.
    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception):
        return JSONResponse(internal_error().body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):  # unknown route, wrong method, ...
        code = {400: "invalid_request", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = str(exc.detail)
        if exc.status_code == 400 and message == "There was an error parsing the body":  # Starlette's words
            message = ("the body could not be read as JSON: it is not valid UTF-8, or it nests too deeply, or it "
                       f"holds an integer of over {sys.get_int_max_str_digits()} digits")
        return JSONResponse(OpenAIError(exc.status_code, message, code).body(), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:] if not _UNION_MEMBER.fullmatch(str(p))) or None
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        code = "invalid_request"
        if first.get("type") == "extra_forbidden" and param in OPENAI_UNSUPPORTED:
            message, code = f"{param} is not supported by this server ({OPENAI_UNSUPPORTED[param]})", \
                "unsupported_parameter"
        elif first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        elif first.get("type") == "json_invalid":  # loc ("body", <character offset>)
            reason = (first.get("ctx") or {}).get("error")
            message, param = f"the body is not valid JSON (at character {param}{f': {reason}' if reason else ''})", None
        elif param is None and first.get("type") == "missing":  # no body at all
            message = "the request has no body: send a JSON object with Content-Type: application/json"
        elif param is None and content_type != "application/json":
            message = (f"the body must be a JSON object sent with Content-Type: application/json (got "
                       f"{content_type or 'no Content-Type'})")
        else:
            # The message alone: the error's input, context and location in the source stay out.
            msg = first.get("msg", "invalid request").removeprefix("Value error, ")  # our validators' own words
            message = f"{param}: {msg}" if param else msg
        return JSONResponse(OpenAIError(400, message, code, param).body(), status_code=400)

    @app.get("/health")
    async def health():
        if await triton.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # health checkers using HEAD

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [await files.card(model_id) for model_id in await model_ids(triton)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.check()
        prompts = body.prompts
        check_completion_count(len(prompts), body.n, config.limits)
        name, version = await resolve(triton, body.model)
        if body.add_special_tokens is False:  # vLLM's: text prompts without the tokenizer's BOS and the like
            tokenizer = await files.tokenizer(name, version)
            limit = await files.max_model_len(name, version)
            prompts = await render_token_ids(tokenizer, prompts, limit, add_special_tokens=False)
        # echo with max_tokens 0 scores the prompt alone (as vLLM: one token is generated and dropped).
        echo_only = bool(body.echo) and body.max_tokens == 0
        max_tokens = 1 if echo_only else body.max_tokens if body.max_tokens is not None else 16
        sampling = body.sampling_parameters(max_tokens, body.logprobs)
        if len(prompts) > 1:  # the prompts take one turn together in the engine's fair queuing
            sampling["fairness_key"] = uuid.uuid4().hex
        echo_logprobs = bool(body.echo) and body.logprobs is not None
        if echo_logprobs:  # the prompt's tokens come back with their logprobs, from the prefill itself
            sampling["prompt_logprobs"] = max(body.prompt_logprobs or 0, body.logprobs)
        texts, ids, token_bytes = [p if isinstance(p, str) else "" for p in prompts], [None] * len(prompts), None
        if body.logprobs is not None or (body.echo and (body.truncate_prompt_tokens is not None
                                                        or any(not isinstance(p, str) for p in prompts))):
            tokenizer = await files.tokenizer(name, version)
            token_bytes = TokenBytes(tokenizer, body.skip_special_tokens is not False)
            if body.echo:
                texts, ids = await asyncio.to_thread(_echo_prompts, tokenizer, prompts, echo_logprobs,
                                                     body.truncate_prompt_tokens)
        request_id = _request_id(body, request)
        view = _View("text_completion", f"cmpl-{request_id}", body.model, chat=False, echo=bool(body.echo),
                     prompts=texts, n=body.n or 1, top_n=body.logprobs, echo_only=echo_only, prompt_ids=ids,
                     token_bytes=token_bytes,
                     prompt_logprobs=body.prompt_logprobs, continuous_usage=body.continuous_usage)
        events = _merged(triton, name, version, prompts, sampling, request_id)
        if echo_logprobs:
            events = _prompt_logprobs_first(events)
        return await _respond(view, events, body.stream, body.include_usage, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        body.check()
        check_completion_count(1, body.n, config.limits)
        tools = await asyncio.to_thread(ToolChoice.from_request, body.tools, body.tool_choice,  # checks schemas
                                        body.parallel_tool_calls)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = body.sampling_parameters(max_tokens, logprobs)
        if tools.structured_outputs() is not None:
            if "structured_outputs" in sampling:
                given = "response_format" if body.response_format is not None else "structured_outputs"
                raise OpenAIError(400, f"tool_choice {tools.mode} constrains the reply; drop {given}",
                                  "invalid_value", "tool_choice")
            sampling["structured_outputs"] = tools.structured_outputs()
        name, version = await resolve(triton, body.model)
        tokenizer = await files.tokenizer(name, version)
        prompt_ids = await _chat_prompt_ids(tokenizer, body, tools, name, version)
        request_id = _request_id(body, request)
        view = _View("chat.completion", f"chatcmpl-{request_id}", body.model, chat=True, echo=False,
                     prompts=[""], n=body.n or 1, top_n=logprobs,
                     tools=tools if tools.active else None,
                     prompt_logprobs=body.prompt_logprobs, continuous_usage=body.continuous_usage,
                     end_token_ids=frozenset(tokenizer.all_special_ids) if body.skip_special_tokens is not False
                     else frozenset(),
                     token_bytes=TokenBytes(tokenizer, body.skip_special_tokens is not False) if body.logprobs else None)
        events = _merged(triton, name, version, [prompt_ids], sampling, request_id)
        return await _respond(view, events, body.stream, body.include_usage, request)

    async def _chat_prompt_ids(tokenizer, body: ChatCompletionRequest, tools: ToolChoice, name: str,
                               version: str) -> list[int]:
        limit = await files.max_model_len(name, version)
        return await chat_prompt_ids(tokenizer, body, tools, config.chat_template, config.trust_request_chat_template,
                                     limit)

    # vLLM's render endpoints: the token ids the engine will compute for a request, without running it. The
    # Gateway API Inference Extension's endpoint picker (llm-d token-producer) tokenizes prompts through them
    # for its precise prefix-cache scorer, so its block keys match the engine's KV events.
    @app.post("/v1/completions/render")
    async def completions_render(body: CompletionRequest):
        body.check()
        prompts = body.prompts
        check_completion_count(len(prompts), 1, config.limits)
        name, version = await resolve(triton, body.model)
        tokenizer = await files.tokenizer(name, version)
        if any(isinstance(prompt, list) for prompt in prompts):  # ids as the engine checks them
            vocab = await files.vocab_size(name, version)
            bad = next((t for prompt in prompts if isinstance(prompt, list) for t in prompt if t >= vocab), None)
            if bad is not None:
                raise OpenAIError(400, f"prompt token ids must be integers in [0, {vocab}), got {bad}",
                                  "invalid_value", "prompt")
        limit = await files.max_model_len(name, version)
        ids = await render_token_ids(tokenizer, prompts, limit)
        return await json_response([{"token_ids": token_ids} for token_ids in ids])

    @app.post("/v1/chat/completions/render")
    async def chat_completions_render(body: ChatCompletionRequest):
        body.check()
        name, version = await resolve(triton, body.model)
        tokenizer = await files.tokenizer(name, version)
        tools = await asyncio.to_thread(ToolChoice.from_request, body.tools, body.tool_choice,  # checks schemas
                                        body.parallel_tool_calls)
        return await json_response({"token_ids": await _chat_prompt_ids(tokenizer, body, tools, name, version)})

    app.include_router(token_routes(triton, config, files))
    app.include_router(responses_routes(chat_completions))  # POST /v1/responses, over the chat route
    return app


def _request_id(body, request: Request) -> str:
    """vLLM's: the body's ``request_id``, else the ``X-Request-Id`` header, else a random one."""
    return body.request_id or request.headers.get("x-request-id") or uuid.uuid4().hex


def _echo_prompts(tokenizer, prompts: list[str | list[int]], with_ids: bool,
                  truncate: int | None = None) -> tuple[list[str], list]:
    """Each prompt as the engine reads it: its text (token ids decoded) and, when ``with_ids``, its token ids
    as the engine computes them (the same tokenizer and call), which name the prompt's tokens in echoed
    logprobs. With ``truncate`` (``truncate_prompt_tokens``) only the last ``truncate`` tokens, as the engine
    keeps them, and their text."""
    texts, ids = [], []
    for prompt in prompts:
        token_ids = None
        if with_ids or truncate is not None or not isinstance(prompt, str):
            token_ids = encode_prompt(tokenizer, prompt) if isinstance(prompt, str) else prompt
        if truncate is not None and len(token_ids) > truncate:
            token_ids = token_ids[-truncate:]
            texts.append(tokenizer.decode(token_ids))
        else:
            texts.append(prompt if isinstance(prompt, str) else tokenizer.decode(prompt))
        ids.append(token_ids if with_ids else None)
    return texts, ids


# -- generation ------------------------------------------------------------------------------------------
async def _prompt_logprobs_first(events: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """The same deltas, but each prompt's completions only after the delta carrying the prompt's logprobs
    (completion 0's first; with ``n`` > 1 another completion's first delta may come before it), so every
    echoed choice starts with the prompt's tokens."""
    seen: set[int] = set()
    held: dict[int, list[Delta]] = {}
    try:
        async for prompt_index, delta in events:
            if prompt_index not in seen and delta.prompt_logprobs is None:
                held.setdefault(prompt_index, []).append(delta)
                continue
            seen.add(prompt_index)
            yield prompt_index, delta
            for waiting in held.pop(prompt_index, []):
                yield prompt_index, waiting
        for prompt_index, waiting in held.items():  # never came (a failed request): what there is
            for delta in waiting:
                yield prompt_index, delta
    finally:
        await events.aclose()


async def _merged(triton: TritonLLM, name: str, version: str, prompts: list[str | list[int]],
                  sampling: dict, request_id: str) -> AsyncIterator[tuple[int, Delta]]:
    """(prompt index, delta) of every prompt's request, as they arrive (Triton request ids ``request_id``, or
    ``<request_id>-<i>`` for prompt i of several). Closing this iterator cancels every request still running."""
    if len(prompts) == 1:
        async for delta in triton.generate(name, version, prompts[0], sampling, request_id):
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt: str) -> None:
        try:
            async for delta in triton.generate(name, version, prompt, sampling, f"{request_id}-{i}"):
                await queue.put((i, delta, None))
        except Exception as exc:
            await queue.put((i, None, exc))
        await queue.put((i, None, None))

    tasks = []
    try:
        for i, p in enumerate(prompts):
            # One request opened per turn of the event loop: 256 tasks started at once would each run their
            # first step (building and sending a gRPC request) before the loop polls a socket again.
            tasks.append(asyncio.create_task(pump(i, p)))
            await asyncio.sleep(0)
        remaining = len(tasks)
        while remaining:
            i, delta, error = await queue.get()
            if error is not None:
                raise error
            if delta is None:
                remaining -= 1
                continue
            yield i, delta
    finally:
        for task in tasks:
            task.cancel()


@dataclass
class _Choice:
    """One choice as answered: its completion's deltas (``backend.fan_in``) and how they are presented."""

    completion: Completion
    echoed: str = ""  # the prompt, with echo: before the completion's text
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) entries, echoed prompt tokens first
    text_offsets: TextOffsets | None = None  # logprobs' text_offset, from the tokens' bytes
    offsets: list = field(default_factory=list)  # the text_offset of each entry of ``logprobs``
    started: bool = False
    tool_parser: ToolCallParser | None = None  # chat with tools: splits the reply into content and tool calls
    held_logprobs: list = field(default_factory=list)  # streaming with tools: chat logprobs of held-back text

    @property
    def finish_reason(self) -> str | None:
        return self.completion.finish_reason


@dataclass
class _View:
    """What an answer needs to know of its request, and the per-choice state while it streams."""

    object: str
    id: str
    model: str
    chat: bool
    echo: bool
    prompts: list[str]
    n: int
    top_n: int | None
    tools: ToolChoice | None = None
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped
    prompt_ids: list | None = None  # per prompt token ids, where echoed logprobs need them
    token_bytes: TokenBytes | None = None  # with logprobs: how tokens are named, and their text offsets
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs field is answered, this wide
    continuous_usage: bool = False  # streaming: usage so far in every chunk
    # Chat: a special token that ends the reply (end of turn, finish_reason stop) is not part of the message, so,
    # as at OpenAI, it has no logprobs entry either; one generated under ignore_eos that the length cut after is.
    end_token_ids: frozenset[int] = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))
    choices: dict[int, _Choice] = field(default_factory=dict)  # choice index -> its state
    completions: FanIn = field(default_factory=FanIn)  # choice index (prompt index * n + completion) -> deltas
    num_input_tokens: dict[int, int] = field(default_factory=dict)
    num_cached_tokens: dict[int, int] = field(default_factory=dict)
    raw_prompt_logprobs: dict[int, list] = field(default_factory=dict)  # prompt index -> vLLM's form

    def add(self, prompt_index: int, delta: Delta) -> tuple[int, _Choice, str, object]:
        """Records a delta; returns (choice index, its state, the new text, the new logprobs or None)."""
        index = prompt_index * self.n + delta.index
        completion = self.completions.add(delta, index)
        choice = self.choices.get(index)
        if choice is None:
            choice = self.choices[index] = _Choice(completion,
                                                   tool_parser=ToolCallParser(self.tools) if self.tools else None)
        if delta.prompt_logprobs is not None:
            self.raw_prompt_logprobs[prompt_index] = delta.prompt_logprobs
        text = "" if self.echo_only else delta.text
        entries = [] if self.echo_only or self.top_n is None else _logprob_entries(delta, self.top_n, not self.chat)
        if entries and delta.finish_reason == "stop" and delta.token_ids and delta.token_ids[-1] in self.end_token_ids:
            entries = entries[:-1]
        echoed = []  # the echoed prompt's entries, on a choice's first delta
        if self.echo and not choice.started:
            choice.echoed = self.prompts[prompt_index]
            text = choice.echoed + text
            if self.top_n is not None:
                echoed = self._prompt_entries(prompt_index)
                entries = echoed + entries
        choice.started = True
        self.count_prompt(prompt_index, delta)
        new_logprobs = None
        if self.top_n is not None:
            if choice.text_offsets is None:
                choice.text_offsets = self.token_bytes.offsets()
            # The echoed prompt spells its special tokens (it is echoed as sent); the generated text does not
            # where skip_special_tokens holds. The two are decoded apart (a prompt that ends inside a character
            # ends in U+FFFD), so the generated tokens' offsets start afresh at the end of the echoed text.
            offsets = [choice.text_offsets.next(e[0], choice.echoed) for e in echoed]
            if echoed:
                choice.text_offsets.restart(len(choice.echoed))
            offsets += [choice.text_offsets.next(e[0]) for e in entries[len(echoed):]]
            choice.logprobs.extend(entries)
            choice.offsets.extend(offsets)
            new_logprobs = self.logprobs(entries, offsets)
        return index, choice, text, new_logprobs

    def text(self, choice: _Choice) -> str:
        """A choice's whole answer: the echoed prompt, then what was generated (nothing with ``echo_only``)."""
        return choice.echoed + ("" if self.echo_only else choice.completion.joined_text)

    def _prompt_entries(self, prompt_index: int) -> list:
        """The echoed prompt's (token id, logprob, top) entries: the first token has no logprob (None)."""
        raw = self.raw_prompt_logprobs.get(prompt_index)
        ids = (self.prompt_ids or [None] * (prompt_index + 1))[prompt_index] or []
        if raw is None or len(raw) != len(ids):
            raise OpenAIError(500, "the prompt's logprobs did not come back with the answer", "internal_error")
        entries = [(ids[0], None, None)] if ids else []
        for token_id, alternatives in zip(ids[1:], raw[1:]):
            entries.append((token_id, alternatives[str(token_id)]["logprob"],
                            _top(alternatives, self.top_n, token_id)))
        return entries

    def prompt_logprobs_of(self, prompt_index: int) -> list | None:
        """vLLM's ``prompt_logprobs`` of a prompt, as wide as asked: the engine computed them wider where echoed
        ``logprobs`` asked for more (the prompt's own token stays, whatever its rank)."""
        raw = self.raw_prompt_logprobs.get(prompt_index)
        ids = (self.prompt_ids or [None] * (prompt_index + 1))[prompt_index]
        if raw is None or ids is None or len(ids) != len(raw):
            return raw
        return [None if position is None else
                {k: v for k, v in position.items() if (v.get("rank") or 0) <= self.prompt_logprobs or k == str(t)}
                for t, position in zip(ids, raw)]

    def logprobs(self, entries: list, offsets: list[int]):
        """OpenAI's logprobs object for these tokens: chat's ``{"content": [...]}`` or the completions form
        (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``: ``offsets``). Tokens are named by
        ``token_bytes`` (a token that holds part of a character by its bytes)."""
        name, raw = self.token_bytes.name, self.token_bytes.of
        if self.chat:
            return {"content": [{"token": name(token), "logprob": logprob, "bytes": list(raw(token)),
                                 "top_logprobs": [{"token": name(t), "logprob": lp, "bytes": list(raw(t))}
                                                  for t, lp in top]}
                                for token, logprob, top in entries]}
        return {"tokens": [name(e[0]) for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [None if top is None else {name(t): lp for t, lp in top} for _, _, top in entries],
                "text_offset": offsets}

    def count_prompt(self, prompt_index: int, delta: Delta) -> None:
        """Records the prompt's token counts, which every delta of it carries."""
        self.num_input_tokens[prompt_index] = delta.num_input_tokens
        self.num_cached_tokens[prompt_index] = delta.num_cached_tokens

    def usage(self) -> dict:
        prompt = sum(self.num_input_tokens.values())
        completion = 0 if self.echo_only else sum(c.num_output_tokens for c in self.completions.in_order())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.num_cached_tokens.values())}}

    def header(self, chunk: bool) -> dict:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


def _logprob_entries(delta: Delta, top_n: int, with_sampled: bool) -> list[tuple[int, float, list]]:
    """(token id, logprob, top alternatives) per new token, from the model's vLLM-form ``logprobs`` output;
    ``with_sampled``: the completions API's top alternatives hold the sampled token too (see :func:`_top`)."""
    entries = []
    for token_id, alternatives in zip(delta.token_ids, delta.logprobs or []):
        sampled = alternatives.get(str(token_id)) or {}
        entries.append((token_id, sampled.get("logprob"),
                        _top(alternatives, top_n, token_id if with_sampled else None)))
    return entries


def _top(alternatives: dict[str, dict], top_n: int, sampled: int | None = None) -> list[tuple[int, float]]:
    """The ``top_n`` most likely tokens as (token id, logprob), best first, then ``sampled`` where it is not
    among them: the completions API's ``top_logprobs`` always holds the chosen token (up to ``logprobs`` + 1
    entries, as OpenAI's legacy API and vLLM answer); chat's hold exactly ``top_logprobs``."""
    ranked = sorted(alternatives.items(), key=lambda kv: kv[1].get("rank") or 0)
    top = [(int(i), a["logprob"]) for i, a in ranked[:top_n]]
    if sampled is not None and str(sampled) in alternatives and all(i != sampled for i, _ in top):
        top.append((sampled, alternatives[str(sampled)]["logprob"]))
    return top


async def _respond(view: _View, events: AsyncIterator[tuple[int, Delta]], stream: bool | None,
                   include_usage: bool, request: Request):
    async def first_delta():
        try:
            return await events.__anext__()
        except StopAsyncIteration:
            return None

    # A request may wait long for its first token (queued behind others, a long prefill, a grammar compile): a
    # client that leaves meanwhile cancels it there, so that no dead request keeps a place in the queue.
    try:
        first = await _unless_disconnected(request, first_delta())
    except OpenAIError:
        await events.aclose()
        raise
    if isinstance(first, Response):  # the client left first
        await events.aclose()
        return first
    if stream:
        return _SSEResponse(_sse(view, first, events, include_usage), media_type="text/event-stream",
                            headers={"Cache-Control": "no-cache"})
    return await _unless_disconnected(request, _collect(view, first, events))


async def _collect(view: _View, first, events) -> dict:
    try:
        if first is not None:
            view.add(*first)
        async for item in events:
            view.add(*item)
    finally:
        await events.aclose()
    choices = []
    for index in sorted(view.choices):
        choice = view.choices[index]
        text = view.text(choice)
        logprobs = view.logprobs(choice.logprobs, choice.offsets) if view.top_n is not None else None  # echoed: from the prompt
        if view.chat and choice.tool_parser is not None:
            parser = choice.tool_parser
            parser.feed(text)
            parser.finish()
            message = {"role": "assistant", "content": parser.content or None}
            if parser.calls:
                message["tool_calls"] = [call.as_message() for call in parser.calls]
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": _finish_reason(choice)})
        elif view.chat:
            choices.append({"index": index, "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs, "finish_reason": choice.finish_reason})
        else:
            choices.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason})
            if view.prompt_logprobs is not None:  # vLLM's field: per choice, its prompt's
                choices[-1]["prompt_logprobs"] = view.prompt_logprobs_of(index // view.n)
    answer = {**view.header(chunk=False), "choices": choices, "usage": view.usage()}
    if view.chat and view.prompt_logprobs is not None:  # vLLM's field: once, for the one prompt
        answer["prompt_logprobs"] = view.prompt_logprobs_of(0)
    return answer


async def _sse(view: _View, first, events, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per delta, ``data: [DONE]`` last; an error after the first delta is
    sent as an error event (the status line has gone out already)."""
    usage = {"usage": None} if include_usage else {}
    try:
        if view.chat:  # every choice's role first, in index order (as OpenAI and vLLM; the SDK's stream needs it)
            if view.continuous_usage and first is not None:  # the prompt's tokens (the first delta's), none generated
                view.count_prompt(*first)
                usage = {"usage": view.usage()}
            for index in range(len(view.prompts) * view.n):
                entry = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None}
                yield _event({**view.header(chunk=True), "choices": [entry], **usage})
        item = first
        while item is not None:
            index, choice, text, logprobs = view.add(*item)
            if view.continuous_usage:
                usage = {"usage": view.usage()}
            if view.chat:
                for entry in _chat_chunks(index, choice, text, logprobs):
                    yield _event({**view.header(chunk=True), "choices": [entry], **usage})
            else:
                entry = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}
                yield _event({**view.header(chunk=True), "choices": [entry], **usage})
            item = await anext(events, None)
        if include_usage:
            yield _event({**view.header(chunk=True), "choices": [], "usage": view.usage()})
    except OpenAIError as exc:
        yield _event(exc.body())
    except Exception:  # noqa: BLE001 - the status line has gone out: the error becomes an event, as above
        log.exception("streaming %s failed", view.id)
        yield _event(internal_error().body())
    finally:
        await events.aclose()
    yield "data: [DONE]\n\n"


def _chat_chunks(index: int, choice: _Choice, text: str, logprobs) -> list[dict]:
    """The chat chunks' choice entries for one delta (the role went out before, `_sse`): its text with its
    logprobs and finish reason; or, with tools, the content and tool-call deltas the parser releases (none while
    it holds back a possible ``<tool_call>``), the logprobs of all the text since the last release with the
    first of them, and the finish reason in an empty delta of its own, as OpenAI ends a tool call."""
    parser = choice.tool_parser
    if parser is None:
        return [{"index": index, "delta": {"content": text}, "logprobs": logprobs,
                 "finish_reason": choice.finish_reason}]
    if logprobs is not None:
        choice.held_logprobs.extend(logprobs["content"])
    deltas = parser.feed(text) + (parser.finish() if choice.finish_reason else [])
    entries = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
    if choice.finish_reason:
        entries.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": _finish_reason(choice)})
    if entries and logprobs is not None:
        entries[0]["logprobs"] = {"content": choice.held_logprobs}
        choice.held_logprobs = []
    return entries


def _finish_reason(choice: _Choice) -> str | None:
    """The model's reason, or the tool parser's where the reply ended normally (``tool_calls`` for calls made
    under ``auto`` or ``required``)."""
    if choice.finish_reason == "stop" and choice.tool_parser is not None:
        return choice.tool_parser.finish_reason or "stop"
    return choice.finish_reason


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class _SSEResponse(StreamingResponse):
    """A streaming response that stops as soon as the client disconnects, whatever the ASGI spec version,
    and closes its iterator then (which cancels the Triton requests)."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def _unless_disconnected(request: Request, work):
    """Runs ``work`` and returns its result; a client that disconnects first cancels it (and with it the Triton
    requests), and a 499 response comes back instead."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            # Wait for the cancelled work to unwind (an iterator it was reading is closed by then).
            await asyncio.wait([task])
    if task.cancelled():
        return JSONResponse({}, status_code=499)
    return task.result()
