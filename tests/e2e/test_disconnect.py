"""A client that goes away mid-request frees its request in the engine at once: nothing keeps
generating (and holding KV blocks) for a reader who is gone."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import httpx
import pytest

from .conftest import MODEL

RELEASE_DEADLINE_S = 1.0
POLL_INTERVAL_S = 0.01
CHUNKS_BEFORE_CLOSE = 3
CLIENT_PATIENCE_S = 0.5
DRAIN_TIMEOUT_S = 60.0
RUNNING = "tailrace:num_requests_running"
KV_USAGE = "tailrace:kv_cache_usage_perc"


def gauge(http: httpx.Client, name: str) -> float:
    response = http.get("/metrics")
    assert response.status_code == 200, response.text
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", response.text, re.MULTILINE)
    assert match is not None, f"{name} is not in /metrics"
    return float(match.group(1))


def assert_idle_within_deadline(http: httpx.Client, idle_kv: float, closed_at: float) -> None:
    deadline = closed_at + RELEASE_DEADLINE_S
    while True:
        running, kv = gauge(http, RUNNING), gauge(http, KV_USAGE)
        if running == 0 and kv == idle_kv:
            return
        assert time.monotonic() < deadline, \
            f"{RELEASE_DEADLINE_S} s after the close: {running:.0f} running, KV usage {kv} (idle: {idle_kv})"
        time.sleep(POLL_INTERVAL_S)


@pytest.fixture(autouse=True)
def drained_afterwards(http: httpx.Client) -> Iterator[None]:
    """When a test here fails, its request may still be generating: let it finish before later tests,
    which assume an idle engine."""
    yield
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while gauge(http, RUNNING) != 0 and time.monotonic() < deadline:
        time.sleep(0.1)


def long_request(endpoint: str, n: int, max_model_len: int) -> tuple[str, dict]:
    """A request that would run for many seconds if nobody stopped it."""
    body = {"model": MODEL, "max_tokens": max_model_len // 2, "ignore_eos": True, "n": n}
    if endpoint == "completions":
        return "/v1/completions", {**body, "prompt": "Once upon a time"}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": "Tell me a story."}]}


@pytest.mark.parametrize(("endpoint", "n"), [("completions", 1), ("chat", 2)])
def test_closed_stream_frees_the_engine_within_a_second(server_url: str, http: httpx.Client, max_model_len: int,
                                                        endpoint: str, n: int) -> None:
    idle_kv = gauge(http, KV_USAGE)
    assert gauge(http, RUNNING) == 0
    path, body = long_request(endpoint, n, max_model_len)
    with httpx.Client(base_url=server_url, headers=http.headers, timeout=30.0) as reader:
        with reader.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            data_lines = 0
            while data_lines < CHUNKS_BEFORE_CLOSE:
                data_lines += next(lines).startswith("data: ")
            assert gauge(http, RUNNING) == n  # else the check below could not fail
            closed_at = time.monotonic()
    assert_idle_within_deadline(http, idle_kv, closed_at)


def test_abandoned_non_stream_request_frees_the_engine_within_a_second(server_url: str, http: httpx.Client,
                                                                       max_model_len: int) -> None:
    idle_kv = gauge(http, KV_USAGE)
    path, body = long_request("completions", 1, max_model_len)
    with httpx.Client(base_url=server_url, headers=http.headers, timeout=CLIENT_PATIENCE_S) as impatient:
        with pytest.raises(httpx.ReadTimeout):  # else it finished too soon to test an abandon
            impatient.post(path, json=body)
    closed_at = time.monotonic()
    assert_idle_within_deadline(http, idle_kv, closed_at)
