"""/v1/chat/completions semantics against a scripted engine: stream and non-stream agree by construction."""

from __future__ import annotations

import asyncio

import pytest

from tailrace.serving.chat import create_chat_completion, template_variables
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol import ChatCompletionRequest
from serving_fakes import FakeEngine, Script, context, drain, same_script, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
GENERATED = TOKENIZER.encode(" Sure, héllo 日本 world")
MESSAGES = [{"role": "user", "content": "Say hello"}]
CONTINUED = [*MESSAGES, {"role": "assistant", "content": "Hello there"}]


STOP_TOKEN = 2  # the scripted choices end on this stop token id unless a test says otherwise


def engine(script: Script | None = None, **kwargs) -> FakeEngine:
    return FakeEngine(TOKENIZER, same_script(script or Script(GENERATED, finish_reason="stop", stop_reason=STOP_TOKEN)),
                      **kwargs)


def chat(fake: FakeEngine, **body):
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, **body})
    return asyncio.run(_chat(fake, request))


async def _chat(fake, request):
    result = await create_chat_completion(fake, request, context())
    return await drain(result) if request.stream else result


def pieces_of(chunks: list[dict]) -> list[dict]:
    return [piece for chunk in chunks for piece in chunk["choices"]]


def join_stream(chunks: list[dict]) -> dict:
    """What a client rebuilds from the chunks: content and logprobs.content concatenated per choice."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if not chunk["choices"]:
            usage = chunk["usage"]
        for piece in chunk["choices"]:
            joined = choices.setdefault(piece["index"], {
                "index": piece["index"], "message": {"role": None, "content": "", "refusal": None, "annotations": []},
                "logprobs": None, "finish_reason": None, "stop_reason": None})
            delta = piece["delta"]
            joined["message"]["role"] = delta.get("role", joined["message"]["role"])
            joined["message"]["content"] += delta.get("content") or ""
            if piece["logprobs"] is not None:
                joined["logprobs"] = joined["logprobs"] or {"content": [], "refusal": None}
                joined["logprobs"]["content"] += piece["logprobs"]["content"]
            if piece["finish_reason"] is not None:
                joined["finish_reason"], joined["stop_reason"] = piece["finish_reason"], piece["stop_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


# ---- stream == non-stream ----------------------------------------------------------------------------

@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [False, True])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("include_usage", [False, True])
def test_joined_stream_equals_non_stream(echo, logprobs, n, include_usage):
    fake = engine(Script(GENERATED, sizes=[2, 1, 5]), order="reversed")
    body = {"messages": CONTINUED if echo else MESSAGES, "echo": echo, "logprobs": logprobs, "n": n,
            **({"top_logprobs": 2} if logprobs else {})}
    full = chat(fake, **body)
    streamed = join_stream(chat(fake, stream=True, stream_options={"include_usage": include_usage}, **body))
    assert streamed["choices"] == full["choices"]
    assert streamed["usage"] == (full["usage"] if include_usage else None)


# ---- stop_reason (vLLM's) ----------------------------------------------------------------------------

def test_stop_reason_is_the_stop_string_in_the_stream_and_the_response():
    fake = engine(Script(GENERATED, finish_reason="stop", stop_reason=" world", keep_chars=6))
    full = chat(fake, stop=[" world"])
    streamed = join_stream(chat(fake, stop=[" world"], stream=True))
    assert (full["choices"][0]["stop_reason"], streamed["choices"][0]["stop_reason"]) == (" world", " world")


def test_stop_reason_is_null_on_every_chunk_but_the_finish():
    chunks = chat(engine(), stream=True)
    assert [p["stop_reason"] for p in pieces_of(chunks)][-1] == STOP_TOKEN
    assert {p["stop_reason"] for p in pieces_of(chunks)[:-1]} == {None}


def test_stop_reason_is_null_for_a_length_finish():
    assert chat(engine(Script(GENERATED)))["choices"][0]["stop_reason"] is None


# ---- response shape --------------------------------------------------------------------------------

def test_non_stream_response_has_the_openai_shape():
    result = chat(engine())
    assert result["id"] == "chatcmpl-abc123"
    assert result["object"] == "chat.completion"
    assert result["model"] == "tiny"
    assert result["choices"] == [{
        "index": 0, "message": {"role": "assistant", "content": TOKENIZER.decode(GENERATED), "refusal": None,
                                "annotations": []},
        "logprobs": None, "finish_reason": "stop", "stop_reason": STOP_TOKEN}]
    assert result["usage"]["completion_tokens"] == len(GENERATED)


def test_every_chunk_is_a_chat_completion_chunk_with_the_same_id_and_created():
    chunks = chat(engine(), stream=True, n=2, stream_options={"include_usage": True})
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == {
        ("chatcmpl-abc123", chunks[0]["created"], "chat.completion.chunk", "tiny")}


def test_each_choice_opens_with_one_role_chunk_with_empty_content():
    chunks = chat(engine(order="reversed"), stream=True, n=2)
    for index in range(2):
        mine = [p for p in pieces_of(chunks) if p["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert not any("role" in p["delta"] for p in mine[1:])


def test_choices_are_introduced_in_ascending_order_when_the_engine_sends_the_last_first():
    chunks = chat(engine(order="last_first"), stream=True, n=3)
    assert list(dict.fromkeys(p["index"] for p in pieces_of(chunks))) == [0, 1, 2]


def test_each_choice_ends_with_one_empty_delta_carrying_the_finish_reason():
    chunks = chat(engine(Script(GENERATED, finish_reason="length", sizes=[3])), stream=True, n=2)
    for index in range(2):
        mine = [p for p in pieces_of(chunks) if p["index"] == index]
        assert [p["finish_reason"] for p in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1]["delta"] == {}


def test_usage_chunk_comes_once_and_last_when_asked():
    chunks = chat(engine(), stream=True, n=2, stream_options={"include_usage": True})
    assert [i for i, c in enumerate(chunks) if "usage" in c] == [len(chunks) - 1]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(GENERATED)


def test_no_usage_in_the_stream_unless_asked():
    assert not any("usage" in c for c in chat(engine(), stream=True))


# ---- prompt ------------------------------------------------------------------------------------------------

def test_messages_go_through_the_chat_template_with_a_generation_prompt():
    fake = engine()
    chat(fake)
    expected = TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert fake.started[0][1] == TOKENIZER.encode(expected, add_special_tokens=False)


def test_text_parts_of_a_message_are_joined():
    fake, parts_fake = engine(), engine()
    chat(fake, messages=[{"role": "user", "content": "Say hello"}])
    chat(parts_fake, messages=[{"role": "user", "content": [{"type": "text", "text": "Say "},
                                                           {"type": "text", "text": "hello"}]}])
    assert parts_fake.started[0][1] == fake.started[0][1]


def test_echo_continues_the_last_message_and_sends_its_content_first():
    fake = engine()
    chunks = chat(fake, stream=True, messages=CONTINUED, echo=True)
    prompt_text = TOKENIZER.decode(fake.started[0][1], skip_special_tokens=False)
    assert prompt_text.endswith("Hello there")
    assert pieces_of(chunks)[0]["delta"] == {"role": "assistant", "content": "Hello there"}
    assert join_stream(chunks)["choices"][0]["message"]["content"] == "Hello there" + TOKENIZER.decode(GENERATED)


def test_chat_template_kwargs_cannot_override_the_template_call():
    fake = engine()
    chat(fake, chat_template_kwargs={"add_generation_prompt": False, "messages": []})
    expected = TOKENIZER.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert fake.started[0][1] == TOKENIZER.encode(expected, add_special_tokens=False)


def test_reasoning_effort_is_a_template_variable_and_none_turns_thinking_off():
    def variables(**body):
        return template_variables(ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, **body}))
    assert variables(reasoning_effort="high") == {"reasoning_effort": "high"}
    assert variables(reasoning_effort="none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert variables(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True, "messages": []}) == {
        "reasoning_effort": "none", "enable_thinking": True}
    assert variables() == {}


def test_max_completion_tokens_reaches_the_engine():
    fake = engine()
    chat(fake, max_completion_tokens=7, max_tokens=9)
    assert fake.started[0][2].max_tokens == 7


# ---- logprobs ----------------------------------------------------------------------------------------------

def test_logprobs_content_has_token_logprob_bytes_and_top_logprobs():
    result = chat(engine(), logprobs=True, top_logprobs=2)
    content = result["choices"][0]["logprobs"]["content"]
    assert [item["token"] for item in content] == [TOKENIZER.token_text(t) for t in GENERATED]
    assert [item["bytes"] for item in content] == [TOKENIZER.token_bytes(t) for t in GENERATED]
    assert all(len(item["top_logprobs"]) == 2 for item in content)
    assert result["choices"][0]["logprobs"]["refusal"] is None


def test_stream_logprobs_are_null_on_every_chunk_when_not_requested():
    assert all(p["logprobs"] is None for p in pieces_of(chat(engine(), stream=True, n=2)))


def test_stream_role_chunk_carries_empty_logprobs_content_when_requested():
    chunks = chat(engine(), stream=True, logprobs=True)
    assert pieces_of(chunks)[0]["logprobs"] == {"content": [], "refusal": None}


# ---- errors before the stream, aborts ----------------------------------------------------------------

def test_context_overflow_raises_before_the_stream_starts():
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, "stream": True,
                                                    "max_tokens": 1})
    with pytest.raises(OpenAIError) as err:
        asyncio.run(create_chat_completion(engine(max_model_len=5), request, context()))
    assert (err.value.code, err.value.param) == ("context_length_exceeded", "messages")


def test_max_completion_tokens_over_the_room_left_names_max_completion_tokens():
    request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES,
                                                    "max_completion_tokens": 10_000})
    with pytest.raises(OpenAIError) as err:
        asyncio.run(create_chat_completion(engine(max_model_len=200), request, context()))
    assert (err.value.param, err.value.message.split(":")[0]) == (
        "max_completion_tokens", "max_completion_tokens is too large")


def test_prompt_that_fills_the_context_is_refused_without_max_tokens():
    with pytest.raises(OpenAIError) as err:
        chat(engine(max_model_len=5))
    assert err.value.code == "context_length_exceeded"


def test_unsupported_field_is_refused():
    with pytest.raises(OpenAIError) as err:
        chat(engine(), audio={"voice": "alloy", "format": "wav"})
    assert err.value.code == "unsupported_parameter"


def test_closing_the_stream_aborts_the_engine_request():
    fake = engine()

    async def read_one_then_close():
        request = ChatCompletionRequest.model_validate({"model": "tiny", "messages": MESSAGES, "stream": True})
        stream = await create_chat_completion(fake, request, context())
        await anext(stream)
        await stream.aclose()

    asyncio.run(read_one_then_close())
    assert fake.aborted == ["chatcmpl-abc123-0"]
    assert fake.closed_unfinished == ["chatcmpl-abc123-0"]
