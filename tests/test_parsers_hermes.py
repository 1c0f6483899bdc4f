"""Hermes / Qwen `<tool_call>` blocks, on hand-written outputs in the format, at every split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.hermes import HermesToolParser

WEATHER = '{"city": "Paris", "unit": "celsius"}'

FIXTURES = {
    "content_only": ("The weather in Paris is sunny today.", Result("The weather in Paris is sunny today.")),
    "one_call": (f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
                 Result(calls=[("get_weather", WEATHER)])),
    "text_then_two_calls": (
        'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>',
        Result("Let me check both.", calls=[("get_weather", '{"city": "Paris"}'),
                                            ("get_time", '{"tz": "Europe/Paris"}')])),
    "braces_quotes_and_unicode_in_arguments": (
        '<tool_call>\n{"name": "run", "arguments": {"code": "if x: {\\"a\\": \\"}\\"}", '
        '"list": [1, {"b": [2, 3]}], "text": "日本 😀"}}\n</tool_call>',
        Result(calls=[("run", '{"code": "if x: {\\"a\\": \\"}\\"}", "list": [1, {"b": [2, 3]}], "text": "日本 😀"}')])),
    "name_after_arguments": ('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>',
                             Result(calls=[("search", '{"q": 1}')])),
    "call_without_arguments": ('<tool_call>\n{"name": "now"}\n</tool_call>', Result(calls=[("now", "{}")])),
    "arguments_as_a_json_string": ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',
                                   Result(calls=[("f", '{"x": 1}')])),
    "block_that_is_no_call_stays_text": ("<tool_call>\nnot json\n</tool_call>",
                                         Result("<tool_call>\nnot json\n</tool_call>")),
    "object_without_name_stays_text": ('<tool_call>{"x": 1}</tool_call>', Result('<tool_call>{"x": 1}</tool_call>')),
    "near_tags_are_text": ("Use <tool> or <tool_c tags", Result("Use <tool> or <tool_c tags")),
    "prose_naming_the_tag_keeps_its_spacing": ("Wrap it in <tool_call> tags.", Result("Wrap it in <tool_call> tags.")),
    "trailing_whitespace_of_plain_text_is_kept": ("Done.\n\n", Result("Done.\n\n")),
    "cut_off_inside_arguments": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                                 Result(calls=[("get_weather", '{"city": "Par')])),
    "cut_off_before_the_name_is_text": ('<tool_call>\n{"name": "get_wea', Result('<tool_call>\n{"name": "get_wea')),
    "text_after_a_call": ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\nDone.',
                          Result("\nDone.", calls=[("a", "{}")])),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_hermes_fixture_parses_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(HermesToolParser, text, expected)


def test_arguments_stream_before_the_call_is_complete():
    parser = HermesToolParser()
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"ci')
    assert [(c.index, c.name, c.arguments) for c in first.tool_calls] == [(0, "get_weather", '{"ci')]
    second = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [(c.index, c.name, c.arguments) for c in second.tool_calls] == [(0, None, 'ty": "Paris"}')]


def test_a_possible_tag_start_is_held_back_until_ruled_out():
    parser = HermesToolParser()
    assert parser.feed("Hello <tool_").content == "Hello"
    assert parser.feed("box>").content == " <tool_box>"
