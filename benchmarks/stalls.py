"""Does a heavy request delay the others? Heavy requests against the real stack, with small ones timed meanwhile.

``python -m benchmarks.stalls [--cases a,b] [--output-dir results/stalls]``

Starts ``python -m serve`` (tritonserver and the OpenAI frontend) on one model version, then for each heavy
request (:data:`CASES`):

1. a baseline window (``--baseline-s``, 3 s): small requests are timed back to back, each on a connection of its
   own kept open (``GET /health``, and ``POST /v1/completions`` with ``max_tokens`` 1), while a streaming
   completion (``ignore_eos``) runs and the time between its events is recorded;
2. the heavy window: the heavy request is sent (from a process of its own, so that building and sending it
   never holds up the timing threads), repeated until ``--heavy-s`` (2 s) have passed, while the same small
   requests and the same stream go on.

The delay a heavy request causes is the difference between the windows: the small requests' median latency in
the heavy window minus their median in the baseline (``p50``), and their largest latency minus the baseline's
largest (``max``); the stream's added gap is its largest gap between events in the heavy window minus its
largest in the baseline. The project's aim is that no heavy request adds more than 100 ms to either. Timings
depend on what else runs on the machine: the report records the load average and the CPU count.

Results: ``<output-dir>/report.json`` (every latency measured) and ``report.md`` (the table printed).
``tests/test_stalls.py`` runs the same cases with looser bounds.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import requests

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
# One version, the project's defaults but for a KV pool that holds the 256-prompt request and the stream.
ENGINE_SETTINGS = {"max_num_seqs": 256, "num_blocks": 2048, "max_model_len": 4096, "drain_grace_s": 3.0}
MODEL = "llm"
SMALL_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
STREAM_BODY = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True}
FIVE_MB = 5_000_000


# -- heavy requests (run in the sender process) ------------------------------------------------------------
def _outcome(response: requests.Response) -> str:
    """``<status> <error code>`` or ``<status> ok``."""
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} (not JSON)"
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return f"{response.status_code} {body['error'].get('code') or body['error'].get('type')}"
    return f"{response.status_code} ok"


def _post(url: str, body, headers: dict | None = None, timeout: float = 120) -> str:
    data = body if isinstance(body, (bytes, bytearray)) or callable(getattr(body, "__next__", None)) \
        else json.dumps(body).encode()
    try:
        response = requests.post(url, data=data, headers={"Content-Type": "application/json", **(headers or {})},
                                 timeout=timeout)
    except requests.ConnectionError as exc:
        return f"connection closed ({type(exc.__context__ or exc).__name__})"
    return _outcome(response)


def _chunked_flood(url: str, body: bytes, timeout: float = 120) -> str:
    """POSTs ``body`` with ``Transfer-Encoding: chunked``, one byte per chunk, over a raw socket; returns the
    answer's status line (and error code), or what became of the connection."""
    parts = urlsplit(url)
    head = (f"POST {parts.path} HTTP/1.1\r\nHost: {parts.hostname}:{parts.port}\r\n"
            f"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        try:
            sock.sendall(head)
            step = 8192
            for i in range(0, len(body), step):
                sock.sendall(b"".join(b"1\r\n" + body[j:j + 1] + b"\r\n" for j in range(i, min(i + step, len(body)))))
            sock.sendall(b"0\r\n\r\n")
        except OSError as exc:
            return f"connection closed while sending ({type(exc).__name__})"
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError as exc:
            if not answer:
                return f"connection closed before an answer ({type(exc).__name__})"
    if not answer:
        return "connection closed before an answer"
    status = answer.split(b"\r\n", 1)[0].decode(errors="replace")
    payload = answer.split(b"\r\n\r\n", 1)[-1]
    code = "ok"
    try:
        error = json.loads(payload).get("error")
        code = (error.get("code") if isinstance(error, dict) else error) or "ok"
    except (ValueError, AttributeError):
        pass
    parts = status.split()
    return f"{parts[1] if len(parts) > 1 else status} {code}"


def _padded(body: dict, size: int) -> bytes:
    """``body`` as JSON, led by spaces to ``size`` bytes (still one valid JSON document)."""
    text = json.dumps(body).encode()
    return b" " * (size - len(text)) + text


def _nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def slow_schema(properties: int) -> dict:
    """A schema within the size, depth and keyword bounds whose grammar takes seconds to compile: ``properties``
    required string properties, each with a bounded-repetition ``pattern`` (about 40 ms of compile apiece)."""
    return {"type": "object", "required": [f"p{i}" for i in range(properties)],
            "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z]{{{i % 20 + 1},40}}"}
                           for i in range(properties)}}


def _chat(content: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}


def _schema_chat(schema: dict, max_tokens: int = 4) -> dict:
    return _chat("Fill in the form.", max_tokens=max_tokens,
                 response_format={"type": "json_schema", "json_schema": {"name": "form", "schema": schema}})


@dataclass
class Case:
    """A heavy request: ``send(openai_url, triton_http_url)`` sends it once and returns its outcome (a string);
    ``expect``: the outcomes that are right (a prefix each)."""

    name: str
    what: str
    send: object
    expect: tuple[str, ...]
    settle_s: float = 0.0  # after the heavy window, for the engine to finish what the heavy request started


@functools.cache
def _big_body() -> bytes:
    return b'{"model": "llm", "messages": [{"role": "user", "content": "' + b"a" * (50 << 20) + b'"}]}'


def _chunked_body():
    body = _big_body()
    for i in range(0, len(body), 1 << 20):
        yield body[i:i + (1 << 20)]


def _cases() -> list[Case]:
    """The heavy requests; their payloads are built on first use (in the sender process)."""
    huge = "word " * (FIVE_MB // 5)
    digits = "0123456789" * 33_000  # 330,000 bytes, one token a digit: within the byte bound of max_model_len 4096
    flood = functools.cache(lambda: _padded({"model": MODEL, "prompt": "Hi", "max_tokens": 1}, 1_000_000))
    triton_flood = functools.cache(lambda: _padded({"text_input": "Hi", "max_tokens": 1}, 1_000_000))
    return [
        Case("body_50mb", "50 MiB chat body, Content-Length declared",
             lambda o, t: _post(f"{o}/v1/chat/completions", _big_body()),
             ("413 request_too_large", "connection closed")),
        Case("body_50mb_chunked", "50 MiB chat body, chunked (no Content-Length)",
             lambda o, t: _post(f"{o}/v1/chat/completions", _chunked_body()),
             ("413 request_too_large", "connection closed")),
        Case("render_5mb", "5 MB prompt to /v1/completions/render",
             lambda o, t: _post(f"{o}/v1/completions/render", {"model": MODEL, "prompt": huge}),
             ("400 invalid_value",)),
        Case("chat_render_5mb", "5 MB message to /v1/chat/completions/render",
             lambda o, t: _post(f"{o}/v1/chat/completions/render", _chat(huge)), ("400 invalid_value",)),
        Case("tokenize_5mb", "5 MB prompt to /tokenize",
             lambda o, t: _post(f"{o}/tokenize", {"model": MODEL, "prompt": huge}), ("400 invalid_value",)),
        Case("render_330k_tokens", "330 kB of digits to /v1/completions/render (330,000 token ids, within bounds)",
             lambda o, t: _post(f"{o}/v1/completions/render", {"model": MODEL, "prompt": digits}), ("200 ok",)),
        Case("tokenize_330k_tokens", "330 kB of digits to /tokenize (330,000 token ids, within bounds)",
             lambda o, t: _post(f"{o}/tokenize", {"model": MODEL, "prompt": digits}), ("200 ok",)),
        Case("completion_330k_tokens",
             "330 kB of digits to /v1/completions (tokenized by the engine, over max_model_len)",
             lambda o, t: _post(f"{o}/v1/completions", {"model": MODEL, "prompt": digits, "max_tokens": 1}),
             ("400 invalid_value", "400 invalid_request")),
        Case("schema_480_deep", "response_format schema of arrays nested 480 deep",
             lambda o, t: _post(f"{o}/v1/chat/completions", _schema_chat(_nested_arrays(480))),
             ("400 invalid_request",)),
        Case("schema_slow_compile", "response_format schema within bounds, ~1 s to compile on an idle core (served)",
             lambda o, t: _post(f"{o}/v1/chat/completions", _schema_chat(slow_schema(24 + time.time_ns() % 7))),
             ("200 ok",)),
        Case("prompts_2000", "/v1/completions with 2,000 prompts",
             lambda o, t: _post(f"{o}/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 2000, "max_tokens": 1}),
             ("400 invalid_value",)),
        Case("prompts_256", "/v1/completions with 256 prompts, max_tokens 1 (the limit)",
             lambda o, t: _post(f"{o}/v1/completions", {"model": MODEL, "prompt": ["Hi"] * 256, "max_tokens": 1}),
             ("200 ok",), settle_s=1.0),
        Case("chunked_flood", "1,000,000 one-byte chunks to the frontend (a valid completion request)",
             lambda o, t: _chunked_flood(f"{o}/v1/completions", flood()), ("200 ok", "413 request_too_large")),
        Case("schema_compile_timeout", "response_format schema within bounds, over the 10 s compile deadline "
             "(in CPU time: a 503 when the compile, at a lower priority, got under 10 CPU-seconds in 30 s)",
             lambda o, t: _post(f"{o}/v1/chat/completions", _schema_chat(slow_schema(320 + time.time_ns() % 20))),
             ("400 invalid_request", "503 service_unavailable")),
        Case("chunked_flood_triton", "1,000,000 one-byte chunks to Triton's HTTP generate (loopback only)",
             lambda o, t: _chunked_flood(f"{t}/v2/models/llm/generate", triton_flood()), ("200", "400")),
    ]


def case_names() -> list[str]:
    return [c.name for c in _cases()]


# chunked_flood_triton is left out unless asked for: tritonserver 2.51 dies of it (SIGSEGV), and with it the stack.
DEFAULT_CASES = [name for name in case_names() if name != "chunked_flood_triton"]


def _sender(conn, openai_url: str, triton_url: str, sender_priority: str = "normal") -> None:
    """The sender process: builds the cases once, then per ("run", name, until) sends that case's request
    repeatedly until ``until`` (``time.time()``), at least once, and answers with the outcomes."""
    if sender_priority == "idle":
        _lowest_priority()
    cases = {c.name: c for c in _cases()}
    conn.send("ready")
    while (message := conn.recv()) is not None:
        _, name, until = message
        outcomes = []
        while True:
            start = time.time()
            outcomes.append((_safe(cases[name].send, openai_url, triton_url), time.time() - start))
            if time.time() >= until:
                break
        conn.send(outcomes)


def _lowest_priority() -> None:
    """The sender as a stand-in for a client on another machine: it runs only when the CPU is otherwise idle
    (``SCHED_IDLE``, nice 19, in a new POSIX session whose autogroup is at nice 19, so that the kernel's
    autogroups do not weigh it as much as the stack)."""
    os.setsid()
    try:
        Path("/proc/self/autogroup").write_text("19")
    except OSError:
        pass
    os.nice(19)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (OSError, AttributeError):
        pass


def _safe(send, *args) -> str:
    try:
        return send(*args)
    except Exception as exc:  # reported as the outcome
        return f"error {type(exc).__name__}: {exc}"[:200]


# -- the timing side ------------------------------------------------------------------------------------
@dataclass
class Watch:
    """Background threads timing small requests and recording a stream's events (``time.time()`` stamps)."""

    openai_url: str
    health: list[tuple[float, float]] = field(default_factory=list)  # (start, seconds)
    completion: list[tuple[float, float]] = field(default_factory=list)
    failures: list[tuple[float, str]] = field(default_factory=list)
    events: list[tuple[int, float]] = field(default_factory=list)  # (stream number, arrival)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> "Watch":
        for target in (self._probe_health, self._probe_completion, self._stream):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def close(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(30)

    def _probe(self, method: str, path: str, body, into: list) -> None:
        http = requests.Session()
        while not self.stop.is_set():
            start = time.time()
            try:
                response = http.request(method, f"{self.openai_url}{path}", json=body, timeout=60)
                ok = response.status_code == 200
                if not ok:
                    self.failures.append((start, f"{path}: {response.status_code} {response.text[:200]}"))
            except requests.RequestException as exc:
                ok = False
                self.failures.append((start, f"{path}: {type(exc).__name__}"))
                http = requests.Session()
            if ok:
                into.append((start, time.time() - start))
            self.stop.wait(0.01)

    def _probe_health(self) -> None:
        self._probe("GET", "/health", None, self.health)

    def _probe_completion(self) -> None:
        self._probe("POST", "/v1/completions", SMALL_COMPLETION, self.completion)

    def _stream(self) -> None:
        number = 0
        while not self.stop.is_set():
            number += 1
            try:
                with requests.post(f"{self.openai_url}/v1/completions", json=STREAM_BODY, stream=True,
                                   timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith(b"data: {"):
                            self.events.append((number, time.time()))
                        if self.stop.is_set():
                            break
            except requests.RequestException as exc:
                self.failures.append((time.time(), f"stream: {type(exc).__name__}"))
                self.stop.wait(0.5)

    def window(self, start: float, end: float) -> dict:
        """The small requests that overlapped [start, end] and the stream's gaps that ended in it."""
        def overlapping(samples):
            return [s for t, s in samples if t < end and t + s > start]

        gaps = [b - a for (na, a), (nb, b) in zip(self.events, self.events[1:]) if na == nb and start < b and a < end]
        return {"health_s": overlapping(self.health), "completion_s": overlapping(self.completion),
                "stream_gaps_s": gaps,
                "failures": [f for t, f in self.failures if start <= t <= end]}


def _ms(x: float | None) -> float | None:
    return None if x is None else round(1000 * x, 1)


def summarize(before: dict, during: dict) -> dict:
    """Added latency (ms) of the small requests and added stream gap between a baseline window and a heavy one:
    ``<probe>_delay_p50_ms`` = median minus median, ``<probe>_delay_max_ms`` = largest minus largest,
    ``stream_gap_added_ms`` = largest gap minus largest gap, and the raw figures beside them."""
    out = {}
    for probe in ("health", "completion"):
        a, b = before[f"{probe}_s"], during[f"{probe}_s"]
        out[f"{probe}_count"] = len(b)
        out[f"{probe}_before_p50_ms"] = _ms(statistics.median(a)) if a else None
        out[f"{probe}_before_max_ms"] = _ms(max(a)) if a else None
        out[f"{probe}_p50_ms"] = _ms(statistics.median(b)) if b else None
        out[f"{probe}_max_ms"] = _ms(max(b)) if b else None
        out[f"{probe}_delay_p50_ms"] = _ms(statistics.median(b) - statistics.median(a)) if a and b else None
        out[f"{probe}_delay_max_ms"] = _ms(max(b) - max(a)) if a and b else None
    gaps_a, gaps_b = before["stream_gaps_s"], during["stream_gaps_s"]
    out["stream_gap_before_max_ms"] = _ms(max(gaps_a)) if gaps_a else None
    out["stream_gap_max_ms"] = _ms(max(gaps_b)) if gaps_b else None
    out["stream_gap_added_ms"] = _ms(max(gaps_b) - max(gaps_a)) if gaps_a and gaps_b else None
    failures = before["failures"] + during["failures"]
    out["failure_count"] = len(failures)
    out["failures"] = failures[:5]  # the first few; the count says how many
    return out


class Bench:
    """The running stack, the sender process and the watch; :meth:`run` measures one case."""

    def __init__(self, openai_url: str, triton_http_url: str, sender_priority: str = "normal") -> None:
        self.openai_url = openai_url
        self.triton_http_url = triton_http_url
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.sender = context.Process(target=_sender, args=(child, openai_url, triton_http_url, sender_priority),
                                      daemon=True)
        self.sender.start()
        if not self.conn.poll(120) or self.conn.recv() != "ready":
            raise RuntimeError("the sender process did not start")
        self.cases = {c.name: c for c in _cases()}
        self.watch = Watch(openai_url).start()
        deadline = time.time() + 120
        while len(self.watch.events) < 5 or not self.watch.completion:
            if time.time() > deadline:
                raise RuntimeError(f"the stream or the small requests did not start: {self.watch.failures[-3:]}")
            time.sleep(0.1)

    def run(self, name: str, baseline_s: float = 3.0, heavy_s: float = 2.0) -> dict:
        """Measures case ``name``: a baseline window, then the heavy window; returns the summary with the
        case's outcomes (each with its seconds) and whether every outcome was an expected one (``as_expected``)."""
        case = self.cases[name]
        start = time.time()
        time.sleep(baseline_s)
        middle = time.time()
        self.conn.send(("run", name, middle + heavy_s))
        if not self.conn.poll(600):
            raise RuntimeError(f"{name}: no answer from the sender in 600 s")
        outcomes = self.conn.recv()
        end = time.time()
        time.sleep(0.3)  # a probe started just before the end has time to finish
        result = {"case": name, "what": case.what, "outcomes": [o for o, _ in outcomes],
                  "heavy_s": [round(s, 3) for _, s in outcomes],
                  "as_expected": all(o.startswith(case.expect) for o, _ in outcomes),
                  **summarize(self.watch.window(start, middle), self.watch.window(middle, end))}
        time.sleep(case.settle_s)
        return result

    def close(self) -> None:
        self.watch.close()
        self.conn.send(None)
        self.sender.join(10)


def table(rows: list[dict]) -> str:
    """The markdown table: heavy request, outcome, small-request delay p50/max (ms; /health and a 1-token
    completion), the completion's median before -> during (ms), the stream's largest gap (ms; baseline ->
    heavy window, added)."""
    def cell(x):
        return "-" if x is None else f"{x:.0f}"

    lines = ["| heavy request | outcome | /health delay p50 / max | completion delay p50 / max | "
             "completion p50: before -> during | stream gap max: before -> during (added) |", "|---|---|---|---|---|---|"]
    for r in rows:
        outcome = ", ".join(sorted(set(r["outcomes"]))) + ("" if r["as_expected"] else " (UNEXPECTED)")
        if "stack_exited" in r:
            outcome += f"; {r['stack_exited']}"
        lines.append(f"| {r['what']} | {outcome} (x{len(r['outcomes'])}, {max(r['heavy_s']):.2f} s) | "
                     f"{cell(r['health_delay_p50_ms'])} / {cell(r['health_delay_max_ms'])} | "
                     f"{cell(r['completion_delay_p50_ms'])} / {cell(r['completion_delay_max_ms'])} | "
                     f"{cell(r['completion_before_p50_ms'])} -> {cell(r['completion_p50_ms'])} | "
                     f"{cell(r['stream_gap_before_max_ms'])} -> {cell(r['stream_gap_max_ms'])} "
                     f"({cell(r['stream_gap_added_ms'])}) |")
    return "\n".join(lines)


def page_markdown(report: dict) -> str:
    """The table, in milliseconds (``benchmarks.docs_page``)."""
    return table(report["rows"]) + "\n\nAll figures in ms: each delay is the heavy window's figure minus the baseline's.\n"


markdown = page_markdown


def start_stack(workdir: Path):
    """``python -m serve`` on a one-version repository (:data:`ENGINE_SETTINGS`), the frontend on a free port;
    returns the server handle (``tests/triton_server.py``) with ``openai_url`` set."""
    sys.path.insert(0, str(TESTS_DIR))
    from triton_server import free_port, single_version_repository, start_launcher

    models = single_version_repository(workdir / "models", ENGINE_SETTINGS)
    port = free_port()
    server = start_launcher(workdir / "serve.log", models, openai_port=port)
    server.openai_url = f"http://127.0.0.1:{port}"
    return server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stalls", description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES),
                        help=f"comma-separated subset of {','.join(case_names())} (default all but "
                             f"{','.join(sorted(set(case_names()) - set(DEFAULT_CASES)))}, which ends the stack)")
    parser.add_argument("--baseline-s", type=float, default=3.0, help="seconds of the baseline window")
    parser.add_argument("--heavy-s", type=float, default=2.0, help="the heavy request is repeated for this long")
    parser.add_argument("--sender-priority", choices=("normal", "idle"), default="normal",
                        help="the heavy requests' sender process: at the default priority, sharing the CPUs with "
                             "the stack (a client on the same machine), or idle (runs only when the CPUs are "
                             "otherwise idle: a stand-in for a client on another machine)")
    parser.add_argument("--output-dir", default="results/stalls")
    parser.add_argument("--openai-url", help="measure a running stack instead (with --triton-http-url)")
    parser.add_argument("--triton-http-url", default="http://127.0.0.1:8000")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.cases.split(",") if n.strip()]
    unknown = set(names) - set(case_names())
    if unknown:
        parser.error(f"unknown cases {sorted(unknown)}; known: {case_names()}")
    from benchmarks.machine import machine_info

    report = {"benchmark": "benchmarks.stalls",
              "command": " ".join(["python -m benchmarks.stalls", *(sys.argv[1:] if argv is None else argv)]),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "machine": {**machine_info(0), "cpus": os.cpu_count()},
              "engine_settings": ENGINE_SETTINGS, "sender_priority": args.sender_priority, "rows": []}
    server = None
    if args.openai_url:
        openai_url, triton_url = args.openai_url.rstrip("/"), args.triton_http_url.rstrip("/")
    else:
        server = start_stack(Path(tempfile.mkdtemp(prefix="bench-stalls-")))
        openai_url, triton_url = server.openai_url, server.http_url
    bench = Bench(openai_url, triton_url, args.sender_priority)
    try:
        for name in names:
            row = bench.run(name, args.baseline_s, args.heavy_s)
            print(json.dumps({k: v for k, v in row.items() if not k.endswith("_count")}), flush=True)
            report["rows"].append(row)
            if not _answers(f"{triton_url}/v2/health/live"):
                row["stack_exited"] = "tritonserver stopped answering"
                if server is not None:
                    try:
                        server.process.wait(60)
                        row["stack_exited"] += f"; the launcher exited with status {server.process.returncode}"
                    except subprocess.TimeoutExpired:
                        pass
                print(row["stack_exited"], flush=True)
                break
            if row["failures"]:  # a restarted part: wait until the stack serves again
                _wait_serving(openai_url)
    finally:
        bench.close()
        if server is not None:
            from triton_server import stop_server

            stop_server(server)
    report["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / "report.json").write_text(json.dumps(report, indent=2))
    machine = report["machine"]
    text = (table(report["rows"]) + f"\n\nms; {machine['cpus']} CPUs, load average "
            f"{machine['loadavg_at_start'][0]} at start, {machine['loadavg_at_end'][0]} at the end\n")
    (output / "report.md").write_text(text)
    print(text)
    return 0


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def _wait_serving(openai_url: str, timeout_s: float = 300) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if requests.post(f"{openai_url}/v1/completions", json=SMALL_COMPLETION, timeout=10).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
