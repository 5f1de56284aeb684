"""Pure-decode steps replayed from CUDA graphs, one captured per batch size.

A decode step of a small model on a GPU is bound by kernel launches, not by arithmetic: dozens of launches per
layer, each a few microseconds of CPU time. A CUDA graph records a step's launches once and replays them with
one call. Graphs fix their tensors' addresses and shapes, so every input lives in a static buffer sized for
the largest batch, a step of ``n`` decodes runs the graph of the smallest captured batch ``>= n``, and the
rows past ``n`` are padding that touches nothing: slot ``-1`` (``reshape_and_cache`` skips it) and context
length 0 (the decode kernel writes zeros). The sizes follow vLLM's and nano-vllm's: 1, 2, 4, 8, then every 16.
Capture goes from the largest batch down, all graphs sharing one memory pool (vLLM's ``CUDAGraphRunner``,
nano-vllm's ``capture_cudagraph``).

Only the compact decoder on the ``triton`` attention backend is captured; steps with prompt
rows, or more decodes than the largest graph, run eagerly. ``emulate`` replaces capture and replay with an eager
call on the same static buffers, on any device: the padding and buffer bookkeeping is then testable on a machine
without a GPU (under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import logging
import time

import torch

from backend.attention.triton import TritonMetadataBuilder

log = logging.getLogger(__name__)
MAX_CAPTURED_BATCH = 256


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURED_BATCH) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 32, ... up to ``min(max_num_seqs, limit)``, which is
    always included."""
    top = min(max_num_seqs, limit)
    sizes = [s for s in (1, 2, 4, 8) if s < top] + list(range(16, top, 16))
    return sizes + [top]


class DecodeGraphs:
    """The decoder's pure-decode forward pass, captured once per batch size of :func:`capture_sizes`.

    Args:
        decoder: ``backend.models`` decoder: ``(input_ids, positions, meta, logits_rows) -> logits``.
        builder: the model runner's ``triton`` metadata builder (it holds the per-layer KV pools).
        max_num_seqs / max_model_len / block_size: the engine's; fix the buffers' sizes.
        emulate: no capture; :meth:`run` calls the decoder eagerly on the static buffers.

    Raises:
        RuntimeError: capture requested (not emulated) where CUDA is not available.
    """

    def __init__(self, decoder, builder: TritonMetadataBuilder, max_num_seqs: int, max_model_len: int,
                 block_size: int, emulate: bool = False) -> None:
        device = builder.kv_caches[0][0].device
        if not emulate and device.type != "cuda":
            raise RuntimeError(f"CUDA graphs need a CUDA device; the KV cache is on {device}")
        self.decoder, self.builder, self.emulate = decoder, builder, emulate
        self.sizes = capture_sizes(max_num_seqs)
        top, width = self.sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((top,), -1, dtype=torch.long, device=device)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(top, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.replays = {size: 0 for size in self.sizes}  # per captured size: how often it ran (tests, logs)
        began = time.perf_counter()
        if not emulate:
            self._capture_all()
        log.info("CUDA graphs %s for decode batches %s in %.1f s", "emulated" if emulate else "captured",
                 self.sizes, time.perf_counter() - began)

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def covers(self, counts: list[int]) -> bool:
        """Whether a step with these per-request query counts runs from a graph: all decodes, few enough."""
        return 0 < len(counts) <= self.max_batch and all(c == 1 for c in counts)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """One pure-decode step of ``n`` requests (any device; copied into the static buffers).

        Args:
            input_ids / positions / slot_mapping: ``[n]`` int64; seq_lens: ``[n]`` context length including the
                new token; block_tables: ``[n, blocks]`` (``blocks`` at most ``ceil(max_model_len / block_size)``).

        Returns:
            ``[n, vocab_size]`` logits: a view of the graph's output, valid until the next :meth:`run`.
        """
        n = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(slot_mapping)
        self.slot_mapping[n:size].fill_(-1)  # padding rows write no K/V ...
        self.seq_lens[:n].copy_(seq_lens)
        self.seq_lens[n:size].zero_()  # ... and read none
        self.block_tables[:n, :block_tables.shape[1]].copy_(block_tables)
        self.replays[size] += 1
        if self.emulate:
            return self._forward(size)[:n]
        self.graphs[size].replay()
        return self.outputs[size][:n]

    def _forward(self, size: int) -> torch.Tensor:
        meta = self.builder.decode(self.slot_mapping[:size], self.seq_lens[:size], self.block_tables[:size])
        return self.decoder(self.input_ids[:size], self.positions[:size], meta, self.logits_rows[:size])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # the largest first: the smaller graphs fit in its memory pool
            self._forward(size)  # warm-up outside the capture: Triton compiles, allocators settle
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
