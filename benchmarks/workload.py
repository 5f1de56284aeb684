"""The workload: prompts cut from real English text, long-tailed output lengths, arrival times.

Prompts are slices of a token stream made from the docstrings of a fixed list of Python standard-library
modules (real prose, present on every machine, no download). Each slice is decoded and re-encoded until
text and ids agree, so systems fed token ids and the server fed text see the same prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
import math
import random
import time
from dataclasses import dataclass

from benchmarks.config import BenchConfig

CORPUS_MODULES = ("argparse", "collections", "csv", "dataclasses", "datetime", "decimal", "difflib", "email.message",
                  "enum", "fractions", "functools", "heapq", "http.client", "inspect", "json", "logging", "pathlib",
                  "pickle", "random", "shutil", "statistics", "string", "subprocess", "tarfile", "tempfile",
                  "textwrap", "threading", "unittest", "urllib.parse", "zipfile")
CORPUS_MAX_CHARS = 400_000


@dataclass(frozen=True)
class BenchRequest:
    """One request. ``online_arrival_s``: seconds after the start of an online run (Poisson process)."""

    index: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    output_len: int
    online_arrival_s: float


@dataclass(frozen=True)
class Workload:
    requests: tuple[BenchRequest, ...]
    seed: int
    rate: float
    corpus_tokens: int
    corpus_sha256: str

    def arrivals(self, mode: str) -> list[float]:
        """Arrival offsets in seconds: the Poisson times online; all 0 offline and concurrent (there a request
        is due when a slot frees, and its system records when it sent it)."""
        return [r.online_arrival_s if mode == "online" else 0.0 for r in self.requests]

    def head(self, limit: int | None) -> "Workload":
        """The first ``limit`` requests (by arrival; None = all), as a workload of their own.

        Raises:
            ValueError: ``limit`` is below 1.
        """
        if limit is not None and limit < 1:
            raise ValueError(f"a workload needs at least one request, got limit {limit}")
        if limit is None or limit >= len(self.requests):
            return self
        return dataclasses.replace(self, requests=self.requests[:limit])

    @property
    def total_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    def mean_decode_context(self) -> float:
        """Token-weighted mean context of a decode step, in tokens: output token k of a request with prompt p
        is computed over p + k tokens, k = 0..len-1."""
        total = sum(len(r.prompt_ids) * r.output_len + r.output_len * (r.output_len - 1) / 2 for r in self.requests)
        return total / self.total_output_tokens

    def summary(self) -> dict:
        prompts = [len(r.prompt_ids) for r in self.requests]
        outputs = [r.output_len for r in self.requests]
        return {"seed": self.seed, "num_requests": len(self.requests), "online_rate_rps": self.rate,
                "prompt_tokens": _stats(prompts), "output_tokens": _stats(outputs),
                "total_prompt_tokens": sum(prompts), "total_output_tokens": sum(outputs),
                "mean_decode_context_tokens": round(self.mean_decode_context(), 1),
                "online_last_arrival_s": round(self.requests[-1].online_arrival_s, 3),
                "corpus": {"source": "docstrings of Python standard-library modules", "modules": list(CORPUS_MODULES),
                           "tokens": self.corpus_tokens, "sha256": self.corpus_sha256},
                "requests": [{"index": r.index, "prompt_tokens": len(r.prompt_ids), "output_tokens": r.output_len,
                              "online_arrival_s": round(r.online_arrival_s, 4)} for r in self.requests]}


def make_workload(tokenizer, config: BenchConfig) -> Workload:
    """Draws ``config.num_requests`` requests with ``random.Random(config.seed)``: same seed, same workload
    (for the same tokenizer and Python version, whose docstrings make the corpus)."""
    text = corpus_text()
    corpus = tokenizer.encode(text)
    rng = random.Random(config.seed)
    lo, hi = config.prompt_tokens
    requests, offset = [], 0.0
    for index in range(config.num_requests):
        length = int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))  # log-uniform: long-tailed
        ids, prompt = _prompt(tokenizer, corpus, length, rng)
        out_range = config.long_output if rng.random() < config.long_share else config.short_output
        requests.append(BenchRequest(index, tuple(ids), prompt, rng.randint(*out_range), offset))
        offset += rng.expovariate(config.rate)
    return Workload(tuple(requests), config.seed, config.rate, len(corpus),
                    hashlib.sha256(text.encode()).hexdigest()[:16])


def corpus_text() -> str:
    """Module and member docstrings of :data:`CORPUS_MODULES`, in a fixed order."""
    parts = []
    for name in CORPUS_MODULES:
        module = importlib.import_module(name)
        parts.append(inspect.getdoc(module) or "")
        for attr, obj in sorted(vars(module).items()):
            if not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj)) \
                    and getattr(obj, "__module__", None) == name:
                parts.append(inspect.getdoc(obj) or "")
    return "\n\n".join(p for p in parts if p)[:CORPUS_MAX_CHARS]


def _prompt(tokenizer, corpus: list[int], length: int, rng: random.Random) -> tuple[list[int], str]:
    """A slice of about ``length`` tokens whose text re-encodes to the same ids."""
    while True:
        start = rng.randrange(len(corpus) - length)
        ids = corpus[start:start + length]
        for _ in range(3):
            text = tokenizer.decode(ids)
            again = tokenizer.encode(text)
            if again == ids and text.strip():
                return ids, text
            ids = again


def sleep_until(deadline: float) -> None:
    """Sleeps until ``time.perf_counter()`` reaches ``deadline`` (seconds)."""
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def _stats(values: list[int]) -> dict:
    ordered = sorted(values)
    return {"min": ordered[0], "mean": round(sum(ordered) / len(ordered), 1), "median": ordered[len(ordered) // 2],
            "max": ordered[-1]}
