"""The model's ``logprobs`` output in the form of Triton's vLLM backend: per completion a JSON string, a list
with one object per new token mapping token id (a string key) to ``{"logprob", "rank", "decoded_token"}``
for the sampled token and its top-N alternatives (vLLM's ``Logprob``; vllm_backend ``src/utils/request.py``)."""

from __future__ import annotations

import json

from backend.sampler import TokenLogprobs


def vllm_logprobs(logprobs: list[TokenLogprobs | None], decode) -> str:
    """JSON text of ``logprobs`` (natural logs of the model's raw distribution); a None entry (the first prompt
    token of prompt logprobs) is ``null``.

    Args:
        decode: token id -> its text (``lambda i: tokenizer.decode([i])``).
    """
    steps = []
    for step in logprobs:
        if step is None:
            steps.append(None)
            continue
        entries = {str(token_id): {"logprob": logprob, "rank": rank, "decoded_token": decode(token_id)}
                   for rank, (token_id, logprob) in enumerate(step.top.items(), start=1)}
        entries[str(step.token_id)] = {"logprob": step.logprob, "rank": step.rank,
                                       "decoded_token": decode(step.token_id)}
        steps.append(entries)
    return json.dumps(steps)
