"""DeepSeek V3 / R1 and V3.1 tool calls between their special tokens, at every split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.deepseek import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP, DeepSeekToolParser

WEATHER = '{"city": "Paris"}'
NESTED = '{"a": [1, {"b": "日本 ```"}]}'


def v3(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{arguments}\n```{CALL_END}"


def v31(name: str, arguments: str) -> str:
    return f"{CALL_BEGIN}{name}{SEP}{arguments}{CALL_END}"


FIXTURES = {
    "content_only": ("Sunny.", Result("Sunny.")),
    "v3_two_calls_after_text": (
        f"Checking.\n{CALLS_BEGIN}{v3('get_weather', WEATHER)}\n{v3('now', '{}')}{CALLS_END}",
        Result("Checking.", calls=[("get_weather", WEATHER), ("now", "{}")])),
    "v31_one_call": (f"{CALLS_BEGIN}{v31('get_weather', WEATHER)}{CALLS_END}",
                     Result(calls=[("get_weather", WEATHER)])),
    "nested_json_and_unicode": (f"{CALLS_BEGIN}{v3('run', NESTED)}{CALLS_END}", Result(calls=[("run", NESTED)])),
    "text_after_the_calls": (f"{CALLS_BEGIN}{v31('now', '{}')}{CALLS_END}\nDone.",
                             Result("\nDone.", calls=[("now", "{}")])),
    "cut_off_in_the_arguments": (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}get_weather\n```json\n{{\"city\": \"Pa",
                                 Result(calls=[("get_weather", '{"city": "Pa')])),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_deepseek_calls_parse_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(DeepSeekToolParser, text, expected)
