"""What a user runs without us: transformers ``generate``, one request at a time (naive) or in fixed batches
with left padding (static batching). Greedy; EOS off (``eos_token_id=None``), so every request produces
exactly its output length, and each run checks that it did.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks.config import BASELINE_MODES, BenchConfig
from benchmarks.records import RequestRecord, SystemRun
from benchmarks.workload import BenchRequest, Workload, sleep_until


def load_hf_model(model_dir: str):
    """A fresh fp32 transformers model (default attention, SDPA) in eval mode."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class _TokenClock(BaseStreamer):
    """A ``generate`` streamer that only records when each new token appears (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self) -> None:
        pass


class _Generate:
    """Shared by both baselines: a loaded model and a greedy, EOS-free ``generate`` call."""

    def __init__(self, model_dir: str, pad_token_id: int) -> None:
        self.model = load_hf_model(model_dir)
        self.pad = pad_token_id
        self.generate([[1, 2, 3, 4]], 4)  # warm-up, untimed

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], max_new_tokens: int, streamer=None) -> int:
        """Left-pads ``prompts`` into one batch and generates; returns the new tokens per row."""
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + list(p) for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=self.pad, streamer=streamer)
        return out.shape[1] - width

    def close(self) -> None:
        del self.model


class NaiveSystem(_Generate):
    """One request at a time, in arrival order, each with its own ``max_new_tokens``."""

    name = "naive"
    modes = BASELINE_MODES

    def __init__(self, config: BenchConfig, model_dir: str, pad_token_id: int) -> None:
        super().__init__(model_dir, pad_token_id)
        self.progress = config.progress

    def run(self, workload: Workload, mode: str) -> SystemRun:
        requests = workload.requests
        arrivals = workload.arrivals(mode)
        start = time.perf_counter()
        records = []
        for r in tqdm(requests, desc=f"naive {mode}", disable=not self.progress, leave=False):
            sleep_until(start + arrivals[r.index])
            clock = _TokenClock()
            produced = self.generate([list(r.prompt_ids)], r.output_len, clock)
            records.append(RequestRecord(r.index, start + arrivals[r.index], r.output_len, clock.times,
                                         time.perf_counter(), produced))
        return SystemRun("naive", mode, records, start, mean_batch=1.0, batch_source="one request at a time")


class StaticSystem(_Generate):
    """Batches of up to B arrived requests, left-padded; a batch runs until its longest request is done and
    only then is released (every request in it finishes at once), and only then does the next batch start."""

    name = "static"
    modes = BASELINE_MODES

    def __init__(self, config: BenchConfig, model_dir: str, pad_token_id: int) -> None:
        super().__init__(model_dir, pad_token_id)
        self.batch = config.static_batch
        self.progress = config.progress

    def run(self, workload: Workload, mode: str) -> SystemRun:
        arrivals = workload.arrivals(mode)
        pending: deque[BenchRequest] = deque(workload.requests)
        start = time.perf_counter()
        records, rows, steps = [], 0, 0
        with tqdm(total=len(pending), desc=f"static {mode}", disable=not self.progress, leave=False) as bar:
            while pending:
                sleep_until(start + arrivals[pending[0].index])
                batch = []
                while pending and len(batch) < self.batch and start + arrivals[pending[0].index] <= time.perf_counter():
                    batch.append(pending.popleft())
                longest = max(r.output_len for r in batch)
                produced = self.generate([list(r.prompt_ids) for r in batch], longest)
                finish = time.perf_counter()
                records += [RequestRecord(r.index, start + arrivals[r.index], r.output_len, [], finish,
                                          min(produced, r.output_len)) for r in batch]
                rows, steps = rows + len(batch) * longest, steps + longest
                bar.update(len(batch))
        useful = sum(r.output_len for r in workload.requests) / steps
        run = SystemRun("static", mode, records, start, streams=False, mean_batch=rows / steps,
                        batch_source="rows per decode step, padding rows included")
        run.notes += [f"B={self.batch}; no streaming: TTFT = end-to-end latency (the batch is released at once)",
                      f"useful rows per decode step {useful:.1f} of {rows / steps:.1f}"]
        return run
