"""``python -m openai_frontend``: the OpenAI API on port 9000, in front of Triton's gRPC port."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import uvicorn

from openai_frontend.app import DEFAULT_MODEL_REPOSITORY, FrontendConfig, create_app
from openai_frontend.auth import KEY_ENV, KEY_FILE_ENV, load_api_key
from openai_frontend.http_protocol import SlicedHttpToolsProtocol
from openai_frontend.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BODY_BYTES, Limits
from openai_frontend.models import tokenizer_for


def _port(text: str) -> int:
    """A TCP port, 0-65535 (0: any free one), for argparse."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def main(argv: list[str] | None = None) -> None:
    # No abbreviations: "--trust" must not quietly mean --trust-request-chat-template.
    parser = argparse.ArgumentParser(description="OpenAI-compatible API in front of Triton's llm model.",
                                     allow_abbrev=False)
    parser.add_argument("--host", default=os.environ.get("OPENAI_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=_port, default=os.environ.get("OPENAI_PORT", "9000"),
                        help="the port (default: $OPENAI_PORT, else 9000)")
    parser.add_argument("--triton-url", default=os.environ.get("TRITON_GRPC_URL", "localhost:8001"),
                        help="Triton's gRPC endpoint, host:port")
    parser.add_argument("--model-repository", type=Path, default=DEFAULT_MODEL_REPOSITORY,
                        help="where each model's tokenizer is found (its model parameter)")
    parser.add_argument("--tokenizer", default=None,
                        help="one tokenizer (HF directory or .gguf) for every model instead")
    parser.add_argument("--chat-template", type=Path, default=None,
                        help="a Jinja chat template file used instead of the tokenizer's")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer <key>' on every route but /health and /metrics "
                             f"(default: ${KEY_ENV}; none: open). Visible in ps: prefer ${KEY_ENV} or a file")
    parser.add_argument("--api-key-file", type=Path, default=None,
                        help=f"read the API key from the first line of this file (default: ${KEY_FILE_ENV})")
    parser.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="larger request bodies get 413 before they are read (default 8 MiB)")
    parser.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                        help="most completions (prompts times n) one request may ask for; more get 400 "
                             "(default 256)")
    parser.add_argument("--triton-metrics-url",
                        default=os.environ.get("TRITON_METRICS_URL", "http://localhost:8002/metrics"),
                        help="Triton's metrics page, whose vllm: gauges /metrics repeats ('' for none)")
    parser.add_argument("--open-render", action="store_true",
                        help="the render endpoints (token ids only, nothing generated) answer without the API key, "
                             "for a caller that cannot send one (the gateway's endpoint picker)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render a request's own chat_template (Jinja code run in this process) instead of "
                             "refusing it with 400; only where every caller is trusted")
    parser.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug",
                                                                "trace"))
    args = parser.parse_args(argv)
    try:
        api_key = load_api_key(args.api_key, args.api_key_file)
        limits = Limits(args.max_request_body_bytes, args.max_prompts_per_request)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        chat_template = args.chat_template.read_text() if args.chat_template else None
    except (OSError, UnicodeDecodeError) as exc:
        parser.error(f"--chat-template: {exc}")
    if args.tokenizer:  # every model's tokenizer: one that cannot load is refused here, not on every request
        try:
            tokenizer_for(args.model_repository, args.tokenizer, "", "")
        except Exception as exc:  # noqa: BLE001 - Hugging Face's loader raises many kinds
            parser.error(f"--tokenizer {args.tokenizer}: {exc}")
    config = FrontendConfig(args.triton_url, args.model_repository, args.tokenizer, chat_template, api_key, limits,
                            args.triton_metrics_url or None, args.open_render,
                            args.trust_request_chat_template)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level,
                http=SlicedHttpToolsProtocol)


if __name__ == "__main__":
    main()
