"""The operator's caps, the bounded queue and the per-request timeout, through the serving layer
against scripted engines."""

from __future__ import annotations

import asyncio

import pytest

from tailrace.outputs import CompletionOutput, RequestOutput
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.completions import create_completion
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError
from tailrace.serving.limits import Admission, Limits
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest
from serving_fakes import FakeEngine, Script, drain, same_script, tiny_tokenizer

TOKENIZER = tiny_tokenizer()
GENERATED = TOKENIZER.encode(" and then some")


def ctx(limits: Limits | None = None, admission: Admission | None = None) -> RequestContext:
    return RequestContext(request_id="req-abc", model_name="tiny", metrics=None, limits=limits or Limits(),
                          admission=admission)


def scripted() -> FakeEngine:
    return FakeEngine(TOKENIZER, same_script(Script(GENERATED)))


def complete(engine, limits: Limits, **body):
    request = CompletionRequest.model_validate({"model": "tiny", "prompt": "Once upon", **body})
    return asyncio.run(_collect(create_completion(engine, request, ctx(limits)), request.stream))


def chat(engine, limits: Limits, **body):
    request = ChatCompletionRequest.model_validate(
        {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **body})
    return asyncio.run(_collect(create_chat_completion(engine, request, ctx(limits)), request.stream))


async def _collect(result, stream: bool):
    outcome = await result
    return await drain(outcome) if stream else outcome


def refused(call, *args, **body) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        call(*args, **body)
    return caught.value


class StallingEngine:
    """Sends one delta per choice, then nothing until cancelled; records what was aborted."""

    def __init__(self) -> None:
        self.tokenizer = TOKENIZER
        self.max_model_len = 4096
        self.errored = False
        self.is_ready = True
        self.closed_unfinished: list[str] = []

    async def add_request(self, request_id, prompt_token_ids, params):
        try:
            for sibling in range(params.n):
                yield RequestOutput(request_id, prompt_token_ids, [CompletionOutput(sibling, " a", [GENERATED[0]])])
            await asyncio.Event().wait()
        finally:
            self.closed_unfinished.append(request_id)

    async def abort(self, request_id):
        pass


# ---- caps ----

def test_n_over_the_cap_is_400_integer_above_max_value():
    error = refused(complete, scripted(), Limits(max_n=4), n=5)
    assert (error.status, error.param, error.code) == (400, "n", "integer_above_max_value")


def test_n_at_the_cap_is_served():
    assert len(complete(scripted(), Limits(max_n=4), n=4)["choices"]) == 4


def test_max_tokens_over_the_cap_is_400():
    error = refused(complete, scripted(), Limits(max_tokens=8), max_tokens=9)
    assert (error.param, error.code) == ("max_tokens", "integer_above_max_value")


def test_chat_cap_names_max_completion_tokens_when_the_client_sent_it():
    error = refused(chat, scripted(), Limits(max_tokens=8), max_completion_tokens=9)
    assert error.param == "max_completion_tokens"


def test_chat_without_max_tokens_generates_at_most_the_cap():
    engine = scripted()
    chat(engine, Limits(max_tokens=8))
    assert engine.started[0][2].max_tokens == 8


def test_completion_default_of_16_is_lowered_to_a_smaller_cap():
    engine = scripted()
    complete(engine, Limits(max_tokens=4))
    assert engine.started[0][2].max_tokens == 4


def test_min_tokens_over_the_max_tokens_cap_is_400():
    assert refused(chat, scripted(), Limits(max_tokens=8), min_tokens=9).param == "min_tokens"


def test_logprobs_over_the_cap_is_400():
    assert refused(complete, scripted(), Limits(max_logprobs=2), logprobs=3).param == "logprobs"
    assert refused(chat, scripted(), Limits(max_logprobs=2), logprobs=True, top_logprobs=3).param == "top_logprobs"


def test_too_many_stop_strings_is_400_array_above_max_length():
    error = refused(complete, scripted(), Limits(max_stop_sequences=2), stop=["a", "b", "c"])
    assert (error.param, error.code) == ("stop", "array_above_max_length")


def test_stop_strings_at_the_cap_are_served():
    assert complete(scripted(), Limits(max_stop_sequences=2), stop=["a", "b"])["choices"]


def test_over_long_stop_string_is_400():
    error = refused(complete, scripted(), Limits(max_stop_chars=3), stop="abcd")
    assert (error.param, error.code) == ("stop", "string_above_max_length")


def test_prompt_over_max_prompt_tokens_is_a_context_overflow():
    error = refused(complete, scripted(), Limits(max_prompt_tokens=2), prompt=[5, 6, 7])
    assert (error.status, error.param, error.code) == (400, "prompt", "context_length_exceeded")
    assert "Input tokens exceed the configured limit of 2 tokens" in error.message


def test_chat_prompt_over_max_prompt_tokens_names_messages():
    assert refused(chat, scripted(), Limits(max_prompt_tokens=2)).param == "messages"


@pytest.mark.parametrize("field", ["max_n", "max_num_seqs", "max_tokens", "max_prompt_tokens", "request_timeout_s"])
def test_limits_refuse_a_zero_cap(field):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: 0}).validate()


# ---- the bounded queue ----

def test_admission_refuses_past_running_plus_waiting_with_retry_after():
    admission = Admission(Limits(max_num_seqs=2, max_waiting_seqs=1))
    with admission.hold(2), pytest.raises(OpenAIError) as caught, admission.hold(2):
        pass
    error = caught.value
    assert (error.status, error.type, error.code) == (429, "requests", "rate_limit_exceeded")
    assert error.headers["retry-after"] == "1"


def test_admission_gives_the_place_back_when_the_request_ends():
    admission = Admission(Limits(max_num_seqs=1, max_waiting_seqs=0))
    with admission.hold(1):
        assert admission.in_flight == 1
    with admission.hold(1):
        pass
    assert admission.in_flight == 0


def test_full_queue_refuses_a_stream_before_its_first_byte_and_frees_on_close():
    async def main():
        admission = Admission(Limits(max_num_seqs=1, max_waiting_seqs=1))
        engine = StallingEngine()
        request = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "n": 2, "stream": True})
        first = await create_completion(engine, request, ctx(admission=admission))
        await anext(first)  # holds both places
        second = await create_completion(engine, request.model_copy(), ctx(admission=admission))
        with pytest.raises(OpenAIError) as caught:
            await anext(second)
        await first.aclose()
        return caught.value.status, admission.in_flight

    assert asyncio.run(main()) == (429, 0)


# ---- the per-request timeout ----

def test_non_stream_past_the_timeout_is_408_and_aborts_the_request():
    engine = StallingEngine()
    error = refused(complete, engine, Limits(request_timeout_s=0.05))
    assert (error.status, error.code) == (408, "request_timeout")
    assert engine.closed_unfinished == ["cmpl-abc-0"]


def test_stream_past_the_timeout_raises_408_after_its_chunks():
    async def main():
        engine = StallingEngine()
        request = CompletionRequest.model_validate({"model": "tiny", "prompt": "x", "stream": True})
        chunks = await create_completion(engine, request, ctx(Limits(request_timeout_s=0.05)))
        received = []
        with pytest.raises(OpenAIError) as caught:
            async for chunk in chunks:
                received.append(chunk)
        return len(received), caught.value.code, engine.closed_unfinished

    assert asyncio.run(main()) == (1, "request_timeout", ["cmpl-abc-0"])


def test_timeout_spans_every_prompt_of_a_batch():
    engine = StallingEngine()
    error = refused(complete, engine, Limits(request_timeout_s=0.05), prompt=["a", "b"])
    assert error.status == 408
    assert sorted(engine.closed_unfinished) == ["cmpl-abc-0", "cmpl-abc-1"]
