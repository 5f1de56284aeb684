"""Structured outputs in the engine: a grammar's bitmask holds whatever the model would rather say.

The tiny random model (which on its own never writes JSON) shows the grammar does all the work; the real
SmolLM2 is exercised through the server tests (tests/test_openai_structured.py).
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from backend import EngineConfig, LLMEngine, SamplingParams
from backend.structured_output import StructuredOutputsParams, apply_grammar_bitmask
from conftest import run_to_completion

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = LLMEngine(EngineConfig(model=tiny_model_dir, num_blocks=256, dtype="float32"))
    yield engine
    engine.shutdown()


def texts(outs) -> dict[int, str]:
    by_index: dict[int, list[str]] = {}
    for out in outs:
        by_index.setdefault(out.index, []).append(out.text)
    return {i: "".join(parts) for i, parts in sorted(by_index.items())}


def finish_reasons(outs) -> list[str]:
    return [o.finish_reason for o in outs if o.finish_reason]


def run(engine, prompt, **params):
    sink = engine.add_request(prompt, SamplingParams(**params), request_id="r")
    return run_to_completion(engine, {"r": sink})["r"]


def test_json_schema_holds_for_every_completion_at_temperature_1(engine):
    outs = run(engine, [5, 6, 7], n=6, seed=1, temperature=1.0, max_tokens=200,
               structured_outputs={"json": PERSON})
    assert finish_reasons(outs) == ["stop"] * 6
    for text in texts(outs).values():
        jsonschema.validate(json.loads(text), PERSON)


def test_regex_choice_and_grammar_hold(engine):
    outs = run(engine, [9, 10], n=4, seed=2, max_tokens=40, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"})
    for text in texts(outs).values():
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", text), text
    outs = run(engine, [9, 11], n=4, seed=3, max_tokens=20, structured_outputs={"choice": ["Paris", "Lon\"don"]})
    assert set(texts(outs).values()) <= {"Paris", "Lon\"don"} and finish_reasons(outs) == ["stop"] * 4
    outs = run(engine, [9, 12], n=2, seed=4, max_tokens=20, structured_outputs={"grammar": 'root ::= "yes" | "no"'})
    assert set(texts(outs).values()) <= {"yes", "no"}


def test_grammar_end_finishes_with_stop_despite_ignore_eos_and_min_tokens(engine):
    outs = run(engine, [3, 4], max_tokens=30, min_tokens=25, ignore_eos=True, temperature=0.0,
               structured_outputs={"choice": ["yes", "no"]})
    assert texts(outs)[0] in ("yes", "no") and finish_reasons(outs) == ["stop"]
    assert outs[-1].num_output_tokens <= 3  # the word and EOS, not 25 tokens


def test_invalid_constraints_fail_their_request_alone(engine):
    good = engine.add_request([1, 2], SamplingParams(max_tokens=4, structured_outputs={"choice": ["ok"]}),
                              request_id="good")
    for bad, message in [({"json": {"type": "nope"}}, "invalid structured_outputs.json: type at $: 'nope' is not one of"),
                         ({"json": {"type": "integer", "maximum": 1e30}}, "invalid structured_outputs.json: "),
                         ({"json": "{x"}, "the schema is not valid JSON"),
                         ({"regex": "[a-"}, "invalid structured_outputs.regex"),
                         ({"grammar": "root ::="}, "invalid structured_outputs.grammar"),
                         ({"choice": []}, "choice must be a non-empty list"),
                         ({"json": PERSON, "regex": "a"}, "exactly one of"),
                         ({"jsn": PERSON}, "unknown structured_outputs field(s) jsn")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            engine.add_request([1, 2], SamplingParams(structured_outputs=bad), request_id="bad")
    assert texts(run_to_completion(engine, {"good": good})["good"]) == {0: "ok"}


def test_each_distinct_constraint_is_compiled_once(engine):
    compiler = engine.grammar_compiler
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "boolean"}}}
    before = compiler.num_compiled
    for i in range(3):
        run(engine, [4, i], max_tokens=20, structured_outputs={"json": schema})
    run(engine, [4, 9], max_tokens=20, structured_outputs={"json": json.dumps(schema)})  # the same, as text
    assert compiler.num_compiled == before + 1 and compiler.num_cache_hits >= 3


def test_preempted_constrained_requests_match_their_solo_output(make_engine, tiny_model_dir):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 20,
              "maxItems": 20}
    params = SamplingParams(max_tokens=120, temperature=0.0, structured_outputs={"json": schema})
    prompts = [[100 + i] * 30 for i in range(6)]
    solo = make_engine(tiny_model_dir)
    want = [texts(run(solo, p, **vars(params)))[0] for p in prompts]
    tight = make_engine(tiny_model_dir, num_blocks=14)  # 6 x (30 + ~100) tokens need ~50 blocks of 16
    sinks = {str(i): tight.add_request(p, params, request_id=str(i)) for i, p in enumerate(prompts)}
    results = run_to_completion(tight, sinks)
    assert tight.stats().num_preemptions > 0
    for i in range(len(prompts)):
        got = texts(results[str(i)])[0]
        assert got == want[i]
        assert len(json.loads(got)) == 20


def test_bitmask_touches_only_rows_with_a_live_grammar(engine):
    compiled = engine.grammar_compiler.compile(StructuredOutputsParams(choice=("yes",)))
    from backend.structured_output import Grammar

    grammar = Grammar(compiled, engine.eos_token_ids)
    logits = torch.randn(3, engine.model_config.vocab_size)
    before = logits.clone()
    assert apply_grammar_bitmask(logits, [None, grammar, None]) == [1]
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all("yes".startswith(engine.tokenizer.decode([t])) for t in allowed)


def test_vllm_options_that_would_change_what_is_enforced_are_refused_and_backend_choices_passed_over():
    schema = {"type": "object"}
    for field, value in [("whitespace_pattern", "\\n"), ("structural_tag", {"structures": []}),
                         ("disable_additional_properties", True)]:
        with pytest.raises(ValueError, match=f"structured_outputs.{field} is not supported"):
            StructuredOutputsParams.from_value({"json": schema, field: value})
    params = StructuredOutputsParams.from_value({"json": schema, "backend": "outlines", "disable_fallback": True,
                                                 "disable_any_whitespace": True,
                                                 "disable_additional_properties": False, "whitespace_pattern": None})
    assert params.kind == "json" and json.loads(params.json) == schema
