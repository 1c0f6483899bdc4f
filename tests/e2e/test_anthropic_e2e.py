"""Anthropic Messages through a real server and the official `anthropic` SDK: `messages.stream`'s
final message is exactly `messages.create`'s, with tools; errors arrive as the SDK's own types.

Anthropic has no seed, so every request is greedy (temperature 0, which this SDK version sends
only as extra body): the stream and the non-stream request draw the same tokens.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import pytest

from .conftest import API_KEY, MODEL

USER = [{"role": "user", "content": "Tell me about the weather."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "additionalProperties": False, "required": ["city"],
                            "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}}}}

CASES: dict[str, dict[str, Any]] = {
    "plain": {"max_tokens": 24},
    "system": {"max_tokens": 24, "system": "You are terse."},
    "cut_short": {"max_tokens": 3},
    "forced_tool": {"max_tokens": 64, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}},
    "any_tool": {"max_tokens": 64, "tools": [WEATHER], "tool_choice": {"type": "any"}},
    "structured": {"max_tokens": 64, "output_config": {"format": {"type": "json_schema", "schema": WEATHER[
        "input_schema"]}}},
}
GREEDY = {"extra_body": {"temperature": 0.0}}


@pytest.fixture(scope="module")
def claude(server_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server_url, api_key=API_KEY, max_retries=0)


def create(claude: anthropic.Anthropic, **body: Any) -> Any:
    return claude.messages.create(model=MODEL, messages=USER, **GREEDY, **body)


def comparable(message: Any) -> dict[str, Any]:
    """Ids are fresh per request, and the second of two requests finds the prompt in the prefix
    cache: how the input tokens split between cached and not may differ, their sum may not."""
    data = message.model_dump()
    for block in data["content"]:
        block.pop("id", None)
    data.pop("id")
    usage = data["usage"]
    usage["input_tokens"] += usage.pop("cache_read_input_tokens")
    return data


@pytest.mark.parametrize("case", CASES)
def test_stream_final_message_is_the_created_message(claude, case):
    whole = create(claude, **CASES[case])
    with claude.messages.stream(model=MODEL, messages=USER, **GREEDY, **CASES[case]) as stream:
        final = stream.get_final_message()
    assert comparable(final) == comparable(whole)


def test_forced_tool_answers_a_tool_use_block_with_valid_input(claude):
    message = create(claude, **CASES["forced_tool"])
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.input["city"] in ("Paris", "London",
                                                                                                  "Tokyo")


def test_a_tool_result_continues_the_conversation(claude):
    call = create(claude, **CASES["forced_tool"]).content[0]
    messages = USER + [{"role": "assistant", "content": [call.model_dump()]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                     "content": "Sunny, 21 C"}]}]
    answer = claude.messages.create(model=MODEL, messages=messages, max_tokens=8, tools=[WEATHER], **GREEDY)
    assert answer.usage.input_tokens > 0 and answer.usage.output_tokens > 0


def test_structured_output_follows_the_schema(claude):
    text = create(claude, **CASES["structured"]).content[0].text
    assert json.loads(text)["city"] in ("Paris", "London", "Tokyo")


def test_running_out_of_tokens_is_max_tokens(claude):
    assert create(claude, **CASES["cut_short"]).stop_reason == "max_tokens"


def test_stop_sequence_is_reported_with_the_sequence(claude):
    probe = create(claude, max_tokens=24).content[0].text
    sequence = probe[len(probe) // 2:len(probe) // 2 + 3]
    message = create(claude, max_tokens=24, stop_sequences=[sequence])
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", sequence)
    assert message.content[0].text == probe[:probe.index(sequence)]


def test_count_tokens_matches_the_usage_of_a_message(claude):
    counted = claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    usage = create(claude, max_tokens=1).usage
    assert counted == usage.input_tokens + usage.cache_read_input_tokens


def test_missing_max_tokens_is_a_bad_request_error(server_url):
    response = httpx.post(f"{server_url}/v1/messages", headers={"x-api-key": API_KEY},
                          json={"model": MODEL, "messages": USER})
    assert response.status_code == 400
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "invalid_request_error"


def test_wrong_types_are_a_bad_request_error(claude):
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=MODEL, messages="not a list", max_tokens=8)


def test_a_wrong_key_is_an_authentication_error(server_url):
    client = anthropic.Anthropic(base_url=server_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, messages=USER, max_tokens=8)


def test_the_wire_is_named_events_without_done(server_url):
    with httpx.stream("POST", f"{server_url}/v1/messages", headers={"x-api-key": API_KEY},
                      json={"model": MODEL, "messages": USER, "max_tokens": 8, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in response.read().decode().split("\n\n") if f]
    for frame in frames:
        name, data = frame.split("\n")
        assert name == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert frames[-1].startswith("event: message_stop")
