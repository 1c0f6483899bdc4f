"""Pythonic tool calls (Llama 3.2 and 4): `[f(a=1), g()]`, at every split."""

from __future__ import annotations

import json

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.pythonic import PythonicToolParser

FIXTURES = {
    "content_only": ("It is sunny in Paris.", Result("It is sunny in Paris.")),
    "one_call": ('[get_weather(city="Paris", days=3, metric=True)]',
                 Result(calls=[("get_weather", '{"city": "Paris", "days": 3, "metric": true}')])),
    "two_calls_and_nested_literals": (
        "[run(code='print(\"a, b)\")', opts={'x': [1, (2, 3)], 'y': None}), get_time()]",
        Result(calls=[("run", json.dumps({"code": 'print("a, b)")', "opts": {"x": [1, [2, 3]], "y": None}})),
                      ("get_time", "{}")])),
    "llama4_tags": ('<|python_start|>[get_time(tz="UTC")]<|python_end|>',
                    Result(calls=[("get_time", '{"tz": "UTC"}')])),
    "a_list_of_numbers_is_content": ("[1, 2, 3] are the first numbers.", Result("[1, 2, 3] are the first numbers.")),
    "a_markdown_link_is_content": ("[the docs](https://example.com) say so",
                                   Result("[the docs](https://example.com) say so")),
    "unicode_values": ('[say(text="日本 😀")]', Result(calls=[("say", '{"text": "日本 😀"}')])),
    "cut_off_in_a_value": ('[get_weather(city="Par', Result(calls=[("get_weather", "{}")])),
    "cut_off_after_a_value": ('[get_weather(city="Paris", ', Result(calls=[("get_weather", '{"city": "Paris"}')])),
    "a_positional_argument_ends_the_call": ('[get_weather("Paris")]',
                                            Result('"Paris")]', calls=[("get_weather", "{}")])),
    "text_after_the_calls": ("[get_time()]\nDone.", Result("\nDone.", calls=[("get_time", "{}")])),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_pythonic_calls_parse_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(PythonicToolParser, text, expected)
