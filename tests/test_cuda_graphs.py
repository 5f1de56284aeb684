"""CUDA graphs for pure-decode steps (backend/cuda_graphs.py). Without a GPU the capture itself cannot run; the
``emulate`` mode runs everything else (static buffers, batch-size buckets, padding rows) through the Triton
kernels under the interpreter, and must give transformers' greedy tokens."""

from __future__ import annotations

import os

import pytest
import torch

from backend import EngineConfig, SamplingParams
from backend.cuda_graphs import capture_sizes
from conftest import GREEDY, assert_matches_reference, run_to_completion
from test_engine_greedy import mixed_prompts


def test_capture_sizes_are_small_powers_then_every_16_up_to_the_limit():
    assert capture_sizes(256) == [1, 2, 4, 8] + list(range(16, 257, 16))
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]
    assert capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert capture_sizes(1024)[-1] == 256


@pytest.mark.parametrize("settings, match", [
    (dict(cuda_graphs="sometimes"), "off, on or emulate"),
    (dict(cuda_graphs="on"), "CUDA device"),
    (dict(cuda_graphs="emulate", attention_backend="torch"), "triton attention backend"),
    (dict(cuda_graphs="emulate", attention_backend="triton", model_impl="transformers"), "compact decoder"),
])
def test_settings_that_cannot_capture_are_refused(settings, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**settings)


def test_capture_without_cuda_is_refused(make_engine, tiny_model_dir):
    engine = make_engine(tiny_model_dir, attention_backend="triton")
    with pytest.raises(RuntimeError, match="CUDA device"):
        engine.engine_core.model_runner.capture_decode_graphs(4)
    other = make_engine(tiny_model_dir, attention_backend="torch")  # a backend without graphs: nothing to capture
    with pytest.raises(ValueError, match="triton attention backend"):
        other.engine_core.model_runner.capture_decode_graphs(4, emulate=True)


def test_padded_decode_batches_match_solo_generate(make_engine, tiny_model_dir, tiny_reference, tokenizer):
    """Four requests ending at different steps: decode batches of 4, 3 (padded to the graph of 4), 2 and 1 run
    from the static buffers; prompt steps run eagerly; every request gets its solo greedy tokens."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs the Triton interpreter (set by conftest on machines without a GPU)")
    engine = make_engine(tiny_model_dir, attention_backend="triton", cuda_graphs="emulate", max_num_seqs=5)
    graphs = engine.engine_core.model_runner.decode_graphs
    assert graphs.sizes == [1, 2, 4, 5]
    batches = []
    run = graphs.run

    def recording(input_ids, *args):
        batches.append(input_ids.shape[0])
        return run(input_ids, *args)

    graphs.run = recording
    prompts = mixed_prompts(tokenizer, [3, 30, 17, 9], seed=6)
    lengths = [3, 5, 7, 9]
    sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=n, **GREEDY), request_id=str(i))
             for i, (p, n) in enumerate(zip(prompts, lengths))}
    results = run_to_completion(engine, sinks)
    for i, (prompt, n) in enumerate(zip(prompts, lengths)):
        got = [t for out in results[str(i)] for t in out.token_ids]
        want, logits = tiny_reference.greedy(prompt, n)
        assert_matches_reference(got, want, logits, f"graph request {i}")
    assert {4, 3, 2, 1} <= set(batches)  # 3 ran padded to the graph of 4
    assert graphs.replays[4] >= batches.count(3) + batches.count(4) > batches.count(4)
    assert sum(graphs.replays.values()) == len(batches)
    assert graphs.slot_mapping[3] == -1 and graphs.seq_lens[3] == 0  # the padding row of the last batch of 3
    assert engine.stats().kv.used_blocks == 0
