"""Tool calls, reasoning and structured output through the chat serving layer, against a
scripted engine: what the engine is asked for, and what stream and non-stream answers say."""

from __future__ import annotations

import asyncio
import json

import pytest

from serving_fakes import FakeEngine, Script, drain
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol import ChatCompletionRequest
from tailrace.tokenizer import load_tokenizer
from tokenizer_fixtures import EMBEDDED, needs_embedded

pytestmark = needs_embedded

MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TWO_CALLS = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


def tokenizer():
    return load_tokenizer(str(EMBEDDED))


def engine(text: str | list[str], finish_reason: str = "stop") -> FakeEngine:
    """Each choice j generates texts[j] (one text: every choice), token by token."""
    tok = tokenizer()
    texts = [text] if isinstance(text, str) else text
    scripts = [Script(tok.encode(t, add_special_tokens=False), finish_reason=finish_reason) for t in texts]
    return FakeEngine(tok, lambda prompt_index, sibling: scripts[sibling % len(scripts)])


def chat(fake: FakeEngine, options: ChatOptions | None = None, **body):
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, **body})
    ctx = RequestContext(request_id="req-abc", model_name="tiny", metrics=None, chat=options or ChatOptions())

    async def go():
        result = await create_chat_completion(fake, request, ctx)
        return await drain(result) if request.stream else result
    return asyncio.run(go())


def both(text, options=None, finish_reason="stop", **body) -> tuple[dict, list[dict]]:
    """The non-stream response and the stream's chunk choices, for the same script."""
    whole = chat(engine(text, finish_reason), options, **body)
    chunks = chat(engine(text, finish_reason), options, stream=True, **body)
    return whole, [piece for chunk in chunks for piece in chunk["choices"]]


def joined_calls(pieces: list[dict], index: int = 0) -> list[dict]:
    """What a client rebuilds from tool-call deltas (checking the wire rules on the way)."""
    calls: list[dict] = []
    for piece in (p for p in pieces if p["index"] == index):
        for delta in piece["delta"].get("tool_calls", []):
            assert "index" in delta and "function" in delta
            if delta["index"] == len(calls):
                assert {"id", "type"} <= delta.keys() and "name" in delta["function"]
                calls.append({"id": delta["id"], "name": delta["function"]["name"], "arguments": ""})
            else:
                assert "id" not in delta and "name" not in delta["function"]
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls


def finish(pieces: list[dict], index: int = 0) -> str:
    return [p["finish_reason"] for p in pieces if p["index"] == index and p["finish_reason"]][0]


# ---- tool_choice auto: the model's own format, parsed ------------------------------------------

def test_auto_tool_calls_come_back_as_tool_calls_in_both_forms():
    whole, pieces = both(TWO_CALLS, tools=[WEATHER, TIME])
    message = whole["choices"][0]["message"]
    assert message["content"] == "Let me check."
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [
        ("function", "get_weather", '{"city": "Paris"}'), ("function", "get_time", "{}")]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    streamed = joined_calls(pieces)
    assert [(c["name"], c["arguments"]) for c in streamed] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert len({c["id"] for c in streamed}) == 2
    assert "".join(p["delta"].get("content") or "" for p in pieces) == "Let me check."
    assert finish(pieces) == "tool_calls"


def test_a_cut_off_answer_stays_length():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    whole, pieces = both(text, finish_reason="length", tools=[WEATHER])
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": "Par'
    assert finish(pieces) == "length"


def test_plain_answer_with_tools_offered_is_content():
    whole, _ = both("It is sunny.", tools=[WEATHER])
    message = whole["choices"][0]["message"]
    assert (message["content"], "tool_calls" in message, whole["choices"][0]["finish_reason"]) == (
        "It is sunny.", False, "stop")


def test_without_parallel_tool_calls_only_the_first_call_is_kept():
    whole, pieces = both(TWO_CALLS, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c["function"]["name"] for c in whole["choices"][0]["message"]["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in joined_calls(pieces)] == ["get_weather"]


def test_each_choice_has_its_own_parser():
    whole, pieces = both([TWO_CALLS, "No tools needed."], tools=[WEATHER, TIME], n=2)
    first, second = whole["choices"]
    assert (len(first["message"]["tool_calls"]), first["finish_reason"]) == (2, "tool_calls")
    assert (second["message"]["content"], second["finish_reason"]) == ("No tools needed.", "stop")
    assert len(joined_calls(pieces, 0)) == 2 and joined_calls(pieces, 1) == []


def test_tool_choice_none_shows_the_tools_but_parses_nothing():
    fake = engine(TWO_CALLS)
    whole = chat(fake, tools=[WEATHER], tool_choice="none")
    assert whole["choices"][0]["message"]["content"] == TWO_CALLS
    prompt = fake.tokenizer.decode(fake.started[0][1], skip_special_tokens=False)
    assert '"name": "get_weather"' in prompt


def test_history_with_tool_calls_and_results_renders_through_the_template():
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "index": 0,
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    fake = engine("It is 18 C.")
    chat(fake, messages=history, tools=[WEATHER])
    prompt = fake.tokenizer.decode(fake.started[0][1], skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in prompt


def test_mistral_parser_keeps_special_tokens_in_the_text():
    fake = engine("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}")
    whole = chat(fake, ChatOptions(tool_call_parser="mistral"), tools=[WEATHER])
    assert fake.started[0][2].skip_special_tokens is False
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# ---- tool_choice required / named: a grammar, read back as calls --------------------------------

def test_named_tool_choice_constrains_to_the_parameters_and_returns_the_call():
    args = '{"city": "Paris"}'
    fake = engine(args)
    whole = chat(fake, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(fake.started[0][2].structured.json_schema) == WEATHER["function"]["parameters"]
    message = whole["choices"][0]["message"]
    assert message["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("get_weather", args)]
    assert whole["choices"][0]["finish_reason"] == "tool_calls"
    _, pieces = both(args, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert [(c["name"], c["arguments"]) for c in joined_calls(pieces)] == [("get_weather", args)]


def test_required_tool_choice_constrains_to_an_array_of_calls():
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    fake = engine(text)
    whole = chat(fake, tools=[WEATHER, TIME], tool_choice="required")
    schema = json.loads(fake.started[0][2].structured.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["choices"][0]["message"]["tool_calls"]] \
        == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    _, pieces = both(text, tools=[WEATHER, TIME], tool_choice="required")
    assert [(c["name"], c["arguments"]) for c in joined_calls(pieces)] == [
        ("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]


def test_required_without_parallel_calls_allows_one_call():
    fake = engine('[{"name": "get_time", "parameters": {}}]')
    chat(fake, tools=[TIME], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(fake.started[0][2].structured.json_schema)["maxItems"] == 1


# ---- response_format ------------------------------------------------------------------------------

def test_json_schema_response_format_is_sent_to_the_engine_and_content_is_untouched():
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fake = engine('{"ok": true}')
    whole = chat(fake, response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
                 tools=[WEATHER])
    assert json.loads(fake.started[0][2].structured.json_schema) == schema
    assert whole["choices"][0]["message"]["content"] == '{"ok": true}'


def test_json_object_response_format_asks_for_any_object():
    fake = engine("{}")
    chat(fake, response_format={"type": "json_object"})
    assert json.loads(fake.started[0][2].structured.json_schema) == {"type": "object"}


def test_unconstrained_request_carries_no_grammar():
    fake = engine("hi")
    chat(fake)
    assert fake.started[0][2].structured is None


@pytest.mark.parametrize("body,param,named", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": {"not": {}}}}},
     "response_format", '"not"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string", "format": "bogus"}}}],
      "tool_choice": "required"}, "tools", "function 'f'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
])
def test_what_cannot_be_served_is_a_400_that_names_it(body, param, named):
    fake = engine("x")
    with pytest.raises(OpenAIError) as err:
        chat(fake, **body)
    assert (err.value.status, err.value.param) == (400, param)
    assert named in err.value.message
    assert fake.started == []  # never reached the engine


# ---- reasoning --------------------------------------------------------------------------------------

THINKING = ChatOptions(reasoning_parser="think")


def test_thinking_goes_to_reasoning_content_and_the_answer_to_content():
    whole, pieces = both("<think>2+2 is 4.</think>\n\nFour.", THINKING)
    message = whole["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("2+2 is 4.", "Four.")
    assert "".join(p["delta"].get("reasoning_content") or "" for p in pieces) == "2+2 is 4."
    assert "".join(p["delta"].get("content") or "" for p in pieces) == "Four."


def test_reasoning_field_can_be_named_reasoning():
    whole, pieces = both("<think>hm</think>ok", ChatOptions(reasoning_parser="think", reasoning_field="reasoning"))
    assert whole["choices"][0]["message"]["reasoning"] == "hm"
    assert "reasoning_content" not in whole["choices"][0]["message"]
    assert any("reasoning" in p["delta"] for p in pieces)


def test_the_engine_learns_where_the_answer_starts():
    fake = engine("<think>x</think>y")
    chat(fake, THINKING, stop=["END"])
    thinking = fake.started[0][2].thinking
    tok = fake.tokenizer
    assert (thinking.open_id, thinking.close_id, thinking.open_at_start) == (
        tok.hf.token_to_id("<think>"), tok.hf.token_to_id("</think>"), False)


def test_tool_calls_after_thinking_are_parsed_from_the_answer():
    text = '<think>Use <tool_call> maybe.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    whole, pieces = both(text, THINKING, tools=[TIME])
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "Use <tool_call> maybe."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    assert finish(pieces) == "tool_calls"


def test_without_the_reasoning_parser_think_tags_are_content():
    whole, _ = both("<think>a</think>b")
    assert whole["choices"][0]["message"]["content"] == "<think>a</think>b"
    assert "reasoning_content" not in whole["choices"][0]["message"]


# ---- the forms models drift into, and formats chosen by the chat template ------------------------

FENCED = '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```'


def test_a_fenced_call_to_a_requested_tool_comes_back_as_a_tool_call_in_both_forms():
    whole, pieces = both(FENCED, tools=[WEATHER])
    message = whole["choices"][0]["message"]
    assert message["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"})]
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and finish(pieces) == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in joined_calls(pieces)] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_a_fence_is_content_without_tools_or_for_a_tool_not_requested():
    for body in ({}, {"tools": [TIME]}):
        whole, pieces = both(FENCED, **body)
        assert whole["choices"][0]["message"]["content"] == FENCED
        assert whole["choices"][0]["finish_reason"] == "stop" and finish(pieces) == "stop"


def test_a_template_that_writes_think_blocks_gets_its_reasoning_parsed_without_a_flag():
    fake = engine("<think>Paris is in France.</think>Sunny.")
    fake.tokenizer.chat_template = "{% if false %}<think>{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
    message = chat(fake)["choices"][0]["message"]
    assert (message["reasoning_content"], message["content"]) == ("Paris is in France.", "Sunny.")
