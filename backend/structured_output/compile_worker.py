"""The process that compiles grammars for :class:`~backend.structured_output.compiler.GrammarCompiler`.

A compile runs in a process of its own so that it can be stopped: xgrammar's compile cannot be interrupted in a
thread, and one past its deadline would otherwise keep burning a core and hold a compile slot until it ends (a
schema can take minutes). This process imports xgrammar once (with torch and transformers: seconds) and forks a
child per compile (milliseconds); the parent kills a child at its deadline, and this process goes on.

Run as a script by the parent (``python compile_worker.py NICE``); it imports nothing of this project. Messages
in both directions are frames: an 8-byte big-endian length, then that many bytes.

- Parent to worker, first: the tokenizer's ``xgrammar.TokenizerInfo`` as JSON (``serialize_json``).
- Worker to parent: ``R`` once ready.
- Parent to worker, then, per compile: JSON ``[method, argument, cpu_seconds]``, method one of ``json_schema``,
  ``regex``, ``grammar`` (EBNF); the child gets ``cpu_seconds`` (whole seconds) as its CPU time limit
  (``RLIMIT_CPU``: the kernel ends it with SIGXCPU there), so a compile nobody waits for any more ends too.
- Worker to parent, per compile: ``P`` + the child's process id (ASCII) when it starts; then ``G`` + the CPU
  seconds the compile took (ASCII) when it compiled, or ``I`` + xgrammar's message (the constraint is invalid or
  unsupported), or ``E`` + a message (anything else), or ``K`` + the child's wait status when it ended without a
  reply (killed).

The grammar itself does not travel: the parent compiles a constraint again once its child has shown that it
compiles in time (:func:`compile_constraint`, the same call). A compiled grammar holds a token mask per state of
its automaton, and its JSON grows with them: 85 MB for a schema of 600 optional properties, whose compile took
0.3-0.5 s and whose JSON took 3-4 s to write and 1.5 s to read (SmolLM2's 49k-token vocabulary, AMD EPYC Zen 4).

A child is reaped when the next compile arrives, so its process id stays its own until the parent has read its
reply. The worker runs at nice ``NICE`` and exits when its input closes or its parent dies.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import sys

HEADER = struct.Struct(">Q")


def read_frame(stream) -> bytes | None:
    """One frame from ``stream``, or None at end of input."""
    header = stream.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (length,) = HEADER.unpack(header)
    data = stream.read(length)
    return data if len(data) == length else None


def write_frame(stream, data: bytes) -> None:
    stream.write(HEADER.pack(len(data)) + data)
    stream.flush()


def _die_with_parent() -> None:
    """Linux: SIGKILL when the parent dies (a compile in progress does not read its closed input)."""
    parent = os.getppid()
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the call
        os._exit(1)


def main(nice: int) -> None:
    _die_with_parent()
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever the library prints goes to stderr, never into the frames
    source = sys.stdin.buffer
    import xgrammar

    info = read_frame(source)
    if info is None:
        return
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.deserialize_json(info.decode()), max_threads=1,
                                        cache_enabled=False)
    write_frame(out, b"R")
    previous = None  # the last child that replied, reaped when the next compile arrives
    while (frame := read_frame(source)) is not None:
        if previous is not None:
            os.waitpid(previous, 0)
            previous = None
        method, argument, cpu_seconds = json.loads(frame)
        readable, writable = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(readable)
            _die_with_parent()
            _limit_cpu(cpu_seconds)
            with os.fdopen(writable, "wb") as reply:
                write_frame(reply, _compile(compiler, method, argument))
            os._exit(0)
        os.close(writable)
        write_frame(out, b"P" + str(child).encode())
        with os.fdopen(readable, "rb") as replies:
            reply = read_frame(replies)
        if reply is None:
            _, status = os.waitpid(child, 0)
            reply = b"K" + str(status).encode()
        else:
            previous = child
        write_frame(out, reply)


def _limit_cpu(seconds: int) -> None:
    """SIGXCPU after ``seconds`` of CPU time, SIGKILL a second later, within the hard limit this process has."""
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    if hard != resource.RLIM_INFINITY:
        seconds = min(seconds, max(hard - 1, 1))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, hard))
    else:
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))


def compile_constraint(compiler, method: str, argument: str):
    """``compiler`` (an ``xgrammar.GrammarCompiler``) compiles ``argument`` by ``method``: one of
    ``json_schema``, ``regex``, ``grammar`` (EBNF). Returns the ``CompiledGrammar``; raises what xgrammar
    raises (RuntimeError, ValueError or TypeError for an invalid or unsupported constraint) and KeyError for
    an unknown method."""
    if method == "json_schema":
        # Compact separators and no free whitespace: a small model sampling at temperature 1 could
        # otherwise spend its whole budget on newlines between the tokens of a valid document.
        return compiler.compile_json_schema(argument, any_whitespace=False)
    if method == "regex":
        return compiler.compile_regex(argument)
    if method == "grammar":
        return compiler.compile_grammar(argument)
    raise KeyError(f"unknown compile method {method!r}")


def _compile(compiler, method: str, argument: str) -> bytes:
    """One compile's reply frame (in the child)."""
    try:
        compile_constraint(compiler, method, argument)
        used = resource.getrusage(resource.RUSAGE_SELF)  # this child's own, since its fork
        return b"G" + f"{used.ru_utime + used.ru_stime:.3f}".encode()
    except (RuntimeError, ValueError, TypeError) as exc:
        return b"I" + str(exc).encode()
    except Exception as exc:
        return b"E" + f"{type(exc).__name__}: {exc}".encode()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
