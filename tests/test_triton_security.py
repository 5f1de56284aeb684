"""``python -m serve`` with both keys set, attacked from outside: Triton's control plane is closed, the OpenAI
frontend wants its key and bounds what a request may cost, and the launcher's own control calls still work.

One launcher (tritonserver + the frontend) for the module, on a single model version with a short grace
period (``drain_grace_s`` 3 s) and the fault-injection hook armed. The tests run in order: the engine-death
test leaves the model reloaded, and the last test stops the launcher with SIGTERM.
"""

from __future__ import annotations

import base64
import json
import signal
import threading
import time

import psutil
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from backend.fault_injection import ENV_VAR
from client import LLMClient, LLMError
from serve import allocator
from serve.control import admin_headers
from triton_server import (free_port, single_version_repository, start_launcher, status_before_the_body,
                           stop_server)

pytestmark = [pytest.mark.server, pytest.mark.slow]  # a server (launcher) of its own: minutes
ADMIN_KEY = "admin-0123456789abcdef"
API_KEY = "api-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SETTINGS = {"max_num_seqs": 8, "num_blocks": 512, "max_model_len": 2048, "drain_grace_s": 3.0}


@pytest.fixture(scope="module")
def launcher(tmp_path_factory, default_model_dir):
    root = tmp_path_factory.mktemp("security")
    models = single_version_repository(root / "models", SETTINGS)
    port = free_port()
    server = start_launcher(root / "serve.log", models, openai_port=port,
                            env={"TRITON_ADMIN_KEY": ADMIN_KEY, "LLM_API_KEY": API_KEY, ENV_VAR: str(root / "fault")},
                            launcher_args=["--openai-arg=--max-prompts-per-request=4"])
    server.openai_url = f"http://127.0.0.1:{port}"
    server.fault = root / "fault"
    yield server
    if server.process.poll() is None:
        stop_server(server)


def tritonserver_of(launcher) -> psutil.Process:
    (triton,) = [p for p in psutil.Process(launcher.process.pid).children() if "tritonserver" in p.name()]
    return triton


def serves(launcher) -> bool:
    return LLMClient(launcher.grpc_url, launcher.http_url).generate("Hello", max_tokens=4,
                                                                   ignore_eos=True).num_output_tokens == 4


def test_triton_listens_on_loopback_and_its_key_is_not_in_the_frontend(launcher):
    triton = tritonserver_of(launcher)
    listening = {(c.laddr.ip, c.laddr.port) for c in triton.net_connections("inet") if c.status == "LISTEN"}
    assert len(listening) == 3, listening  # HTTP, gRPC, metrics
    assert {ip for ip, _ in listening} <= {"127.0.0.1", "::ffff:127.0.0.1"}, listening
    (frontend,) = [p for p in psutil.Process(launcher.process.pid).children() if p.pid != triton.pid]
    assert "TRITON_ADMIN_KEY" not in frontend.environ() and "LLM_API_KEY" not in triton.environ()
    assert ADMIN_KEY not in " ".join(frontend.cmdline()) and API_KEY not in " ".join(frontend.cmdline())
    assert ADMIN_KEY not in launcher.log()  # the launcher prints tritonserver's command with the key masked
    tcmalloc = allocator.tcmalloc_path()  # preloaded into tritonserver, and so into the engine's stub, where installed
    assert (tcmalloc in triton.environ().get("LD_PRELOAD", "").split(":")) if tcmalloc else \
        "LD_PRELOAD" not in triton.environ()
    assert f"tritonserver's allocator: {f'tcmalloc ({tcmalloc})' if tcmalloc else 'glibc malloc'}" in launcher.log()


def test_http_control_apis_refuse_calls_without_the_admin_key(launcher):
    model_py = base64.b64encode(b"import os\nos.system('touch /tmp/pwned')\n").decode()
    calls = [("post", "/v2/repository/index", {}),
             ("post", "/v2/repository/models/llm/unload", {}),
             ("post", "/v2/repository/models/evil/load",
              {"parameters": {"config": json.dumps({"backend": "python"}), "file:1/model.py": model_py}}),
             ("post", "/v2/systemsharedmemory/region/r/register", {"key": "/r", "offset": 0, "byte_size": 64}),
             ("get", "/v2/systemsharedmemory/status", None),
             ("post", "/v2/logging", {"log_verbose_level": 2}),
             ("get", "/v2/trace/setting", None)]
    for headers in ({}, admin_headers("wrong-key")):
        for method, path, body in calls:
            response = getattr(requests, method)(f"{launcher.http_url}{path}", json=body, headers=headers, timeout=10)
            assert response.status_code == 403, (path, response.text)
            assert "This API is restricted" in response.json()["error"]
    assert launcher.is_ready() and serves(launcher)
    index = requests.post(f"{launcher.http_url}/v2/repository/index", json={}, headers=admin_headers(ADMIN_KEY))
    assert [(m["name"], m["state"]) for m in index.json()] == [("llm", "READY")]


def test_grpc_control_apis_refuse_calls_without_the_admin_key(launcher):
    client = grpcclient.InferenceServerClient(launcher.grpc_url)
    calls = [lambda h: client.get_model_repository_index(headers=h),
             lambda h: client.unload_model("llm", headers=h),
             lambda h: client.load_model("evil", config=json.dumps({"backend": "python"}),
                                         files={"file:1/model.py": b"import os\n"}, headers=h),
             lambda h: client.register_system_shared_memory("r", "/r", 64, headers=h),
             lambda h: client.update_log_settings({"log_verbose_level": 2}, headers=h),
             lambda h: client.get_trace_settings(headers=h)]
    for headers in (None, admin_headers("wrong-key", grpc=True), admin_headers(ADMIN_KEY)):  # the HTTP name
        for call in calls:
            with pytest.raises(InferenceServerException, match="This protocol is restricted"):
                call(headers)
    index = client.get_model_repository_index(headers=admin_headers(ADMIN_KEY, grpc=True), as_json=True)
    assert [(m["name"], m["state"]) for m in index["models"]] == [("llm", "READY")]
    assert client.is_model_ready("llm") and serves(launcher)


def test_openai_api_key(launcher):
    url = f"{launcher.openai_url}/v1/completions"
    body = {"model": "llm", "prompt": "Hello", "max_tokens": 4}
    assert requests.post(url, json=body, timeout=60).status_code == 401
    assert requests.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
    response = requests.post(url, json=body, headers=AUTH, timeout=60)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    assert requests.get(f"{launcher.openai_url}/health", timeout=10).json() == {"status": "ok"}
    ids = [m["id"] for m in requests.get(f"{launcher.openai_url}/v1/models", headers=AUTH, timeout=10).json()["data"]]
    assert ids == ["llm", "llm/1"]  # listed through model metadata: the frontend holds no admin key
    # The launcher's --openai-arg reached the frontend: its bound on completions per request is 4 here.
    five = requests.post(url, json={**body, "prompt": ["Hello"] * 5}, headers=AUTH, timeout=60)
    assert five.status_code == 400 and "at most 4" in five.json()["error"]["message"], five.text


def test_large_body_is_413_fast_while_a_stream_and_a_small_request_go_on(launcher):
    chunks, done = [], threading.Event()

    def stream():
        body = {"model": "llm", "prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with requests.post(f"{launcher.openai_url}/v1/completions", json=body, headers=AUTH, stream=True,
                           timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith(b"data: {"):
                    chunks.append(json.loads(line[6:]))
        done.set()

    threading.Thread(target=stream, daemon=True).start()
    deadline = time.monotonic() + 60
    while len(chunks) < 2:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)
    # Refused from the header alone: the answer comes while 50 MiB of the announced body were never sent.
    status, answer = status_before_the_body(launcher.openai_url, "/v1/chat/completions", 50 << 20,
                                            {**AUTH, "Content-Type": "application/json"})
    assert status == 413 and b"request_too_large" in answer, answer[:300]
    big = requests.post(f"{launcher.openai_url}/v1/chat/completions", data=b"{" + b" " * (50 << 20) + b"}",
                        headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    small = requests.post(f"{launcher.openai_url}/v1/completions", headers=AUTH, timeout=60,
                          json={"model": "llm", "prompt": "Hi", "max_tokens": 2})
    many = requests.post(f"{launcher.openai_url}/v1/completions", headers=AUTH, timeout=60,
                         json={"model": "llm", "prompt": ["Hi"] * 2000, "max_tokens": 2})
    assert done.wait(120), "the stream did not finish"
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    assert small.status_code == 200 and small.json()["usage"]["completion_tokens"] == 2
    assert many.status_code == 400 and "2000 completions" in many.json()["error"]["message"]
    # Deltas of a stream that falls behind are merged, so tokens are counted from the usage, not from chunks.
    assert chunks[-1]["usage"]["completion_tokens"] == 48 and not chunks[-1]["choices"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["text"]) >= 4


def test_render_of_a_huge_prompt_is_refused_off_the_event_loop(launcher):
    result = {}

    def render():
        start = time.monotonic()
        result["response"] = requests.post(f"{launcher.openai_url}/v1/completions/render", headers=AUTH,
                                           json={"model": "llm", "prompt": "word " * 1_000_000}, timeout=60)
        result["took"] = time.monotonic() - start

    thread = threading.Thread(target=render)
    thread.start()
    health = []
    while thread.is_alive():
        start = time.monotonic()
        assert requests.get(f"{launcher.openai_url}/health", timeout=10).status_code == 200
        health.append(time.monotonic() - start)
    thread.join()
    response = result["response"]
    print(f"5 MB render refused in {result['took']:.2f} s; slowest /health meanwhile {max(health, default=0):.3f} s")
    assert response.status_code == 400, response.text
    assert "rejected before tokenizing" in response.json()["error"]["message"]
    assert result["took"] < 5
    ok = requests.post(f"{launcher.openai_url}/v1/completions/render", headers=AUTH,
                       json={"model": "llm", "prompt": ["Hello world", "Hi"]}, timeout=60)
    assert ok.status_code == 200 and [len(r["token_ids"]) for r in ok.json()] == [2, 1]


def test_dead_engine_unloads_its_model_under_the_restriction_and_the_key_reloads_it(launcher):
    """The model's own unload (``serve.health``) is an in-process call: Triton's API restriction does not
    stop it. Then a load without the key is refused, and one with it brings the model back."""
    client = LLMClient(launcher.grpc_url, launcher.http_url)
    launcher.fault.touch()
    try:
        for _ in range(3):
            with pytest.raises(LLMError, match="injected fault|engine is dead"):
                client.generate("Hello", max_tokens=4)
    finally:
        launcher.fault.unlink()
    deadline = time.monotonic() + 30
    while launcher.is_ready():
        assert time.monotonic() < deadline, "still ready with a dead engine"
        time.sleep(0.1)
    load = f"{launcher.http_url}/v2/repository/models/llm/load"
    assert requests.post(load, timeout=10).status_code == 403
    assert requests.post(load, headers=admin_headers(ADMIN_KEY), timeout=300).status_code == 200
    assert launcher.is_ready() and serves(launcher)


def test_sigterm_drains_with_the_key_and_exits_0(launcher):
    """Last: SIGTERM with a stream in flight. The launcher unloads the model with its key (the model aborts
    the stream after its 3 s grace period), stops tritonserver and the frontend (which re-raises SIGTERM)
    and exits 0."""
    deltas, errors = [], []

    def stream():
        try:
            for delta in LLMClient(launcher.grpc_url, launcher.http_url).stream_grpc(
                    "Story:", max_tokens=1500, ignore_eos=True):
                deltas.append(delta)
        except LLMError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 60
    while len(deltas) < 2:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)
    sigterm = time.monotonic()
    launcher.process.send_signal(signal.SIGTERM)
    status = launcher.process.wait(90)
    stopped = time.monotonic() - sigterm
    thread.join(30)
    log = launcher.log()
    print(f"launcher exited {status} {stopped:.1f} s after SIGTERM; stream ended with {deltas[-1].finish_reason}")
    assert "draining: unloading llm" in log and "could not unload" not in log and "draining failed" not in log
    assert not errors and deltas[-1].finish_reason == "abort"
    assert status == 0
