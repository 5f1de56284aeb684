"""Model readiness that follows the engine's health, on tritonserver 2.51's Python backend.

In this Triton (2.51, as bundled with nvidia-pytriton) a Python model cannot report itself not ready: the
backend has no readiness hook (``is_model_ready`` in ``pb_utils`` asks about *another* model), and a dead or
SIGKILLed stub leaves the model READY (requests then fail with ``Stub process ... is not healthy``). What
does turn readiness false is unloading the model, which a model may ask for itself through
``pb_utils.unload_model`` when the server runs with ``--model-control-mode=explicit``. So once the engine is
dead (:meth:`backend.LLMEngine.check_health` raises), :class:`HealthMonitor` unloads the model: its
readiness (``/v2/models/<name>/ready``) goes false (the server's, ``/v2/health/ready``, only while the unload
runs: with no model loaded Triton counts the server ready), and new requests are refused by Triton itself. In the default model-control mode that call is refused; the model then stays
READY, and its requests are refused fast with UNAVAILABLE (``engine is dead``) by the engine. The call goes
from the stub to tritonserver in-process (the backend's message queue), not through HTTP or gRPC, so the
launcher's restriction of the repository API to its admin key (``serve.control``) does not stop it.

Before unloading, the model leaves a file named after it in the directory ``LLM_ENGINE_DEATHS_DIR`` names (the
launcher sets it): to the launcher's watch (``serve.stub_watch``) an unload is the same whoever asked for it, and
only an engine's death is to be loaded again, not an operator's unload through the repository API.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from backend import EngineDeadError, LLMEngine
from serve.stub_watch import DEATHS_DIR_ENV

log = logging.getLogger("llm")


def record_death(model_name: str, reason: str) -> None:
    """Leaves ``$LLM_ENGINE_DEATHS_DIR/<model_name>`` (holding ``reason``) for the launcher's watch; nothing
    without the variable (tritonserver run without the launcher)."""
    deaths_dir = os.environ.get(DEATHS_DIR_ENV)
    if not deaths_dir:
        return
    try:
        (Path(deaths_dir) / model_name).write_text(reason + "\n", encoding="utf-8")
    except OSError as exc:
        log.error("could not record the engine's death for the launcher (%s): it will take the unload for an "
                  "operator's and not load model %r again", exc, model_name)


class HealthMonitor:
    """Watches one engine; ``check`` is cheap (no I/O while healthy) and may be called from any thread."""

    def __init__(self, engine: LLMEngine, pb_utils, model_name: str) -> None:
        self.engine = engine
        self.pb_utils = pb_utils
        self.model_name = model_name
        self.dead_reason: str | None = None
        self._lock = threading.Lock()

    def check(self) -> bool:
        """True while the engine is healthy. The first time it is found dead, asks Triton to unload the model
        (on a thread of its own: the unload waits for requests in flight, which may need the caller)."""
        if self.dead_reason is not None:
            return False
        try:
            self.engine.check_health()
            return True
        except EngineDeadError as exc:
            with self._lock:
                if self.dead_reason is not None:
                    return False
                self.dead_reason = str(exc)
            log.error("%s: unloading model %r so that it reports not ready", exc, self.model_name)
            record_death(self.model_name, self.dead_reason)
            threading.Thread(target=self._unload, name="llm-unload", daemon=True).start()
            return False

    def _unload(self) -> None:
        try:
            self.pb_utils.unload_model(self.model_name)
        except Exception as exc:  # the default model-control mode refuses it
            log.error("could not unload model %r (%s); it stays READY and refuses requests with UNAVAILABLE. "
                      "Run tritonserver with --model-control-mode=explicit for readiness to follow health",
                      self.model_name, exc)
