"""Triton Python backend model (decoupled): a thin adapter between Triton requests and the engine.

``initialize`` builds the engine and starts its loop thread; ``execute`` validates each request, hands it
to the engine and returns at once; a sender thread delivers the engine's deltas through each request's
response sender. Every request gets exactly one response flagged FINAL, however it ends.
"""

from __future__ import annotations

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

from backend import EngineConfig, LLMEngine, RequestOutput
from serve.metrics import EngineMetrics
from serve.request_parsing import parse_request

log = logging.getLogger("llm")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_REFRESH_S = 0.25
ORPHAN_CHECK_S = 0.5


@dataclass
class _InFlight:
    sender: object
    stream: bool
    prefix: str  # the prompt, prepended to a non-streaming answer unless exclude_input_in_output
    finished: dict[int, RequestOutput] = field(default_factory=dict)  # completion index -> its last delta
    text: dict[int, list[str]] = field(default_factory=dict)
    token_ids: dict[int, list[int]] = field(default_factory=dict)


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        settings = {k: v["string_value"] for k, v in model_config.get("parameters", {}).items()}
        overrides = Path(args["model_repository"]) / args["model_version"] / "engine.json"
        if overrides.exists():
            settings.update(json.loads(overrides.read_text()))
        self.engine = LLMEngine(EngineConfig.from_dict(settings))
        self.metrics = EngineMetrics(pb_utils, args["model_name"], args["model_version"])
        self.outputs: queue.Queue[RequestOutput | None] = queue.Queue()
        self.inflight: dict[str, _InFlight] = {}
        # Held while asking a sender is_cancelled() and while sending a FINAL: Triton frees a response
        # sender's factory after its FINAL, and asking it then reads freed memory (a server crash).
        self.senders_lock = threading.Lock()
        self.server_pid = os.getppid()
        self.engine.before_step = self._abort_cancelled
        self.engine.start()
        self.sender_thread = threading.Thread(target=self._send_loop, name="llm-sender", daemon=True)
        self.sender_thread.start()
        threading.Thread(target=self._exit_when_orphaned, name="llm-watchdog", daemon=True).start()

    def execute(self, requests: list) -> None:
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
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parsed = parse_request(inputs, json.loads(request.parameters() or "{}"))
            request_id = f"{request.request_id() or 'req'}-{uuid.uuid4().hex[:12]}"
            prefix = "" if parsed.stream or parsed.exclude_input_in_output else parsed.prompt
            self.inflight[request_id] = _InFlight(sender, parsed.stream, prefix)
            try:
                self.engine.add_request(parsed.prompt, parsed.params, request_id, sink=self.outputs)
            except Exception:
                del self.inflight[request_id]
                raise
            return None
        except ValueError as exc:
            _send_error(sender, str(exc), pb_utils.TritonError.INVALID_ARG)
            return str(exc)
        except Exception as exc:
            log.exception("request rejected")
            _send_error(sender, f"internal error: {exc}", pb_utils.TritonError.INTERNAL)
            return str(exc)

    def finalize(self) -> None:
        self.engine.shutdown(timeout=5.0)  # in-flight requests end with finish_reason "abort"
        self.outputs.put(None)
        self.sender_thread.join(timeout=5.0)

    # -- threads ------------------------------------------------------------------------------------
    def _abort_cancelled(self) -> None:
        """Runs on the engine loop before every step: cancelled or disconnected requests are aborted."""
        with self.senders_lock:
            for request_id, state in list(self.inflight.items()):
                if state.sender.is_cancelled():
                    self.engine.abort(request_id)

    def _exit_when_orphaned(self) -> None:
        """This stub serves tritonserver alone: when the server is gone (killed before it could unload the
        model), nothing can be answered any more, so the process ends instead of generating for no one.
        A thread of its own, since the others may be blocked for good in a call to the dead server."""
        while os.getppid() == self.server_pid:
            time.sleep(ORPHAN_CHECK_S)
        log.error("tritonserver (pid %d) is gone; exiting", self.server_pid)
        os._exit(1)

    def _send_loop(self) -> None:
        while True:
            try:
                out = self.outputs.get(timeout=METRICS_REFRESH_S)
            except queue.Empty:
                self.metrics.update(self.engine.stats())
                continue
            if out is None:
                return
            try:
                with self.senders_lock:
                    self._send(out)
            except Exception:
                log.exception("sending a response failed")
            if out.finished or self.outputs.empty():
                self.metrics.update(self.engine.stats())

    def _send(self, out: RequestOutput) -> None:
        state = self.inflight.get(out.request_id)
        if state is None:
            return
        if out.done:
            del self.inflight[out.request_id]
        if out.metrics is not None:
            self.metrics.observe_finished(out.metrics)
        if out.finish_reason == "error":
            _send_error(state.sender, out.error or "generation failed", pb_utils.TritonError.INTERNAL)
            if not out.done:  # other completions of this request may still stream: stop them
                self.engine.abort(out.request_id)
                self.inflight.pop(out.request_id, None)
            return
        flags = FINAL if out.done else 0
        if state.stream:
            if out.token_ids or out.text or out.finished:
                state.sender.send(_response([out.text], out.token_ids, [out]), flags=flags)
            return
        state.text.setdefault(out.index, []).append(out.text)
        state.token_ids.setdefault(out.index, []).extend(out.token_ids)
        if out.finished:
            state.finished[out.index] = out
        if out.done:
            order = sorted(state.finished)
            texts = [state.prefix + "".join(state.text.get(i, [])) for i in order]
            ids = [t for i in order for t in state.token_ids.get(i, [])]
            state.sender.send(_response(texts, ids, [state.finished[i] for i in order]), flags=FINAL)


def _response(texts: list[str], token_ids: list[int], outs: list[RequestOutput]):
    """One response; with n > 1 completions and stream false, one entry per completion (ids concatenated)."""
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([t.encode("utf-8") for t in texts], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int64)),
        pb_utils.Tensor("finish_reason", np.array([(o.finish_reason or "").encode() for o in outs], dtype=np.object_)),
        pb_utils.Tensor("num_input_tokens", np.array([outs[0].num_prompt_tokens], dtype=np.uint32)),
        pb_utils.Tensor("num_output_tokens", np.array([o.num_output_tokens for o in outs], dtype=np.uint32)),
        pb_utils.Tensor("num_cached_tokens", np.array([outs[0].num_cached_tokens], dtype=np.uint32)),
        pb_utils.Tensor("index", np.array([o.index for o in outs], dtype=np.uint32)),
    ])


def _send_error(sender, message: str, code) -> None:
    sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)
