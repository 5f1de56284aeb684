"""Triton request -> engine request: the inputs and parameters Triton's vLLM and TensorRT-LLM backends use."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from backend import SamplingParams

# Optional inputs that map one to one onto SamplingParams fields, with the Python type each must become.
SAMPLING_INPUTS: dict[str, type] = {
    "max_tokens": int, "min_tokens": int, "temperature": float, "top_p": float, "top_k": int, "min_p": float,
    "repetition_penalty": float, "presence_penalty": float, "frequency_penalty": float, "seed": int,
    "ignore_eos": bool, "logprobs": int, "n": int,
}
FLAG_INPUTS = ("stream", "exclude_input_in_output")


@dataclass
class ParsedRequest:
    prompt: str
    params: SamplingParams
    stream: bool
    exclude_input_in_output: bool


def parse_request(inputs: dict[str, np.ndarray], parameters: dict[str, object]) -> ParsedRequest:
    """Builds the engine's view of one Triton request.

    Sampling values are read, later ones winning, from the request ``parameters`` (Triton's generate
    extension puts a ``"parameters": {...}`` object there), then the ``sampling_parameters`` JSON input,
    then the named input tensors (``max_tokens``, ``temperature``, ...).

    Args:
        inputs: input name -> the tensor's numpy array (STRING inputs as ``object`` arrays of bytes).
        parameters: the request's parameters, decoded from JSON.

    Raises:
        ValueError: a message naming the field: missing ``text_input``, bad JSON, wrong type or range.
    """
    if "text_input" not in inputs or inputs["text_input"].size == 0:
        raise ValueError("text_input is required")
    prompt = _text("text_input", _first(inputs["text_input"]))

    values: dict[str, object] = {}
    for key, value in parameters.items():
        if key in SAMPLING_INPUTS or key in FLAG_INPUTS or key == "stop":
            values[key] = value
    if "sampling_parameters" in inputs:
        raw = _first(inputs["sampling_parameters"])
        try:
            sampling = json.loads(raw) if raw else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"sampling_parameters is not valid JSON: {exc}") from None
        if not isinstance(sampling, dict):
            raise ValueError("sampling_parameters must be a JSON object")
        values.update(sampling)
    for name in (*SAMPLING_INPUTS, *FLAG_INPUTS):
        if name in inputs:
            values[name] = _first(inputs[name]).item()
    if "stop" in inputs:
        values["stop"] = [_text("stop", s) for s in inputs["stop"].reshape(-1)]

    stream = _flag(values.pop("stream", False), "stream")
    exclude = _flag(values.pop("exclude_input_in_output", False), "exclude_input_in_output")
    for name, kind in SAMPLING_INPUTS.items():
        if name in values and values[name] is not None:
            values[name] = _coerce(name, values[name], kind)
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    return ParsedRequest(prompt, SamplingParams.from_dict(values), stream, exclude)


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
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name} must be true or false, got {value!r}")


def _coerce(name: str, value: object, kind: type) -> object:
    """JSON and numpy values -> the Python type SamplingParams validates (it names the field on error)."""
    if isinstance(value, np.generic):
        value = value.item()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is bool and isinstance(value, str):
        return _flag(value, name)
    if isinstance(value, str):
        raise ValueError(f"{name} must be {'a number' if kind is float else kind.__name__}, got string {value!r}")
    return value
