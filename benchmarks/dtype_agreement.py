"""How often bf16 gives the same greedy text as fp32 on the real model.

``python -m benchmarks.dtype_agreement [--max-tokens N]``: 20 chat prompts, greedy, through two engines
(``dtype`` float32 and bfloat16); prints how many outputs are identical and where the others first diverge
(output token index).
"""

from __future__ import annotations

import argparse

from backend import EngineConfig, LLMEngine, SamplingParams

PROMPTS = ["What is the capital of France?", "Write a haiku about rivers.", "Count to five.",
           "Explain photosynthesis briefly.", "Who wrote Hamlet?", "Give me three tips for sleeping better.",
           "What is 12 times 7?", "Translate 'good morning' to Spanish.", "Describe a cat in one sentence.",
           "What is the boiling point of water?", "Name three primary colors.", "Why is the sky blue?",
           "Write a short poem about autumn.", "What does a CPU do?", "List the planets of the solar system.",
           "How do I make tea?", "What is machine learning?", "Tell me a fun fact about octopuses.",
           "What is the largest ocean?", "Summarize the plot of Cinderella."]


def greedy_outputs(dtype: str, max_tokens: int, quantization: str = "none") -> list[list[int]]:
    """Each of :data:`PROMPTS`' greedy output token ids (chat template applied), on an engine of ``dtype``."""
    engine = LLMEngine(EngineConfig(dtype=dtype, num_blocks=2048, quantization=quantization))
    try:
        template = engine.tokenizer.apply_chat_template
        sinks = [engine.add_request(template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False), SamplingParams(max_tokens=max_tokens, temperature=0))
                 for q in PROMPTS]
        while engine.has_unfinished_requests():
            engine.step()
        outputs = []
        for sink in sinks:
            ids = []
            while not sink.empty():
                ids += sink.get_nowait().token_ids
            outputs.append(ids)
        return outputs
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.dtype_agreement", description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    fp32, bf16 = greedy_outputs("float32", args.max_tokens), greedy_outputs("bfloat16", args.max_tokens)
    diverged = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                for a, b in zip(fp32, bf16) if a != b]
    print(f"identical: {len(PROMPTS) - len(diverged)} of {len(PROMPTS)}; first divergence at output tokens "
          f"{sorted(diverged)}")


if __name__ == "__main__":
    main()
