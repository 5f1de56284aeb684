"""Triton Python backend model (decoupled): a thin adapter between Triton requests and the engine.

``initialize`` builds the engine and starts its loop thread; ``execute`` validates each request, hands it
to the engine and returns at once; a sender thread delivers the engine's deltas through each request's
response sender. Every request gets exactly one response flagged FINAL, however it ends. A request with the
parameter ``abort`` is no generation: it aborts the one its client gave that ``abort_key`` (``serve.abort_keys``).

Threads of this adapter: Triton's (``execute``: parse, cheap checks, and the tokenizing of prompts up to
``INLINE_TOKENIZE_BYTES``), ``llm-intake`` (tokenizes longer prompts, so they never hold up ``execute``),
``llm-grammar-<i>`` (one per grammar compile thread: adds the requests whose structured-output constraint is not
compiled yet, each waiting for its compile, up to the compile timeout, so that no request waits behind it),
``llm-sender`` (responses, a completion's queued deltas merged into one; metrics), ``llm-cancel`` (asks each
sender ``is_cancelled()`` every ``CANCEL_SWEEP_S``, or less often past ``MAX_CANCEL_CHECKS_PER_S``, and aborts
those requests in the engine, which drops a waiting one before it can be scheduled), ``llm-drain``
(``serve.drain``: once the model is being unloaded, refuses new requests and aborts those still in flight after
``drain_grace_s``), ``llm-watchdog``. The engine loop never calls back into this module. The sender thread also
checks the engine's health when idle (``serve.health``: a dead engine unloads the model).

A request the engine cannot take now (the waiting queue is full, or the engine is dead) gets UNAVAILABLE
(on gRPC; tritonserver 2.51's HTTP generate endpoints answer every error with 400, newer ones UNAVAILABLE with
503); bad input gets INVALID_ARG (HTTP 400).
"""

from __future__ import annotations

import faulthandler
import gc
import json
import logging
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from backend import EngineConfig, EngineUnavailableError, LLMEngine, RequestOutput, cpu_ops
from backend.config import read_settings_file
from backend.errors import REQUEST_ERROR_STARTS
from backend.fan_in import Completion, FanIn
from backend.outputs import coalesce
from backend.prompt_limits import check_prompt_bytes
from serve.abort_keys import ABORT, abort_key
from serve.drain import GRACE_SETTING, DrainMonitor, pop_grace
from serve.health import HealthMonitor
from serve.logprobs import vllm_logprobs
from serve.metrics import METRIC_SETTINGS, EngineMetrics, pop_metric_settings
from serve.request_parsing import check_request_id, parse_request

log = logging.getLogger("llm")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_REFRESH_S = 0.25
FINALIZE_WATCHDOG_S = 20.0
ORPHAN_CHECK_S = 0.5
CANCEL_SWEEP_S = 0.05
MAX_CANCEL_CHECKS_PER_S = 100  # is_cancelled() round trips; past it the sweeps space out (256 in flight: 2.6 s)
METRICS_MIN_INTERVAL_S = 0.2  # metrics are published at most this often while responses flow (changes only)
MAX_SEND_BATCH = 1 << 20  # deltas taken off the queue at once, then merged per completion: all there are
# Threads that wait for constraints to compile: past the compiler's processes, requests queue in the compiler,
# which answers 503 to one queued for its compile_timeout (a wait here has no bound).
GRAMMAR_WAITERS = 32
INLINE_TOKENIZE_BYTES = 64 * 1024  # longer prompts (up to engine.max_prompt_bytes) are tokenized on llm-intake


@dataclass
class _InFlight:
    sender: object
    stream: bool
    prefix: str  # the prompt, prepended to a non-streaming answer unless exclude_input_in_output
    completions: FanIn = field(default_factory=FanIn)  # the deltas so far, per completion (backend.fan_in)
    logprobs: bool = False  # send output_log_probs / cum_log_probs
    returns: frozenset[str] = frozenset()  # the vLLM backend's return_* inputs that were true
    prompt_logprobs: bool = False  # send the prompt_logprobs output
    wanted: frozenset[str] = frozenset()  # the outputs the client asked for (all of them when it named none)
    abort_key: str | None = None  # an abort request with this key ends it (serve.abort_keys)
    aborted: bool = False  # by such a request: aborted on every cancellation sweep until its FINAL has gone out


def _log_to_stderr() -> None:
    """INFO and above of the engine (``backend``: the attention backend chosen, the kernels built, threads pinned),
    the kernels and this model in Triton's log, the stub's stderr (Python alone prints warnings only there)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in ("backend", "kernels", "llm"):
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        _log_to_stderr()
        model_config = json.loads(args["model_config"])
        settings = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        overrides = Path(args["model_repository"]) / args["model_version"] / "engine.json"
        if overrides.exists():
            settings.update(read_settings_file(overrides))
        metric_options = pop_metric_settings(settings)
        drain_grace_s = pop_grace(settings)
        self.engine = LLMEngine(EngineConfig.from_dict(settings, also_known=(*METRIC_SETTINGS, GRACE_SETTING)))
        self.metrics = EngineMetrics(pb_utils, args["model_name"], args["model_version"], **metric_options,
                                     speculative=self.engine.config.num_speculative_tokens > 0)
        self.health = HealthMonitor(self.engine, pb_utils, args["model_name"])
        self.drain = DrainMonitor(self.engine, pb_utils, args["model_name"], args["model_version"], drain_grace_s)
        self.outputs: queue.Queue[RequestOutput | None] = queue.Queue()
        self.inflight: dict[str, _InFlight] = {}
        self.num_responses = 0  # sent by the sender thread (metrics: llm_responses_total)
        # Held around every response sent and every is_cancelled(): Triton frees a response sender's factory
        # after its FINAL, and asking it then reads freed memory (a server crash); and a send overlapping an
        # is_cancelled() of another thread was seen to hang both for good (tritonserver 2.51, 1024 streams).
        self.senders_lock = threading.Lock()
        self.server_pid = os.getppid()
        self.stopping = threading.Event()
        self.intake: queue.Queue = queue.Queue()
        self.grammar_intake: queue.Queue = queue.Queue()
        self.engine.start()
        self.sender_thread = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self.sender_thread.start()
        threading.Thread(target=self._intake_loop, args=(self.intake,), name="llm-intake", daemon=True).start()
        for i in range(GRAMMAR_WAITERS):
            threading.Thread(target=self._intake_loop, args=(self.grammar_intake,), name=f"llm-grammar-{i}",
                             daemon=True).start()
        threading.Thread(target=self._cancel_loop, name="llm-cancel", daemon=True).start()
        threading.Thread(target=self._exit_when_orphaned, name="llm-watchdog", daemon=True).start()
        # The same check from a native thread: the Python one cannot run while another thread holds the GIL
        # blocked in a call to the dead server.
        cpu_ops.exit_when_orphaned(self.server_pid, ORPHAN_CHECK_S)
        # The model and libraries loaded (hundreds of thousands of objects) leave the collector's view: a full
        # collection over them holds the GIL, and so the engine loop, for 0.4 s (the default model, 2 cores).
        gc.freeze()

    def execute(self, requests: list) -> None:
        self.drain.start()  # here, not in initialize: see DrainMonitor.start
        errors = [self._submit(request) for request in requests]
        if len(requests) == 1 and errors[0]:
            # The error response has gone out already; raising as well makes Triton count the request as a
            # failure instead of a success (only safe when no other request shares this call).
            raise pb_utils.TritonModelException(errors[0])
        return None

    def _submit(self, request) -> str | None:
        """Hands one request to the engine; on bad input sends its error response and returns the message."""
        sender = request.get_response_sender()
        try:
            client_id = check_request_id(request.request_id() or "req")
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parameters = json.loads(request.parameters() or "{}")
            target = abort_key(parameters, ABORT)
            if target is not None:
                self._abort_by_key(target, inputs, sender)
                return None
            parsed = parse_request(inputs, parameters, request.timeout(),
                                   vocab_size=self.engine.model_config.vocab_size, check=self._check)
            request_id = f"{client_id}-{uuid.uuid4().hex[:12]}"
            prefix = "" if parsed.stream or parsed.exclude_input_in_output else parsed.prompt
            if not isinstance(prefix, str):  # input_ids: the ids' text, once they are known to be ids of the vocabulary
                prefix = self.engine.tokenizer.decode(self.engine.check_prompt_token_ids(prefix))
            state = _InFlight(sender, parsed.stream, prefix, logprobs=parsed.logprobs_asked,
                              returns=parsed.returns, wanted=frozenset(request.requested_output_names()),
                              prompt_logprobs=parsed.params.prompt_logprobs is not None,
                              abort_key=abort_key(parameters))
            structured = parsed.params.structured_outputs
            if structured is not None and not self.engine.grammar_compiler.is_cached(structured):
                self.inflight[request_id] = state
                self.grammar_intake.put((parsed, request_id))
                return None
            if isinstance(parsed.prompt, str) and len(parsed.prompt) > INLINE_TOKENIZE_BYTES // 4:
                check_prompt_bytes(parsed.prompt, self.engine.max_prompt_bytes, self.engine.max_model_len)
                if len(parsed.prompt.encode("utf-8", "surrogatepass")) > INLINE_TOKENIZE_BYTES:
                    self.inflight[request_id] = state
                    self.intake.put((parsed, request_id))
                    return None
            self._add(parsed, request_id, state)
            return None
        except EngineUnavailableError as exc:  # full or dead: UNAVAILABLE (the client may retry)
            _send_error(sender, str(exc), pb_utils.TritonError.UNAVAILABLE)
            return str(exc)
        except ValueError as exc:
            _send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            return str(exc)
        except Exception as exc:
            log.exception("request rejected")
            _send_error(sender, f"internal error: {exc}", pb_utils.TritonError.INTERNAL)
            return str(exc)

    def _abort_by_key(self, key: str, inputs: dict, sender) -> None:
        """An abort request (``serve.abort_keys``): aborts the requests in flight with this ``abort_key`` (none:
        they have finished) and sends the abort request's empty FINAL.

        Raises:
            ValueError: the abort request carries a prompt.
        """
        if "text_input" in inputs or "input_ids" in inputs:
            raise ValueError(f"an abort request (parameter {ABORT!r}) carries no prompt")
        aborted = []
        for request_id, state in list(self.inflight.items()):
            if state.abort_key == key:
                state.aborted = True
                aborted.append(request_id)
        if aborted:
            self.engine.abort(aborted)
        with self.senders_lock:
            sender.send(flags=FINAL)

    def _check(self, parsed) -> None:
        """The engine's checks of a request without queuing it (``parse_request`` runs them on replaced values)."""
        self.engine.check_request(parsed.params, parsed.cache_salt, parsed.fairness_key)

    def _add(self, parsed, request_id: str, state: _InFlight) -> None:
        """Tokenizes and queues one request in the engine. Raises what ``LLMEngine.add_request`` raises."""
        self.inflight[request_id] = state
        try:
            self.drain.check_accepting()
            timeout = None if parsed.timeout_ms is None else parsed.timeout_ms / 1000
            self.engine.add_request(parsed.prompt, parsed.params, request_id, sink=self.outputs,
                                    priority=parsed.priority, timeout=timeout, cache_salt=parsed.cache_salt,
                                    fairness_key=parsed.fairness_key)
        except Exception:
            self.inflight.pop(request_id, None)
            raise

    def finalize(self) -> None:
        # If this process is still here FINALIZE_WATCHDOG_S from now (a thread stuck in a call to the server
        # while it unloads the model, or the interpreter's exit held up), every thread's Python stack goes
        # to stderr (tritonserver's log): the unload then waits for tritonserver's exit timeout.
        faulthandler.dump_traceback_later(FINALIZE_WATCHDOG_S, exit=False)
        start = time.monotonic()
        self.stopping.set()
        self.drain.stop()
        self.intake.put(None)
        for _ in range(GRAMMAR_WAITERS):
            self.grammar_intake.put(None)
        self.engine.shutdown(timeout=5.0)  # in-flight requests end with finish_reason "abort"
        self.outputs.put(None)
        self.sender_thread.join(timeout=5.0)
        log.info("model %r version %s finalized in %.2f s", self.drain.model_name, self.drain.model_version,
                 time.monotonic() - start)

    # -- threads ------------------------------------------------------------------------------------
    def _intake_loop(self, intake: queue.Queue) -> None:
        """Adds the requests of ``intake`` to the engine off Triton's execute thread: long prompts (tokenized
        here; the Rust tokenizer releases the GIL) or constraints to compile (waited for here), so a short
        request arriving behind them is queued in the engine at once. Errors found here (too many tokens, a
        constraint refused) reach the client as INVALID_ARG like any other, but Triton cannot count them as
        failures."""
        while (item := intake.get()) is not None:
            parsed, request_id = item
            state = self.inflight.get(request_id)
            if state is None:
                continue
            try:
                with self.senders_lock:
                    cancelled = state.aborted or state.sender.is_cancelled()
                if cancelled:  # gave up while waiting: never tokenized, never queued
                    raise ValueError("request cancelled before it was queued")
                self._add(parsed, request_id, state)
            except EngineUnavailableError as exc:
                self._drop(request_id, state, str(exc), pb_utils.TritonError.UNAVAILABLE)
            except ValueError as exc:
                self._drop(request_id, state, str(exc), pb_utils.TritonError.INVALID_ARG)
            except Exception as exc:
                log.exception("request rejected")
                self._drop(request_id, state, f"internal error: {exc}", pb_utils.TritonError.INTERNAL)

    def _drop(self, request_id: str, state: _InFlight, message: str, code) -> None:
        """The error response (FINAL) of a request the engine never took."""
        with self.senders_lock:
            self.inflight.pop(request_id, None)
            _send_error(state.sender, message, code)

    def _cancel_loop(self) -> None:
        """Cancelled or disconnected requests are aborted: every ``CANCEL_SWEEP_S``, on this thread (each
        ``is_cancelled()`` is a round trip to the server, so with many requests in flight the sweeps are
        spaced to ask at most ``MAX_CANCEL_CHECKS_PER_S`` times a second: each check wakes this thread, the
        stub's message thread and one of the server's, and where the engine's threads fill the cores every
        wake-up preempts one of them; a cancelled request runs on at most that long, one row of a full batch).
        Served offline run of the benchmark, bf16, 2 cores: at 2000 checks a second tritonserver used 2.1-2.8
        CPU-s and this thread 1.1-1.4, at 200 0.9 and 0.2; the engine loop thread was preempted 25.4k times at
        200 and 12.5k at 50 (metrics written only when changed). The engine takes aborts before it
        schedules and a sweep's aborts reach it together, so a request cancelled while waiting is dropped without
        being admitted to the slots of running ones cancelled with it. A request is aborted again on each sweep
        until its FINAL has gone out (an abort of an unknown id is ignored), and so is one an abort request ended
        (``serve.abort_keys``): that covers one the intake thread was adding to the engine as the abort came."""
        while not self.stopping.wait(max(CANCEL_SWEEP_S, len(self.inflight) / MAX_CANCEL_CHECKS_PER_S)):
            try:
                cancelled = []
                for request_id in list(self.inflight):
                    with self.senders_lock:  # no is_cancelled() once its FINAL is sent (_send removes it first)
                        state = self.inflight.get(request_id)
                        if state is not None and (state.aborted or state.sender.is_cancelled()):
                            cancelled.append(request_id)
                if cancelled:  # at once: no step between a running request's abort and a waiting one's
                    self.engine.abort(cancelled)
            except Exception:
                log.exception("cancellation sweep failed")

    def _exit_when_orphaned(self) -> None:
        """This stub serves tritonserver alone: when the server is gone (killed before it could unload the
        model), nothing can be answered any more, so the process ends instead of generating for no one.
        A thread of its own, since the others may be blocked for good in a call to the dead server."""
        while os.getppid() == self.server_pid:
            time.sleep(ORPHAN_CHECK_S)
        log.error("tritonserver (pid %d) is gone; exiting", self.server_pid)
        os._exit(1)

    def _send_loop(self) -> None:
        """Sends what the engine produced: everything queued is taken at once and each completion's deltas
        are merged into one response (``backend.outputs.coalesce``), so when the engine runs ahead of the
        server a response carries several tokens instead of the sends falling behind. Metrics are published
        at most every ``METRICS_MIN_INTERVAL_S`` while busy (each write is an IPC round trip) and when idle."""
        metrics_due: float | None = None  # when unpublished changes must go out
        while True:
            timeout = METRICS_REFRESH_S if metrics_due is None else max(0.0, metrics_due - time.monotonic())
            try:
                batch = [self.outputs.get(timeout=timeout)]
            except queue.Empty:
                self.metrics.update(self.engine.stats(), self.num_responses)
                metrics_due = None
                self.health.check()
                continue
            while len(batch) < MAX_SEND_BATCH:
                try:
                    batch.append(self.outputs.get_nowait())
                except queue.Empty:
                    break
            stopping = None in batch
            for out in coalesce([out for out in batch if out is not None]):
                try:
                    self._send(out)
                except Exception as exc:
                    log.exception("sending a response failed")
                    self._end_unsent(out.request_id, exc)
            if stopping:
                return
            now = time.monotonic()
            if metrics_due is None:
                metrics_due = now + METRICS_MIN_INTERVAL_S
            if now >= metrics_due:
                self.metrics.update(self.engine.stats(), self.num_responses)
                metrics_due = None

    def _end_unsent(self, request_id: str, exc: Exception) -> None:
        """A request whose delta could not be sent is aborted and gets a final internal error, so that its
        client is never left waiting (unless the failure was in sending its final response)."""
        self.engine.abort(request_id)
        with self.senders_lock:
            state = self.inflight.pop(request_id, None)
            if state is not None:
                try:
                    _send_error(state.sender, f"internal error: {exc}", pb_utils.TritonError.INTERNAL)
                except Exception:
                    log.exception("sending the error response of request %s failed", request_id)

    def _send(self, out: RequestOutput) -> None:
        """Sends one (possibly merged) delta, under ``senders_lock``."""
        with self.senders_lock:
            if out.metrics is not None:  # every finished completion is timed, also after its request was dropped
                self.metrics.observe_finished(out.metrics)
            state = self.inflight.get(out.request_id)
            if state is not None:
                self._send_delta(state, out)

    def _send_delta(self, state: _InFlight, out: RequestOutput) -> None:
        if out.done:
            del self.inflight[out.request_id]
        if out.finish_reason == "error":
            if out.error and out.error.startswith(REQUEST_ERROR_STARTS):  # the request's own settings: its fault
                _send_error(state.sender, out.error, pb_utils.TritonError.INVALID_ARG)
            else:
                _send_error(state.sender, f"internal error: {out.error or 'generation failed'}",
                            pb_utils.TritonError.INTERNAL)
            if not out.done:  # other completions of this request may still stream: stop them
                self.engine.abort(out.request_id)
                self.inflight.pop(out.request_id, None)
            return
        flags = FINAL if out.done else 0
        completion = state.completions.add(out)
        if state.stream:
            if out.token_ids or out.text or out.finished:
                cumulative = [_cumulative(completion)]
                extra = []
                if state.logprobs:
                    extra = [*_log_prob_tensors([lp.logprob for lp in out.logprobs or []], cumulative),
                             self._vllm_logprobs([out.logprobs or []])]
                if state.prompt_logprobs:
                    extra.append(self._vllm_logprobs([out.prompt_logprobs], "prompt_logprobs"))
                extra += _vllm_outputs(state, cumulative, [len(out.token_ids)])
                state.sender.send(_response(state.wanted, [out.text], out.token_ids, [out], extra), flags=flags)
                self.num_responses += 1
            return
        if out.done:
            completions = state.completions.in_order()
            texts = [state.prefix + c.joined_text for c in completions]
            ids = [t for c in completions for t in c.token_ids]
            cumulative = [_cumulative(c) for c in completions]
            extra = []
            if state.logprobs:
                extra = [*_log_prob_tensors([lp.logprob for c in completions for lp in c.logprobs], cumulative),
                         self._vllm_logprobs([c.logprobs for c in completions])]
            if state.prompt_logprobs:
                extra.append(self._vllm_logprobs([c.prompt_logprobs for c in completions], "prompt_logprobs"))
            extra += _vllm_outputs(state, cumulative, [c.num_output_tokens for c in completions])
            state.sender.send(_response(state.wanted, texts, ids, [c.last for c in completions], extra), flags=FINAL)
            self.num_responses += 1

    def _vllm_logprobs(self, per_completion: list[list | None], name: str = "logprobs"):
        """The ``logprobs`` (or ``prompt_logprobs``) output in the vLLM backend's JSON form, one string per
        completion (``null`` for a completion without them)."""
        decode = lambda token_id: self.engine.tokenizer.decode([token_id])  # noqa: E731
        texts = [b"null" if steps is None else vllm_logprobs(steps, decode).encode("utf-8")
                 for steps in per_completion]
        return pb_utils.Tensor(name, np.array(texts, dtype=np.object_))


def _cumulative(completion: Completion) -> float:
    """The sum of a completion's token log-probabilities so far (0 without logprobs)."""
    return sum(lp.logprob for lp in completion.logprobs)


def _log_prob_tensors(output_log_probs: list[float], cum_log_probs: list[float]) -> list:
    """TensorRT-LLM's log-probability outputs: each new token's log-probability (natural log, of the
    model's raw distribution) and, per completion, the sum over all its tokens so far."""
    return [pb_utils.Tensor("output_log_probs", np.array(output_log_probs, dtype=np.float32)),
            pb_utils.Tensor("cum_log_probs", np.array(cum_log_probs, dtype=np.float32))]


def _vllm_outputs(state: _InFlight, cumulative: list[float], new_tokens: list[int]) -> list:
    """The outputs Triton's vLLM backend adds on request (``return_*`` inputs), per completion in the response:
    ``cumulative_logprob``, ``logprobs`` as JSON ``null`` where no logprobs were asked for, and
    ``num_output_tokens`` as the response's new tokens (replacing the tokens-so-far count)."""
    extra = []
    if "return_cumulative_logprob" in state.returns:
        extra.append(pb_utils.Tensor("cumulative_logprob", np.array(cumulative, dtype=np.float32)))
    if "return_logprobs" in state.returns and not state.logprobs:
        extra.append(pb_utils.Tensor("logprobs", np.array([b"null"] * len(cumulative), dtype=np.object_)))
    if "return_num_output_tokens" in state.returns:
        extra.append(pb_utils.Tensor("num_output_tokens", np.array(new_tokens, dtype=np.uint32)))
    return extra


def _response(wanted: frozenset[str], texts: list[str], token_ids: list[int], outs: list[RequestOutput],
              extra: list | None = None):
    """One response with the outputs in ``wanted`` (the request's requested outputs: each other one would cost the
    stub, the server and the client CPU on every streamed token for nothing); with n > 1 completions and stream
    false, one entry per completion (ids concatenated). An output in ``extra`` replaces the one of the same name
    built here."""
    tensors = [t for t in extra or [] if t.name() in wanted]
    replaced = {t.name() for t in tensors}
    for name, build in _BASE_OUTPUTS.items():
        if name in wanted and name not in replaced:
            tensors.append(pb_utils.Tensor(name, build(texts, token_ids, outs)))
    return pb_utils.InferenceResponse(output_tensors=tensors)


_BASE_OUTPUTS = {  # name -> its array from (texts, token_ids, outs)
    "text_output": lambda texts, ids, outs: np.array([t.encode("utf-8") for t in texts], dtype=np.object_),
    "output_ids": lambda texts, ids, outs: np.array(ids, dtype=np.int64),
    "finish_reason": lambda texts, ids, outs: np.array([(o.finish_reason or "").encode() for o in outs],
                                                       dtype=np.object_),
    "num_input_tokens": lambda texts, ids, outs: np.array([outs[0].num_prompt_tokens], dtype=np.uint32),
    "num_output_tokens": lambda texts, ids, outs: np.array([o.num_output_tokens for o in outs], dtype=np.uint32),
    "num_cached_tokens": lambda texts, ids, outs: np.array([outs[0].num_cached_tokens], dtype=np.uint32),
    "index": lambda texts, ids, outs: np.array([o.index for o in outs], dtype=np.uint32),
}


def _send_error(sender, message: str, code) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
