"""The parts that keep a heavy request from holding up others, one at a time and without Triton: the GIL-free
tokenizing gives the tokenizer's own ids, the sliced JSON answer is Starlette's text, and the sliced HTTP
protocol reads a body of one-byte chunks whole while another connection is answered in between."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from starlette.responses import JSONResponse
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from backend.prompt_limits import encode_prompt
from openai_frontend.http_protocol import SLICE_BYTES, SlicedHttpToolsProtocol
from openai_frontend.limits import JSON_SLICE, json_response
from triton_server import serve_app


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.mark.parametrize("text", ["Hello world", "<|im_start|>user\nHi<|im_end|>\n", " leading space",
                                  "0123456789" * 50, "émoji 🎉 and a zero\u200bwidth space"])
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_prompt_gives_the_tokenizers_own_ids(tokenizer, text, add_special_tokens):
    assert encode_prompt(tokenizer, text, add_special_tokens) == tokenizer.encode(text, add_special_tokens=add_special_tokens)


def test_encode_prompt_of_330k_digits_holds_the_gil_briefly(tokenizer):
    """A thread that wakes every millisecond is never kept waiting long while 330,000 ids are computed."""
    digits = "0123456789" * 33_000
    gaps, done = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not done.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        ids = encode_prompt(tokenizer, digits)
    finally:
        done.set()
        thread.join()
    print(f"longest wait of the other thread: {max(gaps) * 1000:.1f} ms")
    assert len(ids) == 330_000 and ids[:10] == tokenizer.encode("0123456789")
    assert max(gaps) < 0.1


@pytest.mark.parametrize("payload", [
    [{"token_ids": list(range(3 * JSON_SLICE + 5))}, {"token_ids": [1]}],
    {"count": 2, "max_model_len": 4096, "tokens": [7, 8], "token_strs": ["é\"\\", "\u2028"] * JSON_SLICE},
    {"token_ids": []}, [], {"nested": [[1, 2], [], [{"a": None, "b": 1.5, "c": True}]]},
])
def test_json_response_is_starlettes_text(payload):
    response = asyncio.run(json_response(payload))
    assert response.media_type == "application/json"
    assert response.body == JSONResponse(payload).body


class _Fed(HttpToolsProtocol):
    """Records the size of each piece uvicorn's protocol is given to parse."""

    sizes: list[int] = []

    def data_received(self, data: bytes) -> None:
        _Fed.sizes.append(len(data))
        super().data_received(data)


class _RecordingSliced(SlicedHttpToolsProtocol, _Fed):  # SlicedHttpToolsProtocol's slices go through _Fed
    pass


def test_sliced_protocol_reads_a_million_one_byte_chunks_and_answers_others_meanwhile():
    """The parser gets at most SLICE_BYTES per call (uvicorn's own protocol gets whole reads of up to 256 KiB,
    43,690 one-byte chunks, each a Python callback), and other connections are answered in between."""
    received = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        received[scope["path"]] = body
        answer = str(len(body)).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(answer)).encode())]})
        await send({"type": "http.response.body", "body": answer})

    body = bytes(range(256)) * (1_000_000 // 256) + b"x" * (1_000_000 % 256)
    wire = b"".join(b"1\r\n" + body[i:i + 1] + b"\r\n" for i in range(len(body))) + b"0\r\n\r\n"
    assert len(wire) > 100 * SLICE_BYTES
    small_latencies = []
    with serve_app(app, http=_RecordingSliced, lifespan="off") as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as flood:
            flood.sendall(b"POST /flood HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            sender = threading.Thread(target=flood.sendall, args=(wire,))
            sender.start()
            while sender.is_alive():
                start = time.perf_counter()
                with socket.create_connection(("127.0.0.1", port)) as small:
                    small.sendall(b"GET /small HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                    answer = b""
                    while chunk := small.recv(4096):
                        answer += chunk
                assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b"\r\n\r\n0")
                small_latencies.append(time.perf_counter() - start)
            sender.join()
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.endswith(b"1000000"):
                chunk = flood.recv(4096)
                assert chunk, answer
                answer += chunk
    print(f"{len(small_latencies)} small requests meanwhile, slowest {max(small_latencies, default=0) * 1000:.0f} ms")
    print(f"largest piece parsed at once: {max(_Fed.sizes)} bytes of {len(_Fed.sizes)}")
    assert received["/flood"] == body
    assert max(_Fed.sizes) <= SLICE_BYTES and len(_Fed.sizes) >= len(wire) // SLICE_BYTES
    assert small_latencies and max(small_latencies) < 1.0
