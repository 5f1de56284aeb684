"""Faults under ``python -m serve`` end streams with an error instead of hanging them, and the server recovers
or exits non-zero (``serve.supervise``, ``serve.stub_watch``).

One launcher with the OpenAI frontend serves the first two tests in turn: the frontend is SIGKILLed mid-stream,
then the model's backend stub. Each fault has three streams in flight (the frontend's SSE, Triton's gRPC
stream and Triton's HTTP ``generate_stream``); each must end with an error within ``ERROR_WITHIN_S``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import psutil
import pytest
import requests

from client import LLMClient, LLMError
from serve.stub_watch import STUB_NAME
from triton_server import free_port, single_version_repository, start_launcher, stop_server

ERROR_WITHIN_S = 10.0
SETTINGS = {"max_num_seqs": 8, "num_blocks": 512, "max_model_len": 2048, "drain_grace_s": 5.0}


class Stream:
    """One long stream on a thread: counts its events, keeps the last, and records when and how it ended."""

    def __init__(self, name: str, events) -> None:
        self.name, self.events, self.last, self.ended_at, self.error = name, 0, None, None, None
        self.thread = threading.Thread(target=self._run, args=(events,), daemon=True)
        self.thread.start()

    def _run(self, events) -> None:
        try:
            for event in events():
                self.events += 1
                self.last = event
        except Exception as exc:  # what the fault looks like to this client
            self.error = f"{type(exc).__name__}: {exc}"
        self.ended_at = time.monotonic()


def openai_sse(port: int):
    """The chunks of a streaming completion (``choices[0]``); an SSE error event raises LLMError."""
    body = {"model": "llm", "prompt": "Tell me a long story.", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with requests.post(f"http://127.0.0.1:{port}/v1/completions", json=body, stream=True, timeout=(5, 120)) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise LLMError(f"SSE error event: {event['error']['message']} ({event['error']['code']})")
            yield event["choices"][0]


def start_streams(launcher, openai_port: int, triton_tokens: int = 2000) -> list[Stream]:
    """The frontend's SSE stream (2000 tokens), then Triton's gRPC and HTTP streams (``triton_tokens``)."""
    client = LLMClient(launcher.grpc_url, launcher.http_url)
    streams = [Stream("openai", lambda: openai_sse(openai_port)),
               Stream("grpc", lambda: client.stream_grpc("Story:", max_tokens=triton_tokens, ignore_eos=True)),
               Stream("http", lambda: client.stream_http("Story:", max_tokens=triton_tokens, ignore_eos=True))]
    deadline = time.monotonic() + 120
    while not all(s.events >= 3 for s in streams):
        assert time.monotonic() < deadline, {s.name: (s.events, s.error) for s in streams}
        time.sleep(0.05)
    return streams


def wait_ended(streams: list[Stream], since: float) -> dict[str, float]:
    """Seconds from ``since`` until each stream ended (asserting each ends within ERROR_WITHIN_S + 5)."""
    for s in streams:
        s.thread.join(max(0.0, since + ERROR_WITHIN_S + 5 - time.monotonic()))
    return {s.name: (s.ended_at - since if s.ended_at else float("inf")) for s in streams}


def tritonserver_of(launcher) -> psutil.Process:
    (triton,) = [p for p in psutil.Process(launcher.process.pid).children() if "tritonserver" in p.name()]
    return triton


def frontend_of(launcher) -> psutil.Process:
    (frontend,) = [p for p in psutil.Process(launcher.process.pid).children() if "openai_frontend" in p.cmdline()]
    return frontend


def serving_again(launcher, openai_port: int, since: float, timeout_s: float = 240) -> float:
    """Seconds from ``since`` until a completion through the frontend and one on Triton both succeed."""
    client = LLMClient(launcher.grpc_url, launcher.http_url)
    body = {"model": "llm", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True}  # sampled: EOS may come first
    while True:
        assert time.monotonic() - since < timeout_s, launcher.log()[-3000:]
        assert launcher.process.poll() is None, launcher.log()[-3000:]
        try:
            answer = requests.post(f"http://127.0.0.1:{openai_port}/v1/completions", json=body, timeout=30)
            if answer.status_code == 200 and client.generate("Hello", max_tokens=4, ignore_eos=True).num_output_tokens == 4:
                assert answer.json()["usage"]["completion_tokens"] == 4
                return time.monotonic() - since
        except (requests.RequestException, LLMError):
            pass
        time.sleep(0.25)


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir):
    """A launcher with the frontend; (launcher, frontend port)."""
    tmp = tmp_path_factory.mktemp("faults")
    port = free_port()
    server = start_launcher(tmp / "serve.log", single_version_repository(tmp / "models", SETTINGS), openai_port=port)
    yield server, port
    if server.process.poll() is None:
        stop_server(server)


@pytest.mark.server
@pytest.mark.slow  # launchers of their own, killed and restarted: minutes
def test_killed_frontend_ends_its_stream_and_is_started_again(served):
    """SIGKILL of the OpenAI frontend mid-stream: its client's stream breaks at once, Triton's own streams go
    on, the Triton request behind the broken one is cancelled, and the launcher starts the frontend again."""
    launcher, port = served
    triton = tritonserver_of(launcher)
    streams = start_streams(launcher, port, triton_tokens=120)
    frontend = frontend_of(launcher)
    frontend.kill()
    killed = time.monotonic()
    ended = wait_ended(streams[:1], killed)
    recovered = serving_again(launcher, port, killed)
    print(f"frontend killed: its SSE client saw {streams[0].error!r} after {ended['openai']:.2f} s; "
          f"serving again after {recovered:.1f} s")
    assert ended["openai"] < ERROR_WITHIN_S and streams[0].error is not None
    for s in streams[1:]:  # Triton's own streams go on to their end
        s.thread.join(120)
        assert (s.error, s.last.finish_reason, s.last.num_output_tokens) == (None, "length", 120), s.name
    assert tritonserver_of(launcher).pid == triton.pid and frontend_of(launcher).pid != frontend.pid
    assert "the OpenAI frontend exited with status -9: starting it again" in launcher.log()


@pytest.mark.server
@pytest.mark.slow  # launchers of their own, killed and restarted: minutes
def test_killed_stub_ends_every_stream_with_an_error_and_the_server_serves_again(served):
    """SIGKILL of the model's backend stub mid-stream: Triton 2.51 would keep that stub's streams open for
    good; the launcher restarts tritonserver, so the frontend's SSE stream ends with an error event (503) and
    Triton's gRPC and HTTP streams with a transport error, each within ERROR_WITHIN_S; then it serves again."""
    launcher, port = served
    triton = tritonserver_of(launcher)
    streams = start_streams(launcher, port)
    (stub,) = [p for p in triton.children() if p.name() == STUB_NAME]
    stub.kill()
    killed = time.monotonic()
    ended = wait_ended(streams, killed)
    recovered = serving_again(launcher, port, killed)
    print(f"stub killed: streams ended after {ended} s ({ {s.name: s.error for s in streams} }); "
          f"serving again after {recovered:.1f} s")
    assert all(t < ERROR_WITHIN_S for t in ended.values()), ended
    assert all(s.error is not None for s in streams), {s.name: s.last for s in streams}
    assert "SSE error event" in streams[0].error and "service_unavailable" in streams[0].error
    assert tritonserver_of(launcher).pid != triton.pid
    assert "restarting tritonserver" in launcher.log()


@pytest.mark.server
@pytest.mark.slow  # launchers of their own, killed and restarted: minutes
def test_an_engine_that_cannot_recover_makes_the_launcher_drain_and_exit_1(tmp_path, default_model_dir):
    """An operator's unload through the repository API is left alone and spends nothing. An engine that dies
    (every forward pass fails: ``LLM_FAULT_INJECTION_FILE``) unloads its model; the launcher loads it again
    (budget 1), and when the new engine dies too, drains and exits 1 (the container's liveness: the process is
    gone), its children with it."""
    fault = tmp_path / "fault"
    openai_port = free_port()
    server = start_launcher(tmp_path / "serve.log", single_version_repository(tmp_path / "models", SETTINGS),
                            launcher_args=["--max-restarts=1"], openai_port=openai_port,
                            env={"LLM_FAULT_INJECTION_FILE": str(fault), "TRITON_ADMIN_KEY": "operator-key"})
    frontend_health = f"http://127.0.0.1:{openai_port}/health"
    client = LLMClient(server.grpc_url, server.http_url)
    children = psutil.Process(server.process.pid).children(recursive=True)
    admin = {"triton-admin-key": "operator-key"}
    try:
        unload = requests.post(f"{server.http_url}/v2/repository/models/llm/unload", headers=admin, timeout=60)
        assert unload.status_code == 200, unload.text
        time.sleep(4)  # four looks of the watch
        assert requests.get(f"{server.http_url}/v2/models/llm/ready", timeout=5).status_code != 200
        # Triton's server readiness reads true again once the model is unloaded; the frontend's asks the model's.
        assert requests.get(frontend_health, timeout=5).status_code == 503
        assert server.process.poll() is None
        assert "model 'llm' was unloaded through the repository API: not loading it again" in server.log()
        load = requests.post(f"{server.http_url}/v2/repository/models/llm/load", headers=admin, timeout=300)
        assert load.status_code == 200, load.text
        serving_again_on_triton(client, server, time.monotonic())
        assert requests.get(frontend_health, timeout=5).status_code == 200
        fault.touch()
        kill_engine(client)
        died = time.monotonic()
        fault.unlink()
        reloaded = serving_again_on_triton(client, server, died)
        fault.touch()
        kill_engine(client)
        died = time.monotonic()
        status = server.process.wait(60)
        exited = time.monotonic() - died
    finally:
        if server.process.poll() is None:
            stop_server(server)
    print(f"engine died: serving again after {reloaded:.1f} s; died again: launcher exited {status} after "
          f"{exited:.1f} s")
    log = server.log()
    assert "loaded model 'llm' again" in log and "restart budget (1 in 600 s) is spent" in log
    assert log.count("unloaded itself (its engine died)") == 2
    assert status == 1 and exited < 30
    assert not [p.pid for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def kill_engine(client: LLMClient) -> None:
    """Sends requests while every forward pass fails until the engine is dead (3 failed steps in a row, each
    request failing one) or its model is gone."""
    for _ in range(20):
        try:
            client.generate("Hello", max_tokens=4)
        except LLMError as exc:
            if "engine is dead" in str(exc) or "unknown model" in str(exc).lower():
                return
        except requests.RequestException:
            return
    raise AssertionError("the engine did not die")


def serving_again_on_triton(client: LLMClient, server, since: float, timeout_s: float = 240) -> float:
    while True:
        assert time.monotonic() - since < timeout_s, server.log()[-3000:]
        try:
            if client.generate("Hello", max_tokens=4, ignore_eos=True).num_output_tokens == 4:
                return time.monotonic() - since
        except (LLMError, requests.RequestException):
            pass
        time.sleep(0.25)



def test_a_frontend_that_keeps_dying_is_restarted_with_backoff_then_the_launcher_drains_and_exits_1():
    """``run_together`` with the second command restartable and a budget of 2: it is started again after 1 s
    and 2 s, then the budget is spent: the models are drained (tritonserver still runs) and the status is 1."""
    from serve.launch import run_together

    drained = []
    server = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "import sys; sys.exit(3)"]
    start = time.monotonic()
    status = run_together([server, failing], None, drain=lambda cut_short: drained.append(time.monotonic()),
                          restart=(1,), max_restarts=2)
    elapsed = time.monotonic() - start
    assert status == 1 and len(drained) == 1
    assert 3.0 <= elapsed < 20, elapsed  # backoff 1 s + 2 s, then the drain and SIGTERM to the sleeper


def test_the_restart_budget_counts_within_its_window():
    from serve.supervise import RestartBudget

    budget = RestartBudget(limit=2, window_s=0.3)
    assert budget.take() and budget.take() and not budget.take()
    time.sleep(0.35)
    assert budget.take()
    assert not RestartBudget(limit=0).take()


class RepositoryStandIn:
    """An HTTP server answering ``/v2/repository/index`` with scripted states and recording model loads: the
    watch's view of Triton, for timings the real server cannot be made to hit on demand."""

    def __init__(self, states: list[str]) -> None:
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.states, self.loads = list(states), []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path == "/v2/repository/index":
                    state = outer.states.pop(0) if len(outer.states) > 1 else outer.states[0]
                    body = json.dumps([{"name": "llm", "version": "1", "state": state}]).encode()
                else:
                    outer.loads.append(self.path)
                    outer.states = ["READY"]
                    body = b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.mark.parametrize("first_seen", ["READY", "UNLOADING", "LOADING"])
def test_a_model_that_unloads_itself_is_loaded_again_even_if_never_seen_ready(first_seen):
    """An engine can die, and its model start unloading, within a second of turning READY: the watch's first
    look may find it UNLOADING already. Seen loaded in any state, then gone: loaded again, once."""
    from serve.stub_watch import StubWatch

    triton = RepositoryStandIn([first_seen, "UNAVAILABLE"])
    try:
        watch = StubWatch(triton.url, server_pid=psutil.Process().pid)
        assert watch.check() is None  # first look: loaded (READY with no stub would need two looks to act)
        assert watch.check() is None  # gone: a reload starts on a thread of its own
        deadline = time.monotonic() + 5
        while not watch.reloads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert triton.loads == ["/v2/repository/models/llm/load"] and watch.reloads == ["llm"]
        assert watch.check() is None and len(triton.loads) == 1
    finally:
        triton.server.shutdown()


def test_only_a_model_that_recorded_its_engines_death_is_loaded_again(tmp_path, monkeypatch):
    """Two models seen loaded, then gone: the one whose engine recorded its death (``serve.health``, in the
    directory the launcher names) is loaded again and its record taken; the other was an operator's unload."""
    from serve.health import record_death
    from serve.stub_watch import DEATHS_DIR_ENV, StubWatch

    monkeypatch.setenv(DEATHS_DIR_ENV, str(tmp_path))
    triton = RepositoryStandIn(["READY", "UNAVAILABLE"])
    try:
        watch = StubWatch(triton.url, server_pid=psutil.Process().pid, deaths_dir=str(tmp_path))
        assert watch.check() is None
        assert watch.check() is None  # gone without a record: left alone
        time.sleep(0.3)
        assert triton.loads == [] and watch.reloads == []
        triton.states = ["READY", "UNAVAILABLE"]  # the operator loads it again; then its engine dies
        assert watch.check() is None
        record_death("llm", "engine is dead: 3 failed steps in a row")
        assert (tmp_path / "llm").read_text() == "engine is dead: 3 failed steps in a row\n"
        assert watch.check() is None
        deadline = time.monotonic() + 5
        while not watch.reloads and time.monotonic() < deadline:
            time.sleep(0.05)
        assert triton.loads == ["/v2/repository/models/llm/load"] and watch.reloads == ["llm"]
        assert not (tmp_path / "llm").exists()
    finally:
        triton.server.shutdown()


def test_a_model_never_seen_loaded_is_not_loaded_by_the_watch():
    """A model that was never loaded (unavailable from the first look) is the operator's choice: no load."""
    from serve.stub_watch import StubWatch

    triton = RepositoryStandIn(["UNAVAILABLE"])
    try:
        watch = StubWatch(triton.url, server_pid=psutil.Process().pid)
        assert watch.check() is None and watch.check() is None
        time.sleep(0.3)
        assert triton.loads == []
    finally:
        triton.server.shutdown()


@pytest.mark.parametrize("argv, message", [(["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
                                           (["--http-restricted-api", "x"], "the launcher restricts Triton's APIs")])
def test_the_launcher_refuses_a_bad_flag_before_it_prints_or_starts_anything(argv, message, capsys):
    from serve.launch import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    assert exited.value.code == 2 and message in captured.err and "+ " not in captured.out
