"""What one layer's attention asks for, read from the keywords transformers passes to an attention function.

transformers 5.x calls every function registered with ``AttentionInterface`` as
``fn(module, query, key, value, attention_mask, dropout=..., scaling=..., **family_kwargs, **forward_kwargs)``.
Families add per-layer keywords: ``sliding_window`` (Mistral, Qwen2, Gemma 2/3, StarCoder2, GPT-OSS; None on
global layers), ``softcap`` (Gemma 2's attention-logit soft-capping), ``s_aux`` (GPT-OSS's attention sinks);
the caller's forward keywords (``position_ids``, ``use_cache``, our ``attention_metadata``) pass through.

Every keyword is honoured or refused: :func:`attention_options` raises :class:`UnsupportedAttentionError` for a
keyword this engine does not implement when its value would change the result (anything but None, False or 0),
so a family that needs something new fails loudly instead of producing different text.

Sliding-window semantics are transformers' own (``masking_utils.sliding_window_overlay``): a query at position
``p`` with window ``W`` sees keys at positions ``p - W + 1 .. p``, i.e. ``W`` keys including itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HANDLED = frozenset({"sliding_window", "softcap", "s_aux", "scaling", "dropout", "is_causal"})
"""Keywords with attention semantics that :class:`AttentionOptions` carries (``dropout`` is 0 in inference)."""

PASS_THROUGH = frozenset({"attention_metadata", "position_ids", "cache_position", "use_cache", "output_attentions",
                          "output_router_logits", "output_hidden_states", "return_dict"})
"""Forward keywords transformers hands on to the attention function unchanged; they do not change attention."""


class UnsupportedAttentionError(ValueError):
    """A layer asks its attention function for something this engine does not do."""


@dataclass(frozen=True)
class AttentionOptions:
    """One layer's attention variant.

    Attributes:
        sliding_window: a query at position p sees keys p - W + 1 .. p (W keys, itself included); None = all.
        softcap: logits become ``softcap * tanh(logits / softcap)`` after scaling, before masking (Gemma 2,
            Team Gemma 2024, sec. 2); None = off.
        sinks: ``[num_heads]`` learned logits, one per query head, that join each softmax's denominator and
            attend to nothing (attention sinks, Xiao et al. ICLR 2024; GPT-OSS's ``s_aux``); None = off.
    """

    sliding_window: int | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None

    @property
    def is_plain(self) -> bool:
        """True when this is ordinary causal attention (the fast paths apply)."""
        return self.sliding_window is None and self.softcap is None and self.sinks is None

    def describe(self) -> str:
        parts = [f"sliding_window={self.sliding_window}" if self.sliding_window is not None else "",
                 f"softcap={self.softcap}" if self.softcap is not None else "",
                 "sinks" if self.sinks is not None else ""]
        return ", ".join(p for p in parts if p) or "full causal"


PLAIN = AttentionOptions()


def attention_options(module: torch.nn.Module, kwargs: dict) -> AttentionOptions:
    """The options of one attention call, after refusing anything this engine would silently ignore.

    Args:
        module: the calling attention module (its ``is_causal`` is checked).
        kwargs: the keywords the family passed besides query, key, value and mask.

    Returns:
        :data:`PLAIN` when nothing special is asked, else an :class:`AttentionOptions`.

    Raises:
        UnsupportedAttentionError: an unknown keyword with a value other than None, False or 0; dropout above
            0; a non-causal (bidirectional) layer; a non-positive window or soft-cap.
    """
    for name, value in kwargs.items():
        if name in HANDLED or name in PASS_THROUGH:
            continue
        if value is None or value is False or (isinstance(value, (int, float)) and value == 0):
            continue
        raise UnsupportedAttentionError(
            f"{type(module).__name__} passes attention keyword {name!r} ({_short(value)}), which this engine does "
            f"not implement; refusing rather than ignoring it")
    if kwargs.get("dropout"):
        raise UnsupportedAttentionError(f"attention dropout {kwargs['dropout']} (inference runs without dropout)")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise UnsupportedAttentionError(f"{type(module).__name__} attends bidirectionally (is_causal=False)")
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    if window is None and softcap is None and sinks is None:
        return PLAIN
    if window is not None and (not isinstance(window, int) or window <= 0):
        raise UnsupportedAttentionError(f"sliding_window must be a positive int, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise UnsupportedAttentionError(f"softcap must be positive, got {softcap!r}")
    return AttentionOptions(window, None if softcap is None else float(softcap), sinks)


def _short(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    text = repr(value)
    return text if len(text) < 60 else text[:57] + "..."


def allowed_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (and windowed) visibility: ``[..., q, k]`` bool, True where key k may be attended by query q.

    Args:
        query_positions: ``[..., q_len]`` int64; key_positions: ``[..., num_keys]`` int64 (broadcastable).
    """
    q, k = query_positions[..., :, None], key_positions[..., None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def eager_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
                    options: AttentionOptions) -> torch.Tensor:
    """Attention with soft-capping and sinks, written out (SDPA has neither), softmax in fp32 as transformers' eager.

    Args:
        q: ``[batch, num_heads, q_len, head_dim]``; keys, values: ``[batch, num_kv_heads, num_keys, head_dim]``.
        allowed: ``[batch, 1, q_len, num_keys]`` bool (see :func:`allowed_keys`).

    Returns:
        ``[batch, num_heads, q_len, head_dim]`` in ``q``'s dtype.
    """
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    qg = q.reshape(batch, num_kv_heads, group * q_len, head_dim)
    logits = torch.matmul(qg, keys.transpose(-1, -2)).float().view(batch, num_heads, q_len, -1) * scale
    if options.softcap is not None:
        logits = torch.tanh(logits / options.softcap) * options.softcap
    logits = logits.masked_fill(~allowed, float("-inf"))
    if options.sinks is not None:
        sinks = options.sinks.float().view(1, num_heads, 1, 1).expand(batch, num_heads, q_len, 1)
        probs = torch.cat([logits, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probs = logits.softmax(dim=-1)
    probs = probs.to(values.dtype).reshape(batch, num_kv_heads, group * q_len, -1)
    return torch.matmul(probs, values).view(batch, num_heads, q_len, head_dim)


def paged_variant_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta,
                            options: AttentionOptions, scale: float) -> torch.Tensor:
    """The torch path for a layer with a window, soft-cap or sinks: each request's blocks gathered, then SDPA
    under a windowed causal mask (window only) or :func:`eager_attention` (soft-cap or sinks).

    Used by the ``torch`` and ``cpu`` backends for such layers (the C++ kernels do plain causal attention only).

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, decodes first (the metadata of ``backend.attention.torch_sdpa``).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, this step's K/V written.
        meta: the step's ``TorchAttentionMetadata`` (decode block tables and lengths, prefill spans).

    Returns:
        ``[num_tokens, num_heads, head_dim]``.
    """
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    n = meta.num_decodes
    if n:
        seq_lens = meta.decode_seq_lens.to(torch.long)
        out[:n] = _attend(q[:n, :, None], key_cache, value_cache, meta.decode_block_tables, (seq_lens - 1)[:, None],
                          scale, options)[:, :, 0]
    for span in meta.prefills:
        q_len = span.q_end - span.q_start
        positions = torch.arange(span.seq_len - q_len, span.seq_len, device=q.device)[None]
        table = span.block_table[None, : -(-span.seq_len // key_cache.shape[1])]
        out[span.q_start:span.q_end] = _attend(q[None, span.q_start:span.q_end].transpose(1, 2), key_cache,
                                               value_cache, table, positions, scale, options)[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
            query_positions: torch.Tensor, scale: float, options: AttentionOptions) -> torch.Tensor:
    """``q`` ``[batch, num_heads, q_len, head_dim]`` at ``query_positions`` ``[batch, q_len]`` over the blocks of
    ``block_tables`` ``[batch, max_blocks]``; returns ``[batch, num_heads, q_len, head_dim]``."""
    batch, max_blocks = block_tables.shape
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    flat = block_tables.reshape(-1).to(torch.long)
    keys = key_cache.index_select(0, flat).view(batch, max_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)
    values = value_cache.index_select(0, flat).view(batch, max_blocks * block_size, num_kv_heads,
                                                    head_dim).transpose(1, 2)
    key_positions = torch.arange(max_blocks * block_size, device=q.device)
    allowed = allowed_keys(query_positions, key_positions, options.sliding_window)[:, None]  # [batch, 1, q, keys]
    if options.softcap is None and options.sinks is None:
        return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, scale=scale,
                                                                enable_gqa=True)
    return eager_attention(q, keys, values, allowed, scale, options)
