"""Which parsers read a server's answers (serving/parsers/choice.py): decided once from the chat
template where the flags say auto, and said in one start-up line."""

from __future__ import annotations

import json

import pytest

from tailrace.cli import build_parser, chat_options_from
from tailrace.serving.answers import plan_answer
from tailrace.serving.context import ChatOptions
from tailrace.serving.parsers.choice import detect_reasoning_parser, detect_tool_parser, resolve_formats
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED

QWEN3_CODER = ("{{ '<tool_call>\\n<function=' + name + '>\\n' }}{% for k in args %}{{ '<parameter=' + k + '>' }}"
               "{% endfor %}")


@pytest.mark.parametrize(("template", "name"), [
    (QWEN3_CODER, "qwen3_coder"), ("{{ '<tool_call>' + call | tojson }}", "hermes"),
    ("[TOOL_CALLS] {{ calls }}", "mistral"), ("<|python_tag|>{{ call }}", "llama3"), ("{{ messages }}", None),
    ("<|tool_call|>{{ c }}<|/tool_call|>", "phi4_mini_json"), ("<|tool|>{{ tools }}<|/tool|>", "phi4_mini_json"),
    ("{{ '<|tool_call|>' + calls | tojson }}", "granite"), ("<|python_start|>{{ c }}<|python_end|>", "pythonic"),
    ('[func_name1(params_name1=params_value1), func_name2(params)] "parameters"', "pythonic"),
    (None, None),
])
def test_the_tool_call_format_is_the_one_the_template_writes(template, name):
    found, why = detect_tool_parser(template)
    assert found == name and why.startswith("the chat template")


def test_reasoning_is_parsed_where_the_template_writes_think_blocks():
    assert detect_reasoning_parser("{{ '<think>\\n' }}")[0] == "think"
    assert detect_reasoning_parser("{{ '<|channel>thought\\n' + text }}")[0] == "gemma4"
    assert detect_reasoning_parser("{{ '<|channel|>analysis' }}")[0] == "harmony"
    assert detect_reasoning_parser("{{ messages }}")[0] is None


def test_auto_is_decided_at_start_up_and_said_in_one_line_while_flags_are_kept():
    options, line = resolve_formats(ChatOptions(), QWEN3_CODER + "<think>")
    assert (options.tool_call_parser, options.reasoning_parser) == ("qwen3_coder", "think")
    assert line.startswith("answer formats: tool calls = qwen3_coder (the chat template shows it")
    assert "reasoning = think (the chat template writes <think> blocks)" in line
    options, line = resolve_formats(ChatOptions(tool_call_parser="mistral", reasoning_parser=None), QWEN3_CODER)
    assert (options.tool_call_parser, options.reasoning_parser) == ("mistral", None)
    assert "tool calls = mistral (--tool-call-parser)" in line
    options, _ = resolve_formats(ChatOptions(), "{{ messages }}")
    assert (options.tool_call_parser, options.reasoning_parser) == ("none", None)


@pytest.mark.parametrize(("flag", "reasoning"), [("deepseek_r1", "think"), ("qwen3", "think"), ("none", None),
                                                 ("auto", "auto")])
def test_vllms_reasoning_parser_names_are_accepted(flag, reasoning):
    args = build_parser().parse_args(["serve", "--reasoning-parser", flag, "--tool-call-parser", "qwen3_coder"])
    options = chat_options_from(args)
    assert (options.reasoning_parser, options.tool_call_parser) == (reasoning, "qwen3_coder")


TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]


def planned(options: ChatOptions, prompt: str, **body):
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                    **body})
    return plan_answer(request, load_tokenizer(str(EMBEDDED), chat_template="{{ '<think>' }}"), options, prompt)


def test_a_template_that_shows_one_call_a_turn_gets_one_call_even_where_the_client_allows_more():
    plan = planned(ChatOptions(parallel_calls=False), "", tools=TOOLS, tool_choice="required")
    assert json.loads(plan.structured.json_schema)["maxItems"] == 1 and not plan.format.parallel_calls
    plan = planned(ChatOptions(), "", tools=TOOLS, tool_choice="required")
    assert "maxItems" not in json.loads(plan.structured.json_schema) and plan.format.parallel_calls
    assert not planned(ChatOptions(), "", tools=TOOLS, parallel_tool_calls=False).format.parallel_calls


def test_an_answer_has_no_thinking_where_the_prompt_closed_it_or_the_client_asked_for_none():
    think = ChatOptions(reasoning_parser="think")
    assert planned(think, "<|im_start|>assistant\n").format.thinking is False  # the answer's start decides
    closed = planned(think, "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert (closed.format.thinking, closed.thinking) == (None, None)
    unasked = planned(think, "<|im_start|>assistant\n", reasoning_effort="none")
    assert (unasked.format.thinking, unasked.thinking) == (None, None)
    assert planned(think, "<|im_start|>assistant\n<think>\n", reasoning_effort="none").format.thinking is True
