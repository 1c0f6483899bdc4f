"""Qwen3-Coder / Qwen3.5 XML tool calls, on outputs in the format the real template renders, at
every split, with each value typed by the tool's schema."""

from __future__ import annotations

import json

import pytest

from parser_streams import Result, check_every_split, run
from tailrace.serving.parsers.qwen3_xml import Qwen3XmlToolParser, typed_value

TOOLS = {
    "get_weather": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}}},
    "run": {"type": "object", "properties": {"code": {"type": "string"}, "options": {"type": "object"},
                                            "ids": {"type": "array"}, "scale": {"type": "number"}}},
    "now": {},
}


def call(name: str, **parameters: str) -> str:
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


FIXTURES = {
    "content_only": ("Paris is sunny.", Result("Paris is sunny.")),
    "one_call_typed": (call("get_weather", city="Paris", days="3", metric="true"),
                       Result(calls=[("get_weather", '{"city": "Paris", "days": 3, "metric": true}')])),
    "text_then_two_calls": (
        "Checking.\n\n" + call("get_weather", city="New York") + "\n" + call("now"),
        Result("Checking.", calls=[("get_weather", '{"city": "New York"}'), ("now", "{}")])),
    "multiline_code_with_markup_and_unicode": (
        call("run", code="if a < b:\n    print('</tool_call> 日本 😀')", options='{"x": [1, 2]}', ids="[3, 4]",
             scale="2.5"),
        Result(calls=[("run", json.dumps({"code": "if a < b:\n    print('</tool_call> 日本 😀')",
                                          "options": {"x": [1, 2]}, "ids": [3, 4], "scale": 2.5},
                                         ensure_ascii=False))])),
    "a_python_literal_where_the_schema_wants_an_object": (
        call("run", options="{'verbose': True}"), Result(calls=[("run", '{"options": {"verbose": true}}')])),
    "an_undeclared_parameter_stays_a_string": (call("now", tz="42"), Result(calls=[("now", '{"tz": "42"}')])),
    "a_value_not_of_its_type_stays_a_string": (call("get_weather", days="three"),
                                              Result(calls=[("get_weather", '{"days": "three"}')])),
    "a_block_that_is_no_function_stays_text": ("<tool_call>\nnot a call\n</tool_call>",
                                               Result("<tool_call>\nnot a call\n</tool_call>")),
    "near_tags_are_text": ("Use <tool_call or <function= in prose", Result("Use <tool_call or <function= in prose")),
    "cut_off_inside_a_value": ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",
                               Result(calls=[("get_weather", '{"city": "Par"}')])),
    "cut_off_in_the_name_is_text": ("<tool_call>\n<function=get_wea", Result("<tool_call>\n<function=get_wea")),
    "a_function_without_the_tool_call_wrapper": ("Checking.\n<function=get_weather>\n<parameter=city>\nParis\n"
                                                 "</parameter>\n</function>",
                                                 Result("Checking.", calls=[("get_weather", '{"city": "Paris"}')])),
    "missing_closing_tags_are_forgiven": ("<tool_call>\n<function=now>\n</function>\nDone.",
                                          Result("Done.", calls=[("now", "{}")])),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_qwen3_xml_fixture_parses_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(lambda: Qwen3XmlToolParser(TOOLS), text, expected)


def test_the_name_goes_out_before_the_parameters_are_written():
    parser = Qwen3XmlToolParser(TOOLS)
    first = parser.feed("<tool_call>\n<function=get_weather>\n<parameter=city>\nPa")
    assert [(c.name, c.arguments) for c in first.tool_calls] == [("get_weather", "")]
    second = parser.feed("ris\n</parameter>\n")
    assert [c.arguments for c in second.tool_calls] == ['{"city": "Paris"']


def test_arguments_always_join_to_a_json_object():
    result = run(Qwen3XmlToolParser(TOOLS), [call("get_weather", city="a\"b", days="-1")])
    assert json.loads(result.calls[0][1]) == {"city": 'a"b', "days": -1}


@pytest.mark.parametrize(("text", "schema", "value"), [
    ("null", {"type": "integer"}, None), ("null", {"type": "string"}, "null"),
    ("7", {"type": ["integer", "null"]}, 7), ("1e3", {"type": "number"}, 1000.0),
    ("True", {"type": "boolean"}, True), ("[1, 'a']", {"type": "array"}, [1, "a"]),
    (" spaced ", {"type": "string"}, " spaced "), ("5", None, "5"),
])
def test_values_take_their_schemas_type(text, schema, value):
    assert typed_value(text, schema) == value
