"""The forms small models drift into (a ```json fence, a bare JSON call, `<function=NAME>{...}`),
read only as calls to the request's tools, at every split, in front of each model's own format."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.choice import tool_parser_for

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}, "now": {}}
WEATHER = '{"city": "Paris"}'

FIXTURES = {
    "a_fenced_call": ('```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
                      Result(calls=[("get_weather", WEATHER)])),
    "a_fence_without_a_language_and_parameters": ('```\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
                                                 Result(calls=[("get_weather", WEATHER)])),
    "a_bare_call_object": ('{"name": "get_weather", "arguments": {"city": "Paris"}}',
                           Result(calls=[("get_weather", WEATHER)])),
    "a_bare_array_of_calls": ('[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now"}]',
                              Result(calls=[("get_weather", WEATHER), ("now", "{}")])),
    "a_function_tag_with_json": ('<function=get_weather>{"city": "Paris"}</function>',
                                 Result(calls=[("get_weather", WEATHER)])),
    "two_fences_in_a_row": ('```json\n{"name": "now"}\n```\n\n```json\n{"name": "now", "arguments": {}}\n```\n',
                            Result(calls=[("now", "{}"), ("now", "{}")])),
    "an_unknown_name_is_content": ('```json\n{"name": "delete_all", "arguments": {}}\n```',
                                   Result('```json\n{"name": "delete_all", "arguments": {}}\n```')),
    "ordinary_json_is_content": ('{"city": "Paris", "population": 2100000}',
                                 Result('{"city": "Paris", "population": 2100000}')),
    "a_python_fence_is_content": ("```python\nprint(1)\n```", Result("```python\nprint(1)\n```")),
    "prose_is_content": ("  It is sunny in Paris.", Result("  It is sunny in Paris.")),
    "a_call_then_prose": ('```json\n{"name": "now"}\n```\nI asked for the time.',
                          Result("\nI asked for the time.", calls=[("now", "{}")])),
    "an_unclosed_fence_is_content": ('```json\n{"name": "now"}', Result('```json\n{"name": "now"}')),
    "extra_keys_are_no_call": ('{"name": "now", "arguments": {}, "id": 3}',
                               Result('{"name": "now", "arguments": {}, "id": 3}')),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_a_drifted_call_is_read_only_for_a_known_tool_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(tool_parser_for(None, TOOLS), text, expected)


def test_the_models_own_format_still_parses_behind_the_fallback_and_numbers_after_it():
    text = ('```json\n{"name": "now"}\n```\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call>")
    check_every_split(tool_parser_for("hermes", TOOLS), text, Result(calls=[("now", "{}"), ("get_weather", WEATHER)]))


def test_llama3s_own_bare_json_is_left_to_its_parser():
    text = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    check_every_split(tool_parser_for("llama3", TOOLS), text, Result(calls=[("get_weather", WEATHER)]))
