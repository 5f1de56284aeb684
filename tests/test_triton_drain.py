"""``python -m serve`` under stress: SIGTERM with streams in flight (a drain within the models' grace
period), and a SIGKILLed backend stub (the launcher restarts tritonserver).

Each test runs a launcher of its own (``python -m serve``, no OpenAI frontend) on a single model version whose
grace period (``drain_grace_s``) is 8 s: both leave their server stopped or broken.
"""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import psutil
import pytest
import requests

from client import LLMClient, LLMError
from serve.stub_watch import STUB_NAME
from triton_server import free_port, single_version_repository, start_launcher, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]  # a server (launcher) of its own: minutes
GRACE_S = 8.0
SHORT_TOKENS = 32
SETTINGS = {"max_num_seqs": 8, "num_blocks": 512, "max_model_len": 2048, "drain_grace_s": GRACE_S}


@pytest.fixture
def launcher(tmp_path, default_model_dir):
    server = start_launcher(tmp_path / "serve.log", single_version_repository(tmp_path / "models", SETTINGS))
    yield server
    if server.process.poll() is None:
        stop_server(server)


def tritonserver_of(launcher) -> psutil.Process:
    (triton,) = [p for p in psutil.Process(launcher.process.pid).children() if "tritonserver" in p.name()]
    return triton


def test_sigterm_drains_streams_in_flight_then_exits_cleanly(launcher):
    """SIGTERM to the launcher with three long streams (2 HTTP, 1 gRPC) and one short one in flight: the
    short one completes, the long ones end with ``abort`` and a final response after the grace period, a new
    request during the drain is refused at once with a message, readiness is false, and everything exits 0."""
    client = LLMClient(launcher.grpc_url, launcher.http_url)
    triton = tritonserver_of(launcher)
    stubs = triton.children()
    streams: dict[str, list] = {}
    errors: dict[str, str] = {}

    def run(name: str, protocol: str, max_tokens: int) -> None:
        streams[name] = []
        try:
            for delta in getattr(client, f"stream_{protocol}")(f"Story {name}:", max_tokens=max_tokens,
                                                                ignore_eos=True):
                streams[name].append(delta)
        except LLMError as exc:
            errors[name] = str(exc)

    specs = {"http1": ("http", 2000), "http2": ("http", 2000), "grpc": ("grpc", 2000), "short": ("http", 0)}
    threads = {name: threading.Thread(target=run, args=(name, protocol, n)) for name, (protocol, n) in specs.items()
               if n}
    for t in threads.values():
        t.start()
    deadline = time.monotonic() + 120
    while not all(len(streams.get(name, [])) >= 2 for name in threads):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.05)
    # The short one: in flight when the drain begins, with few enough tokens left to finish within the grace
    # period. Tokens, not deltas, are counted: a stream that falls behind the engine gets its deltas merged.
    short = threading.Thread(target=run, args=("short", "grpc", SHORT_TOKENS))
    short.start()
    deadline = time.monotonic() + 60
    while sum(len(d.token_ids) for d in streams.get("short", [])) < 3:
        assert short.is_alive(), f"short stream ended before the drain: {errors or streams['short'][-1:]}"
        assert time.monotonic() < deadline, "short stream did not start"
        time.sleep(0.02)
    assert short.is_alive(), "short stream finished before the drain began"

    sigterm = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    while requests.get(f"{launcher.http_url}/v2/models/llm/ready").status_code == 200:
        assert time.monotonic() - sigterm < 5, "still ready after SIGTERM"
        time.sleep(0.05)
    not_ready = time.monotonic() - sigterm
    start = time.monotonic()
    refused = requests.post(f"{launcher.http_url}/v2/models/llm/generate", json={"text_input": "hi", "max_tokens": 4})
    refused_in = time.monotonic() - start
    assert refused.status_code in (400, 404, 503) and refused.json()["error"], refused.text

    for t in [*threads.values(), short]:
        t.join(GRACE_S + 30)
    status = launcher.process.wait(60)
    stopped = time.monotonic() - sigterm
    finals = {name: (ds[-1].finish_reason, ds[-1].num_output_tokens) for name, ds in streams.items()}
    print(f"not ready after {not_ready:.2f} s; new request refused in {refused_in * 1000:.0f} ms "
          f"({refused.status_code}: {refused.json()['error']}); launcher exited {status} after {stopped:.1f} s; "
          f"finals {finals}")
    assert not errors, errors
    assert finals["short"] == ("length", SHORT_TOKENS)
    assert all(finals[name][0] == "abort" and 0 < finals[name][1] < 2000 for name in ("http1", "http2", "grpc"))
    assert all(sum(len(d.token_ids) for d in streams[name]) == finals[name][1] for name in finals)
    assert refused_in < 2  # refused at once, not after the drain (GRACE_S)
    assert status == 0  # the launcher exits 0 only if tritonserver did
    assert GRACE_S <= stopped < GRACE_S + 20
    log = launcher.log()
    assert "Signal (11)" not in log and "Exit timeout expired" not in log and "forward pass failed" not in log
    assert not [p.pid for p in stubs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_killed_stub_fails_requests_fast_and_the_launcher_reloads_the_model(launcher):
    """SIGKILL of the model's stub: a request fails at once (Triton 2.51: ``Stub process ... is not healthy``)
    instead of hanging, and the launcher notices and restarts tritonserver, which serves again (streams in
    flight: tests/test_faults.py)."""
    client = LLMClient(launcher.grpc_url, launcher.http_url)
    assert client.generate("Hello", max_tokens=4, ignore_eos=True).num_output_tokens == 4
    (stub,) = [p for p in tritonserver_of(launcher).children() if p.name() == STUB_NAME]
    stub.kill()
    killed = time.monotonic()
    start = time.monotonic()
    with pytest.raises(LLMError, match="is not healthy"):
        client.generate("Hello", max_tokens=4)
    first_failure = time.monotonic() - start
    failures, slowest = [], 0.0
    while True:
        assert time.monotonic() - killed < 240, f"not serving again; failures: {failures[-3:]}"
        start = time.monotonic()
        try:
            out = client.generate("Hello", max_tokens=4, ignore_eos=True)  # sampled: EOS may come first
            break
        except (LLMError, requests.RequestException) as exc:  # refused while tritonserver restarts
            failures.append(str(exc))
        slowest = max(slowest, time.monotonic() - start)
        time.sleep(0.2)
    recovered = time.monotonic() - killed
    print(f"first request after the kill failed in {first_failure:.2f} s; then {len(failures)} more failed "
          f"(slowest {slowest:.2f} s, last {failures[-1:]}); serving again {recovered:.1f} s after the kill")
    assert out.num_output_tokens == 4
    assert first_failure < 5
    (new_stub,) = [p for p in tritonserver_of(launcher).children()
                   if p.name() == STUB_NAME and p.status() != psutil.STATUS_ZOMBIE]
    assert new_stub.pid != stub.pid
    assert "restarting tritonserver" in launcher.log()


def test_sigterm_after_openai_traffic_exits_0_promptly(tmp_path, default_model_dir):
    """Requests through the OpenAI frontend, answered and refused, leave nothing that holds the model: SIGTERM
    unloads it and every process exits 0 well within Triton's exit timeout. (Each request is one gRPC stream to
    Triton; a stream the frontend cancelled after its final response could keep the model loaded.)"""
    port = free_port()
    server = start_launcher(tmp_path / "serve.log", single_version_repository(tmp_path / "models", SETTINGS),
                            openai_port=port)
    try:
        base = f"http://127.0.0.1:{port}/v1"
        statuses = []
        for i in range(8):
            statuses.append(requests.post(f"{base}/completions", json={
                "model": "llm", "prompt": f"Count to {i}:", "max_tokens": 2}, timeout=60).status_code)
            statuses.append(requests.post(f"{base}/chat/completions", json={
                "model": "llm", "messages": [{"role": "user", "content": f"Say {i}"}], "max_tokens": 2},
                timeout=60).status_code)
            statuses.append(requests.post(f"{base}/completions", json={  # refused by the model
                "model": "llm", "prompt": "hi", "max_tokens": 2, "structured_outputs": {"regex": "[a-"}},
                timeout=60).status_code)
        assert statuses == [200, 200, 400] * 8
        assert_stops_promptly(server)
    finally:
        if server.process.poll() is None:
            stop_server(server)


def test_sigterm_after_openai_clients_left_as_their_answers_ended_exits_0_promptly(tmp_path, default_model_dir):
    """Clients of the OpenAI API that leave a few milliseconds around the end of short answers, for 25 s: the
    frontend ends each request left early with an abort request on its gRPC stream (serve.abort_keys), never a
    cancellation, which tritonserver 2.51 can lose track of when it meets the request's end (the model then never
    unloads: SIGTERM waited for Triton's exit timeout and the server exited 1, seen with this traffic)."""
    import aiohttp

    port = free_port()
    server = start_launcher(tmp_path / "serve.log", single_version_repository(tmp_path / "models", SETTINGS),
                            openai_port=port)
    counts = {"answered": 0, "left": 0}

    async def client(seed: int, until: float) -> None:
        rng = random.Random(seed)
        async with aiohttp.ClientSession() as http:
            while time.monotonic() < until:
                body = {"model": "llm", "prompt": "Hi", "max_tokens": rng.randint(1, 3), "stream": rng.random() < 0.5}
                try:
                    async with asyncio.timeout(rng.uniform(0, 0.3)):  # leaving closes the connection
                        async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as answer:
                            assert answer.status == 200, await answer.text()
                            await answer.read()
                    counts["answered"] += 1
                except TimeoutError:
                    counts["left"] += 1

    async def clients() -> None:
        until = time.monotonic() + 25
        await asyncio.gather(*(client(seed, until) for seed in range(6)))

    try:
        asyncio.run(clients())
        assert counts["answered"] > 50 and counts["left"] > 50, counts
        assert_stops_promptly(server)
    finally:
        if server.process.poll() is None:
            stop_server(server)


def assert_stops_promptly(server) -> None:
    """SIGTERM to the launcher: the model is unloaded (its ``finalize`` ran) and every process exits 0 well within
    Triton's exit timeout."""
    start = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(90) == 0, server.log()[-3000:]
    elapsed = time.monotonic() - start
    log = server.log()
    assert "successfully unloaded 'llm'" in log and "finalized in" in log, log[-3000:]
    assert "Exit timeout expired" not in log, log[-3000:]
    assert elapsed < 20, f"the launcher took {elapsed:.1f} s to stop"
