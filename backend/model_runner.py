"""Tensors in, tokens out: packs the step's tokens, runs one forward pass, samples.

Owns the model and the KV cache tensors; knows nothing about queues or block allocation. It reads only the
:class:`~backend.scheduler_output.SchedulerOutput` (each request's chunk and block table), builds the slot
mapping and the attention backend's metadata, and returns the sampled token of every request
that reached its last token. A speculative decode (a request with draft tokens) is computed like a prefill chunk
of its last token and its drafts; every one of those rows is sampled, and the drafts are verified against them
(:func:`backend.sampler.accept_greedy`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend import prompt_logprobs
from backend.attention import ATTENTION_NAME, AttentionBackend, StepBatch, TorchSDPABackend
from backend.cpu_threads import ThreadBinder
from backend.cuda_graphs import DecodeGraphs
from backend.models import build_decoder
from backend.sampler import Sampler, TokenLogprobs, accept_greedy
from backend.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass
class ModelRunnerOutput:
    """Per request id: the sampled token, and its logprobs when asked for; for requests that asked for prompt
    logprobs and computed prompt positions this step, (index of the first prompt token scored, its entries);
    for speculative decodes (``verified``), the accepted drafts followed by the model's next token."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    verified: dict[str, list[int]] = field(default_factory=dict)


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

    def __init__(self, model: torch.nn.Module, num_blocks: int, block_size: int, max_model_len: int,
                 attn_backend: type[AttentionBackend] = TorchSDPABackend, compact: bool = True,
                 cpu_threads: list[int] | None = None, quantization: str = "none") -> None:
        """``attn_backend``: the selector's choice (:func:`backend.attention.select_attention_backend`); with
        ``uses_cpu_ops`` the compact decoder's layers run through ``kernels/cpu`` too. ``compact``: the compact
        decoder where the architecture allows (fused GEMMs, prepacked weights); else the unmodified transformers
        model with paged attention plugged into its ``AttentionInterface``. ``quantization``: ``none``, ``int8`` or
        ``w8a8`` (the compact decoder's linears as int8 weights; needs ``compact``).

        Raises:
            ValueError: ``int8`` / ``w8a8`` without the compact decoder, or where its kernel cannot run."""
        self.block_size = block_size
        self.attn_backend = attn_backend
        self.thread_binder = ThreadBinder(cpu_threads)  # pins the stepping thread's torch threads (CPU only)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if quantization != "none" and not compact:
            raise ValueError(f"quantization {quantization} needs the compact decoder (model_impl auto)")
        self.decoder = build_decoder(model, max_model_len, attn_backend.uses_cpu_ops, quantization) if compact else None
        self.model = None if self.decoder is not None else model
        if self.model is not None:
            model.set_attn_implementation(ATTENTION_NAME)
        # The decoder's LM head (and its greedy head) let the sampler pick from hidden states; the transformers
        # model gives logits.
        head = (self.decoder.lm_head, self.decoder.greedy_head) if self.decoder is not None else (None, None)
        self.sampler = Sampler(*head, native_argmax=attn_backend.uses_cpu_ops)
        num_kv_heads, head_dim = kv_shape(model.config)
        shape = (num_blocks, self.block_size, num_kv_heads, head_dim)
        self.kv_caches = [(attn_backend.kv_pool(shape, self.dtype, self.device),
                           attn_backend.kv_pool(shape, self.dtype, self.device))
                          for _ in range(model.config.num_hidden_layers)]
        self.attn_builder = attn_backend.builder(self.kv_caches, block_size, self.device)
        self.max_model_len = max_model_len
        self.decode_graphs: DecodeGraphs | None = None

    def capture_decode_graphs(self, max_num_seqs: int, emulate: bool = False) -> None:
        """Pure-decode steps of up to ``min(max_num_seqs, 256)`` requests replay CUDA graphs from now on
        (:mod:`backend.cuda_graphs`; ``emulate``: the same buffers, run eagerly).

        Raises:
            ValueError: the step would not be capturable: a backend without graphs, or not the compact decoder.
        """
        if not self.attn_backend.graphs or self.decoder is None:
            raise ValueError("CUDA graphs need the triton attention backend and the compact decoder "
                             f"(this model runs {'the compact decoder' if self.decoder else 'transformers modules'} "
                             f"on the {self.attn_backend.name} backend)")
        self.decode_graphs = DecodeGraphs(self.decoder, self.attn_builder, max_num_seqs, self.max_model_len,
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
        requests = [scheduled[i].request for i in sample_rows]
        prompt_rows = prompt_logprobs.plan(scheduled, cu_seqlens[:-1].tolist())
        if (self.decode_graphs is not None and not prompt_rows and sched.num_decodes == len(scheduled)
                and self.decode_graphs.covers(counts)):
            logits = self.decode_graphs.run(torch.tensor(token_ids), positions, slot_mapping, seq_lens, block_tables)
            return self._sample(requests, logits=logits[sample_rows])
        meta = self.attn_builder.build(StepBatch(counts, starts, seq_lens, cu_seqlens, block_tables, slot_mapping,
                                                 sched.num_decodes))
        verifying = None
        if sched.num_draft_tokens:  # a speculative decode samples its last token's row and each draft's
            verifying = [scheduled[i] for i in sample_rows]
            requests, logits_rows = _verification_rows(verifying, cu_seqlens[1:][sample_rows].tolist())
        else:
            logits_rows = cu_seqlens[1:][sample_rows] - 1
        if prompt_rows:  # after the sampling rows: hidden[:num_sample] samples, the rest scores prompts
            logits_rows = torch.cat([logits_rows, torch.tensor([r for p in prompt_rows for r in p.rows])])
        num_sample = len(requests)  # rows that sample (with drafts: one per draft too)
        prompt_out = {}
        input_ids = torch.tensor(token_ids, device=self.device)
        positions, logits_rows = positions.to(self.device), logits_rows.to(self.device)
        if self.decoder is not None:
            hidden = self.decoder.final_hidden(input_ids, positions, meta, logits_rows)
            if prompt_rows:
                prompt_out = prompt_logprobs.compute(hidden[num_sample:], self.decoder.lm_head, prompt_rows)
            return self._sample(requests, hidden=hidden[:num_sample], prompt_out=prompt_out, verifying=verifying)
        logits = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                            logits_to_keep=logits_rows, attention_metadata=meta).logits[0]
        if prompt_rows:
            prompt_out = prompt_logprobs.compute(logits[num_sample:], lambda x: x, prompt_rows)
        return self._sample(requests, logits=logits[:num_sample], prompt_out=prompt_out, verifying=verifying)

    def _sample(self, requests, logits: torch.Tensor | None = None, hidden: torch.Tensor | None = None,
                prompt_out: dict | None = None, verifying: list[ScheduledRequest] | None = None) -> ModelRunnerOutput:
        """``logits`` ``[len(requests), vocab_size]`` or the decoder's final ``hidden`` ``[len(requests),
        hidden_size]``, row j for ``requests[j]``: the sampler turns either into tokens.

        Args:
            verifying: with drafts in the step, the scheduled requests that sample, in order; ``requests`` then
                repeats each once per row it samples (1 + its drafts).
        """
        if not requests:
            return ModelRunnerOutput({}, {}, prompt_out or {})
        out = self.sampler(logits, requests) if hidden is None else self.sampler.from_hidden(hidden, requests)
        if verifying is not None:
            return _verify(verifying, out.token_ids, out.logprobs, prompt_out or {})
        sampled = {r.request_id: t for r, t in zip(requests, out.token_ids)}
        logprobs = {r.request_id: lp for r, lp in zip(requests, out.logprobs) if lp is not None}
        return ModelRunnerOutput(sampled, logprobs, prompt_out or {})


def _verification_rows(verifying: list[ScheduledRequest], row_ends: list[int]) -> tuple[list, torch.Tensor]:
    """The rows a step with drafts samples: the last row of each sampling chunk, and for a speculative decode
    its last ``1 + drafts`` rows (its last token's and each draft's); and the request of each row.

    Args:
        row_ends: packed row after each of ``verifying``'s chunks.

    Returns:
        (the request of each sampled row, the rows ``[num_rows]``).
    """
    requests, rows = [], []
    for s, end in zip(verifying, row_ends):
        n = 1 + len(s.draft_token_ids)
        requests += [s.request] * n
        rows.extend(range(end - n, end))
    return requests, torch.tensor(rows)


def _verify(verifying: list[ScheduledRequest], token_ids: list[int], logprobs: list, prompt_out: dict,
            ) -> ModelRunnerOutput:
    """Groups the sampled rows back by request: a plain request's token, a speculative decode's verified run."""
    sampled, verified, token_logprobs = {}, {}, {}
    row = 0
    for s in verifying:
        request_id, drafts = s.request_id, s.draft_token_ids
        if drafts:
            verified[request_id] = accept_greedy(drafts, token_ids[row:row + 1 + len(drafts)])
        else:
            sampled[request_id] = token_ids[row]
            if logprobs[row] is not None:
                token_logprobs[request_id] = logprobs[row]
        row += 1 + len(drafts)
    return ModelRunnerOutput(sampled, token_logprobs, prompt_out, verified)
