"""Thinking split off the answer (<think>...</think>, Gemma 4's thought channel), alone and before
tool calls, at every split."""

from __future__ import annotations

import functools

import pytest

from parser_streams import Result, check_every_split
from tailrace.serving.parsers import Parsed
from tailrace.serving.parsers.choice import AnswerFormat
from tailrace.serving.parsers.hermes import HermesToolParser
from tailrace.serving.parsers.reasoning import REASONING_TAGS, THINK, ThinkParser, ThinkTags, thinking_at_start


class ThinkOnly:
    """The think parser in the shape the split harness reads."""

    def __init__(self, open_at_start: bool, tags: ThinkTags = THINK) -> None:
        self._parser = ThinkParser(open_at_start, tags)

    def feed(self, text: str) -> Parsed:
        reasoning, content = self._parser.feed(text)
        return Parsed(content=content, reasoning=reasoning)

    def finish(self) -> Parsed:
        reasoning, content = self._parser.finish()
        return Parsed(content=content, reasoning=reasoning)


FIXTURES = {
    "qwen3_think_then_answer": (False, "<think>\nLet me add: 2+2=4.\n</think>\n\nThe answer is 4.",
                                Result("The answer is 4.", "\nLet me add: 2+2=4.\n")),
    "r1_prompt_opened_the_block": (True, "Hmm, 2+2.\n</think>\n\n4", Result("4", "Hmm, 2+2.\n")),
    "no_thinking_at_all": (False, "Just the answer.", Result("Just the answer.")),
    "a_later_think_tag_is_answer_text": (False, "Answer <think>x</think>", Result("Answer <think>x</think>")),
    "closing_tag_in_the_answer_is_text": (False, "<think>a</think>b </think> c", Result("b </think> c", "a")),
    "cut_off_while_thinking": (False, "<think>still going</thi", Result(reasoning="still going</thi")),
    "empty_answer_after_thinking": (False, "<think>only thoughts</think>\n", Result(reasoning="only thoughts")),
    "start_of_a_tag_that_never_came": (False, "<thin", Result("<thin")),
}


GEMMA4 = {
    "thought_then_answer": ("<|channel>thought\nParis is in France.\n<channel|>Sunny.",
                            Result("Sunny.", "Paris is in France.\n")),
    "no_thought": ("Sunny.", Result("Sunny.")),
    "a_think_tag_is_answer_text": ("<think>x</think>", Result("<think>x</think>")),
}


@pytest.mark.parametrize("name", FIXTURES)
def test_reasoning_fixture_splits_the_same_at_every_split(name):
    open_at_start, text, expected = FIXTURES[name]
    check_every_split(functools.partial(ThinkOnly, open_at_start), text, expected)


@pytest.mark.parametrize("name", GEMMA4)
def test_gemma4s_thought_channel_splits_the_same_at_every_split(name):
    text, expected = GEMMA4[name]
    check_every_split(functools.partial(ThinkOnly, False, REASONING_TAGS["gemma4"]), text, expected)


def test_tool_calls_are_parsed_from_the_answer_only():
    text = ('<think>I could write <tool_call>{"name": "x", "arguments": {}}</tool_call> here.</think>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    expected = Result(reasoning='I could write <tool_call>{"name": "x", "arguments": {}}</tool_call> here.',
                      calls=[("get_weather", '{"city": "Paris"}')])
    check_every_split(AnswerFormat(HermesToolParser, thinking=False).parser, text, expected)


@pytest.mark.parametrize("prompt,expected", [
    ("<|im_start|>assistant\n", False),
    ("<｜Assistant｜><think>\n", True),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # Qwen3's enable_thinking=false
    ("<|im_start|>assistant\n<think>a</think>x<|im_end|>\n<|im_start|>assistant\n", False),
    ("earlier <think>a</think> then <think>\n", True),
])
def test_thinking_at_start_reads_the_last_tag_of_the_prompt(prompt, expected):
    assert thinking_at_start(prompt) is expected
