"""Benchmark settings: one dataclass, plus the ``--quick`` preset."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

from backend.config import QUANTIZATIONS

SYSTEMS = ("naive", "static", "generate_batch", "engine", "server", "vllm", "llamacpp", "ceiling",
           "prefix_cache")
MODES = ("offline", "online", "concurrent")
# The peers run only when asked for (`make bench-peers`): vLLM's first use installs it into a venv of its own,
# llama.cpp's compiles it (10-20 minutes on 2 cores).
PEER_SYSTEMS = ("vllm", "llamacpp")
# The transformers baselines: they run torch on the thread that calls them (benchmarks.runner runs them on threads
# of their own, so that no OpenMP pool is left beside our engine's).
HF_BASELINES = ("naive", "static", "generate_batch")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in PEER_SYSTEMS)
LLAMACPP_QUANTS = ("q8_0", "q4_0")
# The HF baselines run one request or one batch at a time; a closed loop of N in flight is a serving workload.
BASELINE_MODES = ("offline", "online")


@dataclass
class BenchConfig:
    """What to run and on what workload.

    Attributes:
        num_requests: requests in the workload.
        seed: fixes prompts, output lengths and arrival times.
        rate: online arrival rate, requests per second (Poisson process).
        concurrency: requests in flight in the ``concurrent`` mode (a closed loop: each request is sent when an
            earlier one has finished, as a fixed pool of clients would; vLLM's benchmark calls this
            ``--max-concurrency``).
        systems / modes: which of :data:`SYSTEMS` and :data:`MODES` to run (by default all but ``llamacpp``).
        model: a Hugging Face directory; None is the default SmolLM2-135M-Instruct (the server always serves
            the default, so it is skipped for any other model).
        threads: torch intra-op threads, the same for every system in this process (and vLLM's OpenMP threads,
            llama-server's ``-t``/``-tb``).
        dtype: of every system's weights and KV cache; ``auto`` as the engine resolves it (bf16 on CPUs with
            AVX512-BF16, AMX, or AVX2 without AVX-512; else fp32).
        prompt_tokens: (min, max) prompt length in tokens, drawn log-uniformly (long-tailed).
        short_output / long_output: (min, max) output tokens, uniform; ``long_share`` of requests are long.
        static_batch: batch size of the static-batching baseline.
        naive_max_requests / static_max_requests: those baselines run only the first this-many requests (by
            arrival; None = all): their rate does not depend on how many follow (one request, or one batch of
            ``static_batch``, at a time), and all of them would take an hour.
        online_max_requests: every system runs only the first this-many requests online and concurrent (None = all).
        max_num_seqs / max_num_batched_tokens / block_size / kv_cache_bytes: the batching limits and KV pool
            (bytes) given to our engine and, translated, to transformers' continuous batching; they match the
            server's model ``llm`` version 2 (its KV pool is 20% of free memory, at most 4 GiB: 4 GiB here).
        max_step_ms: our engine's and server's step time budget (0: none, the library default, and vLLM has none;
            the served model's ``config.pbtxt`` sets 50; ``benchmarks.step_budget`` compares them).
        ceiling_steps: timed decode steps of the forward-only ceiling.
        stream_interval: our engine's and server's ``stream_interval`` (1: every token streamed on its own;
            vLLM is run with its default, 1).
        served_offline_stream: the server's offline run streams every token as the online runs do; by default
            it asks for whole answers (``stream`` false: one response per request), as a batch client would and
            as vLLM's offline ``LLM.generate`` returns them.
        rounds: runs of every selected system, in turn (engine, vllm, engine, vllm, ...): a machine whose speed
            drifts between minutes (shared memory bandwidth) moves neighbouring runs together, so the reported
            ratios are each round's and their median.
        quantization: our engine's and server's ``quantization`` (``none``, ``int8``: weight-only int8 linears, or
            ``w8a8``: int8 weights and activations; ``backend.config.EngineConfig``); the other systems run the model
            as loaded.
        shape: a model shape with random weights (``benchmarks.shapes``) instead of ``model``.
        limits: measure the machine's memory bandwidth and GEMM peak and report the model's bounds
            (``benchmarks.limits``); on by default with ``shape``.
        llamacpp_quant: llama.cpp runs its own quantized weights (``q8_0`` or ``q4_0``, made by ``llama-quantize``
            from the ``dtype`` GGUF) instead of ``dtype`` ones; None: the same weights as the other systems.
        output_dir: where the JSON, markdown and PNGs go.
        progress: show tqdm progress bars.
    """

    num_requests: int = 256
    seed: int = 0
    rate: float = 1.0
    concurrency: int = 16
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    modes: tuple[str, ...] = MODES
    model: str | None = None
    threads: int = field(default_factory=torch.get_num_threads)
    dtype: str = "auto"
    prompt_tokens: tuple[int, int] = (16, 256)
    short_output: tuple[int, int] = (16, 64)
    long_output: tuple[int, int] = (256, 512)
    long_share: float = 0.2
    static_batch: int = 16
    naive_max_requests: int | None = 8
    static_max_requests: int | None = 64
    online_max_requests: int | None = 64
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    kv_cache_bytes: int = 4 << 30
    max_step_ms: float = 0.0
    ceiling_steps: int = 16
    stream_interval: int = 1
    served_offline_stream: bool = False
    rounds: int = 1
    quantization: str = "none"
    shape: str | None = None
    limits: bool = False
    llamacpp_quant: str | None = None
    output_dir: str = "results/bench"
    quick: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        unknown = set(self.systems) - set(SYSTEMS)
        if unknown:
            raise ValueError(f"unknown system(s) {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
        unknown = set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}")
        if not self.systems or not self.modes:
            raise ValueError("choose at least one system and one mode")
        for name in ("num_requests", "threads", "static_batch", "max_num_seqs", "max_num_batched_tokens",
                     "block_size", "kv_cache_bytes", "ceiling_steps", "stream_interval", "concurrency", "rounds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not (0 <= self.max_step_ms < math.inf):
            raise ValueError(f"max_step_ms must be a non-negative number of milliseconds, got {self.max_step_ms}")
        if self.llamacpp_quant not in (None, *LLAMACPP_QUANTS):
            raise ValueError(f"llamacpp_quant must be one of {', '.join(LLAMACPP_QUANTS)} (or None), "
                             f"got {self.llamacpp_quant!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if not (0 < self.rate < math.inf):
            raise ValueError(f"rate must be a positive finite number of requests/s, got {self.rate}")
        for name in ("naive_max_requests", "static_max_requests", "online_max_requests"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive (or None: all requests), got {getattr(self, name)}")

    def max_requests(self, system: str, mode: str) -> int | None:
        """How many requests (the first, by arrival) ``system`` runs in ``mode``; None = all."""
        limits = [{"naive": self.naive_max_requests, "static": self.static_max_requests}.get(system),
                  self.online_max_requests if mode != "offline" else None]
        return min((n for n in limits if n), default=None)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


# --quick: a small workload with shorter outputs, so the whole run fits in about 3 minutes on 2 cores.
# The naive baseline runs a subset (its rate is a rate: not extrapolated, the subset is stated); the others all 12.
QUICK = dict(num_requests=12, rate=3.0, concurrency=4, prompt_tokens=(16, 128), short_output=(8, 32),
             long_output=(48, 96), naive_max_requests=4, static_max_requests=None, online_max_requests=None,
             ceiling_steps=6)
