"""Structured output and tool calls through a real server and the official clients.

The acceptance run: for five schemas, 50 seeded requests each, streamed and not, at temperature 1:
every output parses and validates, and the stream (same seed, so the same sample) joins to
exactly the non-stream answer. Every string and array in the schemas is bounded and max_tokens
covers the longest output they allow, so a valid, complete answer is guaranteed, not likely.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from .conftest import API_KEY, MODEL

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning")]

REQUESTS_PER_SCHEMA = 50
CONCURRENCY = 24
MAX_TOKENS = 512  # over the longest output any schema here allows (a string char is at most ~6 tokens)
MESSAGES = [{"role": "user", "content": "Answer in JSON."}]

SHORT = {"type": "string", "maxLength": 16}
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_objects": {
        "type": "object", "additionalProperties": False, "required": ["user", "active"],
        "properties": {
            "user": {"type": "object", "additionalProperties": False, "required": ["name", "address"],
                     "properties": {"name": SHORT, "address": {
                         "type": "object", "additionalProperties": False, "required": ["city", "zip"],
                         "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
            "active": {"type": "boolean"}}},
    "enums": {
        "type": "object", "additionalProperties": False, "required": ["color", "size", "priority"],
        "properties": {"color": {"enum": ["red", "green", "blue"]},
                       "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
                       "priority": {"type": "integer", "enum": [1, 2, 3]}}},
    "arrays": {
        "type": "object", "additionalProperties": False, "required": ["tags", "grid"],
        "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                "minItems": 1, "maxItems": 4},
                       "grid": {"type": "array", "maxItems": 3, "items": {
                           "type": "array", "maxItems": 3, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
    "bounded_numbers": {
        "type": "object", "additionalProperties": False, "required": ["age", "rating", "balance"],
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "rating": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 6},
                       # multipleOf 0.25 bounds the fraction digits and is exact in binary floating point.
                       "balance": {"type": "number", "minimum": -1000, "maximum": 1000, "multipleOf": 0.25}}},
    "optional_fields": {
        "type": "object", "additionalProperties": False, "required": ["id"],
        "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "nickname": SHORT,
                       "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
                       "verified": {"type": "boolean"}}},
}

WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                      "properties": {"city": SHORT, "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast for a city",
                                           "parameters": WEATHER_PARAMETERS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                           "parameters": {"type": "object", "additionalProperties": False,
                                                          "required": ["timezone"],
                                                          "properties": {"timezone": SHORT}}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)


async def sample_both(api_base: str, seeds: list[int], **body: Any) -> list[tuple[Any, list[Any]]]:
    """For each seed: the non-stream choice and the streamed chunks' choices."""
    client = openai.AsyncOpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)
    gate = asyncio.Semaphore(CONCURRENCY)
    args = {"model": MODEL, "messages": MESSAGES, "temperature": 1.0, "max_tokens": MAX_TOKENS, **body}

    async def one(seed: int) -> tuple[Any, list[Any]]:
        async with gate:
            whole = await client.chat.completions.create(seed=seed, **args)
            stream = await client.chat.completions.create(seed=seed, stream=True, **args)
            return whole.choices[0], [c.choices[0] for c in [chunk async for chunk in stream] if c.choices]

    try:
        return await asyncio.gather(*(one(seed) for seed in seeds))
    finally:
        await client.close()


def streamed_content(pieces: list[Any]) -> str:
    return "".join(p.delta.content or "" for p in pieces)


def streamed_calls(pieces: list[Any]) -> list[tuple[str, str]]:
    calls: list[list[str]] = []
    for delta in (d for p in pieces for d in p.delta.tool_calls or []):
        if delta.index == len(calls):
            calls.append([delta.function.name, ""])
        calls[delta.index][1] += delta.function.arguments or ""
    return [(name, arguments) for name, arguments in calls]


@pytest.mark.parametrize("name", SCHEMAS)
def test_every_sampled_output_validates_streamed_and_not(api_base: str, name: str) -> None:
    schema = SCHEMAS[name]
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
    results = asyncio.run(sample_both(api_base, list(range(REQUESTS_PER_SCHEMA)), response_format=response_format))
    for whole, pieces in results:
        assert whole.finish_reason == "stop"
        jsonschema.validate(json.loads(whole.message.content), schema)
        assert streamed_content(pieces) == whole.message.content
        assert pieces[-1].finish_reason == "stop"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_and_stream_to_the_same_arguments(api_base: str, tool_choice: Any) -> None:
    results = asyncio.run(sample_both(api_base, list(range(20)), tools=TOOLS, tool_choice=tool_choice))
    for whole, pieces in results:
        assert whole.finish_reason == "tool_calls"
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert calls and whole.message.content is None
        for called, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMETERS[called])
        if isinstance(tool_choice, dict):
            assert [called for called, _ in calls] == ["get_weather"]
        assert streamed_calls(pieces) == calls
        assert pieces[-1].finish_reason == "tool_calls"


def test_unsupported_schema_feature_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}})
    assert err.value.param == "response_format"
    assert '"not"' in err.value.message


# ---- the SDK's helpers and LangChain -------------------------------------------------------------

class City(BaseModel):
    name: str = Field(max_length=16)
    country: Literal["FR", "DE", "JP"]
    population: int = Field(ge=0, le=40_000_000)


class GetWeather(BaseModel):
    """Weather forecast for a city."""

    city: str = Field(max_length=16)
    unit: Literal["celsius", "fahrenheit"]


def test_sdk_parse_with_a_pydantic_response_format(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=MESSAGES, response_format=City,
                                               max_tokens=MAX_TOKENS, seed=1)
    assert isinstance(completion.choices[0].message.parsed, City)


def test_sdk_stream_helper_with_a_pydantic_response_format(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, response_format=City,
                                        max_tokens=MAX_TOKENS, seed=2) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, City)


def test_sdk_parse_with_a_strict_pydantic_tool(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}}, max_tokens=MAX_TOKENS, seed=3)
    call, = completion.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


@tool
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
    """Weather forecast for a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def chat_model(api_base: str) -> ChatOpenAI:
    return ChatOpenAI(model=MODEL, base_url=api_base, api_key=API_KEY, max_tokens=MAX_TOKENS, max_retries=0,
                      seed=4)


def test_langchain_bind_tools_gets_tool_calls(chat_model: ChatOpenAI) -> None:
    message = chat_model.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Paris?")
    call, = message.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    assert message.invalid_tool_calls == []


def test_langchain_bind_tools_streams_tool_call_chunks(chat_model: ChatOpenAI) -> None:
    chunks = list(chat_model.bind_tools([get_weather], tool_choice="required").stream("Weather in Paris?"))
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk
    assert [c["name"] for c in message.tool_calls] and message.invalid_tool_calls == []


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output(chat_model: ChatOpenAI, method: str) -> None:
    result = chat_model.with_structured_output(City, method=method).invoke("A city, please.")
    assert isinstance(result, City)
