"""OpenAI Responses over the chat path: the request's translation, the stream's event rules, and
that the stream reassembles into exactly the non-stream response."""

from __future__ import annotations

import asyncio
import json

import pytest

from responses_events import reassembled
from serving_fakes import FakeEngine, Script, drain
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol_responses import ResponsesRequest
from tailrace.serving.responses import create_response
from tailrace.serving.responses_store import ResponseStore
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

WEATHER = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
LOGPROBS = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}


def engine(text: str, finish_reason: str = "stop") -> FakeEngine:
    tok = load_tokenizer(str(EMBEDDED))
    script = Script(tok.encode(text, add_special_tokens=False), finish_reason=finish_reason)
    return FakeEngine(tok, lambda prompt_index, sibling: script)


def respond(fake: FakeEngine, kept: ResponseStore | None = None, options: ChatOptions | None = None,
            request_id: str = "req-abc", **body):
    request = ResponsesRequest.model_validate({"model": "tiny", "input": "Weather in Paris?", **body})
    ctx = RequestContext(request_id=request_id, model_name="tiny", metrics=None, chat=options or ChatOptions())

    async def go():
        result = await create_response(fake, request, ctx, ResponseStore() if kept is None else kept, {})
        return await drain(result) if request.stream else result
    return asyncio.run(go())


def both(text: str, options: ChatOptions | None = None, finish_reason: str = "stop", **body):
    body = {"tools": [WEATHER], **LOGPROBS, **body}
    return (respond(engine(text, finish_reason), options=options, **body),
            respond(engine(text, finish_reason), options=options, stream=True, **body))


def without_call_ids(response: dict) -> dict:
    """Call ids are fresh per request, and created_at is each request's own second (the two calls
    can straddle one); all else must match."""
    kept = {k: v for k, v in response.items() if k != "created_at"}
    return {**kept, "output": [{k: v for k, v in item.items() if k != "call_id"} for item in response["output"]]}


def test_text_answer_is_one_message_with_output_text():
    whole, _ = both("Sunny, 21 degrees.", tools=None)
    (message,) = whole["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Sunny, 21 degrees."
    assert whole["status"] == "completed"


@pytest.mark.parametrize("text, finish_reason, think", [
    ("Sunny, 21 degrees.", "stop", False),
    (f"Let me check.\n{CALL}", "stop", False),
    ("Sunny, 21 degrees and", "length", False),
    ("<think>Paris is in France.</think>Sunny.", "stop", True),
])
def test_stream_reassembles_into_the_non_stream_response(text, finish_reason, think):
    options = ChatOptions(reasoning_parser="think") if think else None
    whole, events = both(text, options, finish_reason)
    assert without_call_ids(reassembled(events)) == without_call_ids(whole)


def test_tool_call_is_a_function_call_item():
    whole, events = both(f"Let me check.\n{CALL}")
    call = whole["output"][1]
    assert (call["type"], call["name"], json.loads(call["arguments"])) == ("function_call", "get_weather",
                                                                           {"city": "Paris"})
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert done[0]["arguments"] == call["arguments"]


def test_running_out_of_tokens_is_incomplete_with_the_reason():
    whole, events = both("Sunny and", finish_reason="length")
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["type"] == "response.incomplete"


def test_logprobs_come_with_the_text_they_made():
    whole, _ = both("Sunny.", tools=None)
    part = whole["output"][0]["content"][0]
    assert "".join(entry["token"] for entry in part["logprobs"]) == "Sunny."
    assert all(len(entry["top_logprobs"]) == 2 for entry in part["logprobs"])


def test_thinking_is_a_reasoning_item_counted_in_reasoning_tokens():
    whole, _ = both("<think>Paris is in France.</think>Sunny.", ChatOptions(reasoning_parser="think"))
    reasoning = whole["output"][0]
    assert reasoning["type"] == "reasoning" and reasoning["content"][0]["text"] == "Paris is in France."
    assert 0 < whole["usage"]["output_tokens_details"]["reasoning_tokens"] < whole["usage"]["output_tokens"]


def test_previous_response_id_continues_the_conversation():
    store = ResponseStore()
    first = respond(engine("Sunny."), store, input="Weather in Paris?", instructions="Be brief.")
    fake = engine("You're welcome.")
    respond(fake, store, request_id="req-def", input="Thanks!", previous_response_id=first["id"])
    prompt = fake.tokenizer.decode(fake.started[0][1])
    assert prompt.index("Weather in Paris?") < prompt.index("Sunny.") < prompt.index("Thanks!")
    assert "Be brief." not in prompt  # instructions do not carry over


def test_an_unknown_previous_response_id_is_a_404():
    with pytest.raises(OpenAIError) as caught:
        respond(engine("x"), previous_response_id="resp_nope")
    assert (caught.value.status, caught.value.param) == (404, "previous_response_id")


def test_store_false_keeps_nothing():
    store = ResponseStore()
    respond(engine("Sunny."), store, store=False)
    assert len(store) == 0


def test_function_call_output_items_become_tool_messages():
    request = ResponsesRequest.model_validate({"model": "tiny", "tools": [WEATHER], "input": [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    chat = request.chat_request(request.input_items())
    assert [m.role for m in chat.messages] == ["user", "assistant", "tool"]
    assert chat.messages[1].tool_calls[0].id == "c1" and chat.messages[2].content == "sunny"


def test_json_schema_text_format_becomes_the_grammar():
    request = ResponsesRequest.model_validate({"model": "tiny", "input": "x", "text": {"format": {
        "type": "json_schema", "name": "city", "schema": {"type": "object"}}}})
    chat = request.chat_request(request.input_items())
    assert chat.response_format.type == "json_schema" and chat.response_format.json_schema.name == "city"


def test_a_built_in_tool_is_refused_by_name():
    request = ResponsesRequest.model_validate({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]})
    with pytest.raises(OpenAIError, match=r"tools\[0\]\.web_search"):
        request.chat_request(request.input_items())


def test_an_engine_failure_mid_stream_ends_in_response_failed():
    fake = engine("Sunny, 21 degrees.")
    fake.fail_after = 3
    events = respond(fake, stream=True)
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"]


def test_reasoning_items_become_the_reasoning_of_the_assistant_turn_they_start():
    from tailrace.serving.protocol_responses import Item, chat_messages

    items = [Item.model_validate(item) for item in (
        {"type": "message", "role": "user", "content": "Hi"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "greet back"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "message", "role": "user", "content": "Weather?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"})]
    assert chat_messages(items) == [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet back"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]


def test_reasoning_effort_is_chat_completions_reasoning_effort():
    request = ResponsesRequest.model_validate({"model": "tiny", "input": "Hi", "reasoning": {"effort": "low"}})
    assert request.chat_request(request.input_items()).reasoning_effort == "low"
    plain = ResponsesRequest.model_validate({"model": "tiny", "input": "Hi", "reasoning": {"summary": "auto"}})
    assert plain.chat_request(plain.input_items()).reasoning_effort is None
