"""openai_frontend/metrics.py without a server: what one request's deltas make of vLLM's histograms and counters,
and the page when Triton's metrics port does not answer."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families
from triton_server import free_port

from openai_frontend.metrics import FrontendMetrics
from openai_frontend.triton_stream import Delta


def samples(metrics: FrontendMetrics) -> dict[tuple[str, tuple], float]:
    page = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page) for s in family.samples}


async def replay(metrics: FrontendMetrics, deltas: list[Delta], stop_early: bool = False) -> None:
    async def stream():
        for delta in deltas:
            await asyncio.sleep(0.01)
            yield delta

    measured = metrics.measure("llm", stream())
    async for _ in measured:
        if stop_early:
            break
    await measured.aclose()


def delta(index: int, tokens: int, finish: str | None = None) -> Delta:
    return Delta(index, "x" * tokens, list(range(tokens)), finish, 7, 0, 0)


def test_two_completions_observe_one_first_token_each_and_every_token_of_later_responses_once():
    metrics = FrontendMetrics(triton_metrics_url=None)
    # n=2: completion 0 streams 1, 2 and 1 tokens; completion 1 streams 3 tokens at once and finishes by stop.
    asyncio.run(replay(metrics, [delta(0, 1), delta(1, 3, "stop"), delta(0, 2), delta(0, 1, "length")]))
    got = samples(metrics)
    model = (("model_name", "llm"),)
    assert got[("vllm:time_to_first_token_seconds_count", model)] == 2
    # Completion 0's later responses carry 2 + 1 tokens; completion 1's tokens all came with its first response.
    assert got[("vllm:inter_token_latency_seconds_count", model)] == 3
    assert got[("vllm:e2e_request_latency_seconds_count", model)] == 2
    assert got[("vllm:generation_tokens_total", model)] == 7
    assert got[("vllm:prompt_tokens_total", model)] == 7  # counted once per request, not per completion
    assert got[("vllm:request_success_total", (("finished_reason", "length"), *model))] == 1
    assert got[("vllm:request_success_total", (("finished_reason", "stop"), *model))] == 1
    assert got[("vllm:time_to_first_token_seconds_sum", model)] < got[("vllm:e2e_request_latency_seconds_sum", model)]


def test_a_completion_cut_short_counts_as_abort():
    metrics = FrontendMetrics(triton_metrics_url=None)
    asyncio.run(replay(metrics, [delta(0, 1), delta(0, 1)], stop_early=True))
    got = samples(metrics)
    assert got[("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "llm")))] == 1
    assert got.get(("vllm:e2e_request_latency_seconds_count", (("model_name", "llm"),)), 0) == 0


def test_a_completion_that_triton_failed_counts_as_error_not_abort():
    from openai_frontend.errors import OpenAIError

    async def failing():
        yield delta(0, 1)
        yield delta(1, 1)
        raise OpenAIError(500, "internal error: the forward pass failed", "internal_error")

    async def consume():
        try:
            async for _ in metrics.measure("llm", failing()):
                pass
        except OpenAIError:
            pass

    metrics = FrontendMetrics(triton_metrics_url=None)
    asyncio.run(consume())
    got = samples(metrics)
    assert got[("vllm:request_success_total", (("finished_reason", "error"), ("model_name", "llm")))] == 2
    assert ("vllm:request_success_total", (("finished_reason", "abort"), ("model_name", "llm"))) not in got


def test_an_unreachable_triton_leaves_the_engine_gauges_out_and_says_so():
    metrics = FrontendMetrics(triton_metrics_url=f"http://127.0.0.1:{free_port()}/metrics")
    got = samples(metrics)
    assert got[("llm_frontend_engine_metrics_up", ())] == 0
    assert not any(name.startswith("vllm:num_requests") for name, _ in got)


def test_every_finish_reason_of_a_declared_model_starts_at_0():
    metrics = FrontendMetrics(triton_metrics_url=None)
    metrics.declare("llm")
    got = samples(metrics)
    for reason in ("stop", "length", "abort", "error", "timeout"):
        assert got[("vllm:request_success_total", (("finished_reason", reason), ("model_name", "llm")))] == 0
    assert got[("vllm:generation_tokens_total", (("model_name", "llm"),))] == 0
    assert got[("vllm:time_to_first_token_seconds_count", (("model_name", "llm"),))] == 0
