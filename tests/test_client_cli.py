"""The command-line client without a server: the HTTP address as the gRPC one is written, and an unreachable
server as one line, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from client.llm_client import LLMClient
from serve.launch import REPO_ROOT
from triton_server import free_port


def test_http_url_without_a_scheme_means_http():
    assert LLMClient(http_url="localhost:7100").http_url == "http://localhost:7100"
    assert LLMClient(http_url="https://triton.example:443/").http_url == "https://triton.example:443"


def test_an_unreachable_server_is_one_line_and_status_1():
    port = free_port()
    for protocol in ("http", "grpc"):
        run = subprocess.run([sys.executable, "-m", "client", "hi", "--protocol", protocol,
                              "--http-url", f"127.0.0.1:{port}", "--grpc-url", f"127.0.0.1:{port}"],
                             cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert run.returncode == 1, run.stderr
        assert run.stderr.startswith("error: ") and "Traceback" not in run.stderr, run.stderr
    assert f"cannot connect to http://127.0.0.1:{port}" in run.stderr or "UNAVAILABLE" in run.stderr


def test_a_tokenizer_that_is_not_a_directory_is_refused_by_flag():
    run = subprocess.run([sys.executable, "-m", "client", "hi", "--chat", "--tokenizer", "/nonexistent/tokenizer"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert "--tokenizer /nonexistent/tokenizer: no such directory" in run.stderr


def test_a_directory_without_a_tokenizer_is_refused_by_flag(tmp_path):
    run = subprocess.run([sys.executable, "-m", "client", "hi", "--chat", "--tokenizer", str(tmp_path)],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert f"--tokenizer {tmp_path}: no tokenizer" in run.stderr


def test_an_integer_past_its_inputs_type_is_refused_not_wrapped():
    # 2**32 + 5 would reach the server as 5 (numpy's int32 on gRPC, Triton's JSON conversion on HTTP).
    client = LLMClient(grpc_url="127.0.0.1:1", http_url="127.0.0.1:1")
    for call in (lambda: client.grpc_inputs("hi", None, True, max_tokens=2 ** 32 + 5),
                 lambda: client._http_body("hi", None, True, {"max_tokens": 2 ** 32 + 5})):
        with pytest.raises(ValueError, match=r"max_tokens 4294967301 is outside INT32"):
            call()
    client.grpc_inputs("hi", None, True, max_tokens=2 ** 31 - 1, seed=2 ** 40)  # within INT32, INT64
    run = subprocess.run([sys.executable, "-m", "client", "hi", "--max-tokens", str(2 ** 32 + 5),
                          "--http-url", "127.0.0.1:1", "--grpc-url", "127.0.0.1:1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and run.stderr.startswith("error: max_tokens 4294967301 is outside INT32"), run.stderr


@pytest.mark.parametrize("option, value, message", [
    ("max_tokens", "5", r"max_tokens must be an integer \(INT32\), got '5'"),
    ("max_tokens", 2.5, r"max_tokens must be an integer \(INT32\), got 2.5"),
    ("seed", True, r"seed must be an integer \(INT64\), got True"),
    ("temperature", "0.5", r"temperature must be a number \(FP32\), got '0.5'"),
    ("ignore_eos", 1, r"ignore_eos must be a boolean \(BOOL\), got 1"),
])
def test_an_option_of_the_wrong_kind_is_refused_by_name(option, value, message):
    # numpy would have parsed "5" and truncated 2.5 on gRPC; now each is a ValueError before any request.
    client = LLMClient(grpc_url="127.0.0.1:1", http_url="127.0.0.1:1")
    with pytest.raises(ValueError, match=message):
        client.grpc_inputs("hi", None, True, **{option: value})
    client.grpc_inputs("hi", None, True, temperature=1, top_p=np.float32(0.5), ignore_eos=np.bool_(True),
                       max_tokens=np.int64(4))


def test_chat_text_leaves_the_bos_to_the_servers_tokenizer(tokenizer):
    # The server tokenizes text_input with the tokenizer's special tokens: a template that writes the BOS too
    # (Llama 3, Mistral) would give the prompt two.
    import copy

    from tokenizers import processors

    from client.__main__ import without_template_bos

    assert without_template_bos(tokenizer, "<|endoftext|>Hi") == "<|endoftext|>Hi"  # SmolLM2 adds none
    bos = copy.deepcopy(tokenizer)
    bos.bos_token = "<|endoftext|>"
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos.convert_tokens_to_ids("<|endoftext|>"))])
    text = without_template_bos(bos, "<|endoftext|><|im_start|>user\nHi")
    assert text == "<|im_start|>user\nHi"
    assert bos.encode(text).count(bos.bos_token_id) == 1
