"""Merging a completion's queued deltas into one (``backend.outputs.coalesce``), as the Triton model's sender
does when the engine runs ahead of it."""

from __future__ import annotations

from backend.outputs import RequestOutput, coalesce
from backend.sampler import TokenLogprobs


def delta(rid: str, tokens: list[int], index: int = 0, **fields) -> RequestOutput:
    return RequestOutput(rid, tokens, "".join(f"<{t}>" for t in tokens), index=index, **fields)


def test_each_completions_deltas_merge_in_order_and_the_done_delta_stays_last():
    deltas = [delta("a", [1]), delta("b", [7], num_output_tokens=1), delta("a", [2], index=1),
              delta("a", [3], finish_reason="length", num_output_tokens=2),
              delta("b", [8], num_output_tokens=2),
              delta("a", [4], index=1, finish_reason="length", done=True)]
    merged = coalesce(deltas)
    assert [(o.request_id, o.index, o.token_ids, o.text) for o in merged] == [
        ("a", 0, [1, 3], "<1><3>"), ("b", 0, [7, 8], "<7><8>"), ("a", 1, [2, 4], "<2><4>")]
    assert merged[0].finish_reason == "length" and merged[0].num_output_tokens == 2
    assert merged[1].num_output_tokens == 2 and merged[1].finish_reason is None
    assert merged[-1].done and not merged[0].done
    assert deltas[0].token_ids == [1]  # the inputs are left as they were


def test_an_error_is_never_merged_into_and_logprobs_concatenate():
    lp = [TokenLogprobs(5, -0.5, {}), TokenLogprobs(6, -1.5, {})]
    deltas = [delta("a", [5], logprobs=lp[:1]), delta("a", [6], logprobs=lp[1:]),
              delta("a", [], finish_reason="error", error="boom", done=True)]
    merged = coalesce(deltas)
    assert [(o.token_ids, o.finish_reason) for o in merged] == [([5, 6], None), ([], "error")]
    assert merged[0].logprobs == lp and merged[1].error == "boom" and merged[1].done
    assert coalesce([delta("x", [1]), delta("x", [2])])[0].logprobs is None


def test_fan_in_gathers_interleaved_completions_in_index_order():
    """``backend.fan_in``: the rule both the Triton model and the OpenAI frontend answer ``n`` > 1 by."""
    from backend.fan_in import FanIn

    lp = [TokenLogprobs(t, -t / 10, {}) for t in (5, 6, 7)]
    deltas = [delta("a", [5], index=2, logprobs=lp[:1], num_output_tokens=1),
              delta("a", [1], index=0, num_output_tokens=1, prompt_logprobs=[None]),
              delta("a", [6], index=2, logprobs=lp[1:2], finish_reason="stop", num_output_tokens=2),
              delta("a", [2, 3], index=0, finish_reason="length", num_output_tokens=3),
              delta("a", [7], index=1, logprobs=lp[2:], finish_reason="length", num_output_tokens=1, done=True)]
    fan_in = FanIn()
    gathered = [fan_in.add(d) for d in deltas]
    assert gathered[0] is gathered[2] and gathered[1] is gathered[3]
    completions = fan_in.in_order()
    assert [(c.index, c.token_ids, c.joined_text, c.finish_reason, c.num_output_tokens) for c in completions] == [
        (0, [1, 2, 3], "<1><2><3>", "length", 3), (1, [7], "<7>", "length", 1), (2, [5, 6], "<5><6>", "stop", 2)]
    assert completions[2].logprobs == lp[:2] and completions[0].prompt_logprobs == [None]
    assert completions[1].last is deltas[-1] and all(c.finished for c in completions)
    keyed = FanIn()
    keyed.add(delta("a", [9], index=0), index=4)  # the frontend's key: prompt index * n + completion index
    assert [c.index for c in keyed.in_order()] == [4]
