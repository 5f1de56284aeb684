"""Schemathesis fuzzes the OpenAI frontend from its own OpenAPI schema, against the real stack (tritonserver + the
frontend): no 5xx, no hang, no leaked internals (tracebacks, source paths, class names), and the server answers a
real request afterwards.

Schemathesis runs from a virtual environment of its own, ``.venv-fuzz`` (``make test-slow`` creates it;
``SCHEMATHESIS`` names another ``st`` executable). The engine serves a short context (``max_model_len`` 96) so that
generated requests that do reach the model finish quickly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import requests

from triton_server import serve_app, single_version_repository, start_server, stop_server

pytestmark = [pytest.mark.slow, pytest.mark.server]

ROOT = Path(__file__).resolve().parent.parent
SCHEMATHESIS = os.environ.get("SCHEMATHESIS", str(ROOT / ".venv-fuzz" / "bin" / "st"))
SETTINGS = {"max_model_len": 96, "max_num_seqs": 16, "num_blocks": 256, "dtype": "float32"}
LEAKS = re.compile(r"Traceback|File \"|\.py\b|<class |pydantic|site-packages|/work/|/usr/lib", re.I)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, default_model_dir):
    from openai_frontend.app import FrontendConfig, create_app

    root = tmp_path_factory.mktemp("fuzz")
    repository = single_version_repository(root / "models", SETTINGS)
    server = start_server(root / "tritonserver.log", model_repository=repository)
    app = create_app(FrontendConfig(triton_url=server.grpc_url, model_repository=repository,
                                    triton_metrics_url=server.metrics_url))
    try:
        with serve_app(app) as url:
            yield url, root
    finally:
        stop_server(server)


def test_schemathesis_finds_no_server_error_hang_or_leak(stack):
    url, root = stack
    if not Path(SCHEMATHESIS).exists():
        pytest.fail(f"{SCHEMATHESIS} is missing: `make test-slow` creates .venv-fuzz")
    har = root / "fuzz.har"
    command = [SCHEMATHESIS, "run", f"{url}/openapi.json", "--checks", "not_a_server_error",
               "--max-examples", "30", "--request-timeout", "60", "--seed", "1", "--workers", "1",
               "--report", "har", "--report-har-path", str(har)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1500,
                            env={**os.environ, "SCHEMATHESIS_HOOKS": ""})
    assert result.returncode == 0, f"schemathesis found failures:\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    entries = json.loads(har.read_text())["log"]["entries"]
    assert len(entries) > 100, f"only {len(entries)} requests were sent"
    statuses = [e["response"]["status"] for e in entries]
    assert all(0 < s < 500 for s in statuses), sorted(set(statuses))
    for entry in entries:
        body = entry["response"]["content"].get("text") or ""
        assert not LEAKS.search(body), f"{entry['request']['method']} {entry['request']['url']}: {body[:500]}"
    answer = requests.post(f"{url}/v1/completions", json={"model": "llm", "prompt": "Hello", "max_tokens": 4},
                           timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
