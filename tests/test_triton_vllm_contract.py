"""The real tritonserver speaks Triton vLLM backend's optional-output contract (what Triton's OpenAI frontend
``--backend vllm`` sends) and takes structured-output constraints through its inputs."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from test_triton_clients import generate, joined, stream
from test_triton_server import PROMPT

pytestmark = pytest.mark.server

RETURNS = {name: True for name in ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                                   "return_num_input_tokens", "return_num_output_tokens")}


def column(results, name: str) -> list:
    return [r.as_numpy(name).reshape(-1).tolist() for r in results if r.as_numpy(name) is not None]


@pytest.mark.parametrize("streaming", [True, False])
def test_vllm_return_outputs_have_vllm_backend_values(triton_server, tokenizer, streaming):
    inputs = {"text_input": PROMPT, "stream": streaming, "exclude_input_in_output": True,
              "sampling_parameters": json.dumps({"max_tokens": 12, "temperature": 0, "ignore_eos": True,
                                                 "logprobs": 1}), **RETURNS}
    results = stream(triton_server, inputs, version="1")
    new_tokens = [n for per in column(results, "num_output_tokens") for n in per]
    output_ids = [int(t) for r in results for t in (r.as_numpy("output_ids") if r.as_numpy("output_ids") is not None else [])]
    assert sum(new_tokens) == len(output_ids) == 12  # each response counts its own new tokens (vLLM's meaning)
    steps = [step for texts in column(results, "logprobs") for text in texts for step in json.loads(text)]
    assert len(steps) == 12
    sampled = [step[str(token)]["logprob"] for step, token in zip(steps, output_ids)]
    cumulative = column(results, "cumulative_logprob")[-1][0]
    assert cumulative == pytest.approx(sum(sampled), abs=1e-4) and cumulative < 0
    assert column(results, "finish_reason")[-1] == [b"length"]
    prompt_tokens = column(results, "num_input_tokens")
    assert prompt_tokens and all(n == [len(tokenizer.encode(PROMPT))] for n in prompt_tokens)


def test_cumulative_logprob_without_logprobs_and_logprobs_null(triton_server):
    inputs = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 5, "temperature": 0}),
              "return_cumulative_logprob": True}
    results = stream(triton_server, inputs, version="1")
    assert column(results, "cumulative_logprob")[-1][0] < 0
    inputs = {"text_input": PROMPT, "sampling_parameters": json.dumps({"max_tokens": 5}), "return_logprobs": True}
    results = stream(triton_server, inputs, version="1")
    assert column(results, "logprobs") == [[b"null"]]
    # Both switches: the cumulative sum, and still null logprobs and no TensorRT-LLM logprob outputs (the
    # engine computes the sampled tokens' logprobs for the sum, but nobody asked for them).
    inputs = {**inputs, "return_cumulative_logprob": True}
    results = stream(triton_server, inputs, version="1")
    assert column(results, "logprobs") == [[b"null"]] and column(results, "cumulative_logprob")[-1][0] < 0
    assert column(results, "output_log_probs") == column(results, "cum_log_probs") == []
    # Without the switches, num_output_tokens keeps its meaning here: the completion's tokens so far.
    # A stream behind the engine gets its deltas merged, so the counts are checked against the token ids each
    # response carries, not against a fixed number of responses.
    results = stream(triton_server, {"text_input": PROMPT, "stream": True, "max_tokens": 16, "ignore_eos": True})
    counts = [n for per in column(results, "num_output_tokens") for n in per]
    new_ids = [len(ids) for ids in column(results, "output_ids")]
    assert counts == [sum(new_ids[:i + 1]) for i in range(len(new_ids))] and counts[-1] == 16, (counts, new_ids)
    assert len(counts) >= 2 and counts[-1] != new_ids[-1]  # a running total, not the last response's own count


def test_structured_outputs_through_sampling_parameters_and_trtllm_inputs(triton_server):
    schema = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}
    for constraint in ({"structured_outputs": {"json": schema}},
                       {"guided_decoding": json.dumps({"json": schema, "regex": None, "backend": None})}):
        text = joined(stream(triton_server, {"text_input": PROMPT, "exclude_input_in_output": True,
                                             "sampling_parameters": json.dumps({"max_tokens": 30, **constraint})}))
        assert json.loads(text)["city"] in ("Paris", "Rome")
    text = joined(stream(triton_server, {"text_input": PROMPT, "max_tokens": 20, "exclude_input_in_output": True,
                                         "guided_decoding_guide_type": "regex",
                                         "guided_decoding_guide": r"[A-Z][a-z]{2,6}!"}))
    assert re.fullmatch(r"[A-Z][a-z]{2,6}!", text), text
    body = {"text_input": PROMPT, "max_tokens": 10, "exclude_input_in_output": True,
            "sampling_parameters": json.dumps({"structured_outputs": {"choice": ["yes", "no"]}})}
    assert generate(triton_server, body).json()["text_output"] in ("yes", "no")


def test_invalid_schema_is_a_400_for_that_request_alone(triton_server):
    body = {"text_input": PROMPT, "sampling_parameters": json.dumps({"structured_outputs": {"json": {"type": 5}}})}
    response = generate(triton_server, body)
    assert response.status_code == 400
    assert "invalid structured_outputs.json" in response.json()["error"]
    assert generate(triton_server, {"text_input": PROMPT, "max_tokens": 3}).status_code == 200
