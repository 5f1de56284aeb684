"""The launcher's watch on tritonserver's models: a killed backend stub, and an engine that died.

**A killed stub.** Triton 2.51 keeps a model version READY after its stub process dies (SIGKILL, the OOM
killer): new requests fail at once with ``Stub process '<model>_0_0' is not healthy``, but the requests that
stub had in flight are never ended (the Python backend keeps their response factories, which only the stub
could finish, so their streams stay open), and the version's unload never completes (those factories hold
the model), whether the model is unloaded first, loaded first or reloaded. :class:`StubWatch` lists
tritonserver's stub processes (each one's command line names its ``<repository>/<model>/<version>/model.py``)
and the repository index; a version that is READY with no live stub on two checks in a row is broken, and
the check asks the launcher to restart tritonserver (``serve.supervise``), the one thing that ends those
streams.

**A dead engine.** A model whose engine died unloads itself (``serve.health``), after leaving a file named
after it in the watch's ``deaths_dir`` (``LLM_ENGINE_DEATHS_DIR`` in tritonserver's environment). A model that
the watch has seen loaded (READY, LOADING or UNLOADING: an engine can die, and its model start unloading, within
a second of turning READY, before any check saw it READY) and that is no longer loaded, without the launcher
having asked, is loaded again (on a thread of its own) when that file is there; if the load fails, the model
cannot recover in this process and the check asks the launcher to give up (drain, exit 1, so that an orchestrator
restarts the container). Each reload spends the launcher's restart budget. Without the file the model was
unloaded through the repository API (an operator with the admin key): it stays unloaded, spends nothing, and is
watched again once it is loaded.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import psutil
import requests

from serve.supervise import GIVE_UP, RESTART_SERVER, RestartBudget

STUB_NAME = "triton_python_backend_stub"
LOADED_STATES = ("READY", "LOADING", "UNLOADING")
LOAD_TIMEOUT_S = 600.0
DEATHS_DIR_ENV = "LLM_ENGINE_DEATHS_DIR"  # tritonserver's environment: where a model records its engine's death


def stub_versions(server_pid: int) -> set[tuple[str, str]]:
    """(model, version) of every live stub process of the tritonserver ``server_pid``."""
    versions = set()
    try:
        children = psutil.Process(server_pid).children()
    except psutil.NoSuchProcess:
        return versions
    for child in children:
        try:
            if child.name() != STUB_NAME or child.status() == psutil.STATUS_ZOMBIE:
                continue
            model_py = Path(child.cmdline()[1])
        except (psutil.Error, IndexError):
            continue
        versions.add((model_py.parent.parent.name, model_py.parent.name))
    return versions


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class StubWatch:
    """``check()`` (from the launcher's loop, about once a second) returns what the launcher must do: None,
    :data:`serve.supervise.RESTART_SERVER` (a stub is gone) or :data:`serve.supervise.GIVE_UP` (a model could
    not be loaded again, or the restart budget is spent)."""

    def __init__(self, http_url: str, server_pid: int, headers: dict[str, str] | None = None,
                 budget: RestartBudget | None = None, deaths_dir: str | None = None) -> None:
        self.http_url = http_url
        self.deaths_dir = deaths_dir  # where models record an engine's death (serve.health); None: every unload is one
        self.headers = headers or {}  # the admin key (serve.control): the repository API is restricted
        self.server_pid = server_pid
        self.budget = budget or RestartBudget()
        self._suspects: set[tuple[str, str]] = set()
        self._served: set[str] = set()  # models seen loaded
        self._reloading: set[str] = set()
        self._failed: str | None = None
        self.reloads: list[str] = []

    def check(self) -> str | None:
        if self._failed is not None:
            return GIVE_UP
        try:
            response = requests.post(f"{self.http_url}/v2/repository/index", json={}, headers=self.headers, timeout=2)
            response.raise_for_status()
            index = response.json()
        except (requests.RequestException, ValueError):
            return None  # not up yet, or stopping (a refused admin key is the launcher's own bug: drain reports it)
        ready = {(m["name"], m["version"]) for m in index if m.get("state") == "READY" and "version" in m}
        broken = ready - stub_versions(self.server_pid)
        suspects, self._suspects = self._suspects, broken
        if broken & suspects:
            names = ", ".join(f"{m!r} version {v}" for m, v in sorted(broken & suspects))
            log(f"the backend stub of model {names} is gone: Triton cannot end its requests in flight; "
                f"restarting tritonserver")
            return RESTART_SERVER
        loaded = {m["name"] for m in index if m.get("state") in LOADED_STATES}
        self._served |= loaded
        for model in sorted(self._served - loaded - self._reloading):
            if not self._engine_died(model):
                log(f"model {model!r} was unloaded through the repository API: not loading it again "
                    f"(POST /v2/repository/models/{model}/load with the admin key loads it)")
                self._served.discard(model)
                continue
            if not self.budget.take():
                log(f"model {model!r} unloaded itself (its engine died) and the restart budget "
                    f"({self.budget.limit} in {self.budget.window_s:.0f} s) is spent")
                return GIVE_UP
            log(f"model {model!r} unloaded itself (its engine died): loading it again")
            self._reloading.add(model)
            threading.Thread(target=self._reload, args=(model,), daemon=True).start()
        return None

    def _engine_died(self, model: str) -> bool:
        """Whether ``model`` recorded its engine's death (the record is taken)."""
        if self.deaths_dir is None:
            return True
        record = Path(self.deaths_dir) / model
        try:
            record.unlink()
            return True
        except FileNotFoundError:
            return False

    def _reload(self, model: str) -> None:
        try:
            response = requests.post(f"{self.http_url}/v2/repository/models/{model}/load", headers=self.headers,
                                     timeout=LOAD_TIMEOUT_S)
            if response.status_code != 200:
                self._failed = f"HTTP {response.status_code} {response.text}"
            else:
                log(f"loaded model {model!r} again")
                self.reloads.append(model)
        except requests.RequestException as exc:
            self._failed = str(exc)
        finally:
            if self._failed is not None:
                log(f"could not load model {model!r} again: {self._failed}")
            self._reloading.discard(model)
