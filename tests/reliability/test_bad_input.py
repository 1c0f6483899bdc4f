"""A hand-made battery of hostile requests against a real server. Each answer is a 4xx in OpenAI's
error shape (never a 5xx, never FastAPI's 422), and the server serves the next request."""

from __future__ import annotations

import json

import httpx
import pytest

from harness import MODEL

from .conftest import assert_openai_error

MAX_MODEL_LEN = 1024  # conftest.FUZZ_FLAGS
MAX_PROMPT_TOKENS = 900
HUGE = 10**30  # past what JSON parsers and msgpack take as an integer
U64 = 2**64 - 1  # the largest integer the JSON parser takes


def post_raw(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.fixture(autouse=True)
def still_serving(http: httpx.Client):
    """After every hostile request, a plain one is still answered."""
    yield
    response = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert response.status_code == 200, response.text


def prompt_over(http: httpx.Client, tokens: int) -> str:
    """A text prompt of more than `tokens` tokens."""
    text = " hello" * tokens
    assert http.post("/tokenize", json={"prompt": text}).json()["count"] > tokens
    return text


# ---- bodies that are not the JSON object we expect ----

@pytest.mark.parametrize("content", [
    b"", b"{", b'{"model": "tiny",}', b"[1, 2]", b'"just a string"', b"null", b"\x00\x01\x02",
    b'{"model": "tiny", "prompt": "x"} trailing',
], ids=["empty", "truncated", "trailing-comma", "array", "string", "null", "binary", "trailing-garbage"])
def test_invalid_json_is_400(http, content):
    assert_openai_error(post_raw(http, "/v1/completions", content), 400)


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400"])
def test_nan_and_infinite_numbers_are_400(http, literal):
    content = b'{"model": "tiny", "prompt": "x", "temperature": ' + literal + b"}"
    assert_openai_error(post_raw(http, "/v1/completions", content), 400)


@pytest.mark.parametrize("value", [HUGE, U64, -HUGE])
@pytest.mark.parametrize("field", ["max_tokens", "n", "min_tokens", "seed", "logprobs", "best_of"])
def test_huge_integers_are_400(http, completion, field, value):
    assert_openai_error(http.post("/v1/completions", json={**completion, field: value}), 400)


@pytest.mark.parametrize("value", [HUGE, U64])
@pytest.mark.parametrize("field", ["min_tokens", "max_completion_tokens", "top_logprobs"])
def test_huge_integers_in_chat_are_400(http, chat, field, value):
    body = {key: item for key, item in chat.items() if key != "max_tokens"}
    assert_openai_error(http.post("/v1/chat/completions", json={**body, field: value, "logprobs": True}), 400)


@pytest.mark.parametrize("value", [U64, 2**63])
def test_huge_top_k_means_no_cut(http, completion, value):
    assert http.post("/v1/completions", json={**completion, "top_k": value}).status_code == 200


@pytest.mark.parametrize("body", [
    {"prompt": [HUGE]}, {"prompt": [[1, U64]]}, {"stop_token_ids": [U64]}, {"logit_bias": {str(HUGE): 1}},
    {"logit_bias": {"8192": 1}}, {"prompt": [-1]}, {"prompt": [8192]},
], ids=["prompt-id", "nested-prompt-id", "stop-token-id", "logit-bias-key", "logit-bias-past-vocab", "negative-id",
        "id-past-vocab"])
def test_out_of_range_token_ids_are_400(http, completion, body):
    assert_openai_error(http.post("/v1/completions", json={**completion, **body}), 400)


@pytest.mark.parametrize("body", [
    {"prompt": 5}, {"prompt": {"text": "x"}}, {"n": "two"}, {"stream": "maybe"}, {"temperature": "hot"},
    {"max_tokens": 1.5}, {"stop": 3}, {"logit_bias": []}, {"model": 7}, {"stream_options": "usage"},
    {"echo": [True]},
], ids=lambda body: next(iter(body)))
def test_wrong_types_are_400(http, completion, body):
    assert_openai_error(http.post("/v1/completions", json={**completion, **body}), 400)


@pytest.mark.parametrize("messages", [
    "hi", [], [{"role": "wizard", "content": "x"}], [{"content": "x"}], [{"role": "user", "content": 5}],
    [{"role": "user", "content": [{"type": "text"}]}], [None],
], ids=["string", "empty", "bad-role", "no-role", "int-content", "part-without-text", "null-message"])
def test_malformed_messages_are_400(http, chat, messages):
    assert_openai_error(http.post("/v1/chat/completions", json={**chat, "messages": messages}), 400)


# ---- text that is not valid Unicode ----

@pytest.mark.parametrize("raw", [b"\xff\xfe", b"\xed\xa0\x80", b"\xc3"], ids=["ff-fe", "encoded-surrogate", "cut-char"])
def test_invalid_utf8_is_400(http, raw):
    assert_openai_error(post_raw(http, "/v1/completions", b'{"model": "tiny", "prompt": "' + raw + b'"}'), 400)


@pytest.mark.parametrize("escape", [r"\ud800", r"\udfff", r"x\ud83dy"])
def test_lone_surrogate_escapes_are_400(http, escape):
    for path, body in (("/v1/completions", f'{{"model": "tiny", "prompt": "{escape}"}}'),
                       ("/v1/chat/completions",
                        f'{{"model": "tiny", "messages": [{{"role": "user", "content": "{escape}"}}]}}'),
                       ("/tokenize", f'{{"prompt": "{escape}"}}')):
        assert_openai_error(post_raw(http, path, body.encode()), 400)


def test_nul_characters_are_just_text(http, completion):
    response = http.post("/v1/completions", json={**completion, "prompt": "a\u0000b"})
    assert response.status_code == 200, response.text


# ---- size and shape ----

@pytest.mark.parametrize("depth", [100, 10_000])
def test_deeply_nested_json_is_400(http, depth):
    nested = b"[" * depth + b"]" * depth
    assert_openai_error(post_raw(http, "/v1/completions", b'{"model": "tiny", "prompt": ' + nested + b"}"), 400)


def test_deeply_nested_messages_are_400(http, chat):
    content = json.dumps({**chat, "messages": [{"role": "user", "content": [[[[[["x"]]]]]]}]})
    assert_openai_error(post_raw(http, "/v1/chat/completions", content.encode()), 400)


def test_ten_megabyte_body_is_413(http, completion):
    content = json.dumps({**completion, "prompt": "x" * 10_000_000}).encode()
    assert_openai_error(post_raw(http, "/v1/completions", content), 413)


def test_ten_megabyte_chunked_body_is_413(http):
    def chunks():
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(100):
            yield b"x" * 100_000
        yield b'"}'

    assert_openai_error(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}),
                        413)


@pytest.mark.parametrize("prompt", ["", [], [[]], [""]],
                         ids=["empty-string", "empty-list", "empty-ids", "list-of-empty"])
def test_empty_prompts_are_400(http, completion, prompt):
    assert_openai_error(http.post("/v1/completions", json={**completion, "prompt": prompt}), 400)


def test_prompt_over_the_prompt_cap_is_a_context_overflow(http, completion):
    error = assert_openai_error(
        http.post("/v1/completions", json={**completion, "prompt": prompt_over(http, MAX_PROMPT_TOKENS)}), 400)
    assert error["code"] == "context_length_exceeded"


def test_prompt_over_the_context_is_a_context_overflow(http, completion):
    ids = [5] * (MAX_MODEL_LEN + 1)
    error = assert_openai_error(http.post("/v1/completions", json={**completion, "prompt": ids}), 400)
    assert error["code"] == "context_length_exceeded"


def test_over_long_chat_is_a_context_overflow(http, chat):
    messages = [{"role": "user", "content": prompt_over(http, MAX_MODEL_LEN)}]
    error = assert_openai_error(http.post("/v1/chat/completions", json={**chat, "messages": messages}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")


def test_n_choices_beyond_the_kv_cache_are_400(http, completion):
    body = {**completion, "prompt": [5] * 890, "max_tokens": 8}
    assert http.post("/v1/completions", json={**body, "n": 1}).status_code == 200  # one choice fits
    error = assert_openai_error(http.post("/v1/completions", json={**body, "n": 16}), 400)
    assert "KV blocks" in error["message"]


@pytest.mark.parametrize("body", [{"n": 17}, {"max_tokens": 9}, {"logprobs": 5, "max_tokens": 2}],
                         ids=["n", "max_tokens", "logprobs-ok"])
def test_caps_on_n_and_max_tokens(http, completion, body):
    response = http.post("/v1/completions", json={**completion, **body})
    if "logprobs" in body:
        assert response.status_code == 200, response.text
    else:
        assert assert_openai_error(response, 400)["code"] == "integer_above_max_value"


def test_too_many_stop_strings_are_400(http, completion):
    error = assert_openai_error(http.post("/v1/completions", json={**completion, "stop": ["x"] * 17}), 400)
    assert (error["param"], error["code"]) == ("stop", "array_above_max_length")


def test_over_long_stop_string_is_400(http, completion):
    error = assert_openai_error(http.post("/v1/completions", json={**completion, "stop": "x" * 257}), 400)
    assert (error["param"], error["code"]) == ("stop", "string_above_max_length")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404(http, completion, chat, path):
    body = completion if path == "/v1/completions" else chat
    error = assert_openai_error(http.post(path, json={**body, "model": "gpt-4o"}), 404)
    assert error["code"] == "model_not_found"


def test_model_path_is_never_read_from_a_request(http, completion):
    error = assert_openai_error(http.post("/v1/completions", json={**completion, "model": "/etc/passwd"}), 404)
    assert "root:" not in error["message"]
