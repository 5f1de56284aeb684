"""Client-side timing of one streamed completion: TTFT, ITL, TPOT, end-to-end latency and output tokens/s.

Works on any iterator of :class:`client.llm_client.Delta` (``LLMClient.stream_http`` or ``stream_grpc``). The
request goes out when iteration starts, so the clock starts there. Closing the iterator cancels the request on
the server (gRPC: the stream is cancelled; HTTP: the connection is dropped).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field

from client.llm_client import Delta


@dataclass
class StreamTiming:
    """What one stream took, all times in seconds.

    Attributes:
        ttft_s: time to first token, from sending the request to the first response carrying a token.
        itl_s: inter-token latency, one sample per token-carrying response after the first: the gap since
            the previous such response divided by the tokens in this one.
        e2e_s: end-to-end latency, from sending the request to the final response (or to the cancel).
        output_tokens: tokens received.
        finish_reason: the server's (``length``, ``stop``, ...); None when cancelled or cut short.
        cancelled: the client cancelled the stream on purpose before it finished.
    """

    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None
    cancelled: bool = False

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: ``(e2e - TTFT) / (tokens - 1)``, seconds."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens per second of end-to-end latency."""
        return self.output_tokens / self.e2e_s if self.output_tokens and self.e2e_s > 0 else None


def time_stream(deltas: Iterator[Delta], cancel_after_tokens: int | None = None,
                clock: Callable[[], float] = time.perf_counter) -> StreamTiming:
    """Consumes ``deltas`` and times them; with ``cancel_after_tokens``, closes the stream (cancelling the
    request) once that many tokens have arrived, unless the stream has finished by then.

    The stream is closed however this returns, so an exception or a stopped Locust user cancels it too.
    """
    timing = StreamTiming()
    start = last = clock()
    with closing(deltas):
        for delta in deltas:
            now = clock()
            if delta.token_ids:
                if timing.ttft_s is None:
                    timing.ttft_s = now - start
                else:
                    timing.itl_s.append((now - last) / len(delta.token_ids))
                last = now
                timing.output_tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                timing.finish_reason = delta.finish_reason
                break
            if cancel_after_tokens is not None and timing.output_tokens >= cancel_after_tokens:
                timing.cancelled = True
                break
        timing.e2e_s = clock() - start
    return timing
