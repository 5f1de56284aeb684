"""Finds a ``tritonserver`` and runs it on ``model_repository/``, with the OpenAI frontend beside it.

Where ``tritonserver`` is on PATH (the NGC container) it is used as is. Elsewhere the server bundled in
the ``nvidia-pytriton`` wheel is used: its binary, its Python backend with the stub for this Python
version copied beside ``libtriton_python.so``, and its shared libraries on ``LD_LIBRARY_PATH``.

The server runs in explicit model-control mode with every model loaded at start (``--model-control-mode=explicit
--load-model=*``): the same models as the default mode, plus the load/unload API, which this launcher needs:
it drains by unloading every model, and a model whose engine has died unloads itself so that its readiness
turns false (``serve.health``) and the launcher loads it again. Pass another
``--model-control-mode`` to override (and lose both).

The control plane is closed (``serve.control``): tritonserver's HTTP, gRPC and metrics services bind
127.0.0.1 unless ``--triton-host`` (``TRITON_HOST``) says otherwise, and its model-repository, shared-memory,
logging and trace APIs answer only requests carrying the admin key (``TRITON_ADMIN_KEY``,
``TRITON_ADMIN_KEY_FILE``, or a random key per start), which the drain and the stub reload send. The key
is on tritonserver's command line, Triton's only way to take it (docs/security.md).

``python -m serve`` supervises tritonserver (and the OpenAI frontend) instead of replacing itself with it: on
SIGTERM or SIGINT it first drains, unloading every model through the repository API and waiting until they
are unloaded (each model finishes what is in flight within its grace period, ``serve.drain``), and only then
stops tritonserver, which has nothing left in flight. Stopping tritonserver directly with requests in flight
makes Triton 2.51 wait its exit timeout for HTTP connections first, then unload the models with what time is
left, and exit "immediately" when that runs out, with a segmentation fault or a hang while the stubs still
run. While running, the launcher restarts tritonserver when a backend stub was killed (Triton 2.51 would keep that
stub's streams open for good), loads again a model whose engine died, restarts a frontend that died, and past
``--max-restarts`` drains and exits 1 (``serve.supervise``, ``serve.stub_watch``).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import requests

from serve import allocator, control
from serve.control import admin_headers, restriction_args
from serve.stub_watch import DEATHS_DIR_ENV, StubWatch
from serve.supervise import DEFAULT_MAX_RESTARTS, Child, RestartBudget, Supervisor

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
STAGING = REPO_ROOT / "build" / "triton"
DRAIN_TIMEOUT_S = 45.0  # the models' default grace period (30 s) plus time to abort, unload and exit
WATCH_INTERVAL_S = 1.0  # how often the launcher looks for killed backend stubs
DEFAULT_TRITON_HOST = "127.0.0.1"  # tritonserver's own APIs stay on this host; the OpenAI frontend is the way in
EXIT_TIMEOUT_S = 5  # tritonserver's --exit-timeout-secs under this launcher, which has drained already


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str]


def build_command(model_repository: Path = DEFAULT_MODEL_REPOSITORY, http_port: int = 8000, grpc_port: int = 8001,
                  metrics_port: int = 8002, log_verbose: int = 0, extra_args: list[str] | None = None,
                  host: str = DEFAULT_TRITON_HOST, admin_key: str | None = None) -> ServerCommand:
    """The argv and environment that start tritonserver with the Python backend able to import this project.

    Args:
        host: the address tritonserver's HTTP, gRPC and metrics services bind (``--http-address``,
            ``--grpc-address``, ``--metrics-address``); loopback by default.
        admin_key: when given, the APIs of :data:`serve.control.RESTRICTED_APIS` answer only requests that
            carry it in the header ``triton-admin-key`` (:func:`serve.control.restriction_args`).

    Raises:
        FileNotFoundError: no tritonserver on PATH and no nvidia-pytriton wheel installed.
    """
    env = dict(os.environ)
    # The Python backend's stub embeds its own interpreter, which finds its prefix by looking for `python3`
    # on PATH: this environment's bin first, so the stub sees this virtual environment's packages.
    # (It ignores PYTHONPATH; this project is importable there through its editable install or its cwd.)
    env["PATH"] = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
    extra_args = list(extra_args or [])
    if not any(arg.startswith("--model-control-mode") for arg in extra_args):
        extra_args = ["--model-control-mode=explicit", "--load-model=*", *extra_args]
    argv = [f"--model-repository={model_repository}", f"--http-address={host}", f"--http-port={http_port}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}", f"--metrics-address={host}",
            f"--metrics-port={metrics_port}", "--allow-metrics=true", f"--log-verbose={log_verbose}",
            *(restriction_args(admin_key) if admin_key else []), *extra_args]

    on_path = shutil.which("tritonserver")
    if on_path:
        return ServerCommand([on_path, *argv], env)

    spec = importlib.util.find_spec("pytriton")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("no tritonserver on PATH and nvidia-pytriton is not installed "
                                "(pip install nvidia-pytriton, or use the NGC tritonserver container)")
    bundle = Path(spec.origin).parent / "tritonserver"
    backends = _stage_python_backend(bundle)
    libs = Path(spec.origin).parent.parent / "nvidia_pytriton.libs"
    # The stub links libpython3.X: this interpreter's own LIBDIR first, so its standard library (ssl) matches.
    lib_path = [sysconfig.get_config_var("LIBDIR"), str(libs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_path if p)
    return ServerCommand([str(bundle / "bin" / "tritonserver"), f"--backend-directory={backends}", *argv], env)


def _stage_python_backend(bundle: Path) -> Path:
    """Copies the bundled Python backend plus the stub for this Python version into ``build/triton``."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    target = STAGING / "backends" / "python"
    target.mkdir(parents=True, exist_ok=True)
    for source in [*(bundle / "backends" / "python").glob("*.*"), stub]:
        destination = target / source.name
        if not destination.exists() or destination.stat().st_size != source.stat().st_size:
            shutil.copy2(source, destination)
    return target.parent


def _port(low: int):
    """An argparse type: a TCP port number, ``low`` (1, or 0 where 0 means none) to 65535. tritonserver takes any
    int and binds it modulo 65536, where the launcher's own requests (drain, health) would not find it."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
        if not low <= value <= 65535:
            raise argparse.ArgumentTypeError(f"{value} is not a port: {low}-65535")
        return value
    return parse


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds, above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a wait: a finite number of seconds above 0")
    return value


def main(argv: list[str] | None = None) -> None:
    # String defaults from the environment go through each flag's type too, so a bad HTTP_PORT is named as
    # --http-port's value instead of a traceback.
    parser = argparse.ArgumentParser(prog="python -m serve",
                                     description="Start tritonserver on this repository's model repository.")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="the Triton model repository to serve (default: this checkout's model_repository/)")
    parser.add_argument("--http-port", type=_port(1), default=os.environ.get("HTTP_PORT", "8000"),
                        help="Triton's HTTP port (env HTTP_PORT; default 8000)")
    parser.add_argument("--grpc-port", type=_port(1), default=os.environ.get("GRPC_PORT", "8001"),
                        help="Triton's gRPC port (env GRPC_PORT; default 8001)")
    parser.add_argument("--metrics-port", type=_port(1), default=os.environ.get("METRICS_PORT", "8002"),
                        help="Triton's metrics port (env METRICS_PORT; default 8002)")
    parser.add_argument("--triton-host", default=os.environ.get("TRITON_HOST", DEFAULT_TRITON_HOST),
                        help="address of tritonserver's HTTP, gRPC and metrics services (default 127.0.0.1: "
                             "reachable from this host only; 0.0.0.0 exposes them)")
    parser.add_argument("--log-verbose", type=int, default=0,
                        help="tritonserver's --log-verbose level (default 0; 1 and above log each request)")
    parser.add_argument("--openai-port", type=_port(0), default=os.environ.get("OPENAI_PORT", "9000"),
                        help="port of the OpenAI frontend started beside tritonserver (0: none); its API key comes "
                             "from LLM_API_KEY or LLM_API_KEY_FILE in this environment")
    parser.add_argument("--openai-arg", action="append", default=[], metavar="ARG",
                        help="a flag for the OpenAI frontend, written with '=' (repeat for several), e.g. "
                             "--openai-arg=--max-request-body-bytes=1048576 (python -m openai_frontend --help)")
    parser.add_argument("--malloc", choices=allocator.CHOICES, default=os.environ.get("LLM_MALLOC", "auto"),
                        help="tritonserver's (and so the engine's) allocator: tcmalloc, preloaded (auto: where "
                             "installed, package libtcmalloc-minimal4), or glibc's (system); default %(default)s")
    parser.add_argument("--drain-timeout-secs", type=_seconds, default=DRAIN_TIMEOUT_S,
                        help="on SIGTERM/SIGINT, wait at most this long for the models to drain and unload "
                             "(their own grace period is the model setting drain_grace_s) before stopping "
                             "tritonserver (default %(default)s)")
    parser.add_argument("--max-restarts", type=int, default=os.environ.get("MAX_RESTARTS", str(DEFAULT_MAX_RESTARTS)),
                        help="restarts of tritonserver (a killed backend stub) or the OpenAI frontend and reloads "
                             "of a model whose engine died, allowed in any ten minutes; past them the launcher "
                             "drains and exits 1 (default %(default)s; 0: give up on the first fault)")
    args, extra = parser.parse_known_args(argv)
    if not any(arg.startswith("--exit-timeout-secs") for arg in extra):
        # This process drains before it stops tritonserver, whose exit timeout then only bounds the wait for
        # idle HTTP keep-alive connections (Triton 2.51 waits for every open HTTP connection first).
        extra = [*extra, f"--exit-timeout-secs={EXIT_TIMEOUT_S}"]
    if any(arg.startswith(("--http-restricted-api", "--grpc-restricted-protocol")) for arg in extra):
        parser.error("the launcher restricts Triton's APIs itself (serve.control); set TRITON_ADMIN_KEY or "
                     "TRITON_ADMIN_KEY_FILE to choose the key")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    try:
        key = control.admin_key()
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    command = build_command(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                            args.log_verbose, extra, host=args.triton_host, admin_key=key)
    print("+", " ".join(command.argv).replace(key, "<TRITON_ADMIN_KEY>"), flush=True)
    # Each child gets only the secret it uses: tritonserver (and the model code it runs) not the API key, the
    # frontend (which needs only inference, health and metadata) not the admin key.
    server_env = _without(command.env, "LLM_API_KEY", "LLM_API_KEY_FILE", control.KEY_ENV, control.KEY_FILE_ENV)
    try:
        server_env, malloc = allocator.preload(server_env, args.malloc)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    print(f"+ tritonserver's allocator: {malloc}", flush=True)
    deaths_dir = tempfile.mkdtemp(prefix="llm-engine-deaths-")  # serve.health records an engine's death there
    server_env[DEATHS_DIR_ENV] = deaths_dir
    argvs, envs = [command.argv], [server_env]
    if args.openai_port > 0:
        argvs.append([sys.executable, "-m", "openai_frontend", "--port", str(args.openai_port),
                      "--triton-url", f"{_connect_host(args.triton_host)}:{args.grpc_port}", "--model-repository",
                      str(args.model_repository), "--triton-metrics-url",
                      f"http://{_connect_host(args.triton_host)}:{args.metrics_port}/metrics", *args.openai_arg])
        envs.append(_without(command.env, control.KEY_ENV, control.KEY_FILE_ENV))
        print("+", " ".join(argvs[-1]), flush=True)
    url = f"http://{_connect_host(args.triton_host)}:{args.http_port}"
    headers = admin_headers(key)
    try:
        status = run_together(argvs, envs,
                              drain=lambda cut_short: drain_models(url, args.drain_timeout_secs, cut_short, headers),
                              watch=lambda server_pid, budget: StubWatch(url, server_pid, headers, budget,
                                                                         deaths_dir).check,
                              restart=tuple(range(1, len(argvs))), max_restarts=args.max_restarts)
    finally:
        shutil.rmtree(deaths_dir, ignore_errors=True)
    sys.exit(status)


def _connect_host(host: str) -> str:
    """The host to reach a service bound to ``host`` from this machine (loopback for a wildcard address)."""
    if host in ("", "0.0.0.0", "::"):
        return "127.0.0.1"
    return f"[{host}]" if ":" in host else host


def _without(env: dict[str, str], *names: str) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in names}


def drain_models(http_url: str, timeout: float, cut_short=lambda: False, headers: dict[str, str] | None = None) -> bool:
    """Unloads every loaded model through Triton's repository API and waits until all are unloaded.
    ``headers`` go with every call (the admin key: ``serve.control``).

    The unload turns each model not ready at once (Triton refuses new requests for it) and lets its requests in
    flight finish; the model itself bounds that by its grace period (``serve.drain``). Returns True once no
    model is loaded or unloading, False after ``timeout`` seconds, when ``cut_short()`` turns true, or when
    the server does not take the request (HTTP disabled, or not in explicit model-control mode).
    """
    deadline = time.monotonic() + timeout

    def live() -> set[str]:
        index = requests.post(f"{http_url}/v2/repository/index", json={}, headers=headers, timeout=5)
        index.raise_for_status()
        index = index.json()
        return {m["name"] for m in index if m.get("state") in ("READY", "LOADING", "UNLOADING")}

    try:
        names = live()
        for name in sorted(names):
            response = requests.post(f"{http_url}/v2/repository/models/{name}/unload", headers=headers, timeout=5)
            if response.status_code != 200:
                print(f"could not unload model {name!r}: {response.text}", file=sys.stderr, flush=True)
                return False
        print(f"draining: unloading {', '.join(sorted(names)) or 'no models'}", file=sys.stderr, flush=True)
        while (names := live()) and time.monotonic() < deadline and not cut_short():
            time.sleep(0.2)
    except (requests.RequestException, ValueError) as exc:
        print(f"draining failed ({exc}); stopping tritonserver", file=sys.stderr, flush=True)
        return False
    return not names


def run_together(argvs: list[list[str]], env: dict[str, str] | list[dict[str, str]] | None, drain=None,
                 watch=None, restart: tuple[int, ...] = (), max_restarts: int = DEFAULT_MAX_RESTARTS) -> int:
    """Runs the commands as children (``env``: one environment for all, or one per command) under
    :class:`serve.supervise.Supervisor` until the first one ends that is not restarted (or SIGINT/SIGTERM),
    then stops the others (SIGTERM, SIGKILL after 30 s). Returns the exit status of the first to end (1 after
    giving up on a fault); when stopped by a signal, 0 if every child then stopped cleanly (exit status 0, or
    killed by the SIGTERM this process sent it: uvicorn re-raises SIGTERM once it has shut down), else the
    first other status (a negative status -N, killed by signal N, becomes 128 + N, as a shell reports it).

    ``restart``: indexes of the commands (never 0, tritonserver) started again with backoff when they exit on
    their own, within ``max_restarts`` restarts in ten minutes. ``watch(server_pid, budget)`` returns a check
    run about once a second while they run (``serve.stub_watch``). On SIGINT/SIGTERM, and before stopping a
    running tritonserver after a fault, ``drain(cut_short)`` runs first (a second signal makes ``cut_short()``
    true). The children run in a session of their own, so a Ctrl-C in a terminal reaches only this process,
    and each gets SIGTERM should this process die without stopping them (``PR_SET_PDEATHSIG``).

    Raises:
        ValueError: as many environments as commands are needed; tritonserver (index 0) is never restarted.
    """
    envs = env if isinstance(env, list) else [env] * len(argvs)
    if len(envs) != len(argvs):
        raise ValueError(f"{len(argvs)} commands but {len(envs)} environments")
    if 0 in restart:
        raise ValueError("the first command (tritonserver) is restarted only by its watch")
    names = ["tritonserver", "OpenAI frontend"] + [f"command {i}" for i in range(2, len(argvs))]
    children = [Child(names[i], argv, child_env, restart=i in restart)
                for i, (argv, child_env) in enumerate(zip(argvs, envs))]
    return Supervisor(children, drain, watch, RestartBudget(max_restarts), WATCH_INTERVAL_S).run()


if __name__ == "__main__":
    main()
