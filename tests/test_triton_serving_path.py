"""The serving path at engine speeds: the zero-cost model (``model_runner: zero_cost``) through a real tritonserver.

The engine then produces tokens far faster than one response per token can be sent, so the model's sender
merges each stream's queued deltas into one response. Every stream must still get exactly its tokens, in
order, with one final response; cancelling many streams at once must still free their blocks.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
import numpy as np
import pytest
import tritonclient.grpc.aio as grpcaio

from backend.zero_cost_runner import zero_cost_token
from triton_server import settled, single_version_repository, start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]  # a server (launcher) of its own: minutes
SETTINGS = {"model_runner": "zero_cost", "max_num_seqs": 64, "num_blocks": 20000, "max_model_len": 4096}
NUM_STREAMS = 48


@pytest.fixture(scope="module")
def server(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("serving-path")
    repository = single_version_repository(root / "models", SETTINGS)
    server = start_server(root / "tritonserver.log", model_repository=repository)
    yield server
    stop_server(server)


def _input(name: str, value, datatype: str) -> grpcaio.InferInput:
    tensor = grpcaio.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else None))
    return tensor


async def _streams(url: str, requests: list[dict], cancel_after: int | None = None) -> list[list[tuple]]:
    """Runs every request as its own gRPC stream at once; per request, its responses as (is_final, output ids,
    text, finish_reason, num_output_tokens). With ``cancel_after``, each stream is cancelled after that many."""
    client = grpcaio.InferenceServerClient(url)

    async def one(sampling: dict) -> list[tuple]:
        done = asyncio.Event()
        inputs = [_input("text_input", b"Tell me about rivers.", "BYTES"), _input("stream", True, "BOOL"),
                  _input("sampling_parameters", json.dumps(sampling).encode(), "BYTES")]

        async def request_iterator():
            yield {"model_name": "llm", "inputs": inputs, "request_id": uuid.uuid4().hex}
            await done.wait()

        got = []
        responses = client.stream_infer(request_iterator())
        try:
            async for result, error in responses:
                assert error is None, error
                final = result.get_response().parameters["triton_final_response"].bool_param
                got.append((final, result.as_numpy("output_ids").tolist(),
                            result.as_numpy("text_output")[0].decode(), result.as_numpy("finish_reason")[0].decode(),
                            int(result.as_numpy("num_output_tokens")[0]), int(result.as_numpy("num_input_tokens")[0])))
                if final or len(got) == cancel_after:
                    break
        finally:
            done.set()
            if cancel_after is not None:
                responses.cancel()
        return got

    try:
        return await asyncio.gather(*(one(r) for r in requests))
    finally:
        await client.close()


def test_every_stream_gets_exactly_its_tokens_in_order_with_one_final(server, tokenizer):
    requests = [{"max_tokens": 300 + 7 * i, "ignore_eos": True} for i in range(NUM_STREAMS)]
    results = asyncio.run(_streams(server.grpc_url, requests))
    vocab = len(tokenizer)
    merged = 0
    for request, got in zip(requests, results):
        finals = [i for i, r in enumerate(got) if r[0]]
        assert finals == [len(got) - 1], f"final flags at {finals} of {len(got)} responses"
        ids = [t for r in got for t in r[1]]
        prompt_len = got[-1][5]
        assert ids == [zero_cost_token(prompt_len + k, vocab) for k in range(request["max_tokens"])]
        assert "".join(r[2] for r in got) == tokenizer.decode(ids)
        assert [r[3] for r in got] == [""] * (len(got) - 1) + ["length"]
        assert got[-1][4] == request["max_tokens"]
        assert [r[4] for r in got] == list(np.cumsum([len(r[1]) for r in got]))  # counts match what was sent
        merged += sum(len(r[1]) > 1 for r in got)
    assert merged > 0, "no response carried more than one token: the engine never ran ahead of the sender"


def test_cancelling_many_streams_at_once_frees_every_block(server):
    def metric(name, **labels):
        return server.metric(name, model="llm", **labels)

    def ended(reason: str) -> float:
        return metric("llm_request_finished_total", finish_reason=reason)

    before = settled(lambda: {reason: ended(reason) for reason in ("abort", "length")})
    requests = [{"max_tokens": 4000, "ignore_eos": True} for _ in range(NUM_STREAMS)]  # max_model_len 4096 here
    results = asyncio.run(_streams(server.grpc_url, requests, cancel_after=1))
    assert all(len(got) == 1 for got in results)
    # The zero-cost engine makes thousands of tokens a second: a stream's request may finish (length) in the
    # moment between the client's cancel and the next cancellation sweep. Every other one must be aborted,
    # and nothing may hold a block or a running slot afterwards.
    deadline = time.monotonic() + 10
    while True:
        counts = {reason: ended(reason) - before[reason] for reason in before}
        used, running = metric("llm_kv_cache_blocks_used"), metric("llm_num_requests_running")
        if not used and not running and sum(counts.values()) == NUM_STREAMS:
            break
        assert time.monotonic() < deadline, ("cancelled streams still hold blocks or never ended", used, running,
                                             counts)
        time.sleep(0.1)
    assert counts["abort"] >= 1, counts  # the cancellation path ran (how many finish first is a race)
