"""The sampler at the edges: tiny temperatures, extreme penalties, banned words."""

from __future__ import annotations

import pytest
import torch

from backend import Request, SamplingParams
from backend.bad_words import banned_next_tokens
from backend.sampler import Sampler, _top_k_top_p

VOCAB = 64


def request(prompt: list[int], output: list[int] = (), **params) -> Request:
    r = Request("r", prompt, SamplingParams(**params), eos_token_ids=(0,), max_tokens=100)
    r.token_ids.extend(output)
    return r


def logits_for(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 5


@pytest.mark.parametrize("temperature", [1e-6, 1e-38, 1e-45])
def test_tiny_positive_temperature_is_greedy(temperature):
    logits = logits_for(4)
    requests = [request([1, 2, 3], temperature=temperature, seed=i) for i in range(4)]
    assert requests[0].params.greedy
    assert Sampler()(logits.clone(), requests).token_ids == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("top_p", [1e-300, 1e-46, 5e-46, 1e-45, 1e-9])
def test_a_top_p_under_fp32s_smallest_keeps_the_most_likely_token(top_p):
    """top_p of 1e-300 is valid (in (0, 1]) and 0 in the sampler's fp32: the most likely token still stays (it
    dropped every token once, and the draw then picked id VOCAB, which the next forward pass could not embed,
    failing every request in that step); its batch mate samples as usual."""
    logits = logits_for(2, seed=5)
    requests = [request([1, 2], temperature=1.0, top_p=top_p, seed=1), request([1, 2], temperature=1.0, seed=2)]
    picks = [Sampler()(logits.clone(), requests).token_ids for _ in range(20)]
    assert {p[0] for p in picks} == {int(logits[0].argmax())}
    assert all(0 <= p[1] < VOCAB for p in picks) and len({p[1] for p in picks}) > 1


@pytest.mark.parametrize("penalty", [1e-45, 1e-30, 3e38])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_extreme_penalties_keep_logits_finite(penalty, temperature):
    logits = logits_for(1, seed=1)
    seen = [3, 9, 17]
    r = request(seen, [5], repetition_penalty=penalty, presence_penalty=2.0, frequency_penalty=-2.0,
                temperature=temperature, seed=3)
    penalized = Sampler._apply_penalties(logits.clone(), [r])
    assert torch.isfinite(penalized).all()
    token = Sampler()(logits.clone(), [r]).token_ids[0]
    assert 0 <= token < VOCAB
    if penalty < 1 and temperature == 0.0:  # positive logits of seen tokens blown up: a seen token wins
        assert token in [*seen, 5] or logits[0, [*seen, 5]].max() < 0


def test_sampling_after_temperature_has_no_nan():
    logits = torch.full((1, VOCAB), 1e30)
    logits[0, 7] = 3e38
    r = request([1], temperature=1e-5, seed=0)
    for _ in range(5):
        assert Sampler()(logits.clone(), [r]).token_ids == [7]


def test_banned_next_tokens_match_the_tail():
    sequences = [[5], [7, 8, 9], [2, 4]]
    assert banned_next_tokens([1, 2, 3], sequences) == [5]
    assert banned_next_tokens([1, 7, 8], sequences) == [5, 9]
    assert banned_next_tokens([8], sequences) == [5]
    assert banned_next_tokens([2], sequences) == [5, 4]


def test_bad_words_mask_the_token_that_would_complete_them():
    logits = logits_for(1, seed=2)
    best = int(logits.argmax())
    r = request([1, 2], [6], temperature=0.0)
    r.bad_words_token_ids = [[6, best]]  # "6 best" is banned: after 6, best may not follow
    assert Sampler()(logits.clone(), [r]).token_ids[0] != best
    r.bad_words_token_ids = [[3, best]]  # the tail is 6, not 3: nothing banned
    assert Sampler()(logits.clone(), [r]).token_ids[0] == best


@pytest.mark.parametrize("penalty", [dict(frequency_penalty=0.3), dict(presence_penalty=0.6),
                                     dict(repetition_penalty=1.5)])
def test_penalties_move_the_greedy_choice(penalty):
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 2] = 3.0, 2.5
    request = Request("r", [1, 1], SamplingParams(temperature=0.0, **penalty), (), max_tokens=5)
    request.token_ids += [5, 5]  # two outputs of token 5: frequency 0.6, presence 0.6, repetition 3 / 1.5 = 2
    assert Sampler()(logits.clone(), [request]).token_ids == [2]
    plain = Request("p", [1, 1], SamplingParams(temperature=0.0), (), max_tokens=5)
    plain.token_ids += [5, 5]
    assert Sampler()(logits.clone(), [plain]).token_ids == [5]


def test_top_k_top_p_min_p_restrict_the_draw():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    cases = [(dict(top_k=1), {0}), (dict(top_p=0.7), {0, 1}), (dict(top_p=0.85), {0, 1, 2}),
             (dict(min_p=0.5), {0, 1}), (dict(), {0, 1, 2, 3})]
    for settings, allowed in cases:
        seen = set()
        for seed in range(200):
            request = Request("r", [1], SamplingParams(seed=seed, **settings), (), max_tokens=5)
            seen.add(Sampler()(logits.clone(), [request]).token_ids[0])
        assert seen == allowed, settings


def test_greedy_batches_pick_through_the_cpu_kernel_exactly_as_torch_argmax():
    """A batch of plain greedy requests takes kernels/cpu's argmax on the bf16 logits (no fp32 copy); a request
    with a penalty sends the whole batch through the general path. Both give torch's argmax of the fp32 logits."""
    from backend import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ compiler for kernels/cpu")
    torch.manual_seed(0)
    logits = torch.randn(6, 300).to(torch.bfloat16)
    plain = [Request(str(i), [1, 2, 3], SamplingParams(temperature=0.0), (), max_tokens=5) for i in range(6)]
    want = logits.float().argmax(-1).tolist()
    assert Sampler(native_argmax=True)(logits, plain).token_ids == want
    penalized = plain[:5] + [Request("p", [1, 2, 3], SamplingParams(temperature=0.0, presence_penalty=0.5), (),
                                     max_tokens=5)]
    assert Sampler(native_argmax=True)(logits, penalized).token_ids[:5] == want[:5]


def test_draws_follow_the_distribution_and_never_pick_a_zero():
    """Inverse transform sampling: over 4,000 seeded draws each token's share is within 4 standard deviations of
    its probability, and a token of probability 0 (masked, or at either end of the vocabulary) is never drawn."""
    probs = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    draws = 4000
    requests = [Request(f"r{i}", [1], SamplingParams(seed=i), (), max_tokens=5) for i in range(draws)]
    logits = torch.log(probs).expand(draws, -1).clone()
    counts = torch.bincount(torch.tensor(Sampler()(logits, requests).token_ids), minlength=len(probs))
    assert counts[probs == 0].sum() == 0
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert bool(((counts / draws - probs).abs() <= 4 * sigma + 1e-9).all()), counts.tolist()


def test_unseeded_draws_in_one_batch_differ_and_follow_the_distribution():
    probs = torch.tensor([0.25, 0.25, 0.5])
    draws = 4000
    requests = [Request(f"r{i}", [1], SamplingParams(temperature=1.0), (), max_tokens=5) for i in range(draws)]
    counts = torch.bincount(torch.tensor(Sampler()(torch.log(probs).expand(draws, -1).clone(), requests).token_ids),
                            minlength=3)
    sigma = (probs * (1 - probs) / draws).sqrt()
    assert bool(((counts / draws - probs).abs() <= 4 * sigma).all()), counts.tolist()


def test_a_batch_mates_top_k_or_top_p_moves_no_other_rows_draw():
    """Top-k/top-p runs on the whole batch once a row asks; a row that does not (top_k -1, top_p 1) must come out
    as it went in. fp32's running sum of a large vocabulary's probabilities reaches 1.0 before its tail: read as
    top_p 1, it dropped tens of thousands of tail tokens, and a seeded draw changed with its batch mates."""
    vocab = 49152
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0)) * 6
    masked = _top_k_top_p(logits.clone(), [-1], [1.0])
    assert torch.equal(masked, logits)

    def seeded(**params):
        return Request("r", [1, 2, 3], SamplingParams(temperature=1.0, **params), eos_token_ids=(0,), max_tokens=16)

    for seed in range(10):
        alone = Sampler()(logits.clone(), [seeded(seed=seed)]).token_ids[0]
        beside = Sampler()(torch.cat([logits, logits]), [seeded(seed=seed), seeded(top_k=5, top_p=0.5)]).token_ids
        assert beside[0] == alone, seed
        assert beside[1] in logits[0].topk(5).indices.tolist()
