"""``GET /metrics`` on the OpenAI frontend's port (9000): Prometheus metrics under vLLM's names.

The Gateway API Inference Extension's endpoint picker scrapes each endpoint of an InferencePool on the pool's
target port, which is this frontend's, and reads vLLM's gauges there (llm-d router ``core-metrics-extractor``,
engine type ``vllm``: ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``); the Inference Gateway dashboards read vLLM's latency
histograms and request counters. Two sources make up the page:

- **The engine's gauges** live in the Triton model (``serve/metrics.py``, model setting ``vllm_metrics``, on by
  default) and are published on Triton's metrics port. Each scrape of ``/metrics`` reads Triton's page over
  loopback (``--triton-metrics-url``, default ``http://localhost:8002/metrics``) and repeats every ``vllm:``
  family found there unchanged, so the picker sees the engine's own values with one scrape of one port. When
  Triton cannot be read, those families are left out (the picker then treats the endpoint's metrics as stale)
  and ``llm_frontend_engine_metrics_up`` reads 0.
- **Latency histograms and request counters measured here**, at the frontend, per completion of a request
  (vLLM's names, buckets and ``model_name`` label; vLLM ``vllm/v1/metrics/loggers.py`` and ``buckets.py`` of
  0.32.0): ``vllm:time_to_first_token_seconds`` (request start to its first token), ``vllm:inter_token_latency_seconds``
  (between consecutive responses carrying tokens, once per token: a later response of k tokens after a gap of t
  seconds observes t / k k times; tokens that arrive with the first one have no gap to measure), ``vllm:e2e_request_latency_seconds`` (request start to its last token),
  ``vllm:request_success_total`` by ``finished_reason``, ``vllm:prompt_tokens_total`` and
  ``vllm:generation_tokens_total``. They include the frontend's own time (gRPC, detokenized text), which is
  what a client of this port sees.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from openai_frontend.triton_stream import Delta, TritonLLM

DEFAULT_TRITON_METRICS_URL = "http://localhost:8002/metrics"
SCRAPE_TIMEOUT_S = 2.0  # a scrape of Triton's page; the picker scrapes every 50 ms to 1 s
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
UP = "llm_frontend_engine_metrics_up"
UP_HELP = "1 when this scrape read the engine's gauges from Triton's metrics port, else 0"

# vLLM 0.32.0 vllm/v1/metrics/buckets.py
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                               7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineMetricsCollector:
    """A prometheus_client collector that repeats the ``vllm:`` families of Triton's metrics page."""

    def __init__(self, url: str) -> None:
        self.url = url

    def collect(self) -> Iterator[Metric]:
        try:
            with urllib.request.urlopen(self.url, timeout=SCRAPE_TIMEOUT_S) as response:
                text = response.read().decode("utf-8")
        except (urllib.error.URLError, OSError):
            yield GaugeMetricFamily(UP, UP_HELP, value=0)
            return
        yield GaugeMetricFamily(UP, UP_HELP, value=1)
        for family in text_string_to_metric_families(text):
            if family.name.startswith("vllm:"):
                yield family


FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")  # the engine's (backend.outputs)


class FrontendMetrics:
    """The registry behind ``/metrics`` and the per-request measurements (see the module docstring).

    Args:
        triton_metrics_url: Triton's metrics page (``http://host:port/metrics``), read on every scrape; None
            to publish only what the frontend measures.
    """

    def __init__(self, triton_metrics_url: str | None = DEFAULT_TRITON_METRICS_URL) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TIME_TO_FIRST_TOKEN_BUCKETS, registry=self.registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=INTER_TOKEN_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=self.registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=self.registry)
        if triton_metrics_url:
            self.registry.register(EngineMetricsCollector(triton_metrics_url))

    def declare(self, model: str) -> None:
        """Creates every series of ``model`` at 0 (each finish reason too, as vLLM does at start), so that a
        rate over a scrape range that starts after a restart counts the first requests."""
        for metric in (self.ttft, self.itl, self.e2e, self.prompt_tokens, self.generation_tokens):
            metric.labels(model)
        for reason in FINISH_REASONS:
            self.success.labels(model, reason)

    def render(self) -> bytes:
        """The Prometheus text page (blocking: reads Triton's page)."""
        return generate_latest(self.registry)

    async def measure(self, model: str, deltas: AsyncIterator[Delta]) -> AsyncIterator[Delta]:
        """Passes one request's deltas through, observing each completion (by ``Delta.index``) on the way.

        A completion that ends without a finish reason counts, when it had started, as ``error`` where Triton or
        the model failed the request (the stream raised) and as ``abort`` where the client went away (the stream
        was closed); one that had not started is not counted (vLLM counts finished requests).
        """
        start = time.monotonic()
        last: dict[int, float] = {}  # completion index -> time of its last response with tokens
        finished: set[int] = set()
        prompt_counted = False
        ended = "abort"  # how started completions without a finish reason ended: closed by the caller, unless
        try:
            async for delta in deltas:
                now = time.monotonic()
                if not prompt_counted and delta.num_input_tokens:
                    self.prompt_tokens.labels(model).inc(delta.num_input_tokens)
                    prompt_counted = True
                count = len(delta.token_ids)
                if count:
                    self.generation_tokens.labels(model).inc(count)
                    if delta.index not in last:
                        self.ttft.labels(model).observe(now - start)
                        count -= 1  # the first token has no gap before it
                    else:
                        gap = (now - last[delta.index]) / count
                        for _ in range(count):
                            self.itl.labels(model).observe(gap)
                    last[delta.index] = now
                if delta.finish_reason is not None and delta.index not in finished:
                    finished.add(delta.index)
                    self.e2e.labels(model).observe(now - start)
                    self.success.labels(model, delta.finish_reason).inc()
                yield delta
        except Exception:
            ended = "error"  # Triton or the model failed the request (GeneratorExit, a close, is not an Exception)
            raise
        finally:
            for index in last.keys() - finished:
                self.success.labels(model, ended).inc()


def install(app: FastAPI, triton: TritonLLM, triton_metrics_url: str | None) -> FrontendMetrics:
    """Adds ``GET /metrics`` to ``app`` and measures every request ``triton.generate`` streams (this instance's
    ``generate`` is wrapped, so each route that generates is measured without knowing of it)."""
    metrics = FrontendMetrics(triton_metrics_url)
    for model in triton.offered():
        metrics.declare(model)
    generate = triton.generate

    def measured(model: str, version: str, prompt: str | list[int], sampling: dict,
                 request_id: str | None = None) -> AsyncIterator[Delta]:
        return metrics.measure(model, generate(model, version, prompt, sampling, request_id))

    triton.generate = measured
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    def prometheus_metrics() -> Response:  # a sync route: FastAPI runs it in a thread (it reads Triton's page)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.include_router(router)
    app.state.metrics = metrics
    return metrics
