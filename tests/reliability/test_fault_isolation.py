"""An exception while processing one request fails that request only: a 500 in OpenAI's shape
before the first byte, an in-band error event after it, while a concurrent request completes and
the engine drops the failed one."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter

import httpx
import pytest

from harness import MODEL, RUNNING, parse_metrics
from tailrace.engine.output_processor import OutputProcessor
from tailrace.serving.completions import CompletionPieces

from .inprocess import InProcessServer

MARKER = "INJECT FAULT"
GOOD_TOKENS = 48


@pytest.fixture(scope="module")
def live():
    with InProcessServer() as server:
        yield server


@pytest.fixture
def detokenizer_fault(monkeypatch):
    """The output processor raises on the third delta of a request whose prompt has the marker."""
    original = OutputProcessor._choice_delta
    seen: Counter = Counter()

    def faulty(self, state, out, result):
        if MARKER in self.tokenizer.decode(state.prompt_token_ids):
            seen[state.request_id] += 1
            if seen[state.request_id] == 3:
                raise RuntimeError("injected detokenizer fault")
        return original(self, state, out, result)

    monkeypatch.setattr(OutputProcessor, "_choice_delta", faulty)


@pytest.fixture
def serving_fault(monkeypatch):
    """Building the completion pieces raises for a request whose echoed prompt has the marker."""
    original = CompletionPieces.__call__

    def faulty(self, step):
        if not step.first and MARKER in (step.choice.prompt.echo or ""):
            raise RuntimeError("injected serving fault")
        return original(self, step)

    monkeypatch.setattr(CompletionPieces, "__call__", faulty)


def body(prompt: str, stream: bool, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": GOOD_TOKENS, "ignore_eos": True, "stream": stream,
            **extra}


async def read_stream(client: httpx.AsyncClient, payload: dict) -> tuple[int, list[dict | str]]:
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        events = [line.removeprefix("data: ") async for line in response.aiter_lines() if line.startswith("data: ")]
    return response.status_code, [e if e == "[DONE]" else json.loads(e) for e in events]


async def good_and_faulty(live: InProcessServer, faulty: dict) -> tuple[tuple[int, list], httpx.Response | tuple]:
    async with httpx.AsyncClient(base_url=live.url, headers=live.headers, timeout=60) as client:
        good = read_stream(client, body("A neighbour", stream=True))
        bad = read_stream(client, faulty) if faulty["stream"] else client.post("/v1/completions", json=faulty)
        return await asyncio.gather(good, bad)


def assert_completed(result: tuple[int, list]) -> None:
    status, events = result
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert not any("error" in c for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]


def assert_engine_idle(live: InProcessServer) -> None:
    deadline = time.monotonic() + 2.0
    while parse_metrics(httpx.get(live.url + "/metrics", headers=live.headers).text)[RUNNING] != 0:
        assert time.monotonic() < deadline, "the failed request still runs in the engine"
        time.sleep(0.02)


def in_band_error(events: list) -> dict:
    errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1 and events[-1] == "[DONE]", events
    assert set(errors[0]) == {"message", "type", "param", "code"}
    assert "injected" not in errors[0]["message"] and "Traceback" not in errors[0]["message"]
    return errors[0]


def test_detokenizer_fault_mid_stream_is_one_in_band_error(live, detokenizer_fault):
    good, (status, events) = asyncio.run(good_and_faulty(live, body(MARKER, stream=True)))
    assert status == 200
    assert in_band_error(events)["code"] == "internal_error"
    assert_completed(good)
    assert_engine_idle(live)


def test_detokenizer_fault_in_a_non_stream_request_is_500_in_openai_shape(live, detokenizer_fault):
    good, response = asyncio.run(good_and_faulty(live, body(MARKER, stream=False)))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "injected" not in response.text
    assert_completed(good)
    assert_engine_idle(live)


def test_serving_fault_mid_stream_is_one_in_band_error(live, serving_fault):
    good, (status, events) = asyncio.run(good_and_faulty(live, body(MARKER, stream=True, echo=True)))
    assert status == 200
    assert in_band_error(events)["code"] == "internal_error"
    assert_completed(good)
    assert_engine_idle(live)


def test_serving_fault_in_a_non_stream_request_is_500_in_openai_shape(live, serving_fault):
    good, response = asyncio.run(good_and_faulty(live, body(MARKER, stream=False, echo=True)))
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert "injected" not in response.text
    assert_completed(good)
    assert_engine_idle(live)
