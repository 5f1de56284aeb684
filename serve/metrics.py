"""Prometheus metrics through Triton's Python backend (``pb_utils.MetricFamily``), on Triton's /metrics port.

The ``llm_*`` families follow vLLM's meanings. ``nv_trt_llm_kv_cache_block_metrics`` and
``nv_trt_llm_request_metrics`` repeat the same facts under the names and labels of Triton's TensorRT-LLM
backend, which Triton's ORCA load report and the Kubernetes Gateway API Inference Extension's endpoint picker
read (engine type ``triton-tensorrt-llm``: the model-server protocol, gateway-api-inference-extension
``docs/proposals/003-model-server-protocol``). With the model setting ``vllm_metrics`` true (the default), the protocol's
vLLM names are published too (``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc``, ``vllm:cache_config_info``), so a picker configured for vLLM reads them as well,
and, where speculative decoding is on (``num_speculative_tokens`` above 0; vLLM has them only then), vLLM's speculative
decoding counters (``vllm:spec_decode_num_drafts_total``, ``vllm:spec_decode_num_draft_tokens_total``,
``vllm:spec_decode_num_accepted_tokens_total``).
"""

from __future__ import annotations

import threading
import time

from backend import EngineStats, RequestMetrics

LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0]
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")
METRIC_SETTINGS = ("vllm_metrics",)  # model settings (config.pbtxt parameters) read here, not by the engine


def pop_metric_settings(settings: dict) -> dict:
    """Removes this module's settings from a model's settings and returns them as ``EngineMetrics`` keyword
    arguments: ``vllm_metrics`` (``true``/``false``, default true; an empty string means the default).

    Raises:
        ValueError: a value that is not a boolean.
    """
    options = {}
    for key in METRIC_SETTINGS:
        if key in settings:
            raw = settings.pop(key)
            text = str(raw).strip().lower()
            if isinstance(raw, bool):
                options[key] = raw
            elif isinstance(raw, str) and text in ("true", "1", "false", "0"):
                options[key] = text in ("true", "1")
            elif isinstance(raw, str) and text == "":
                continue  # the default
            else:
                raise ValueError(f"setting {key} must be true or false, got {raw!r}")
    return options


THREADS = ("llm-engine-loop", "llm-sender", "llm-cancel", "llm-intake")  # whose CPU time is published


def thread_cpu_seconds(names: tuple[str, ...] = THREADS) -> dict[str, float]:
    """CPU seconds used so far by each live thread of this process named in ``names`` (Linux thread CPU
    clocks; a name with no live thread is left out)."""
    found = {}
    for thread in threading.enumerate():
        if thread.name in names and thread.ident is not None:
            try:
                found[thread.name] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
            except (OSError, AttributeError):  # the thread just ended, or no thread CPU clocks here
                pass
    return found


class _Written:
    """A gauge or counter whose writes that would change nothing are skipped: each write is an IPC round trip
    to the server (two thread wake-ups in the stub and the server each), and on a machine whose cores the
    engine's threads fill every wake-up preempts one of them."""

    __slots__ = ("metric", "value")

    def __init__(self, metric) -> None:
        self.metric = metric
        self.value: float | None = None

    def set(self, value: float) -> None:
        if value != self.value:
            self.metric.set(value)
            self.value = value

    def increment(self, delta: float) -> None:
        if delta:
            self.metric.increment(delta)


class EngineMetrics:
    """Publishes an engine's stats; ``update`` is cheap enough to call after every batch of outputs.

    Args:
        vllm_metrics: also publish the model-server protocol's vLLM-named gauges, labelled ``model_name``
            (vLLM's label) and ``version``.
        speculative: the engine decodes speculatively: with ``vllm_metrics``, publish vLLM's counters of it too.
    """

    def __init__(self, pb_utils, model: str, version: str, vllm_metrics: bool = True,
                 speculative: bool = False) -> None:
        labels = {"model": model, "version": version}
        self._families = []  # a Metric is only valid while its MetricFamily object lives

        def family(name, description, kind):
            self._families.append(pb_utils.MetricFamily(name, description, kind))
            return self._families[-1]

        family.GAUGE, family.COUNTER = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        family.HISTOGRAM = pb_utils.MetricFamily.HISTOGRAM

        def gauge(name, description, **extra):
            return _Written(family(name, description, family.GAUGE).Metric(labels={**labels, **extra}))

        def counter(name, description, **extra):
            return _Written(family(name, description, family.COUNTER).Metric(labels={**labels, **extra}))

        self.running = gauge("llm_num_requests_running", "Requests in the running batch")
        self.waiting = gauge("llm_num_requests_waiting", "Requests waiting to be scheduled")
        self.blocks_used = gauge("llm_kv_cache_blocks_used", "KV cache blocks in use")
        self.blocks_free = gauge("llm_kv_cache_blocks_free", "KV cache blocks free")
        self.blocks_total = gauge("llm_kv_cache_blocks_total", "KV cache blocks in the pool")
        self.usage = gauge("llm_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0..1)")
        self.prompt_tokens = counter("llm_prompt_tokens_total", "Prompt tokens, prefix-cache hits included")
        self.generation_tokens = counter("llm_generation_tokens_total", "Output tokens generated")
        self.rejected = counter("llm_request_rejected_total",
                                "Requests refused with UNAVAILABLE because the waiting queue was full")
        self.preemptions = counter("llm_num_preemptions_total", "Requests preempted (recompute)")
        self.prefix_queries = counter("llm_prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache")
        self.prefix_hits = counter("llm_prefix_cache_hits_total", "Prompt tokens found in the prefix cache")
        finished = family("llm_request_finished_total", "Finished completions (each of an n > 1 request counts) by finish_reason", family.COUNTER)
        self.finished = {r: _Written(finished.Metric(labels={**labels, "finish_reason": r})) for r in FINISH_REASONS}

        def histogram(name, description):
            hist = family(name, description, family.HISTOGRAM)
            return hist.Metric(labels=labels, buckets=LATENCY_BUCKETS)

        self.ttft = histogram("llm_time_to_first_token_seconds", "Time to first token (TTFT)")
        self.tpot = histogram("llm_time_per_output_token_seconds", "Mean time per output token after the first")
        self.e2e = histogram("llm_e2e_request_latency_seconds", "End-to-end request latency")

        kv_family = family("nv_trt_llm_kv_cache_block_metrics", "KV cache block metrics (TensorRT-LLM names)",
                           family.GAUGE)
        self.trt_kv = {t: _Written(kv_family.Metric(labels={**labels, "kv_cache_block_type": t}))
                       for t in ("max", "free", "used", "tokens_per", "fraction")}
        request_family = family("nv_trt_llm_request_metrics", "Request metrics (TensorRT-LLM names)", family.GAUGE)
        self.trt_requests = {t: _Written(request_family.Metric(labels={**labels, "request_type": t}))
                             for t in ("active", "max", "scheduled", "context", "waiting")}
        self.vllm = None
        if vllm_metrics:
            vllm_labels = {"model_name": model, "version": version}
            self.vllm = {name: _Written(family(name, description, family.GAUGE).Metric(labels=vllm_labels))
                         for name, description in (
                             ("vllm:num_requests_waiting", "Requests waiting to be scheduled (vLLM name)"),
                             ("vllm:num_requests_running", "Requests in the running batch (vLLM name)"),
                             ("vllm:kv_cache_usage_perc", "KV cache usage, 0..1 (1 = 100%; vLLM name)"))}
            self._cache_config_family = family("vllm:cache_config_info", "KV cache configuration (vLLM name)",
                                               family.GAUGE)
            self._cache_config = None  # set once the pool's size is known (the first update)
            self._vllm_labels = vllm_labels
            # Speculative decoding (vLLM's counters; prometheus_client, which vLLM uses, adds "_total"):
            # decodes with drafts, draft tokens verified, and draft tokens accepted.
            self.vllm_spec = {field: _Written(family(f"vllm:{field}_total", description, family.COUNTER)
                                              .Metric(labels=vllm_labels))
                              for field, description in (
                                  ("spec_decode_num_drafts", "Number of spec decoding drafts."),
                                  ("spec_decode_num_draft_tokens", "Number of draft tokens."),
                                  ("spec_decode_num_accepted_tokens", "Number of accepted tokens."))
                              if speculative}
        # Where the serving path's time goes (benchmarks.serving_path reads them): engine steps, responses
        # sent, and the CPU time of the engine loop and of each adapter thread.
        self.steps = counter("llm_engine_steps_total", "Engine steps that computed something")
        self.responses = counter("llm_responses_total",
                                 "Responses sent to clients (a response may carry several tokens)")
        cpu = family("llm_thread_cpu_seconds_total", "CPU seconds used by the engine loop and the adapter's threads",
                     family.COUNTER)
        self.thread_cpu = {name: _Written(cpu.Metric(labels={**labels, "thread": name})) for name in THREADS}
        self._last_cpu: dict[str, float] = {}
        self._last_responses = 0
        self._last: EngineStats | None = None

    def update(self, stats: EngineStats, num_responses: int = 0) -> None:
        """Publishes what changed since the last call; nothing at all when idle (every metric write is an IPC
        round trip to the server, and a stub blocked in one cannot exit if the server dies).

        Args:
            num_responses: responses sent since start (a total, like the engine's counters).
        """
        if stats == self._last and num_responses == self._last_responses:
            return
        self.responses.increment(num_responses - self._last_responses)
        self._last_responses = num_responses
        for name, seconds in thread_cpu_seconds().items():
            self.thread_cpu[name].increment(seconds - self._last_cpu.get(name, 0.0))
            self._last_cpu[name] = seconds
        if stats == self._last:
            return
        kv = stats.kv
        last = self._last
        # Counters first, gauges after: each write is seen by a scrape at once, and a scraper that reads
        # "0 running, 0 waiting" (the load test's wait for idle) must also read the counts of what finished.
        self.prompt_tokens.increment(stats.prompt_tokens - (last.prompt_tokens if last else 0))
        self.generation_tokens.increment(stats.generation_tokens - (last.generation_tokens if last else 0))
        self.preemptions.increment(stats.num_preemptions - (last.num_preemptions if last else 0))
        self.steps.increment(stats.num_steps - (last.num_steps if last else 0))
        self.rejected.increment(stats.num_rejected - (last.num_rejected if last else 0))
        self.prefix_queries.increment(kv.prefix_cache_queries - (last.kv.prefix_cache_queries if last else 0))
        self.prefix_hits.increment(kv.prefix_cache_hits - (last.kv.prefix_cache_hits if last else 0))
        for reason, metric in self.finished.items():
            metric.increment(stats.finished.get(reason, 0) - (last.finished.get(reason, 0) if last else 0))
        if self.vllm is not None:
            for field, metric in self.vllm_spec.items():
                metric.increment(getattr(stats, field) - (getattr(last, field) if last else 0))
        self._last = stats

        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.blocks_used.set(kv.used_blocks)
        self.blocks_free.set(kv.free_blocks)
        self.blocks_total.set(kv.num_blocks)
        self.usage.set(kv.usage)
        for key, value in (("max", kv.num_blocks), ("free", kv.free_blocks), ("used", kv.used_blocks),
                           ("tokens_per", kv.tokens_per_block), ("fraction", kv.usage)):
            self.trt_kv[key].set(value)
        # The picker reads "scheduled" as the requests being served: those of the last step still running.
        active = stats.num_running
        for key, value in (("active", active), ("max", stats.max_num_seqs),
                           ("scheduled", min(stats.last_step_num_scheduled, active)),
                           ("context", min(stats.last_step_num_prefills, active)),
                           ("waiting", stats.num_waiting)):
            self.trt_requests[key].set(value)
        if self.vllm is not None:
            self.vllm["vllm:num_requests_waiting"].set(stats.num_waiting)
            self.vllm["vllm:num_requests_running"].set(stats.num_running)
            self.vllm["vllm:kv_cache_usage_perc"].set(kv.usage)
            if self._cache_config is None:  # vLLM's info gauge: the configuration in labels, value 1
                self._cache_config = self._cache_config_family.Metric(labels={
                    **self._vllm_labels, "block_size": str(kv.tokens_per_block), "num_gpu_blocks": str(kv.num_blocks)})
                self._cache_config.set(1)

    def observe_finished(self, metrics: RequestMetrics) -> None:
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if metrics.time_per_output_token is not None:
            self.tpot.observe(metrics.time_per_output_token)
        self.e2e.observe(metrics.e2e_latency)
