"""Real chat templates (tests/templates/, with their sources): the format each one teaches is the
one auto-detection picks, and what the template renders for an assistant's tool calls (and
thinking) reads back, through that parser at every split, as exactly those calls."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from parser_streams import check_every_split, run
from tailrace.serving.parsers.choice import AnswerFormat, detect_reasoning_parser, detect_tool_parser, tool_parser_for
from tailrace.serving.parsers.reasoning import REASONING_TAGS, THINK, thinking_at_start
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

TEMPLATES = Path(__file__).parent / "templates"
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The forecast", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "units": {"type": "object"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
CALLS = [("get_weather", {"city": "São Paulo", "days": 3, "units": {"temp": "C"}}), ("get_time", {})]
USER = {"role": "user", "content": "Weather in São Paulo for 3 days, and the time?"}
END_OF_TURN = ("<|im_end|>", "<｜end▁of▁sentence｜>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<turn|>",
               "<|tool_response>")
# What a generation prompt adds for a model not asked to think, which the turn as rendered lacks.
EMPTY_THOUGHT = "<|channel>thought\n<channel|>"  # Gemma 4

# template -> (the tool-call format it teaches, the reasoning parser it gets)
FORMATS = {
    "Qwen3-Coder.jinja": ("qwen3_coder", None),
    "Qwen3.5-4B.jinja": ("qwen3_coder", "think"),
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "think"),
    "Qwen-Qwen2.5-7B-Instruct.jinja": ("hermes", None),
    "HuggingFaceTB-SmolLM3-3B.jinja": (None, "think"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("deepseek_v3", "think"),
    "ibm-granite-granite-3.3-2B-Instruct.jinja": ("granite", "think"),
    "meta-llama-Llama-3.2-3B-Instruct.jinja": ("llama3", None),
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": ("mistral", None),
    "openai-gpt-oss-120b.jinja": ("openai", "harmony"),
    "google-gemma-4-31B-it.jinja": ("gemma4", "gemma4"),
}
# Templates that render an assistant's tool calls in one turn (Granite 3.3's writes only the
# content, and SmolLM3's knows no tools), with how many calls the turn may hold.
# gpt-oss's harmony is read back in tests/test_harmony_serving.py.
ROUND_TRIPS = {name: 2 for name in FORMATS if not name.startswith(("ibm-granite", "HuggingFaceTB", "openai"))}
ROUND_TRIPS["meta-llama-Llama-3.2-3B-Instruct.jinja"] = 1  # "This model only supports single tool-calls at once!"


def template(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize("name", FORMATS)
def test_auto_detection_picks_the_format_the_template_teaches(name):
    assert (detect_tool_parser(template(name))[0], detect_reasoning_parser(template(name))[0]) == FORMATS[name]


def rendered_answer(name: str, calls: list[tuple[str, dict]]) -> tuple[str, str]:
    """The generation prompt, and what the template writes for the assistant turn that makes
    `calls`, as the model would write it after that prompt."""
    tokenizer = load_tokenizer(str(EMBEDDED), chat_template=template(name))
    made = [{"id": f"call{i}abcd", "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)]
    prompt = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tools=TOOLS)
    whole = tokenizer.apply_chat_template([USER, {"role": "assistant", "content": "", "tool_calls": made}],
                                          add_generation_prompt=False, tools=TOOLS)
    if not whole.startswith(prompt):
        prompt = prompt.removesuffix(EMPTY_THOUGHT)
    assert whole.startswith(prompt), (prompt[-200:], whole[len(prompt) - 200:])
    answer = whole[len(prompt):]
    ends = [answer.find(marker) for marker in END_OF_TURN if marker in answer]
    return prompt, answer[:min(ends)] if ends else answer


@pytest.mark.parametrize("name", ROUND_TRIPS)
def test_the_calls_a_template_renders_read_back_exactly_at_every_split(name):
    tool_format, reasoning = FORMATS[name]
    calls = CALLS[:ROUND_TRIPS[name]]
    prompt, answer = rendered_answer(name, calls)
    tags = REASONING_TAGS.get(reasoning or "", THINK)
    thinking = thinking_at_start(prompt, tags) if reasoning else None
    parser = AnswerFormat(tool_parser_for(tool_format, SCHEMAS), thinking, think_tags=tags).parser
    whole = run(parser(), [answer])
    assert [(n, json.loads(a)) for n, a in whole.calls] == calls, answer
    assert not whole.content.strip() and not whole.reasoning.strip(), answer
    check_every_split(parser, answer, whole)
