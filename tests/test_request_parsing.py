"""Triton request parsing: the request shapes of Triton's vLLM and TensorRT-LLM backends' clients, and limits."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from serve.request_parsing import MAX_REQUEST_ID_BYTES, MAX_SAMPLING_PARAMETERS_BYTES, check_request_id, parse_request


def inputs(prompt: str = "hi", **tensors) -> dict[str, np.ndarray]:
    out = {"text_input": np.array([prompt.encode()], dtype=np.object_)}
    for name, value in tensors.items():
        if isinstance(value, list):
            out[name] = np.array([v.encode() for v in value], dtype=np.object_)
        elif isinstance(value, str):
            out[name] = np.array([value.encode()], dtype=np.object_)
        elif isinstance(value, bool):
            out[name] = np.array([value], dtype=np.bool_)
        elif isinstance(value, float):
            out[name] = np.array([value], dtype=np.float32)
        elif name == "random_seed":
            out[name] = np.array([value], dtype=np.uint64)
        else:
            out[name] = np.array([value], dtype=np.int32)
    return out


def test_vllm_sample_client_strings_parse_as_numbers():
    """samples/client.py of vllm_backend: the same string values in sampling_parameters and as parameters."""
    sampling = {"temperature": "0.1", "top_p": "0.95", "max_tokens": "100"}
    parsed = parse_request(inputs(stream=False, sampling_parameters=json.dumps(sampling)), dict(sampling))
    assert (parsed.params.temperature, parsed.params.top_p, parsed.params.max_tokens) == (0.1, 0.95, 100)
    assert not parsed.stream


def test_genai_perf_vllm_shape_parses_min_and_max_tokens():
    sampling = json.dumps({"max_tokens": "12", "min_tokens": "12"})
    parsed = parse_request(inputs(exclude_input_in_output=True, stream=True, sampling_parameters=sampling), {})
    assert (parsed.params.max_tokens, parsed.params.min_tokens) == (12, 12)
    assert parsed.stream and parsed.exclude_input_in_output


@pytest.mark.parametrize("sampling, expected", [
    ({"ignore_eos": "false"}, ("ignore_eos", False)),  # vLLM's bool("false") would be True
    ({"ignore_eos": "TRUE"}, ("ignore_eos", True)),
    ({"seed": " 7 "}, ("seed", 7)),
    ({"frequency_penalty": "-1.5"}, ("frequency_penalty", -1.5)),
    ({"top_k": "-1"}, ("top_k", -1)),
    ({"skip_special_tokens": "false"}, ("skip_special_tokens", False)),
    ({"include_stop_str_in_output": "true"}, ("include_stop_str_in_output", True)),
    ({"prompt_logprobs": "1"}, ("prompt_logprobs", 1)),
    ({"truncate_prompt_tokens": "4"}, ("truncate_prompt_tokens", 4)),
    ({"logit_bias": {"5": "-1.5"}}, ("logit_bias", {5: -1.5})),
])
def test_numeric_and_boolean_strings_are_parsed(sampling, expected):
    params = parse_request(inputs(sampling_parameters=json.dumps(sampling)), {}).params
    assert getattr(params, expected[0]) == expected[1]


@pytest.mark.parametrize("sampling, message", [
    ({"max_tokens": "many"}, "max_tokens must be an integer, got string 'many'"),
    ({"max_tokens": "1.5"}, "max_tokens must be an integer, got string '1.5'"),
    ({"temperature": "hot"}, "temperature must be a number, got string 'hot'"),
    ({"temperature": "nan"}, "temperature must be a finite number"),
    ({"ignore_eos": "maybe"}, "ignore_eos must be true or false, got 'maybe'"),
])
def test_unparseable_strings_are_rejected_by_name(sampling, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(sampling_parameters=json.dumps(sampling)), {})


def test_genai_perf_tensorrtllm_shape_maps_min_length():
    parsed = parse_request(inputs(max_tokens=20, min_length=20, stream=True), {})
    assert (parsed.params.max_tokens, parsed.params.min_tokens) == (20, 20)


def test_tensorrt_llm_inputs_map_onto_sampling_params():
    parsed = parse_request(inputs(
        stop_words=["", "\n\n"], stop=["END"], bad_words=["", "red"], end_id=2, pad_id=0, beam_width=1,
        return_log_probs=True, num_return_sequences=2, random_seed=2**64 - 1, runtime_top_k=0,
        runtime_top_p=0.5, len_penalty=1.3, length_penalty=0.7, early_stopping=True, temperature=0.7), {})
    p = parsed.params
    assert p.stop == ["END", "\n\n"] and p.bad_words == ["red"]  # empty strings mean none
    assert p.stop_token_ids == [2] and p.ignore_eos  # end_id replaces the model's EOS
    assert p.logprobs == 0 and p.n == 2 and p.seed == 2**63 - 1
    assert p.top_k == -1 and p.top_p == 0.5  # runtime_top_k 0 is off, as in TensorRT-LLM


@pytest.mark.parametrize("tensors, message", [
    (dict(beam_width=4), "beam_width must be 1 \\(beam search is not supported\\), got 4"),
    (dict(runtime_top_p=0.0), "top_p must be in .* \\(sent as runtime_top_p\\)"),
    (dict(min_length=30, max_tokens=10), "min_tokens must be <= max_tokens .* \\(sent as min_length\\)"),
    (dict(num_return_sequences=3, n=2), "num_return_sequences \\(3\\) and n \\(2\\) disagree"),
    (dict(len_penalty=float("inf")), "len_penalty must be a finite number"),
    (dict(max_tokens=-1294967296), "max_tokens .* got -1294967296; if a JSON number over 2147483647 was sent"),
    (dict(max_tokens=-3), "^max_tokens must be in \\[1, inf\\), got -3$"),  # as sent over gRPC: nothing wrapped
    (dict(end_id=-3), "^end_id must be a token id \\(an integer >= 0\\), got -3$"),
    (dict(pad_id=-1), "^pad_id must be a token id"),
    (dict(stop_words=["x" * 257]), "^stop_words has a string of 257 characters; at most 256$"),
    (dict(stop_words=["x"] * 20, stop=["y"] * 13), "^stop_words and stop hold 20 and 13 strings; at most 32 together$"),
])
def test_tensorrt_llm_inputs_are_refused_clearly(tensors, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(**tensors), {})


@pytest.mark.parametrize("sampling, message", [
    ({"stop_words": 5}, "^stop_words must be a string or a list of strings, got 5$"),
    ({"stop_words": [5]}, "^stop_words must be a string or a list of strings, got \\[5\\]$"),
    ({"pad_id": [5]}, "^pad_id must be a token id \\(an integer >= 0\\), got \\[5\\]$"),
    ({"end_id": "x"}, "^end_id must be an integer, got string 'x'$"),
    ({"end_id": True}, "^end_id must be a token id"),
    ({"end_id": 49152}, "^end_id is 49152, outside the vocabulary \\[0, 49152\\)$"),
])
def test_tensorrt_llm_values_of_the_wrong_kind_are_refused_by_the_name_sent(sampling, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(sampling_parameters=json.dumps(sampling)), {}, vocab_size=49152)
    assert parse_request(inputs(sampling_parameters=json.dumps({"end_id": 49151})), {},
                         vocab_size=49152).params.stop_token_ids == [49151]


def test_max_tokens_beyond_int32_quotes_the_value_sent():
    with pytest.raises(ValueError, match="max_tokens is 3000000000, beyond the INT32 range"):
        parse_request(inputs(), {"max_tokens": 3000000000})


@pytest.mark.parametrize("raw, message", [
    ("[" * 300_000 + "]" * 300_000, f"sampling_parameters is 600000 bytes; at most {MAX_SAMPLING_PARAMETERS_BYTES}"),
    ('{"stop": ' + "[" * 1000 + "]" * 1000 + "}", "sampling_parameters nests 1001 levels deep; at most 32"),
    ('{"stop": ["[[[[[[[[", "{{{{{{{"]}', None),  # brackets inside strings do not count
])
def test_sampling_parameters_size_and_depth_are_bounded_before_decoding(raw, message):
    if message is None:
        assert parse_request(inputs(sampling_parameters=raw), {}).params.stop == ["[[[[[[[[", "{{{{{{{"]
        return
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(sampling_parameters=raw), {})


@pytest.mark.parametrize("stop, message", [
    (["x"] * 33, "stop has 33 strings; at most 32"),
    (["x" * 257], "stop has a string of 257 characters; at most 256"),
])
def test_stop_strings_are_bounded(stop, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(stop=stop), {})


def test_request_id_length_is_bounded_without_echoing_it():
    assert check_request_id("a" * MAX_REQUEST_ID_BYTES) == "a" * MAX_REQUEST_ID_BYTES
    with pytest.raises(ValueError, match="^request id is 1048576 bytes; at most 256$"):
        check_request_id("x" * 2**20)


def test_structured_outputs_arrive_by_every_route_and_only_one_at_a_time():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "string"}}}}}
    deep = parse_request(inputs(sampling_parameters=json.dumps({"structured_outputs": {"json": schema}})), {})
    assert json.loads(deep.params.structured_outputs.json) == schema  # 6 levels deep: within the limit
    old = parse_request(inputs(sampling_parameters=json.dumps(
        {"guided_decoding": json.dumps({"regex": "a+", "json": None, "backend": None})})), {})
    assert old.params.structured_outputs.regex == "a+"
    assert parse_request(inputs(), {"structured_outputs": '{"choice": ["x"]}'}).params.structured_outputs.choice == ("x",)
    trt = parse_request(inputs(guided_decoding_guide_type="json_schema", guided_decoding_guide='{"type": "integer"}'), {})
    assert trt.params.structured_outputs.kind == "json"
    assert parse_request(inputs(guided_decoding_guide_type="json"), {}).params.structured_outputs.json_object
    for tensors, message in [(dict(guided_decoding_guide_type="xml"), "guided_decoding_guide_type must be one of"),
                             (dict(guided_decoding_guide_type="regex"), "needs guided_decoding_guide"),
                             (dict(guided_decoding_guide_type="json", sampling_parameters=json.dumps(
                                 {"structured_outputs": {"regex": "a"}})), "both constrain the output")]:
        with pytest.raises(ValueError, match=message):
            parse_request(inputs(**tensors), {})


def test_vllm_backend_return_switches_and_openai_passthrough_fields():
    parsed = parse_request(inputs(return_cumulative_logprob=True, return_num_output_tokens=True,
                                  return_logprobs=False), {})
    assert parsed.returns == {"return_cumulative_logprob", "return_num_output_tokens"}
    assert parsed.params.logprobs == 0  # the cumulative logprob needs the sampled tokens' logprobs
    chat = parse_request(inputs(sampling_parameters=json.dumps(
        {"logprobs": True, "top_logprobs": 3, "best_of": 1, "n": 1, "temperature": 0.7})), {})
    assert chat.params.logprobs == 3 and chat.returns == frozenset()
    assert parse_request(inputs(sampling_parameters=json.dumps({"logprobs": False})), {}).params.logprobs is None
    with pytest.raises(ValueError, match="best_of must be 1 or n"):
        parse_request(inputs(sampling_parameters=json.dumps({"best_of": 3})), {})


def test_fairness_key_is_read_from_sampling_parameters_or_a_request_parameter_and_must_be_a_string():
    assert parse_request(inputs(sampling_parameters=json.dumps({"fairness_key": "tenant-a"})), {}).fairness_key == "tenant-a"
    assert parse_request(inputs(), {"fairness_key": "tenant-b"}).fairness_key == "tenant-b"
    assert parse_request(inputs(), {}).fairness_key is None
    with pytest.raises(ValueError, match="fairness_key must be a string, got 7"):
        parse_request(inputs(sampling_parameters=json.dumps({"fairness_key": 7})), {})


def test_cache_salt_and_prompt_token_ids_are_read():
    ids = np.array([5, 6, 7], dtype=np.int64)
    parsed = parse_request({"input_ids": ids, "sampling_parameters": np.array([b'{"cache_salt": "t1"}'],
                                                                               dtype=np.object_)}, {})
    assert parsed.prompt == [5, 6, 7] and parsed.cache_salt == "t1"
    with pytest.raises(ValueError, match="exactly one"):
        parse_request({**inputs("hi"), "input_ids": ids}, {})
    with pytest.raises(ValueError, match="exactly one"):
        parse_request({}, {})


def test_an_unknown_sampling_parameter_lists_every_key_that_would_have_been_taken():
    with pytest.raises(ValueError, match="unknown sampling parameter") as unknown:
        parse_request(inputs(sampling_parameters=json.dumps({"bogus": 1})), {})
    known = set(str(unknown.value).split("known: ")[1].split(", "))
    accepted = {"priority": 1, "timeout_ms": 5, "cache_salt": "s", "fairness_key": "k", "best_of": 1,
                "exclude_input_in_output": True, "guided_decoding": {"regex": "a"}, "runtime_top_k": 2,
                "temperature": 0.5}
    for name, value in accepted.items():
        parse_request(inputs(sampling_parameters=json.dumps({name: value})), {})  # each is taken ...
        assert name in known, name  # ... and so listed


def test_top_k_and_runtime_top_k_agree_on_off_whether_0_or_minus_1():
    for top_k, runtime_top_k in ((0, 0), (0, -1), (-1, 0), (5, 5)):
        sampling = json.dumps({"top_k": top_k, "runtime_top_k": runtime_top_k})
        parsed = parse_request(inputs(sampling_parameters=sampling), {})
        assert parsed.params.top_k == (5 if top_k == 5 else -1)
    with pytest.raises(ValueError, match="disagree"):
        parse_request(inputs(sampling_parameters=json.dumps({"top_k": 3, "runtime_top_k": 0})), {})


@pytest.mark.parametrize("json_value, message", [
    ({"max_tokens": "x"}, "max_tokens must be an integer, got string 'x'"),
    ({"max_tokens": -5}, r"max_tokens must be in \[1, inf\), got -5"),
    ({"temperature": "hot"}, "temperature must be a number, got string 'hot'"),
    ({"stop": 5}, "stop must be a non-empty string"),
    ({"max_tokens": 2**40}, f"max_tokens is {2**40}, beyond the INT32 range"),
    ({"max_tokens": 9, "temperature": 1.5, "stop": ["y"]}, None),  # valid, and replaced by the named inputs
])
def test_a_value_a_named_input_replaces_is_still_validated(json_value, message):
    tensors = dict(sampling_parameters=json.dumps(json_value), max_tokens=3, temperature=0.5, stop=["x"])
    if message is None:
        params = parse_request(inputs(**tensors), {}).params
        assert (params.max_tokens, params.temperature, params.stop) == (3, 0.5, ["x"])
        return
    with pytest.raises(ValueError, match=f"{message}.*the {next(iter(json_value))} input, replaces it"):
        parse_request(inputs(**tensors), {})
    with pytest.raises(ValueError, match=f"{message}.*replaces it"):  # a request parameter that the JSON replaces
        parse_request(inputs(sampling_parameters=json.dumps({"max_tokens": 3, "temperature": 0.5, "stop": ["x"]})),
                      json_value)


@pytest.mark.parametrize("parameters, sampling, message", [
    ({"timeout_ms": -1}, {"timeout_ms": 1000}, "timeout_ms must be a positive number"),
    ({"cache_salt": 5}, {"cache_salt": "b"}, "cache_salt must be a string"),
    ({"stop_words": '["' + "x" * 300 + '"]'}, {"stop_words": ["a"]}, "stop_words has a string of"),
    ({"end_id": 10**9}, {"end_id": 5}, "end_id is 1000000000, outside the vocabulary"),
    ({"beam_width": 3}, {"beam_width": 1}, "beam_width must be 1"),
    ({"random_seed": -5}, {"random_seed": 5}, "random_seed"),
    ({"len_penalty": "inf"}, {"len_penalty": 1.0}, "len_penalty"),
])
def test_a_replaced_value_is_checked_as_if_it_were_the_only_one(parameters, sampling, message):
    # Each value also alone: the same error, without the note.
    with pytest.raises(ValueError, match=message) as alone:
        parse_request(inputs(), parameters, vocab_size=49152)
    assert "replaces" not in str(alone.value)
    with pytest.raises(ValueError, match=f"{message}.*replaces it"):  # the good one, sent later, replaces it
        parse_request(inputs(sampling_parameters=json.dumps(sampling)), parameters, vocab_size=49152)
    parse_request(inputs(sampling_parameters=json.dumps(sampling)), {}, vocab_size=49152)  # good alone


def test_a_replaced_value_is_checked_alone_not_against_the_settings_that_won():
    # min_tokens 50 with the max_tokens 100 that replaced 5: a valid request, and 5 is valid alone.
    parsed = parse_request(inputs(sampling_parameters=json.dumps({"max_tokens": 100, "min_tokens": 50})),
                           {"max_tokens": 5})
    assert (parsed.params.max_tokens, parsed.params.min_tokens) == (100, 50)
    parsed = parse_request(inputs(sampling_parameters=json.dumps({"n": 2, "best_of": 2})), {"n": 1})
    assert parsed.params.n == 2
    # Sent in all three sources: the first one is checked too.
    with pytest.raises(ValueError, match="timeout_ms must be a positive number.*replaces it"):
        parse_request(inputs(sampling_parameters=json.dumps({"timeout_ms": 1000}), timeout_ms=500),
                      {"timeout_ms": -1})


def test_a_replaced_value_goes_through_the_engines_checks(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_n=4)
    vocab = engine.model_config.vocab_size

    def check(parsed):
        engine.check_request(parsed.params, parsed.cache_salt, parsed.fairness_key)

    for parameters, sampling, message in [
            ({"n": 5}, {"n": 1}, "n must be at most 4"),
            ({"fairness_key": "a" * 300}, {"fairness_key": "b"}, "fairness_key must be a non-empty string"),
            ({"logit_bias": json.dumps({str(vocab + 7): 100})}, {"logit_bias": {"30": 1}}, "outside the vocabulary")]:
        with pytest.raises(ValueError, match=f"{message}.*replaces it"):
            parse_request(inputs(sampling_parameters=json.dumps(sampling)), parameters, check=check)
        kept = parse_request(inputs(sampling_parameters=json.dumps(sampling)), {}, check=check)
        check(kept)  # the value that replaced it is good on its own
    with pytest.raises(ValueError, match="n must be at most 4.*the n input, replaces it"):  # a named input's turn
        parse_request(inputs(sampling_parameters=json.dumps({"n": 9}), n=2), {}, check=check)
    # The request's own fault is named as its own, not as a replaced value's.
    with pytest.raises(ValueError, match="n must be at most 4") as own:
        parse_request(inputs(sampling_parameters=json.dumps({"temperature": 0.7, "n": 9})), {"temperature": 0.5},
                      check=check)
    assert "replaces" not in str(own.value)


def test_a_constraint_nested_past_the_stack_is_a_400_not_an_internal_error():
    for sent in ({"structured_outputs": "[" * 200_000}, {"guided_decoding": "{\"a\":" * 20_000}):
        with pytest.raises(ValueError, match="structured_outputs is nested too deeply|nests .* levels deep"):
            parse_request(inputs(), sent)
        with pytest.raises(ValueError, match="structured_outputs is nested too deeply|nests .* levels deep"):
            parse_request(inputs(sampling_parameters=json.dumps(sent)), {})


def test_a_constraint_sent_twice_must_be_the_same():
    one = {"regex": "a+"}
    parsed = parse_request(inputs(sampling_parameters=json.dumps({"structured_outputs": one})),
                           {"structured_outputs": json.dumps(one)})
    assert parsed.params.structured_outputs.regex == "a+"
    with pytest.raises(ValueError, match="structured_outputs is sent in two sources with different constraints"):
        parse_request(inputs(sampling_parameters=json.dumps({"structured_outputs": one})),
                      {"structured_outputs": json.dumps({"regex": "("})})


def test_request_parameters_carry_every_sampling_setting_and_bad_ones_are_refused():
    params = parse_request(inputs(), {"logit_bias": '{"30": 100}', "allowed_token_ids": "[30, 31]",
                                      "include_stop_str_in_output": True, "truncate_prompt_tokens": 1,
                                      "prompt_logprobs": 1, "logprobs": True, "top_logprobs": 2,
                                      "triton_enable_empty_final_response": True}).params  # the last: Triton's own
    assert (params.logit_bias, params.allowed_token_ids, params.include_stop_str_in_output) == ({30: 100.0}, [30, 31], True)
    assert (params.truncate_prompt_tokens, params.prompt_logprobs, params.logprobs) == (1, 1, 2)
    for bad, message in [({"logit_bias": "garbage"}, "logit_bias must be an object"),
                         ({"logit_bias": "{30: 1}"}, "the logit_bias parameter is not valid JSON"),
                         ({"best_of": 5}, "best_of must be 1 or n")]:
        with pytest.raises(ValueError, match=message):
            parse_request(inputs(), bad)
    # string-list settings: a JSON list's text is the list; any other text (JSON or not) is one string
    for sent, stop in [('[" Paris", "END"]', [" Paris", "END"]), ("[END]", ["[END]"]), (" Paris", [" Paris"])]:
        assert parse_request(inputs(), {"stop": sent}).params.stop == stop
    assert parse_request(inputs(), {"stop_words": '["a", ""]', "bad_words": '["b"]'}).params.stop == ["a"]
    assert parse_request(inputs(), {"bad_words": '["b", "c"]'}).params.bad_words == ["b", "c"]


@pytest.mark.parametrize("sampling, message", [
    ({"temperature": 10**400}, "^temperature must be a finite number"),
    ({"runtime_top_p": 10**400}, "^top_p must be a finite number.*sent as runtime_top_p"),
    ({"logit_bias": {"5": 10**400}}, "^logit_bias must be a finite number"),
    *(({"logit_bias": {key: 1}}, f"^logit_bias keys must be token ids .*got '{re.escape(key)}'$")
      for key in (" 5", "+5", "5_0", "\u0665", "-1", "", "9" * 40)),  # int() takes the first four ("\u0665": Arabic-Indic 5)
    ({"logit_bias": {"5": 1, "05": 2}}, "^logit_bias names token 5 twice$"),
    ({"len_penalty": -10**400}, "^len_penalty must be a finite number"),
    ({"early_stopping": 5}, "^early_stopping must be true or false, got 5$"),
    ({"return_log_probs": [1]}, "^return_log_probs must be true or false"),
    ({"random_seed": 2**64}, "^random_seed must be in \\[0, 2\\*\\*64\\)"),
])
def test_values_no_field_can_hold_are_refused_by_name(sampling, message):
    with pytest.raises(ValueError, match=message):
        parse_request(inputs(sampling_parameters=json.dumps(sampling)), {})


def test_best_of_is_checked_against_n_from_any_source():
    both = parse_request(inputs(n=2, sampling_parameters=json.dumps({"best_of": 2})), {}).params
    assert both.n == 2
    assert parse_request(inputs(num_return_sequences=3), {"best_of": "3"}).params.n == 3
    with pytest.raises(ValueError, match="best_of must be 1 or n"):
        parse_request(inputs(n=2, sampling_parameters=json.dumps({"best_of": 3})), {})


def test_a_trtllm_guide_without_its_type_is_refused():
    with pytest.raises(ValueError, match="guided_decoding_guide needs guided_decoding_guide_type"):
        parse_request(inputs(guided_decoding_guide="[0-9]+"), {})
