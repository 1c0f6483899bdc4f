"""Phi-4-mini's `<|tool_call|>[...]<|/tool_call|>` and Granite 3's `<|tool_call|>[...]`, at every
split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.tagged_json import TaggedJsonToolParser

WEATHER = '{"city": "Paris"}'
PHI4 = {
    "content_only": ("It is sunny.", Result("It is sunny.")),
    "an_array_of_two_calls": (
        '<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}]'
        "<|/tool_call|>", Result(calls=[("get_weather", WEATHER), ("now", "{}")])),
    "one_object_after_text": ('Checking.<|tool_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}'
                              "<|/tool_call|>", Result("Checking.", calls=[("get_weather", WEATHER)])),
    "two_tagged_blocks": ('<|tool_call|>[{"name": "now"}]<|/tool_call|>\n<|tool_call|>[{"name": "now"}]<|/tool_call|>',
                          Result(calls=[("now", "{}"), ("now", "{}")])),
    "a_tag_without_a_call_is_text": ("<|tool_call|>none today", Result("<|tool_call|>none today")),
    "cut_off_in_the_arguments": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Pa',
                                 Result(calls=[("get_weather", '{"city": "Pa')])),
}
GRANITE = {
    "no_closing_tag": ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
                       Result(calls=[("get_weather", WEATHER)])),
    "text_after_the_calls": ('<|tool_call|>[{"name": "now", "arguments": {}}] Done.',
                             Result(" Done.", calls=[("now", "{}")])),
}


FORMATS = {"phi4": (TaggedJsonToolParser, PHI4), "granite": (lambda: TaggedJsonToolParser(end=None), GRANITE)}


@pytest.mark.parametrize(("form", "name"), [(form, name) for form, (_, cases) in FORMATS.items() for name in cases])
def test_tagged_json_calls_parse_the_same_at_every_split(form, name):
    make, cases = FORMATS[form]
    text, expected = cases[name]
    check_every_split(make, text, expected)
