"""The real tritonserver end to end: streaming over both protocols, concurrency, cancellation, errors, metrics."""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient

from client import LLMClient, LLMError
from triton_server import eventually, settled

pytestmark = pytest.mark.server
GREEDY = dict(temperature=0.0, max_tokens=24)
PROMPT = "The three primary colors are"


@pytest.fixture
def client(triton_server):
    return LLMClient(triton_server.grpc_url, triton_server.http_url)


def wait_idle(server, timeout: float = 10.0) -> float:
    """Seconds until no request runs or waits and no KV block is used (fails after ``timeout``)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if (server.metric("llm_kv_cache_blocks_used", version="2") == 0
                and server.metric("llm_num_requests_running", version="2") == 0
                and server.metric("llm_num_requests_waiting", version="2") == 0):
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError(f"server not idle after {timeout} s")


def test_streams_over_grpc_and_http_join_to_the_non_streaming_text(client):
    whole = client.generate(PROMPT, **GREEDY)
    assert whole.finish_reason in ("length", "stop") and whole.text
    grpc_deltas = list(client.stream_grpc(PROMPT, **GREEDY))
    http_deltas = list(client.stream_http(PROMPT, **GREEDY))
    for deltas in (grpc_deltas, http_deltas):
        assert len(deltas) > 1
        assert "".join(d.text for d in deltas) == whole.text
        assert [t for d in deltas for t in d.token_ids] == whole.token_ids
        assert [d.finish_reason for d in deltas][-1] == whole.finish_reason
        assert all(d.finish_reason is None for d in deltas[:-1])


def test_generate_endpoint_takes_inputs_or_a_parameters_object(triton_server):
    url = f"{triton_server.http_url}/v2/models/llm/generate"
    flat = requests.post(url, json={"text_input": PROMPT, "max_tokens": 8, "temperature": 0}).json()
    nested = requests.post(url, json={"text_input": PROMPT, "parameters": {"max_tokens": 8, "temperature": 0}}).json()
    assert flat["num_output_tokens"] == 8 and flat["finish_reason"] == "length"
    assert flat["text_output"] == nested["text_output"]
    assert flat["text_output"].startswith(PROMPT)  # exclude_input_in_output defaults to false, as in vllm_backend
    excluded = requests.post(url, json={"text_input": PROMPT, "max_tokens": 8, "temperature": 0,
                                        "exclude_input_in_output": True}).json()
    assert PROMPT + excluded["text_output"] == flat["text_output"]


def test_concurrent_requests_share_steps_and_each_gets_its_own_answer(triton_server):
    """Version 1 runs fp32, where greedy output does not depend on what shares the batch (bf16 GEMMs round
    differently at different batch sizes, so version 2 on a bf16 CPU would not give equal text)."""
    client = LLMClient(triton_server.grpc_url, triton_server.http_url, version="1")
    prompts = [f"Question {i}: name a famous {thing}." for i, thing in
               enumerate(["river", "mountain", "painter", "city", "planet", "poet"])]
    alone = {p: client.generate(p, temperature=0.0, max_tokens=32, ignore_eos=True).text for p in prompts}
    results, peak = {}, [0.0]
    done = threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], triton_server.metric("llm_num_requests_running", version="1"))
            time.sleep(0.05)

    def run(p):
        results[p] = "".join(d.text for d in client.stream_grpc(p, temperature=0.0, max_tokens=32, ignore_eos=True))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    done.set()
    watcher.join()
    assert peak[0] > 1, "requests never ran in the same step"
    assert results == alone


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_cancel_mid_stream_frees_blocks_and_server_keeps_serving(client, triton_server, protocol):
    aborts_before = settled(lambda: triton_server.metric("llm_request_finished_total", finish_reason="abort",
                                                         version="2"))
    stream = (client.stream_grpc if protocol == "grpc" else client.stream_http)(
        "Tell me a very long story.", max_tokens=1000, ignore_eos=True)
    for i, _ in enumerate(stream):
        if i == 3:
            break
    # The model publishes metrics at most every 200 ms while responses flow, and three tokens can arrive sooner.
    try:
        eventually(lambda: triton_server.metric("llm_kv_cache_blocks_used", version="2") > 0,
                   "no KV blocks in use while streaming", timeout_s=1.0)
    finally:
        stream.close()  # gRPC: stop_stream(cancel_requests=True); HTTP: the connection is dropped
    elapsed = wait_idle(triton_server)
    assert elapsed < 1.0, f"blocks freed only after {elapsed:.2f} s"
    assert triton_server.metric("llm_request_finished_total", finish_reason="abort", version="2") == aborts_before + 1
    assert triton_server.is_ready()
    assert client.generate("Hello", max_tokens=4, ignore_eos=True).num_output_tokens == 4


BAD_REQUESTS = [
    ({"text_input": ""}, "prompt is empty"),
    ({"text_input": "word " * 5000}, "max_model_len"),
    ({"text_input": "hi", "temperature": -1}, "temperature"),
    ({"text_input": "hi", "top_p": 1.5}, "top_p"),
    ({"text_input": "hi", "top_k": -2}, "top_k"),
    ({"text_input": "hi", "max_tokens": 0}, "max_tokens"),
    ({"text_input": "hi", "stop": [""]}, "stop must be"),
    ({"text_input": "hi", "sampling_parameters": '{"seed": 9223372036854775808}'}, "seed"),
    ({"text_input": "hi", "sampling_parameters": "{not json"}, "sampling_parameters is not valid JSON"),
    ({"text_input": "hi", "sampling_parameters": '{"tempreature": 1}'}, "unknown sampling parameter"),
    ({"text_input": "hi", "parameters": {"top_k": -2}}, "top_k"),
    ({"text_input": "hi", "stop": ["x"] * 100}, "stop has 100 strings"),
    ({"text_input": "hi", "sampling_parameters": "[" * 50 + "]" * 50}, "sampling_parameters nests 50 levels"),
    ({"text_input": "hi", "beam_width": 2}, "beam_width must be 1"),
    ({"input_ids": [1, -1], "max_tokens": 2}, "prompt token ids must be integers in [0, 49152), got -1"),
    ({"input_ids": [49152], "max_tokens": 2}, "prompt token ids must be integers in [0, 49152), got 49152"),
]


@pytest.mark.parametrize("body, message", BAD_REQUESTS, ids=[m for _, m in BAD_REQUESTS])
def test_bad_input_gets_a_clear_error_counted_as_failure(triton_server, body, message):
    before = triton_server.metric("nv_inference_request_failure", model="llm", version="2")
    response = requests.post(f"{triton_server.http_url}/v2/models/llm/generate", json=body)
    assert response.status_code == 400
    assert message in response.json()["error"]
    assert triton_server.is_ready()
    ok = requests.post(f"{triton_server.http_url}/v2/models/llm/generate", json={"text_input": "ok", "max_tokens": 2})
    assert ok.status_code == 200
    deadline = time.monotonic() + 5  # Triton refreshes its counters every --metrics-interval-ms
    while triton_server.metric("nv_inference_request_failure", model="llm", version="2") <= before:
        assert time.monotonic() < deadline, "the failure was not counted"
        time.sleep(0.1)


@pytest.mark.parametrize("body, keyword", [
    ({"text_input": "hi", "max_tokens": "many"}, "Unable to parse"),  # Triton does not name the field
    ({"text_input": "hi", "parameters": {"top_k": 2.5}}, "parameters"),
    ({"text_input": "hi", "parameters": {"temperature": "hot"}}, "parameters"),
    ({"text_input": "hi", "parameters": {"ignore_eos": "maybe"}}, "parameters"),
    ({"max_tokens": 3}, "text_input"),
])
def test_wrong_json_types_are_rejected_before_the_model(triton_server, body, keyword):
    """Triton converts generate-extension JSON to typed inputs itself and rejects what does not convert."""
    response = requests.post(f"{triton_server.http_url}/v2/models/llm/generate", json=body)
    assert response.status_code in (400, 500)
    assert keyword in response.json()["error"]
    assert triton_server.is_ready()


def test_wrongly_typed_grpc_input_is_rejected(triton_server):
    client = grpcclient.InferenceServerClient(triton_server.grpc_url)
    text = grpcclient.InferInput("text_input", [1], "BYTES")
    text.set_data_from_numpy(np.array([b"hi"], dtype=np.object_))
    bad = grpcclient.InferInput("max_tokens", [1], "FP32")
    bad.set_data_from_numpy(np.array([3.0], dtype=np.float32))
    errors: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: errors.put(error))
    client.async_stream_infer("llm", [text, bad], request_id="typed")
    error = errors.get(timeout=30)
    client.stop_stream()
    assert error is not None and "max_tokens" in str(error) and "FP32" in str(error)


def test_non_utf8_prompt_is_rejected_by_name(triton_server):
    got = raw_stream(triton_server, {"text_input": ([b"caf\xe9 \xff"], "BYTES", np.object_)})
    assert len(got) == 1 and "text_input is not valid UTF-8" in str(got[0][2])


def raw_stream(server, body_inputs: dict, cancel_after: int | None = None) -> list[tuple[bool, object, object]]:
    """Every gRPC response of one request as (is_final, result, error), with empty final responses on."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = []
    for name, (value, datatype, dtype) in body_inputs.items():
        tensor = grpcclient.InferInput(name, [len(value)], datatype)
        tensor.set_data_from_numpy(np.array(value, dtype=dtype))
        inputs.append(tensor)
    client.async_stream_infer("llm", inputs, request_id=uuid.uuid4().hex, enable_empty_final_response=True)
    got = []
    while True:
        try:
            result, error = responses.get(timeout=60 if cancel_after is None else 3)
        except queue.Empty:
            break
        final = error is not None or result.get_response().parameters["triton_final_response"].bool_param
        got.append((final, result, error))
        if final and cancel_after is None:
            time.sleep(0.5)  # anything sent after FINAL would arrive now
            while not responses.empty():
                got.append((False, *responses.get()))
            break
        if cancel_after is not None and len(got) == cancel_after:
            client.stop_stream(cancel_requests=True)
    client.close()
    return got


def text_inputs(prompt: str, **extra) -> dict:
    inputs = {"text_input": ([prompt.encode()], "BYTES", np.object_), "stream": ([True], "BOOL", np.bool_)}
    for name, value in extra.items():
        if name == "stop":
            inputs[name] = ([s.encode() for s in value], "BYTES", np.object_)
        elif isinstance(value, bool):
            inputs[name] = ([value], "BOOL", np.bool_)
        elif isinstance(value, float):
            inputs[name] = ([value], "FP32", np.float32)
        else:
            inputs[name] = ([value], "INT32", np.int32)
    return inputs


CHAT_PROMPT = ("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
ENDINGS = {
    "length": text_inputs(PROMPT, max_tokens=5, temperature=0.0),
    "stop_string": text_inputs(PROMPT, max_tokens=40, temperature=0.0, ignore_eos=True, stop=[","]),
    "eos": text_inputs(CHAT_PROMPT, max_tokens=60, temperature=0.0),
    "error": text_inputs(PROMPT, top_p=3.0),
}


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_exactly_one_final_response_per_request(triton_server, ending):
    got = raw_stream(triton_server, ENDINGS[ending])
    finals = [i for i, (final, _, _) in enumerate(got) if final]
    assert finals == [len(got) - 1], f"final flags at {finals} of {len(got)} responses"
    last_final, result, error = got[-1]
    if ending == "error":
        assert error is not None and "top_p" in str(error) and len(got) == 1
        return
    reasons = [r.as_numpy("finish_reason") for _, r, _ in got if r.as_numpy("finish_reason") is not None]
    last_reason = reasons[-1].reshape(-1)[0].decode()
    assert last_reason == {"length": "length", "stop_string": "stop", "eos": "stop"}[ending]
    if ending == "stop_string":
        text = "".join(r.as_numpy("text_output").reshape(-1)[0].decode() for _, r, _ in got
                       if r.as_numpy("text_output") is not None)
        assert "," not in text


def test_cancelled_request_gets_no_response_after_cancel_and_frees_blocks(triton_server):
    got = raw_stream(triton_server, text_inputs("Write a long essay.", max_tokens=500, ignore_eos=True),
                     cancel_after=2)
    # The two read, the few that were already on their way when the cancel went out, then the cancellation: the
    # stream ends there, far short of its 500 tokens, and the engine frees the request's blocks at once.
    *responses, (final, _, error) = got
    assert final and error is not None and len(responses) >= 2
    assert not any(f or e is not None for f, _, e in responses) and len(responses) <= 10
    assert wait_idle(triton_server) < 1.0


def test_a_client_can_address_a_version(triton_server):
    base = f"{triton_server.http_url}/v2/models/llm"
    v1 = requests.post(f"{base}/versions/1/generate", json={"text_input": PROMPT, "max_tokens": 3}).json()
    latest = requests.post(f"{base}/generate", json={"text_input": PROMPT, "max_tokens": 3}).json()
    assert v1["model_version"] == "1" and latest["model_version"] == "2"
    config = requests.get(f"{base}/versions/1/config").json()
    assert config["name"] == "llm"
    missing = requests.post(f"{base}/versions/7/generate", json={"text_input": PROMPT})
    assert missing.status_code in (400, 404) and "version" in missing.json()["error"].lower()


def test_metrics_match_what_the_requests_did(client, triton_server):
    m = triton_server.metric
    wait_idle(triton_server)
    before = settled(lambda: {name: m(name, version="1") for name in (
        "llm_prompt_tokens_total", "llm_generation_tokens_total", "llm_time_to_first_token_seconds_count",
        "llm_e2e_request_latency_seconds_count", "llm_time_per_output_token_seconds_count")})
    length_before = m("llm_request_finished_total", finish_reason="length", version="1")
    v1 = LLMClient(triton_server.grpc_url, triton_server.http_url, version="1")
    outs = [v1.generate(f"Say something about number {i}.", max_tokens=5 + i, ignore_eos=True) for i in range(3)]
    # The model publishes its metrics at most every 0.2 s while responses flow, and 0.25 s after.
    eventually(lambda: m("llm_generation_tokens_total", version="1") - before["llm_generation_tokens_total"] >= 18
               and m("llm_request_finished_total", finish_reason="length", version="1") - length_before >= 3
               and m("llm_kv_cache_blocks_used", version="1") == 0, "the requests' metrics were not published")
    assert m("llm_prompt_tokens_total", version="1") - before["llm_prompt_tokens_total"] == sum(
        o.num_input_tokens for o in outs)
    assert m("llm_generation_tokens_total", version="1") - before["llm_generation_tokens_total"] == 5 + 6 + 7
    assert m("llm_request_finished_total", finish_reason="length", version="1") - length_before == 3
    for name in ("llm_time_to_first_token_seconds_count", "llm_e2e_request_latency_seconds_count",
                 "llm_time_per_output_token_seconds_count"):
        assert m(name, version="1") - before[name] == 3
    # Idle gauges at rest, in our names and in TensorRT-LLM's.
    total = m("llm_kv_cache_blocks_total", version="1")
    assert total > 0 and m("llm_kv_cache_blocks_free", version="1") == total
    assert m("llm_kv_cache_blocks_used", version="1") == 0 and m("llm_kv_cache_usage_ratio", version="1") == 0
    assert m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max", version="1") == total
    assert m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used", version="1") == 0
    assert m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per", version="1") == 32
    assert m("nv_trt_llm_request_metrics", request_type="max", version="1") == 16
    assert m("nv_trt_llm_request_metrics", request_type="active", version="1") == 0
    assert m("nv_trt_llm_request_metrics", request_type="waiting", version="1") == 0


def test_client_raises_the_server_error(client):
    """The server's message itself, over each protocol (HTTP streaming sends it as one server-sent event)."""
    expected = "top_p must be in (0, 1], got 1.5"
    for call in (client.stream_grpc, client.stream_http, client.generate):
        with pytest.raises(LLMError) as raised:
            result = call("hi", top_p=1.5)
            list(result) if call is not client.generate else None
        assert str(raised.value) == expected, call


def test_parallel_sampling_streams_each_completion_and_generate_returns_all(client, triton_server):
    deltas = list(client.stream_grpc(PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))
    by_index = {i: [d for d in deltas if d.index == i] for i in range(3)}
    assert all(sum(len(d.token_ids) for d in ds) == 6 for ds in by_index.values())
    assert sorted(d.index for d in deltas if d.finish_reason) == [0, 1, 2]
    body = {"text_input": PROMPT, "n": 2, "max_tokens": 5, "temperature": 0, "exclude_input_in_output": True}
    both = requests.post(f"{triton_server.http_url}/v2/models/llm/generate", json=body).json()
    assert both["index"] == [0, 1] and both["finish_reason"] == ["length", "length"]
    assert both["text_output"][0] == both["text_output"][1]  # greedy: completions of one prompt agree
    assert len(both["output_ids"]) == 10
    # the client splits them back into completions, each its own text, ids and counts
    streamed = {i: [t for d in ds for t in d.token_ids] for i, ds in by_index.items()}
    whole = client.generate_all(PROMPT, n=3, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    assert [d.index for d in whole] == [0, 1, 2] and [d.token_ids for d in whole] == [streamed[i] for i in range(3)]
    assert all(d.num_output_tokens == 6 and d.finish_reason == "length" and d.text for d in whole)
    with pytest.raises(ValueError, match="generate_all"):
        client.generate(PROMPT, n=2)


def test_prefix_cache_hits_are_counted(client, triton_server):
    prompt = "You are a helpful assistant. Answer briefly and precisely. " * 6 + "Why is the sky blue?"
    hits_before = triton_server.metric("llm_prefix_cache_hits_total", version="2")
    cached = [client.generate(prompt, max_tokens=4, temperature=0.0) for _ in range(3)]
    assert cached[0].text == cached[1].text == cached[2].text
    assert cached[0].num_cached_tokens == 0 or cached[0].num_cached_tokens < cached[1].num_cached_tokens
    expected = (cached[1].num_input_tokens - 1) // 16 * 16
    assert cached[1].num_cached_tokens == cached[2].num_cached_tokens == expected > 0
    eventually(lambda: triton_server.metric("llm_prefix_cache_hits_total", version="2") - hits_before >= 2 * expected,
               "prefix cache hits were not counted")


def test_benchmark_client_times_every_token_of_concurrent_streams(triton_server):
    """The benchmark's served system (one asyncio channel for all streams) on the shared server: every request's
    tokens arrive, each timestamped after its arrival, in order, in the streamed modes; offline, whole answers
    (no token times) unless ``served_offline_stream``; the concurrent mode keeps its limit."""
    from benchmarks.config import BenchConfig
    from benchmarks.server_system import ServerSystem
    from benchmarks.workload import BenchRequest, Workload

    lengths = [3, 9, 17]
    workload = Workload(tuple(BenchRequest(i, (), f"{PROMPT} {i}", n, 0.2 * i) for i, n in enumerate(lengths)),
                        seed=0, rate=1.0, corpus_tokens=0, corpus_sha256="")
    system = ServerSystem(BenchConfig(dtype="float32", concurrency=2), server=triton_server)
    try:
        whole = system.run(workload, "offline")
        assert not whole.streams and [r.num_output_tokens for r in whole.records] == lengths
        for record, arrival in zip(whole.records, workload.arrivals("offline")):
            assert record.token_times == [] and record.finish > record.arrival == pytest.approx(whole.start + arrival)
        system.offline_stream = True
        for mode in ("offline", "online", "concurrent"):
            run = system.run(workload, mode)
            assert run.streams and [r.num_output_tokens for r in run.records] == lengths
            for record, arrival in zip(run.records, workload.arrivals(mode)):
                assert len(record.token_times) == record.expected_tokens
                assert record.token_times == sorted(record.token_times)
                if mode != "concurrent":
                    assert record.arrival == pytest.approx(run.start + arrival)
                assert record.arrival <= record.token_times[0] and record.finish == record.token_times[-1]
        # the closed loop: two streams at once, the third sent only once one of them had ended
        first, second, third = sorted(run.records, key=lambda r: r.arrival)
        assert third.arrival >= min(first.finish, second.finish) and second.arrival < first.finish
    finally:
        system.close()
    assert triton_server.is_ready()  # close() leaves a server it did not start running
    wait_idle(triton_server)
