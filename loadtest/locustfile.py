"""Locust users that stream completions from the Triton ``llm`` model, over HTTP and over gRPC.

``HttpStreamUser`` posts to ``/v2/models/llm/generate_stream`` (server-sent events); ``GrpcStreamUser`` uses
Triton's decoupled gRPC stream (tritonclient). Both take prompts and exact output lengths (``ignore_eos``) from
the workload file. A share of the users (``--cancel-share``) cancel every stream they open after a random
number of tokens: gRPC cancels the stream, HTTP drops the connection.

Each stream fires Locust request events, ``request_type`` being the protocol (``http`` / ``grpc``):

========== ======================================================================================
name       value (in Locust's response-time columns)
========== ======================================================================================
TTFT       time to first token, ms
ITL        inter-token latency, ms: one sample per streamed response after the first
TPOT       time per output token after the first, ms: (e2e - TTFT) / (tokens - 1), one per request
e2e        end-to-end latency, ms, one per request; response_length = output tokens. Failures land here
tokens/s   output tokens per second of e2e latency, one per request (the value is tokens/s, not ms)
cancelled  a stream cancelled on purpose: ms until the cancel; response_length = tokens received.
           Never a failure, and no other event is fired for it
========== ======================================================================================

Run it through ``python -m loadtest`` (headless, with reports and a server summary) or with plain ``locust -f
loadtest/locustfile.py --host http://localhost:8000 --grpc-host localhost:8001`` for the web UI.
"""

from __future__ import annotations

# Locust has monkey-patched the standard library for gevent before it imports this file; grpcio needs its own
# switch, before any channel exists, or its blocking calls stall every greenlet in the process.
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()

import collections  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

from locust import User, between, events, task  # noqa: E402
from locust.runners import WorkerRunner  # noqa: E402

from client.llm_client import Delta, LLMClient  # noqa: E402
from loadtest.report import summarize_locust  # noqa: E402
from loadtest.streaming import StreamTiming, time_stream  # noqa: E402
from loadtest.workload import DEFAULT_WORKLOAD, WorkItem, load_workload  # noqa: E402

DEFAULT_HTTP_HOST = "http://localhost:8000"


@events.init_command_line_parser.add_listener
def add_arguments(parser) -> None:
    parser.add_argument("--grpc-host", default="localhost:8001", env_var="LOCUST_GRPC_HOST",
                        help="host:port of Triton's gRPC endpoint (the HTTP one is --host)")
    parser.add_argument("--workload", default=str(DEFAULT_WORKLOAD), env_var="LOCUST_WORKLOAD",
                        help="JSONL file of {prompt, max_tokens}")
    parser.add_argument("--max-output-tokens", type=int, default=0, env_var="LOCUST_MAX_OUTPUT_TOKENS",
                        help="cap every request's max_tokens (0: as in the workload)")
    parser.add_argument("--cancel-share", type=float, default=0.0, env_var="LOCUST_CANCEL_SHARE",
                        help="fraction of users (0..1) that cancel each stream mid-way")
    parser.add_argument("--model", default="llm", env_var="LOCUST_MODEL")
    parser.add_argument("--model-version", default="", env_var="LOCUST_MODEL_VERSION",
                        help="empty: the server's default version")
    parser.add_argument("--summary-json", default="", env_var="LOCUST_SUMMARY_JSON", include_in_web_ui=False,
                        help="write the final per-protocol summary here when Locust quits")


@events.quitting.add_listener
def write_summary(environment, **_kwargs) -> None:
    """Locust's CSV files are snapshots taken every second; this summary is taken once every user stopped."""
    path = environment.parsed_options and environment.parsed_options.summary_json
    if path and not isinstance(environment.runner, WorkerRunner):
        summary = summarize_locust(environment.stats, environment.runner.exceptions)
        Path(path).write_text(json.dumps(summary, indent=2))


# Users started so far in this process, per protocol: decides which of them cancel.
_users_started: collections.Counter[str] = collections.Counter()


def is_cancelling(index: int, share: float) -> bool:
    """Whether the ``index``-th user (0-based) of a protocol cancels: spread evenly, so that among the first
    ``n`` users ``n * share`` rounded to the nearest whole number cancel (share 0.2 of 4 users: 1)."""
    def cancelling(n: int) -> int:
        return math.floor(n * share + 0.5)

    return cancelling(index + 1) > cancelling(index)


class StreamingUser(User):
    """Streams one completion per task; subclasses say how (``protocol``, ``open_stream``)."""

    abstract = True
    protocol = ""
    wait_time = between(0.1, 1.0)

    def on_start(self) -> None:
        options = self.environment.parsed_options
        self.workload = load_workload(options.workload, options.max_output_tokens or None)
        self.cancels = is_cancelling(_users_started[self.protocol], options.cancel_share)
        _users_started[self.protocol] += 1
        self.llm = LLMClient(grpc_url=options.grpc_host, http_url=self.host or DEFAULT_HTTP_HOST,
                             model=options.model, version=options.model_version)

    def open_stream(self, item: WorkItem) -> Iterator[Delta]:
        raise NotImplementedError

    @task
    def stream_completion(self) -> None:
        item = random.choice(self.workload)
        cancel_after = random.randint(1, max(1, item.max_tokens // 2)) if self.cancels else None
        try:
            timing = time_stream(self.open_stream(item), cancel_after)
        except Exception as exc:  # the server's error or a connection failure: a failed request
            self.fire("e2e", 0.0, exception=exc)
            return
        self.report(timing, item)

    def report(self, timing: StreamTiming, item: WorkItem) -> None:
        if timing.cancelled:
            self.fire("cancelled", timing.e2e_s * 1000, timing.output_tokens)
            return
        error = None
        if timing.finish_reason != "length" or timing.output_tokens != item.max_tokens:
            error = AssertionError(f"expected {item.max_tokens} tokens and finish_reason 'length', got "
                                   f"{timing.output_tokens} and {timing.finish_reason!r}")
        if timing.ttft_s is not None:
            self.fire("TTFT", timing.ttft_s * 1000)
        for gap in timing.itl_s:
            self.fire("ITL", gap * 1000)
        if timing.tpot_s is not None:
            self.fire("TPOT", timing.tpot_s * 1000)
        if timing.tokens_per_s is not None:
            self.fire("tokens/s", timing.tokens_per_s)
        self.fire("e2e", timing.e2e_s * 1000, timing.output_tokens, error)

    def fire(self, name: str, value: float, length: int = 0, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(request_type=self.protocol, name=name, response_time=value,
                                             response_length=length, exception=exception, context={})


class HttpStreamUser(StreamingUser):
    """Streams over HTTP ``generate_stream`` (server-sent events)."""

    protocol = "http"

    def open_stream(self, item: WorkItem) -> Iterator[Delta]:
        return self.llm.stream_http(item.prompt, max_tokens=item.max_tokens, ignore_eos=True)


class GrpcStreamUser(StreamingUser):
    """Streams over Triton's decoupled gRPC stream."""

    protocol = "grpc"

    def open_stream(self, item: WorkItem) -> Iterator[Delta]:
        return self.llm.stream_grpc(item.prompt, max_tokens=item.max_tokens, ignore_eos=True)
