"""How close our engine comes to the memory traffic its workload cannot avoid.

``python -m benchmarks.memory_floor [--dtype bfloat16] [--gbps 18] [--num-requests 256]``

On a CPU, a decode step reads every weight once and each running request's KV cache once; at small batches
(and, on 2 cores, at all the batches of the benchmark's workload) that traffic, not arithmetic, bounds the step.
This runs the benchmark's offline workload in process, step by step through the engine's own scheduler, and
counts for each step the bytes it must read:

- weights: the Llama-family matrices (QKV, O, gate, up, down per layer, and the LM head, read once per step
  whether or not it is tied to the embedding; the embedding's few rows, norms and biases are left out);
- KV: each scheduled request's cached tokens before the step (``num_computed_tokens``) x layers x 2 (K and V) x
  KV heads x head_dim x the element size.

It prints, per kind of step, the time, the bytes and the rate they were read at, and with ``--gbps`` the run's
floor: its bytes at that bandwidth (what a plain multi-threaded reader of a large buffer gets on the machine).
Both our engine and vLLM read these same bytes, so on a machine where they bound the step the two engines'
ratio is set by how much of the bandwidth each keeps busy.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

from benchmarks.config import BenchConfig

PHASES = ("steps with prefill", "decode, batch 1-16", "decode, batch 17-64", "decode, batch 65+")


def linear_shapes(model_config) -> list[tuple[int, int, int]]:
    """(count, out_features, in_features) of the matrices a step reads once, for a Llama-family config: per layer
    the fused QKV, O, the fused gate-up and down; the LM head."""
    hidden, inter, layers = model_config.hidden_size, model_config.intermediate_size, model_config.num_hidden_layers
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    q, kv = heads * head_dim, kv_heads * head_dim
    return [(layers, q + 2 * kv, hidden), (layers, hidden, q), (layers, 2 * inter, hidden), (layers, hidden, inter),
            (1, model_config.vocab_size, hidden)]


def weight_bytes(model_config, element_size: int) -> int:
    """Bytes of the matrices a step reads once (see the module docstring), for a Llama-family config."""
    return sum(count * rows * cols for count, rows, cols in linear_shapes(model_config)) * element_size


def int8_weight_bytes(model_config) -> int:
    """Bytes of the same matrices with ``quantization: int8``: one byte per weight and an fp32 scale per output row."""
    return sum(count * rows * (cols + 4) for count, rows, cols in linear_shapes(model_config))


@dataclass
class Phase:
    steps: int = 0
    seconds: float = 0.0
    bytes: int = 0


@dataclass
class FloorRun:
    """One run: per phase (:data:`PHASES`) its steps, time and bytes; the workload's output tokens."""

    output_tokens: int
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    phases: dict[str, Phase] = field(default_factory=lambda: {name: Phase() for name in PHASES})

    @property
    def seconds(self) -> float:
        return sum(p.seconds for p in self.phases.values())

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.phases.values())

    def markdown(self, gbps: float | None = None) -> str:
        lines = ["| steps | count | seconds | GB read | GB/s |", "|---|---:|---:|---:|---:|"]
        for name, p in [*self.phases.items(), ("all", Phase(sum(p.steps for p in self.phases.values()),
                                                              self.seconds, self.bytes))]:
            rate = f"{p.bytes / p.seconds / 1e9:.1f}" if p.seconds else "n/a"
            lines.append(f"| {name} | {p.steps} | {p.seconds:.1f} | {p.bytes / 1e9:.1f} | {rate} |")
        lines.append(f"\nWeights {self.weight_bytes_per_step / 1e6:.0f} MB a step, KV "
                     f"{self.kv_bytes_per_token / 1e3:.1f} kB a cached token; {self.output_tokens} output tokens "
                     f"in {self.seconds:.1f} s ({self.output_tokens / self.seconds:.0f} tokens/s).")
        if gbps:
            floor = self.bytes / (gbps * 1e9)
            lines.append(f"At {gbps:g} GB/s these bytes take at least {floor:.1f} s "
                         f"({self.output_tokens / floor:.0f} tokens/s): this run took {self.seconds / floor:.1f}x that.")
        return "\n".join(lines)


def run(config: BenchConfig) -> FloorRun:
    """Steps the offline workload of ``config`` through our engine in process, counting each step's bytes."""
    from transformers import AutoTokenizer

    from backend import LLMEngine
    from backend.model_loader import resolve_model_dir
    from backend.model_runner import kv_bytes_per_block
    from benchmarks.engine_system import engine_config, greedy
    from benchmarks.workload import make_workload

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(config.model)))
    workload = make_workload(tokenizer, config)
    engine = LLMEngine(engine_config(config))
    engine.add_request([1, 2, 3, 4], greedy(4))  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    runner = engine.engine_core.model_runner  # this thread steps: it may read the core
    model_config = (runner.decoder or runner.model).config
    element_size = runner.kv_caches[0][0].element_size()
    result = FloorRun(workload.total_output_tokens, weight_bytes(model_config, element_size),
                      kv_bytes_per_block(model_config, runner.block_size, runner.dtype) // runner.block_size)
    for r in workload.requests:
        engine.add_request(list(r.prompt_ids), greedy(r.output_len))
    while engine.has_unfinished_requests():
        cached = sum(r.num_computed_tokens for r in engine.engine_core.scheduler.running)
        begin = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - begin
        stats = engine.stats()
        batch = stats.last_step_num_scheduled
        name = (PHASES[0] if stats.last_step_num_prefills else PHASES[1] if batch <= 16
                else PHASES[2] if batch <= 64 else PHASES[3])
        phase = result.phases[name]
        phase.steps += 1
        phase.seconds += seconds
        phase.bytes += result.weight_bytes_per_step + cached * result.kv_bytes_per_token
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_floor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--gbps", type=float, help="a bandwidth to state the run's floor at, GB/s")
    args = parser.parse_args(argv)
    values = {"dtype": args.dtype, "num_requests": args.num_requests, "progress": False}
    if args.threads:
        values["threads"] = args.threads
    print(run(BenchConfig(**values)).markdown(args.gbps))


if __name__ == "__main__":
    main()
