"""Prompts and stop strings chosen from the model's own greedy output, so that no check depends on
what a particular model writes: ask once without a stop, then cut a stop string that spans a token
boundary out of what came back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.expect import ok_json, require_endpoint
from tailrace.check.results import skip
from tailrace.check.wire import read_full

MAX_TOKENS = 32
COMPLETION_PROMPTS = ("Once upon a time", "The quick brown fox", "Here is a list of things to do:")
CHAT_MESSAGES = ("Tell me a story.", "Describe the sea in a few sentences.", "What is a list?")
ECHOED = "Once upon a time"  # the assistant message chat's echo continues
STOP_SIDES = ((2, 2), (1, 2), (2, 1), (1, 1))  # characters taken before and after the token boundary


@dataclass(frozen=True, slots=True)
class Probe:
    endpoint: str
    base: dict[str, Any]  # model, prompt or messages, max_tokens, temperature 0
    text: str  # the greedy answer without a stop
    stop: str  # spans a token boundary of `text`, first found at `stop_at`
    stop_at: int
    echo_body: dict[str, Any]  # the base request with echo on
    echoed: str  # what echo puts in front of the answer


def base_request(endpoint: str, model: str, attempt: int) -> dict[str, Any]:
    if endpoint == "completions":
        prompt: dict[str, Any] = {"prompt": COMPLETION_PROMPTS[attempt]}
    else:
        prompt = {"messages": [{"role": "user", "content": CHAT_MESSAGES[attempt]}]}
    return {"model": model, **prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def logprobs_fields(endpoint: str, top: int) -> dict[str, Any]:
    return {"logprobs": top} if endpoint == "completions" else {"logprobs": True, "top_logprobs": top}


def echo_request(endpoint: str, base: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The base request with echo on, and the text echo repeats (chat's echo is vLLM's extension)."""
    if endpoint == "completions":
        return {**base, "echo": True}, base["prompt"]
    messages = [*base["messages"], {"role": "assistant", "content": ECHOED}]
    return {**base, "messages": messages, "echo": True}, ECHOED


def spanning_stop(text: str, tokens: list[bytes] | None) -> tuple[str, int] | None:
    """A short stop string across a token boundary near the middle of `text` (any character boundary
    when the server's tokens do not spell its text), found first where it is cut, with text before it."""
    if tokens and b"".join(tokens) != text.encode():
        tokens = tokens[:-1]  # a last end-of-sequence token adds no text
    if tokens and b"".join(tokens) == text.encode():
        spans = [b"".join(tokens[:i]) for i in range(1, len(tokens))]
        boundaries = [len(span.decode()) for span in spans if _whole_characters(span)]
    else:
        boundaries = list(range(1, len(text)))
    for boundary in sorted(boundaries, key=lambda b: abs(b - len(text) // 2)):
        for before, after in STOP_SIDES:
            start = boundary - before
            stop = text[start:boundary + after]
            if start >= 1 and len(stop) == before + after and stop.strip() == stop and text.find(stop) == start:
                return stop, start
    return None


def _whole_characters(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def find_probe(post: Callable[[str, dict[str, Any]], Exchange], model: str, endpoint: str) -> Probe:
    """A greedy answer of `model` to cut a stop string from; `post` makes (or recalls) each exchange."""
    for attempt in range(len(COMPLETION_PROMPTS)):
        base = base_request(endpoint, model, attempt)
        exchange = post(endpoint, {**base, **logprobs_fields(endpoint, 0)})
        require_endpoint(exchange, endpoint)
        if exchange.status != 200:  # logprobs refused: the stop string spans characters instead
            exchange = post(endpoint, base)
        choice = read_full(endpoint, ok_json(exchange)).get(0)
        if choice is None:
            continue
        tokens = None if choice.tokens is None else [token.raw or b"" for token in choice.tokens]
        found = spanning_stop(choice.text, tokens)
        if found is not None:
            echo_body, echoed = echo_request(endpoint, base)
            return Probe(endpoint, base, choice.text, found[0], found[1], echo_body, echoed)
    skip(f"the model's greedy answers to {len(COMPLETION_PROMPTS)} prompts were too short to cut a stop string from")
