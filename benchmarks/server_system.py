"""Our engine behind a real tritonserver, timed at the client: one gRPC stream per request, each sent at its
arrival time (in the concurrent mode: once fewer than ``concurrency`` streams are open). The online and
concurrent runs ask for every token as it comes and timestamp each streamed response when the client receives
it; the offline run asks for whole answers (``stream`` false, one response per request), as a batch client would
and as vLLM's offline ``LLM.generate`` returns them (``served_offline_stream`` streams it too: on 2 cores each
streamed response costs the client, tritonserver and the stub CPU that the forward pass then lacks).

The client shares the machine's cores with the server, so it is kept light, as vLLM's benchmark client is: one
asyncio event loop on one channel (``tritonclient.grpc.aio``) rather than a thread and a channel per request,
which cost the server about 5% of its throughput on 2 cores (0.1-0.2 of a core at 256 streams).

The server runs model ``llm`` as the one version of a repository of its own (``tests/triton_server.py``'s
``single_version_repository``: the project's ``config.pbtxt`` and ``model.py``) whose ``engine.json`` sets only the
benchmark's dtype, stream_interval, quantization and step time budget (``max_step_ms``: 0, none, unless
``--max-step-ms``), so that in-process and served runs compute and schedule the same thing: otherwise
``config.pbtxt``'s settings (max_num_seqs 256, max_num_batched_tokens 2048, block_size 16, KV cache sized from
free memory: 20% of it, at most 4 GiB) on the default model, with torch's default thread count in its own
process. ``--max-step-ms 50`` measures both with the served model's own budget. Its running batch is sampled from its ``/metrics`` (``llm_num_requests_running``) while the run lasts.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from tqdm import tqdm

from benchmarks.config import BenchConfig
from benchmarks.records import RequestRecord, SystemRun
from benchmarks.workload import BenchRequest, Workload

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
# The running batch is sampled this often: each sample is a scrape and parse of the whole /metrics page, which
# the client (7.1 ms of a core each, measured) and tritonserver pay on the cores the model computes with.
METRICS_POLL_S = 1.0
MODEL_VERSION = "2"  # the version of a server given to ServerSystem (the project's repository: version 2 serves
# the default model); a server of its own serves one version, 1
STREAMED_OUTPUTS = ("text_output", "output_ids")


def served_settings(config: BenchConfig) -> dict:
    """The ``engine.json`` of the served version: the settings the in-process engine gets from ``config`` that the
    served model's ``config.pbtxt`` would otherwise set differently (its step time budget, 50 ms, holds prompts back
    for the streams' sake: an offline batch then runs in more, smaller steps than the in-process engine's)."""
    return {"dtype": config.dtype, "stream_interval": config.stream_interval, "quantization": config.quantization,
            "max_step_ms": config.max_step_ms}


class ServerSystem:
    name = "server"

    def __init__(self, config: BenchConfig, server=None) -> None:
        """Starts a server of its own, or uses ``server`` (a ``tests/triton_server.TritonServer`` whose version
        2 serves the default model; it is left running by :meth:`close`)."""
        if config.model is not None:
            raise RuntimeError("the server serves the default model only (model_repository/llm); --model differs")
        sys.path.insert(0, str(TESTS_DIR))
        from triton_server import single_version_repository, start_server  # tests/triton_server.py

        from client import LLMClient

        self.owned = server is None
        self.version = MODEL_VERSION
        if server is None:
            workdir = Path(tempfile.mkdtemp(prefix="bench-triton-"))
            self.log_path = workdir / "tritonserver.log"
            repository = single_version_repository(workdir / "model_repository", served_settings(config))
            self.version = "1"
            try:
                server = start_server(self.log_path, model_repository=repository)
            except RuntimeError:  # start-up races with other servers on the machine happen: one more try
                server = start_server(self.log_path, model_repository=repository)
        self.server = server
        self.client = LLMClient(self.server.grpc_url, self.server.http_url, version=self.version)
        self.progress = config.progress
        self.concurrency = config.concurrency
        self.offline_stream = config.served_offline_stream
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

        def poll() -> None:
            while not stop.wait(METRICS_POLL_S):
                value = self._metric("llm_num_requests_running")
                if value:
                    running.append(value)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        concurrency = self.concurrency if mode == "concurrent" else None
        stream = mode != "offline" or self.offline_stream
        asyncio.run(self._stream_all(workload.requests, records, start, arrivals, concurrency, stream, errors, bar))
        time.sleep(3 * METRICS_POLL_S)  # let the server publish its last counters
        stop.set()
        poller.join()
        bar.close()
        if errors:
            raise RuntimeError(f"{len(errors)} server request(s) failed: {errors[:3]}")
        return SystemRun("server", mode, list(records.values()), start, streams=stream,
                         mean_batch=sum(running) / len(running) if running else None,
                         batch_source=f"server llm_num_requests_running, sampled every {METRICS_POLL_S}s when > 0",
                         preemptions=int(self._metric("llm_num_preemptions_total") - preempted_before),
                         notes=["timed at the gRPC client; server torch threads: its own default"]
                         + ([] if stream else ["whole answers (stream false): one response per request"]))

    async def _stream_all(self, requests: list[BenchRequest], records: dict, start: float, arrivals: list[float],
                          concurrency: int | None, stream: bool, errors: list[str], bar) -> None:
        """Sends every request at its arrival time over one channel; with ``concurrency``, at most that many at
        once (a closed loop: a request is due when it gets a slot). Fills ``records`` as responses arrive."""
        import tritonclient.grpc.aio as grpcclient

        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        slots = asyncio.Semaphore(concurrency or len(requests))

        async def one(r: BenchRequest) -> None:
            rec = records[r.index]
            rec.arrival = start + arrivals[r.index]
            await asyncio.sleep(max(0.0, rec.arrival - time.perf_counter()))
            async with slots:
                if concurrency:
                    rec.arrival = time.perf_counter()
                await self._stream_one(client, r, rec, stream, errors, self.version)
            bar.update(1)

        try:
            await asyncio.gather(*(one(r) for r in requests))
        finally:
            await client.close()

    @staticmethod
    async def _stream_one(client, r: BenchRequest, rec: RequestRecord, stream: bool, errors: list[str],
                          version: str) -> None:
        """One request's stream to model version ``version``: with ``stream``, a timestamp per received token, else
        one response with the whole answer (no token times); a failure is appended to ``errors``."""
        from client import LLMClient

        import tritonclient.grpc.aio as grpcclient

        inputs = LLMClient.grpc_inputs(r.prompt_text, stream=stream, max_tokens=r.output_len, temperature=0.0,
                                       ignore_eos=True)
        # The outputs a streaming client reads (the text, and the ids to count tokens by): the others would cost the
        # stub, the server and this client CPU on each response, which on a small machine the forward pass loses.
        outputs = [grpcclient.InferRequestedOutput(name) for name in STREAMED_OUTPUTS]
        done = asyncio.Event()

        async def request():
            yield {"model_name": "llm", "model_version": version, "inputs": inputs, "outputs": outputs,
                   "request_id": uuid.uuid4().hex}
            await done.wait()

        try:
            async for result, error in client.stream_infer(request()):
                now = time.perf_counter()
                if error is not None:
                    raise RuntimeError(str(error))
                new_tokens = result.as_numpy("output_ids").size
                rec.num_output_tokens += new_tokens
                if stream:
                    rec.token_times += [now] * new_tokens
                rec.finish = now
                if result.get_response().parameters["triton_final_response"].bool_param:
                    done.set()  # half-close: Triton ends the stream (never cancel a finished one: operations.md)
        except Exception as exc:  # reported, and the run fails in run()
            errors.append(f"request {r.index}: {exc}")
        finally:
            done.set()

    def _metric(self, name: str) -> float:
        return self.server.metric(name, model="llm", version=self.version)

    def close(self) -> None:
        from triton_server import stop_server

        if self.owned:
            stop_server(self.server)
