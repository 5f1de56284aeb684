"""No heavy request holds up the others: each of ``benchmarks.stalls``' heavy requests against one real
``python -m serve`` (tritonserver and the OpenAI frontend), while small requests (``GET /health``, a one-token
completion) are timed back to back and a streaming completion runs.

Each test asserts the heavy request's answer (refused with the right error, or served) and, against the window
just before it: the median latency of ``GET /health`` (the frontend's event loop) grew by less than
:data:`HEALTH_DELAY_S`, that of a one-token completion by less than :data:`COMPLETION_DELAY_S`, and the stream's
largest gap between events by less than :data:`STREAM_GAP_S`. The completion and the stream need the engine's
forward pass, which on 2 cores takes both: every CPU-second the heavy request costs anywhere (its own client,
the frontend parsing it, the tokenizer) slows the engine's steps on such a machine. Their bounds leave room
for that sharing and still fail a request that waits behind another (seconds); ``python -m benchmarks.stalls``
measures every case against the 100 ms aim.
"""

from __future__ import annotations

import pytest

from benchmarks.stalls import Bench, start_stack

pytestmark = [pytest.mark.server, pytest.mark.slow]  # a launcher of its own: minutes
HEALTH_DELAY_S = 0.25  # added to the median of GET /health
COMPLETION_DELAY_S = 1.0  # added to the median of a one-token completion
STREAM_GAP_S = 1.0  # added to the stream's largest gap
# 256 prompts in one request take 0.8-1.9 s end to end on 2 CPU cores, of which the engine's steps are about
# 0.2 s (the step time budget holds each under 80 ms); the rest is per-request work in the frontend and the
# backend stub, which holds their GIL. In one step the small completion and the stream would wait for all of it;
# spread over steps they wait for a share: the stream's longest added gap was up to 45% of the request's time on a
# Zen 4 EPYC (0.79 s of 1.88), the completion's median delay up to 38%. The request is repeated over a few seconds
# so that the median completion delay has samples to be a median of; that median is what holds the spreading to a
# share. The stream's largest gap is a single sample (one stall of the frontend's per-request work anywhere in the
# window): on the same machine kind it ranged from 12% to 67% of the request's time over five runs, so it keeps
# the bound of a request that waits behind another, STREAM_GAP_S.
SPREAD_BOUND_S = 0.3
SPREAD_SHARE = 0.6  # of the 256-prompt request's own time


@pytest.fixture(scope="module")
def bench(tmp_path_factory, default_model_dir):
    from triton_server import stop_server

    server = start_stack(tmp_path_factory.mktemp("stalls"))
    bench = Bench(server.openai_url, server.http_url)
    yield bench
    bench.close()
    stop_server(server)


def check(row: dict, completion_bound_s: float = COMPLETION_DELAY_S, stream_bound_s: float = STREAM_GAP_S) -> None:
    print({k: v for k, v in row.items() if not k.endswith("_count")})
    assert row["as_expected"], row["outcomes"]
    assert not row["failures"], row["failures"]
    assert row["health_count"] >= 3 and row["completion_count"] >= 1, row
    assert row["health_delay_p50_ms"] < 1000 * HEALTH_DELAY_S, row
    assert row["completion_delay_p50_ms"] < 1000 * completion_bound_s, row
    assert row["stream_gap_added_ms"] < 1000 * stream_bound_s, row


@pytest.mark.parametrize("case", ["body_50mb", "body_50mb_chunked"])
def test_50_mib_body_is_refused_without_holding_up_others(bench, case):
    check(bench.run(case, baseline_s=2.0, heavy_s=1.5))


@pytest.mark.parametrize("case", ["render_5mb", "chat_render_5mb", "tokenize_5mb", "completion_330k_tokens"])
def test_oversized_prompt_is_refused_without_holding_up_others(bench, case):
    check(bench.run(case, baseline_s=2.0, heavy_s=1.5))


@pytest.mark.parametrize("case", ["render_330k_tokens", "tokenize_330k_tokens"])
def test_330k_token_render_is_served_without_holding_up_others(bench, case):
    check(bench.run(case, baseline_s=2.0, heavy_s=1.5))


def test_480_deep_schema_is_refused_without_holding_up_others(bench):
    check(bench.run("schema_480_deep", baseline_s=2.0, heavy_s=1.5))


def test_slow_schema_compiles_while_others_are_served(bench):
    """The compile runs on a worker thread; Triton's execute thread takes the small requests meanwhile."""
    check(bench.run("schema_slow_compile", baseline_s=2.0, heavy_s=0.0))


def test_2000_prompts_are_refused_without_holding_up_others(bench):
    check(bench.run("prompts_2000", baseline_s=2.0, heavy_s=1.5))


def test_256_prompts_are_spread_over_steps_that_leave_room_for_others(bench):
    row = bench.run("prompts_256", baseline_s=2.0, heavy_s=3.0)
    # In one step the others would wait for nearly all of the request's compute (its own time); the bound is a
    # share of that time, so a slower machine, whose steps are all slower, is held to the same spreading.
    bound_s = max(SPREAD_BOUND_S, SPREAD_SHARE * max(row["heavy_s"]))
    check(row, completion_bound_s=bound_s)


def test_chunked_flood_to_the_frontend_is_served_without_holding_up_others(bench):
    check(bench.run("chunked_flood", baseline_s=2.0, heavy_s=0.0))


def test_schema_over_the_compile_deadline_is_refused_while_others_are_served(bench):
    """Last: its compile goes on past the deadline (on a compile thread, using a core) for seconds after the
    refusal."""
    check(bench.run("schema_compile_timeout", baseline_s=2.0, heavy_s=0.0))
