"""The launcher's supervision of tritonserver and the OpenAI frontend: who is restarted, and when to give up.

Three faults, three answers:

* **The OpenAI frontend dies** (killed, crashed): it holds no state of its own, so it is started again after a
  backoff (1, 2, 4, ... s, at most 30) while the restart budget lasts; its clients' connections broke with it
  (their streams end at once), and tritonserver, which keeps serving, cancels the frontend's requests as their
  gRPC streams close. Once the budget is spent the launcher drains the models and exits non-zero.
* **A backend stub dies** (SIGKILL, the OOM killer; ``serve.stub_watch``): Triton 2.51 then never ends the
  requests that stub had in flight (their response factories live on in tritonserver, so neither the streams of
  Triton's own clients nor the frontend's end, and the version's unload never completes, whatever the order of
  unload and load). Only tritonserver's exit ends them, so the launcher kills tritonserver (SIGKILL: a SIGTERM
  would first wait out ``--exit-timeout-secs`` for those very connections, then hang in the dead version's
  unload) and starts it again; every stream it served ends with a transport error (gRPC ``UNAVAILABLE``, a
  broken HTTP chunked response), which the frontend answers as 503 / an SSE error event. Streams of other,
  healthy stubs end too: the price of a server that can be neither drained nor unloaded cleanly.
* **An engine dies** (``serve.health``: the model unloads itself): the launcher loads the model again; if that
  load fails, the model cannot recover in this process and the launcher drains and exits non-zero, so that an
  orchestrator restarts the container (liveness: the process is gone).

Every restart of either child and every reload of a model spends the same budget (``--max-restarts`` within
``RESTART_WINDOW_S``); past it the launcher drains what can be drained and exits 1. The backoff and the budget
follow Kubernetes' container restart policy (exponential backoff, capped) and supervisord's ``startretries``.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field

DEFAULT_MAX_RESTARTS = 5
RESTART_WINDOW_S = 600.0  # restarts older than this no longer count against the budget
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # the n-th consecutive restart of a child waits BACKOFF_S[n]
STOP_TIMEOUT_S = 30.0  # SIGTERM, then SIGKILL after this many seconds
REPEAT_SIGNAL_S = 1.0  # a second SIGINT/SIGTERM this long after the first cuts the drain short

# What a watch's check() may ask for (see Supervisor.run).
RESTART_SERVER = "restart-server"
GIVE_UP = "give-up"


@dataclass
class Child:
    """One supervised command. ``restart``: started again (with backoff) when it exits on its own."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    restart: bool = False
    process: subprocess.Popen | None = None
    restarts_in_a_row: int = 0
    started_at: float = 0.0

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, env=self.env, start_new_session=True,
                                        preexec_fn=_terminate_with_parent)
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid


@dataclass
class RestartBudget:
    """At most ``limit`` restarts within any ``window_s`` seconds (``limit`` 0: none)."""

    limit: int = DEFAULT_MAX_RESTARTS
    window_s: float = RESTART_WINDOW_S
    times: deque = field(default_factory=deque)

    def take(self) -> bool:
        """Spends one restart; False when the budget is spent (nothing is spent then)."""
        now = time.monotonic()
        while self.times and now - self.times[0] > self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return False
        self.times.append(now)
        return True


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Supervisor:
    """Runs ``children`` (the first is tritonserver) until a signal, a child that ends and is not restarted, or
    a fault past the budget.

    Args:
        drain: ``drain(cut_short) -> bool``, unloads every model (``serve.launch.drain_models``); run before the
            children are stopped on SIGINT/SIGTERM and when giving up with tritonserver still running.
        watch: ``watch(server_pid, budget)`` -> a check run about once a second (``serve.stub_watch``), made
            anew for each tritonserver; the check returns None, :data:`RESTART_SERVER` or :data:`GIVE_UP`.
        budget: restarts and reloads allowed (:class:`RestartBudget`).
        interval_s: seconds between checks.
    """

    def __init__(self, children: list[Child], drain=None, watch=None, budget: RestartBudget | None = None,
                 interval_s: float = 1.0) -> None:
        self.children = children
        self.drain = drain
        self.watch = watch
        self.budget = budget or RestartBudget()
        self.interval_s = interval_s
        self.signals: list[tuple[int, float]] = []  # (signal number, time.monotonic()) as received

    def run(self) -> int:
        """Returns the exit status (see :func:`serve.launch.run_together` for the signal case): the status of a
        child that ended and is not restarted, 1 after giving up on a fault."""
        # The handlers come before the children: a signal while they start is then a request to stop like any
        # other, not the death of this process (with no drain, and its children stopped only by their
        # PR_SET_PDEATHSIG).
        previous = {sig: signal.signal(sig, lambda signum, frame: self.signals.append((signum, time.monotonic())))
                    for sig in (signal.SIGINT, signal.SIGTERM)}
        status, drain = None, False
        try:
            for child in self.children:
                if self.signals:  # asked to stop before every child started: start no more, drain nothing
                    break
                child.start()
            else:
                status, drain = self._loop()
            if drain and self.drain is not None:
                self.drain(self._asked_again)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        terminated = self._stop_all()
        if status is None:  # stopped by a signal: 0 when every child stopped cleanly
            status = next((c.process.returncode for c in self.children if c.process is not None
                           and c.process.returncode != 0
                           and not (c.pid in terminated and c.process.returncode == -signal.SIGTERM)), 0)
        # sys.exit(-15) would exit 241 (the status modulo 256): report death by signal N as a shell does.
        return 128 - status if status < 0 else status

    def _asked_again(self) -> bool:
        """Whether a signal came :data:`REPEAT_SIGNAL_S` or more after the first: the operator asks again, so
        the drain is cut short. Signals closer together are one request to stop, delivered twice: ``make``
        forwards the SIGTERM it gets to its child, which a SIGTERM to the whole process group (``kill -TERM
        -PGID``, systemd's default ``KillMode``) has reached already."""
        return any(at - self.signals[0][1] >= REPEAT_SIGNAL_S for _, at in self.signals[1:])

    def _loop(self) -> tuple[int | None, bool]:
        """Supervises until it is time to stop; returns (exit status or None for a signal, whether to drain)."""
        check = self._new_check()
        last_check = time.monotonic()
        pending: dict[int, float] = {}  # child index -> when to start it again
        while not self.signals:
            now = time.monotonic()
            for i, child in enumerate(self.children):
                if i in pending:
                    if now >= pending[i]:
                        del pending[i]
                        log(f"starting the {child.name} again")
                        child.start()
                    continue
                if child.process.poll() is None:
                    if now - child.started_at > BACKOFF_S[-1]:
                        child.restarts_in_a_row = 0  # it ran long enough: the next failure backs off from 1 s
                    continue
                code = child.process.returncode
                if i == 0 or not child.restart:
                    log(f"the {child.name} exited with status {code}; stopping")
                    return code, i != 0  # tritonserver gone: nothing left to drain
                if not self.budget.take():
                    log(f"the {child.name} exited with status {code} and the restart budget "
                        f"({self.budget.limit} in {self.budget.window_s:.0f} s) is spent: draining, then exiting 1")
                    return 1, True
                delay = BACKOFF_S[min(child.restarts_in_a_row, len(BACKOFF_S) - 1)]
                child.restarts_in_a_row += 1
                log(f"the {child.name} exited with status {code}: starting it again in {delay:.0f} s")
                pending[i] = now + delay
            time.sleep(0.2)
            if check is None or time.monotonic() - last_check < self.interval_s:
                continue
            action = check()
            last_check = time.monotonic()
            if action == GIVE_UP:
                log("a model cannot recover: draining, then exiting 1")
                return 1, True
            if action == RESTART_SERVER:
                if not self.budget.take():
                    log(f"tritonserver needs a restart and the restart budget ({self.budget.limit} in "
                        f"{self.budget.window_s:.0f} s) is spent: exiting 1")
                    self.children[0].process.kill()  # it can be neither drained nor stopped (serve.stub_watch)
                    self.children[0].process.wait()
                    return 1, False
                self._restart_server()
                check = self._new_check()
        return None, True

    def _new_check(self):
        return self.watch(self.children[0].pid, self.budget) if self.watch is not None else None

    def _restart_server(self) -> None:
        server = self.children[0]
        log(f"killing tritonserver (pid {server.pid}) and starting it again")
        server.process.kill()
        server.process.wait()
        server.start()

    def _stop_all(self) -> set[int]:
        """SIGTERM to every running child, SIGKILL after ``STOP_TIMEOUT_S``; returns the pids sent SIGTERM.
        (Children never started, the run having been stopped while it started them, are skipped.)"""
        started = [child for child in self.children if child.process is not None]
        terminated = set()
        for child in started:
            if child.process.poll() is None:
                child.process.terminate()
                terminated.add(child.pid)
        for child in started:
            try:
                child.process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        return terminated


def _terminate_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux ``prctl(PR_SET_PDEATHSIG)``)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
