"""gpt-oss's harmony answers through the three APIs, with the real gpt-oss chat template
(tests/templates/): the analysis channel is the reasoning, the final channel the content, a
commentary message to functions.NAME a tool call; streamed and not; and a conversation with an
earlier turn's reasoning, call and result renders as harmony expects."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from anthropic.lib.streaming._messages import accumulate_event
from responses_events import reassembled
from serving_fakes import FakeEngine, Script, drain
from tailrace.serving.anthropic_messages import create_message
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.serving.protocol_anthropic import MessagesRequest
from tailrace.serving.protocol_responses import ResponsesRequest
from tailrace.serving.responses import create_response
from tailrace.serving.responses_store import ResponseStore
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

TEMPLATE = (Path(__file__).parent / "templates" / "openai-gpt-oss-120b.jinja").read_text()
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
THINKING = "User wants weather. Call the tool."
CALL_TEXT = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>commentary "
             'to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>')
FINAL_TEXT = (f"<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
              "<|return|>")


def engine(text: str) -> FakeEngine:
    tok = load_tokenizer(str(EMBEDDED), chat_template=TEMPLATE)
    script = Script(tok.encode(text, add_special_tokens=False), finish_reason="stop")
    return FakeEngine(tok, lambda prompt_index, sibling: script)


def context() -> RequestContext:
    return RequestContext(request_id="req-abc", model_name="tiny", metrics=None, chat=ChatOptions())


def run(make, fake: FakeEngine, stream: bool):
    async def go():
        result = await make(fake)
        return await drain(result) if stream else result
    return asyncio.run(go())


def chat(text: str, stream: bool, **body):
    request = ChatCompletionRequest.model_validate({"model": "tiny", "stream": stream, "messages": [
        {"role": "user", "content": "Weather in Paris?"}], **body})
    fake = engine(text)
    return run(lambda f: create_chat_completion(f, request, context()), fake, stream), fake


# gpt-oss's template writes every tool's description (and fails without one, as in transformers).
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                                "parameters": PARAMETERS}}]


def test_chat_reads_reasoning_and_calls_from_harmony_with_special_tokens_kept():
    whole, fake = chat(CALL_TEXT, False, tools=CHAT_TOOLS)
    assert fake.started[0][2].skip_special_tokens is False
    choice = whole["choices"][0]
    message = choice["message"]
    assert (message["reasoning_content"], message["content"]) == (THINKING, None)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    assert choice["finish_reason"] == "tool_calls"
    chunks, _ = chat(CALL_TEXT, True, tools=CHAT_TOOLS)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == THINKING
    assert not "".join(d.get("content") or "" for d in deltas)
    assert "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", [])) == '{"city":"Paris"}'
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "tool_calls"


def test_chat_final_channel_is_the_content_and_nothing_else_leaks():
    whole, _ = chat(FINAL_TEXT, False)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == (THINKING, "Sunny.")
    chunks, _ = chat(FINAL_TEXT, True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "Sunny."


def test_an_earlier_turns_reasoning_call_and_result_render_as_harmony():
    request = ChatCompletionRequest.model_validate({"model": "tiny", "tools": CHAT_TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "reasoning_content": THINKING, "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]})
    prompt = engine("").tokenizer.apply_chat_template([m.template_dict() for m in request.messages],
                                                      tools=[t.model_dump(exclude_none=True) for t in request.tools])
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in prompt
    assert prompt.endswith('<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"Sunny"'
                           "<|end|><|start|>assistant")


def test_responses_give_a_reasoning_item_and_a_function_call_item_streamed_and_not():
    def respond(stream: bool):
        request = ResponsesRequest.model_validate({"model": "tiny", "input": "Weather in Paris?", "stream": stream,
                                                   "tools": [{"type": "function", "name": "get_weather",
                                                              "description": "The weather",
                                                              "parameters": PARAMETERS}]})
        return run(lambda f: create_response(f, request, context(), ResponseStore(), {}), engine(CALL_TEXT), stream)

    whole = respond(False)
    assert [item["type"] for item in whole["output"]] == ["reasoning", "function_call"]
    assert whole["output"][0]["content"][0]["text"] == THINKING
    assert (whole["output"][1]["name"], json.loads(whole["output"][1]["arguments"])) == ("get_weather",
                                                                                          {"city": "Paris"})
    streamed = reassembled(respond(True))
    assert [item["type"] for item in streamed["output"]] == ["reasoning", "function_call"]
    assert streamed["output"][1]["arguments"] == whole["output"][1]["arguments"]


def test_messages_give_a_thinking_block_and_a_tool_use_block_streamed_and_not():
    def message(stream: bool):
        request = MessagesRequest.model_validate({
            "model": "tiny", "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "get_weather", "description": "The weather", "input_schema": PARAMETERS}]})
        return run(lambda f: create_message(f, request, context(), {}), engine(CALL_TEXT), stream)

    whole = message(False)
    assert [block["type"] for block in whole["content"]] == ["thinking", "tool_use"]
    assert whole["content"][0]["thinking"] == THINKING and whole["content"][1]["input"] == {"city": "Paris"}
    assert whole["stop_reason"] == "tool_use"
    snapshot, json_bufs = None, {}
    for event in message(True):
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    folded = snapshot.to_dict()
    assert [block["type"] for block in folded["content"]] == ["thinking", "tool_use"]
    assert folded["content"][1]["input"] == {"city": "Paris"}


def test_responses_input_items_replay_the_reasoning_before_the_call_as_harmony_expects():
    from tailrace.serving.protocol_responses import Item, chat_messages

    items = [Item.model_validate(item) for item in (
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": THINKING}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"})]
    request = ChatCompletionRequest.model_validate({"model": "tiny", "tools": CHAT_TOOLS,
                                                    "messages": chat_messages(items)})
    prompt = engine("").tokenizer.apply_chat_template([m.template_dict() for m in request.messages],
                                                      tools=[t.model_dump(exclude_none=True) for t in request.tools])
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{THINKING}<|end|><|start|>assistant to=functions."
            'get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>') in prompt
