"""``python -m benchmarks [--quick] [--num-requests N] [--seed S] [--rate R] [--concurrency C] [--systems a,b]
[--modes m,n] [--output-dir DIR]``"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from backend.config import QUANTIZATIONS
from benchmarks.config import LLAMACPP_QUANTS, MODES, QUICK, SYSTEMS, BenchConfig


def parse_args(argv: list[str] | None = None) -> BenchConfig:
    parser = build_parser()
    args = parser.parse_args(argv)
    return _config(parser, args)


def build_parser() -> argparse.ArgumentParser:
    """The command line's options (``benchmarks.matrix`` passes options on to it and checks them here)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="small workload, shorter outputs, naive on a subset: about 3 minutes on 2 cores")
    parser.add_argument("--num-requests", type=int, help="requests in the workload (default 256; quick 12)")
    parser.add_argument("--seed", type=int, help="workload seed (default 0)")
    parser.add_argument("--rate", type=float, help="online arrival rate, requests/s (default 1.0; quick 3.0)")
    parser.add_argument("--concurrency", type=int,
                        help="requests in flight in the concurrent mode, a closed loop (default 16; quick 4)")
    parser.add_argument("--systems", help=f"comma-separated subset of {','.join(SYSTEMS)} (default all but the peers "
                                          f"vllm and llamacpp, which install vLLM or compile llama.cpp on first use)")
    parser.add_argument("--modes", help=f"comma-separated subset of {','.join(MODES)} (default all)")
    parser.add_argument("--model", help="a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights and KV cache of every system (default auto: the engine's rule, bf16 where it is at least as fast)")
    parser.add_argument("--threads", type=int, help="torch threads for every system (default: torch's default)")
    parser.add_argument("--static-batch", type=int, help="static batching batch size (default 16)")
    parser.add_argument("--naive-max-requests", type=int,
                        help="run naive on the first N requests only (default 8; quick 4; 0 = all)")
    parser.add_argument("--static-max-requests", type=int,
                        help="run static batching on the first N requests only (default 64; quick all; 0 = all)")
    parser.add_argument("--online-max-requests", type=int,
                        help="run every system online on the first N requests only (default 64; quick all; 0 = all)")
    parser.add_argument("--max-num-seqs", type=int, help="our engine's max_num_seqs (default 256)")
    parser.add_argument("--max-num-batched-tokens", type=int, help="our engine's max_num_batched_tokens (default 2048)")
    parser.add_argument("--stream-interval", type=int,
                        help="our engine's and server's stream_interval: tokens per streamed delta after the first "
                             "(default 1)")
    parser.add_argument("--max-step-ms", type=float,
                        help="our engine's and server's step time budget in ms (default 0: none, as vLLM schedules; "
                             "the served model's config.pbtxt sets 50)")
    parser.add_argument("--rounds", type=int,
                        help="run the systems this many times in turn; ratios per round and their median (default 1)")
    parser.add_argument("--served-offline-stream", action="store_true",
                        help="the server's offline run streams every token (default: whole answers, stream false)")
    parser.add_argument("--quantization", choices=QUANTIZATIONS,
                        help="our engine's quantization (default none; int8: weight-only int8 linears; "
                             "w8a8: int8 weights and activations)")
    parser.add_argument("--shape", help="a model shape with random weights instead of --model: "
                                        "smollm2-360m, smollm2-1.7b, llama-3b (benchmarks.shapes; written once)")
    parser.add_argument("--limits", action="store_true",
                        help="measure memory bandwidth and GEMM peak and report the model's bounds (on with --shape)")
    parser.add_argument("--llamacpp-quant", choices=LLAMACPP_QUANTS,
                        help="llama.cpp runs its own quantized weights (llama-quantize) instead of --dtype ones: "
                             "faster, and different numbers (its greedy tokens differ)")
    parser.add_argument("--output-dir", help="where report.json, report.md and the PNGs go (default results/bench)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def _config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> BenchConfig:

    values = dict(QUICK) if args.quick else {}
    values["quick"] = args.quick
    for field in ("num_requests", "seed", "rate", "concurrency", "model", "dtype", "threads", "static_batch",
                  "max_num_seqs", "max_num_batched_tokens", "stream_interval", "rounds", "output_dir", "shape",
                  "llamacpp_quant", "quantization", "max_step_ms"):
        if getattr(args, field) is not None:
            values[field] = getattr(args, field)
    for field in ("naive_max_requests", "static_max_requests", "online_max_requests"):
        if getattr(args, field) is not None:
            values[field] = getattr(args, field) or None
    if args.systems:
        values["systems"] = tuple(s.strip() for s in args.systems.split(",") if s.strip())
    if args.modes:
        values["modes"] = tuple(s.strip() for s in args.modes.split(",") if s.strip())
    if args.shape and args.model:
        parser.error("--shape and --model are alternatives")
    values["limits"] = args.limits or bool(args.shape)
    values["progress"] = not args.no_progress
    values["served_offline_stream"] = args.served_offline_stream
    for field in ("naive_max_requests", "static_max_requests", "online_max_requests"):
        if getattr(args, field) is not None and getattr(args, field) < 0:
            parser.error(f"--{field.replace('_', '-')} must be >= 0 (0 = all requests)")
    known = {f.name for f in dataclasses.fields(BenchConfig)}
    try:
        return BenchConfig(**{k: v for k, v in values.items() if k in known})
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = parse_args(argv)
    if argv is None:  # run as a program (not called by a test): the in-process systems get the served allocator
        preload_allocator("benchmarks", sys.argv[1:])
    if not config.progress:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()  # its "Loading weights" bars too
    from benchmarks.report import markdown  # torch and transformers load after argument errors are reported
    from benchmarks.runner import run_benchmark

    args = sys.argv[1:] if argv is None else argv
    report = run_benchmark(config, command=" ".join(["python -m benchmarks", *args]))
    print(markdown(report))
    print("written:", ", ".join(report["files"]))
    return 0


MALLOC_ENV = "LLM_BENCH_MALLOC"  # the allocator of this process's in-process systems, in words (the report's)
PRELOAD_ENV = "LLM_BENCH_PRELOAD"  # the library this process preloaded for them, which peers must not inherit


def preload_allocator(module: str, args: list[str]) -> None:
    """Runs ``python -m MODULE ARGS`` again with the allocator the served engine gets (``serve.allocator``:
    tcmalloc where installed; ``LLM_MALLOC=system`` keeps glibc's), once, so that the in-process engine is
    measured as served; the allocator, in words, is then in ``os.environ[MALLOC_ENV]``. Peers started from here
    leave it out (``serve.allocator.without``)."""
    if MALLOC_ENV in os.environ:
        return
    from serve import allocator

    env, malloc = allocator.preload(dict(os.environ), os.environ.get("LLM_MALLOC", "auto"))
    env[MALLOC_ENV] = malloc
    if env.get("LD_PRELOAD") == os.environ.get("LD_PRELOAD"):
        os.environ[MALLOC_ENV] = malloc
        return
    env[PRELOAD_ENV] = allocator.tcmalloc_path() or ""
    os.execve(sys.executable, [sys.executable, "-m", module, *args], env)


if __name__ == "__main__":
    sys.exit(main())
