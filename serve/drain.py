"""Draining with a grace period, on tritonserver 2.51's Python backend.

When a model is unloaded (``POST /v2/repository/models/<name>/unload`` with the admin key, ``serve.control``,
or ``python -m serve`` on SIGTERM, which unloads every model before it stops tritonserver), Triton turns the
model not ready at once and routes no new request to it, but lets the requests in flight go on and calls the
model's ``finalize`` only once all of them have finished, with no time limit. The model gets no signal of its
own: the stub ignores SIGTERM and SIGINT, and ``finalize`` comes too late for a timer. What it can see is its
own readiness:
``pb_utils.is_model_ready(name, version)`` turns false within a poll of the unload, and raises ("Server not
ready") once a SIGTERMed tritonserver has begun unloading its models. :class:`DrainMonitor` polls it; from
the first time it reads not ready the model is draining: requests that reach the model from then on are
refused with UNAVAILABLE, those in flight go on for ``drain_grace_s`` seconds (a model setting, default 30,
Triton's default ``--exit-timeout-secs``), and whatever is still in flight then ends with finish_reason
``abort`` and its final response, so that the unload completes and tritonserver can exit cleanly.

The idea of a bounded drain is vLLM's ``--shutdown-timeout`` and Triton's own ``--exit-timeout-secs``; the
readiness poll is this project's way to learn of the unload on Triton 2.51.
"""

from __future__ import annotations

import logging
import threading
import time

from backend import EngineUnavailableError, LLMEngine

log = logging.getLogger("llm")
GRACE_SETTING = "drain_grace_s"
DEFAULT_GRACE_S = 30.0
POLL_S = 0.25


def pop_grace(settings: dict) -> float:
    """Removes ``drain_grace_s`` from the model's settings and returns it (seconds; default 30).

    Raises:
        ValueError: not a finite number >= 0.
    """
    raw = settings.pop(GRACE_SETTING, "")
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return DEFAULT_GRACE_S
    if isinstance(raw, bool):
        raise ValueError(f"{GRACE_SETTING} must be a number of seconds, got {raw!r}")
    try:
        grace = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"{GRACE_SETTING} must be a number of seconds, got {raw!r}") from None
    if not 0 <= grace < float("inf"):
        raise ValueError(f"{GRACE_SETTING} must be a finite number >= 0, got {raw!r}")
    return grace


class DrainMonitor:
    """Polls the model's own readiness on a thread of its own (``llm-drain``); see the module docstring.

    Args:
        grace_s: seconds from the start of the drain after which requests still in flight are aborted.
    """

    def __init__(self, engine: LLMEngine, pb_utils, model_name: str, model_version: str, grace_s: float) -> None:
        self.engine = engine
        self.pb_utils = pb_utils
        self.model_name, self.model_version = model_name, model_version
        self.grace_s = grace_s
        self.draining_since: float | None = None  # time.monotonic() when first seen not ready
        self.aborted = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    def start(self) -> None:
        """Starts polling (idempotent). Call it from ``execute``, never from ``initialize``: Triton calls
        ``execute`` only once the model is ready, and a readiness query while the server is still loading
        the model's versions can block that load for good (seen with two versions loading at once)."""
        with self._start_lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._run, name="llm-drain", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stops polling and waits for a readiness query in progress: the stub must not exit in the middle of
        one (the server then fails to lock the message queue the stub left locked, and aborts)."""
        with self._start_lock:
            self._stop.set()
            thread = self._thread
        if thread is not None:
            thread.join(timeout)

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def check_accepting(self) -> None:
        """Raises if the model is draining (called before a request is handed to the engine).

        Raises:
            EngineUnavailableError: draining; the client should retry elsewhere or later.
        """
        if self.draining_since is not None:
            raise EngineUnavailableError("server is shutting down (the model is being unloaded); retry later")

    def _ready(self) -> bool:
        try:
            return bool(self.pb_utils.is_model_ready(self.model_name, self.model_version))
        except Exception as exc:  # "Server not ready": tritonserver is stopping
            log.debug("readiness check failed: %s", exc)
            return False

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.draining_since is None:
                # Asked only while requests are in flight: nothing to drain otherwise (Triton itself refuses
                # requests to an unloaded model), and a query racing Triton's unload of an idle model is one
                # more chance for the server to find the stub's message queue locked as it goes.
                if not self.engine.request_ids() or self._ready():
                    continue
                self.draining_since = time.monotonic()
                log.warning("model %r version %s is being unloaded: draining %d request(s) in flight for up "
                            "to %.0f s", self.model_name, self.model_version, len(self.engine.request_ids()),
                            self.grace_s)
            if time.monotonic() - self.draining_since >= self.grace_s:
                # Again on every poll: a request taken by the intake thread just before the drain began may
                # reach the engine after the first abort.
                in_flight = self.engine.request_ids()
                if in_flight and not self.aborted:
                    log.warning("drain grace period (%.0f s) over: aborting %d request(s)", self.grace_s,
                                len(in_flight))
                self.aborted = True
                for request_id in in_flight:
                    self.engine.abort(request_id)
