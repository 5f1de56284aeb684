"""Prompt logprobs: each prompt token's log-probability from the prefill's own forward pass, equal to
transformers' log-softmax over the same tokens, however the prompt is chunked, cached or preempted."""

from __future__ import annotations

import pytest
import torch

from backend import SamplingParams
from conftest import run_to_completion


@pytest.fixture(scope="module")
def reference_logprobs(tiny_reference):
    """Prompt ids -> ``[len - 1, vocab]`` fp32 log-softmax of transformers' logits (row j scores token j + 1)."""
    @torch.inference_mode()
    def score(ids: list[int]) -> torch.Tensor:
        logits = tiny_reference.model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)[:-1]
    return score


def _prompt_logprobs(engine, prompt, request_id="r", **params):
    sink = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, **params), request_id=request_id)
    outs = run_to_completion(engine, {request_id: sink})[request_id]
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    if "prompt_logprobs" not in params:
        assert not carrying
        return None
    assert len(carrying) == 1 and carrying[0] is outs[0], "prompt logprobs ride on the first delta only"
    return carrying[0].prompt_logprobs


def _check(got, ids, reference, top_n):
    assert len(got) == len(ids) and got[0] is None
    for j, entry in enumerate(got[1:], start=1):
        row = reference[j - 1]
        assert entry.token_id == ids[j]
        assert abs(entry.logprob - float(row[ids[j]])) < 1e-3, f"token {j}"
        # Rank and top-N within the two computations' rounding (1e-3): near ties may order either way.
        assert int((row > entry.logprob + 1e-3).sum()) + 1 <= entry.rank <= int((row > entry.logprob - 1e-3).sum()) + 1
        assert len(entry.top) == top_n
        want_top = row.topk(top_n).values.tolist() if top_n else []
        assert all(abs(a - b) < 1e-3 for a, b in zip(sorted(entry.top.values(), reverse=True), want_top))
        assert all(abs(lp - float(row[t])) < 1e-3 for t, lp in entry.top.items())


@pytest.mark.parametrize("chunk", [2048, 7])
def test_prompt_logprobs_equal_transformers_log_softmax(make_engine, tiny_model_dir, reference_logprobs, chunk):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=chunk)
    ids = list(range(100, 140))
    got = _prompt_logprobs(engine, ids, prompt_logprobs=3)
    _check(got, ids, reference_logprobs(ids), 3)


def test_prefix_cache_hits_do_not_lose_prompt_logprobs(make_engine, tiny_model_dir, reference_logprobs):
    engine = make_engine(tiny_model_dir, block_size=16, enable_prefix_caching=True)
    ids = list(range(200, 250))
    _prompt_logprobs(engine, ids, request_id="warm")  # caches the prompt's full blocks
    got = _prompt_logprobs(engine, ids, request_id="scored", prompt_logprobs=0)
    _check(got, ids, reference_logprobs(ids), 0)
    # A plain request still hits the cache the scored one filled.
    sink = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0.0), request_id="plain")
    assert run_to_completion(engine, {"plain": sink})["plain"][-1].num_cached_tokens == 48


def test_n_completions_get_one_copy_of_the_prompt_logprobs(make_engine, tiny_model_dir, reference_logprobs):
    engine = make_engine(tiny_model_dir)
    ids = list(range(300, 320))
    sink = engine.add_request(ids, SamplingParams(n=3, max_tokens=2, temperature=1.0, seed=1, prompt_logprobs=1),
                              request_id="n3")
    outs = run_to_completion(engine, {"n3": sink})["n3"]
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert [o.index for o in carrying] == [0]
    _check(carrying[0].prompt_logprobs, ids, reference_logprobs(ids), 1)


def test_one_token_prompt_has_only_the_empty_first_entry(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    assert _prompt_logprobs(engine, [42], prompt_logprobs=2) == [None]


def test_prompt_logprobs_out_of_range_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
