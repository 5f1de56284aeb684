"""What publishing KV cache events costs an engine step (target: under 2%).

One in-process engine with KV events on, a subscriber draining them on the other end of the socket, and a
workload that stores, shares and evicts blocks all the time: requests with a shared system prompt and
their own tails, in a pool a fraction of the size they need (so blocks are evicted every few steps). Per
step it measures the engine's whole ``step()`` and the part of it that KV events add on the engine thread:
the hand-off (``BlockPool.take_events`` + ``KVEventPublisher.publish``, timed around the calls) plus the
recording (one tuple append per stored or removed block: the events counted times an append's cost, timed
separately). The publisher thread's own time (converting, msgpack encoding, sending) does not block the
step but shares the GIL and the cores; it is reported beside it.

    python -m benchmarks.kv_events [--num-requests 64] [--num-blocks 256] [--threads 2]

Not a comparison of two runs: both shares come from the same run.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
import timeit

import zmq

from backend import EngineConfig, LLMEngine, SamplingParams
from benchmarks.machine import machine_info
from benchmarks.workload import corpus_text


class _Timed:
    """Wraps a callable, adding its wall time to ``seconds``."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        started = time.perf_counter()
        try:
            result = self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - started
            self.calls += 1
        self.items += len(result) if isinstance(result, list) else 0
        return result

    items = 0  # for take_events: the events it handed over


def append_cost_s() -> float:
    """Seconds for one event append as the pool records it (a tuple of four built and appended)."""
    events, block_hash, tokens = [], b"\x01" * 32, tuple(range(16))
    loops = 200_000
    return timeit.timeit(lambda: events.append((0, block_hash, None, tokens)), number=loops) / loops


def run(num_requests: int, num_blocks: int, max_tokens: int, threads: int | None, seed: int = 0) -> dict:
    engine = LLMEngine(EngineConfig(num_threads=threads, num_blocks=num_blocks, max_num_seqs=32,
                                    kv_events_endpoint="inproc://kv-events-bench"))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect("inproc://kv-events-bench")
    received = {"messages": 0, "bytes": 0}
    stop = threading.Event()

    def drain() -> None:
        while not stop.is_set():
            if subscriber.poll(100):
                received["messages"] += 1
                received["bytes"] += len(subscriber.recv_multipart()[2])

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    core = engine.engine_core  # this thread steps: it may wrap the core's methods
    publish, take = _Timed(engine.kv_events.publish), _Timed(core.take_kv_events)
    engine.kv_events.publish, core.take_kv_events = publish, take
    ids = engine.tokenizer.encode(corpus_text())
    system, step_s = ids[:256], []
    try:
        engine.add_request([5, 6, 7, 8], SamplingParams(max_tokens=2, temperature=0.0), request_id="warm-up")
        while engine.has_unfinished_requests():  # stepped here, never by the engine's own loop thread
            engine.step()
        core.take_kv_events()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i in range(num_requests):
            start = 300 + (i * 97 + seed) % (len(ids) - 400)
            engine.add_request(system + ids[start:start + 48 + i % 32], params, request_id=str(i))
        publish.seconds = take.seconds = 0.0
        take.items = 0
        encode_before = engine.kv_events.encode_seconds
        evictions_before = engine.debug_snapshot().num_evictions
        while engine.has_unfinished_requests():
            started = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - started)
        time.sleep(0.5)  # let the publisher and the subscriber catch up
        encode_s = engine.kv_events.encode_seconds - encode_before
        batches = engine.kv_events.num_batches
        evictions = engine.debug_snapshot().num_evictions - evictions_before
    finally:
        stop.set()
        engine.shutdown()
        reader.join()
        subscriber.close(linger=0)
    total = sum(step_s)
    num_events = take.items
    record_s = num_events * append_cost_s()
    hot_path = publish.seconds + take.seconds + record_s
    return {"steps": len(step_s), "step_total_s": round(total, 3), "step_mean_ms": round(1000 * total / len(step_s), 2),
            "events_recorded": num_events, "evictions": evictions, "batches_published": batches,
            "messages_received": received["messages"], "payload_bytes": received["bytes"],
            "handoff_s": round(publish.seconds + take.seconds, 5), "recording_s_estimated": round(record_s, 5),
            "engine_thread_share": round(hot_path / total, 5),
            "publisher_thread_s": round(encode_s, 4), "publisher_thread_share": round(encode_s / total, 5)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV pool size (16-token blocks)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    result = run(args.num_requests, args.num_blocks, args.max_tokens, args.threads)
    result["machine"] = machine_info(args.threads or 0)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
