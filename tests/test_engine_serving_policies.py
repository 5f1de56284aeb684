"""Serving policies in the engine itself: the bound on waiting work, deadlines, priorities, a dead engine."""

from __future__ import annotations

import time

import pytest

from backend import EngineDeadError, EngineOverloadedError, SamplingParams
from backend.fault_injection import ENV_VAR
from conftest import drain, run_to_completion

LONG = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_waiting_bound_refuses_at_once_and_admitted_requests_finish(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=1, max_num_waiting_requests=2, max_num_waiting_tokens=100)
    sinks = {rid: engine.add_request([1, 2, 3], LONG, request_id=rid) for rid in ("a", "b")}
    with pytest.raises(EngineOverloadedError, match="server is full: 2 requests"):
        engine.add_request([1, 2, 3], LONG, request_id="c")
    assert engine.stats().num_rejected == 1
    engine.step()  # a runs, b waits: one more fits
    sinks["c"] = engine.add_request([1, 2, 3], LONG, request_id="c")
    with pytest.raises(EngineOverloadedError, match="tokens"):  # 3 + 3 waiting + 98 > 100
        engine.add_request(list(range(1, 99)), LONG, request_id="d")
    with pytest.raises(ValueError, match="already in flight"):  # the refused id was never registered ...
        engine.add_request([1], LONG, request_id="c")
    results = run_to_completion(engine, sinks)
    assert all(outs[-1].finish_reason == "length" and outs[-1].num_output_tokens == 40 for outs in results.values())
    assert engine.stats().num_rejected == 2 and engine.stats().kv.used_blocks == 0
    run_to_completion(engine, {"d": engine.add_request(list(range(1, 99)), LONG, request_id="d")})  # ... nor d


def test_deadline_ends_waiting_and_running_requests_with_partial_output(make_engine, default_model_dir):
    # The real model: 1000 tokens take seconds, so the running request cannot end by length before its deadline
    # (the tiny model's steps are fast enough to, on a quiet machine).
    engine = make_engine(default_model_dir, max_num_seqs=1)
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    running = engine.add_request([1, 2, 3], params, request_id="running", timeout=0.3)
    waiting = engine.add_request([4, 5, 6], params, request_id="waiting", timeout=0.1)
    start = time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
    outs = {"running": drain(running), "waiting": drain(waiting)}
    assert outs["waiting"][-1].finish_reason == "timeout" and outs["waiting"][-1].num_output_tokens == 0
    assert outs["running"][-1].finish_reason == "timeout"
    assert 0 < outs["running"][-1].num_output_tokens == sum(len(o.token_ids) for o in outs["running"])
    assert 0.3 <= outs["running"][-1].metrics.e2e_latency < 0.3 + 0.5  # a step or two past the deadline
    assert time.monotonic() - start < 2.0
    assert engine.stats().kv.used_blocks == 0 and engine.stats().finished["timeout"] == 2
    with pytest.raises(ValueError, match="timeout must be a positive"):
        engine.add_request([1], params, timeout=0)


def test_lower_priority_value_is_admitted_first_and_higher_value_is_preempted_first(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sinks = {rid: engine.add_request([1, 2, 3], params, request_id=rid, priority=p)
             for rid, p in (("low1", 5), ("low2", 5), ("high", -1), ("mid", 0))}
    engine.step()
    assert list(engine.debug_snapshot().running) == ["high", "mid"]
    assert list(engine.debug_snapshot().waiting) == ["low1", "low2"]
    run_to_completion(engine, sinks)

    # 4 blocks of 16 tokens: two 20-token prompts fit (2 blocks each); the first decode past 32 tokens needs a
    # fifth, so one must go: the higher priority value, though it is the older request.
    engine = make_engine(tiny_model_dir, num_blocks=4, max_num_seqs=2)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    sinks = {"low": engine.add_request(list(range(1, 21)), params, request_id="low", priority=5)}
    engine.step()
    sinks["high"] = engine.add_request(list(range(21, 41)), params, request_id="high", priority=0)
    while engine.stats().num_preemptions == 0:
        engine.step()
    assert list(engine.debug_snapshot().waiting) == ["low"]
    results = run_to_completion(engine, sinks)
    assert all(outs[-1].num_output_tokens == 20 for outs in results.values())


def test_waiting_high_priority_request_preempts_the_lowest_priority_running_one(make_engine, tiny_model_dir,
                                                                                tiny_reference):
    # No free sequence slot: max_num_seqs 2, both running; a lower value arrives and takes the slot of the
    # running request with the highest value (the newer of two equals), which then waits and later resumes.
    engine = make_engine(tiny_model_dir, max_num_seqs=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sinks = {rid: engine.add_request([1, 2, 3], params, request_id=rid, priority=5) for rid in ("low1", "low2")}
    engine.step()
    sinks["high"] = engine.add_request([4, 5, 6], params, request_id="high", priority=0)
    engine.step()
    assert list(engine.debug_snapshot().running) == ["low1", "high"]
    assert list(engine.debug_snapshot().waiting) == ["low2"] and engine.stats().num_preemptions == 1
    results = run_to_completion(engine, sinks)
    want, _ = tiny_reference.greedy([1, 2, 3], 12)
    assert [t for o in results["low2"] for t in o.token_ids] == want  # recomputed: the same greedy tokens
    assert all(outs[-1].num_output_tokens == 12 for outs in results.values())

    # No free block: 4 blocks of 16 tokens, a running 40-token prompt holds 3; a 20-token one of lower value
    # needs 2, so the running one goes. Equal priorities never preempt at admission (FCFS: it waits).
    for high_priority, preempted in ((0, True), (5, False)):
        engine = make_engine(tiny_model_dir, num_blocks=4, max_num_seqs=4)
        sinks = {"low": engine.add_request(list(range(1, 41)), params, request_id="low", priority=5)}
        engine.step()
        sinks["high"] = engine.add_request(list(range(41, 61)), params, request_id="high", priority=high_priority)
        engine.step()
        running = list(engine.debug_snapshot().running)
        assert running == (["high"] if preempted else ["low"]), running
        results = run_to_completion(engine, sinks)
        assert all(outs[-1].num_output_tokens == 12 for outs in results.values())
        assert engine.stats().kv.used_blocks == 0


def test_failing_forward_fails_its_requests_then_a_permanent_fault_kills_the_engine(
        make_engine, tiny_model_dir, tmp_path, monkeypatch):
    fault = tmp_path / "fault"
    monkeypatch.setenv(ENV_VAR, str(fault))
    engine = make_engine(tiny_model_dir)
    fault.touch()
    outs = list(engine.generate([1, 2, 3], LONG, request_id="a"))
    assert outs[-1].finish_reason == "error" and "injected fault" in outs[-1].error
    fault.unlink()  # a transient fault: the next request is served
    assert list(engine.generate([1, 2, 3], LONG, request_id="b"))[-1].finish_reason == "length"
    engine.check_health()
    fault.touch()
    for rid in ("c", "d", "e"):  # three failed steps in a row
        assert list(engine.generate([1, 2, 3], LONG, request_id=rid))[-1].finish_reason == "error"
    fault.unlink()
    with pytest.raises(EngineDeadError, match="3 steps failed in a row"):
        engine.check_health()
    with pytest.raises(EngineDeadError):
        engine.add_request([1, 2, 3], LONG)

