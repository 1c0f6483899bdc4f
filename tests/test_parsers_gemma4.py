"""Gemma 4's `<|tool_call>call:NAME{key:value}<tool_call|>`, at every split, with its own
notation for values read as JSON."""

from __future__ import annotations

import json

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.gemma4 import Gemma4ToolParser, gemma_value

Q = '<|"|>'
FIXTURES = {
    "content_only": ("It is sunny.", Result("It is sunny.")),
    "one_call": (f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:3,metric:true}}<tool_call|>",
                 Result(calls=[("get_weather", '{"city": "Paris", "days": 3, "metric": true}')])),
    "text_then_two_calls_with_nested_values": (
        f"Checking.<|tool_call>call:run{{code:{Q}if a, b: {{c}}{Q},opts:{{{Q}x{Q}:[1,{Q}y,z{Q}],deep:{{k:false}}}}}}"
        f"<tool_call|><|tool_call>call:now{{}}<tool_call|>",
        Result("Checking.", calls=[("run", json.dumps({"code": "if a, b: {c}", "opts": {"x": [1, "y,z"],
                                                                                        "deep": {"k": False}}})),
                                   ("now", "{}")])),
    "unicode": (f"<|tool_call>call:say{{text:{Q}日本 😀{Q}}}<tool_call|>",
                Result(calls=[("say", '{"text": "日本 😀"}')])),
    "a_tag_without_a_call_is_text": ("Use <|tool_call> carefully.", Result("Use <|tool_call> carefully.")),
    "cut_off_in_a_value": (f"<|tool_call>call:get_weather{{city:{Q}Par",
                           Result(calls=[("get_weather", '{"city": "Par"}')])),
    "text_after_a_call": ("<|tool_call>call:now{}<tool_call|>Done.", Result("Done.", calls=[("now", "{}")])),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_gemma4_calls_parse_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(Gemma4ToolParser, text, expected)


@pytest.mark.parametrize(("text", "value"), [
    (f"{Q}a{Q}", "a"), ("3.5", 3.5), ("-2", -2), ("true", True), ("None", None), ("[]", []), ("{}", {}),
    (f"{{a:[{Q}x{Q},{{b:1}}],{Q}c d{Q}:null}}", {"a": ["x", {"b": 1}], "c d": None}), ("bare words", "bare words"),
    ("{a:", "{a:"), (f"[{Q}unclosed", f"[{Q}unclosed"),
])
def test_gemma_values_read_as_json(text, value):
    assert gemma_value(text) == value
