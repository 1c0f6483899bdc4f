"""Llama 3.x JSON tool calls, on hand-written outputs in the format, at every split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.llama3 import Llama3JsonToolParser

FIXTURES = {
    "one_call": ('{"name": "get_weather", "parameters": {"city": "Paris"}}',
                 Result(calls=[("get_weather", '{"city": "Paris"}')])),
    "python_tag_first": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
                         Result(calls=[("get_weather", '{"city": "Paris"}')])),
    "two_calls_separated_by_semicolon": (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [1, {"z": "}"}]}}',
        Result(calls=[("a", '{"x": 1}'), ("b", '{"y": [1, {"z": "}"}]}')])),
    "leading_whitespace_before_a_call": ('\n\n{"name": "now", "parameters": {}}', Result(calls=[("now", "{}")])),
    "arguments_key_is_read_too": ('{"name": "f", "arguments": {"q": "x"}}', Result(calls=[("f", '{"q": "x"}')])),
    "plain_answer": ("The answer is 42.", Result("The answer is 42.")),
    "plain_answer_with_leading_whitespace": ("  Hello {x}", Result("  Hello {x}")),
    "json_answer_without_name_is_content": ('{"answer": 42}', Result('{"answer": 42}')),
    "text_after_the_calls": ('{"name": "a", "parameters": {}} and more', Result("and more", calls=[("a", "{}")])),
    "cut_off_inside_parameters": ('{"name": "get_weather", "parameters": {"city": "Pa',
                                  Result(calls=[("get_weather", '{"city": "Pa')])),
    "cut_off_before_the_name_is_content": ('{"na', Result('{"na')),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_llama3_fixture_parses_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(Llama3JsonToolParser, text, expected)
