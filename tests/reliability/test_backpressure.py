"""The bounded queue and the per-request timeout over real HTTP: 429 with retry-after when full, 408
(or an in-band error once streaming) past the timeout, and the engine freed either way."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from harness import MODEL, RUNNING, parse_metrics
from tailrace.serving.limits import Limits

from .conftest import assert_openai_error
from .inprocess import InProcessServer

TIMEOUT_S = 1.0
LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture(scope="module")
def queue_server():
    with InProcessServer(Limits(max_num_seqs=1, max_waiting_seqs=1)) as server:
        yield server


@pytest.fixture(scope="module")
def timeout_server():
    with InProcessServer(Limits(request_timeout_s=TIMEOUT_S)) as server:
        yield server


def client_for(server: InProcessServer) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers=server.headers, timeout=60)


def wait_engine_idle(client: httpx.Client, within_s: float = 2.0) -> None:
    deadline = time.monotonic() + within_s
    while parse_metrics(client.get("/metrics").text)[RUNNING] != 0:
        assert time.monotonic() < deadline, "the engine still runs a request"
        time.sleep(0.02)


def test_full_queue_answers_429_with_retry_after_then_serves_again(queue_server):
    with client_for(queue_server) as client:
        with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as running, \
                client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as waiting:
            assert (running.status_code, waiting.status_code) == (200, 200)
            refused = client.post("/v1/completions", json={**LONG, "max_tokens": 1})
            error = assert_openai_error(refused, 429)
            assert error["code"] == "rate_limit_exceeded"
            assert refused.headers["retry-after"] == "1"
            assert "x-should-retry" not in refused.headers  # the SDK retries a 429 by itself
        wait_engine_idle(client)
        assert client.post("/v1/completions", json={**LONG, "max_tokens": 1}).status_code == 200


def test_non_stream_past_the_timeout_is_408_and_frees_the_engine(timeout_server):
    with client_for(timeout_server) as client:
        started = time.monotonic()
        error = assert_openai_error(client.post("/v1/completions", json=LONG), 408)
        assert error["code"] == "request_timeout"
        assert time.monotonic() - started < TIMEOUT_S + 1.0
        wait_engine_idle(client)


def test_stream_past_the_timeout_ends_with_an_in_band_error(timeout_server):
    with client_for(timeout_server) as client:
        with client.stream("POST", "/v1/chat/completions",
                           json={**LONG, "messages": [{"role": "user", "content": "Hi"}], "stream": True}) as response:
            assert response.status_code == 200
            events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["error"]["code"] == "request_timeout"
        assert all("choices" in json.loads(e) for e in events[:-2])
        wait_engine_idle(client)
