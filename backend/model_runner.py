"""Tensors in, tokens out: packs the step's tokens, runs one forward pass, samples.

Owns the model and the KV cache tensors; knows nothing about queues or block allocation. It reads only the
:class:`~backend.scheduler_output.SchedulerOutput` (each request's chunk and block table), builds the slot
mapping and the attention metadata of the path in use, and returns the sampled token of every request
that reached its last token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend import prompt_logprobs
from backend.attention import (ATTENTION_NAME, AttentionMetadata, GatherWorkspace, KernelAttentionMetadata,
                               PrefillSpan, TorchAttentionMetadata)
from backend.cpu_threads import ThreadBinder
from backend.cuda_graphs import DecodeGraphs
from backend.models import build_decoder
from backend.sampler import Sampler, TokenLogprobs, plain_greedy
from backend.scheduler_output import SchedulerOutput
from backend.utils import cdiv


@dataclass
class ModelRunnerOutput:
    """Per request id: the sampled token, and its logprobs when asked for; for requests that asked for prompt
    logprobs and computed prompt positions this step, (index of the first prompt token scored, its entries)."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


def kv_bytes_per_block(model_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    num_kv_heads, head_dim = kv_shape(model_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_hidden_layers * block_size * num_kv_heads * head_dim * itemsize


def kv_shape(model_config) -> tuple[int, int]:
    num_kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    return num_kv_heads, head_dim


class ModelRunner:
    """Owns the model and the paged KV cache tensors.

    The KV cache is, per layer, a key and a value tensor ``[num_blocks, block_size, num_kv_heads, head_dim]``.
    """

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, use_kernels: bool,
                 max_model_len: int, compact: bool = True, cpu_kernel: bool = False,
                 cpu_threads: list[int] | None = None) -> None:
        self.block_size = block_size
        self.use_kernels = use_kernels
        self.cpu_kernel = cpu_kernel  # decodes through kernels/cpu (reads blocks in place) instead of gather + SDPA
        self.sampler = Sampler(cpu_kernels=cpu_kernel)
        self.thread_binder = ThreadBinder(cpu_threads)  # pins the stepping thread's torch threads (CPU only)
        self.workspace = GatherWorkspace()
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # The compact decoder where the architecture allows (fused GEMMs, prepacked weights); else the
        # unmodified transformers model with paged attention plugged into its AttentionInterface.
        self.decoder = build_decoder(model, max_model_len, cpu_kernel) if compact else None
        self.model = None if self.decoder is not None else model
        if self.model is not None:
            model.set_attn_implementation(ATTENTION_NAME)
        num_kv_heads, head_dim = kv_shape(model.config)
        shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                           torch.zeros(shape, dtype=self.dtype, device=self.device))
                          for _ in range(model.config.num_hidden_layers)]
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, emulate: bool = False) -> None:
        """Pure-decode steps of up to ``min(max_num_seqs, 256)`` requests replay CUDA graphs from now on
        (:mod:`backend.cuda_graphs`; ``emulate``: the same buffers, run eagerly).

        Raises:
            ValueError: the step would not be capturable: not the Triton kernels, or not the compact decoder.
        """
        if not self.use_kernels or self.decoder is None:
            raise ValueError("CUDA graphs need the Triton kernels (use_kernels) and the compact decoder "
                             f"(this model runs {'the compact decoder' if self.decoder else 'transformers modules'}, "
                             f"use_kernels={self.use_kernels})")
        self.decode_graphs = DecodeGraphs(self.decoder, self.kv_caches, max_num_seqs, self.max_model_len,
                                          self.block_size, emulate=emulate)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One forward pass over all scheduled tokens, packed with no padding; logits only for each
        request's last scheduled token, and only when that token is the request's last, plus the rows that
        score a prompt for requests that asked for prompt logprobs (``backend.prompt_logprobs``)."""
        self.thread_binder.ensure_bound()
        scheduled = sched.scheduled
        counts = [s.num_scheduled_tokens for s in scheduled]
        starts = [s.num_computed_tokens for s in scheduled]
        token_ids: list[int] = []
        for s in scheduled:
            token_ids.extend(s.token_ids)

        counts_t = torch.tensor(counts)
        starts_t = torch.tensor(starts)
        seq_lens = starts_t + counts_t
        cu_seqlens = torch.zeros(len(scheduled) + 1, dtype=torch.long)
        torch.cumsum(counts_t, 0, out=cu_seqlens[1:])
        num_tokens = int(cu_seqlens[-1])
        # Position of each packed token: its request's start + its offset within the request's chunk.
        row_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), counts_t)
        positions = starts_t[row_of_token] + torch.arange(num_tokens) - cu_seqlens[:-1][row_of_token]

        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = torch.tensor([s.block_ids + [0] * (max_blocks - len(s.block_ids)) for s in scheduled],
                                    dtype=torch.long)
        block_tables.clamp_(min=0)  # null entries (freed behind a sliding window) are masked out: any id will do
        slot_mapping = (block_tables[row_of_token, positions // self.block_size] * self.block_size
                        + positions % self.block_size)

        sample_rows = [i for i, s in enumerate(scheduled) if s.samples]
        prompt_rows = prompt_logprobs.plan(scheduled, cu_seqlens[:-1].tolist())
        if self.decode_graphs is not None and not prompt_rows and self.decode_graphs.covers(counts):
            logits = self.decode_graphs.run(torch.tensor(token_ids), positions, slot_mapping, seq_lens, block_tables)
            return self._sample(logits[sample_rows], scheduled, sample_rows)
        if self.use_kernels:
            meta = self._kernel_metadata(_num_decodes(counts), seq_lens, cu_seqlens, block_tables, slot_mapping)
        else:
            meta = self._torch_metadata(counts, starts, seq_lens, cu_seqlens, block_tables, slot_mapping)
        logits_rows = cu_seqlens[1:][sample_rows] - 1
        if prompt_rows:  # after the sampling rows: hidden[:len(sample_rows)] samples, the rest scores prompts
            logits_rows = torch.cat([logits_rows, torch.tensor([r for p in prompt_rows for r in p.rows])])
        num_sample = len(sample_rows)
        prompt_out = {}
        input_ids = torch.tensor(token_ids, device=self.device)
        positions, logits_rows = positions.to(self.device), logits_rows.to(self.device)
        if self.decoder is not None:
            hidden = self.decoder.final_hidden(input_ids, positions, meta, logits_rows)
            if prompt_rows:
                prompt_out = prompt_logprobs.compute(hidden[num_sample:], self.decoder.lm_head, prompt_rows)
                hidden = hidden[:num_sample]
            if self.decoder.greedy_head is not None and sample_rows:  # fp32 heads only: skip the check elsewhere
                requests = [scheduled[i].request for i in sample_rows]
                tokens = self.decoder.greedy_tokens(hidden) if all(plain_greedy(r) for r in requests) else None
                if tokens is not None:
                    return ModelRunnerOutput({r.request_id: t for r, t in zip(requests, tokens)}, {}, prompt_out)
            logits = self.decoder.lm_head(hidden)
        else:
            logits = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                                logits_to_keep=logits_rows, attention_metadata=meta).logits[0]
            if prompt_rows:
                prompt_out = prompt_logprobs.compute(logits[num_sample:], lambda x: x, prompt_rows)
                logits = logits[:num_sample]
        return self._sample(logits, scheduled, sample_rows, prompt_out)

    def _sample(self, logits: torch.Tensor, scheduled, sample_rows: list[int],
                prompt_out: dict | None = None) -> ModelRunnerOutput:
        """``logits``: ``[len(sample_rows), vocab_size]``, row j for request ``scheduled[sample_rows[j]]``."""
        if not sample_rows:
            return ModelRunnerOutput({}, {}, prompt_out or {})
        sample_requests = [scheduled[i].request for i in sample_rows]
        out = self.sampler(logits, sample_requests)
        sampled = {r.request_id: t for r, t in zip(sample_requests, out.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(sample_requests, out.logprobs) if lp is not None}
        return ModelRunnerOutput(sampled, logprobs, prompt_out or {})

    def _kernel_metadata(self, nd: int, seq_lens: torch.Tensor, cu_seqlens: torch.Tensor,
                         block_tables: torch.Tensor, slot_mapping: torch.Tensor) -> AttentionMetadata:
        device, i32 = self.device, torch.int32
        return KernelAttentionMetadata(
            kv_caches=self.kv_caches, slot_mapping=slot_mapping.to(device), num_decodes=nd,
            decode_seq_lens=seq_lens[:nd].to(device=device, dtype=i32),
            decode_block_tables=block_tables[:nd].to(device=device, dtype=i32),
            cu_seqlens_q=(cu_seqlens[nd:] - nd).to(device=device, dtype=i32),
            seq_lens=seq_lens[nd:].to(device=device, dtype=i32),
            block_tables=block_tables[nd:].to(device=device, dtype=i32))

    def _torch_metadata(self, counts: list[int], starts: list[int], seq_lens: torch.Tensor,
                        cu_seqlens: torch.Tensor, block_tables: torch.Tensor,
                        slot_mapping: torch.Tensor) -> AttentionMetadata:
        device, bs = self.device, self.block_size
        num_decodes = _num_decodes(counts)
        decode_lens = seq_lens[:num_decodes]
        decode_blocks = cdiv(int(decode_lens.max()), bs) if num_decodes else 0
        decode_tables = block_tables[:num_decodes, :decode_blocks]
        decode_mask = None  # the C++ kernel takes the lengths; gather + SDPA needs a key mask
        if not self.cpu_kernel:
            decode_mask = (torch.arange(decode_blocks * bs)[None, :] < decode_lens[:, None])[:, None, None, :]
        prefills = []
        for i in range(num_decodes, len(counts)):
            start, n, seq_len = starts[i], counts[i], starts[i] + counts[i]
            mask = None
            if start:  # causal with an offset: query j sees keys 0..start + j
                mask = (torch.arange(seq_len)[None, :] <= torch.arange(start, seq_len)[:, None]).to(device)
            prefills.append(PrefillSpan(int(cu_seqlens[i]), int(cu_seqlens[i + 1]), seq_len,
                                        block_tables[i, :cdiv(seq_len, bs)].to(device), mask))
        kernel_prefills = {}
        if self.cpu_kernel and prefills:
            kernel_prefills = dict(prefill_block_tables=block_tables[num_decodes:].contiguous(),
                                   prefill_cu_seqlens=cu_seqlens[num_decodes:] - cu_seqlens[num_decodes],
                                   prefill_seq_lens=seq_lens[num_decodes:].contiguous())
        return TorchAttentionMetadata(
            kv_caches=self.kv_caches, slot_mapping=slot_mapping.to(device), num_decodes=num_decodes,
            decode_block_tables=(decode_tables.contiguous() if self.cpu_kernel else decode_tables).to(device),
            decode_mask=None if decode_mask is None else decode_mask.to(device),
            decode_seq_lens=decode_lens.to(device),
            prefills=prefills, workspace=self.workspace, cpu_kernel=self.cpu_kernel, **kernel_prefills)


def _num_decodes(counts: list[int]) -> int:
    """How many requests at the front of the batch have one query token (the decodes; the scheduler puts
    running requests first)."""
    n = 0
    while n < len(counts) and counts[n] == 1:
        n += 1
    return n
