"""The cost of structured outputs: decode tokens/s at a batch of 32, with a JSON schema vs without.

``python -m benchmarks.structured_output [--batch 32] [--tokens 96] [--rounds 3] [--dtype float32]``
``python -m benchmarks.structured_output --grammar-only [--batch 32]``: the grammar's own work per step alone
(bitmask fill and apply for ``batch`` rows, one token accepted per row), in CPU time of the calling thread,
without the model; compare it with a step's time (about 100 ms for a decode step at batch 32 on 2 cores).

Both runs generate the same number of tokens per request from the same chat prompts: free text with
``ignore_eos`` for ``max_tokens`` tokens, and a JSON schema (an array of exactly ``tokens`` // 4 short
integers, so its output is about as long) whose grammar ends each request by itself. Each round runs
free then schema, one after the other on one engine (warmed up first, grammar compiled before timing), so
a machine whose load changes hurts both alike; the report gives every round and the median overhead
(the aim: under 10%), in tokens/s (wall clock) and in this process's CPU time per token (which other
work on a shared machine disturbs less). Prints one JSON object per round and a summary line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from backend import EngineConfig, LLMEngine, SamplingParams


def _run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> tuple[int, float, float]:
    """(tokens generated, wall seconds, CPU seconds of this process) for all prompts submitted at once and
    stepped to completion."""
    sinks = [engine.add_request(p, params) for p in prompts]
    began, began_cpu = time.perf_counter(), time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    elapsed, cpu = time.perf_counter() - began, time.process_time() - began_cpu
    tokens = 0
    for sink in sinks:
        while not sink.empty():
            tokens += len(sink.get_nowait().token_ids)
    return tokens, elapsed, cpu


def grammar_cost(batch: int, steps: int = 200) -> dict:
    """CPU milliseconds (this thread) per step that structured outputs add for ``batch`` rows: each row's
    matcher walks a valid document of a JSON schema, and every step fills and applies the bitmask of all rows
    to ``[batch, vocab]`` fp32 logits and accepts one token per row."""
    import torch
    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir
    from backend.structured_output import Grammar, GrammarCompiler, StructuredOutputsParams, apply_grammar_bitmask

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    vocab = len(tokenizer)
    schema = {"type": "array", "items": {"type": "object", "required": ["name", "age"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}}}}
    document = json.dumps([{"name": f"person {i}", "age": 20 + i} for i in range(200)])  # xgrammar's separators
    tokens = tokenizer.encode(document)[:steps]
    compiled = GrammarCompiler(tokenizer, vocab).compile(StructuredOutputsParams(json=json.dumps(schema)))
    grammars = [Grammar(compiled, (tokenizer.eos_token_id,)) for _ in range(batch)]
    logits = torch.randn(batch, vocab)
    began = time.thread_time()
    for token in tokens:
        apply_grammar_bitmask(logits, grammars)
        for grammar in grammars:
            assert grammar.accept(token)
    per_step = (time.thread_time() - began) / len(tokens)
    return {"batch": batch, "steps": len(tokens), "grammar_cpu_ms_per_step": round(1000 * per_step, 3)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured_output", description=__doc__)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=96, help="output tokens per request (about)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--grammar-only", action="store_true", help="the grammar's own cost per step, no model")
    args = parser.parse_args(argv)
    if args.grammar_only:
        print(json.dumps(grammar_cost(args.batch)))
        return

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
        overheads, cpu_overheads = [], []
        for round_ in range(args.rounds):
            free_tokens, free_s, free_cpu = _run(engine, prompts, free)
            schema_tokens, schema_s, schema_cpu = _run(engine, prompts, constrained)
            overheads.append(1 - (schema_tokens / schema_s) / (free_tokens / free_s))
            cpu_overheads.append((schema_cpu / schema_tokens) / (free_cpu / free_tokens) - 1)
            print(json.dumps({"round": round_, "batch": args.batch, "free_tokens": free_tokens,
                              "free_tok_s": round(free_tokens / free_s, 1), "schema_tokens": schema_tokens,
                              "schema_tok_s": round(schema_tokens / schema_s, 1), "overhead": round(overheads[-1], 4),
                              "free_cpu_ms_per_token": round(1000 * free_cpu / free_tokens, 2),
                              "schema_cpu_ms_per_token": round(1000 * schema_cpu / schema_tokens, 2),
                              "cpu_overhead": round(cpu_overheads[-1], 4)}), flush=True)
        print(f"median overhead of a JSON schema at batch {args.batch}: tokens/s {statistics.median(overheads):.1%}, "
              f"CPU time per token {statistics.median(cpu_overheads):.1%} (rounds: "
              f"{', '.join(f'{o:.1%}/{c:.1%}' for o, c in zip(overheads, cpu_overheads))})")
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
