"""OpenAI Responses through a real server and the official `openai` SDK: `responses.stream`'s
final response is exactly `responses.create`'s (with tools, structured output and logprobs),
`previous_response_id` chains, the stored-response routes, and errors as the SDK's own types.

Sampling is seeded at temperature 1 (the seed goes as extra body), so the stream and the
non-stream request draw the same tokens.
"""

from __future__ import annotations

import json
import time
from typing import Any

import openai
import pytest

from responses_events import reassembled

from .conftest import API_KEY, MODEL

SEED = {"extra_body": {"seed": 1234}}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                          "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}}}}
CITY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city"],
               "properties": {"city": {"enum": ["Paris", "London", "Tokyo"]}}}

CASES: dict[str, dict[str, Any]] = {
    "plain": {"max_output_tokens": 24},
    "instructions": {"max_output_tokens": 24, "instructions": "You are terse."},
    "logprobs": {"max_output_tokens": 24, "include": ["message.output_text.logprobs"], "top_logprobs": 2},
    "json_schema": {"max_output_tokens": 64, "text": {"format": {"type": "json_schema", "name": "city",
                                                                  "schema": CITY_SCHEMA, "strict": True}}},
    "json_object": {"max_output_tokens": 64, "text": {"format": {"type": "json_object"}}},
    "named_tool": {"max_output_tokens": 64, "tools": [WEATHER],
                   "tool_choice": {"type": "function", "name": "get_weather"}},
    "required_tool": {"max_output_tokens": 96, "tools": [WEATHER], "tool_choice": "required"},
}


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)


def create(client: openai.OpenAI, **body: Any) -> Any:
    return client.responses.create(model=MODEL, **{"input": "Tell me about the weather.", **body}, temperature=1.0,
                                   **SEED)


LOGPROB_TOLERANCE = 1e-4  # a prompt found in the prefix cache is computed in other batches: ~1e-7 drift


def comparable(response: Any) -> dict[str, Any]:
    """Ids and times are fresh per request, and the second of two requests finds the prompt in
    the prefix cache; everything else must match, logprobs within LOGPROB_TOLERANCE. An SDK
    object or the raw JSON."""
    data = response if isinstance(response, dict) else response.model_dump(exclude_none=True)
    for key in ("id", "created_at", "completed_at"):
        data.pop(key, None)
    for item in data["output"]:
        item.pop("id", None)
        item.pop("call_id", None)
        for part in item.get("content", []):
            for entry in part.get("logprobs", []):
                for alternative in [entry, *entry["top_logprobs"]]:
                    alternative["logprob"] = pytest.approx(alternative["logprob"], abs=LOGPROB_TOLERANCE)
    data["usage"]["input_tokens_details"].pop("cached_tokens")
    return data


@pytest.mark.parametrize("case", CASES)
def test_stream_final_response_is_the_created_response(client, case):
    whole = create(client, **CASES[case])
    with client.responses.stream(model=MODEL, input="Tell me about the weather.", temperature=1.0, **SEED,
                                 **CASES[case]) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert comparable(final) == comparable(whole)
    assert deltas == whole.output_text


@pytest.mark.parametrize("case", CASES)
def test_raw_stream_follows_the_event_rules_and_reassembles_into_the_response(http, case):
    body = {"model": MODEL, "input": "Tell me about the weather.", "temperature": 1.0, **SEED["extra_body"],
            **CASES[case]}
    whole = http.post("/v1/responses", json=body).json()
    with http.stream("POST", "/v1/responses", json={**body, "stream": True}) as response:
        frames = [f for f in response.read().decode().split("\n\n") if f]
    events = [json.loads(frame.split("\n")[1].removeprefix("data: ")) for frame in frames]
    assert comparable(reassembled(events)) == comparable(whole)


def test_a_cut_short_stream_ends_incomplete_like_the_created_response(client):
    whole = create(client, max_output_tokens=3)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    events = list(client.responses.create(model=MODEL, input="Tell me about the weather.", temperature=1.0,
                                          max_output_tokens=3, stream=True, **SEED))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.incomplete"
    assert comparable(events[-1].response) == comparable(whole)


def test_structured_output_follows_the_schema(client):
    text = create(client, **CASES["json_schema"]).output_text
    assert json.loads(text)["city"] in ("Paris", "London", "Tokyo")


def test_named_tool_is_a_function_call_with_valid_arguments(client):
    (call,) = create(client, **CASES["named_tool"]).output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "London", "Tokyo")


def test_logprobs_cover_the_output_text(client):
    part = create(client, **CASES["logprobs"]).output[0].content[0]
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(len(entry.top_logprobs) == 2 for entry in part.logprobs)


def test_previous_response_id_chains_a_conversation(client):
    first = create(client, max_output_tokens=8, instructions="Be brief.")
    second = create(client, max_output_tokens=8, input="And tomorrow?", previous_response_id=first.id)
    third = create(client, max_output_tokens=8, input="Thanks.", previous_response_id=second.id)
    assert second.previous_response_id == first.id
    assert first.usage.input_tokens < second.usage.input_tokens < third.usage.input_tokens


def test_a_function_call_output_continues_after_a_tool_call(client):
    first = create(client, **CASES["named_tool"])
    call = first.output[0]
    answer = create(client, max_output_tokens=8, previous_response_id=first.id, tools=[WEATHER],
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}])
    assert answer.status in ("completed", "incomplete") and answer.usage.output_tokens > 0


def test_a_stored_response_is_retrieved_then_deleted(client):
    created = create(client, max_output_tokens=8)
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    client.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(created.id)


def test_an_unknown_previous_response_id_is_not_found(client):
    with pytest.raises(openai.NotFoundError):
        create(client, max_output_tokens=8, previous_response_id="resp_unknown")


def test_a_background_response_runs_to_completion(client):
    queued = create(client, max_output_tokens=8, background=True)
    assert queued.status in ("queued", "in_progress", "completed")
    response = queued
    for _ in range(200):
        response = client.responses.retrieve(queued.id)
        if response.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert response.status in ("completed", "incomplete") and response.output_text


def test_a_running_background_response_can_be_cancelled(client):
    # The grammar forces 300 digits, so it is still running when the cancel arrives.
    long = {"type": "object", "required": ["n"], "properties": {"n": {
        "type": "array", "minItems": 300, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}
    queued = create(client, max_output_tokens=1500, background=True,
                    text={"format": {"type": "json_schema", "name": "digits", "schema": long}})
    cancelled = client.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(queued.id).status == "cancelled"


def test_cancelling_a_foreground_response_is_a_bad_request(client):
    created = create(client, max_output_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(created.id)


def test_wrong_types_are_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="hi", max_output_tokens="many")
    assert caught.value.body["param"] == "max_output_tokens"


def test_the_wire_is_named_events_without_done(http):
    with http.stream("POST", "/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 8,
                                                    "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        frames = [f for f in response.read().decode().split("\n\n") if f]
    for frame in frames:
        name, data = frame.split("\n")
        assert name == f"event: {json.loads(data.removeprefix('data: '))['type']}"
    assert "[DONE]" not in frames[-1]
