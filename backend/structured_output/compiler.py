"""Compiles structured-output constraints into grammars, once per distinct constraint (an LRU cache)."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from backend.structured_output.params import StructuredOutputsParams

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept (each holds per-state token masks: tens of KiB to MiB)
_NATIVE_PREFIX = re.compile(r"^\[[0-9:]+\] [^ ]+:\d+: ")  # "[13:41:12] /project/cpp/x.cc:94: " in xgrammar errors


class GrammarCompiler:
    """Turns :class:`StructuredOutputsParams` into an xgrammar ``CompiledGrammar`` for one tokenizer.

    Thread-safe; called on the thread that adds a request (never the engine loop), so the request is queued
    only once its grammar is ready, and an invalid constraint fails that request alone. The tokenizer's
    vocabulary is read on first use (about 1 s for a 49k-token BPE vocabulary), so engines whose requests
    never ask for structured outputs pay nothing.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        cache_size: compiled grammars kept, least recently used dropped first.

    Attributes:
        num_compiled, num_cache_hits: counters, for tests and stats.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.num_compiled = 0
        self.num_cache_hits = 0

    def compile(self, params: StructuredOutputsParams):
        """The compiled grammar for ``params`` (cached by kind and text).

        Raises:
            ValueError: the schema, regex or grammar is invalid or unsupported (xgrammar's reason, without
                its source location).
        """
        key = (params.kind, params.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return compiled
            compiler = self._get_compiler()
            try:
                compiled = _compile(compiler, params)
            except (RuntimeError, ValueError, TypeError) as exc:
                message = _NATIVE_PREFIX.sub("", str(exc).strip()).splitlines()[0][:500]
                raise ValueError(f"invalid structured_outputs.{params.kind}: {message}") from None
            self._cache[key] = compiled
            self.num_compiled += 1
            if len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _get_compiler(self):
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            # Its own cache is off: ours bounds the count and counts hits.
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler


def _compile(compiler, params: StructuredOutputsParams):
    kind = params.kind
    if kind == "json":
        try:
            schema = json.loads(params.json)
        except json.JSONDecodeError as exc:
            raise ValueError(f"the schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        # Compact separators and no free whitespace: a small model sampling at temperature 1 could otherwise
        # spend its whole budget on newlines between the tokens of a valid document.
        return compiler.compile_json_schema(params.json, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(params.regex)
    if kind == "choice":  # a grammar of string literals (JSON string escapes are EBNF's too)
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                   for c in params.choice))
    return compiler.compile_grammar(params.grammar)
