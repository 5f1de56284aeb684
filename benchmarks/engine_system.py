"""Our engine in process: the loop thread steps while a feeder thread adds requests at their arrival times (or,
in the concurrent mode, whenever fewer than ``concurrency`` are in flight); the caller reads every delta from one
shared queue and timestamps it there (what a user of the engine sees).

The engine's ``step_log`` keeps its stats snapshot after every step: the running batch and the KV pool,
tokens stored / slots reserved = sum(num_computed_tokens of running requests) / (used_blocks * block_size).
"""

from __future__ import annotations

import gc
import queue
import threading
import time

from tqdm import tqdm

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.config import BenchConfig
from benchmarks.records import RequestRecord, SystemRun
from benchmarks.workload import Workload, sleep_until


def engine_config(config: BenchConfig) -> EngineConfig:
    """The engine settings of the benchmark (those of the server's ``llm`` version 2)."""
    return EngineConfig(model=config.model, dtype=config.dtype, num_threads=config.threads,
                        max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
                        block_size=config.block_size, kv_cache_memory_bytes=config.kv_cache_bytes,
                        max_step_ms=config.max_step_ms, stream_interval=config.stream_interval,
                        quantization=config.quantization)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def step_until_all_decoding(engine: LLMEngine) -> None:
    """Steps a caller-driven engine (no loop thread) until every added request is admitted and prefilled, so
    the next step is a pure decode of all of them (requests sit in the inbox until the first step)."""
    engine.step()
    while engine.stats().num_waiting or engine.stats().last_step_num_prefills:
        engine.step()


class StepTrace:
    """Per-step samples from the engine's ``step_log`` (snapshots taken after each step): time (s),
    requests in that step, running requests, KV blocks used, tokens stored."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.rows: list[tuple[float, int, int, int, int]] = []
        engine.step_log = []

    def stop(self) -> None:
        """Takes the rows from the engine's log and stops logging."""
        log, self.engine.step_log = self.engine.step_log or [], None
        self.rows = [(s.time, s.last_step_num_scheduled, s.num_running, s.kv.used_blocks, s.num_computed_tokens)
                     for s in log]

    def summary(self, start: float) -> tuple[float, dict, dict]:
        """(mean requests per step, KV figures, timeline for the plots)."""
        kv = self.engine.stats().kv
        block = kv.tokens_per_block
        reserved = sum(r[3] for r in self.rows) * block
        stored = sum(r[4] for r in self.rows)
        ratio = stored / reserved if reserved else 1.0
        mean_batch = sum(r[1] for r in self.rows) / len(self.rows)
        timeline = {"t_s": [r[0] - start for r in self.rows], "step_requests": [r[1] for r in self.rows],
                    "running": [r[2] for r in self.rows],
                    "kv_used_pct": [100 * r[3] / kv.num_blocks for r in self.rows],
                    "kv_waste_pct": [100 * (1 - r[4] / (r[3] * block)) if r[3] else 0.0 for r in self.rows]}
        kv_figures = {"stored_tokens": stored, "reserved_slots": reserved, "stored_per_reserved": ratio,
                      "waste_pct": 100 * (1 - ratio), "num_blocks": kv.num_blocks, "block_size": block,
                      "peak_used_pct": max(timeline["kv_used_pct"], default=0.0)}
        return mean_batch, kv_figures, timeline


class EngineSystem:
    name = "engine"

    def __init__(self, config: BenchConfig) -> None:
        self.engine = LLMEngine(engine_config(config))
        self.progress = config.progress
        self.concurrency = config.concurrency
        # Warm-up, untimed, on the loop thread as the runs step: a step on this thread would give the process a
        # second OpenMP pool, which makes every barrier sleep (backend.cpu_threads).
        self.engine.start()
        for _ in self.engine.generate([1, 2, 3, 4], greedy(4)):
            pass
        self.engine.shutdown()
        # As the served model does after loading (model_repository/llm/1/model.py): the startup heap leaves the
        # collector's view, so the runs do not pay full collections over the model's and libraries' objects.
        gc.collect()
        gc.freeze()

    def run(self, workload: Workload, mode: str) -> SystemRun:
        engine, arrivals = self.engine, workload.arrivals(mode)
        records = {r.index: RequestRecord(r.index, 0.0, r.output_len) for r in workload.requests}
        first_tokens: dict[int, list[int]] = {r.index: [] for r in workload.requests}
        sink: queue.Queue = queue.Queue()
        # A slot per request in flight: unbounded except in the closed loop, where the feeder waits for one.
        slots = threading.Semaphore(self.concurrency if mode == "concurrent" else len(records))
        preempted_before = engine.stats().num_preemptions
        # Every mode starts with nothing cached: the modes send the same prompts (and llama.cpp's server starts
        # afresh for each), so a later mode would otherwise skip the prefill of every prompt.
        if not engine.reset_prefix_cache():
            raise RuntimeError("the engine still holds KV blocks before a run")
        trace = StepTrace(engine)
        engine.start()
        start = time.perf_counter()

        def feed() -> None:
            for r in workload.requests:
                sleep_until(start + arrivals[r.index])
                slots.acquire()  # closed loop: due once a slot frees, so its latencies count from then
                records[r.index].arrival = time.perf_counter() if mode == "concurrent" else start + arrivals[r.index]
                engine.add_request(list(r.prompt_ids), greedy(r.output_len), request_id=str(r.index), sink=sink)

        feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
        feeder.start()
        with tqdm(total=len(records), desc=f"engine {mode}", disable=not self.progress, leave=False) as bar:
            done = 0
            while done < len(records):
                out = sink.get()
                now = time.perf_counter()
                rec = records[int(out.request_id)]
                rec.token_times += [now] * len(out.token_ids)
                first_tokens[rec.index] = (first_tokens[rec.index] + out.token_ids)[:16]
                rec.num_output_tokens = out.num_output_tokens
                if out.finished:
                    if out.finish_reason != "length":
                        raise RuntimeError(f"engine request {out.request_id} ended with {out.finish_reason}: "
                                           f"{out.error}")
                    rec.finish = now
                    slots.release()
                    done += 1
                    bar.update(1)
        feeder.join()
        engine.shutdown()
        trace.stop()
        mean_batch, kv, timeline = trace.summary(start)
        return SystemRun("engine", mode, list(records.values()), start, mean_batch=mean_batch,
                         batch_source="requests per engine step", kv=kv, timeline=timeline,
                         preemptions=engine.stats().num_preemptions - preempted_before, first_tokens=first_tokens)

    def close(self) -> None:
        self.engine.shutdown()
        del self.engine
        gc.unfreeze()
