"""The cost of structured outputs: decode tokens/s at a batch of 32, with a JSON schema vs without.

``python -m benchmarks.structured_output [--batch 32] [--tokens 96] [--rounds 3] [--dtype float32]``

Both runs generate the same number of tokens per request from the same chat prompts: free text with
``ignore_eos`` for ``max_tokens`` tokens, and a JSON schema (an array of exactly ``tokens`` // 4 short
integers, so its output is about as long) whose grammar ends each request by itself. Each round runs
free then schema, one after the other on one engine (warmed up first, grammar compiled before timing), so
a machine whose load changes hurts both alike; the report gives every round and the median overhead
(issue 16's goal: under 10%). Prints one JSON object per round and a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from backend import EngineConfig, LLMEngine, SamplingParams


def _run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> tuple[int, float]:
    """(tokens generated, seconds) for all prompts submitted at once and stepped to completion."""
    sinks = [engine.add_request(p, params) for p in prompts]
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed = time.perf_counter() - began
    tokens = 0
    for sink in sinks:
        while not sink.empty():
            tokens += len(sink.get_nowait().token_ids)
    return tokens, elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_output", description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request (about)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)

    engine = LLMEngine(EngineConfig(dtype=args.dtype, num_threads=args.threads, max_num_seqs=args.batch,
                                    max_model_len=1024))
    prompts = [engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"List {i + 8} numbers as a JSON array."}], tokenize=False,
        add_generation_prompt=True) for i in range(args.batch)]
    items = max(1, args.tokens // 4)  # "12, " is about 4 tokens... a number, a comma, a space
    schema = {"type": "array", "minItems": items, "maxItems": items,
              "items": {"type": "integer", "minimum": 0, "maximum": 99}}
    free = SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=4 * args.tokens, temperature=1.0, seed=0,
                                 structured_outputs={"json": schema})
    try:
        _run(engine, prompts[:4], SamplingParams(max_tokens=4, temperature=0))  # warm-up
        _run(engine, prompts[:4], SamplingParams(max_tokens=8, structured_outputs={"json": schema}))  # compile
        overheads = []
        for round_ in range(args.rounds):
            free_tokens, free_s = _run(engine, prompts, free)
            schema_tokens, schema_s = _run(engine, prompts, constrained)
            free_tps, schema_tps = free_tokens / free_s, schema_tokens / schema_s
            overheads.append(1 - schema_tps / free_tps)
            print(json.dumps({"round": round_, "batch": args.batch, "free_tokens": free_tokens,
                              "free_tok_s": round(free_tps, 1), "schema_tokens": schema_tokens,
                              "schema_tok_s": round(schema_tps, 1), "overhead": round(overheads[-1], 4)}),
                  flush=True)
        print(f"median overhead of a JSON schema at batch {args.batch}: {statistics.median(overheads):.1%} "
              f"(rounds: {', '.join(f'{o:.1%}' for o in overheads)})")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
