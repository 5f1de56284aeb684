"""kernels.cpu.greedy_head (through backend.models.greedy_head.GreedyHead): greedy picks from an fp32 LM head via a
bounded bf16 pass equal the argmax of the fp32 logits small_gemm computes, ties and near ties included."""

from __future__ import annotations

import pytest
import torch

import kernels.cpu
from backend import SamplingParams
from conftest import GREEDY, run_to_completion

pytestmark = pytest.mark.skipif(kernels.cpu.load() is None or not kernels.cpu.greedy_head_available(),
                                reason="greedy_head needs the C++ kernels and AVX512-BF16")


def _reference(x: torch.Tensor, weight: torch.Tensor) -> list[int]:
    return kernels.cpu.argmax(kernels.cpu.small_gemm(x, kernels.cpu.small_gemm_pack(weight))).tolist()


def _head(weight: torch.Tensor):
    from backend.models.greedy_head import GreedyHead

    head = GreedyHead(weight)
    packed = kernels.cpu.small_gemm_pack(weight)
    return head, lambda h: kernels.cpu.small_gemm(h, packed)


@pytest.mark.parametrize("vocab,hidden", [(4096, 64), (49152, 576)])
@pytest.mark.parametrize("rows", [1, 7, 40, 256])
def test_picks_equal_the_argmax_of_the_fp32_logits(vocab, hidden, rows):
    gen = torch.Generator().manual_seed(rows + vocab)
    weight = torch.randn(vocab, hidden, generator=gen) * 0.05
    x = torch.randn(rows, hidden, generator=gen) * 3
    head, lm_head = _head(weight)
    assert head(x, lm_head) == _reference(x, weight)
    # every row's pick came from at least one exact fp32 logit, and the bound left only a few in doubt
    assert rows <= head.num_exact <= 16 * rows


def test_exact_ties_go_to_the_first_index_and_one_ulp_apart_is_resolved_exactly():
    gen = torch.Generator().manual_seed(1)
    hidden = 64
    weight = torch.randn(1024, hidden, generator=gen) * 0.05
    top = torch.randn(hidden, generator=gen)
    weight[100] = top  # the best direction, copied exactly: equal logits
    weight[900] = top
    weight[500] = top.clone()
    weight[500, 7] = torch.nextafter(top[7], torch.tensor(float("inf")))  # one ulp apart in one weight
    weight[300] = top.clone()
    weight[300, 3] = torch.nextafter(top[3], torch.tensor(float("-inf")))
    x = top.repeat(64, 1) + torch.randn(64, hidden, generator=gen) * 1e-3  # near `top`: the four lead, close
    x[::2, 7] *= -1  # flip which way the one-ulp differences go
    x[1::4, 3] *= -1
    head, lm_head = _head(weight)
    picks = head(x, lm_head)
    assert picks == _reference(x, weight)
    assert set(picks) <= {100, 300, 500, 900} and len(set(picks)) > 1
    assert 900 not in picks  # a tie with 100 always goes to the first index


def test_values_below_bf16s_normal_range_are_bounded_too():
    """Weights and hidden values that round to bf16 denormals (or vanish in bf16) next to large ones."""
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2048, 64, generator=gen) * 0.05
    weight[:, :8] = torch.randn(2048, 8, generator=gen) * 1e-39  # bf16 denormals
    x = torch.randn(32, 64, generator=gen)
    x[:, :8] = 1e25 * torch.randn(32, 8, generator=gen)  # against the denormal weights: ~1e-14 each
    x[:16, 8:] *= 1e-39  # denormal hidden values: the logits are the denormal weights' alone
    x[16:24, 8:] = 0
    head, lm_head = _head(weight)
    picks, exact = kernels.cpu.greedy_head(x, head.packed, head.norms, head.error_norms, head.weight)
    assert (picks >= 0).all()  # bounded, not sent to the full logits
    assert picks.tolist() == _reference(x, weight)


def test_rows_that_are_not_finite_take_the_full_logits():
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(2048, 64, generator=gen) * 0.05
    x = torch.randn(6, 64, generator=gen)
    x[1, 5] = float("nan")
    x[3, 0] = float("inf")
    x[4] = 1e38  # finite, but its logits could overflow the bound
    head, lm_head = _head(weight)
    picks, _ = kernels.cpu.greedy_head(x, head.packed, head.norms, head.error_norms, head.weight)
    assert picks.tolist()[1] == -1 and picks.tolist()[3] == -1 and picks.tolist()[4] == -1
    assert head(x, lm_head) == _reference(x, weight)


def test_a_huge_row_against_a_tiny_head_takes_the_full_logits():
    """|x| past fp32's range with weights small enough that |x| max|W_i| looks harmless: bf16(x) and |x'| overflow,
    inf * 0 makes NaN bounds, and without a guard the token with the largest logit would be dropped."""
    weight = torch.zeros(16, 32)
    weight[1, 0] = -1e-10
    weight[3, 0], weight[3, 1] = 1e-39, 2e-9
    x = torch.zeros(2, 32)
    x[0, 0] = x[0, 1] = 3e38
    x[1, 0], x[1, 1] = 3.4e38, 1e10
    head, lm_head = _head(weight)
    picks, _ = kernels.cpu.greedy_head(x, head.packed, head.norms, head.error_norms, head.weight)
    assert picks.tolist() == [-1, -1]
    assert head(x, lm_head) == _reference(x, weight)


def test_the_engine_takes_the_head_for_plain_greedy_rows_only(make_engine, tiny_model_dir, tiny_reference):
    """Plain greedy requests go through the head (and match transformers' generate); a greedy request that wants
    logprobs gets the full logits, and the same tokens."""
    engine = make_engine(tiny_model_dir)
    head = engine.engine_core.model_runner.decoder.greedy_head
    assert head is not None
    prompt = [5, 17, 301, 42, 9]
    want, _ = tiny_reference.greedy(prompt, 12)
    sink = engine.add_request(prompt, SamplingParams(max_tokens=12, **GREEDY), request_id="plain")
    got = [t for out in run_to_completion(engine, {"plain": sink})["plain"] for t in out.token_ids]
    assert got == want
    used = head.num_exact
    assert used >= 12
    sink = engine.add_request(prompt, SamplingParams(max_tokens=12, logprobs=1, **GREEDY), request_id="logprobs")
    outs = run_to_completion(engine, {"logprobs": sink})["logprobs"]
    assert [t for out in outs for t in out.token_ids] == want
    assert head.num_exact == used
