"""Greedy picks from an fp32 LM head at about bf16 cost, the same tokens as the fp32 logits would give.

A decode step of a small fp32 model spends a fifth of its multiply-adds in the LM head (SmolLM2-135M: 28 of
135 M weights). For a request that only wants the argmax (greedy, no logprobs, nothing that changes the logits:
the sampler's ``plain_greedy``), ``greedy_head`` of ``kernels/cpu`` runs the head in bf16 with a proven bound on each
logit's error and computes the exact fp32 logit only for the few tokens the bound cannot rule out (derivation in
``kernels/cpu/greedy_head.cpp``). The picks are those of ``argmax`` over the fp32 logits ``small_gemm`` computes,
bit for bit, ties to the first index.
"""

from __future__ import annotations

import torch

from backend import cpu_ops


class GreedyHead:
    """The bf16 copy of an fp32 LM head and the per-token norms the bound needs.

    Args:
        weight: ``[vocab, hidden]`` fp32, the LM head's weight (kept by reference: for tied embeddings it is the
            embedding table, so only the bf16 copy, half its size, is new memory).
        max_rows: the most rows it takes: those of the LM head's ``small_gemm`` (more rows go to oneDNN, which
            sums the logits in another order, so the picks could differ); None: any number.

    Raises:
        ValueError: ``weight`` is not fp32 ``[V, K]`` with ``V % 16 == 0`` and ``K % 32 == 0`` (``small_gemm``'s
            bf16 layout).
    """

    def __init__(self, weight: torch.Tensor, max_rows: int | None = None) -> None:
        if (weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 32
                or not weight.numel()):
            raise ValueError(f"GreedyHead needs an fp32 [V % 16 == 0, K % 32 == 0] weight, not empty, got "
                             f"{weight.dtype} {list(weight.shape)}")
        self.weight = weight.detach().contiguous()
        rounded = self.weight.bfloat16()
        rounded[rounded.abs() < torch.finfo(torch.bfloat16).tiny] = 0  # denormals as zero (see greedy_head.cpp)
        self.packed = cpu_ops.small_gemm_pack(rounded)
        norms, error_norms = [], []
        for start in range(0, weight.shape[0], 4096):  # in float64, a slice at a time (not a 4x copy of the head)
            exact, near = self.weight[start:start + 4096].double(), rounded[start:start + 4096].double()
            norms.append(near.norm(dim=1))  # |bf16(W_i)|
            error_norms.append((exact - near).norm(dim=1))  # |W_i - bf16(W_i)|
        self.norms, self.error_norms = _round_up(torch.cat(norms)), _round_up(torch.cat(error_norms))
        self.num_exact = 0  # exact fp32 logits computed so far (a handful per row)
        self.max_rows = max_rows

    def covers(self, rows: int) -> bool:
        """Whether a batch of ``rows`` hidden states goes through this head."""
        return 0 < rows and (self.max_rows is None or rows <= self.max_rows)

    def __call__(self, hidden: torch.Tensor, lm_head) -> list[int]:
        """``hidden``: ``[rows, K]`` fp32 final hidden states -> each row's greedy token id. Rows the kernel cannot
        bound (not finite) are picked from their full logits, ``lm_head(hidden[rows])``."""
        picks, exact = cpu_ops.greedy_head(hidden, self.packed, self.norms, self.error_norms, self.weight)
        self.num_exact += exact
        unbounded = (picks < 0).nonzero().flatten()
        if unbounded.numel():
            picks[unbounded] = cpu_ops.argmax(lm_head(hidden.index_select(0, unbounded)))
        return picks.tolist()


def _round_up(values: torch.Tensor) -> torch.Tensor:
    """float64 -> the smallest float32 at or above each value."""
    rounded = values.float()
    return torch.where(rounded.double() < values, torch.nextafter(rounded, torch.tensor(float("inf"))), rounded)
