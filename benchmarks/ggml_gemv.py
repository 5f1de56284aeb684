"""One token's weight reads, our kernel against llama.cpp's, on the same shapes, alternating in one window.

``python -m benchmarks.ggml_gemv [--shape smollm2-1.7b | --model DIR] [--dtype bfloat16] [--threads 2] [--rounds 10]``

A decode step of one stream multiplies one row by every weight matrix of the model: its time is the time to
stream the weights from memory (the roofline's memory side; Williams, Waterman and Patterson, CACM 2009). This
times exactly that part of a step for both engines, with nothing else around it: the per-layer matrices of a
Llama-family shape (:func:`benchmarks.memory_floor.linear_shapes`: fused QKV, O, fused gate-up, down, the LM head)
through our ``cpu_ops.small_gemm`` at one row (the decode path's kernel, from its packed layout), and through
llama.cpp's ``ggml_mul_mat`` (tinyBLAS for bf16 with AVX512-BF16, or its vec_dot kernels), compiled from the same
llama.cpp build the peer benchmark runs (``make llamacpp``) into a small program (``ggml_gemv.cpp``) that this
process drives over a pipe. Both get the matrices as our engine holds them (QKV and gate-up fused; llama.cpp's own
graph runs them unfused, in more and smaller calls). Each round times one pass of ours and one pass of llama.cpp's
(in turn first), each after an idle gap (:data:`GAP_S`: the other side's OpenMP threads, which spin for a while
after their last parallel region, have stopped by then; without it whichever side ran second lost up to a tenth of
its time), then the bandwidth probe of :mod:`benchmarks.limits`, back to back: on a shared host whose memory
bandwidth moves by half within minutes, only such alternation says which kernel reads faster. Both read their own
copy of the same number of bytes, asked for on 2 MiB pages; how much of each process's memory got them is recorded
(``huge_page_bytes``). Prints each round, the median of the rounds' own ratios and the median for each order;
``--output FILE`` writes them as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.llamacpp_system import LLAMACPP_DIR, ensure_llamacpp, llamacpp_source, llamacpp_version

SOURCE = Path(__file__).with_name("ggml_gemv.cpp")
GGML_LIBS = ("libggml.a", "libggml-cpu.a", "libggml-base.a")  # static, in link order
GGML_TYPES = {"bfloat16": "bf16", "float32": "f32"}
GAP_S = 0.1  # idle before each timed pass
REPLY_TIMEOUT_S = 600.0  # the program's longest silence: start-up (writing every weight) or one pass


def build_program(root: Path = LLAMACPP_DIR) -> Path:
    """``ggml_gemv.cpp`` compiled against the llama.cpp build in ``root`` (built first if missing), cached by the
    source's and the build's identity.

    Raises:
        subprocess.CalledProcessError: the compiler failed (its output on stderr).
    """
    bin_dir = ensure_llamacpp(root)
    lib_dir = bin_dir.parent / "ggml" / "src"
    build = "".join(f"{lib}:{(lib_dir / lib).stat().st_size}:{(lib_dir / lib).stat().st_mtime_ns};" for lib in GGML_LIBS)
    key = hashlib.sha256(SOURCE.read_bytes() + llamacpp_version(root).encode() + build.encode()).hexdigest()[:12]
    program = root / f"ggml_gemv-{key}"
    if not program.exists():
        include = llamacpp_source(root) / "ggml" / "include"
        # -march=native as the llama.cpp build (GGML_NATIVE=ON); OpenMP as its threads (GGML_OPENMP=ON).
        subprocess.run(["c++", "-O3", "-march=native", "-std=c++17", "-fopenmp", f"-I{include}", str(SOURCE),
                        *(str(lib_dir / lib) for lib in GGML_LIBS), "-ldl", "-lpthread", "-o", f"{program}.tmp"],
                       check=True)
        Path(f"{program}.tmp").rename(program)
    return program


class GgmlGemv:
    """The program running: :meth:`run` computes every matrix once and returns the milliseconds.

    Raises (any method):
        RuntimeError: the program exited (its status), or said nothing for :data:`REPLY_TIMEOUT_S` seconds (it is
            killed).
    """

    def __init__(self, program: Path, dtype: str, threads: int, shapes: list[tuple[int, int]]) -> None:
        spec = ",".join(f"{n}x{k}" for n, k in shapes)
        self.process = subprocess.Popen([str(program), GGML_TYPES[dtype], str(threads), spec], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if self._reply() != "ready":
            raise RuntimeError(f"{program} did not start")

    def _ask(self, command: str) -> str:
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it exited: _reply says with which status
        return self._reply()

    def _reply(self) -> str:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(REPLY_TIMEOUT_S):
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"ggml_gemv said nothing for {REPLY_TIMEOUT_S:.0f} s and was killed")
        line = self.process.stdout.readline().strip()
        if not line:
            raise RuntimeError(f"ggml_gemv exited with status {self.process.wait()}")
        return line

    def run(self) -> float:
        return float(self._ask("run"))

    def output_sum(self) -> float:
        """The sum of every output of the last :meth:`run` (0 before the first; see ``ggml_gemv.cpp`` for the
        weights and x)."""
        return float(self._ask("sum"))

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def huge_page_bytes(pid: int) -> int | None:
    """Bytes of process ``pid``'s anonymous memory on transparent huge pages (``AnonHugePages`` of its
    ``smaps_rollup``), or None where Linux does not say."""
    try:
        for line in (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def matrix_shapes(model_config) -> list[tuple[int, int]]:
    """(out_features, in_features) of every matrix one decode step reads, in the order a step reads them."""
    from benchmarks.memory_floor import linear_shapes

    *per_layer, (_, vocab, hidden) = linear_shapes(model_config)  # the LM head comes last
    return [(n, k) for _, n, k in per_layer] * model_config.num_hidden_layers + [(vocab, hidden)]


def model_config_for(shape: str | None, model: str | None):
    """The config of ``shape`` (no weights written; ``default``: the default model's), or of the model directory
    ``model``.

    Raises:
        ValueError: an unknown shape name.
    """
    from transformers import AutoConfig, LlamaConfig

    if model or shape == "default":
        from backend.model_loader import resolve_model_dir

        return AutoConfig.from_pretrained(resolve_model_dir(model))
    from benchmarks.shapes import COMMON, SHAPES

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    return LlamaConfig(**COMMON, **SHAPES[shape])


def compare(model_config, dtype: str, threads: int, rounds: int, root: Path = LLAMACPP_DIR) -> dict:
    """Alternates one pass of ours and one of llama.cpp's (in turn first, each after :data:`GAP_S` idle) and the
    bandwidth probe ``rounds`` times (after one untimed pass of each); returns the bytes, each round's times, rates
    and order, the medians, the median ratio for each side first, and each process's memory on huge pages.

    Raises:
        RuntimeError: small_gemm is not available for ``dtype`` here (no AVX-512 or AVX2 kernels).
    """
    import torch

    from backend import cpu_ops
    from benchmarks.limits import measure_bandwidth_gbps

    torch_dtype = getattr(torch, dtype)
    if not cpu_ops.small_gemm_available(torch_dtype):
        raise RuntimeError(f"cpu_ops.small_gemm is not available for {dtype} on this CPU")
    torch.set_num_threads(threads)
    shapes = matrix_shapes(model_config)
    generator = torch.Generator().manual_seed(0)
    packed = [cpu_ops.small_gemm_pack(torch.randn(n, k, generator=generator).to(torch_dtype)) for n, k in shapes]
    rows = {k: torch.randn(1, k, generator=generator).to(torch_dtype) for _, k in shapes}
    outs = [torch.empty(1, n, dtype=torch_dtype) for n, _ in shapes]
    weight_bytes = sum(n * k for n, k in shapes) * torch_dtype.itemsize

    def ours() -> float:
        start = time.perf_counter()
        for (_, k), weights, out in zip(shapes, packed, outs):
            cpu_ops.small_gemm(rows[k], weights, None, out=out)
        return 1e3 * (time.perf_counter() - start)

    ggml = GgmlGemv(build_program(root), dtype, threads, shapes)
    try:
        ours(), ggml.run()  # untimed: pages faulted in, threads started
        huge_pages = {"ours": huge_page_bytes(os.getpid()), "llamacpp": huge_page_bytes(ggml.process.pid)}
        samples = []
        for i in range(rounds):
            first = "llamacpp" if i % 2 else "ours"  # in turn first: neither always runs after the other
            times = {}
            for side in (("llamacpp", "ours") if i % 2 else ("ours", "llamacpp")):
                time.sleep(GAP_S)
                times[side] = ggml.run() if side == "llamacpp" else ours()
            samples.append({"ours_ms": times["ours"], "llamacpp_ms": times["llamacpp"],
                            "probe_gbps": measure_bandwidth_gbps(threads, repeats=3), "first": first})
    finally:
        ggml.close()
    for s in samples:
        s["ours_gbps"] = weight_bytes / s["ours_ms"] / 1e6
        s["llamacpp_gbps"] = weight_bytes / s["llamacpp_ms"] / 1e6
        s["ours_vs_llamacpp_time"] = s["ours_ms"] / s["llamacpp_ms"]
    numeric = [key for key in samples[0] if key != "first"]
    by_first = {side: statistics.median(s["ours_vs_llamacpp_time"] for s in samples if s["first"] == side)
                for side in ("ours", "llamacpp") if any(s["first"] == side for s in samples)}
    return {"dtype": dtype, "threads": threads, "matrices": len(shapes), "weight_bytes": weight_bytes,
            "llamacpp": llamacpp_version(root), "gap_s": GAP_S, "huge_page_bytes": huge_pages, "rounds": samples,
            "median": {key: statistics.median(s[key] for s in samples) for key in numeric},
            "median_ratio_by_first": by_first}


def markdown(result: dict, every_round: bool = False) -> str:
    """The medians of the rounds, their least and greatest values, and each round's ratio, as a table (every round's
    figures too with ``every_round``); ``docs_page`` renders a kept result with it."""
    what = result.get("shape") or result.get("model")
    rounds = result["rounds"]
    keys = ("ours_ms", "llamacpp_ms", "ours_vs_llamacpp_time", "ours_gbps", "llamacpp_gbps", "probe_gbps")
    rows = [(str(i + 1), s) for i, s in enumerate(rounds)] if every_round else []
    rows += [("**median**", result["median"]), ("least", {k: min(s[k] for s in rounds) for k in keys}),
             ("greatest", {k: max(s[k] for s in rounds) for k in keys})]
    lines = [f"{what}: {result['matrices']} matrices, {result['weight_bytes'] / 1e9:.2f} GB of {result['dtype']} "
             f"weights, one row, {result['threads']} threads, {len(rounds)} alternating rounds; {result['llamacpp']}.",
             "", "| rounds | ours ms | llama.cpp ms | ours / llama.cpp | ours GB/s | llama.cpp GB/s | probe GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for label, s in rows:
        lines.append(f"| {label} | {s['ours_ms']:.1f} | {s['llamacpp_ms']:.1f} | {s['ours_vs_llamacpp_time']:.2f}x | "
                     f"{s['ours_gbps']:.1f} | {s['llamacpp_gbps']:.1f} | {s['probe_gbps']:.1f} |")
    ratios = ", ".join(f"{s['ours_vs_llamacpp_time']:.2f}" for s in rounds)
    lines += ["", f"Each round's ours / llama.cpp time, in order: {ratios}."]
    by_first = result.get("median_ratio_by_first") or {}
    if by_first:
        lines[-1] += (" Median by the side that ran first: " + ", ".join(
            f"{'ours' if side == 'ours' else 'llama.cpp'} first {value:.2f}x" for side, value in by_first.items())
                      + f" ({result['gap_s']:.1f} s idle before each pass).")
    huge = result.get("huge_page_bytes") or {}
    if huge.get("ours") is not None and huge.get("llamacpp") is not None:
        lines[-1] += (f" On 2 MiB pages: {huge['ours'] / 1e9:.2f} GB of our process's memory, "
                      f"{huge['llamacpp'] / 1e9:.2f} GB of llama.cpp's.")
    return "\n".join(lines)


page_markdown = markdown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ggml_gemv", description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--shape", default="smollm2-1.7b", help="a benchmark shape (benchmarks/shapes.py), or `default` for the default model")
    source.add_argument("--model", help="a model directory or hub id (its config only)")
    parser.add_argument("--dtype", choices=sorted(GGML_TYPES), default="bfloat16")
    parser.add_argument("--threads", type=int, help="threads of each side (default: torch's default, as the benchmark's)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--output", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.threads is None:
        import torch

        args.threads = torch.get_num_threads()
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    from benchmarks.machine import machine_info

    result = compare(model_config_for(args.shape, args.model), args.dtype, args.threads, args.rounds)
    result.update(benchmark="benchmarks.ggml_gemv", shape=None if args.model else args.shape, model=args.model,
                  machine=machine_info(args.threads), command="python -m benchmarks.ggml_gemv " + " ".join(sys.argv[1:] if argv is None else argv),
                  date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    print(markdown(result, every_round=True))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
