"""Errors as the clients see them (status, SDK exception class, code, param), and the small
endpoints around the API: models, health, tokenize."""

from __future__ import annotations

from typing import Any

import httpx
import litellm
import openai
import pytest
from langchain_openai import ChatOpenAI

from .conftest import API_KEY, MODEL

BODY_LIMIT_BYTES = 4 * 1024 * 1024  # the server's default --max-body-bytes
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def client(api_base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=api_base, api_key=API_KEY, max_retries=0)


def assert_openai_error_shape(body: dict[str, Any]) -> None:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["code"] is None or isinstance(body["error"]["code"], str)


# ---- 400 for bad values, with param (never pydantic's 422) ----------------------------------------

@pytest.mark.parametrize(("param", "bad"), [
    ("temperature", {"temperature": 3}),
    ("n", {"n": 0}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
], ids=["temperature_3", "n_0", "top_logprobs_without_logprobs", "five_stop_strings"])
def test_bad_value_is_400_naming_the_param(client: openai.OpenAI, param: str, bad: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, **bad)
    assert caught.value.status_code == 400
    assert caught.value.param == param
    assert caught.value.type == "invalid_request_error"
    assert_openai_error_shape(caught.value.response.json())


def test_bad_completion_value_is_400_naming_the_param(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, temperature=3)
    assert caught.value.param == "temperature"


def test_missing_required_field_is_400_not_422(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL})
    assert response.status_code == 400
    assert_openai_error_shape(response.json())
    assert response.json()["error"]["param"] == "messages"


# ---- auth, model, size ----------------------------------------------------------------------------

def test_wrong_key_is_401(api_base: str) -> None:
    wrong = openai.OpenAI(base_url=api_base, api_key="not-the-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4)
    assert caught.value.code == "invalid_api_key"


def test_missing_key_is_401(client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                       extra_headers={"Authorization": openai.Omit()})


def test_missing_key_on_the_wire_is_401(server_url: str) -> None:
    response = httpx.post(f"{server_url}/v1/completions", json={"model": MODEL, "prompt": "Hi"})
    assert response.status_code == 401
    assert_openai_error_shape(response.json())


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=4)
    assert caught.value.code == "model_not_found"
    assert "no-such-model" in caught.value.message


def test_body_over_the_limit_is_413(http: httpx.Client) -> None:
    prompt = "a" * (5 * 1024 * 1024)
    assert len(prompt) > BODY_LIMIT_BYTES
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    assert response.status_code == 413
    assert_openai_error_shape(response.json())


def test_chunked_body_over_the_limit_is_413(http: httpx.Client) -> None:
    def body():  # no Content-Length: the server must count while it reads
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(5):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    response = http.post("/v1/completions", content=body(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    assert_openai_error_shape(response.json())


def test_final_error_tells_the_sdk_not_to_retry(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "temperature": 3})
    assert response.status_code == 400
    assert response.headers.get("x-should-retry") == "false"


# ---- context overflow -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_text(max_model_len: int) -> str:
    return "hello world " * max_model_len  # at least two tokens a repeat: over any context


def test_chat_context_overflow_is_400_context_length_exceeded(client: openai.OpenAI, http: httpx.Client,
                                                               max_model_len: int, long_text: str) -> None:
    messages = [{"role": "user", "content": long_text}]
    prompt_tokens = http.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.param == "messages"
    assert f"limit of {max_model_len} tokens" in caught.value.message
    assert f"resulted in {prompt_tokens} tokens" in caught.value.message


def test_completion_context_overflow_is_400_context_length_exceeded(client: openai.OpenAI, http: httpx.Client,
                                                                     max_model_len: int, long_text: str) -> None:
    prompt_tokens = http.post("/tokenize", json={"model": MODEL, "prompt": long_text}).json()["count"]
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=long_text, max_tokens=4)
    assert caught.value.code == "context_length_exceeded"
    assert f"limit of {max_model_len} tokens" in caught.value.message
    assert f"resulted in {prompt_tokens} tokens" in caught.value.message


def test_streamed_context_overflow_is_a_plain_http_error(client: openai.OpenAI, long_text: str) -> None:
    """Found before the first byte, so a status the SDK raises on, not an in-band stream event."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}], stream=True)
    assert caught.value.code == "context_length_exceeded"


def test_langchain_classifies_context_overflow(api_base: str, long_text: str) -> None:
    from langchain_openai.chat_models.base import OpenAIContextOverflowError

    chat = ChatOpenAI(base_url=api_base, api_key=API_KEY, model=MODEL, max_retries=0)
    with pytest.raises(OpenAIContextOverflowError):
        chat.invoke(long_text)


def test_litellm_classifies_context_overflow(api_base: str, long_text: str) -> None:
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{MODEL}", api_base=api_base, api_key=API_KEY, num_retries=0,
                           messages=[{"role": "user", "content": long_text}])


# ---- request ids, bad JSON ------------------------------------------------------------------------

def test_success_carries_x_request_id(client: openai.OpenAI) -> None:
    completion = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert completion._request_id


def test_error_carries_x_request_id(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)
    assert caught.value.request_id


def test_stream_carries_x_request_id(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stream": True})
    assert response.status_code == 200
    assert response.headers.get("x-request-id")


def test_invalid_json_is_400_in_openai_shape(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b'{"model": "tiny", "messages": [',
                         headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert_openai_error_shape(response.json())
    assert response.json()["error"]["type"] == "invalid_request_error"
    assert response.headers.get("x-request-id")


# ---- models, health, tokenizer --------------------------------------------------------------------

def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]


def test_health_needs_no_key(server_url: str) -> None:
    assert httpx.get(f"{server_url}/health").status_code == 200


def test_tokenize_then_detokenize_round_trips(http: httpx.Client) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    tokenized = http.post("/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) > 1
    detokenized = http.post("/detokenize", json={"model": MODEL, "tokens": tokenized["tokens"]}).json()
    assert detokenized["prompt"] == text
