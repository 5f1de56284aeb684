"""lm-evaluation-harness itself, unchanged, against the real stack (tritonserver + the OpenAI frontend): a local
multiple-choice task through ``local-completions`` (prompts sent as token-id lists, scored by echoed prompt
logprobs) must give every loglikelihood that transformers computes for the same tokens in process, and so the
same accuracy; a local generation task runs through ``local-chat-completions`` too.

lm-eval needs numpy 2 while Triton's Python backend stub needs numpy < 2, so it runs from a virtual environment
of its own, ``.venv-lmeval`` (``make test-slow`` creates it; ``LM_EVAL`` names another ``lm_eval`` executable).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.slow, pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
DATA = Path(__file__).resolve().parent / "data" / "lm_eval"
LM_EVAL = os.environ.get("LM_EVAL", str(ROOT / ".venv-lmeval" / "bin" / "lm_eval"))
MODEL = "llm/1"  # fp32


def _tasks(directory: Path) -> Path:
    """The task YAMLs with their data files' absolute paths filled in."""
    directory.mkdir()
    for name in ("multiple_choice", "generation"):
        text = (DATA / f"{name}.yaml").read_text().replace("DATA_DIR", str(DATA))
        (directory / f"{name}.yaml").write_text(text)
    return directory


def _run(tmp_path: Path, model: str, model_args: str, task: str, *extra: str) -> list[dict]:
    """Runs lm_eval and returns its logged samples (one dict per document)."""
    if not Path(LM_EVAL).exists():
        pytest.fail(f"{LM_EVAL} is missing: `make test-slow` creates .venv-lmeval")
    output = tmp_path / f"out-{model}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OPENAI_API_KEY": "unused",
           "TOKENIZERS_PARALLELISM": "false"}
    command = [LM_EVAL, "run", "--model", model, "--model_args", model_args, "--tasks", task,
               "--include_path", str(_tasks(tmp_path / f"tasks-{model}")), "--output_path", str(output),
               "--log_samples", *extra]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"lm_eval failed:\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    samples = sorted(output.rglob(f"samples_{task}_*.jsonl"))
    assert samples, f"no samples written under {output}"
    return [json.loads(line) for line in samples[-1].read_text().splitlines()]


def test_lm_eval_multiple_choice_scores_what_transformers_computes(frontend, default_model_dir, tokenizer, tmp_path):
    model_args = (f"model={MODEL},base_url={frontend}/v1/completions,tokenizer={default_model_dir},"
                  f"tokenized_requests=True,num_concurrent=2,max_retries=1")
    samples = _run(tmp_path, "local-completions", model_args, "local_multiple_choice")
    reference = __import__("transformers").AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32).eval()
    docs = [json.loads(line) for line in (DATA / "multiple_choice.jsonl").read_text().splitlines()]
    assert len(samples) == len(docs)
    correct_server = correct_local = 0
    for sample in samples:
        doc = docs[sample["doc_id"]]
        served = [float(r[0][0]) for r in sample["resps"]]
        pairs = [sample["arguments"][f"gen_args_{i}"] for i in range(len(doc["choices"]))]
        assert [p["arg_1"].strip() for p in pairs] == doc["choices"]
        local = [_loglikelihood(reference, tokenizer, p["arg_0"], p["arg_1"]) for p in pairs]
        assert served == pytest.approx(local, abs=1e-3), f"document {sample['doc_id']}"
        correct_server += int(max(range(len(served)), key=served.__getitem__) == doc["answer"])
        correct_local += int(max(range(len(local)), key=local.__getitem__) == doc["answer"])
    assert correct_server == correct_local


def test_lm_eval_generation_through_chat_completions(frontend, default_model_dir, tmp_path):
    model_args = f"model={MODEL},base_url={frontend}/v1/chat/completions,num_concurrent=2,max_retries=1"
    samples = _run(tmp_path, "local-chat-completions", model_args, "local_generation", "--apply_chat_template")
    assert len(samples) == 4
    for sample in samples:
        answer = sample["filtered_resps"][0]
        assert isinstance(answer, str) and answer.strip(), f"document {sample['doc_id']}: empty answer"


@torch.inference_mode()
def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log P(continuation | context) as lm-eval splits the tokens (the whole text encoded, then cut at the
    context's length; trailing spaces of the context move to the continuation)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), dim=-1)
    return float(sum(logprobs[j - 1, whole[j]] for j in range(start, len(whole))))
