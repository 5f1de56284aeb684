"""The serving path at GPU token rates: everything but the forward pass, through a real tritonserver.

``python -m benchmarks.serving_path [--concurrency 1,64,256,1024] [--max-tokens 128] [--duration 10]
[--client-processes 2] [--output-dir results/serving_path]`` (``make bench-serving-path``).

The model is the zero-cost runner (``model_runner: zero_cost``, :mod:`backend.zero_cost_runner`): the real
scheduler, KV cache manager, output processor and Triton adapter, with a forward pass that takes no time, as a
stand-in for an accelerator much faster than these CPUs. Two measurements:

- In process: the engine loop alone (``LLMEngine.step`` in a loop, no Triton) at a decode batch of 256:
  steps/s by the wall clock and by the loop thread's CPU time.
- Through tritonserver: ``C`` concurrent gRPC streams (tritonclient's asyncio client, one bidirectional stream
  per request, as the OpenAI frontend opens them), closed loop: each stream sends its next request (a short
  prompt, ``max_tokens`` tokens, ``ignore_eos``) as soon as the last one ended. Spread over
  ``--client-processes`` processes so that the client is not the bottleneck; their CPU time is reported.
  Over a ``--duration`` window after a warm-up: tokens/s received by the clients, responses/s, the engine's
  steps/s and its mean batch, and from the model's own metrics (``llm_thread_cpu_seconds_total``) the CPU
  time per engine step of the engine loop thread and of the adapter's threads (sender, cancellation sweep).
  Every request's token ids are checked against the zero-cost token cycle: a lost, duplicated or reordered
  token is an error.

The server runs a copy of ``model_repository/`` with version 2 only, set to ``model_runner: zero_cost``,
``max_num_seqs`` = the largest concurrency (every stream runs; none waits) and a KV pool large enough for all.
Timings depend on what else runs on the machine: the report records the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
PROMPT = "Tell me about rivers."
MODEL_VERSION = "2"
ENGINE_BATCH = 256


# -- in process ------------------------------------------------------------------------------------------
def engine_loop_steps(batch: int = ENGINE_BATCH, steps: int = 300) -> dict:
    """The engine loop alone with the zero-cost model: ``batch`` requests decoding together, ``steps`` timed.

    Returns:
        ``steps_per_s`` (wall), ``cpu_ms_per_step`` (this thread's CPU time) and the batch measured.
    """
    from backend import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model_runner="zero_cost", max_num_seqs=batch, num_blocks=batch * 64))
    params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        engine.add_request(PROMPT, params, request_id=str(i))
    while engine.stats().last_step_num_scheduled < batch or engine.stats().last_step_num_prefills:
        engine.step()
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(steps):
        engine.step()
    wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
    measured_batch = engine.stats().last_step_num_scheduled
    engine.shutdown()
    return {"batch": measured_batch, "steps": steps, "steps_per_s": steps / wall,
            "cpu_ms_per_step": 1000 * cpu / steps, "steps_per_cpu_s": steps / cpu}


# -- the server ------------------------------------------------------------------------------------------
def start_zero_cost_server(workdir: Path, max_num_seqs: int, max_tokens: int):
    """tritonserver on a copy of the model repository serving version 2 only, with the zero-cost runner."""
    sys.path.insert(0, str(TESTS_DIR))
    from triton_server import copy_repository, start_server

    settings = {"model_runner": "zero_cost", "max_num_seqs": max_num_seqs,
                "num_blocks": max_num_seqs * (max_tokens // 16 + 4), "max_num_waiting_requests": 4 * max_num_seqs}
    repository = copy_repository(workdir / "model_repository", {MODEL_VERSION: settings})
    config = repository / "llm" / "config.pbtxt"
    policy = "version_policy: { all: {} }"
    if policy not in config.read_text():
        raise RuntimeError(f"{config} has no {policy!r} line to narrow to version {MODEL_VERSION}")
    only = f"version_policy: {{ specific: {{ versions: [{MODEL_VERSION}] }} }}"
    config.write_text(config.read_text().replace(policy, only))
    return start_server(workdir / "tritonserver.log", model_repository=repository)


def server_counters(server) -> dict:
    """The model's counters now: steps, tokens, responses, and CPU seconds per thread."""
    samples = server.metrics()
    out = {"steps": 0.0, "tokens": 0.0, "responses": 0.0, "cpu": {}}
    names = {"llm_engine_steps_total": "steps", "llm_generation_tokens_total": "tokens",
             "llm_responses_total": "responses"}
    for (name, labels), value in samples.items():
        labels = dict(labels)
        if labels.get("model") != "llm" or labels.get("version") != MODEL_VERSION:
            continue
        if name in names:
            out[names[name]] = value
        elif name == "llm_thread_cpu_seconds_total":
            out["cpu"][labels["thread"]] = value
    return out


# -- the clients -----------------------------------------------------------------------------------------
def _client_process(url: str, streams: int, max_tokens: int, cycle: list[int], go, times, results) -> None:
    """Once ``go`` is set, runs ``streams`` closed-loop streams from ``times[0]`` to ``times[2]`` (``time.time()``
    seconds) and puts its counts (tokens and responses received from ``times[1]`` on, CPU seconds over that
    window, errors) on ``results``. ``cycle``: the zero-cost tokens, position ``p`` -> ``cycle[p % len]``."""
    import numpy as np  # noqa: F401  (imported before the start: a loaded machine takes seconds)
    import tritonclient.grpc.aio  # noqa: F401

    results.put("ready")
    go.wait()
    start, window = times[0], (times[1], times[2])
    results.put(asyncio.run(_client_main(url, streams, max_tokens, cycle, start, window)))


async def _client_main(url: str, streams: int, max_tokens: int, cycle: list[int], start: float,
                       window: tuple) -> dict:
    import numpy as np
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    counts = {"tokens": 0, "responses": 0, "requests": 0, "errors": [], "cpu": 0.0}

    def tensor(name, value, datatype):
        t = grpcclient.InferInput(name, [1], datatype)
        t.set_data_from_numpy(np.array([value], dtype=np.object_ if datatype == "BYTES" else None))
        return t

    inputs = [tensor("text_input", PROMPT.encode(), "BYTES"), tensor("stream", True, "BOOL"),
              tensor("max_tokens", np.int32(max_tokens), "INT32"), tensor("ignore_eos", True, "BOOL")]

    async def one_request() -> None:
        done = asyncio.Event()

        async def requests():
            yield {"model_name": "llm", "model_version": MODEL_VERSION, "inputs": inputs,
                   "request_id": uuid.uuid4().hex}
            await done.wait()

        ids, reason, num_input = [], "", 0
        responses = client.stream_infer(requests())
        try:
            async for result, error in responses:
                if error is not None:
                    counts["errors"].append(str(error))
                    return
                now = time.time()
                new = result.as_numpy("output_ids")
                if window[0] <= now < window[1]:
                    counts["tokens"] += new.size
                    counts["responses"] += 1
                ids.extend(new.tolist())
                reason = result.as_numpy("finish_reason")[0]
                if result.get_response().parameters["triton_final_response"].bool_param:
                    num_input = int(result.as_numpy("num_input_tokens")[0])
                    done.set()  # half-close: Triton ends the stream (never cancel a finished one: operations.md)
        finally:
            done.set()
        want = [cycle[(num_input + k) % len(cycle)] for k in range(max_tokens)]
        if ids != want or reason != b"length":
            first = next((i for i, (a, b) in enumerate(zip(ids, want)) if a != b), min(len(ids), len(want)))
            counts["errors"].append(f"got {len(ids)} tokens (finish {reason!r}), want {max_tokens} in the "
                                    f"zero-cost order: first differing at {first}")
        counts["requests"] += 1

    async def stream() -> None:
        while time.time() < window[1]:
            await one_request()

    async def cpu_at(when: float) -> float:
        await asyncio.sleep(max(0.0, when - time.time()))
        return time.process_time()

    await asyncio.sleep(max(0.0, start - time.time()))
    cpu_start = asyncio.ensure_future(cpu_at(window[0]))
    cpu_end = asyncio.ensure_future(cpu_at(window[1]))
    await asyncio.gather(*(stream() for _ in range(streams)))
    counts["cpu"] = await cpu_end - await cpu_start
    await client.close()
    if len(counts["errors"]) > 5:
        counts["errors"] = counts["errors"][:5] + [f"... {len(counts['errors']) - 5} more"]
    return counts


def run_concurrency(server, concurrency: int, max_tokens: int, duration: float, warmup: float,
                    processes: int, cycle: list[int]) -> dict:
    """One closed-loop run at ``concurrency`` streams; returns the row of the table (see the module docstring)."""
    processes = max(1, min(processes, concurrency))
    context = multiprocessing.get_context("spawn")
    results, go, times = context.Queue(), context.Event(), context.Array("d", 3)
    workers = [context.Process(target=_client_process, args=(
        server.grpc_url, concurrency // processes + (i < concurrency % processes), max_tokens, cycle, go, times,
        results)) for i in range(processes)]
    for w in workers:
        w.start()
    for _ in workers:
        if results.get(timeout=300) != "ready":
            raise RuntimeError("a client process failed to start")
    start = time.time() + 0.5
    window = (start + warmup, start + warmup + duration)
    times[:] = [start, *window]
    go.set()
    time.sleep(max(0.0, window[0] - time.time()))
    before, cpu_before = server_counters(server), process_cpu_seconds(server.process.pid)
    load_before = os.getloadavg()[0]
    time.sleep(max(0.0, window[1] - time.time()))
    after, cpu_after = server_counters(server), process_cpu_seconds(server.process.pid)
    counts = [results.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    steps = after["steps"] - before["steps"]
    cpu = {name: after["cpu"].get(name, 0.0) - before["cpu"].get(name, 0.0) for name in after["cpu"]}
    adapter = sum(v for k, v in cpu.items() if k != "llm-engine-loop")
    tokens = sum(c["tokens"] for c in counts)
    return {
        "concurrency": concurrency, "duration_s": duration, "max_tokens": max_tokens,
        "client_tokens_per_s": tokens / duration,
        "client_responses_per_s": sum(c["responses"] for c in counts) / duration,
        "tokens_per_response": tokens / max(1, sum(c["responses"] for c in counts)),
        "requests_completed": sum(c["requests"] for c in counts),
        "engine_steps_per_s": steps / duration,
        "engine_tokens_per_step": (after["tokens"] - before["tokens"]) / max(1.0, steps),
        "engine_loop_cpu_ms_per_step": 1000 * cpu.get("llm-engine-loop", 0.0) / max(1.0, steps),
        "adapter_cpu_ms_per_step": 1000 * adapter / max(1.0, steps),
        "thread_cpu_s": cpu,
        "client_processes": len(workers),
        "client_cpu_cores": sum(c["cpu"] for c in counts) / duration,
        "tritonserver_cpu_cores": (cpu_after["server"] - cpu_before["server"]) / duration,
        "stub_cpu_cores": (cpu_after["stub"] - cpu_before["stub"]) / duration,
        "errors": [e for c in counts for e in c["errors"]],
        "load_average_1m": [load_before, os.getloadavg()[0]],
    }


def process_cpu_seconds(server_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of tritonserver itself and of its children (the backend stub)."""
    import psutil

    server = psutil.Process(server_pid)
    children = 0.0
    for child in server.children(recursive=True):
        try:
            times = child.cpu_times()
            children += times.user + times.system
        except psutil.NoSuchProcess:
            pass
    times = server.cpu_times()
    return {"server": times.user + times.system, "stub": children}


def wait_idle(server, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while any(server.metric(name, model="llm", version=MODEL_VERSION)
              for name in ("llm_num_requests_running", "llm_num_requests_waiting")):
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not go idle between runs")
        time.sleep(0.2)


def markdown(report: dict) -> str:
    engine = report["engine_loop"]
    lines = [f"In process, engine loop at batch {engine['batch']}: {engine['steps_per_s']:.0f} steps/s "
             f"({engine['cpu_ms_per_step']:.2f} ms CPU per step, {engine['steps_per_cpu_s']:.0f} steps per CPU second)"
             if engine else "In process: not measured", "",
             "| concurrent streams | tokens/s to clients | tokens per response | engine steps/s | tokens per step "
             "| engine loop CPU ms/step | adapter CPU ms/step | CPU cores: tritonserver / stub / clients |",
             "|---|---|---|---|---|---|---|---|"]
    for row in report["runs"]:
        lines.append(f"| {row['concurrency']} | {row['client_tokens_per_s']:,.0f} | {row['tokens_per_response']:.1f} "
                     f"| {row['engine_steps_per_s']:.0f} | {row['engine_tokens_per_step']:.0f} "
                     f"| {row['engine_loop_cpu_ms_per_step']:.2f} | {row['adapter_cpu_ms_per_step']:.2f} "
                     f"| {row['tritonserver_cpu_cores']:.2f} / {row['stub_cpu_cores']:.2f} / "
                     f"{row['client_cpu_cores']:.2f} |")
    errors = [e for row in report["runs"] for e in row["errors"]]
    lines += ["", f"Stream errors (a token lost, repeated or out of order): {len(errors)}"
              + (f" (first: {errors[0]})" if errors else "")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serving_path", description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", default="1,64,256,1024", help="comma-separated stream counts")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
    parser.add_argument("--duration", type=float, default=10.0, help="measured seconds per concurrency")
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds before the window opens")
    parser.add_argument("--client-processes", type=int, default=2, help="client processes (each one asyncio loop)")
    parser.add_argument("--engine-steps", type=int, default=300, help="steps timed in process (0: skip)")
    parser.add_argument("--output-dir", default="results/serving_path")
    args = parser.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not concurrencies or min(concurrencies) < 1 or args.max_tokens < 1 or args.duration <= 0:
        parser.error("concurrency, max tokens and duration must be positive")

    from transformers import AutoConfig

    from backend.model_loader import resolve_model_dir

    from backend.zero_cost_runner import CYCLE_LENGTH, zero_cost_token

    vocab_size = AutoConfig.from_pretrained(resolve_model_dir(None)).vocab_size
    cycle = [zero_cost_token(p, vocab_size) for p in range(CYCLE_LENGTH)]
    if any(zero_cost_token(p, vocab_size) != cycle[p % CYCLE_LENGTH] for p in range(4 * CYCLE_LENGTH)):
        raise RuntimeError("the zero-cost cycle of this vocabulary is shorter than CYCLE_LENGTH")
    from benchmarks.machine import load_average, machine_info

    report = {"benchmark": "benchmarks.serving_path",
              "command": " ".join(["python -m benchmarks.serving_path", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine_info(0)}
    report["engine_loop"] = engine_loop_steps(steps=args.engine_steps) if args.engine_steps else {}
    workdir = Path(tempfile.mkdtemp(prefix="bench-serving-path-"))
    server = start_zero_cost_server(workdir, max(concurrencies), args.max_tokens)
    from triton_server import stop_server

    try:
        report["runs"] = []
        for concurrency in concurrencies:
            wait_idle(server)
            row = run_concurrency(server, concurrency, args.max_tokens, args.duration, args.warmup,
                                  args.client_processes, cycle)
            print(json.dumps({k: v for k, v in row.items() if k != "errors"}), f"errors: {len(row['errors'])}",
                  flush=True)
            report["runs"].append(row)
    finally:
        stop_server(server)
    report["machine"]["loadavg_at_end"] = load_average()
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    (output / "report.md").write_text(markdown(report) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
