"""Per-request sampling settings, with the names and meanings vLLM and the OpenAI API use."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field

from backend.structured_output.params import StructuredOutputsParams

MAX_LOGPROBS = 20
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (vLLM's _SAMPLING_EPS): logits / T would overflow
# Bounds on what one request may ask the detokenizer and sampler to check every step (cost per token grows
# with number x length of stop strings), and on what it may make the tokenizer do.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 32
MAX_BAD_WORD_CHARS = 256
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
MAX_ALLOWED_TOKEN_IDS = 1 << 18


@dataclass
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        n: completions for the prompt (parallel sampling: they share the prompt's full KV blocks), >= 1; the
            engine's ``max_n`` bounds it.
        max_tokens: most output tokens; None allows up to ``max_model_len``.
        min_tokens: output tokens before EOS, stop_token_ids or stop strings may end the request (a grammar that
            allows nothing but its end still ends it: see ``backend.sampler.Sampler``).
        temperature: 0 means greedy, and so does anything below ``GREEDY_TEMPERATURE`` (1e-5, as vLLM),
            where dividing the logits by it could overflow; otherwise logits are divided by it.
        top_k: keep the k most likely tokens; -1 or 0 keeps all (0 is taken as -1, as vLLM takes both).
        top_p: keep the smallest set of tokens whose probability sums to top_p (nucleus, Holtzman et al. 2020).
        min_p: drop tokens less likely than min_p times the most likely one.
        repetition_penalty: divides positive (multiplies negative) logits of tokens already in prompt or
            output (Keskar et al. 2019, CTRL); 1 is off.
        presence_penalty: subtracted once from tokens already in the output (OpenAI semantics).
        frequency_penalty: subtracted per occurrence in the output (OpenAI semantics).
        seed: a per-request random generator seed (any int64; -1 is no seed, as in vLLM): the same seed gives
            the same random draws, so the same tokens wherever the model's probabilities are the same. torch's
            CPU generator takes a 32-bit seed: a seed under 2**32 is used as it is, and a larger or negative one
            has its upper 32 bits mixed into the lower (``generator_seed``), so that seeds which differ only
            there (s and s + 2**32, or -1 and 2**32 - 1) draw differently. The n completions of a request use
            seed, seed + 1, ..., seed + n - 1 (as vLLM does), so neighbouring seeds share completions. In fp32
            on the C++ kernels the tokens are the same whatever shares the batch (every GEMM sums in one order for
            any number of rows, and the prefill attention kernel for any split of a prompt into chunks, for heads
            of 64 or 128 dimensions; other head sizes attend through SDPA, whose sums follow the chunk); a request
            preempted and recomputed, or one whose prompt is served from cached blocks that
            another request's decode steps wrote (a chat's earlier answer), has K/V from a prefill where they came
            from decode steps, or the reverse; the two attention kernels round differently (about 1e-5 in
            log-probabilities), so a draw that falls that close to a boundary can go the other way.
        stop: strings that end the request; the stop string itself is not returned (at most
            ``MAX_STOP_STRINGS`` of at most ``MAX_STOP_STRING_CHARS`` characters).
        stop_token_ids: token ids that end the request (the token is kept in output_ids; at most
            ``MAX_STOP_TOKEN_IDS``).
        bad_words: words never generated (TensorRT-LLM's ``bad_words``, vLLM's ``bad_words``): each is
            tokenized as given and with a leading space; a token is banned when it would complete one of those
            token sequences (at most ``MAX_BAD_WORDS`` of at most ``MAX_BAD_WORD_CHARS`` characters).
        ignore_eos: keep generating after the EOS token.
        logprobs: also return the sampled token's log-probability and the top-N alternatives (0..20).
        prompt_logprobs: also return each prompt token's log-probability given the tokens before it, and the
            top-N alternatives at that position (0..20; vLLM's ``prompt_logprobs``). Computed from the prefill's
            own forward pass (no second model run); the prompt's first token has none. Such a request takes no
            prefix-cache hits for its prompt (a cached block's positions would have no logits).
        skip_special_tokens: leave special tokens out of the text.
        include_stop_str_in_output: keep the stop string that ended the request at the end of its text.
        logit_bias: token id -> a value added to its logit before sampling, in [-100, 100] (OpenAI's
            ``logit_bias``; -100 in effect bans a token, 100 all but forces it); at most ``MAX_LOGIT_BIAS`` entries.
        allowed_token_ids: only these tokens may be sampled (vLLM's ``allowed_token_ids``); at most
            ``MAX_ALLOWED_TOKEN_IDS``.
        truncate_prompt_tokens: keep only the prompt's last k tokens (vLLM's ``truncate_prompt_tokens``), k >= 1.
        structured_outputs: what the output must match (a JSON schema, any JSON object, a regex, a choice,
            an EBNF grammar; vLLM's ``structured_outputs``), enforced while sampling; an object with those
            field names (or its JSON text) is converted. See ``backend.structured_output``.

    Raises:
        ValueError: naming the field and its allowed range, on any invalid value.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    bad_words: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        _int("n", self.n, low=1)
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, low=1)
        _int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _float("temperature", self.temperature, low=0.0)
        _int("top_k", self.top_k, low=-1)
        if self.top_k == 0:  # vLLM 0.32's default and its "off", beside -1
            self.top_k = -1
        _float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _float("min_p", self.min_p, low=0.0, high=1.0)
        _float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _int("seed", self.seed, low=-2**63, high=2**63 - 1)  # any int64, as vLLM and OpenAI take
            if self.seed == -1:  # vLLM's "no seed"
                self.seed = None
        _strings("stop", self.stop, MAX_STOP_STRINGS, MAX_STOP_STRING_CHARS)
        _strings("bad_words", self.bad_words, MAX_BAD_WORDS, MAX_BAD_WORD_CHARS)
        if not isinstance(self.stop_token_ids, list):
            raise ValueError(f"stop_token_ids must be a list of integers, got {_short(self.stop_token_ids)}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} entries; at most {MAX_STOP_TOKEN_IDS}")
        for token_id in self.stop_token_ids:
            _int("stop_token_ids", token_id, low=0)
        _bool("ignore_eos", self.ignore_eos)
        _bool("skip_special_tokens", self.skip_special_tokens)
        _bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, list) or not self.allowed_token_ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got "
                                 f"{_short(self.allowed_token_ids)}")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise ValueError(f"allowed_token_ids has {len(self.allowed_token_ids)} entries; at most "
                                 f"{MAX_ALLOWED_TOKEN_IDS}")
            for token_id in self.allowed_token_ids:
                _int("allowed_token_ids", token_id, low=0)
        if self.truncate_prompt_tokens is not None:
            _int("truncate_prompt_tokens", self.truncate_prompt_tokens, low=1)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    def token_ids_used(self) -> list[int]:
        """Every token id these parameters name (checked against the vocabulary by the engine)."""
        return [*self.stop_token_ids, *(self.logit_bias or {}), *(self.allowed_token_ids or [])]

    @property
    def greedy(self) -> bool:
        """Argmax sampling: temperature 0 or below ``GREEDY_TEMPERATURE``."""
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, values: dict[str, object], also_known: tuple[str, ...] = ()) -> "SamplingParams":
        """Builds params from a JSON-like dict (the Triton `sampling_parameters` input).

        Args:
            also_known: names the caller took out of ``values`` before (request-level settings), listed among
                the known ones in the error for an unknown key.

        Raises:
            ValueError: an unknown key, or any invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            names = ", ".join(unknown)
            names = names if len(names) <= 200 else f"{names[:200]}..."
            raise ValueError(f"unknown sampling parameter(s) {names}; known: "
                             f"{', '.join(sorted(known | set(also_known)))}")
        return cls(**values)


def _logit_bias(value: object) -> dict[int, float]:
    """``{token id (an int, or its decimal string as JSON keys are): bias}`` -> ``{int: float}``. A string key is
    ASCII digits only (Python's ``int`` would also take " 5", "+5", "5_0" and other scripts' digits), and no token
    may be named twice ("5" and "05")."""
    if not isinstance(value, dict):
        raise ValueError(f"logit_bias must be an object of token id -> bias, got {_short(value)}")
    if len(value) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(value)} entries; at most {MAX_LOGIT_BIAS}")
    out = {}
    for key, bias in value.items():
        if isinstance(key, int) and not isinstance(key, bool):
            token_id = key
        elif isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 19:  # under 2**63
            token_id = int(key)
        else:
            token_id = None
        if token_id is None or token_id < 0:
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {_short(key)}")
        if token_id in out:
            raise ValueError(f"logit_bias names token {token_id} twice")
        _float("logit_bias", bias, low=-100.0, high=100.0)
        out[token_id] = float(bias)
    return out


def _strings(name: str, value: object, max_count: int, max_chars: int) -> None:
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise ValueError(f"{name} must be a non-empty string or a list of non-empty strings, got {_short(value)}")
    if len(value) > max_count:
        raise ValueError(f"{name} has {len(value)} strings; at most {max_count}")
    longest = max((len(s) for s in value), default=0)
    if longest > max_chars:
        raise ValueError(f"{name} has a string of {longest} characters; at most {max_chars}")


def _short(value: object, limit: int = 80) -> str:
    """repr() cut to ``limit`` characters: error messages never echo a whole oversized input."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _int(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, float) and value.is_integer():
        raise ValueError(f"{name} must be an integer, got float {value!r}")
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {_short(value)}")
    _range(name, value, low, high, low_open=False)


def _float(name: str, value: object, low: float | None = None, high: float | None = None, low_open: bool = False) -> None:
    if (not isinstance(value, (int, float)) or isinstance(value, bool)
            # an int beyond float's range (JSON's 1e400 written out) is as infinite as a float would hold it
            or not (abs(value) <= sys.float_info.max if isinstance(value, int) else math.isfinite(value))):
        raise ValueError(f"{name} must be a finite number, got {_short(value)}")
    _range(name, value, low, high, low_open)


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {_short(value)}")


def _bound(value: float) -> str:
    """A range's end as written: integers whole (2**63 - 1, not 9.22337e+18), other numbers short."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _range(name: str, value: float, low: float | None, high: float | None, low_open: bool) -> None:
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        left = "(" if low_open else "["
        lo = "-inf" if low is None else _bound(low)
        hi = "inf" if high is None else _bound(high)
        raise ValueError(f"{name} must be in {left}{lo}, {hi}{']' if high is not None else ')'}, got {value!r}")


def generator_seed(seed: int) -> int:
    """The 32-bit seed of torch's CPU generator (mt19937, which uses only the low 32 bits of the seed it is
    given) for an int64 ``seed``: the low 32 bits, XOR the upper 32 bits through MurmurHash3's 32-bit finalizer
    (Appleby), which maps 0 to 0, so seeds in ``[0, 2**32)`` are used unchanged and seeds that differ only in
    their upper half draw differently. Returns an int in ``[0, 2**32)``."""
    value = seed % 2**64
    high = value >> 32
    high ^= high >> 16
    high = (high * 0x85EBCA6B) & 0xFFFFFFFF
    high ^= high >> 13
    high = (high * 0xC2B2AE35) & 0xFFFFFFFF
    high ^= high >> 16
    return (value & 0xFFFFFFFF) ^ high
