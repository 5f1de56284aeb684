"""transformers' own continuous batching (``transformers.generation.continuous_batching``).

``model.generate_batch(inputs, ...)`` is a thin wrapper: it opens ``continuous_batching_context_manager`` and
calls ``manager.add_requests(inputs, max_new_tokens=...)`` with one ``max_new_tokens`` for all. We use that
same manager directly so that each request gets its own ``max_new_tokens`` (``manager.add_request`` takes
it; no tokens wasted past a request's length) and so that online requests can arrive while it runs.
It gets our engine's limits: 16-token pages, ``max_batch_tokens`` and ``max_requests_per_batch``, and our
KV pool capped at what the whole workload needs at once. generate_batch does not stream: per-token times are its own
``record_timestamps`` (taken when each token is sampled), which is slightly in its favour against our
engine, timed where its output queue is read.
"""

from __future__ import annotations

import threading
import time

import torch
from tqdm import tqdm
from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.utils import WorkloadHints

from backend.cpu_threads import run_on_fresh_thread
from backend.model_runner import kv_bytes_per_block
from benchmarks.config import BASELINE_MODES, BenchConfig
from benchmarks.hf_baselines import load_hf_model
from benchmarks.records import RequestRecord, SystemRun, busy_mean
from benchmarks.workload import Workload, sleep_until


class GenerateBatchSystem:
    name = "generate_batch"
    modes = BASELINE_MODES

    def __init__(self, config: BenchConfig, model_dir: str, workload: Workload) -> None:
        # Loaded on a thread that ends with it: transformers generates on a thread of its own, and a pool of OpenMP
        # workers left on this one would put that thread's barriers to sleep (backend.cpu_threads).
        self.model = run_on_fresh_thread(lambda: load_hf_model(model_dir))
        self.progress = config.progress
        # Our engine's pool (same bytes, same 16-token blocks), capped at what every request of the workload needs
        # at once: never short of KV, and its SDPA mask, sized by the pool, stays small.
        ours = config.kv_cache_bytes // kv_bytes_per_block(self.model.config, config.block_size, torch.float32)
        needed = sum(-(-(len(r.prompt_ids) + r.output_len) // config.block_size) for r in workload.requests)
        num_blocks = min(ours, needed + config.max_num_seqs)
        self.settings = dict(page_size=config.block_size, num_blocks=num_blocks,
                             max_batch_tokens=config.max_num_batched_tokens,
                             max_requests_per_batch=config.max_num_seqs)
        self.cb_config = ContinuousBatchingConfig(**self.settings)
        self.hints = WorkloadHints(max_prompt_length=max(len(r.prompt_ids) for r in workload.requests),
                                   max_generated_length=max(r.output_len for r in workload.requests),
                                   num_requests=len(workload.requests))
        # eos_token_id=-1 disables EOS (what generate_batch does when there is none).
        self.gen_config = GenerationConfig(do_sample=False, max_new_tokens=self.hints.max_generated_length,
                                           eos_token_id=-1, pad_token_id=0)

    def run(self, workload: Workload, mode: str) -> SystemRun:
        arrivals = workload.arrivals(mode)
        records = {r.index: RequestRecord(r.index, 0.0, r.output_len) for r in workload.requests}
        spans = []
        with self.model.continuous_batching_context_manager(
                generation_config=self.gen_config, continuous_batching_config=self.cb_config,
                workload_hints=self.hints, warmup=True, block=True, timeout=5) as manager:
            start = time.perf_counter()

            def feed() -> None:
                for r in workload.requests:
                    sleep_until(start + arrivals[r.index])
                    manager.add_request(list(r.prompt_ids), request_id=str(r.index), max_new_tokens=r.output_len,
                                        record_timestamps=True)

            feeder = threading.Thread(target=feed, name="bench-feeder", daemon=True)
            feeder.start()
            with tqdm(total=len(records), desc=f"generate_batch {mode}", disable=not self.progress,
                      leave=False) as bar:
                done = 0
                while done < len(records):
                    result = manager.get_result(timeout=1)
                    if result is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers' continuous batching loop stopped")
                        continue
                    if not result.is_finished():
                        continue
                    if result.error:
                        raise RuntimeError(f"generate_batch request {result.request_id} failed: {result.error}")
                    rec = records[int(result.request_id)]
                    rec.arrival, rec.finish = start + arrivals[rec.index], time.perf_counter()
                    rec.token_times = list(result.timestamps or [])
                    rec.num_output_tokens = len(result.generated_tokens)
                    spans.append(result.lifespan)
                    done += 1
                    bar.update(1)
            feeder.join()
        run = SystemRun("generate_batch", mode, list(records.values()), start, mean_batch=busy_mean(spans),
                        batch_source="requests in flight (scheduled to finished), time-weighted while busy")
        run.notes.append(f"per-request max_new_tokens via the generate_batch manager; {self.settings}")
        return run

    def close(self) -> None:
        del self.model
