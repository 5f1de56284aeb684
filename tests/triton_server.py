"""A real tritonserver for tests: started on free ports, stopped at the end of the test run."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import requests
from prometheus_client.parser import text_string_to_metric_families

from serve.launch import DEFAULT_MODEL_REPOSITORY, REPO_ROOT, build_command

STARTUP_TIMEOUT_S = 300


@dataclass
class TritonServer:
    http_url: str
    grpc_url: str
    metrics_url: str
    process: subprocess.Popen
    log_path: Path

    def is_ready(self) -> bool:
        try:
            return requests.get(f"{self.http_url}/v2/health/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def metrics(self) -> dict[tuple[str, frozenset], float]:
        """(sample name, labels) -> value, from Triton's /metrics."""
        text = requests.get(self.metrics_url, timeout=5).text
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    def metric(self, name: str, **labels) -> float:
        """The sum of the samples of ``name`` whose labels include ``labels``.

        (The parser names a counter's samples ``<name>_total`` even where Triton omits the suffix.)
        """
        wanted = set(labels.items())
        names = {name, f"{name}_total"}
        return sum(v for (n, ls), v in self.metrics().items() if n in names and wanted <= ls)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def eventually(condition, message: str, timeout_s: float = 10.0) -> None:
    """Polls ``condition`` every 50 ms until it holds; fails with ``message`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.05)


def settled(read, timeout_s: float = 10.0):
    """``read()`` once two reads 0.5 s apart agree. A model publishes its metrics at most every 0.2 s while
    responses flow (and 0.25 s after the last), so a test's baseline of a counter must wait out the previous
    test's last counts."""
    deadline = time.monotonic() + timeout_s
    value = read()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        value, last = read(), value
        if value == last:
            return value
    raise AssertionError(f"metrics still changing after {timeout_s} s: {value}")


_handed_out: set[int] = set()  # every port free_ports() returned in this process
_handed_out_lock = threading.Lock()


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports, free now and not returned before in this process. The sockets that
    find them stay bound until all are found, so the kernel cannot offer one twice. (Another process can still
    take one before its user binds it: see :func:`_start_on_free_ports`.)"""
    sockets = []
    try:
        with _handed_out_lock:
            ports = []
            while len(ports) < count:
                sockets.append(socket.socket())
                sockets[-1].bind(("127.0.0.1", 0))
                port = sockets[-1].getsockname()[1]
                if port not in _handed_out:
                    ports.append(port)
                    _handed_out.add(port)
            return ports
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


DEFAULT_VERSION_POLICY = "version_policy: { latest: { num_versions: 1 } }"  # model_repository/llm/config.pbtxt


def status_before_the_body(url: str, path: str, declared_bytes: int, headers: dict[str, str],
                           timeout_s: float = 30.0) -> tuple[int, bytes]:
    """POSTs ``path`` announcing a body of ``declared_bytes`` (``Content-Length``) but sending only its first
    KiB, and returns the status code and the answer's body read before ``timeout_s``: a server that waits for
    the body sends nothing (``TimeoutError``), so the answer proves the body was never needed."""
    connection = http.client.HTTPConnection(url.removeprefix("http://"), timeout=timeout_s)
    try:
        connection.putrequest("POST", path)
        for name, value in {**headers, "Content-Length": str(declared_bytes)}.items():
            connection.putheader(name, value)
        connection.endheaders(b"{" + b" " * 1023)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def serve_app(app, **settings):
    """Serves an ASGI app with uvicorn on a free loopback port, on a thread of its own, as a context manager
    that yields its base URL and stops it on exit. ``settings`` go to ``uvicorn.Config`` (``http=``, ...)."""
    import contextlib
    import threading

    import uvicorn

    @contextlib.contextmanager
    def running():
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", **settings))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "the app did not start"
            time.sleep(0.05)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(10)
    return running()


def copy_repository(target: Path, version_settings: dict[str, dict]) -> Path:
    """A copy of the project's model repository at ``target`` serving every version (``version_policy: { all: {} }``
    instead of the newest only), whose versions' ``engine.json`` are replaced by ``version_settings`` (version ->
    settings), e.g. ``{"2": {"dtype": "float32"}}``; returns ``target``."""
    shutil.copytree(DEFAULT_MODEL_REPOSITORY, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    config = target / "llm" / "config.pbtxt"
    config.write_text(config.read_text().replace(DEFAULT_VERSION_POLICY, "version_policy: { all: {} }"))
    for version, settings in version_settings.items():
        (target / "llm" / version / "engine.json").write_text(json.dumps(settings))
    return target


def single_version_repository(target: Path, settings: dict) -> Path:
    """A model repository at ``target`` holding the project's ``llm`` model as one version (1) with ``settings``
    as its ``engine.json`` (the config's version policy dropped); returns ``target``."""
    model = target / "llm"
    (model / "1").mkdir(parents=True)
    config = (DEFAULT_MODEL_REPOSITORY / "llm" / "config.pbtxt").read_text()
    (model / "config.pbtxt").write_text(config.replace(DEFAULT_VERSION_POLICY, ""))
    (model / "1" / "model.py").symlink_to(DEFAULT_MODEL_REPOSITORY / "llm" / "1" / "model.py")
    (model / "1" / "engine.json").write_text(json.dumps(settings))
    return target


def start_server(log_path: Path, extra_args: list[str] | None = None, model_repository: Path | None = None,
                 env: dict[str, str] | None = None) -> TritonServer:
    """Starts tritonserver on ``model_repository`` (default: the project's), with ``env`` added to the
    environment; returns once it reports ready."""
    def start(http: int, grpc: int, metrics: int) -> TritonServer:
        command = build_command(**({"model_repository": model_repository} if model_repository else {}),
                                http_port=http, grpc_port=grpc, metrics_port=metrics,
                                extra_args=["--metrics-interval-ms=200", *(extra_args or [])])
        process = subprocess.Popen(command.argv, env={**command.env, **(env or {})}, stdout=open(log_path, "wb"),
                                   stderr=subprocess.STDOUT)
        return _wait_ready(TritonServer(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                        f"http://127.0.0.1:{metrics}/metrics", process, log_path))
    return _start_on_free_ports(start)


def start_launcher(log_path: Path, model_repository: Path, launcher_args: list[str] | None = None,
                   env: dict[str, str] | None = None, openai_port: int = 0) -> TritonServer:
    """Starts ``python -m serve`` on ``model_repository`` (the OpenAI frontend on ``openai_port``, 0: none), with
    ``env`` added to the environment; ``process`` is the launcher, which supervises tritonserver. Returns once
    the server (and the frontend, if any) reports ready."""
    def start(http: int, grpc: int, metrics: int) -> TritonServer:
        argv = [sys.executable, "-m", "serve", f"--model-repository={model_repository}", f"--http-port={http}",
                f"--grpc-port={grpc}", f"--metrics-port={metrics}", f"--openai-port={openai_port}",
                "--metrics-interval-ms=200", *(launcher_args or [])]
        process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                                   env={**os.environ, **(env or {})})
        return _wait_ready(TritonServer(f"http://127.0.0.1:{http}", f"127.0.0.1:{grpc}",
                                        f"http://127.0.0.1:{metrics}/metrics", process, log_path))
    server = _start_on_free_ports(start)
    process = server.process
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while openai_port and not _answers(f"http://127.0.0.1:{openai_port}/health"):
        if process.poll() is not None or time.monotonic() > deadline:
            stop_server(server)
            raise RuntimeError(f"the OpenAI frontend did not become ready:\n{server.log()[-5000:]}")
        time.sleep(0.5)
    return server


START_ATTEMPTS = 3
# What tritonserver (2.51) logs, then exits 1, when one of its ports is taken:
# failed to start HTTP service: Unavailable - Socket '127.0.0.1:39407' already in use
PORT_TAKEN = re.compile(r"failed to start (HTTP|GRPC|Metrics) service: .* already in use")


class PortTaken(RuntimeError):
    """tritonserver exited because another process had bound one of its ports."""


def _start_on_free_ports(start) -> TritonServer:
    """``start(http_port, grpc_port, metrics_port)`` on distinct free ports. tritonserver binds them only once
    its models have loaded (tens of seconds), so another process (a test run beside this one) can take one
    meanwhile: then it starts again on new ports, up to :data:`START_ATTEMPTS` times in all."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            return start(*free_ports(3))
        except PortTaken:
            if attempt == START_ATTEMPTS:
                raise


def _wait_ready(server: TritonServer) -> TritonServer:
    """Returns once the server reports ready and its metrics endpoint answers: Triton starts the metrics service
    after the HTTP one (seen 43 ms later), so a test reading metrics at once could be refused.

    Raises:
        PortTaken: it exited because one of its ports was taken.
        RuntimeError: it exited otherwise, or was not ready within :data:`STARTUP_TIMEOUT_S`.
    """
    process = server.process
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (server.is_ready() and _answers(server.metrics_url)):
        exited = process.poll() is not None
        if exited or time.monotonic() > deadline:
            stop_server(server)
            log = server.log()
            error = PortTaken if exited and PORT_TAKEN.search(log) else RuntimeError
            raise error(f"tritonserver did not become ready:\n{log[-5000:]}")
        time.sleep(0.5)
    return server


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.RequestException:
        return False


def stop_server(server: TritonServer) -> None:
    server.process.terminate()
    try:
        server.process.wait(60)
    except subprocess.TimeoutExpired:
        server.process.kill()
        server.process.wait()
