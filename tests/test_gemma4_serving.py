"""Gemma 4's answers through chat with its real template (tests/templates/): the thought channel
is the reasoning, `<|tool_call>call:...` a tool call, streamed and not, with special tokens kept."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from serving_fakes import FakeEngine, Script, drain
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

TEMPLATE = (Path(__file__).parent / "templates" / "google-gemma-4-31B-it.jinja").read_text()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
ANSWER = ('<|channel>thought\nThe user wants Paris.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}'
          "<tool_call|>")


def chat(stream: bool):
    tokenizer = load_tokenizer(str(EMBEDDED), chat_template=TEMPLATE)
    fake = FakeEngine(tokenizer, lambda prompt, sibling: Script(tokenizer.encode(ANSWER, add_special_tokens=False),
                                                                finish_reason="stop"))
    # Thinking on: with it off, the template closes an empty thought channel before the answer.
    request = ChatCompletionRequest.model_validate({"model": "tiny", "stream": stream, "tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"}], "chat_template_kwargs": {"enable_thinking": True}})
    context = RequestContext(request_id="req-abc", model_name="tiny", metrics=None, chat=ChatOptions())

    async def go():
        result = await create_chat_completion(fake, request, context)
        return await drain(result) if stream else result
    return asyncio.run(go()), fake


def test_gemma4_thought_and_call_come_back_as_reasoning_and_tool_calls_streamed_and_not():
    whole, fake = chat(False)
    assert fake.started[0][2].skip_special_tokens is False
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("The user wants Paris.", None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    chunks, _ = chat(True)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "The user wants Paris."
    assert "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", [])) == \
        message["tool_calls"][0]["function"]["arguments"]
