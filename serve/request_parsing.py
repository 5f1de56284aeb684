"""Triton request -> engine request: the inputs and parameters Triton's vLLM and TensorRT-LLM backends use.

Values may arrive typed (input tensors, JSON numbers) or as strings (``{"max_tokens": "100"}``, which
Triton's vLLM backend sample client and GenAI-Perf's ``--backend vllm`` send in ``sampling_parameters``
and as request parameters): numeric and boolean strings are parsed, anything else is rejected naming the
field. TensorRT-LLM backend inputs are mapped onto the same engine parameters (``TRTLLM_INPUTS``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from backend import SamplingParams
from backend.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# Optional inputs that map one to one onto SamplingParams fields, with the Python type each must become.
SAMPLING_INPUTS: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int,
    "ignore_eos": bool, "logprobs": int, "n": int,
}
FLAG_INPUTS = ("stream", "exclude_input_in_output")
# Triton's vLLM backend's optional BOOL inputs: each asks for the output of the same name without "return_"
# (ParsedRequest.returns). Their outputs follow vllm_backend's meaning (see model.py and docs/triton-api.md).
RETURN_INPUTS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
                 "return_num_output_tokens")
LIST_INPUTS = ("stop", "stop_token_ids", "bad_words")  # lists (STRING [-1] tensors, JSON arrays)

# TensorRT-LLM backend inputs (names of its tensorrt_llm, tensorrt_llm_bls and ensemble models), with the
# Python type each must become. Mapped in _apply_trtllm_inputs.
TRTLLM_INPUTS: dict[str, type] = {
    "min_length": int, "runtime_top_k": int, "runtime_top_p": float, "random_seed": int,
    "num_return_sequences": int, "end_id": int, "pad_id": int, "beam_width": int, "return_log_probs": bool,
    "len_penalty": float, "length_penalty": float, "early_stopping": bool,
}
TRTLLM_LIST_INPUTS = ("stop_words", "bad_words")
# Scheduling inputs (not sampling): ParsedRequest.priority (lower first) and .timeout_ms (a deadline).
SCHEDULING_INPUTS: dict[str, type] = {"priority": int, "timeout_ms": int}
# Fields that are not inputs but, like them, may come as strings in sampling_parameters or as request parameters
# (``{"prompt_logprobs": "1"}``), with the Python type each must become: SamplingParams fields, and best_of (a vLLM
# request field, checked against n and then dropped).
OTHER_SCALAR_FIELDS: dict[str, type] = {"prompt_logprobs": int, "truncate_prompt_tokens": int,
                                        "skip_special_tokens": bool, "include_stop_str_in_output": bool,
                                        "best_of": int}
# String settings read like sampling values: vLLM's cache_salt, and the fair-queuing key of the scheduler
# (requests with the same key take one turn together in admission).
STRING_SETTINGS = ("cache_salt", "fairness_key")
# Structured outputs: vLLM's sampling-parameter names (an object or its JSON text; guided_decoding is its
# older name, which Triton's OpenAI frontend sends for tool calls), and TensorRT-LLM's two STRING inputs.
STRUCTURED_OUTPUTS_NAMES = ("structured_outputs", "guided_decoding")
TRTLLM_GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}

# Limits checked before parsing (cheap checks before expensive work).
# What sampling_parameters (or the request's parameters) may hold besides SamplingParams' own fields: taken out
# before it is built, so named here for the error that lists the known keys.
REQUEST_LEVEL_NAMES = (*FLAG_INPUTS, *SCHEDULING_INPUTS, *STRING_SETTINGS, *STRUCTURED_OUTPUTS_NAMES, *TRTLLM_INPUTS,
                       *TRTLLM_LIST_INPUTS, "best_of", "top_logprobs")
# Above what the fields' own limits allow together (a JSON schema of up to 128 KiB, the most
# structured_outputs_max_schema_bytes may be, which JSON's \u escapes can triple; 1024 logit_bias entries; 32 stop
# strings), so that those limits, which name their field, decide. Checking and decoding 512 KiB holds the
# stub's GIL for about 26 ms on a 2-core Zen 3 with both cores busy (the depth scan most of it).
MAX_SAMPLING_PARAMETERS_BYTES = 512 * 1024
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
# Settings whose value is an object or a list: a request parameter (a string, number or boolean in Triton) carries
# it as JSON text, e.g. "parameters": {"logit_bias": "{\"30\": 100}"}.
JSON_PARAMETER_FIELDS = ("logit_bias", "allowed_token_ids", "stop_token_ids")
# Settings that hold strings: as a request parameter, a JSON list's text (``'["a", "b"]'``) is that list, and any
# other string (``"[END]"`` included, which is not JSON) the one string.
STRING_LIST_FIELDS = ("stop", "stop_words", "bad_words")
MAX_JSON_DEPTH = 32  # {"stop": ["..."]} is 2 deep; a JSON schema in structured_outputs adds its own depth
MAX_REQUEST_ID_BYTES = 256
INT32_MAX = 2**31 - 1
# Triton's HTTP endpoint converts a JSON number over INT32_MAX sent to an INT32 input modulo 2**32, so values in
# (INT32_MAX, 2**32) arrive as [-2**31, -1]. A value this far below zero is named as such a wrap in the error;
# a small negative one (-1, sent as is, as over gRPC) is not.
WRAPPED_BELOW = 2**24
INT32_INPUTS = ("max_tokens", "min_tokens", "top_k", "n", "min_length", "end_id", "pad_id", "beam_width",
                "num_return_sequences", "runtime_top_k", "priority", "timeout_ms")


@dataclass
class ParsedRequest:
    """One request as the engine takes it.

    Attributes:
        returns: the vLLM backend's ``return_*`` inputs that were true (``return_cumulative_logprob`` also
            turns on the sampled tokens' logprobs, ``logprobs`` 0, when none were asked for).
        logprobs_asked: the client asked for logprobs (``logprobs`` or an alias), as opposed to the engine
            computing them only for ``return_cumulative_logprob``: only then are the logprobs outputs sent.
        priority: lower is scheduled first (vLLM's priority policy); 0 when not given.
        timeout_ms: the request's deadline, in milliseconds from its arrival; None for none.
    """

    prompt: str | list[int]  # text_input, or the input_ids tensor's token ids
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool
    priority: int = 0
    timeout_ms: int | None = None
    returns: frozenset[str] = frozenset()  # the RETURN_INPUTS set true
    cache_salt: str | None = None  # vLLM's: prefix-cache sharing only among requests with the same salt
    fairness_key: str | None = None  # requests with the same key take one turn together in admission
    logprobs_asked: bool = False


def check_request_id(request_id: str) -> str:
    """A client's request id, which Triton echoes in every response and the model in its logs.

    Raises:
        ValueError: longer than ``MAX_REQUEST_ID_BYTES`` (the message gives its size, not the id).
    """
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if size > MAX_REQUEST_ID_BYTES:
        raise ValueError(f"request id is {size} bytes; at most {MAX_REQUEST_ID_BYTES}")
    return request_id


def parse_request(inputs: dict[str, np.ndarray], parameters: dict[str, object],
                  triton_timeout_us: int = 0, vocab_size: int | None = None,
                  check: Callable[[ParsedRequest], None] | None = None) -> ParsedRequest:
    """Builds the engine's view of one Triton request.

    Sampling values are read, later ones winning, from the request ``parameters`` (Triton's generate
    extension puts a ``"parameters": {...}`` object there), then the ``sampling_parameters`` JSON input,
    then the named input tensors (``max_tokens``, ``temperature``, ..., and the TensorRT-LLM names).
    ``priority`` and ``timeout_ms`` are read the same way.

    Args:
        inputs: input name -> the tensor's numpy array (STRING inputs as ``object`` arrays of bytes).
        parameters: the request's parameters, decoded from JSON.
        triton_timeout_us: Triton's own request timeout (``request.timeout()``, microseconds; 0 for none),
            the deadline when no ``timeout_ms`` is given.
        vocab_size: the model's vocabulary size: ``end_id`` outside it is refused under that name (other token
            ids are checked by the engine).
        check: the engine's own checks of a request (``LLMEngine.check_request``), run on the request and, for
            each value that a later source replaced, on a request with that setting alone: such a value must be
            valid on its own, never dropped unread.

    Raises:
        ValueError: a message naming the field: neither or both of ``text_input`` and ``input_ids``, bad or
            oversized JSON, a value of the
            wrong type or out of range (quoting the value sent), ``beam_width`` other than 1, a
            ``timeout_ms`` that is not positive; any of these, or what ``check`` raises, for a value that a
            later source replaced (saying so); a constraint (``structured_outputs``) sent in two sources with
            different values.
    """
    prompt = _prompt(inputs)

    scalars = {**SAMPLING_INPUTS, **TRTLLM_INPUTS, **SCHEDULING_INPUTS, **OTHER_SCALAR_FIELDS}
    lists = (*LIST_INPUTS, *TRTLLM_LIST_INPUTS)
    values: dict[str, object] = {}
    for key, value in parameters.items():  # keys that name no setting are Triton's own (or a client's): left alone
        if (key in scalars or key in FLAG_INPUTS or key in lists or key in STRUCTURED_OUTPUTS_NAMES
                or key in STRING_SETTINGS or key in SAMPLING_FIELDS or key in REQUEST_LEVEL_NAMES):
            values[key] = (_json_parameter(key, value) if key in JSON_PARAMETER_FIELDS
                           else _string_list_parameter(key, value) if key in STRING_LIST_FIELDS else value)
    values = _vllm_request_fields(values)
    overridden: list[tuple[str, object]] = []  # values that a later source replaces: checked all the same
    if "sampling_parameters" in inputs:
        fields = _vllm_request_fields(_sampling_parameters(_first(inputs["sampling_parameters"])))
        overridden += [(name, values[name]) for name in fields if name in values]
        values.update(fields)
    returns = frozenset(name for name in RETURN_INPUTS
                        if name in inputs and inputs[name].size and _flag(_first(inputs[name]).item(), name))
    for name in (*scalars, *FLAG_INPUTS):
        if name in inputs and inputs[name].size:
            if name in values:
                overridden.append((name, values[name]))
            values[name] = _first(inputs[name]).item()
    for name in STRING_LIST_FIELDS:
        if name in inputs:
            if name in values:
                overridden.append((name, values[name]))
            values[name] = [_text(name, s) for s in inputs[name].reshape(-1)]
    parsed = _parsed(prompt, dict(values), inputs, returns, scalars, triton_timeout_us, vocab_size)
    if overridden and check is not None:
        check(parsed)  # the request's own faults first, named as such
    for name, value in overridden:  # each replaced value parsed and checked as the only setting of a request
        if value is None:  # not set
            continue
        if name in STRUCTURED_OUTPUTS_NAMES:
            if _decoded(value) != _decoded(values[name]):
                raise ValueError(f"{name} is sent in two sources with different constraints; send one")
            continue
        try:
            replaced = _parsed(prompt, {name: value}, {}, frozenset(), scalars, triton_timeout_us, vocab_size)
            if check is not None:
                check(replaced)
        except ValueError as exc:
            raise ValueError(f"{exc} (where a later source, sampling_parameters or the {name} input, replaces "
                             f"it)") from None
    return parsed


def _decoded(value: object) -> object:
    """A constraint as sent: JSON text (a request parameter) decoded where it is JSON, else as it is."""
    if isinstance(value, str):
        try:
            return _bounded_json("a constraint", value)
        except ValueError:  # not JSON, or past the bounds: compared as text
            return value
    return value


def _parsed(prompt: str | list[int], values: dict[str, object], inputs: dict[str, np.ndarray],
            returns: frozenset[str], scalars: dict[str, type], triton_timeout_us: int,
            vocab_size: int | None) -> ParsedRequest:
    """The request of ``values`` (every source's values merged; consumed), as :func:`parse_request` describes."""
    stream = _flag(values.pop("stream", False), "stream")
    exclude = _flag(values.pop("exclude_input_in_output", False), "exclude_input_in_output")
    for name, kind in scalars.items():
        if name in values and values[name] is not None:
            values[name] = _coerce(name, values[name], kind)
    for name in INT32_INPUTS:
        _check_int32(name, values.get(name))
    for name in STRING_LIST_FIELDS:
        if isinstance(values.get(name), str):
            values[name] = [values[name]]
    if isinstance(values.get("logit_bias"), dict):  # {"5": "1"}: biases may be strings like any number
        values["logit_bias"] = {k: _coerce("logit_bias", v, float) for k, v in values["logit_bias"].items()}
    cache_salt, fairness_key = (values.pop(name, None) for name in STRING_SETTINGS)
    for name, value in zip(STRING_SETTINGS, (cache_salt, fairness_key)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"{name} must be a string, got {_clip(value)}")
    priority = values.pop("priority", None)
    timeout_ms = values.pop("timeout_ms", None)
    for name, value in (("priority", priority), ("timeout_ms", timeout_ms)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"{name} must be an integer, got {_clip(value)}")
    priority = 0 if priority is None else priority
    if timeout_ms is not None and timeout_ms <= 0:
        raise ValueError(f"timeout_ms must be a positive number of milliseconds, got {timeout_ms}")
    if timeout_ms is None and triton_timeout_us > 0:
        timeout_ms = max(1, triton_timeout_us // 1000)
    _apply_structured_outputs(values, inputs)
    aliases = _apply_trtllm_inputs(values, vocab_size)
    best_of = values.pop("best_of", None)  # vLLM's: kept only where it asks for nothing but the n completions
    if best_of is not None and best_of not in (1, values.get("n", 1)):
        raise ValueError(f"best_of must be 1 or n (ranking candidates is not supported), got {_clip(best_of)}")
    logprobs_asked = values.get("logprobs") is not None
    if "return_cumulative_logprob" in returns and not logprobs_asked:
        values["logprobs"] = 0
    try:
        params = SamplingParams.from_dict(values, REQUEST_LEVEL_NAMES)
    except ValueError as exc:
        message = str(exc)
        for alias, canonical in aliases.items():  # name the field the client sent
            if message.startswith(f"{canonical} "):
                message += f" (sent as {alias})"
        for name in INT32_INPUTS:
            if message.startswith(f"{name} ") and name in inputs and _first(inputs[name]).item() <= -WRAPPED_BELOW:
                message += (f"; if a JSON number over {INT32_MAX} was sent to the INT32 {name} input over HTTP, "
                            f"Triton's conversion wrapped it around to this before the model saw it")
        raise ValueError(message) from None
    return ParsedRequest(prompt, params, stream, exclude, priority, timeout_ms, returns, cache_salt, fairness_key,
                         logprobs_asked)


def _json_parameter(name: str, value: object) -> object:
    """A request parameter's JSON text (an object or a list) decoded (:func:`_bounded_json`); any other value as
    it is."""
    if not isinstance(value, str) or not value.lstrip().startswith(("{", "[")):
        return value
    return _bounded_json(f"the {name} parameter", value)


def _string_list_parameter(name: str, value: object) -> object:
    """A request parameter of a string-list setting: the list when its text is a JSON list, else as it is."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            decoded = _bounded_json(f"the {name} parameter", value)
        except ValueError:  # not JSON (or over the limits): the string itself, checked as one stop string
            return value
        if isinstance(decoded, list):
            return decoded
    return value


def _check_int32(name: str, value: object) -> None:
    """A request parameter or JSON value can hold more than the INT32 input of the same name could: refused.

    Raises:
        ValueError: ``value`` is an int outside INT32's range.
    """
    if isinstance(value, int) and not isinstance(value, bool) and not -INT32_MAX - 1 <= value <= INT32_MAX:
        raise ValueError(f"{name} is {value}, beyond the INT32 range of the {name} input (max {INT32_MAX})")


def _prompt(inputs: dict[str, np.ndarray]) -> str | list[int]:
    """The prompt: ``text_input`` (text), or ``input_ids`` (token ids, as TensorRT-LLM's input of that name and
    vLLM's ``prompt_token_ids``), exactly one of them; ids are range-checked by the engine."""
    has_text = "text_input" in inputs and inputs["text_input"].size > 0
    has_ids = "input_ids" in inputs and inputs["input_ids"].size > 0
    if has_text == has_ids:
        raise ValueError("send the prompt as text_input or as input_ids (token ids), exactly one of them")
    if has_text:
        return _text("text_input", _first(inputs["text_input"]))
    ids = inputs["input_ids"]
    if ids.dtype.kind not in "iu":
        raise ValueError(f"input_ids must be integers, got {ids.dtype}")
    return [int(t) for t in ids.reshape(-1)]


def _vllm_request_fields(values: dict[str, object]) -> dict[str, object]:
    """OpenAI request fields that Triton's OpenAI frontend (``--backend vllm``) passes through in
    ``sampling_parameters``, as the engine's fields: chat's ``logprobs`` (a boolean) with ``top_logprobs``
    becomes ``logprobs`` (a count, or None). (``best_of`` is checked against ``n`` once every source is read.)
    """
    values = dict(values)
    top_logprobs = values.pop("top_logprobs", None)
    if isinstance(values.get("logprobs"), bool):
        values["logprobs"] = (top_logprobs or 0) if values["logprobs"] else None
    return values


def _apply_structured_outputs(values: dict[str, object], inputs: dict[str, np.ndarray]) -> None:
    """Puts the request's output constraint, however it was sent, in ``values["structured_outputs"]``.

    Accepted: ``structured_outputs`` (vLLM) or ``guided_decoding`` (its former name), each an object or its
    JSON text, in ``sampling_parameters`` or the request parameters; or TensorRT-LLM's
    ``guided_decoding_guide_type`` (``json``, ``json_schema``, ``regex``, ``ebnf_grammar``) with
    ``guided_decoding_guide`` (the schema, regex or grammar) inputs.

    Raises:
        ValueError: two of them at once, an unknown guide type, or a guide type without a guide.
    """
    given = [name for name in STRUCTURED_OUTPUTS_NAMES if values.get(name) is not None]
    guide_type = _first(inputs["guided_decoding_guide_type"]) if "guided_decoding_guide_type" in inputs else None
    if guide_type is None and "guided_decoding_guide" in inputs and inputs["guided_decoding_guide"].size:
        raise ValueError(f"guided_decoding_guide needs guided_decoding_guide_type ({', '.join(TRTLLM_GUIDE_TYPES)})")
    if guide_type is not None:
        guide_type = _text("guided_decoding_guide_type", guide_type)
        if guide_type not in TRTLLM_GUIDE_TYPES:
            raise ValueError(f"guided_decoding_guide_type must be one of {', '.join(TRTLLM_GUIDE_TYPES)}, "
                             f"got {_clip(guide_type)}")
        kind = TRTLLM_GUIDE_TYPES[guide_type]
        if kind == "json_object":
            values["guided_decoding_guide_type"] = {"json_object": True}
        elif "guided_decoding_guide" not in inputs or not inputs["guided_decoding_guide"].size:
            raise ValueError(f"guided_decoding_guide_type {guide_type} needs guided_decoding_guide")
        else:
            values["guided_decoding_guide_type"] = {kind: _text("guided_decoding_guide",
                                                                _first(inputs["guided_decoding_guide"]))}
        given.append("guided_decoding_guide_type")
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; send one")
    constraint = values.pop(given[0]) if given else None
    for name in STRUCTURED_OUTPUTS_NAMES:
        values.pop(name, None)
    if constraint is not None:
        values["structured_outputs"] = constraint


def _apply_trtllm_inputs(values: dict[str, object], vocab_size: int | None = None) -> dict[str, str]:
    """Rewrites TensorRT-LLM backend inputs in ``values`` as SamplingParams fields, in place.

    - ``min_length`` -> ``min_tokens``; ``num_return_sequences`` -> ``n``; ``runtime_top_p`` -> ``top_p``;
      ``runtime_top_k`` -> ``top_k`` (0 means off, as in TensorRT-LLM: ``top_k`` -1).
    - ``random_seed`` (UINT64) -> ``seed``, folded into 63 bits (the same seed always gives the same tokens).
    - ``stop_words`` -> more ``stop`` strings; ``bad_words`` -> ``bad_words``; empty strings are dropped
      (TensorRT-LLM clients send ``""`` for none).
    - ``end_id`` -> the request's end token: generation stops on it (a stop token id) instead of the
      model's EOS.
    - ``return_log_probs`` true -> ``logprobs`` 0 (the sampled tokens' log-probabilities are returned as
      ``output_log_probs`` and ``cum_log_probs``).
    - ``beam_width`` must be 1: beam search is not implemented. ``len_penalty``/``length_penalty`` and
      ``early_stopping`` only act on beam search, so at beam width 1 they have no effect, as in
      TensorRT-LLM; they are checked (a finite number, a boolean) and ignored. ``pad_id`` has no effect:
      outputs are never padded.

    Args:
        values: the request's values by name, rewritten in place.
        vocab_size: the model's vocabulary size, against which ``end_id`` is checked (None: not checked here).

    Returns:
        alias -> canonical field name, for the aliases that were present (to name them in errors).

    Raises:
        ValueError: ``beam_width`` other than 1, a non-finite ``len_penalty``, an ``end_id`` or ``pad_id`` that
            is not a token id (``end_id`` outside the vocabulary), ``stop_words`` that are not strings, longer
            than a stop string may be or, with ``stop``, more than a request may hold, or an alias and its
            canonical field both given with different values.
    """
    aliases: dict[str, str] = {}
    beam_width = values.pop("beam_width", None)
    if beam_width is not None and beam_width != 1:
        raise ValueError(f"beam_width must be 1 (beam search is not supported), got {beam_width!r}")
    for name in ("len_penalty", "length_penalty"):
        penalty = values.pop(name, None)
        if penalty is not None and not (isinstance(penalty, float) and np.isfinite(penalty)):
            raise ValueError(f"{name} must be a finite number, got {penalty!r}")
    values.pop("early_stopping", None)
    _token_id("pad_id", values.pop("pad_id", None), None)

    renamed = {"min_length": "min_tokens", "num_return_sequences": "n", "runtime_top_p": "top_p",
               "runtime_top_k": "top_k", "random_seed": "seed"}
    for alias, canonical in renamed.items():
        if values.get(alias) is None:
            values.pop(alias, None)
            continue
        value = values.pop(alias)
        if alias == "runtime_top_k" and value == 0:
            value = -1
        if alias == "random_seed" and isinstance(value, int):
            if not 0 <= value < 2**64:
                raise ValueError(f"random_seed must be in [0, 2**64) (TensorRT-LLM's UINT64), got {value}")
            value &= 2**63 - 1
        sent = values.get(canonical)
        if canonical == "top_k" and sent == 0:  # 0 and -1 both mean off (SamplingParams takes 0 as -1)
            sent = -1
        if sent is not None and sent != value:
            raise ValueError(f"{alias} ({value!r}) and {canonical} ({values[canonical]!r}) disagree; send one")
        values[canonical] = value
        aliases[alias] = canonical

    stop_words = values.pop("stop_words", None)
    if stop_words is not None:
        values["stop"] = _merged_stop_words(stop_words, values.get("stop"))
    if "bad_words" in values and isinstance(values["bad_words"], list):
        values["bad_words"] = [w for w in values["bad_words"] if w != ""]
    end_id = _token_id("end_id", values.pop("end_id", None), vocab_size)
    if end_id is not None:
        stop_token_ids = values.get("stop_token_ids") or []
        values["stop_token_ids"] = [*stop_token_ids, end_id] if isinstance(stop_token_ids, list) else stop_token_ids
        values["ignore_eos"] = True
        aliases["end_id"] = "stop_token_ids"
    if values.pop("return_log_probs", False) and values.get("logprobs") is None:
        values["logprobs"] = 0
    return aliases


def _token_id(name: str, value: object, vocab_size: int | None) -> int | None:
    """A TensorRT-LLM token-id input (``end_id``, ``pad_id``): None, or an integer in [0, vocab_size).

    Raises:
        ValueError: naming the input, for any other value.
    """
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a token id (an integer >= 0), got {_clip(value)}")
    if vocab_size is not None and value >= vocab_size:
        raise ValueError(f"{name} is {value}, outside the vocabulary [0, {vocab_size})")
    return value


def _merged_stop_words(stop_words: object, stop: object) -> object:
    """TensorRT-LLM's ``stop_words`` added to ``stop``, its empty strings dropped (its clients send ``""`` for
    none), checked against the stop strings' limits under its own name.

    Raises:
        ValueError: ``stop_words`` is not a list of strings, holds a string longer than a stop string may be,
            or holds more strings than fit beside ``stop``.
    """
    if not isinstance(stop_words, list) or not all(isinstance(w, str) for w in stop_words):
        raise ValueError(f"stop_words must be a string or a list of strings, got {_clip(stop_words)}")
    words = [w for w in stop_words if w != ""]
    longest = max((len(w) for w in words), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop_words has a string of {longest} characters; at most {MAX_STOP_STRING_CHARS}")
    stop = [] if stop is None else stop
    if not isinstance(stop, list):  # SamplingParams refuses it, naming stop
        return stop
    if len(stop) + len(words) > MAX_STOP_STRINGS:
        raise ValueError(f"stop_words and stop hold {len(words)} and {len(stop)} strings; at most "
                         f"{MAX_STOP_STRINGS} together")
    return [*stop, *words]


def _sampling_parameters(raw: object) -> dict[str, object]:
    """The ``sampling_parameters`` input: a JSON object (:func:`_bounded_json`)."""
    if not raw:
        return {}
    sampling = _bounded_json("sampling_parameters", raw if isinstance(raw, bytes) else str(raw))
    if not isinstance(sampling, dict):
        raise ValueError("sampling_parameters must be a JSON object")
    return sampling


def _bounded_json(what: str, raw: str | bytes) -> object:
    """``raw`` decoded as JSON, its size (``MAX_SAMPLING_PARAMETERS_BYTES``) and nesting (``MAX_JSON_DEPTH``)
    checked before decoding.

    Raises:
        ValueError: naming ``what``: over the size or depth, or not valid JSON.
    """
    size = len(raw) if isinstance(raw, bytes) else len(raw.encode("utf-8", "surrogatepass"))
    if size > MAX_SAMPLING_PARAMETERS_BYTES:
        raise ValueError(f"{what} is {size} bytes; at most {MAX_SAMPLING_PARAMETERS_BYTES}")
    depth = _json_depth(raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw)
    if depth > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests {depth} levels deep; at most {MAX_JSON_DEPTH}")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{what} is not valid JSON: {exc}") from None


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACKETS = re.compile(r"[\[\]{}]")


def _json_depth(text: str) -> int:
    """Deepest nesting of ``[`` / ``{`` in JSON text, brackets inside strings left out (linear time: no
    recursion, so 100,000 levels cost what any 100 kB of text does)."""
    depth = deepest = 0
    for match in _BRACKETS.finditer(_JSON_STRING.sub('""', text)):
        depth += 1 if match.group() in "[{" else -1
        deepest = max(deepest, depth)
    return deepest


def _first(array: np.ndarray):
    return array.reshape(-1)[0]


def _text(name: str, value: object) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    return str(value)


def _flag(value: object, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"{name} must be true or false, got {_clip(value)}")


def _coerce(name: str, value: object, kind: type) -> object:
    """JSON, numpy and string values -> the Python type SamplingParams validates (it names the field on error).

    Strings are parsed as Triton's vLLM backend does (``"100"`` -> 100, ``"0.1"`` -> 0.1), booleans as
    ``true``/``false``/``1``/``0`` (where vLLM's ``bool("false")`` would be True). A string that does not
    parse is rejected naming the field.
    """
    if isinstance(value, np.generic):
        value = value.item()
    if kind is bool:
        return _flag(value, name)
    if isinstance(value, str):
        try:
            value = int(value) if kind is int else float(value)
        except ValueError:
            wanted = "an integer" if kind is int else "a number"
            raise ValueError(f"{name} must be {wanted}, got string {_clip(value)}") from None
    if kind is float and isinstance(value, int) and not isinstance(value, bool) and abs(value) <= sys.float_info.max:
        return float(value)
    return value  # a larger int is refused by SamplingParams, naming the field


def _clip(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
