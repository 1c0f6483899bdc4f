"""A server started with a vLLM command line, as an existing script or manifest writes it, serves
under every name it was given, and logs every line in one timestamped format."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from e2e.conftest import REPO_ROOT, _stop, _wait_healthy, free_port

NAMES = ["tiny-a", "tiny-b"]
ORIGIN = "https://dashboard.example"
STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} [A-Z]+ [\w.]+: ")


@pytest.fixture(scope="module")
def vllm_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("vllm-cli") / "server.log"
    command = [sys.executable, "-m", "tailrace", "serve", "--model", model_dir, "--port", str(port),
               "--served-model-name", *NAMES, "--max-model-len", "1k", "--max-num-seqs", "8",
               "--dtype", "float", "--seed", "3", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.9",
               "--enable-prefix-caching", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json",
               "--generation-config", "vllm", "--disable-log-requests", "--log-level", "info",
               "--uvicorn-log-level", "info", "--allowed-origins", f'["{ORIGIN}"]', "--access-log"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url, log_path)
        yield url, log_path
    finally:
        _stop(process)


def test_models_lists_every_served_name_with_the_context_limit(vllm_server):
    url, _ = vllm_server
    cards = httpx.get(f"{url}/v1/models").json()["data"]
    assert [(card["id"], card["max_model_len"]) for card in cards] == [(name, 1000) for name in NAMES]


def test_a_request_under_the_second_name_is_answered_under_the_first(vllm_server):
    url, _ = vllm_server
    body = {"model": NAMES[1], "prompt": "The list type", "max_tokens": 4, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200
    assert response.json()["model"] == NAMES[0]


def test_allowed_origins_answer_the_cors_preflight(vllm_server):
    url, _ = vllm_server
    response = httpx.options(f"{url}/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
    assert response.headers["access-control-allow-origin"] == ORIGIN


def test_every_log_line_has_one_timestamped_format(vllm_server):
    url, log_path = vllm_server
    httpx.get(f"{url}/health")  # an access-log line, from uvicorn
    lines = [line for line in log_path.read_text().splitlines() if line.strip()]
    assert any("uvicorn" in line for line in lines) and any(" tailrace: " in line for line in lines)
    assert [line for line in lines if not STAMPED.match(line)] == []
