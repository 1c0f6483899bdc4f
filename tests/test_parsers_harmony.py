"""gpt-oss's harmony messages: analysis as reasoning, final as content, commentary to
functions.NAME as calls (only where the request has tools), at every split."""

from __future__ import annotations

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers.harmony import HarmonyParser

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}}}
WEATHER = '{"city":"Paris"}'
ANALYSIS = "<|channel|>analysis<|message|>User asks weather. Use the tool.<|end|>"

FIXTURES = {
    "analysis_then_final": (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>",
                            Result("It is sunny.", "User asks weather. Use the tool.")),
    "a_call_with_the_recipient_after_the_channel": (
        ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + WEATHER + "<|call|>",
        Result(reasoning="User asks weather. Use the tool.", calls=[("get_weather", WEATHER)])),
    "a_call_with_the_recipient_in_the_role_header": (
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant to=functions.get_weather"
        "<|channel|>commentary json<|message|>" + WEATHER + "<|call|>",
        Result(reasoning="Need weather.", calls=[("get_weather", WEATHER)])),
    "a_preamble_is_content_and_two_calls": (
        "<|channel|>commentary<|message|>Checking both.<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|><|start|>assistant<|channel|>"
        "commentary to=functions.now <|constrain|>json<|message|><|call|>",
        Result("Checking both.", calls=[("get_weather", WEATHER), ("now", "{}")])),
    "final_only_with_markup_like_text": ("<|channel|>final<|message|>Use <|end of line|> and <|channel. Done.",
                                         Result("Use <|end of line|> and <|channel. Done.")),
    "plain_text_without_channels": ("Sunny in Paris.", Result("Sunny in Paris.")),
    "cut_off_in_the_analysis": ("<|channel|>analysis<|message|>Thinking ab", Result(reasoning="Thinking ab")),
    "cut_off_in_a_header": (ANALYSIS + "<|start|>assistant<|channel|>fin", Result(reasoning="User asks weather. "
                                                                                  "Use the tool.")),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_harmony_messages_parse_the_same_at_every_split(name):
    text, expected = FIXTURES[name]
    check_every_split(lambda: HarmonyParser(TOOLS), text, expected)


def test_without_tools_a_call_is_content_and_no_markup_leaks():
    text = ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + WEATHER + "<|call|>")
    check_every_split(lambda: HarmonyParser(None), text, Result(WEATHER))
