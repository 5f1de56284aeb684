"""The scheduler over the real KV cache manager and block pool, driven by a fake runner (no model): random
workloads checked after every step (``tests/core_sim.py`` lists the invariants), and targeted cases.

vLLM's ``tests/v1/core/test_scheduler.py`` is the model: fake requests, a fake model output, asserts on queues
and blocks; Hypothesis draws the workloads (arrivals, aborts, forks, priorities, pool and budget sizes).
"""

from __future__ import annotations

import pytest
from core_sim import EOS, CoreSim, expected_output, fake_token
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from backend.kv_cache_manager import KVCacheManager
from backend.request import Request, RequestStatus
from backend.sampling_params import SamplingParams

BASES = ([(7 * i + 3) % 63 + 1 for i in range(40)], [(11 * i + 5) % 63 + 1 for i in range(40)])  # shared prefixes


@st.composite
def request_specs(draw):
    base = BASES[draw(st.integers(0, 1))]
    prefix = base[:draw(st.integers(0, 24))]
    suffix = draw(st.lists(st.integers(1, 63), max_size=8))
    prompt = (prefix + suffix) or [1]
    n = draw(st.integers(1, 3))
    return dict(arrival=draw(st.integers(0, 12)), prompt=prompt, max_tokens=draw(st.integers(1, 10)), n=n,
                priority=draw(st.sampled_from([0, 0, 1, 2])),
                prompt_logprobs=draw(st.sampled_from([None, None, None, 0, 2])),
                cache_salt=draw(st.sampled_from([None, None, None, "a", "b"])) if n == 1 else None,
                abort_after=draw(st.none() | st.integers(0, 12)), greedy=draw(st.booleans()),
                fairness_key=draw(st.sampled_from([None, None, "k1", "k2"])))


@st.composite
def scenarios(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    window = draw(st.integers(1, 20)) if draw(st.integers(0, 2)) == 0 else None  # a third have a window
    budget = draw(st.integers(1, 40))
    specs = draw(st.lists(request_specs(), min_size=1, max_size=7))
    sizing = KVCacheManager(1, block_size, sliding_window=window)
    needed = max(sizing.max_blocks_per_request(len(s["prompt"]) + s["max_tokens"], budget) for s in specs)
    # Speculative decoding in half the scenarios (greedy requests only; drafts never past the budget).
    speculative = min(draw(st.sampled_from([0, 0, 1, 2, 4])), budget - 1)
    return dict(block_size=block_size, sliding_window=window, max_num_batched_tokens=budget,
                num_speculative_tokens=speculative, max_step_ms=draw(st.sampled_from([0, 0, 5, 20])),
                max_num_seqs=draw(st.integers(1, 6)), enable_prefix_caching=draw(st.booleans()),
                num_blocks=needed + draw(st.sampled_from([0, 0, 1, 2, 4, 8, 32])), specs=specs,
                failing_step=draw(st.sampled_from([None, None, None, None, 0, 1, 3, 6])))


def run_scenario(scenario: dict) -> CoreSim:
    """Adds each request at its arrival step, aborts it ``abort_after`` steps later, steps until all finish;
    then every completion's output must be its solo output (or a prefix of it, when aborted or failed).

    At ``failing_step`` the forward pass fails: as the engine does, every request of that step ends with
    ``FINISHED_ERROR`` and its blocks leave the prefix cache."""
    specs = scenario.pop("specs")
    failing_step = scenario.pop("failing_step")
    sim = CoreSim(**scenario)
    children: dict[int, list[Request]] = {}
    step = 0
    while True:
        for k, spec in enumerate(specs):
            if spec["arrival"] == step:
                children[k] = sim.add_prompt(f"r{k}", spec["prompt"], spec["max_tokens"], n=spec["n"],
                                             priority=spec["priority"], prompt_logprobs=spec["prompt_logprobs"],
                                             cache_salt=spec["cache_salt"], greedy=spec["greedy"],
                                             fairness_key=spec["fairness_key"])
                sim.check()
            if spec["abort_after"] is not None and spec["arrival"] + spec["abort_after"] == step:
                for child in children[k]:
                    sim.abort(child)  # a no-op on a finished completion
        if step > max(s["arrival"] for s in specs) and not (sim.scheduler.running or sim.scheduler.waiting):
            break
        if (sim.scheduler.running or sim.scheduler.waiting) and step == failing_step:
            sim.fail_step()
        elif sim.scheduler.running or sim.scheduler.waiting:
            assert not sim.step().is_empty, "work left but nothing scheduled"
        step += 1
        assert step < 2000, "requests left unfinished"
    sim.check_drained()
    for k, spec in enumerate(specs):
        for child in children[k]:
            want, status = expected_output(spec["prompt"], spec["max_tokens"], child.index)
            if child.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
                assert child.output_token_ids == want[:child.num_output_tokens]
            else:
                assert (child.output_token_ids, child.status) == (want, status), child
    target(float(sim.scheduler.num_preemptions), label="preemptions")
    event(f"preempted: {sim.scheduler.num_preemptions > 0}")
    event(f"prefix-cache hits: {any(r.num_cached_tokens for r in sim.requests.values())}")
    event(f"sliding window: {scenario['sliding_window'] is not None}")
    event(f"aborted with output: {any(r.status == RequestStatus.FINISHED_ABORTED and r.num_output_tokens for r in sim.requests.values())}")
    event(f"failed step: {any(r.status == RequestStatus.FINISHED_ERROR for r in sim.requests.values())}")
    event(f"drafts accepted: {sim.scheduler.num_spec_accepted_tokens > 0}")
    event(f"drafts rejected: {sim.scheduler.num_spec_accepted_tokens < sim.scheduler.num_spec_draft_tokens}")
    return sim


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_random_workloads_keep_every_invariant_and_give_solo_outputs(scenario):
    run_scenario(scenario)


# -- targeted cases -------------------------------------------------------------------------------------------
def tokens(start: int, count: int) -> list[int]:
    return [(start + i) % 63 + 1 for i in range(count)]


def test_fake_token_outputs_are_what_a_solo_run_gives():
    sim = CoreSim(num_blocks=16, block_size=4)
    (request,) = sim.add_prompt("a", tokens(0, 10), max_tokens=6)
    sim.run()
    want, status = expected_output(tokens(0, 10), 6)
    assert request.output_token_ids == want and request.status == status
    assert sim.num_steps == 1 + len(want) - 1  # one prefill step, then one decode per further token


def test_chunked_prefill_splits_a_prompt_under_the_token_budget():
    sim = CoreSim(num_blocks=16, block_size=4, max_num_batched_tokens=5)
    request, = sim.add_prompt("a", tokens(0, 12), max_tokens=2)
    chunks = []
    for _ in range(3):
        (s,) = sim.step().scheduled
        chunks.append((s.num_computed_tokens, s.num_scheduled_tokens))
    assert chunks == [(0, 5), (5, 5), (10, 2)]
    assert request.num_output_tokens == 1  # sampled only once the chunk reached the prompt's last token
    sim.run()


def test_decodes_are_scheduled_before_a_new_prefill_and_share_the_budget():
    sim = CoreSim(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sim.add_prompt("a", tokens(0, 6), max_tokens=8)
    sim.step()
    sim.add_prompt("b", tokens(20, 20), max_tokens=2)
    out = sim.step()
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    sim.run()


def test_max_num_seqs_keeps_later_requests_waiting():
    sim = CoreSim(num_blocks=64, block_size=4, max_num_seqs=2)
    for k in range(4):
        sim.add_prompt(f"r{k}", tokens(10 * k, 5), max_tokens=3)
    out = sim.step()
    assert [s.request_id for s in out.scheduled] == ["r0", "r1"]
    assert [r.request_id for r in sim.scheduler.waiting] == ["r2", "r3"]
    sim.run()


def test_prefix_cache_counters_count_each_request_once_when_admitted():
    """A request held back by the step time budget is looked up in the cache at every step it waits; only the
    look that admits it counts (vLLM's PrefixCacheStats), so queries are the prompts served, hits their hits."""
    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=20)
    prompts = {f"d{i}": tokens(i, 4) for i in range(5)}
    for name, prompt in prompts.items():
        sim.add_prompt(name, prompt, max_tokens=30)
    sim.step()  # untimed: all five admitted; then each step leaves prefill work of 8 units beside their decodes
    shared = tokens(100, 8)  # two full blocks every later prompt finds cached once the first has run
    for i in range(12):
        prompts[f"p{i}"] = shared + [200 + i]
        sim.add_prompt(f"p{i}", prompts[f"p{i}"], max_tokens=1)
    waited = 0
    while sim.scheduler.waiting:
        sim.step()
        waited += 1
    assert waited >= 3  # the later prompts waited, and were looked up, step after step
    sim.run()
    assert sim.kv.prefix_cache_queries == sum(len(p) for p in prompts.values())
    assert sim.kv.prefix_cache_hits == 8 * 11  # every p prompt but the first found the shared blocks


def test_preempted_request_is_requeued_ahead_of_its_equals():
    # 4 blocks of 4 tokens: two 7-token prompts fill them; the first decode that needs a 3rd block preempts.
    sim = CoreSim(num_blocks=4, block_size=4)
    a, = sim.add_prompt("a", tokens(0, 7), max_tokens=8)
    b, = sim.add_prompt("b", tokens(30, 7), max_tokens=8)
    c, = sim.add_prompt("c", tokens(50, 3), max_tokens=1)
    sim.step()  # a and b prefill (2 blocks each); c waits for a block
    assert [r.request_id for r in sim.scheduler.running] == ["a", "b"]
    out = sim.step()  # a's 8th token needs no new block; b's neither
    out = sim.step()  # a's 9th token needs a 3rd block: b (the newest) is preempted
    assert b.status == RequestStatus.PREEMPTED and b.num_preemptions == 1 and b.num_computed_tokens == 0
    assert [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in sim.scheduler.waiting] == ["b", "c"]  # ahead of c, which came before it
    sim.run()
    assert sim.scheduler.num_preemptions >= 1
    for request, prompt, max_tokens in ((a, tokens(0, 7), 8), (b, tokens(30, 7), 8), (c, tokens(50, 3), 1)):
        assert (request.output_token_ids, request.status) == expected_output(prompt, max_tokens)


def test_a_lower_priority_value_preempts_the_running_request_with_the_highest():
    sim = CoreSim(num_blocks=4, block_size=4)
    low, = sim.add_prompt("low", tokens(0, 12), max_tokens=4, priority=5)
    sim.step()
    assert low.status == RequestStatus.RUNNING
    urgent, = sim.add_prompt("urgent", tokens(20, 6), max_tokens=2, priority=0)
    out = sim.step()
    assert low.status == RequestStatus.PREEMPTED and urgent.status == RequestStatus.RUNNING
    assert [s.request_id for s in out.scheduled] == ["urgent"]
    sim.run()
    assert urgent.finish_time < low.finish_time


def test_equal_priorities_never_preempt_for_a_waiting_request():
    sim = CoreSim(num_blocks=4, block_size=4)
    first, = sim.add_prompt("first", tokens(0, 12), max_tokens=4)
    sim.step()
    second, = sim.add_prompt("second", tokens(20, 6), max_tokens=2)
    out = sim.step()
    assert [s.request_id for s in out.scheduled] == ["first"] and second.status == RequestStatus.WAITING
    sim.run()
    assert sim.scheduler.num_preemptions == 0


def test_waiting_queue_orders_by_priority_then_arrival():
    sim = CoreSim(num_blocks=64, block_size=4, max_num_seqs=1)
    for name, priority in (("a", 2), ("b", 0), ("c", 2), ("d", 1), ("e", 0)):
        sim.add_prompt(name, tokens(ord(name), 3), max_tokens=1, priority=priority)
    assert [r.request_id for r in sim.scheduler.waiting] == ["b", "e", "d", "a", "c"]
    order = []
    while sim.scheduler.waiting or sim.scheduler.running:
        order += [s.request_id for s in sim.step().scheduled]
    assert order == ["b", "e", "d", "a", "c"]
    sim.check_drained()


@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "decoding"])
def test_aborted_request_frees_its_blocks_and_leaves_both_queues(when):
    sim = CoreSim(num_blocks=16, block_size=4, max_num_batched_tokens=6)
    request, = sim.add_prompt("a", tokens(0, 10), max_tokens=20)
    other, = sim.add_prompt("b", tokens(40, 3), max_tokens=2)
    for _ in range({"waiting": 0, "mid_prefill": 1, "decoding": 3}[when]):
        sim.step()
    assert request.num_computed_tokens == {"waiting": 0, "mid_prefill": 6, "decoding": 11}[when]
    sim.abort(request)
    assert request.status == RequestStatus.FINISHED_ABORTED and request.finish_time is not None
    assert request not in sim.scheduler.running and request not in sim.scheduler.waiting
    assert "a" not in sim.kv.block_tables
    sim.abort(request)  # idempotent
    sim.run()
    assert other.status == RequestStatus.FINISHED_LENGTH


def test_aborting_a_preempted_request_takes_it_off_the_waiting_queue():
    sim = CoreSim(num_blocks=4, block_size=4)
    sim.add_prompt("a", tokens(0, 7), max_tokens=8)
    b, = sim.add_prompt("b", tokens(30, 7), max_tokens=8)
    for _ in range(3):
        sim.step()
    assert b.status == RequestStatus.PREEMPTED
    sim.abort(b)
    assert b not in sim.scheduler.waiting and sim.scheduler.num_waiting_tokens == 0
    sim.run()


def test_n_completions_share_the_prompt_blocks_and_diverge_after():
    for caching in (True, False):
        sim = CoreSim(num_blocks=32, block_size=4, enable_prefix_caching=caching)
        prompt = tokens(0, 10)  # 2 full blocks and 2 tokens
        children = sim.add_prompt("p", prompt, max_tokens=6, n=3)
        assert [c.request_id for c in children] == ["p#0", "p#1", "p#2"]
        assert (children[0].cache_salt is None) == caching and len({c.cache_salt for c in children}) == 1
        out = sim.step()  # all three in one step: the 2nd and 3rd hit the 1st's 2 full blocks at once
        assert [s.num_computed_tokens for s in out.scheduled] == [0, 8, 8]
        tables = [s.block_ids for s in out.scheduled]
        assert tables[0][:2] == tables[1][:2] == tables[2][:2]
        assert len({t[2] for t in tables}) == 3  # the partial block holding the last prompt token: one each
        assert [sim.pool.ref_counts[b] for b in tables[0]] == [3, 3, 1]
        sim.run()
        outputs = [c.output_token_ids for c in children]
        assert outputs == [expected_output(prompt, 6, i)[0] for i in range(3)]
        assert len({tuple(o) for o in outputs}) == 3


def test_forks_with_caching_off_share_only_with_each_other():
    sim = CoreSim(num_blocks=32, block_size=4, enable_prefix_caching=False)
    prompt = tokens(0, 9)
    sim.add_prompt("solo", prompt, max_tokens=2)
    forks = sim.add_prompt("fork", prompt, max_tokens=2, n=2)
    by_id = {s.request_id: s for s in sim.step().scheduled}
    assert {rid: s.num_computed_tokens for rid, s in by_id.items()} == {"solo": 0, "fork#0": 0, "fork#1": 8}
    assert set(by_id["solo"].block_ids).isdisjoint(by_id["fork#0"].block_ids)
    assert by_id["fork#0"].block_ids[:2] == by_id["fork#1"].block_ids[:2]
    sim.run()
    assert [f.output_token_ids for f in forks] == [expected_output(prompt, 2, i)[0] for i in range(2)]


def test_prompt_logprobs_request_takes_no_prefix_hit_but_its_siblings_do():
    sim = CoreSim(num_blocks=32, block_size=4)
    prompt = tokens(0, 13)
    sim.add_prompt("warm", prompt, max_tokens=1)
    sim.run()
    children = sim.add_prompt("p", prompt, max_tokens=2, n=2, prompt_logprobs=1)
    assert [c.wants_prompt_logprobs for c in children] == [True, False]
    by_id = {s.request_id: s for s in sim.step().scheduled}
    assert {rid: s.num_computed_tokens for rid, s in by_id.items()} == {"p#0": 0, "p#1": 12}
    assert [c.num_cached_tokens for c in children] == [0, 12]
    sim.run()


def test_sliding_window_frees_blocks_behind_the_window_and_keeps_outputs():
    prompt = tokens(0, 30)
    sim = CoreSim(num_blocks=16, block_size=4, max_num_batched_tokens=8, sliding_window=6)
    request, = sim.add_prompt("w", prompt, max_tokens=10)
    held = []
    while not request.is_finished:
        sim.step()
        held.append(sum(1 for b in sim.kv.get_block_ids("w") if b >= 0))
    assert max(held) <= sim.kv.max_blocks_per_request(40, 8) < 10  # 40 tokens would need 10 blocks
    assert (request.output_token_ids, request.status) == expected_output(prompt, 10)
    sim.check_drained()


def test_check_fits_refuses_what_could_never_run():
    sim = CoreSim(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        sim.scheduler.check_fits(30, 3)
    with pytest.raises(ValueError, match="KV blocks"):
        sim.scheduler.check_fits(16, 1)  # 17 tokens: 5 blocks of 4, the pool has 4
    sim.scheduler.check_fits(15, 1)


def test_finished_request_in_the_step_output_is_not_advanced_again():
    # A request finished while the step ran (e.g. a shutdown on another thread) is skipped by the update.
    sim = CoreSim(num_blocks=16, block_size=4)
    request, = sim.add_prompt("a", tokens(0, 5), max_tokens=4)
    out = sim.scheduler.schedule()
    sampled, _ = sim.runner.execute(out, sim._holders())
    sim.scheduler.finish_request(request, RequestStatus.FINISHED_ABORTED)
    assert sim.scheduler.update_from_output(out, sampled) == []
    assert request.num_output_tokens == 0 and request.num_computed_tokens == 0
    sim.check_drained()


def test_errored_request_drops_its_blocks_from_the_prefix_cache():
    sim = CoreSim(num_blocks=16, block_size=4)
    request, = sim.add_prompt("a", tokens(0, 9), max_tokens=4)
    out = sim.step()
    blocks = out.scheduled[0].block_ids[:2]
    assert all(b in sim.pool._keys for b in blocks)
    sim.scheduler.finish_request(request, RequestStatus.FINISHED_ERROR, "forward pass failed")
    assert not any(b in sim.pool._keys for b in blocks) and not sim.pool._cached
    again, = sim.add_prompt("b", tokens(0, 9), max_tokens=1)
    assert sim.step().scheduled[0].num_computed_tokens == 0  # no hit on content that may never have been written
    sim.check_drained()


def test_request_preempted_in_the_step_it_was_scheduled_leaves_no_unwritten_block_findable():
    # A's second chunk (positions 8..13) registers block 2 in the prefix cache when it is allocated; then, in
    # the same step, the more urgent C takes A's only sequence slot. A's chunk is never computed, so block 2
    # must not stay findable: A, readmitted, would take it as a hit and attend to K/V nobody wrote.
    sim = CoreSim(num_blocks=16, block_size=4, max_num_batched_tokens=8, max_num_seqs=1)
    a, = sim.add_prompt("a", tokens(0, 14), max_tokens=2, priority=1)
    sim.step()  # A computes positions 0..7 (blocks 0 and 1)
    c, = sim.add_prompt("c", tokens(40, 2), max_tokens=1, priority=0)
    out = sim.step()
    assert [s.request_id for s in out.scheduled] == ["c"] and a.status == RequestStatus.PREEMPTED
    out = sim.step()  # A again: only its two computed blocks are hits
    assert [(s.request_id, s.num_computed_tokens) for s in out.scheduled] == [("a", 8)]
    sim.run()
    assert (a.output_token_ids, a.status) == expected_output(tokens(0, 14), 2)


def test_no_preemption_of_a_request_whose_unwritten_blocks_a_new_request_just_hit():
    # A (priority 2) computes the last 8 tokens of a 24-token prompt this step, registering blocks 4 and 5 at
    # allocation; B (priority 0), admitted next in the same step, takes them as prefix-cache hits. Preempting A
    # for C (priority 1) would leave B attending to blocks nobody writes, so C waits one step instead.
    sim = CoreSim(num_blocks=32, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    prefix = tokens(0, 24)
    a, = sim.add_prompt("a", prefix, max_tokens=3, priority=2)
    sim.step()  # A: positions 0..15
    b, = sim.add_prompt("b", prefix + [5, 6], max_tokens=3, priority=0)
    c, = sim.add_prompt("c", tokens(40, 3), max_tokens=3, priority=1)
    out = sim.step()  # the fake runner fails this step if B reads positions 16..23 unwritten
    assert [(s.request_id, s.num_computed_tokens) for s in out.scheduled] == [("a", 16), ("b", 24)]
    assert c.status == RequestStatus.WAITING
    sim.run()
    for request, prompt in ((a, prefix), (b, prefix + [5, 6]), (c, tokens(40, 3))):
        assert (request.output_token_ids, request.status) == expected_output(prompt, 3)


def test_speculative_decodes_give_solo_outputs_in_fewer_steps_and_free_what_rejected_drafts_held():
    sim = CoreSim(num_blocks=64, block_size=2, num_speculative_tokens=4)
    (request,) = sim.add_prompt("a", tokens(0, 6), max_tokens=40, greedy=True)
    (plain,) = sim.add_prompt("b", tokens(3, 6), max_tokens=40)  # sampled: never speculates
    sim.step()  # both prefills
    rejected_some = False
    while sim.scheduler.running:
        before = request.num_computed_tokens
        out = sim.step()
        by_id = {s.request_id: s for s in out.scheduled}
        assert not by_id.get("b") or not by_id["b"].draft_token_ids
        s = by_id.get("a")
        if s is not None and s.draft_token_ids and not request.is_finished:
            accepted = request.num_computed_tokens - before - 1
            rejected_some |= accepted < len(s.draft_token_ids)
            # the table covers the computed tokens only: blocks that held just rejected drafts are back in the pool
            assert len(sim.kv.block_tables["a"]) == -(-request.num_computed_tokens // 2)
    sim.check_drained()
    for r, prompt in ((request, tokens(0, 6)), (plain, tokens(3, 6))):
        assert (r.output_token_ids, r.status) == expected_output(prompt, 40)
    assert rejected_some and sim.scheduler.num_spec_accepted_tokens > 0
    assert sim.num_steps < 1 + len(request.output_token_ids)  # accepted drafts saved steps


def test_drafts_count_against_the_token_budget_and_never_reach_past_max_tokens():
    sim = CoreSim(num_blocks=64, block_size=4, num_speculative_tokens=2, max_num_batched_tokens=3)
    (request,) = sim.add_prompt("a", tokens(0, 3), max_tokens=5, greedy=True)
    while sim.scheduler.running or sim.scheduler.waiting:
        out = sim.step()  # check_schedule: budget, drafts < max_tokens left, drafts only on decodes
        assert out.total_num_scheduled_tokens <= 3
    assert (request.output_token_ids, request.status) == expected_output(tokens(0, 3), 5)
    assert sim.scheduler.num_spec_drafts > 0


# -- fair queuing and the step time budget ---------------------------------------------------------------------
def test_a_new_key_is_admitted_ahead_of_the_rest_of_a_many_prompt_request():
    """Start-time fair queuing: 40 prompts of one key are admitted 4 a step (max_num_batched_tokens 8, two-token
    prompts); a request of another key that arrives after the first step is admitted in the very next step, not
    after the 36 still waiting. Every prompt of the big key still completes with its solo output."""
    sim = CoreSim(num_blocks=256, block_size=4, max_num_batched_tokens=8)
    big = [sim.add_prompt(f"big-{i}", tokens(3 * i, 2), max_tokens=1, fairness_key="batch")[0] for i in range(40)]
    first = sim.step()
    assert [s.request_id for s in first.scheduled] == ["big-0", "big-1", "big-2", "big-3"]
    (small,) = sim.add_prompt("small", tokens(99, 2), max_tokens=1)
    second = sim.step()
    assert "small" in [s.request_id for s in second.scheduled]
    assert len(second.scheduled) == 4
    sim.run()
    for i, request in enumerate(big):
        assert (request.output_token_ids, request.status) == expected_output(tokens(3 * i, 2), 1)
    assert small.status == RequestStatus.FINISHED_LENGTH


def test_without_keys_admission_is_first_come_first_served():
    sim = CoreSim(num_blocks=256, block_size=4, max_num_batched_tokens=8)
    for i in range(12):
        sim.add_prompt(f"r{i}", tokens(3 * i, 2), max_tokens=1)
    order = []
    while sim.scheduler.waiting:
        order += [s.request_id for s in sim.step().scheduled if s.num_computed_tokens == 0]
    assert order == [f"r{i}" for i in range(12)]


def test_a_keys_turns_interleave_with_another_key_that_arrived_together():
    sim = CoreSim(num_blocks=256, block_size=4, max_num_batched_tokens=2)  # one two-token prompt a step
    for i in range(3):
        sim.add_prompt(f"a{i}", tokens(i, 2), max_tokens=1, fairness_key="a")
    for i in range(3):
        sim.add_prompt(f"b{i}", tokens(10 + i, 2), max_tokens=1, fairness_key="b")
    order = [sim.step().scheduled[0].request_id for _ in range(6)]
    assert order == ["a0", "b0", "a1", "b1", "a2", "b2"]


def test_the_step_time_budget_bounds_prefill_work_beside_decodes():
    """max_step_ms 20 with steps costing 2 ms + 1 ms per unit (tokens + requests; ``fake_step_seconds``): once
    a step has been timed, a step of 5 decodes (10 units) admits prefill work of at most 8 units (20 - 2 - 10),
    and never less than block_size + 1 units even when the decodes alone are over budget."""
    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=20)
    for i in range(5):
        sim.add_prompt(f"d{i}", tokens(i, 4), max_tokens=50)
    sim.step()  # untimed: everything waiting is admitted
    assert len(sim.scheduler.running) == 5
    for i in range(30):
        sim.add_prompt(f"p{i}", tokens(20 + i, 1), max_tokens=1)
    out = sim.step()
    prefill = [s for s in out.scheduled if s.request_id.startswith("p")]
    assert sum(s.num_scheduled_tokens + 1 for s in prefill) <= 8 and prefill
    # 20 more decoding requests: decodes alone (50 units) exceed the budget; prefill gets the floor, 5 units.
    for i in range(20):
        sim.add_prompt(f"e{i}", tokens(40 + i, 3), max_tokens=50)
    while sim.scheduler.waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in sim.scheduler.running):
        sim.step()  # until every e prompt is in and decoding
    for i in range(10):
        sim.add_prompt(f"q{i}", tokens(60 + i, 1), max_tokens=1)
    out = sim.step()
    prefill = [s for s in out.scheduled if s.request_id.startswith("q")]
    assert sum(s.num_scheduled_tokens + 1 for s in prefill) == 4  # two one-token prompts: 4 of the 5 units
    sim.run()


def test_a_long_prompt_is_chunked_by_the_step_time_budget_only_while_others_run():
    """Alone, a 100-token prompt is computed in one step (nobody to keep waiting); while a stream of another key
    decodes, it is chunked to what the 30 ms budget leaves (steps cost 2 ms + 1 ms per unit), and the stream
    gets its token every step."""
    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=30)
    (alone,) = sim.add_prompt("alone", tokens(5, 100), max_tokens=1)
    assert sim.step().num_scheduled_tokens == [100]
    (stream,) = sim.add_prompt("stream", tokens(0, 2), max_tokens=60)
    sim.step()
    (long,) = sim.add_prompt("long", tokens(7, 100), max_tokens=2)
    chunks = []
    while long.num_output_tokens == 0:
        out = sim.step()
        assert "stream" in [s.request_id for s in out.scheduled]
        chunks += [s.num_scheduled_tokens for s in out.scheduled if s.request_id == "long"]
    assert sum(chunks) == 100 and max(chunks) <= 30 - 2 - 2 - 1 and len(chunks) >= 4
    sim.run()
    assert (long.output_token_ids, long.status) == expected_output(tokens(7, 100), 2)
    assert (alone.output_token_ids, alone.status) == expected_output(tokens(5, 100), 1)


def test_a_short_request_is_admitted_beside_a_long_prompts_chunks_not_after_them():
    """Under the budget a running long prompt's chunks leave the floor (block_size + 1 units) to the waiting
    queue: a 3-token request sent while a 200-token prompt is being chunked is admitted in the next step, and
    the long prompt keeps moving in that step too (its chunks used to take the whole budget until it was done)."""
    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=30)
    sim.add_prompt("warm", tokens(3, 40), max_tokens=1)
    sim.run()
    (stream,) = sim.add_prompt("stream", tokens(0, 2), max_tokens=80)
    sim.step()
    (long,) = sim.add_prompt("long", tokens(7, 200), max_tokens=2)
    sim.step()
    sim.step()
    assert 0 < long.num_computed_tokens < 150  # chunked
    (short,) = sim.add_prompt("short", tokens(60, 3), max_tokens=1)
    out = sim.step()
    scheduled = {s.request_id: s.num_scheduled_tokens for s in out.scheduled}
    assert scheduled.get("short") == 3 and scheduled.get("long", 0) > 0 and "stream" in scheduled
    sim.run()
    assert (short.output_token_ids, short.status) == expected_output(tokens(60, 3), 1)
    assert (long.output_token_ids, long.status) == expected_output(tokens(7, 200), 2)


def test_a_waiting_request_is_admitted_where_max_num_batched_tokens_is_the_tighter_bound():
    """A generous max_step_ms (its budget past max_num_batched_tokens): a long prompt's chunks take at most half of
    the step's tokens while a request waits, so a 20-token request is admitted whole beside them."""
    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=1000, max_num_batched_tokens=64)
    sim.add_prompt("warm", tokens(3, 40), max_tokens=1)
    sim.run()
    sim.add_prompt("stream", tokens(0, 2), max_tokens=80)
    sim.step()
    (long,) = sim.add_prompt("long", tokens(7, 400), max_tokens=2)
    sim.step()
    (short,) = sim.add_prompt("short", tokens(60, 20), max_tokens=1)
    out = sim.step()
    scheduled = {s.request_id: s.num_scheduled_tokens for s in out.scheduled}
    assert scheduled.get("short") == 20 and scheduled.get("long", 0) > 0, scheduled
    sim.run()
    assert (short.output_token_ids, short.status) == expected_output(tokens(60, 20), 1)
    assert (long.output_token_ids, long.status) == expected_output(tokens(7, 400), 2)


def test_step_cost_fits_the_base_and_the_cost_per_unit_of_noisy_steps():
    import random

    from backend.step_cost import StepCost

    rng = random.Random(0)
    cost = StepCost()
    assert cost.line() is None and cost.units_within(0.1, 0) is None
    for _ in range(200):
        work = rng.randint(1, 300)
        cost.observe(work, (0.028 + 0.0016 * work) * rng.uniform(0.97, 1.03))
    base, per_unit = cost.line()
    assert base == pytest.approx(0.028, rel=0.25) and per_unit == pytest.approx(0.0016, rel=0.1)
    assert cost.units_within(0.100, 10) == pytest.approx((0.100 - base) / per_unit - 10, abs=1)
    assert cost.units_within(0.010, 0) == 0  # below the base: nothing fits


def test_a_preempted_chunk_gives_its_prefill_budget_back_to_the_request_that_preempted_it():
    """max_num_seqs 1: a priority-0 request preempts the priority-1 prompt whose chunk had taken the whole step time
    budget (8 units of 8: steps cost 2 ms + 1 ms per unit, max_step_ms 10); the victim's units go back, so the
    urgent request runs in that same step instead of the step coming out empty."""
    sim = CoreSim(num_blocks=64, block_size=1, max_num_seqs=1, max_num_batched_tokens=8, max_step_ms=10)
    sim.add_prompt("warm", tokens(0, 1), max_tokens=3)
    sim.run()  # steps of 2 units
    (low,) = sim.add_prompt("low", tokens(5, 15), max_tokens=1, priority=1)
    assert sim.step().num_scheduled_tokens == [8]  # alone: a full chunk; now the fit has two sizes of step
    (urgent,) = sim.add_prompt("urgent", tokens(30, 1), max_tokens=1, priority=0)
    out = sim.step()
    assert [s.request_id for s in out.scheduled] == ["urgent"] and low.status == RequestStatus.PREEMPTED
    sim.run()
    assert (low.output_token_ids, low.status) == expected_output(tokens(5, 15), 1)


def test_a_step_budget_that_holds_prefill_to_its_floor_is_logged_once(caplog):
    """max_step_ms 20 with steps costing 2 ms + 1 ms per unit: 5 decodes (12 ms) leave room for prefill, 25 (52 ms)
    leave it the floor (block_size tokens); once the fit has ~20 steps behind it the log says so, once, with the
    decode step the fit gives for the decodes running then."""
    import re

    sim = CoreSim(num_blocks=512, block_size=4, max_step_ms=20)
    for i in range(5):
        sim.add_prompt(f"d{i}", tokens(i, 4), max_tokens=60)
    for _ in range(4):
        sim.step()
    sim.add_prompt("p0", tokens(20, 1), max_tokens=1)
    sim.step()
    assert "max_step_ms" not in caplog.text
    for i in range(20):
        sim.add_prompt(f"e{i}", tokens(40 + i, 3), max_tokens=60)
    for k in range(25):  # the fit weighs ~20 steps: the log waits for that many
        if k == 10:
            assert "max_step_ms" not in caplog.text
        sim.step()
        sim.add_prompt(f"q{k}", tokens(60 + k, 1), max_tokens=1)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("max_step_ms 20 leaves prefill 4 ")]
    assert len(said) == 1, caplog.text
    found = re.search(r"a step with (\d+) running decodes takes about (\d+) ms here and each prompt token adds about "
                      r"([\d.]+) ms", said[0])
    decodes, ms, per_token = int(found[1]), int(found[2]), float(found[3])
    assert decodes >= 7 and abs(ms - (2 + 2 * decodes)) <= 1  # 18 ms beside the 2 fixed: <= 4 units from 7 decodes on
    assert abs(per_token - 1.0) < 0.05
    sim.run()
