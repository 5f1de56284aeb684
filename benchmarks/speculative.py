"""Speculative decoding by n-gram prompt lookup: single-stream inter-token latency and tokens/s, off vs on.

``python -m benchmarks.speculative [--dtypes float32,bfloat16] [--k 0,2,4] [--prompts code_edit,summary,open_ended]
[--max-tokens 128] [--rounds 1] [--threads N] [--output-dir results/speculative]``

One request at a time (a single stream), greedy, on the embedded SmolLM2-135M-Instruct, for each dtype and each
``num_speculative_tokens`` k (0 = off) on three chat prompts:

- ``code_edit``: a source file of this repository (``backend/stopping.py``) to rewrite with one change: the answer
  copies long runs of the prompt, the case prompt lookup is for;
- ``summary``: a passage of the repository's docstrings to summarize quoting its key sentences;
- ``open_ended``: a short story, where little repeats: speculation should cost little there.

The engine is stepped in this thread; a delta's arrival time is when ``step()`` returns it. Inter-token latency
(ITL) is per token: the gap before a delta divided evenly among its tokens (several arrive at once after accepted
drafts; the OpenAI frontend's ``vllm:inter_token_latency_seconds`` splits them the same way), mean and p50 over the
tokens after the first. Tokens/s counts the tokens after the first over the time from the first to the last. Each
run also records the acceptance (accepted / draft tokens, from the engine's stats) and whether its tokens equal
those of k = 0 (they should: greedy verification keeps exactly the tokens plain decoding gives, up to floating-point
differences between the shapes computed). Timings depend on what else runs on the machine: the report records
the load average at start and end. Writes ``report.json`` under the output directory and prints one JSON line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.machine import load_average, machine_info
from benchmarks.workload import corpus_text

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ("code_edit", "summary", "open_ended")


def build_prompts(tokenizer) -> dict[str, list[int]]:
    """The three chat prompts (token ids), see the module docstring."""
    source = (ROOT / "backend" / "stopping.py").read_text()
    messages = {
        "code_edit": "Rewrite this Python code with one change: rename the function stop_status to check_stop. "
                     "Output the whole file.\n\n" + source,
        "summary": corpus_text()[:2500] + "\n\nSummarize the text above in a few sentences, quoting its key "
                                          "sentences word for word.",
        "open_ended": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    }
    prompts = {}
    for name, message in messages.items():
        ids = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        prompts[name] = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return prompts


def measure(engine: LLMEngine, prompt: list[int], max_tokens: int) -> dict:
    """One greedy request alone, stepped to completion; latency figures in milliseconds."""
    before = engine.stats()
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), request_id="bench")
    arrivals: list[tuple[float, int]] = []  # (seconds, tokens in the delta)
    token_ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.token_ids:
                arrivals.append((time.perf_counter(), len(out.token_ids)))
                token_ids += out.token_ids
    after = engine.stats()
    itl = []  # per token after the first
    for (previous, _), (now, count) in zip(arrivals, arrivals[1:]):
        itl += [(now - previous) / count] * count
    decode_s = arrivals[-1][0] - arrivals[0][0]
    drafts = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
    accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
    return {"output_tokens": len(token_ids), "steps_after_first": len(arrivals) - 1,
            "itl_mean_ms": 1e3 * statistics.mean(itl) if itl else None,
            "itl_p50_ms": 1e3 * statistics.median(itl) if itl else None,
            "tokens_per_s": (len(token_ids) - 1) / decode_s if decode_s > 0 else None,
            "draft_tokens": drafts, "accepted_tokens": accepted,
            "acceptance": accepted / drafts if drafts else None, "token_ids": token_ids}


def run(dtype: str, k: int, prompts: dict[str, list[int]], args) -> list[dict]:
    """Every prompt on one engine of ``dtype`` with ``num_speculative_tokens`` k (after an untimed warm-up)."""
    engine = LLMEngine(EngineConfig(dtype=dtype, num_threads=args.threads, num_speculative_tokens=k,
                                    prompt_lookup_min=args.prompt_lookup_min,
                                    prompt_lookup_max=args.prompt_lookup_max, kv_cache_memory_bytes=256 << 20))
    try:
        measure(engine, prompts["open_ended"][:64], 8)  # warm-up
        rows = []
        for name in args.prompts:
            for round_ in range(args.rounds):
                row = {"dtype": dtype, "k": k, "prompt": name, "prompt_tokens": len(prompts[name]), "round": round_}
                row.update(measure(engine, prompts[name], args.max_tokens))
                rows.append(row)
        return rows
    finally:
        engine.shutdown()


def page_markdown(report: dict) -> str:
    """The report's rows as a table (``benchmarks.docs_page``)."""
    fmt = lambda v, f: "n/a" if v is None else f.format(v)  # noqa: E731
    lines = ["| dtype | prompt | k | ITL mean / p50 (ms) | tokens/s | acceptance | tokens equal to k = "
             f"{min(r['k'] for r in report['runs'])} |", "|---|---|---:|---:|---:|---:|---|"]
    for r in report["runs"]:
        lines.append(f"| {r['dtype']} | {r['prompt']} | {r['k']} | {fmt(r['itl_mean_ms'], '{:.1f}')} / "
                     f"{fmt(r['itl_p50_ms'], '{:.1f}')} | {fmt(r['tokens_per_s'], '{:.1f}')} | "
                     f"{fmt(r['acceptance'], '{:.0%}')} | {'yes' if r['same_tokens_as_lowest_k'] else '**no**'} |")
    return "\n".join(lines) + "\n"


markdown = page_markdown


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.speculative", description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated engine dtypes")
    parser.add_argument("--k", default="0,2,4", help="comma-separated num_speculative_tokens values (0 = off)")
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=f"comma-separated, of {', '.join(PROMPTS)}")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request at most")
    parser.add_argument("--rounds", type=int, default=1, help="requests per prompt and setting")
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--output-dir", default="results/speculative")
    args = parser.parse_args(argv)
    args.prompts = [p.strip() for p in args.prompts.split(",") if p.strip()]
    ks = [int(k) for k in args.k.split(",") if k.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if set(args.prompts) - set(PROMPTS) or not args.prompts:
        parser.error(f"--prompts must name some of {', '.join(PROMPTS)}")
    if not ks or min(ks) < 0 or args.max_tokens < 2 or args.rounds < 1:
        parser.error("--k values must be >= 0, --max-tokens >= 2, --rounds >= 1")

    from transformers import AutoTokenizer

    from backend.model_loader import resolve_model_dir

    prompts = build_prompts(AutoTokenizer.from_pretrained(resolve_model_dir(None)))
    import torch

    report = {"benchmark": "benchmarks.speculative",
              "command": " ".join(["python -m benchmarks.speculative", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": machine_info(args.threads or torch.get_num_threads()), "runs": []}
    for dtype in dtypes:
        reference: dict[str, list[int]] = {}
        for k in sorted(ks):
            for row in run(dtype, k, prompts, args):
                tokens = row.pop("token_ids")
                if k == min(ks):
                    reference.setdefault(row["prompt"], tokens)
                row["same_tokens_as_lowest_k"] = tokens == reference.get(row["prompt"])
                print(json.dumps(row), flush=True)
                report["runs"].append(row)
    report["machine"]["loadavg_at_end"] = load_average()
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    print(f"wrote {output / 'report.json'} (load average {os.getloadavg()[0]:.2f} at the end)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
