"""Resident memory of a local tritonserver and its Python backend stubs over a load test (the soak).

The server is found by its HTTP port (the ``--http-port=<port>`` in a ``tritonserver`` command line on this
machine); the stubs are its ``triton_python_backend_stub`` children, named by the model version they serve
(``<model>/<version>``, from the ``model.py`` path in their command line). A stub started later (a reload) is
picked up at the next sample. Drift is measured from the first sample after a warm-up (KV blocks, allocator
pools and caches fill during the first minutes of load) to the last.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil

MIB = 1024 * 1024
STUB_NAME = "triton_python_backend_stub"


def find_server(http_url: str) -> psutil.Process | None:
    """The local ``tritonserver`` serving HTTP at ``http_url``'s port, or None (remote, or not found)."""
    port = urlparse(http_url).port or 8000
    for process in psutil.process_iter(["name", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["name"] == "tritonserver" and f"--http-port={port}" in cmdline:
            return process
    return None


def sample_rss(server: psutil.Process) -> dict[str, float]:
    """RSS in MiB: ``tritonserver`` and each live stub (``stub <model>/<version>``, ``#2``... for more)."""
    values = {"tritonserver": server.memory_info().rss / MIB}
    for child in server.children():
        try:
            if child.name() != STUB_NAME or child.status() == psutil.STATUS_ZOMBIE:
                continue
            model_py = Path(child.cmdline()[1])
            name = f"stub {model_py.parent.parent.name}/{model_py.parent.name}"
            while name in values:
                name += "#"
            values[name] = child.memory_info().rss / MIB
        except (psutil.Error, IndexError):
            continue
    return values


class MemorySampler:
    """Samples :func:`sample_rss` every ``interval_s`` on a thread of its own, from ``start()`` to ``stop()``
    (which takes one last sample). ``samples``: (seconds since start, {process: RSS MiB})."""

    def __init__(self, server: psutil.Process, interval_s: float) -> None:
        self.server, self.interval_s = server, interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._start = 0.0

    def start(self) -> None:
        self._start = time.monotonic()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        self._sample()
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self) -> None:
        try:
            self.samples.append((time.monotonic() - self._start, sample_rss(self.server)))
        except psutil.Error:
            pass  # the server is gone: the run reports it

    def summary(self, warmup_s: float) -> dict:
        """Per process: RSS at the start, after ``warmup_s`` (the first sample at or past it), at the end and
        at most (MiB); ``drift_mib`` = end - after warm-up; plus every sample."""
        processes: dict[str, dict] = {}
        for name in sorted({n for _, values in self.samples for n in values}):
            series = [(t, values[name]) for t, values in self.samples if name in values]
            warm = next(((t, v) for t, v in series if t >= warmup_s), series[-1])
            processes[name] = {"start_mib": series[0][1], "warm_mib": warm[1], "warm_at_s": warm[0],
                               "end_mib": series[-1][1], "max_mib": max(v for _, v in series),
                               "drift_mib": series[-1][1] - warm[1]}
        return {"interval_s": self.interval_s, "warmup_s": warmup_s, "processes": processes,
                "samples": [{"t_s": t, **values} for t, values in self.samples]}
