"""One generation over Triton's gRPC streaming API (tritonclient's asyncio client), as a stream of deltas.

Each call opens its own bidirectional stream, sends one request with ``stream`` true and reads the
decoupled model's responses until the one flagged final. Leaving the iterator early (a client that
disconnected) sends an abort request on the same stream (``serve.abort_keys``: the generation request carries a
random ``abort_key``): the model aborts the request in the engine, its KV blocks are freed, and its final
response (finish_reason ``abort``) ends it.

After the final response (or an error, which the model and Triton always send as final) the stream is closed
from this side and left to end normally. It is cancelled only where that takes over ``CLOSE_TIMEOUT_S``:
tritonserver 2.51 can lose track of a stream cancelled around the moment its request completes, and the leaked
stream state keeps the model loaded, so an unload (and with it a SIGTERM) then waits until Triton's exit
timeout. For the same reason the responses are read on a task of their own (``_Stream``): grpc.aio cancels a
call whose read is cancelled, as the read of a client that left would be. The close is awaited on a task of its
own, so the client's response is not held up by it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import tritonclient.grpc.aio as grpcclient
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE
from tritonclient.utils import InferenceServerException

from openai_frontend.errors import OpenAIError, error_from_triton
from serve.abort_keys import ABORT, ABORT_KEY
from serve.request_parsing import MAX_SAMPLING_PARAMETERS_BYTES

CLOSE_TIMEOUT_S = 10.0  # a stream not ended this long after its final response (or its abort) is cancelled
# tritonclient's own channel options, and a reconnect backoff of at most 2 s: gRPC's default grows to 120 s, so
# that once Triton came back (a restart, a slow first load) /health stayed 503 for up to two minutes after.
_KEEPALIVE = grpcclient.KeepAliveOptions()
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.keepalive_time_ms", _KEEPALIVE.keepalive_time_ms),
    ("grpc.keepalive_timeout_ms", _KEEPALIVE.keepalive_timeout_ms),
    ("grpc.keepalive_permit_without_calls", _KEEPALIVE.keepalive_permit_without_calls),
    ("grpc.http2.max_pings_without_data", _KEEPALIVE.http2_max_pings_without_data),
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


@dataclass
class Delta:
    """One response of the ``llm`` model: new text and tokens of completion ``index``.

    ``logprobs`` is vLLM's form (one dict per new token: token id -> ``{logprob, rank, decoded_token}``),
    present when the request asked for logprobs; ``num_output_tokens`` is the completion's total so far."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    logprobs: list[dict[str, dict]] | None = None
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's form, on completion 0's first delta


@dataclass
class TritonLLM:
    """A connection to Triton's gRPC endpoint (``host:port``); the models offered are those of
    ``model_repository`` (its directories) that Triton serves."""

    url: str
    model_repository: Path | None = None
    _client: grpcclient.InferenceServerClient | None = field(default=None, init=False)
    _closing: set[asyncio.Task] = field(default_factory=set, init=False)  # finished streams ending

    @property
    def client(self) -> grpcclient.InferenceServerClient:
        if self._client is None:
            self._client = grpcclient.InferenceServerClient(self.url, channel_args=CHANNEL_ARGS)
        return self._client

    def offered(self) -> list[str]:
        """The model names this frontend serves: the directories of ``model_repository``, ready or not."""
        if self.model_repository is None or not self.model_repository.is_dir():
            return []
        return sorted(p.name for p in self.model_repository.iterdir() if p.is_dir())

    async def close(self) -> None:
        if self._closing:
            await asyncio.wait(self._closing, timeout=CLOSE_TIMEOUT_S)
        if self._client is not None:
            await self._client.close()

    async def ready(self) -> bool:
        """Whether a model this frontend serves has a READY version. Triton's own server readiness is not
        enough: it reads true again once a model is unloaded (a drain, an unload by hand), as it counts only
        the models loaded. Without a model repository to name them, the server's readiness."""
        try:
            names = self.offered()
            if not names:
                return await self.client.is_server_ready()
            return any(await asyncio.gather(*(self.client.is_model_ready(name) for name in names)))
        except InferenceServerException:
            return False

    async def models(self) -> list[tuple[str, str]]:
        """(name, version) of every READY version of the models in ``model_repository``.

        Asked through model metadata (one call per model, its ``versions`` are the READY ones), not the
        repository index: the launcher keeps the repository API behind Triton's admin key
        (``serve.control``), which this public-facing process does not hold.

        Raises:
            OpenAIError: 503 when Triton cannot be reached.
        """
        names = self.offered()

        async def versions(name: str) -> list[tuple[str, str]]:
            try:
                metadata = await self.client.get_model_metadata(name, as_json=True)
            except InferenceServerException:  # unknown to Triton, or no version READY
                return []
            return [(name, str(v)) for v in metadata.get("versions", [])] or [(name, "")]

        found = [pair for pairs in await asyncio.gather(*(versions(n) for n in names)) for pair in pairs]
        if not found:
            try:
                await self.client.is_server_live()
            except InferenceServerException as exc:
                raise OpenAIError(503, f"Triton is unreachable: {exc.message()}", "service_unavailable") from None
        return found

    async def generate(self, model: str, version: str, prompt: str | list[int], sampling: dict,
                       request_id: str | None = None) -> AsyncIterator[Delta]:
        """Streams the deltas of one request (every completion of an ``n`` > 1 request, told apart by index).

        Args:
            prompt: text (the ``text_input`` input) or token ids (``input_ids``).
            request_id: Triton's request id (a random one when None).
            sampling: the model's ``sampling_parameters`` (vLLM's names: ``max_tokens``, ``stop``, ...).

        Raises:
            OpenAIError: the model or Triton rejected or failed the request (status from the message).
        """
        request_id = request_id or uuid.uuid4().hex
        key = secrets.token_hex(16)
        stream = _Stream(self.client, {
            "model_name": model, "model_version": version, "request_id": request_id,
            "inputs": [_prompt_input(prompt), _bool_input("stream", True),
                       _bytes_input("sampling_parameters", _sampling_json(sampling))],
            "parameters": {ABORT_KEY: key}})
        finished = False
        try:
            while (item := await stream.incoming.get()) is not None:
                if isinstance(item, Exception):
                    finished = True
                    if isinstance(item, grpc.RpcError):  # the stream itself failed: Triton gone or shutting down
                        raise OpenAIError(503, f"Triton stream failed: {_details(item)}", "service_unavailable")
                    raise item
                result, error = item
                if error is not None:
                    finished = True
                    raise error_from_triton(error.message())
                finished = result.get_response().parameters["triton_final_response"].bool_param
                if result.as_numpy("text_output") is not None:
                    yield from_result(result)
                if finished:
                    return
            finished = True
            raise OpenAIError(503, "Triton ended the stream before the request's final response",
                              "service_unavailable")
        finally:
            aborted = None
            if not finished:  # left early (the client went away): the model aborts it
                stream.send({"model_name": model, "model_version": version, "request_id": f"{request_id}-abort",
                             "inputs": [], "parameters": {ABORT: key}})
                aborted = request_id
            task = asyncio.get_running_loop().create_task(stream.end(aborted))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)


class _Stream:
    """One request's bidirectional gRPC stream, read on a task of its own into ``incoming`` ((result, error)
    pairs, the exception if reading failed, e.g. a ``grpc.RpcError``, then None once it ended). The reader is
    apart from the consumer so that a consumer cancelled mid-read (a client that left) does not cancel the call:
    grpc.aio cancels a call whose read is cancelled, and that cancellation is what tritonserver 2.51 can lose
    track of."""

    def __init__(self, client: grpcclient.InferenceServerClient, request: dict) -> None:
        self.outgoing: asyncio.Queue[dict | None] = asyncio.Queue()  # None half-closes our side
        self.outgoing.put_nowait(request)
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.call = client.stream_infer(self._requests())
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self):
        while (item := await self.outgoing.get()) is not None:
            yield item

    async def _read(self) -> None:
        try:
            async for item in self.call:
                self.incoming.put_nowait(item)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self.incoming.put_nowait(exc)
        finally:
            self.incoming.put_nowait(None)

    def send(self, request: dict) -> None:
        self.outgoing.put_nowait(request)

    async def end(self, aborted: str | None = None) -> None:
        """Half-closes the stream and waits until Triton ends it, first (``aborted``: the id of a request an
        abort request was sent for) for that request's final response or an error; cancels the call if that
        takes over ``CLOSE_TIMEOUT_S`` or this task is cancelled."""
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                while aborted is not None and (item := await self.incoming.get()) is not None:
                    if isinstance(item, Exception) or item[1] is not None:
                        break
                    response = item[0].get_response()
                    if response.id == aborted and response.parameters["triton_final_response"].bool_param:
                        break
                self.outgoing.put_nowait(None)
                await self.reader
        except asyncio.CancelledError:
            self._cancel()
            raise
        except TimeoutError:
            self._cancel()

    def _cancel(self) -> None:
        self.outgoing.put_nowait(None)
        self.call.cancel()
        self.reader.cancel()


def _details(exc: grpc.RpcError) -> str:
    return exc.details() if hasattr(exc, "details") else str(exc)


def from_result(result) -> Delta:
    """The model's output tensors -> a Delta (the first completion's entry of each)."""
    def first(name, default=0):
        value = result.as_numpy(name)
        return default if value is None or value.size == 0 else value.reshape(-1)[0]

    text = first("text_output", b"")
    reason = first("finish_reason", b"")
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    ids = result.as_numpy("output_ids")
    logprobs = first("logprobs", None)
    prompt_logprobs = first("prompt_logprobs", None)
    return Delta(index=int(first("index")), text=text.decode("utf-8") if isinstance(text, bytes) else str(text),
                 token_ids=[] if ids is None else [int(t) for t in ids.reshape(-1)], finish_reason=reason or None,
                 num_input_tokens=int(first("num_input_tokens")), num_output_tokens=int(first("num_output_tokens")),
                 num_cached_tokens=int(first("num_cached_tokens")),
                 logprobs=None if logprobs is None else json.loads(logprobs),
                 prompt_logprobs=None if prompt_logprobs is None else json.loads(prompt_logprobs))


def _sampling_json(sampling: dict) -> str:
    """``sampling`` as the model's ``sampling_parameters`` JSON.

    Raises:
        OpenAIError: 400 naming the largest field, when the JSON is over what the model reads
            (``serve.request_parsing.MAX_SAMPLING_PARAMETERS_BYTES``).
    """
    text = json.dumps(sampling)  # ASCII: a lone surrogate in a string stays an escape, never an encoding error
    if len(text) <= MAX_SAMPLING_PARAMETERS_BYTES:
        return text
    largest = max(sampling, key=lambda key: len(json.dumps(sampling[key])))
    name = {"structured_outputs": "response_format or tools (as a structured output)"}.get(largest, largest)
    raise OpenAIError(400, f"the request's sampling parameters are {len(text)} bytes of JSON, over the "
                           f"{MAX_SAMPLING_PARAMETERS_BYTES} the model reads; the largest is {name}, "
                           f"{len(json.dumps(sampling[largest]))} bytes", "invalid_value", largest)


def _bytes_input(name: str, value: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BYTES")
    tensor.set_data_from_numpy(np.array([value.encode("utf-8")], dtype=np.object_))
    return tensor


def _prompt_input(prompt: str | list[int]) -> grpcclient.InferInput:
    if isinstance(prompt, str):
        return _bytes_input("text_input", prompt)
    tensor = grpcclient.InferInput("input_ids", [len(prompt)], "INT64")
    tensor.set_data_from_numpy(np.array(prompt, dtype=np.int64))
    return tensor


def _bool_input(name: str, value: bool) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value]))
    return tensor
