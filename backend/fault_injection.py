"""A fault-injection hook for tests: makes the forward pass fail on demand, in a running server.

Set ``LLM_FAULT_INJECTION_FILE`` to a path before the engine starts; while a file exists at that path,
every step's forward pass raises :class:`InjectedFault` before computing anything (the engine core handles
it as any failed forward: the step's requests end with ``error``). Remove the file and steps succeed again.
Unset (the default), the hook costs one attribute test per step. For tests only; never set in production.
"""

from __future__ import annotations

import os

ENV_VAR = "LLM_FAULT_INJECTION_FILE"


class InjectedFault(RuntimeError):
    """The forward pass failure injected by :class:`FaultInjector`."""


class FaultInjector:
    """Reads ``LLM_FAULT_INJECTION_FILE`` once, at construction."""

    def __init__(self) -> None:
        self.path = os.environ.get(ENV_VAR) or None

    def check(self) -> None:
        """Raises:
            InjectedFault: the fault file exists now."""
        if self.path is not None and os.path.exists(self.path):
            raise InjectedFault(f"injected fault ({ENV_VAR}={self.path} exists)")
