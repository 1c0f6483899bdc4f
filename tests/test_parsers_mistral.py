"""Mistral `[TOOL_CALLS]` in both tokenizer generations' forms, at every split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.mistral import MistralToolParser

FIXTURES = {
    "v3_array_of_calls": (
        '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        Result(calls=[("get_weather", '{"city": "Paris"}'), ("get_time", "{}")])),
    "v11_name_then_args": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "UTC"}',
                           Result(calls=[("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "UTC"}')])),
    "v11_with_call_id": ('[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}',
                         Result(calls=[("get_weather", '{"city": "Paris"}')])),
    "text_before_the_call": ('Sure.\n[TOOL_CALLS]get_weather[ARGS]{"city": "[Paris]"}',
                             Result("Sure.", calls=[("get_weather", '{"city": "[Paris]"}')])),
    "plain_answer": ("Bonjour [TOOLS] is not a tag", Result("Bonjour [TOOLS] is not a tag")),
    "array_that_is_no_call_stays_text": ("[TOOL_CALLS] [1, 2]", Result("[TOOL_CALLS][1, 2]")),
    "cut_off_inside_args": ('[TOOL_CALLS]search[ARGS]{"q": "cats', Result(calls=[("search", '{"q": "cats')])),
    "cut_off_before_args_is_text": ("[TOOL_CALLS]sear", Result("[TOOL_CALLS]sear")),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_mistral_fixture_parses_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(MistralToolParser, text, expected)
