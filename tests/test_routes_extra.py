"""The Anthropic Messages and OpenAI Responses routes through FastAPI's TestClient: auth headers,
error shapes, and the named-event SSE framing."""

from __future__ import annotations

import json

import pytest

from test_app import FakeEngine, client_for, tokenizer  # noqa: F401 (tokenizer is a fixture)

KEY = "sk-test-key"
MESSAGE = {"model": "tiny", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def client(tokenizer):  # noqa: F811
    return client_for(FakeEngine(tokenizer), api_key=KEY)


def named_events(response) -> list[dict]:
    """Each frame is `event: <type>` then one data line whose type is that name; no [DONE]."""
    events = []
    for frame in filter(None, response.text.split("\n\n")):
        name, data = frame.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        events.append(event)
    return events


def assert_anthropic_error(response, status: int, kind: str) -> None:
    assert response.status_code == status
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"]


def test_messages_take_the_key_as_x_api_key(client):
    response = client.post("/v1/messages", json=MESSAGE, headers={"x-api-key": KEY})
    assert response.status_code == 200
    assert response.json()["content"] == [{"type": "text", "text": "Hello world"}]


def test_messages_without_a_key_answer_anthropics_401(client):
    assert_anthropic_error(client.post("/v1/messages", json=MESSAGE), 401, "authentication_error")


def test_x_api_key_is_not_a_key_on_openai_routes(client):
    response = client.post("/v1/chat/completions", headers={"x-api-key": KEY},
                           json={"model": "tiny", "messages": MESSAGE["messages"]})
    assert response.status_code == 401 and "error" in response.json() and "type" in response.json()["error"]


def test_messages_without_max_tokens_answer_anthropics_400(client):
    body = {k: v for k, v in MESSAGE.items() if k != "max_tokens"}
    response = client.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert_anthropic_error(response, 400, "invalid_request_error")
    assert "max_tokens" in response.json()["error"]["message"]


def test_messages_for_an_unknown_model_answer_anthropics_404(client):
    response = client.post("/v1/messages", json={**MESSAGE, "model": "claude"}, headers={"x-api-key": KEY})
    assert_anthropic_error(response, 404, "not_found_error")


def test_messages_stream_is_named_events_without_done(client):
    response = client.post("/v1/messages", json={**MESSAGE, "stream": True}, headers={"x-api-key": KEY})
    assert response.headers["content-type"].startswith("text/event-stream")
    events = named_events(response)
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "message_stop"


def test_count_tokens_answers_input_tokens(client):
    body = {k: v for k, v in MESSAGE.items() if k != "max_tokens"}
    response = client.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": KEY})
    assert response.status_code == 200 and response.json()["input_tokens"] > 0
