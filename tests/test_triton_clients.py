"""The real tritonserver with the request shapes existing Triton LLM clients send, and the edges:
sampling edges, finish reasons, input limits, cancellation of queued requests."""

from __future__ import annotations

import json
import re
import queue
import threading
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from test_triton_server import CHAT_PROMPT, PROMPT, wait_idle
from triton_server import settled

pytestmark = pytest.mark.server


def tensor(name: str, value) -> grpcclient.InferInput:
    """A [len] tensor of the type Triton's LLM clients use for ``value``'s Python type."""
    values = value if isinstance(value, list) else [value]
    if isinstance(values[0], (str, bytes)):
        data = np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
        datatype = "BYTES"
    elif isinstance(values[0], bool):
        data, datatype = np.array(values, dtype=bool), "BOOL"
    elif isinstance(values[0], float):
        data, datatype = np.array(values, dtype=np.float32), "FP32"
    elif name == "random_seed":
        data, datatype = np.array(values, dtype=np.uint64), "UINT64"
    else:
        data, datatype = np.array(values, dtype=np.int32), "INT32"
    t = grpcclient.InferInput(name, list(data.shape), datatype)
    t.set_data_from_numpy(data)
    return t


def stream(server, inputs: dict, version: str = "", parameters: dict | None = None, outputs=None,
           request_id: str | None = None) -> list:
    """All responses of one request over a gRPC stream: a list of InferResult; raises its error."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    client.async_stream_infer("llm", [tensor(k, v) for k, v in inputs.items()], model_version=version,
                              request_id=request_id or uuid.uuid4().hex, parameters=parameters,
                              outputs=[grpcclient.InferRequestedOutput(o) for o in outputs] if outputs else None,
                              enable_empty_final_response=True)
    got = []
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if result.as_numpy("text_output") is not None or outputs:
                got.append(result)
            if response.parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()
        client.close()


def joined(results, name: str = "text_output") -> str:
    return "".join(r.as_numpy(name).reshape(-1)[0].decode() for r in results if r.as_numpy(name) is not None)


def ids(results) -> list[int]:
    return [int(t) for r in results if r.as_numpy("output_ids") is not None for t in r.as_numpy("output_ids")]


def last_reason(results) -> str:
    return [r for r in results if r.as_numpy("finish_reason") is not None][-1].as_numpy("finish_reason")[0].decode()


def generate(server, body: dict, version: str = "") -> requests.Response:
    base = f"{server.http_url}/v2/models/llm" + (f"/versions/{version}" if version else "")
    return requests.post(f"{base}/generate", json=body, timeout=120)


# -- existing clients -------------------------------------------------------------------------------------
def test_vllm_backend_sample_client_request_shape(triton_server):
    """Exactly what vllm_backend's samples/client.py sends: string values, in sampling_parameters and again
    as request parameters, only text_output requested; streaming and not."""
    sampling = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    for streaming in (False, True):
        got = stream(triton_server, {"text_input": "What is the capital of France?\n", "stream": streaming,
                                     "sampling_parameters": json.dumps(sampling)},
                     parameters=sampling, outputs=["text_output"], request_id="0")
        assert joined(got).strip()
        assert len(got) >= (2 if streaming else 1)
    # The same shape, greedy with a short limit: the values are honoured, not just accepted.
    sampling = {"temperature": "0", "max_tokens": "7", "ignore_eos": "true"}
    got = stream(triton_server, {"text_input": PROMPT, "stream": False, "sampling_parameters": json.dumps(sampling)},
                 parameters=sampling)
    assert len(ids(got)) == 7 and last_reason(got) == "length"
    greedy = generate(triton_server, {"text_input": PROMPT, "max_tokens": 7, "temperature": 0, "ignore_eos": True})
    assert joined(got) == greedy.json()["text_output"]


def test_only_the_requested_outputs_are_sent(triton_server):
    """A client naming its outputs gets those and no others in every streamed response (the model builds no
    others); one naming none gets them all. The tokens are the same either way."""
    inputs = {"text_input": PROMPT, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True, "stream": True}
    named = stream(triton_server, inputs, outputs=["output_ids", "text_output"])  # a response may carry several
    assert all({o.name for o in r.get_response().outputs} == {"output_ids", "text_output"} for r in named)
    every = stream(triton_server, inputs)
    assert {o.name for o in every[0].get_response().outputs} >= {"text_output", "output_ids", "finish_reason",
                                                                  "num_input_tokens", "num_output_tokens", "index"}
    assert ids(named) == ids(every) and len(ids(named)) == 6 and joined(named) == joined(every)


@pytest.mark.parametrize("version", ["1", "2"])
def test_genai_perf_kserve_vllm_request_shape(triton_server, version):
    """GenAI-Perf --endpoint-type kserve --backend vllm --output-tokens-mean 12 --output-tokens-mean-deterministic."""
    sampling = json.dumps({"max_tokens": "12", "min_tokens": "12"})
    got = stream(triton_server, {"text_input": [CHAT_PROMPT], "exclude_input_in_output": [True], "stream": [True],
                                 "sampling_parameters": [sampling]}, version=version)
    # min_tokens held EOS off; a response per token, unless the sender fell behind the engine and merged some
    # (backend.outputs.coalesce: a loaded 2-core machine does)
    assert len(ids(got)) == 12 and 1 < len(got) <= 12
    assert not joined(got).startswith(CHAT_PROMPT)


@pytest.mark.parametrize("version", ["1", "2"])
def test_genai_perf_kserve_tensorrtllm_request_shape(triton_server, version):
    """GenAI-Perf --endpoint-type kserve --backend tensorrtllm --output-tokens-mean 10 --output-tokens-mean-deterministic."""
    got = stream(triton_server, {"text_input": [CHAT_PROMPT], "max_tokens": [10], "min_length": [10],
                                 "stream": [True]}, version=version)
    assert len(ids(got)) == 10 and last_reason(got) == "length"
    plain = stream(triton_server, {"text_input": [CHAT_PROMPT], "max_tokens": [256], "stream": [True],
                                   "temperature": [0.0]}, version=version)  # the default shape: EOS may end it
    assert 0 < len(ids(plain)) <= 256


@pytest.mark.parametrize("version", ["1", "2"])
def test_tensorrt_llm_inputs_are_honoured(triton_server, version):
    greedy = dict(text_input=PROMPT, max_tokens=12, temperature=0.0, exclude_input_in_output=True)
    base = stream(triton_server, {**greedy, "ignore_eos": True}, version)
    base_ids, base_text = ids(base), joined(base)
    # bad_words: the greedy first word is never generated; stop_words: cut like stop strings.
    first_word = base_text.split()[0]
    banned = stream(triton_server, {**greedy, "ignore_eos": True, "bad_words": ["", first_word]}, version)
    assert first_word not in joined(banned).split() and len(ids(banned)) == 12
    stop_word = base_text[4:8]
    cut = stream(triton_server, {**greedy, "ignore_eos": True, "stop_words": [stop_word, ""]}, version)
    assert joined(cut) == base_text[: base_text.index(stop_word)] and last_reason(cut) == "stop"
    # end_id: the given token ends generation (here the greedy 3rd token), pad_id, beam_width 1: accepted.
    ended = stream(triton_server, {**greedy, "end_id": base_ids[2], "pad_id": 0, "beam_width": 1,
                                   "len_penalty": 1.0, "length_penalty": 1.0, "early_stopping": False}, version)
    assert ids(ended) == base_ids[: base_ids.index(base_ids[2]) + 1] and last_reason(ended) == "stop"
    # min_length holds the end token off
    held = stream(triton_server, {**greedy, "end_id": base_ids[0], "min_length": 5}, version)
    assert len(ids(held)) >= 5 and base_ids[0] not in ids(held)[:5]
    # return_log_probs: TensorRT-LLM's outputs, per token and cumulative
    logged = stream(triton_server, {**greedy, "ignore_eos": True, "return_log_probs": True}, version)
    per_token = [float(v) for r in logged for v in r.as_numpy("output_log_probs")]
    assert ids(logged) == base_ids and len(per_token) == 12 and all(v <= 0 for v in per_token)
    assert logged[-1].as_numpy("cum_log_probs")[0] == pytest.approx(sum(per_token), rel=1e-4)
    assert base[-1].as_numpy("output_log_probs") is None  # not asked: not sent
    # num_return_sequences, random_seed, runtime_top_k/p
    sampled = dict(text_input=PROMPT, max_tokens=6, temperature=1.0, ignore_eos=True, runtime_top_k=0,
                   runtime_top_p=0.9, random_seed=2**64 - 5, num_return_sequences=2, stream=False)
    one, two = stream(triton_server, sampled, version), stream(triton_server, sampled, version)
    assert list(one[-1].as_numpy("index")) == [0, 1] and ids(one) == ids(two) and len(ids(one)) == 12


@pytest.mark.parametrize("body, message", [
    ({"text_input": "hi", "beam_width": 4}, "beam_width must be 1 (beam search is not supported), got 4"),
    ({"text_input": "hi", "runtime_top_p": 0.0}, "(sent as runtime_top_p)"),
    ({"text_input": "hi", "sampling_parameters": '{"max_tokens": "many"}'}, "max_tokens must be an integer, got string 'many'"),
    ({"text_input": "hi", "end_id": 49152}, "end_id is 49152, outside the vocabulary [0, 49152)"),
    ({"text_input": "hi", "sampling_parameters": '{"stop_words": 5}'}, "stop_words must be a string or a list of strings"),
    ({"text_input": "hi", "sampling_parameters": '{"allowed_token_ids": [2], "min_tokens": 3}'}, "no token can be sampled"),
])
def test_tensorrt_llm_and_string_values_are_refused_by_name(triton_server, body, message):
    for version in ("1", "2"):
        response = generate(triton_server, body, version)
        assert response.status_code == 400 and message in response.json()["error"]


# -- sampling and finishing ----------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1e-38, 1e-45])
def test_tiny_temperature_gives_the_greedy_answer(triton_server, temperature):
    body = {"text_input": PROMPT, "max_tokens": 10, "ignore_eos": True, "exclude_input_in_output": True}
    greedy = generate(triton_server, {**body, "temperature": 0}).json()
    tiny = generate(triton_server, {**body, "temperature": temperature}).json()
    assert tiny["output_ids"] == greedy["output_ids"] and tiny["output_ids"][:3] != [0, 0, 0]


def test_extreme_repetition_penalty_gives_real_tokens(triton_server):
    for penalty in (1e-38, 3e38):
        out = generate(triton_server, {"text_input": PROMPT, "max_tokens": 6, "ignore_eos": True, "temperature": 0.5,
                                       "repetition_penalty": penalty, "seed": 1}).json()
        assert len(out["output_ids"]) == 6 and out["output_ids"] != [0] * 6, out


def test_eos_as_the_last_allowed_token_finishes_with_stop(triton_server):
    body = {"text_input": CHAT_PROMPT, "temperature": 0, "max_tokens": 60}
    free = generate(triton_server, body).json()
    assert free["finish_reason"] == "stop" and free["num_output_tokens"] < 60  # ends in EOS by itself
    exact = generate(triton_server, {**body, "max_tokens": free["num_output_tokens"]}).json()
    assert exact["finish_reason"] == "stop" and exact["output_ids"] == free["output_ids"]
    shorter = generate(triton_server, {**body, "max_tokens": free["num_output_tokens"] - 1}).json()
    assert shorter["finish_reason"] == "length"


@pytest.mark.parametrize("streaming", [False, True])
def test_stop_string_in_the_last_allowed_token_finishes_with_stop(triton_server, streaming):
    body = {"text_input": PROMPT, "temperature": 0.0, "max_tokens": 10, "ignore_eos": True,
            "exclude_input_in_output": True}
    full = generate(triton_server, body).json()["text_output"]
    stop = next(full[-k:] for k in range(2, len(full)) if full.find(full[-k:]) == len(full) - k)
    got = stream(triton_server, {**body, "stop": [stop], "stream": streaming})
    assert joined(got) == full[: -len(stop)] and last_reason(got) == "stop"
    assert got[-1].as_numpy("num_output_tokens")[0] == 10


# -- input limits -------------------------------------------------------------------------------------------
LIMITS = [
    ({"text_input": "hi", "stop": ["x"] * 10_000}, "stop has 10000 strings; at most 32"),
    ({"text_input": "hi", "stop": ["x" * 100_000]}, "stop has a string of 100000 characters; at most 256"),
    ({"text_input": "hi", "sampling_parameters": "[" * 300_000 + "]" * 300_000}, "sampling_parameters is 600000 bytes"),
    ({"text_input": "hi", "sampling_parameters": '{"stop":' + "[" * 5000 + "]" * 5000 + "}"},
     "sampling_parameters nests 5001 levels deep"),
    ({"text_input": "hi", "id": "r" * 2**20}, "request id is 1048576 bytes; at most 256"),
    ({"text_input": "hi", "max_tokens": 3_000_000_000}, "Triton's conversion wrapped it around"),
]


@pytest.mark.parametrize("body, message", LIMITS, ids=[m.split(";")[0][:40] for _, m in LIMITS])
def test_limits_give_a_clear_400_and_the_server_keeps_serving(triton_server, body, message):
    response = generate(triton_server, body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert message in error and len(error) < 1000  # nothing of the oversized input echoed
    assert "Traceback" not in triton_server.log()[-20000:]
    assert generate(triton_server, {"text_input": "ok", "max_tokens": 2}).status_code == 200


def test_the_engines_choices_at_load_are_in_the_server_log(triton_server):
    """The attention backend the selector chose (the configuration docs say it is logged) reaches Triton's log,
    not only warnings."""
    assert re.search(r"INFO backend\.attention\.selector: attention backend: \w+ \(auto; cpu, torch\.float32",
                     triton_server.log())


def test_a_replaced_value_beyond_int32_is_refused_too(triton_server):
    """A request parameter that the named input replaces is checked like one alone: never dropped unread."""
    with pytest.raises(RuntimeError, match="max_tokens is 3000000000, beyond the INT32 range.*replaces it"):
        stream(triton_server, {"text_input": "hi", "max_tokens": 4}, parameters={"max_tokens": 3_000_000_000})


def test_max_tokens_beyond_int32_as_a_request_parameter_quotes_the_value_sent(triton_server):
    with pytest.raises(RuntimeError, match="max_tokens is 3000000000, beyond the INT32 range"):
        stream(triton_server, {"text_input": "hi"}, parameters={"max_tokens": 3_000_000_000})


def test_huge_prompt_is_rejected_by_bytes_at_once(triton_server):
    start = time.monotonic()
    response = generate(triton_server, {"text_input": "word " * 3_200_000})  # 16 MB
    elapsed = time.monotonic() - start
    assert response.status_code == 400 and "bytes" in response.json()["error"]
    assert "rejected before tokenizing" in response.json()["error"]
    assert elapsed < 5.0, f"took {elapsed:.1f} s"


def test_long_prompts_do_not_hold_up_a_short_request(triton_server):
    """Prompts just under the byte bound (~330 kB, tokenized on the adapter's intake thread) arriving first
    do not delay the admission of a short request sent right after them (tokenized inline on Triton's
    execute thread, they held it up 1.7 s on 2 cores; off it, 0.14 s against 0.07 s alone)."""
    body = {"text_input": "Hello", "max_tokens": 1}
    solo = min(_timed(lambda: generate(triton_server, body)) for _ in range(2))
    big = {"text_input": "x" * 330_000, "max_tokens": 1}  # ~41,000 tokens: rejected after tokenizing
    results: list = []
    threads = [threading.Thread(target=lambda: results.append(generate(triton_server, big))) for _ in range(16)]
    for t in threads:
        t.start()
    time.sleep(0.3)  # all big ones have reached the model
    small = _timed(lambda: generate(triton_server, body))
    print(f"short request behind long prompts: {small:.2f} s (alone {solo:.2f} s)")
    for t in threads:
        t.join(120)
    assert len(results) == 16 and all(r.status_code == 400 and "max_model_len" in r.json()["error"] for r in results)
    assert small < solo + 0.8, f"short request took {small:.2f} s behind long prompts (alone {solo:.2f} s)"


def _timed(call) -> float:
    start = time.monotonic()
    assert call().status_code == 200
    return time.monotonic() - start


# -- cancellation ---------------------------------------------------------------------------------------------
def test_cancelled_waiting_requests_are_never_scheduled(triton_server):
    """Version 1 runs 16 sequences at most: 16 long streams run, 6 more wait; all are cancelled (the waiting
    ones first), which frees the slots, yet the waiting ones must end without ever being admitted (no first
    token, so no prompt tokens counted for them)."""
    m = triton_server.metric
    prompt_tokens_before, aborts_before = settled(lambda: (
        m("llm_prompt_tokens_total", version="1"),
        m("llm_request_finished_total", finish_reason="abort", version="1")))
    first_responses: dict[int, tuple] = {}  # running stream -> its first (result, error)
    running, waiting = [], []
    try:
        for i in range(16):
            running.append(_open_stream(triton_server, f"Story {i}: once upon a time", 300,
                                        lambda result, error, i=i: first_responses.setdefault(i, (result, error))))
        deadline = time.monotonic() + 60
        while m("llm_num_requests_running", version="1") < 16:
            assert time.monotonic() < deadline, "16 requests never ran"
            time.sleep(0.05)
        # A prompt is counted at its first token, while a request counts as running from its first prefill
        # chunk on (the step time budget can spread a prefill over steps): wait for every running stream's
        # first token, then for the counter to be published, before reading it.
        while len(first_responses) < 16:
            assert time.monotonic() < deadline, f"only {len(first_responses)} of 16 streams got a first token"
            time.sleep(0.05)
        assert [error for _, error in first_responses.values() if error is not None] == []
        prompt_tokens_running = settled(lambda: m("llm_prompt_tokens_total", version="1")) - prompt_tokens_before
        assert prompt_tokens_running >= 16 * 8  # each running prompt is at least 8 tokens
        waiting += [_open_stream(triton_server, f"Waiting request number {i} asks a question", 50)
                    for i in range(6)]
        while m("llm_num_requests_waiting", version="1") < 6:
            assert time.monotonic() < deadline, "6 requests never waited"
            time.sleep(0.05)
        for client in waiting + running:  # the waiting ones first, then at once the running ones: slots free up
            client.stop_stream(cancel_requests=True)
        deadline = time.monotonic() + 10
        while (m("llm_kv_cache_blocks_used", version="1") > 0 or m("llm_num_requests_running", version="1") > 0
               or m("llm_num_requests_waiting", version="1") > 0):
            assert time.monotonic() < deadline, "cancelled requests were not dropped"
            time.sleep(0.05)
        while m("llm_request_finished_total", finish_reason="abort", version="1") - aborts_before < 22:
            assert time.monotonic() < deadline, "not every cancelled request was counted as aborted"
            time.sleep(0.05)
        assert m("llm_request_finished_total", finish_reason="abort", version="1") - aborts_before == 22
        assert m("llm_prompt_tokens_total", version="1") - prompt_tokens_before == prompt_tokens_running
    finally:
        # Cancel before closing (a plain close waits for the requests to finish), so that a failed assertion
        # does not leave 300-token streams running into the next tests on this server.
        for client in waiting + running:
            client.stop_stream(cancel_requests=True)
            client.close()
    wait_idle(triton_server)


def _open_stream(server, prompt: str, max_tokens: int, callback=None) -> grpcclient.InferenceServerClient:
    """A gRPC stream running one request for ``prompt``; ``callback(result, error)`` gets its responses."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback or (lambda result, error: None))
    client.async_stream_infer("llm", [tensor("text_input", prompt), tensor("stream", True),
                                      tensor("max_tokens", max_tokens), tensor("ignore_eos", True)],
                              model_version="1", request_id=uuid.uuid4().hex)
    return client


def test_an_abort_request_on_the_same_stream_ends_a_request_without_cancelling_it(triton_server):
    """serve.abort_keys: an abort request with a long stream's abort_key, sent on the same stream, ends that request
    (finish_reason abort, its KV blocks freed); the stream then half-closes and ends with no cancellation. An abort
    request whose key is not in flight only gets its empty final."""
    m = triton_server.metric
    aborts = settled(lambda: m("llm_request_finished_total", finish_reason="abort", version="2"))
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    key = uuid.uuid4().hex
    client.async_stream_infer("llm", [tensor("text_input", "Tell me a very long story."), tensor("stream", True),
                                      tensor("max_tokens", 1000), tensor("ignore_eos", True)],
                              request_id="long", parameters={"abort_key": key}, enable_empty_final_response=True)
    finals: dict[str, object] = {}

    def read_until(request_id: str) -> None:
        while request_id not in finals:
            result, error = responses.get(timeout=60)
            assert error is None, error
            response = result.get_response()
            if response.parameters["triton_final_response"].bool_param:
                finals[response.id] = result

    try:
        result, error = responses.get(timeout=60)  # the first token: it runs
        assert error is None and result.get_response().id == "long"
        client.async_stream_infer("llm", [], request_id="stranger", parameters={"abort": uuid.uuid4().hex},
                                  enable_empty_final_response=True)
        read_until("stranger")
        assert "long" not in finals  # still running
        client.async_stream_infer("llm", [], request_id="owner", parameters={"abort": key},
                                  enable_empty_final_response=True)
        read_until("long")
        read_until("owner")
    finally:
        client.stop_stream()  # no cancellation: it returns once Triton has ended the stream
        client.close()
    assert finals["long"].as_numpy("finish_reason")[0].decode() == "abort"
    assert finals["owner"].as_numpy("text_output") is None and finals["stranger"].as_numpy("text_output") is None
    assert wait_idle(triton_server) < 2.0
    assert settled(lambda: m("llm_request_finished_total", finish_reason="abort", version="2")) == aborts + 1


@pytest.mark.parametrize("inputs, parameters, message", [
    ({}, {"abort": "short"}, "abort must be a string of 16 to 256 characters"),
    ({}, {"abort": 1234567890123456}, "abort must be a string of 16 to 256 characters"),
    ({"text_input": "hi"}, {"abort": uuid.uuid4().hex}, "an abort request (parameter 'abort') carries no prompt"),
    ({"text_input": "hi"}, {"abort_key": "x"}, "abort_key must be a string of 16 to 256 characters"),
])
def test_a_malformed_abort_request_or_key_is_refused_by_name(triton_server, inputs, parameters, message):
    with pytest.raises(RuntimeError, match=re.escape(message)):
        stream(triton_server, inputs, parameters=parameters)
