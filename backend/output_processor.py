"""From engine requests to what callers see: detokenization, stop strings, fan-in of ``n`` > 1, sinks.

vLLM v1's ``OutputProcessor``: the engine core hands over the requests that gained a token or ended this
step; this module turns each into a :class:`RequestOutput` delta for its caller's sink. It owns
the per-completion state (:class:`RequestState`: detokenizer, parent) and the caller-side counters
(prompt and generation tokens, finish reasons). It never changes a request: a stop string it finds is
handed back (:meth:`OutputProcessor.detokenize`) and the engine asks the scheduler to finish the request.
"""

from __future__ import annotations

import queue
import threading
from collections import Counter
from dataclasses import dataclass

from backend.detokenizer import IncrementalDetokenizer
from backend.outputs import RequestMetrics, RequestOutput, coalesce
from backend.parallel_sampling import ParentRequest
from backend.request import Request, RequestStatus
from backend.sampler import TokenLogprobs
from backend.stopping import stop_strings_active


@dataclass
class RequestState:
    """One completion as the output side tracks it."""

    request: Request
    detokenizer: IncrementalDetokenizer
    parent: ParentRequest
    held: RequestOutput | None = None  # deltas not sent yet (stream_interval), merged
    sent_tokens: int = 0
    num_detokenized: int = 0  # output tokens added to the detokenizer
    num_emitted: int = 0  # output tokens put in deltas (held ones included)
    # Prompt logprobs gathered chunk by chunk (entry 0, the first prompt token, is None); sent on the first delta.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputProcessor:
    """Builds and delivers deltas. ``add_request`` may be called from any thread; the rest from the engine
    thread only. With ``stream_interval`` N > 1 a completion's deltas after its first are merged until N new
    tokens have accumulated or it ends (vLLM's ``--stream-interval``)."""

    def __init__(self, tokenizer, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self._lock = threading.Lock()
        self._parents: dict[str, ParentRequest] = {}  # caller's id -> the request, until done
        self._states: dict[str, RequestState] = {}  # engine request id -> its state, until finished
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # finish reason -> completions

    def add_request(self, parent: ParentRequest, requests: list[Request]) -> None:
        """Registers a caller's request and its completions.

        Raises:
            ValueError: a request with the same id is still in flight.
        """
        params = parent.params
        states = [RequestState(r, IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens, params.stop,
                                                               params.include_stop_str_in_output),
                               parent, prompt_logprobs=[None] if r.wants_prompt_logprobs else None)
                  for r in requests]
        with self._lock:
            if parent.request_id in self._parents:
                raise ValueError(f"request id {parent.request_id!r} is already in flight")
            self._parents[parent.request_id] = parent
            self._states.update((s.request.request_id, s) for s in states)

    def remove_request(self, parent: ParentRequest) -> None:
        """Forgets a request the engine core refused (it produced nothing)."""
        with self._lock:
            if self._parents.get(parent.request_id) is parent:
                del self._parents[parent.request_id]
            for request_id in parent.child_ids:
                self._states.pop(request_id, None)

    def child_ids(self, request_id: str) -> list[str]:
        """The engine request ids of a caller's request in flight (none when unknown or done)."""
        with self._lock:
            parent = self._parents.get(request_id)
            return parent.child_ids if parent is not None else []

    def parent_ids(self) -> list[str]:
        with self._lock:
            return list(self._parents)

    def has_unfinished_requests(self) -> bool:
        with self._lock:
            return bool(self._parents)

    def detokenize(self, requests: list[Request]) -> list[tuple[Request, int | None]]:
        """Adds each request's new tokens to its text, one by one (a speculative decode appends several),
        stopping at the first that completes a stop string.

        A request the scheduler ended on a token (EOS, a stop token id, a finished grammar) leaves that token's
        text out unless ``include_stop_str_in_output``, as vLLM's detokenizer does for a stop-terminated request;
        the token itself stays in ``token_ids`` and its logprobs.

        Returns:
            (request, where its stop string ends) for the requests whose text now ends in a stop string (outside
            ``min_tokens``): None when in the last token, else the number of output tokens up to and including
            the one it ends in (the engine drops the rest: no token past a stop is emitted).
        """
        stopped = []
        for request in requests:
            state = self._states[request.request_id]
            detokenizer = state.detokenizer
            num_new = request.num_output_tokens - state.num_detokenized
            state.num_detokenized = request.num_output_tokens
            # Stop strings are matched below, so a request stopped already was stopped by its last token.
            stop_token = (request.status == RequestStatus.FINISHED_STOPPED
                          and not request.params.include_stop_str_in_output)
            if num_new == 1:
                if not stop_token:
                    detokenizer.add_token(request.token_ids[-1], check_stop=stop_strings_active(request))
                if detokenizer.stopped:
                    stopped.append((request, None))
                continue
            min_tokens = request.params.min_tokens
            for i, token_id in enumerate(request.token_ids[-num_new:]):
                num_output_tokens = request.num_output_tokens - num_new + i + 1
                if stop_token and num_output_tokens == request.num_output_tokens:
                    break
                detokenizer.add_token(token_id, check_stop=num_output_tokens > min_tokens)  # stop_strings_active
                if detokenizer.stopped:
                    last = num_output_tokens == request.num_output_tokens
                    stopped.append((request, None if last else num_output_tokens))
                    state.num_detokenized = num_output_tokens
                    break
        return stopped

    def make_outputs(self, with_token: list[Request], without_token: list[Request],
                     logprobs: dict[str, TokenLogprobs],
                     prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] | None = None,
                     ) -> list[tuple[queue.Queue, RequestOutput]]:
        """Deltas for the requests that gained a token this step and for those that ended without one
        (aborted, failed); the counters are updated at once, the caller puts the deltas on their sinks.

        Args:
            prompt_logprobs: this step's prompt-logprob entries (``EngineCoreOutput.prompt_logprobs``), gathered
                until the completion's first delta carries them all. A chunk computed again after a preemption
                repeats entries already held; those are skipped.

        Returns:
            (sink, delta) pairs, in that order (held-back deltas, see ``stream_interval``, are not among them).
        """
        for request_id, (first, entries) in (prompt_logprobs or {}).items():
            state = self._states.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                gathered = state.prompt_logprobs  # chunks arrive in order: first <= len(gathered)
                gathered.extend(entries[len(gathered) - first:])
        outputs = []
        for request in with_token:
            state = self._states[request.request_id]
            num_new = request.num_output_tokens - state.num_emitted  # 1, or more after a speculative decode
            if state.num_emitted == 0 and request.index == 0:
                self.prompt_tokens += request.num_prompt_tokens
            state.num_emitted = request.num_output_tokens
            self.generation_tokens += num_new
            token_logprobs = logprobs.get(request.request_id)
            outputs += self._emit(request, request.token_ids[-num_new:],
                                  None if token_logprobs is None else [token_logprobs], state)
        for request in without_token:
            outputs += self._emit(request, [], None)
        return outputs

    def _emit(self, request: Request, token_ids: list[int], logprobs: list[TokenLogprobs] | None,
              state: RequestState | None = None) -> list[tuple[queue.Queue, RequestOutput]]:
        """This step's delta of ``request`` (none while ``stream_interval`` holds it back; two when an error
        follows held-back tokens); ``state``: its :class:`RequestState` when the caller has it at hand."""
        state = state or self._states[request.request_id]
        parent = state.parent
        finished = request.is_finished
        out = RequestOutput(parent.request_id, token_ids, state.detokenizer.delta(final=finished),
                            request.status.finish_reason, request.num_prompt_tokens, request.num_output_tokens,
                            logprobs, request.error, index=request.index,
                            num_cached_tokens=request.num_cached_tokens, prompt_logprobs=state.prompt_logprobs)
        state.prompt_logprobs = None  # on the first delta only
        before = []
        if self.stream_interval > 1:
            held, state.held = state.held, None
            if held is not None:
                *before, out = coalesce([held, out])  # an error is never merged into: the tokens go first
            new_tokens = request.num_output_tokens - state.sent_tokens
            if not finished and state.sent_tokens and new_tokens < self.stream_interval:
                state.held = out
                return []
            state.sent_tokens = request.num_output_tokens
        if finished:
            out.metrics = RequestMetrics(request.arrival_time, request.first_token_time, request.finish_time,
                                         request.num_output_tokens)
            self.finished[out.finish_reason] += 1
            out.done = parent.finish_child()
            with self._lock:
                del self._states[request.request_id]
                if out.done:
                    del self._parents[parent.request_id]
        return [(parent.sink, delta) for delta in [*before, out]]
