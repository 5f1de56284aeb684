"""Heavy work beside the step runs at a lower CPU priority, so that the step's threads go first.

A CPU step is an OpenMP team that ends every operation in a barrier (``backend/cpu_threads.py``): when another
busy thread takes one of the team's cores for a time slice, the whole team waits. Compiling a large grammar is
such a thread (seconds of one core; xgrammar releases the GIL while it runs). At nice :data:`BACKGROUND_NICE`
(Linux keeps a nice value per thread; raising it needs no privilege) the scheduler weighs it at 335 against
1024 for each of the step's threads: it runs in the step's idle moments and gets about a quarter of a core
beside a busy step, instead of half the machine on two cores.

Why 5 and not 19: measured with ``python -m benchmarks.stalls`` on 2 cores with a stream running, a grammar
of about 1 s on an idle core took 7 s at nice 5, 18 s at nice 10 and over 30 s at nice 19 (starved: the step's
threads leave little idle time), for a small request's delay of 15, 20 and 14 ms (53 ms at nice 0). Work that
holds the GIL does not belong at a lower priority: a thread holding it while it waits for a core holds up
every thread of its process (tokenizing 330,000 tokens on such a thread in the frontend, whose last 2 ms hold
the GIL, delayed ``/health`` by 0.9 s).
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger(__name__)

BACKGROUND_NICE = 5  # Linux's scheduler weight 335 against 1024 at nice 0


def lower_this_thread_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Sets the calling thread's nice value to ``nice`` (Linux: per thread; threads it starts inherit it).

    Returns:
        True where the value was set; False where the platform has no per-thread nice or refused it (the
        thread runs at its old priority then; logged once per process at warning level).
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
        return True
    except (OSError, AttributeError) as exc:
        if not getattr(lower_this_thread_priority, "warned", False):
            lower_this_thread_priority.warned = True
            log.warning("could not lower a background thread's CPU priority (%s); it runs at the default", exc)
        return False


def this_thread_nice() -> int:
    """The calling thread's nice value (Linux: per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
