"""What a chat template takes of tool calls, found by rendering a probe through the real templates
(tests/templates/): several calls a turn or one, and call ids as issued or cut short; and the ids
of a conversation cut so that each result still answers its call."""

from __future__ import annotations

from pathlib import Path

import pytest

from tailrace.serving.context import ChatOptions
from tailrace.serving.template_fit import fit_call_ids, fit_to_template
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded
TEMPLATES = Path(__file__).parent / "templates"


@pytest.mark.parametrize("template,parallel,id_length", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", True, None),
    ("Qwen3-Coder.jinja", True, None),
    ("openai-gpt-oss-120b.jinja", True, None),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", False, None),  # "This model only supports single tool-calls"
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", True, 9),  # "Tool call IDs should be ... length 9!"
])
def test_the_probe_finds_what_the_template_takes(template, parallel, id_length):
    tokenizer = load_tokenizer(str(EMBEDDED), chat_template=(TEMPLATES / template).read_text())
    options, line = fit_to_template(ChatOptions(), tokenizer)
    assert (options.parallel_calls, options.call_id_length) == (parallel, id_length)
    assert line.startswith("tool calls in the chat template: ")


def test_a_template_that_renders_no_call_leaves_the_options_and_says_so():
    tokenizer = load_tokenizer(str(EMBEDDED), chat_template="{{ raise_exception('no tools here') }}")
    options, line = fit_to_template(ChatOptions(), tokenizer)
    assert options == ChatOptions()
    assert "renders no probe conversation" in line


def test_cut_ids_keep_each_result_paired_with_its_call():
    messages = [{"role": "assistant", "tool_calls": [{"id": "call_0123456789abcdef", "function": {}},
                                                     {"id": "toolu_01-ABCDEFGHIJ", "function": {}}]},
                {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "1"},
                {"role": "tool", "tool_call_id": "toolu_01-ABCDEFGHIJ", "content": "2"}]
    fitted = fit_call_ids(messages, 9)
    assert [c["id"] for c in fitted[0]["tool_calls"]] == ["789abcdef", "BCDEFGHIJ"]
    assert [m["tool_call_id"] for m in fitted[1:]] == ["789abcdef", "BCDEFGHIJ"]
    assert fit_call_ids([{"role": "tool", "tool_call_id": "x-1"}], None) == [{"role": "tool", "tool_call_id": "x-1"}]
