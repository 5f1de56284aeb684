"""llama.cpp's ``llama-server`` as a peer system, built and run as a CPU user would, on the benchmark's workload.

Build (once, :func:`ensure_llamacpp`): the PyPI sdist of ``llama-cpp-python`` vendors llama.cpp's sources
(``vendor/llama.cpp``: ``tools/server``, ``convert_hf_to_gguf.py``, ``gguf-py``, and its git metadata, so the
commit is known); ``llama-server``, ``llama-quantize`` and ``llama-perplexity`` are built from it with cmake (Release,
``GGML_NATIVE=ON``: the build machine's own instruction set; no TLS, no web UI, no tests or examples) into
``build/llama.cpp/``.

Weights (once per model directory and type, :func:`ensure_gguf`): the very directory the other systems load
(HF safetensors) is converted with the vendored ``convert_hf_to_gguf.py`` to f32 for ``--dtype float32``, bf16
for bfloat16 (f16 for float16); ``--llamacpp-quant q8_0|q4_0`` quantizes that GGUF with ``llama-quantize``
(llama.cpp's own quantized weights: faster, and not the same numbers, so their greedy tokens differ).

Serving (:class:`LlamaCppSystem`): one ``llama-server`` per mode, on a free port of 127.0.0.1, with the run's
threads (``-t``, ``-tb``), continuous batching (its default, stated), ``--parallel`` slots = the requests it
may hold at once in that mode (:func:`plan_slots`), context = slots x the longest request (prompt + output):
llama.cpp gives each slot a fixed 1/slots share of the context, so every request fits any slot. Its KV cache
type follows ``--dtype`` (f32 or bf16, as ours), its logical batch is our ``max_num_batched_tokens``. Each
request goes to ``/completion`` as token ids (``prompt_ids``: no BOS added, as our engine gets them) with
``n_predict`` = its output length, ``ignore_eos``, ``temperature`` 0, ``cache_prompt`` false and ``stream``
true; every streamed token is timestamped when the client reads it (one asyncio loop, one connection per
request in flight, as ``server_system`` drives tritonserver).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

from tqdm import tqdm

from benchmarks.config import LLAMACPP_QUANTS, BenchConfig
from benchmarks.records import RequestRecord, SystemRun
from serve import allocator
from benchmarks.workload import BenchRequest, Workload

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_DIR = Path(os.environ.get("LLAMACPP_DIR", REPO_ROOT / "build" / "llama.cpp"))
LLAMACPP_PYTHON_VERSION = "0.3.36"
SDIST_NAME = f"llama_cpp_python-{LLAMACPP_PYTHON_VERSION}"
TARGETS = ("llama-server", "llama-quantize", "llama-perplexity")
# cmake options: a Release build for this CPU, only what the three tools need, nothing fetched.
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_APP=OFF",
                 "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF",
                 "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF")
# --dtype -> GGUF weight type of the conversion and the KV cache type (-ctk/-ctv) of the server.
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
KV_TYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2}
# llama.cpp sizes its context in multiples of 256 tokens; a slot's length is rounded up to one.
CONTEXT_ALIGN = 256
FIRST_TOKENS = 16
START_TIMEOUT_S = 300.0


def llamacpp_source(root: Path = LLAMACPP_DIR) -> Path:
    """The vendored llama.cpp tree, unpacked from the sdist (downloaded with pip if it is not in ``root``).

    Raises:
        subprocess.CalledProcessError: pip could not download the sdist (no network to PyPI).
    """
    source = root / SDIST_NAME / "vendor" / "llama.cpp"
    if (source / "CMakeLists.txt").exists():
        return source
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"{SDIST_NAME}.tar.gz"
    if not sdist.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMACPP_PYTHON_VERSION}", "-d", str(root)], check=True)
    with tarfile.open(sdist) as archive:
        archive.extractall(root, filter="data")
    return source


def llamacpp_built(root: Path = LLAMACPP_DIR) -> Path | None:
    """The directory of the built binaries, or None if :func:`ensure_llamacpp` has not finished a build."""
    bin_dir = root / "cmake-build" / "bin"
    if (root / ".built").exists() and all((bin_dir / t).exists() for t in TARGETS):
        return bin_dir
    return None


def ensure_llamacpp(root: Path = LLAMACPP_DIR, jobs: int | None = None) -> Path:
    """The directory holding :data:`TARGETS`, building them first if one is not there (a build from before a
    target was added builds only what is missing).

    The build takes 10-20 minutes on 2 cores; a marker file (``.built``, holding :func:`llamacpp_version`)
    records a finished one.

    Raises:
        RuntimeError: cmake or a C++ compiler is missing.
        subprocess.CalledProcessError: the download, the configure or the build failed (its output is in
            ``root/build.log``).
    """
    built = llamacpp_built(root)
    if built:
        return built
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"building llama.cpp needs {tool} (apt-get install cmake g++)")
    source = llamacpp_source(root)
    log.info("llamacpp: building %s in %s (10-20 minutes on 2 cores, once; log: %s)", ", ".join(TARGETS), root,
             root / "build.log")
    with open(root / "build.log", "w") as out:
        subprocess.run(["cmake", "-S", str(source), "-B", str(root / "cmake-build"), *CMAKE_OPTIONS],
                       check=True, stdout=out, stderr=subprocess.STDOUT)
        subprocess.run(["cmake", "--build", str(root / "cmake-build"), "--target", *TARGETS,
                        "-j", str(jobs or os.cpu_count() or 1)], check=True, stdout=out, stderr=subprocess.STDOUT)
    (root / ".built").write_text(llamacpp_version(root) + "\n")
    return root / "cmake-build" / "bin"


def llamacpp_version(root: Path = LLAMACPP_DIR) -> str:
    """The vendored llama.cpp: its version (CMakeLists.txt), its commit (the sdist's git metadata) and the sdist."""
    source = root / SDIST_NAME / "vendor" / "llama.cpp"
    text = (source / "CMakeLists.txt").read_text()
    parts = [re.search(rf"set\(LLAMA_VERSION_{p} (\d+)\)", text) for p in ("MAJOR", "MINOR", "PATCH")]
    version = ".".join(m.group(1) for m in parts) if all(parts) else "unknown"
    commit = subprocess.run(["git", "rev-parse", "--short=10", "HEAD"], cwd=source, capture_output=True,
                            text=True).stdout.strip() if shutil.which("git") else ""
    return (f"llama.cpp {version}-dev, commit {commit or 'unknown'} "
            f"(vendored in llama-cpp-python {LLAMACPP_PYTHON_VERSION})")


def gguf_type(dtype: str) -> str:
    """The GGUF weight type (and KV cache type) for a resolved torch dtype name.

    Raises:
        ValueError: a dtype llama.cpp's converter has no type for.
    """
    if dtype not in GGUF_TYPES:
        raise ValueError(f"llama.cpp: no GGUF type for dtype {dtype!r}; known: {', '.join(GGUF_TYPES)}")
    return GGUF_TYPES[dtype]


def gguf_cache_dir(model_dir: str | Path, root: Path = LLAMACPP_DIR) -> Path:
    """Where the GGUFs of ``model_dir`` go: ``root/gguf/<name>-<key>``, the key a hash of the directory's path
    and of its config's and weights' sizes and modification times (a rewritten model gets new GGUFs)."""
    model_dir = Path(model_dir).resolve()
    digest = hashlib.sha256(str(model_dir).encode())
    for path in sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"]):
        if path.exists():
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return root / "gguf" / f"{model_dir.name}-{digest.hexdigest()[:12]}"


def ensure_gguf(model_dir: str | Path, dtype: str, quant: str | None = None, root: Path = LLAMACPP_DIR,
                bin_dir: Path | None = None) -> Path:
    """The GGUF of ``model_dir`` in ``dtype`` (``quant``: then quantized by ``llama-quantize``), made once.

    Raises:
        ValueError: an unknown ``dtype`` or ``quant``.
        subprocess.CalledProcessError: the conversion or the quantization failed (its output is in the log
            beside the GGUF).
    """
    base_type = gguf_type(dtype)
    if quant is not None and quant not in LLAMACPP_QUANTS:
        raise ValueError(f"llama.cpp quantization {quant!r} unknown; known: {', '.join(LLAMACPP_QUANTS)}")
    cache = gguf_cache_dir(model_dir, root)
    cache.mkdir(parents=True, exist_ok=True)
    base = cache / f"{base_type}.gguf"
    if not base.exists():
        script = llamacpp_source(root) / "convert_hf_to_gguf.py"
        tmp = base.with_suffix(".tmp")
        log.info("llamacpp: converting %s to %s", model_dir, base)
        with open(cache / f"{base_type}.log", "w") as out:
            subprocess.run([sys.executable, str(script), str(model_dir), "--outtype", base_type, "--outfile", str(tmp)],
                           check=True, stdout=out, stderr=subprocess.STDOUT)
        os.replace(tmp, base)
    if quant is None:
        return base
    target = cache / f"{base_type}-{quant}.gguf"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        quantize = (bin_dir or ensure_llamacpp(root)) / "llama-quantize"
        with open(cache / f"{base_type}-{quant}.log", "w") as out:
            subprocess.run([str(quantize), str(base), str(tmp), quant.upper()], check=True, stdout=out,
                           stderr=subprocess.STDOUT)
        os.replace(tmp, target)
    return target


def llamacpp_perplexity(gguf: Path, text: str, window_tokens: int, windows: int, threads: int,
                        bin_dir: Path | None = None) -> float:
    """llama.cpp's own perplexity of ``gguf`` on ``text`` (``llama-perplexity``): the text tokenized by the GGUF's
    tokenizer, cut into ``windows`` chunks of ``window_tokens``, each chunk's second half scored with its first
    half as context (llama.cpp's method; ours scores every token of a window after its first, so compare each
    tool's ratio to its own float weights, not the values across tools).

    Raises:
        RuntimeError: ``llama-perplexity`` failed, or printed no final estimate (its output's tail in the message).
    """
    tool = (bin_dir or ensure_llamacpp()) / "llama-perplexity"
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as corpus:
        corpus.write(text)
        corpus.flush()
        done = subprocess.run([str(tool), "-m", str(gguf), "-f", corpus.name, "-c", str(window_tokens),
                               "-b", str(window_tokens), "--chunks", str(windows), "-t", str(threads)],
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"llama-perplexity exited with status {done.returncode}: "
                           f"{(done.stdout + done.stderr)[-2000:]}")
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", done.stdout + done.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity printed no final estimate: {(done.stdout + done.stderr)[-2000:]}")
    return float(found.group(1))


def kv_bytes_per_token(model_dir: str | Path, kv_type: str) -> int:
    """Bytes of K and V per token of context over all layers: 2 x layers x KV heads x head dim x element size."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * KV_TYPE_BYTES[kv_type]


def slot_length(workload: Workload) -> int:
    """Context tokens one slot needs: the longest prompt + output of the workload, rounded up to 256."""
    longest = max(len(r.prompt_ids) + r.output_len for r in workload.requests)
    return -(-longest // CONTEXT_ALIGN) * CONTEXT_ALIGN


def plan_slots(config: BenchConfig, mode: str, num_requests: int, slot_len: int, token_bytes: int) -> int:
    """``--parallel`` for ``mode``: the requests llama-server may hold at once.

    Closed loop (``concurrent``): the loop's ``concurrency``. Offline and online (no bound of their own): as many
    as our engine may run at once (``max_num_seqs``), no more than the requests, and no more than fit our
    engine's KV pool (``kv_cache_bytes``) at a whole slot each, since llama.cpp reserves each slot's full
    context up front where our paged pool holds only the tokens stored.

    Raises:
        ValueError: not even one slot of ``slot_len`` tokens fits the KV pool.
    """
    fit = config.kv_cache_bytes // (slot_len * token_bytes)
    if fit < 1:
        raise ValueError(f"llama.cpp: one slot of {slot_len} tokens needs {slot_len * token_bytes} bytes of KV "
                         f"cache, more than kv_cache_bytes {config.kv_cache_bytes}")
    if mode == "concurrent":
        return min(config.concurrency, num_requests)
    return min(config.max_num_seqs, num_requests, fit)


def server_command(bin_dir: Path, gguf: Path, config: BenchConfig, kv_type: str, slots: int, slot_len: int,
                   port: int) -> list[str]:
    """The ``llama-server`` command line for ``slots`` slots of ``slot_len`` tokens each (see the module doc)."""
    return [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-t", str(config.threads), "-tb", str(config.threads), "--parallel", str(slots),
            "-c", str(slots * slot_len), "--no-kv-unified", "--cont-batching", "-b", str(config.max_num_batched_tokens),
            "-ctk", kv_type, "-ctv", kv_type, "--cache-ram", "0", "--no-webui", "-ngl", "0"]


def completion_body(request: BenchRequest) -> dict:
    """The ``/completion`` request of one benchmark request (greedy, exactly ``output_len`` tokens, streamed)."""
    return {"prompt": list(request.prompt_ids), "n_predict": request.output_len, "ignore_eos": True,
            "temperature": 0.0, "cache_prompt": False, "stream": True, "return_tokens": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaCppSystem:
    name = "llamacpp"

    def __init__(self, config: BenchConfig, model_dir: str, dtype: str, workload: Workload) -> None:
        """Builds llama.cpp and the GGUF if needed (untimed); the servers start per mode in :meth:`run`."""
        self.config = config
        self.kv_type = gguf_type(dtype)
        self.bin_dir = ensure_llamacpp()
        self.gguf = ensure_gguf(model_dir, dtype, config.llamacpp_quant, bin_dir=self.bin_dir)
        self.token_bytes = kv_bytes_per_token(model_dir, self.kv_type)
        self.slot_len = slot_length(workload)
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-llamacpp-"))
        self.process: subprocess.Popen | None = None
        weights = f"{self.kv_type} GGUF" + (f" quantized to {config.llamacpp_quant} by llama-quantize (not the "
                                            f"same weights as the other systems: tokens differ)"
                                            if config.llamacpp_quant else "")
        self.notes = [f"{llamacpp_version()}; llama-server, {weights}, KV cache {self.kv_type}, "
                      f"{config.threads} threads, continuous batching, {self.slot_len} tokens per slot; "
                      f"timed at the HTTP client (/completion, streamed)",
                      "llama.cpp's ignore_eos bans the end-of-generation tokens (logit -inf) where ours and vLLM's "
                      "only keep going past them: a request whose greedy token is one takes another path from there"]

    def _start(self, slots: int) -> str:
        """Starts a server with ``slots`` slots; its base URL once ``/health`` answers 200.

        Raises:
            RuntimeError: it exited or did not become healthy within :data:`START_TIMEOUT_S` (its log's tail).
        """
        port = free_port()
        command = server_command(self.bin_dir, self.gguf, self.config, self.kv_type, slots, self.slot_len, port)
        self.log_path = self.workdir / f"llama-server-{slots}.log"
        with open(self.log_path, "w") as server_log:  # the child keeps its own copy of the descriptor
            # As a llama.cpp user runs it: without the allocator this process preloaded for our engine.
            env = allocator.without(dict(os.environ), os.environ.get("LLM_BENCH_PRELOAD"))
            self.process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, env=env,
                                            stdin=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        return url
            except OSError:  # refused while it binds, 503 while it loads
                pass
            time.sleep(0.2)
        self._stop()
        raise RuntimeError(f"llama-server did not start ({' '.join(command)}): "
                           + self.log_path.read_text(errors="replace")[-1500:])

    def _stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def run(self, workload: Workload, mode: str) -> SystemRun:
        slots = plan_slots(self.config, mode, len(workload.requests), self.slot_len, self.token_bytes)
        url = self._start(slots)
        try:
            asyncio.run(self._warm_up(url))
            arrivals = workload.arrivals(mode)
            records = {r.index: RequestRecord(r.index, 0.0, r.output_len) for r in workload.requests}
            first_tokens: dict[int, list[int | None]] = {r.index: [] for r in workload.requests}
            concurrency = self.config.concurrency if mode == "concurrent" else None
            start = time.perf_counter()
            try:
                asyncio.run(self._stream_all(url, workload.requests, records, first_tokens, start, arrivals,
                                             concurrency, mode))
            except Exception as exc:  # say what the server did, with its log's tail
                try:
                    state = f"llama-server exited with status {self.process.wait(timeout=2)}"
                except subprocess.TimeoutExpired:
                    state = "llama-server is still running"
                raise RuntimeError(f"{type(exc).__name__}: {exc}: {state}; its log ends: "
                                   + self.log_path.read_text(errors="replace")[-1500:]) from exc
        finally:
            self._stop()
        known = {k: v for k, v in first_tokens.items() if None not in v}
        notes = [*self.notes, f"--parallel {slots} slots, context {slots * self.slot_len} tokens"]
        if len(known) < len(first_tokens):
            notes.append(f"{len(first_tokens) - len(known)} request(s) left out of the greedy-token comparison: "
                         f"llama-server held back a token that ended inside a UTF-8 character and streamed the next "
                         f"without its id")
        return SystemRun("llamacpp", mode, list(records.values()), start, mean_batch=None,
                         batch_source="", notes=notes, first_tokens=known)

    async def _warm_up(self, url: str) -> None:
        import aiohttp

        warm = BenchRequest(-1, (1, 2, 3, 4), "", 4, 0.0)
        async with aiohttp.ClientSession() as client:
            await self._stream_one(client, url, warm, RequestRecord(-1, 0.0, 4), [])

    async def _stream_all(self, url: str, requests, records: dict, first_tokens: dict, start: float,
                          arrivals: list[float], concurrency: int | None, mode: str) -> None:
        """Sends every request at its arrival time; with ``concurrency``, at most that many at once (a closed
        loop: a request is due when it gets a slot, and its latencies count from then)."""
        import aiohttp

        slots = asyncio.Semaphore(concurrency or len(requests))
        bar = tqdm(total=len(requests), desc=f"llamacpp {mode}", disable=not self.config.progress, leave=False)
        # A connection per request, closed after it: reusing a kept-alive one races the server closing it
        # (llama-server's HTTP library ends idle and long-used connections), seen as "Server disconnected".
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        timeout = aiohttp.ClientTimeout(total=None)

        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
            async def one(r: BenchRequest) -> None:
                rec = records[r.index]
                rec.arrival = start + arrivals[r.index]
                await asyncio.sleep(max(0.0, rec.arrival - time.perf_counter()))
                async with slots:
                    if concurrency:
                        rec.arrival = time.perf_counter()
                    await self._stream_one(client, url, r, rec, first_tokens[r.index])
                bar.update(1)

            try:
                await asyncio.gather(*(one(r) for r in requests))
            finally:
                bar.close()

    @staticmethod
    async def _stream_one(client, url: str, r: BenchRequest, rec: RequestRecord, first: list[int | None]) -> None:
        """One request's server-sent events: each partial result carries the token just sampled (``tokens``)
        and the count so far (``tokens_predicted``); a count that jumps means tokens held back inside a UTF-8
        character, recorded at this time with unknown ids (None).

        Raises:
            RuntimeError: an HTTP error, or a stream that ended before the last result or with another count.
        """
        async with client.post(f"{url}/completion", json=completion_body(r)) as response:
            if response.status != 200:
                raise RuntimeError(f"llama-server /completion: HTTP {response.status}: {await response.text()}")
            final = None
            async for raw in response.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                now = time.perf_counter()
                event = json.loads(line[6:])
                new = event.get("tokens_predicted", 0) - rec.num_output_tokens
                if new > 0:  # the last result repeats the count: tokens held back to the end show up here
                    rec.token_times += [now] * new
                    rec.num_output_tokens += new
                    ids = [] if event.get("stop") else event.get("tokens") or []
                    if len(first) < FIRST_TOKENS:
                        first += [None] * (new - len(ids)) + list(ids)
                        del first[FIRST_TOKENS:]
                rec.finish = now
                if event.get("stop"):
                    final = event
                    break
        if final is None or rec.num_output_tokens != r.output_len:
            raise RuntimeError(f"llama-server request {r.index}: {rec.num_output_tokens} of {r.output_len} tokens "
                               f"({'stream ended early' if final is None else final.get('stop_type')})")

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
