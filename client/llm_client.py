"""Stream completions from the Triton `llm` model over gRPC (decoupled streaming) or HTTP (generate_stream)."""

from __future__ import annotations

import json
import queue
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

# Sampling and scheduling options and the Triton datatype of each optional input.
SAMPLING_INPUTS = {
    "max_tokens": ("INT32", np.int32), "min_tokens": ("INT32", np.int32), "temperature": ("FP32", np.float32),
    "top_p": ("FP32", np.float32), "top_k": ("INT32", np.int32), "min_p": ("FP32", np.float32),
    "repetition_penalty": ("FP32", np.float32), "presence_penalty": ("FP32", np.float32),
    "frequency_penalty": ("FP32", np.float32), "seed": ("INT64", np.int64), "ignore_eos": ("BOOL", np.bool_),
    "n": ("INT32", np.int32), "priority": ("INT32", np.int32), "timeout_ms": ("INT32", np.int32),
}

# What each kind of input takes: numpy would parse a string ("5") and truncate a float given for an integer.
_KINDS = {"BOOL": ("a boolean", (bool, np.bool_)), "FP32": ("a number", (int, float, np.integer, np.floating)),
          "INT": ("an integer", (int, np.integer))}


def _check_sampling(sampling: dict) -> None:
    """Raises ValueError for an unknown option, a value not of its input's kind (``_KINDS``), or an integer
    option outside its input's type (INT32, INT64): numpy and Triton's JSON conversion would wrap it silently
    (2**32 + 5 becomes 5)."""
    unknown = set(sampling) - set(SAMPLING_INPUTS)
    if unknown:
        raise ValueError(f"unknown sampling option(s) {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(SAMPLING_INPUTS)}")
    for name, value in sampling.items():
        datatype, dtype = SAMPLING_INPUTS[name]
        if value is None:
            continue
        kind, types = _KINDS.get(datatype, _KINDS["INT"])
        if not isinstance(value, types) or (datatype != "BOOL" and isinstance(value, (bool, np.bool_))):
            raise ValueError(f"{name} must be {kind} ({datatype}), got {value!r}")
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            if not info.min <= value <= info.max:
                raise ValueError(f"{name} {value} is outside {SAMPLING_INPUTS[name][0]} ({info.min} to {info.max})")


class LLMError(RuntimeError):
    """The server rejected or failed a request (the message is the server's)."""


@dataclass
class Delta:
    """One streamed response: the new text and token ids; ``finish_reason`` set on a completion's last one.
    ``index`` tells the completions of an ``n`` > 1 request apart."""

    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    index: int = 0


class LLMClient:
    """A client for one server.

    Args:
        grpc_url: ``host:port`` of Triton's gRPC endpoint.
        http_url: ``http://host:port`` of Triton's HTTP endpoint (``host:port`` means ``http://host:port``).
        model / version: the model name and version ("" = the server's choice, by version_policy).
    """

    def __init__(self, grpc_url: str = "localhost:8001", http_url: str = "http://localhost:8000",
                 model: str = "llm", version: str = "") -> None:
        # "host:port" as --grpc-url takes it: the scheme is implied.
        http_url = http_url if "://" in http_url else f"http://{http_url}"
        self.grpc_url, self.http_url = grpc_url, http_url.rstrip("/")
        self.model, self.version = model, version
        self._grpc: grpcclient.InferenceServerClient | None = None

    # -- gRPC ----------------------------------------------------------------------------------------
    def stream_grpc(self, prompt: str, stop: list[str] | None = None, **sampling) -> Iterator[Delta]:
        """Streams deltas over gRPC; closing the iterator early (or Ctrl-C) cancels the request on the server.

        Raises:
            LLMError: the server answered with an error.
        """
        client = grpcclient.InferenceServerClient(self.grpc_url)
        responses: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: responses.put((result, error)))
        finished = False
        try:
            try:
                client.async_stream_infer(self.model, self.grpc_inputs(prompt, stop, True, **sampling),
                                          model_version=self.version, request_id=uuid.uuid4().hex,
                                          enable_empty_final_response=True)
            except InferenceServerException as exc:  # the stream broke first (no server): its callback says why
                try:
                    _, error = responses.get(timeout=5)
                except queue.Empty:
                    error = None
                raise LLMError(str(error or exc)) from None
            while not finished:
                result, error = responses.get()
                if error is not None:
                    raise LLMError(str(error))
                response = result.get_response()
                finished = response.parameters["triton_final_response"].bool_param
                if result.as_numpy("text_output") is None:  # the empty final response
                    continue
                yield _delta(result.as_numpy)
        finally:
            client.stop_stream(cancel_requests=not finished)
            client.close()

    @staticmethod
    def grpc_inputs(prompt: str, stop: list[str] | None = None, stream: bool = True, **sampling) -> list:
        """The request's gRPC inputs (``InferInput``s, usable with ``tritonclient.grpc`` and its ``aio``).

        Raises:
            ValueError: an unknown sampling option, one of the wrong kind, or an integer one outside its input's type.
        """
        def tensor(name, array, datatype):
            t = grpcclient.InferInput(name, list(array.shape), datatype)
            t.set_data_from_numpy(array)
            return t

        _check_sampling(sampling)
        inputs = [tensor("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
                  tensor("stream", np.array([stream]), "BOOL")]
        for name, value in sampling.items():
            if value is None:
                continue
            datatype, dtype = SAMPLING_INPUTS[name]
            inputs.append(tensor(name, np.array([value], dtype=dtype), datatype))
        if stop:
            inputs.append(tensor("stop", np.array([s.encode() for s in stop], dtype=np.object_), "BYTES"))
        return inputs

    # -- HTTP ----------------------------------------------------------------------------------------
    def stream_http(self, prompt: str, stop: list[str] | None = None, **sampling) -> Iterator[Delta]:
        """Streams deltas over HTTP ``generate_stream`` (server-sent events); closing the iterator early
        drops the connection, which cancels the request on the server.

        Raises:
            LLMError: the server answered with an error, or could not be reached (HTTP).
        """
        body = self._http_body(prompt, stop, True, sampling)
        with self._post("generate_stream", body, stream=True) as response:
            if response.status_code != 200:
                raise LLMError(_http_error(response))
            for line in response.iter_lines():
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    raise LLMError(event["error"])
                yield _delta(lambda name: _json_output(event, name))

    def generate(self, prompt: str, stop: list[str] | None = None, exclude_input_in_output: bool = True,
                 **sampling) -> Delta:
        """One non-streaming completion over HTTP ``generate``.

        Raises:
            ValueError: ``n`` > 1 (:meth:`generate_all` returns every completion).
            LLMError: the server answered with an error, or could not be reached (HTTP).
        """
        if (sampling.get("n") or 1) > 1:
            raise ValueError("generate returns one completion; generate_all returns the n of an n > 1 request")
        return self.generate_all(prompt, stop, exclude_input_in_output, **sampling)[0]

    def generate_all(self, prompt: str, stop: list[str] | None = None, exclude_input_in_output: bool = True,
                     **sampling) -> list[Delta]:
        """Every completion of one non-streaming request over HTTP ``generate`` (``n`` of them), in ``index`` order.

        Raises:
            LLMError: the server answered with an error, or could not be reached (HTTP).
        """
        body = self._http_body(prompt, stop, False, sampling)
        body["exclude_input_in_output"] = exclude_input_in_output
        response = self._post("generate", body)
        if response.status_code != 200:
            raise LLMError(_http_error(response))
        return _completions(response.json())

    def _post(self, endpoint: str, body: dict, stream: bool = False) -> requests.Response:
        try:
            return requests.post(self._url(endpoint), json=body, stream=stream, timeout=(5, 600))
        except requests.ConnectionError as exc:
            raise LLMError(f"cannot connect to {self.http_url} ({type(exc).__name__})") from exc

    def _url(self, endpoint: str) -> str:
        version = f"/versions/{self.version}" if self.version else ""
        return f"{self.http_url}/v2/models/{self.model}{version}/{endpoint}"

    @staticmethod
    def _http_body(prompt: str, stop: list[str] | None, stream: bool, sampling: dict) -> dict:
        _check_sampling(sampling)
        body = {"text_input": prompt, "stream": stream, **{k: v for k, v in sampling.items() if v is not None}}
        if stop:
            body["stop"] = list(stop)
        return body


def _delta(output) -> Delta:
    text = output("text_output")
    ids = output("output_ids")
    reason = output("finish_reason")
    reason = reason.reshape(-1)[0] if reason is not None and reason.size else b""
    reason = reason.decode() if isinstance(reason, bytes) else str(reason)
    return Delta(text=_as_text(text.reshape(-1)[0]) if text is not None and text.size else "",
                 token_ids=[int(t) for t in np.asarray(ids).reshape(-1)] if ids is not None else [],
                 finish_reason=reason or None,
                 num_input_tokens=_first_int(output("num_input_tokens")),
                 num_output_tokens=_first_int(output("num_output_tokens")),
                 num_cached_tokens=_first_int(output("num_cached_tokens")),
                 index=_first_int(output("index")))


def _completions(event: dict) -> list[Delta]:
    """A non-streaming answer's completions: one ``text_output``, ``finish_reason`` and ``num_output_tokens`` per
    completion, and ``output_ids`` holding their token ids one after another (docs/triton-api.md, Outputs)."""
    texts = np.asarray(event.get("text_output", []), dtype=np.object_).reshape(-1)
    reasons = np.asarray(event.get("finish_reason", [""] * len(texts)), dtype=np.object_).reshape(-1)
    lengths = np.asarray(event.get("num_output_tokens", [0] * len(texts)), dtype=np.int64).reshape(-1)
    indices = np.asarray(event.get("index", range(len(texts))), dtype=np.int64).reshape(-1)
    ids = [int(t) for t in np.asarray(event.get("output_ids", []), dtype=np.int64).reshape(-1)]
    ends = np.cumsum(lengths).tolist()
    deltas = []
    for i, text in enumerate(texts):
        start = ends[i - 1] if i else 0
        deltas.append(Delta(text=_as_text(text), token_ids=ids[start:ends[i]], finish_reason=str(reasons[i]) or None,
                            num_input_tokens=_first_int(event.get("num_input_tokens")),
                            num_output_tokens=int(lengths[i]),
                            num_cached_tokens=_first_int(event.get("num_cached_tokens")), index=int(indices[i])))
    return sorted(deltas, key=lambda d: d.index)


def _first_int(value) -> int:
    return 0 if value is None else int(np.asarray(value).reshape(-1)[0])


def _as_text(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _json_output(event: dict, name: str):
    if name not in event:
        return None
    return np.asarray(event[name], dtype=np.object_ if name in (
        "text_output", "finish_reason") else np.int64)


def _http_error(response: requests.Response) -> str:
    """The error message of a failed ``generate`` (a JSON body) or ``generate_stream`` (Triton sends the error
    as one server-sent event, ``data: {"error": ...}``)."""
    text = response.text.strip()
    if text.startswith("data:"):
        text = text[5:].strip()
    try:
        return json.loads(text).get("error", response.text)
    except (ValueError, AttributeError):
        return f"HTTP {response.status_code}: {response.text}"
