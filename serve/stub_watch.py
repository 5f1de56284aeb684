"""Reloads a model whose Python backend stub was killed, for ``python -m serve``.

Triton 2.51 keeps a model version READY after its stub process dies (SIGKILL, the OOM killer): every request
then fails at once with ``Stub process '<model>_0_0' is not healthy``, and nothing in the model can act, its
process being gone. The launcher can: :class:`StubWatch` lists tritonserver's stub processes (each one's
command line names its ``<repository>/<model>/<version>/model.py``) and the repository index; a version
that is READY with no live stub on two checks in a row is broken, and its model is reloaded (unload, then
load, on a thread of its own; a load of an unchanged loaded model is a no-op in Triton, so both are needed).
Requests fail fast meanwhile; readiness stays true until the unload begins (Triton's, not ours).

Triton 2.51 never completes the unload of the dead version (it waits for the dead stub), so that server
later exits with "Exit timeout expired" (status 1) after its exit timeout; the new version serves.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import psutil
import requests

STUB_NAME = "triton_python_backend_stub"


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


class StubWatch:
    """``check()`` (from the launcher's loop, about once a second) reloads models that lost a stub."""

    def __init__(self, http_url: str, server_pid: int, headers: dict[str, str] | None = None) -> None:
        self.http_url = http_url
        self.headers = headers or {}  # the admin key (serve.control): the repository API is restricted
        self.server_pid = server_pid
        self._suspects: set[tuple[str, str]] = set()
        self._reloading: set[str] = set()
        self.reloads: list[str] = []

    def check(self) -> None:
        try:
            response = requests.post(f"{self.http_url}/v2/repository/index", json={}, headers=self.headers, timeout=2)
            response.raise_for_status()
            index = response.json()
        except (requests.RequestException, ValueError):
            return  # not up yet, or stopping (a refused admin key is the launcher's own bug: drain reports it)
        ready = {(m["name"], m["version"]) for m in index if m.get("state") == "READY" and "version" in m}
        broken = ready - stub_versions(self.server_pid)
        for model, version in broken & self._suspects:
            if model not in self._reloading:
                print(f"the stub of model {model!r} version {version} is gone: reloading the model",
                      file=sys.stderr, flush=True)
                self._reloading.add(model)
                threading.Thread(target=self._reload, args=(model,), daemon=True).start()
        self._suspects = broken

    def _reload(self, model: str) -> None:
        try:
            requests.post(f"{self.http_url}/v2/repository/models/{model}/unload", headers=self.headers, timeout=10)
            response = requests.post(f"{self.http_url}/v2/repository/models/{model}/load", headers=self.headers,
                                     timeout=600)
            print(f"reloaded model {model!r}: HTTP {response.status_code} {response.text}", file=sys.stderr,
                  flush=True)
            self.reloads.append(model)
        except requests.RequestException as exc:
            print(f"could not reload model {model!r}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._reloading.discard(model)
