"""Anthropic Messages over the chat path: the request's translation, the stream's events, and that
the events fold (by the Anthropic SDK's own accumulator) into exactly the non-stream message."""

from __future__ import annotations

import asyncio

import pytest
from anthropic.lib.streaming._messages import accumulate_event

from serving_fakes import FakeEngine, Script, drain
from tailrace.serving.anthropic_messages import AnthropicError, count_tokens, create_message
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.errors import OpenAIError, engine_unavailable, rate_limited
from tailrace.serving.protocol_anthropic import MessagesRequest
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

WEATHER = {"name": "get_weather", "description": "Current weather",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def engine(text: str, finish_reason: str = "stop", stop_reason: str | None = None) -> FakeEngine:
    tok = load_tokenizer(str(EMBEDDED))
    script = Script(tok.encode(text, add_special_tokens=False), finish_reason=finish_reason, stop_reason=stop_reason)
    return FakeEngine(tok, lambda prompt_index, sibling: script)


def message(fake: FakeEngine, options: ChatOptions | None = None, **body):
    request = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 64,
                                             "messages": [{"role": "user", "content": "Weather in Paris?"}], **body})
    ctx = RequestContext(request_id="req-abc", model_name="tiny", metrics=None, chat=options or ChatOptions())

    async def go():
        result = await create_message(fake, request, ctx, {})
        return await drain(result) if request.stream else result
    return asyncio.run(go())


def folded(events: list[dict]) -> dict:
    snapshot, json_bufs = None, {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)
    return snapshot.to_dict()


def without_ids(message: dict) -> dict:
    """Tool-use ids are fresh per call; everything else must match."""
    return {**message, "content": [{k: v for k, v in block.items() if k != "id"} for block in message["content"]]}


def both(text: str, options: ChatOptions | None = None, **script) -> tuple[dict, list[dict]]:
    body = {"tools": [WEATHER]}
    return message(engine(text, **script), options, **body), message(engine(text, **script), options, stream=True,
                                                                     **body)


def test_text_answer_is_one_text_block_ending_the_turn():
    whole, _ = both("Sunny, 21 degrees.")
    assert whole["content"] == [{"type": "text", "text": "Sunny, 21 degrees."}]
    assert whole["stop_reason"] == "end_turn" and whole["stop_sequence"] is None


@pytest.mark.parametrize("text, script", [
    ("Sunny, 21 degrees.", {}),
    (f"Let me check.\n{CALL}", {}),
    ("Sunny, 21 degrees and", {"finish_reason": "length"}),
    ("Sunny", {"stop_reason": "END"}),
])
def test_stream_folded_by_the_sdk_is_the_non_stream_message(text, script):
    whole, events = both(text, **script)
    assert without_ids(folded(events)) == without_ids(whole)


def test_tool_call_is_a_tool_use_block_with_its_input():
    whole, _ = both(f"Let me check.\n{CALL}")
    assert whole["content"][1] == {"type": "tool_use", "id": whole["content"][1]["id"], "name": "get_weather",
                                   "input": {"city": "Paris"}}
    assert whole["stop_reason"] == "tool_use"


def test_stream_events_follow_anthropics_order():
    _, events = both(f"Hi.\n{CALL}")
    kinds = [e["type"] for e in events if e["type"] != "content_block_delta"]
    assert kinds == ["message_start", "content_block_start", "content_block_stop", "content_block_start",
                     "content_block_stop", "message_delta", "message_stop"]
    deltas = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert deltas == {"text_delta", "input_json_delta"}


def test_a_matched_stop_sequence_is_named():
    whole, _ = both("Sunny", stop_reason="END")
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")


def test_running_out_of_tokens_is_max_tokens():
    whole, _ = both("Sunny and", finish_reason="length")
    assert whole["stop_reason"] == "max_tokens"


def test_thinking_is_a_thinking_block_before_the_text():
    options = ChatOptions(reasoning_parser="think")
    whole, events = both("<think>Paris is in France.</think>Sunny.", options)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0]["thinking"] == "Paris is in France."
    assert any(e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta" for e in events)
    assert without_ids(folded(events)) == without_ids(whole)


def test_tool_results_and_tool_uses_become_chat_tool_messages():
    request = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
        "system": "Be brief.", "tool_choice": {"type": "any"}})
    chat = request.chat_request()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool"]
    assert chat.messages[2].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert chat.messages[3].tool_call_id == "t1" and chat.messages[3].content == "sunny"
    assert chat.tool_choice == "required"


def test_an_image_block_is_refused_by_name():
    request = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]})
    with pytest.raises(OpenAIError, match=r"messages\[0\]\.content\[0\]\.image"):
        request.chat_request()


def test_count_tokens_counts_the_rendered_prompt():
    fake = engine("x")
    request = MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8,
                                             "messages": [{"role": "user", "content": "Hello"}]})
    ctx = RequestContext(request_id="req-abc", model_name="tiny", metrics=None)
    counted = count_tokens(fake, request, ctx)["input_tokens"]
    text = fake.tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
    assert counted == len(fake.tokenizer.encode(text, add_special_tokens=False))


def test_errors_take_anthropics_shape_and_keep_their_status():
    err = AnthropicError.of(rate_limited())
    assert err.status == 429
    assert err.body() == {"type": "error", "error": {"type": "rate_limit_error", "message": err.message}}


def test_an_unavailable_engine_is_anthropics_529_overloaded():
    err = AnthropicError.of(engine_unavailable())
    assert (err.status, err.body()["error"]["type"]) == (529, "overloaded_error")


def test_an_engine_failure_mid_stream_is_an_error_event():
    fake = engine("Sunny, 21 degrees.")
    fake.fail_after = 3
    events = message(fake, stream=True)
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": events[-1]["error"][
        "message"]}}


def test_thinking_disabled_asks_for_no_reasoning_and_enabled_turns_the_switch_on():
    def chat_of(thinking):
        return MessagesRequest.model_validate({"model": "tiny", "max_tokens": 8, "thinking": thinking,
                                               "messages": [{"role": "user", "content": "Hi"}]}).chat_request()
    off = chat_of({"type": "disabled"})
    assert (off.reasoning_effort, off.chat_template_kwargs) == ("none", None)
    on = chat_of({"type": "enabled", "budget_tokens": 1024})
    assert (on.reasoning_effort, on.chat_template_kwargs) == (None, {"enable_thinking": True})
