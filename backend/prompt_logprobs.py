"""Prompt logprobs (vLLM's ``prompt_logprobs``): each prompt token's log-probability given the tokens before it,
taken from the prefill's own forward pass.

The hidden state at position p predicts token p + 1, so a prefill chunk covering positions [s, s + n) of a
prompt of P tokens yields the logprobs of prompt tokens s + 1 .. min(s + n, P - 1); position P - 1 predicts the
first output token and is the ordinary sampling row. The model runner asks the decoder for these rows besides
the sampling rows (:func:`plan`), and turns their hidden states into :class:`~backend.sampler.TokenLogprobs`
(:func:`compute`) a slice of rows at a time, so a 2,048-token chunk never holds a ``[2048, vocab]`` fp32 copy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.sampler import TokenLogprobs

ROWS_PER_SLICE = 256  # rows through the LM head and log-softmax at once (~50 MB of fp32 logits at vocab 49152)


@dataclass
class PromptRows:
    """The rows of one request's chunk whose logits score its prompt.

    Attributes:
        request_id: the engine request.
        first_token: index in the prompt of the token the first row scores (>= 1).
        rows: packed row indices of the step, ``[k]``.
        targets: the prompt tokens those rows score, ``[k]``.
        top_n: alternatives wanted per row.
    """

    request_id: str
    first_token: int
    rows: list[int]
    targets: list[int]
    top_n: int


def plan(scheduled, row_starts: list[int]) -> list[PromptRows]:
    """The prompt-scoring rows of this step.

    Args:
        scheduled: the step's :class:`~backend.scheduler_output.ScheduledRequest` list.
        row_starts: packed row of each scheduled request's first token.
    """
    out = []
    for s, row in zip(scheduled, row_starts):
        request = s.request
        if not request.wants_prompt_logprobs:
            continue
        start, end = s.num_computed_tokens, min(s.seq_len, request.num_prompt_tokens - 1)
        if start >= end:
            continue
        out.append(PromptRows(request.request_id, start + 1, list(range(row, row + end - start)),
                              request.token_ids[start + 1:end + 1], request.params.prompt_logprobs))
    return out


def compute(hidden: torch.Tensor, lm_head, prompt_rows: list[PromptRows]) -> dict[str, tuple[int, list[TokenLogprobs]]]:
    """Log-probabilities of the planned prompt tokens.

    Args:
        hidden: ``[sum of len(p.rows), hidden_size]``, the final norm's output for the planned rows, in plan order.
        lm_head: hidden ``[k, hidden_size]`` -> logits ``[k, vocab_size]``.

    Returns:
        request id -> (index of the first prompt token scored, one :class:`TokenLogprobs` per scored token:
        its logprob under the model's raw distribution, its rank (1 = most likely) and the ``top_n`` best).
    """
    targets = torch.tensor([t for p in prompt_rows for t in p.targets], dtype=torch.long)
    top_n = max(p.top_n for p in prompt_rows)
    logprobs, ranks, top_values, top_ids = [], [], [], []
    for begin in range(0, hidden.shape[0], ROWS_PER_SLICE):
        rows = torch.log_softmax(lm_head(hidden[begin:begin + ROWS_PER_SLICE]).float(), dim=-1)
        chosen = rows.gather(1, targets[begin:begin + ROWS_PER_SLICE, None].to(rows.device))
        logprobs.append(chosen[:, 0].cpu())
        ranks.append((rows > chosen).sum(dim=-1).cpu() + 1)
        if top_n:
            values, ids = rows.topk(top_n, dim=-1)
            top_values.append(values.cpu())
            top_ids.append(ids.cpu())
    lp, rk = torch.cat(logprobs).tolist(), torch.cat(ranks).tolist()
    tv = torch.cat(top_values).tolist() if top_n else None
    ti = torch.cat(top_ids).tolist() if top_n else None
    out: dict[str, tuple[int, list[TokenLogprobs]]] = {}
    i = 0
    for p in prompt_rows:
        entries = []
        for target in p.targets:
            top = dict(zip(ti[i][:p.top_n], tv[i][:p.top_n])) if p.top_n else {}
            entries.append(TokenLogprobs(target, lp[i], top, rk[i]))
            i += 1
        out[p.request_id] = (p.first_token, entries)
    return out
