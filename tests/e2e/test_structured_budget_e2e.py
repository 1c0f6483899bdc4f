"""Structured output within max_tokens through the real server: hypothesis schemas as
response_format and as forced tool calls, each with a budget from its minimum up, at
temperature 1, streamed and not. Every answer parses and validates, the stream joins to the
non-stream answer, and one the budget ended says "length". The minimum comes from the server's
own 400 for a budget below it."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from closing_schemas import OBJECT_SCHEMAS, SCHEMAS
from tailrace.engine.structured_output.json_grammar import schema_error

from .conftest import API_KEY, MODEL
from .test_structured_e2e import streamed_calls, streamed_content

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

MESSAGES = [{"role": "user", "content": "Answer in JSON."}]
CONCURRENCY = 24
EXTRA_TOKENS = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 60))
MINIMUM = re.compile(r"set max_tokens to at least (\d+)")
# A failing batch is reported whole: shrinking a batch of server answers would take hours.
BATCHES = settings(max_examples=3, deadline=None, database=None, phases=[Phase.generate],
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                          HealthCheck.data_too_large])


def enforceable(schemas: st.SearchStrategy) -> st.SearchStrategy:
    return schemas.filter(lambda s: schema_error(json.dumps(s)) is None)


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}}


def forced_call(parameters: dict[str, Any], choice: str = "named") -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "record", "parameters": parameters}}],
            "tool_choice": {"type": "function", "function": {"name": "record"}} if choice == "named" else choice}


async def minimum(client: openai.AsyncOpenAI, body: dict[str, Any]) -> int:
    """The fewest tokens the server says an answer takes (from its 400 for max_tokens 1)."""
    try:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, **body)
    except openai.BadRequestError as err:
        assert err.body["param"] == "max_tokens"
        return int(MINIMUM.search(err.body["message"]).group(1))
    return 1  # one token is enough: nothing to refuse


async def both(api_base: str, cases: list[tuple[dict[str, Any], int, int]]) -> list[tuple[int, Any, list[Any]]]:
    """For each (request fields, extra tokens, seed): its budget, the non-stream choice and the
    streamed chunks' choices."""
    client = openai.AsyncOpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(body: dict[str, Any], extra: int, seed: int) -> tuple[int, Any, list[Any]]:
        async with gate:
            budget = await minimum(client, body) + extra
            args = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "max_tokens": budget, "seed": seed,
                    **body}
            whole = await client.chat.completions.create(**args)
            stream = await client.chat.completions.create(stream=True, **args)
            return budget, whole.choices[0], [c.choices[0] for c in [chunk async for chunk in stream] if c.choices]

    try:
        return await asyncio.gather(*(one(*case) for case in cases))
    finally:
        await client.close()


def cases_of(schemas: st.SearchStrategy, size: int) -> st.SearchStrategy:
    return st.lists(st.tuples(enforceable(schemas), EXTRA_TOKENS, st.integers(0, 2**31)), min_size=size,
                    max_size=size)


@BATCHES
@given(cases=cases_of(SCHEMAS, 40))
def test_response_format_answers_validate_under_any_budget_streamed_and_not(api_base, cases):
    results = asyncio.run(both(api_base, [(response_format(s), extra, seed) for s, extra, seed in cases]))
    for (schema, _, _), (budget, whole, pieces) in zip(cases, results):
        case = f"schema {json.dumps(schema)}, max_tokens {budget}: {whole.message.content!r}"
        jsonschema.validate(json.loads(whole.message.content), schema)
        assert streamed_content(pieces) == whole.message.content, case
        assert pieces[-1].finish_reason == whole.finish_reason, case
        assert whole.finish_reason in ("stop", "length"), case
    assert any(whole.finish_reason == "length" for _, whole, _ in results)


@pytest.mark.parametrize("choice", ["named", "required"])
@BATCHES
@given(cases=cases_of(OBJECT_SCHEMAS, 25))
def test_forced_tool_call_arguments_validate_under_any_budget_streamed_and_not(api_base, choice, cases):
    results = asyncio.run(both(api_base, [(forced_call(s, choice), extra, seed) for s, extra, seed in cases]))
    for (schema, _, _), (budget, whole, pieces) in zip(cases, results):
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
        case = f"parameters {json.dumps(schema)}, max_tokens {budget}: {calls!r}"
        assert calls and {name for name, _ in calls} == {"record"}, case
        assert len(calls) == 1 or choice == "required", case  # parallel calls: one or more
        for _, arguments in calls:
            jsonschema.validate(json.loads(arguments), schema)
        assert streamed_calls(pieces) == calls, case
        assert whole.finish_reason in ("tool_calls", "length"), case
        assert pieces[-1].finish_reason == whole.finish_reason, case
    assert any(whole.finish_reason == "length" for _, whole, _ in results)


def test_an_answer_the_budget_ended_says_length_streamed_and_not(api_base):
    schema = {"type": "object", "required": ["story"], "properties": {"story": {"type": "string"}}}
    results = asyncio.run(both(api_base, [(response_format(schema), 6, seed) for seed in range(12)]))
    ended = [(whole, pieces) for _, whole, pieces in results if whole.finish_reason == "length"]
    assert ended, "no answer ran into the budget"
    for whole, pieces in ended:
        assert isinstance(json.loads(whole.message.content)["story"], str)
        assert pieces[-1].finish_reason == "length"


@pytest.mark.parametrize("body", [response_format({"type": "object", "required": ["a"],
                                                   "properties": {"a": {"enum": ["a long enough value"]}}}),
                                  forced_call({"type": "object", "required": ["a"],
                                               "properties": {"a": {"enum": ["a long enough value"]}}})],
                         ids=["response_format", "tool_call"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_budget_under_the_shortest_answer_is_400_naming_the_minimum(http: httpx.Client, body, stream):
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 3,
                                                       "stream": stream, **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == "max_tokens"
    needed = int(MINIMUM.search(error["message"]).group(1))
    assert needed > 3 and "max_tokens is 3" in error["message"]
