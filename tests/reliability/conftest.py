"""Real `tailrace serve` processes for the reliability suite, started by bench/harness.py (the soak
scripts measure through the same code).

Import note: like tests/e2e, this directory is a package, so this conftest is `reliability.conftest`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from harness import MODEL, ServerProcess  # noqa: E402  (bench/ is on sys.path only from here)

# Small caps, so that a fuzzed request that passes validation finishes in well under a second, and a
# KV cache of 64 blocks of 16 tokens, so that the bad-input battery can ask for more than it holds.
FUZZ_FLAGS = ("--max-tokens", "8", "--max-num-seqs", "16", "--num-kv-blocks", "64", "--max-model-len", "1024",
              "--max-prompt-tokens", "900")


def start_server(tmp_path_factory: pytest.TempPathFactory, name: str, *flags: str,
                 via_bin_serve: bool = False) -> ServerProcess:
    server = ServerProcess(tmp_path_factory.mktemp(name) / "server.log", *flags, via_bin_serve=via_bin_serve)
    try:
        server.wait_healthy()
    except RuntimeError as err:
        server.stop()
        pytest.fail(str(err))
    return server


@pytest.fixture(scope="package")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the bad-input battery and the fuzzer, with the caps above."""
    with start_server(tmp_path_factory, "reliability-server", *FUZZ_FLAGS) as process:
        yield process


@pytest.fixture(scope="package")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60.0) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int | None = None) -> dict:
    """A 4xx whose body is exactly OpenAI's error object (never FastAPI's `detail`)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:500])
    if status is not None:
        assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


@pytest.fixture
def completion() -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4}


@pytest.fixture
def chat() -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
