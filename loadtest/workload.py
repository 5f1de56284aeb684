"""The load test's workload: prompts with exact output lengths, one JSON object a line.

Each line is ``{"prompt": "...", "max_tokens": N}``; requests use ``ignore_eos`` so every completion that is
not cancelled has exactly ``max_tokens`` output tokens. The committed ``workload.jsonl`` is made by::

    python -m loadtest.workload --seed 0 --count 100 --output loadtest/workload.jsonl

Mix (fractions of requests): 80% short outputs (16-64 tokens) and 20% long ones (256-512 tokens); prompts
independently 75% short (a one-line instruction, 5-40 words) and 25% long (notes of 150-500 words to work on).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DEFAULT_WORKLOAD = Path(__file__).resolve().parent / "workload.jsonl"

SHORT_OUTPUT_TOKENS, LONG_OUTPUT_TOKENS, LONG_OUTPUT_SHARE = (16, 64), (256, 512), 0.2
SHORT_PROMPT_WORDS, LONG_PROMPT_WORDS, LONG_PROMPT_SHARE = (5, 40), (150, 500), 0.25

TOPICS = ["the water cycle", "how a bicycle gear works", "the history of paper", "why the sky is blue",
          "caring for a house plant", "how bread rises", "the life of honey bees", "planning a small garden",
          "how tides follow the moon", "learning a second language", "the first railways", "how vaccines work",
          "keeping a budget", "the planets of the solar system", "how a compass finds north", "making soup"]
TASKS = ["Explain {topic} to a curious child.", "Write a short story about {topic}.",
         "List the key facts about {topic}.", "Describe {topic} in plain words, step by step.",
         "Write a friendly letter that mentions {topic}."]
WORDS = ("the a small large old new quick careful bright quiet river town garden teacher student machine "
         "morning evening water light stone paper wheel market road window story question answer reason "
         "idea method result change season field friend family engine signal pattern measure simple early "
         "late often always never before after because while carries brings shows makes finds keeps turns "
         "grows moves opens holds learns builds notes explains follows").split()


@dataclass(frozen=True)
class WorkItem:
    """One request: the prompt text and its exact output length in tokens."""

    prompt: str
    max_tokens: int


def make_workload(count: int, seed: int) -> list[WorkItem]:
    """``count`` items drawn with ``random.Random(seed)``: the same seed gives the same file."""
    rng = random.Random(seed)
    items = []
    for _ in range(count):
        task = rng.choice(TASKS).format(topic=rng.choice(TOPICS))
        long_prompt = rng.random() < LONG_PROMPT_SHARE
        words = rng.randint(*(LONG_PROMPT_WORDS if long_prompt else SHORT_PROMPT_WORDS))
        prompt = _with_notes(task, words, rng) if long_prompt else _padded(task, words, rng)
        lengths = LONG_OUTPUT_TOKENS if rng.random() < LONG_OUTPUT_SHARE else SHORT_OUTPUT_TOKENS
        items.append(WorkItem(prompt, rng.randint(*lengths)))
    return items


def _padded(task: str, words: int, rng: random.Random) -> str:
    """The task, followed by a sentence of filler words when it is shorter than ``words``."""
    missing = words - len(task.split())
    return task if missing <= 0 else f"{task} Keep in mind: {_sentence(missing, rng)}"


def _with_notes(task: str, words: int, rng: random.Random) -> str:
    sentences, left = [], words
    while left > 0:
        length = min(left, rng.randint(6, 18))
        sentences.append(_sentence(length, rng))
        left -= length
    return f"{task} Use these notes:\n" + " ".join(sentences)


def _sentence(words: int, rng: random.Random) -> str:
    text = " ".join(rng.choice(WORDS) for _ in range(words))
    return text[0].upper() + text[1:] + "."


def save_workload(items: list[WorkItem], path: Path) -> None:
    path.write_text("".join(json.dumps({"prompt": i.prompt, "max_tokens": i.max_tokens}) + "\n" for i in items))


@lru_cache(maxsize=8)
def load_workload(path: str | Path = DEFAULT_WORKLOAD, max_output_tokens: int | None = None) -> tuple[WorkItem, ...]:
    """The items of a JSONL workload file; ``max_output_tokens`` caps every item's length (for short runs).

    Raises:
        ValueError: the file is empty or a line lacks ``prompt`` or a positive ``max_tokens``.
    """
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        prompt, max_tokens = record.get("prompt"), record.get("max_tokens")
        if not isinstance(prompt, str) or not prompt or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"{path}:{number}: needs a non-empty 'prompt' and a positive integer 'max_tokens'")
        if max_output_tokens:
            max_tokens = min(max_tokens, max_output_tokens)
        items.append(WorkItem(prompt, max_tokens))
    if not items:
        raise ValueError(f"{path}: no workload items")
    return tuple(items)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.workload", description="Generate a workload file.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=100)
    parser.add_argument("--output", type=Path, default=DEFAULT_WORKLOAD)
    args = parser.parse_args(argv)
    save_workload(make_workload(args.count, args.seed), args.output)
    print(f"wrote {args.count} items to {args.output}")


if __name__ == "__main__":
    main()
