"""Our engine behind a real tritonserver, timed at the client: one thread and one gRPC stream per request,
each sent at its arrival time; every streamed response is timestamped when the client receives it.

The server runs model ``llm`` version 2 of a copy of ``model_repository/`` whose ``2/engine.json`` sets only the
benchmark's dtype (so that in-process and served runs compute the same thing): otherwise ``config.pbtxt``'s
settings (max_num_seqs 256, max_num_batched_tokens 2048, block_size 16, KV cache sized from free memory: 20% of
it, at most 4 GiB) on the default model, with torch's default thread count in its own process. Its running batch is sampled from
its ``/metrics`` (``llm_num_requests_running``) while the run lasts.
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

from tqdm import tqdm

from benchmarks.config import BenchConfig
from benchmarks.records import RequestRecord, SystemRun
from benchmarks.workload import BenchRequest, Workload, sleep_until

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
METRICS_POLL_S = 0.25
MODEL_VERSION = "2"


class ServerSystem:
    name = "server"

    def __init__(self, config: BenchConfig) -> None:
        if config.model is not None:
            raise RuntimeError("the server serves the default model only (model_repository/llm); --model differs")
        sys.path.insert(0, str(TESTS_DIR))
        from triton_server import copy_repository, start_server  # tests/triton_server.py: ports, readiness

        from client import LLMClient

        workdir = Path(tempfile.mkdtemp(prefix="bench-triton-"))
        self.log_path = workdir / "tritonserver.log"
        repository = copy_repository(workdir / "model_repository", {MODEL_VERSION: {"dtype": config.dtype}})
        try:
            self.server = start_server(self.log_path, model_repository=repository)
        except RuntimeError:  # start-up races with other servers on the machine happen: one more try
            self.server = start_server(self.log_path, model_repository=repository)
        self.client = LLMClient(self.server.grpc_url, self.server.http_url, version=MODEL_VERSION)
        self.progress = config.progress
        list(self.client.stream_grpc("Hello", max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up

    def run(self, workload: Workload, mode: str) -> SystemRun:
        arrivals = workload.arrivals(mode)
        records = {r.index: RequestRecord(r.index, 0.0, r.output_len) for r in workload.requests}
        errors: list[str] = []
        preempted_before = self._metric("llm_num_preemptions_total")
        running: list[float] = []
        stop = threading.Event()
        bar = tqdm(total=len(records), desc=f"server {mode}", disable=not self.progress, leave=False)
        start = time.perf_counter()

        def one(r: BenchRequest) -> None:
            rec = records[r.index]
            rec.arrival = start + arrivals[r.index]
            sleep_until(rec.arrival)
            try:
                for delta in self.client.stream_grpc(r.prompt_text, max_tokens=r.output_len, temperature=0.0,
                                                     ignore_eos=True):
                    now = time.perf_counter()
                    rec.token_times += [now] * len(delta.token_ids)
                    rec.num_output_tokens = delta.num_output_tokens
                    rec.finish = now
            except Exception as exc:  # reported, and the run fails below
                errors.append(f"request {r.index}: {exc}")
            bar.update(1)

        def poll() -> None:
            while not stop.wait(METRICS_POLL_S):
                value = self._metric("llm_num_requests_running")
                if value:
                    running.append(value)

        threads = [threading.Thread(target=one, args=(r,), daemon=True) for r in workload.requests]
        poller = threading.Thread(target=poll, daemon=True)
        for t in [*threads, poller]:
            t.start()
        for t in threads:
            t.join()
        time.sleep(3 * METRICS_POLL_S)  # let the server publish its last counters
        stop.set()
        poller.join()
        bar.close()
        if errors:
            raise RuntimeError(f"{len(errors)} server request(s) failed: {errors[:3]}")
        return SystemRun("server", mode, list(records.values()), start,
                         mean_batch=sum(running) / len(running) if running else None,
                         batch_source=f"server llm_num_requests_running, sampled every {METRICS_POLL_S}s when > 0",
                         preemptions=int(self._metric("llm_num_preemptions_total") - preempted_before),
                         notes=["timed at the gRPC client; server torch threads: its own default"])

    def _metric(self, name: str) -> float:
        return self.server.metric(name, model="llm", version=MODEL_VERSION)

    def close(self) -> None:
        from triton_server import stop_server

        stop_server(self.server)
