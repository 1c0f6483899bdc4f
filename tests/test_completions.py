"""/v1/completions semantics against a scripted engine: stream and non-stream agree by construction."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tailrace.serving.completions import create_completion
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol import CompletionRequest
from serving_fakes import FakeEngine, RecordingMetrics, Script, context, drain, same_script, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
GENERATED = TOKENIZER.encode(" and then héllo 日本 world")
PROMPT = "Once upon a time"


def engine(script: Script | None = None, **kwargs) -> FakeEngine:
    return FakeEngine(TOKENIZER, same_script(script or Script(GENERATED)), **kwargs)


def complete(fake: FakeEngine, **body):
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": PROMPT, "max_tokens": 50, **body})
    return asyncio.run(_complete(fake, request))


async def _complete(fake, request, ctx=None):
    result = await create_completion(fake, request, ctx or context())
    return await drain(result) if request.stream else result


def join_stream(chunks: list[dict]) -> dict:
    """What a client rebuilds from the chunks: per choice index, text and logprobs concatenated."""
    choices: dict[int, dict] = {}
    usage = None
    for chunk in chunks:
        if not chunk["choices"]:
            usage = chunk["usage"]
        for piece in chunk["choices"]:
            joined = choices.setdefault(piece["index"], {"index": piece["index"], "text": "", "logprobs": None,
                                                         "finish_reason": None, "stop_reason": None})
            joined["text"] += piece["text"]
            if piece["logprobs"] is not None:
                joined["logprobs"] = joined["logprobs"] or {k: [] for k in piece["logprobs"]}
                for key, values in piece["logprobs"].items():
                    joined["logprobs"][key] += values
            if piece["finish_reason"] is not None:
                joined["finish_reason"], joined["stop_reason"] = piece["finish_reason"], piece["stop_reason"]
    return {"choices": [choices[i] for i in sorted(choices)], "usage": usage}


def pieces_of(chunks: list[dict]) -> list[dict]:
    return [piece for chunk in chunks for piece in chunk["choices"]]


# ---- stream == non-stream --------------------------------------------------------------------

@pytest.mark.parametrize("echo", [False, True])
@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT, "In a land far"]])
def test_joined_stream_equals_non_stream(echo, logprobs, n, prompt):
    fake = engine(Script(GENERATED, sizes=[3, 1, 4]), order="reversed")
    body = {"prompt": prompt, "echo": echo, "logprobs": logprobs, "n": n}
    full = complete(fake, **body)
    streamed = join_stream(complete(fake, stream=True, stream_options={"include_usage": True}, **body))
    assert streamed["choices"] == full["choices"]
    assert streamed["usage"] == full["usage"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30)
       .filter(lambda s: "<|" not in s),
       sizes=st.lists(st.integers(min_value=1, max_value=5), max_size=10), echo=st.booleans())
def test_stream_offsets_equal_non_stream_offsets_for_any_split(text, sizes, echo):
    fake = engine(Script(TOKENIZER.encode(text), sizes=sizes))
    body = {"echo": echo, "logprobs": 1, "n": 2}
    full = complete(fake, **body)
    streamed = join_stream(complete(fake, stream=True, **body))
    for choice, joined in zip(full["choices"], streamed["choices"]):
        offsets = choice["logprobs"]["text_offset"]
        assert joined["logprobs"]["text_offset"] == offsets
        assert offsets == sorted(offsets)
        assert all(o <= len(choice["text"]) for o in offsets)
        first_generated = offsets[len(TOKENIZER.encode(PROMPT))] if echo else offsets[0]
        assert first_generated == (len(PROMPT) if echo else 0)


# ---- response shape ------------------------------------------------------------------------------

def test_non_stream_response_has_the_openai_shape():
    result = complete(engine(Script(GENERATED, finish_reason="stop", stop_reason=2)))
    assert result["id"] == "cmpl-abc123"
    assert result["object"] == "text_completion"
    assert result["model"] == "tiny"
    assert isinstance(result["created"], int)
    assert result["choices"] == [{"index": 0, "text": TOKENIZER.decode(GENERATED), "logprobs": None,
                                  "finish_reason": "stop", "stop_reason": 2}]


def test_usage_counts_each_prompt_once_and_every_choice():
    result = complete(engine(num_cached_tokens=3), prompt=[PROMPT, "Hi"], n=2)
    prompt_tokens = len(TOKENIZER.encode(PROMPT)) + len(TOKENIZER.encode("Hi"))
    assert result["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4 * len(GENERATED),
                               "total_tokens": prompt_tokens + 4 * len(GENERATED),
                               "prompt_tokens_details": {"cached_tokens": 6}}


def test_choice_index_is_prompt_index_times_n_plus_sibling():
    fake = FakeEngine(TOKENIZER, lambda p, j: Script(TOKENIZER.encode(f" p{p}s{j}")))
    result = complete(fake, prompt=["a", "b"], n=2)
    assert [(c["index"], c["text"]) for c in result["choices"]] == [
        (0, " p0s0"), (1, " p0s1"), (2, " p1s0"), (3, " p1s1")]


def test_each_prompt_is_its_own_engine_request_with_n_siblings():
    fake = engine()
    complete(fake, prompt=[[5, 6, 7], [8, 9]], n=3)
    assert [(rid, ids, params.n) for rid, ids, params in fake.started] == [
        ("cmpl-abc123-0", [5, 6, 7], 3), ("cmpl-abc123-1", [8, 9], 3)]


def test_every_chunk_has_the_same_id_created_object_and_model():
    chunks = complete(engine(), stream=True, n=2, stream_options={"include_usage": True})
    assert {(c["id"], c["created"], c["object"], c["model"]) for c in chunks} == {
        (chunks[0]["id"], chunks[0]["created"], "text_completion", "tiny")}


def test_stream_chunks_carry_one_choice_and_null_logprobs_when_not_requested():
    chunks = complete(engine(), stream=True, n=2)
    assert all(len(c["choices"]) == 1 for c in chunks)
    assert all(piece["logprobs"] is None for piece in pieces_of(chunks))


def test_exactly_one_finish_chunk_per_choice_and_it_is_the_choice_last():
    chunks = complete(engine(Script(GENERATED, sizes=[2, 5])), stream=True, prompt=[PROMPT, "x"], n=2)
    pieces = pieces_of(chunks)
    for index in range(4):
        mine = [p for p in pieces if p["index"] == index]
        assert [p["finish_reason"] for p in mine] == [None] * (len(mine) - 1) + ["length"]
        assert mine[-1]["text"] == ""


def test_choices_are_introduced_in_ascending_order_when_the_engine_sends_the_last_first():
    chunks = complete(engine(order="last_first"), stream=True, prompt=[PROMPT, "x"], n=3)
    first_seen = list(dict.fromkeys(p["index"] for p in pieces_of(chunks)))
    assert first_seen == list(range(6))


def test_usage_chunk_comes_once_and_last_when_asked():
    chunks = complete(engine(), stream=True, n=2, stream_options={"include_usage": True})
    assert [i for i, c in enumerate(chunks) if "usage" in c] == [len(chunks) - 1]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * len(GENERATED)


def test_no_usage_in_the_stream_unless_asked():
    chunks = complete(engine(), stream=True)
    assert not any("usage" in c for c in chunks)


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk():
    chunks = complete(engine(), stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    running = [c["usage"]["completion_tokens"] for c in chunks]
    assert running == sorted(running)
    assert running[-1] == len(GENERATED)
    assert [c for c in chunks if not c["choices"]] == [chunks[-1]]


# ---- echo --------------------------------------------------------------------------------------------

def test_echo_goes_out_once_in_the_first_chunk_of_each_choice():
    chunks = complete(engine(), stream=True, echo=True, n=2)
    for index in range(2):
        texts = [p["text"] for p in pieces_of(chunks) if p["index"] == index]
        assert texts[0].startswith(PROMPT)
        assert PROMPT not in "".join(texts[1:])


def test_echo_of_token_ids_is_their_decoded_text():
    prompt_ids = TOKENIZER.encode(PROMPT)
    result = complete(engine(), prompt=prompt_ids, echo=True)
    assert result["choices"][0]["text"] == PROMPT + TOKENIZER.decode(GENERATED)


def test_text_offset_continues_after_echo():
    chunks = complete(engine(), stream=True, echo=True, logprobs=0)
    first, second = [p for p in pieces_of(chunks) if p["text"]][:2]
    prompt_len = len(TOKENIZER.encode(PROMPT))
    assert first["logprobs"]["text_offset"][prompt_len] == len(PROMPT)
    assert second["logprobs"]["text_offset"][0] == len(first["text"])


def test_echoed_prompt_first_token_has_null_logprob_and_null_top():
    result = complete(engine(), echo=True, logprobs=1)
    logprobs = result["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None
    assert all(v is not None for v in logprobs["token_logprobs"][1:])


def test_max_tokens_zero_with_echo_returns_the_prompt_and_its_logprobs_only():
    result = complete(engine(), echo=True, logprobs=1, max_tokens=0)
    choice = result["choices"][0]
    assert choice["text"] == PROMPT
    assert choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [TOKENIZER.token_text(t) for t in TOKENIZER.encode(PROMPT)]
    assert result["usage"]["completion_tokens"] == 0


# ---- logprobs ----------------------------------------------------------------------------------------

def test_top_logprobs_always_hold_the_sampled_token():
    result = complete(engine(), logprobs=2)
    logprobs = result["choices"][0]["logprobs"]
    for token, top in zip(logprobs["tokens"], logprobs["top_logprobs"]):
        assert token in top


def test_tokens_are_named_by_id_when_asked():
    result = complete(engine(), logprobs=0, return_tokens_as_token_ids=True)
    assert result["choices"][0]["logprobs"]["tokens"] == [f"token_id:{t}" for t in GENERATED]


def test_tokens_after_a_stop_string_cut_sit_at_the_end_of_the_text():
    fake = engine(Script(GENERATED, finish_reason="stop", stop_reason=" world", keep_chars=8, sizes=[2, 99]))
    result = complete(fake, logprobs=0)
    choice = result["choices"][0]
    assert choice["text"] == TOKENIZER.decode(GENERATED)[:8]
    assert choice["logprobs"]["text_offset"][-1] == 8
    assert choice["stop_reason"] == " world"


# ---- errors before the stream, aborts ----------------------------------------------------------------

def test_context_overflow_raises_before_the_stream_starts():
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": PROMPT, "max_tokens": 1, "stream": True})
    with pytest.raises(OpenAIError) as err:
        asyncio.run(create_completion(engine(max_model_len=len(TOKENIZER.encode(PROMPT)) - 1), request, context()))
    assert (err.value.status, err.value.code, err.value.param) == (400, "context_length_exceeded", "prompt")


def test_max_tokens_over_the_room_left_is_a_max_tokens_error_not_a_prompt_overflow():
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": PROMPT, "max_tokens": 100})
    with pytest.raises(OpenAIError) as err:
        asyncio.run(create_completion(engine(max_model_len=50), request, context()))
    room = 50 - len(TOKENIZER.encode(PROMPT))
    assert (err.value.status, err.value.param) == (400, "max_tokens")
    assert f"leaves at most {room} completion tokens" in err.value.message


def test_token_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(OpenAIError) as err:
        complete(engine(), prompt=[1, 999999])
    assert err.value.param == "prompt"


def test_unsupported_field_is_refused():
    with pytest.raises(OpenAIError) as err:
        complete(engine(), suffix="!")
    assert err.value.code == "unsupported_parameter"


def test_dead_engine_gives_503_before_the_stream():
    with pytest.raises(OpenAIError) as err:
        complete(engine(errored=True), stream=True)
    assert err.value.status == 503


def test_engine_dying_during_a_non_stream_request_gives_503():
    with pytest.raises(OpenAIError) as err:
        complete(engine(fail_after=2))
    assert err.value.status == 503


def test_engine_dying_mid_stream_raises_engine_unavailable_from_the_iterator():
    with pytest.raises(OpenAIError) as caught:
        complete(engine(fail_after=2), stream=True)
    assert (caught.value.status, caught.value.code) == (503, "engine_unavailable")


def test_closing_the_stream_aborts_every_engine_request():
    fake = engine()

    async def read_one_then_close():
        request = CompletionRequest.model_validate({"model": "tiny", "prompt": [PROMPT, "x"], "stream": True})
        stream = await create_completion(fake, request, context())
        await anext(stream)
        await stream.aclose()

    asyncio.run(read_one_then_close())
    assert sorted(fake.aborted) == ["cmpl-abc123-0", "cmpl-abc123-1"]
    assert sorted(fake.closed_unfinished) == ["cmpl-abc123-0", "cmpl-abc123-1"]


def test_cancelling_a_non_stream_request_aborts_it():
    fake = engine(Script(GENERATED * 20))

    async def cancel_midway():
        request = CompletionRequest.model_validate({"model": "tiny", "prompt": PROMPT, "max_tokens": 500})
        task = asyncio.create_task(create_completion(fake, request, context()))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_midway())
    assert fake.aborted == ["cmpl-abc123-0"]


# ---- metrics ----------------------------------------------------------------------------------------

def test_metrics_see_one_ttft_one_e2e_the_tokens_and_each_finish():
    metrics = RecordingMetrics()
    ascii_ids = TOKENIZER.encode(" one token per delta")
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 50})
    asyncio.run(_complete(engine(Script(ascii_ids)), request, context(metrics=metrics)))
    assert len(metrics.ttft) == 1 and len(metrics.e2e) == 1
    assert len(metrics.itl) == 2 * len(ascii_ids) - 2  # every later delta of each choice
    assert [sum(column) for column in zip(*metrics.tokens)] == [len(TOKENIZER.encode(PROMPT)), 2 * len(ascii_ids)]
    assert metrics.finishes == ["length", "length"]
    assert metrics.sizes == [(len(TOKENIZER.encode(PROMPT)), len(ascii_ids))] * 2
