"""Stopping the server: model unload does not hang, and no backend stub outlives the server.

On SIGTERM Triton first lets in-flight requests finish, for up to ``--exit-timeout-secs`` (a graceful
drain, by design), then unloads models, which calls the model's ``finalize``.
"""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from client import LLMClient, LLMError
from triton_server import start_server, stop_server

pytestmark = [pytest.mark.server, pytest.mark.slow]  # a server (launcher) of its own: minutes


@pytest.fixture
def server(tmp_path, default_model_dir):
    """A server of the test's own, which the test stops; stopped here if a failed assertion left it running."""
    server = start_server(tmp_path / "tritonserver.log")
    yield server
    if server.process.poll() is None:
        stop_server(server)


def stubs_of(server) -> list[psutil.Process]:
    stubs = psutil.Process(server.process.pid).children(recursive=True)
    assert len(stubs) == 1, "the Python backend runs the served version (the newest, 2) in a stub process"
    return stubs


def wait_gone(processes: list[psutil.Process], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_sigterm_after_serving_unloads_promptly(server):
    stubs = stubs_of(server)
    client = LLMClient(server.grpc_url, server.http_url)
    # ignore_eos: a sampled answer may end before 8 tokens
    assert client.generate("Hello there", max_tokens=8, ignore_eos=True).num_output_tokens == 8
    start = time.monotonic()
    server.process.terminate()
    server.process.wait(60)
    elapsed = time.monotonic() - start
    log = server.log()
    # The default repository serves the newest version only.
    assert "successfully unloaded 'llm' version 2" in log and "'llm' version 1" not in log
    assert "Exit timeout expired" not in log
    assert elapsed < 15, f"the server took {elapsed:.1f} s to stop"
    assert not wait_gone(stubs, 5)


def test_stub_exits_when_the_server_is_killed_mid_stream(server):
    stubs = stubs_of(server)
    client = LLMClient(server.grpc_url, server.http_url)
    received, ended = [], threading.Event()

    def stream():
        try:
            for delta in client.stream_grpc("Write a long story.", max_tokens=2000, ignore_eos=True):
                received.append(delta)
        except LLMError:
            pass
        finally:
            ended.set()

    threading.Thread(target=stream, daemon=True).start()
    deadline = time.monotonic() + 60
    while len(received) < 3:
        assert time.monotonic() < deadline, "no tokens streamed"
        time.sleep(0.05)
    server.process.kill()
    server.process.wait(10)
    alive = wait_gone(stubs, 10)
    assert not alive, f"stub processes outlived the server: {alive}"
    assert ended.wait(10), "the client stream did not end"
