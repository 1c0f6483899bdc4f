"""Tool calls the grammar forced (tool_choice required / named), at every split."""

from __future__ import annotations

import functools

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.forced import NamedCallParser, RequiredCallsParser


def test_named_call_is_the_whole_answer_as_arguments():
    text = '{"city": "Paris", "days": [1, 2]}'
    check_every_split(functools.partial(NamedCallParser, "get_weather"), text, Result(calls=[("get_weather", text)]))


def test_named_call_is_announced_even_when_nothing_was_generated():
    check_every_split(functools.partial(NamedCallParser, "now"), "", Result(calls=[("now", "")]))


def test_required_calls_array_gives_each_call_its_index():
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}]'
    check_every_split(RequiredCallsParser, text,
                      Result(calls=[("get_weather", '{"city": "Paris"}'), ("now", "{}")]))


def test_required_calls_cut_off_keep_the_arguments_so_far():
    text = '[{"name": "get_weather", "parameters": {"city": "Pa'
    check_every_split(RequiredCallsParser, text, Result(calls=[("get_weather", '{"city": "Pa')]))
