"""Command line: ``python -m client "prompt" [--protocol grpc|http] [sampling options]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from client.llm_client import LLMClient, LLMError


def apply_chat_template(prompt: str, tokenizer_path: str | None) -> str:
    """Wraps the prompt as a user turn with the model's chat template (the default model's tokenizer unless given)."""
    from transformers import AutoTokenizer

    if tokenizer_path is None:
        from backend.model_loader import resolve_model_dir

        tokenizer_path = str(resolve_model_dir(None))
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    return without_template_bos(tokenizer, text)


def without_template_bos(tokenizer, text: str) -> str:
    """``text`` without the BOS a template wrote where the tokenizer adds one itself: the server tokenizes
    ``text_input`` with the tokenizer's special tokens, so the prompt would begin with two (Llama 3, Mistral)."""
    bos = tokenizer.bos_token
    adds_bos = bos is not None and tokenizer.encode("", add_special_tokens=True)[:1] == [tokenizer.bos_token_id]
    return text[len(bos):] if adds_bos and text.startswith(bos) else text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description="Stream a completion from Triton.")
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--grpc-url", default="localhost:8001")
    parser.add_argument("--http-url", default="http://localhost:8000")
    parser.add_argument("--model", default="llm")
    parser.add_argument("--model-version", default="", help="a version number; empty = the server's default")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    parser.add_argument("--tokenizer", help="tokenizer directory for --chat (default: the embedded model's)")
    parser.add_argument("--no-stream", action="store_true", help="one HTTP /generate response instead of a stream")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", default=None)
    parser.add_argument("--stats", action="store_true", help="print token counts and finish reason at the end")
    args = parser.parse_args(argv)

    if args.tokenizer is not None and not Path(args.tokenizer).is_dir():
        parser.error(f"--tokenizer {args.tokenizer}: no such directory")
    try:
        prompt = apply_chat_template(args.prompt, args.tokenizer) if args.chat else args.prompt
    except (OSError, ValueError) as exc:  # transformers' words for a directory without a tokenizer
        where = f"--tokenizer {args.tokenizer}" if args.tokenizer else "the default model's tokenizer"
        parser.error(f"{where}: no tokenizer with a chat template there ({exc})")
    sampling = dict(max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                    repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                    frequency_penalty=args.frequency_penalty, seed=args.seed, ignore_eos=args.ignore_eos)
    client = LLMClient(args.grpc_url, args.http_url, args.model, args.model_version)
    last = None
    try:
        if args.no_stream:
            last = client.generate(prompt, stop=args.stop, **sampling)
            print(last.text, flush=True)
        else:
            stream = client.stream_grpc if args.protocol == "grpc" else client.stream_http
            for last in stream(prompt, stop=args.stop, **sampling):
                print(last.text, end="", flush=True)
            print()
    except KeyboardInterrupt:  # leaving the generator cancels the request on the server
        print("\n[cancelled]", file=sys.stderr)
        return 130
    except (LLMError, ValueError) as exc:  # ValueError: a value the request cannot carry (max_tokens past INT32)
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if args.stats and last is not None:
        print(f"[finish_reason={last.finish_reason} input_tokens={last.num_input_tokens} "
              f"output_tokens={last.num_output_tokens}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
