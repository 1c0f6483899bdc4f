"""The official clients against a real server: the OpenAI SDK (sync, async, streaming), LangChain's
ChatOpenAI and legacy OpenAI LLM, and LiteLLM. Each gets real text, a finish reason, and usage that adds up.
Every test runs twice: against the session's server, and against one whose model is split over two
tensor-parallel ranks (`--tensor-parallel-size 2`; not through Ray, whose run is of the replicas)."""

from __future__ import annotations

import asyncio
from typing import Any

import litellm
import openai
import pytest
from langchain_openai import ChatOpenAI
from langchain_openai import OpenAI as LangChainOpenAI

from .conftest import API_KEY, MODEL, THROUGH_RAY, TP_SIZE

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore:.*ReadOnly.*:UserWarning")]  # noise from LiteLLM's imports

MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "Write a short story about a cat."}]
PROMPT = "Once upon a time"
FINISH_REASONS = ("stop", "length")


def check_usage(prompt_tokens: int, completion_tokens: int, total_tokens: int) -> None:
    assert prompt_tokens > 0
    assert 0 < completion_tokens <= MAX_TOKENS
    assert total_tokens == prompt_tokens + completion_tokens


def check_text(text: str | None) -> None:
    assert isinstance(text, str) and text.strip(), f"expected real text, got {text!r}"


@pytest.fixture(scope="module", params=[1] if THROUGH_RAY else [1, TP_SIZE], ids=lambda size: f"tp{size}")
def api_base(request: pytest.FixtureRequest) -> str:
    """The session's server, then the tensor-parallel one (its own fixture, so it starts only here)."""
    return f"{request.getfixturevalue('server_url' if request.param == 1 else 'tp_server_url')}/v1"


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)


# ---- openai SDK -------------------------------------------------------------------------------------

def test_sdk_sync_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    choice, = completion.choices
    check_text(choice.text)
    assert choice.finish_reason in FINISH_REASONS
    check_usage(completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)


def test_sdk_sync_streaming_chat(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True)
    chunks = list(stream)
    check_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        in [["stop"], ["length"]]


def test_sdk_stream_sends_one_usage_chunk_last(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1]
    last = chunks[-1]
    assert last.choices == []
    check_usage(last.usage.prompt_tokens, last.usage.completion_tokens, last.usage.total_tokens)


def test_sdk_async_completion(api_base: str) -> None:
    async def main() -> Any:
        async with openai.AsyncOpenAI(base_url=api_base, api_key=API_KEY, max_retries=0) as aclient:
            return await aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)

    completion = asyncio.run(main())
    check_text(completion.choices[0].text)
    assert completion.choices[0].finish_reason in FINISH_REASONS
    check_usage(completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)


def test_sdk_async_streaming_chat(api_base: str) -> None:
    async def main() -> list[Any]:
        async with openai.AsyncOpenAI(base_url=api_base, api_key=API_KEY, max_retries=0) as aclient:
            stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS,
                                                           temperature=0, stream=True,
                                                           stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(main())
    check_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    usage = chunks[-1].usage
    check_usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def test_sdk_stream_helper_accumulates_two_choices(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, n=2, seed=7,
                                        temperature=1.0) as stream:
        for _ in stream:
            pass
        completion = stream.current_completion_snapshot  # get_final_completion() refuses "length" finishes
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        check_text(choice.message.content)
        assert choice.finish_reason in FINISH_REASONS


# ---- LangChain --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_model(api_base: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=api_base, api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                      max_retries=0)


def test_langchain_chat_invoke(chat_model: ChatOpenAI) -> None:
    message = chat_model.invoke(CHAT[0]["content"])
    check_text(message.content)
    assert message.response_metadata["finish_reason"] in FINISH_REASONS
    usage = message.usage_metadata
    check_usage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])


def test_langchain_chat_stream_counts_usage_once(chat_model: ChatOpenAI) -> None:
    chunks = list(chat_model.stream(CHAT[0]["content"], stream_usage=True))
    message = chunks[0]
    for chunk in chunks[1:]:
        message += chunk  # LangChain sums usage over chunks: usage sent twice would double it
    check_text(message.content)
    assert message.response_metadata["finish_reason"] in FINISH_REASONS
    usage = message.usage_metadata
    check_usage(usage["input_tokens"], usage["output_tokens"], usage["total_tokens"])


def test_langchain_legacy_llm_invoke(api_base: str) -> None:
    llm = LangChainOpenAI(base_url=api_base, api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                          max_retries=0)
    check_text(llm.invoke(PROMPT))


def test_langchain_legacy_llm_stream(api_base: str) -> None:
    llm = LangChainOpenAI(base_url=api_base, api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                          max_retries=0)
    check_text("".join(llm.stream(PROMPT)))


def test_langchain_legacy_llm_reports_usage(api_base: str) -> None:
    llm = LangChainOpenAI(base_url=api_base, api_key=API_KEY, model=MODEL, max_tokens=MAX_TOKENS, temperature=0,
                          max_retries=0)
    result = llm.generate([PROMPT])
    generation, = result.generations[0]
    check_text(generation.text)
    assert generation.generation_info["finish_reason"] in FINISH_REASONS
    usage = result.llm_output["token_usage"]
    check_usage(usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"])


# ---- LiteLLM ----------------------------------------------------------------------------------------

def test_litellm_chat_completion(api_base: str) -> None:
    response = litellm.completion(model=f"openai/{MODEL}", api_base=api_base, api_key=API_KEY, messages=CHAT,
                                  max_tokens=MAX_TOKENS, temperature=0)
    check_text(response.choices[0].message.content)
    assert response.choices[0].finish_reason in FINISH_REASONS
    check_usage(response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens)


def test_litellm_streaming_chat(api_base: str) -> None:
    stream = litellm.completion(model=f"openai/{MODEL}", api_base=api_base, api_key=API_KEY, messages=CHAT,
                                max_tokens=MAX_TOKENS, temperature=0, stream=True,
                                stream_options={"include_usage": True})
    chunks = list(stream)
    check_text("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] \
        in [["stop"], ["length"]]
    usage = litellm.stream_chunk_builder(chunks).usage
    check_usage(usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)


def test_litellm_text_completion(api_base: str) -> None:
    response = litellm.text_completion(model=f"text-completion-openai/{MODEL}", api_base=api_base, api_key=API_KEY,
                                       prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    check_text(response.choices[0].text)
    assert response.choices[0].finish_reason in FINISH_REASONS
    check_usage(response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens)


def test_litellm_text_completion_without_max_tokens_gets_the_default_16(api_base: str) -> None:
    """LiteLLM sends no max_tokens here; the legacy endpoint's default of 16 must apply."""
    response = litellm.text_completion(model=f"text-completion-openai/{MODEL}", api_base=api_base, api_key=API_KEY,
                                       prompt=PROMPT, temperature=0)
    check_text(response.choices[0].text)
    assert response.usage.completion_tokens <= 16
