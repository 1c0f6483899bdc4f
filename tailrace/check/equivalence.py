"""Stream == non-stream: one request asked both ways says the same, choice by choice: text,
finish_reason, logprobs, and the usage chunk's totals."""

from __future__ import annotations

from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.compare import choice_difference, usage_difference
from tailrace.check.probe import logprobs_fields
from tailrace.check.results import fail, ignore
from tailrace.check.session import Check, Session
from tailrace.check.wire import read_full, read_stream, usage_chunks

GROUP = "equivalence"
TOP = 2


def assert_stream_equals_full(session: Session, endpoint: str, body: dict[str, Any]) -> Exchange:
    """The stream of `body` (with usage) against its non-stream answer; the stream when they agree."""
    _, full = session.full(endpoint, body)
    stream = session.stream(endpoint, body)
    chunks = stream.chunks()
    full_choices, streamed = read_full(endpoint, full), read_stream(endpoint, chunks)
    if full_choices.keys() != streamed.keys():
        fail(f"the stream has choices {sorted(streamed)}, the non-stream answer {sorted(full_choices)}", stream)
    for index in sorted(full_choices):
        reason = choice_difference(streamed[index], full_choices[index])
        if reason is not None:
            fail(reason if len(full_choices) == 1 else f"choice {index}: {reason}", stream)
    assert_usage_equals_full(stream, full)
    return stream


def assert_usage_equals_full(stream: Exchange, full: dict[str, Any]) -> None:
    chunks = stream.chunks()
    with_usage = usage_chunks(chunks)
    if not with_usage:
        fail("no usage chunk, though stream_options.include_usage was true", stream)
    reason = usage_difference(chunks[with_usage[-1]]["usage"], full.get("usage"))
    if reason is not None:
        fail(reason, stream)


def _greedy(endpoint: str):
    def run(session: Session) -> None:
        assert_stream_equals_full(session, endpoint, {**session.probe(endpoint).base, **logprobs_fields(endpoint, TOP)})
    return run


def _seeded(endpoint: str):
    def run(session: Session) -> None:
        assert_stream_equals_full(session, endpoint, session.seeded(endpoint, **logprobs_fields(endpoint, TOP)))
    return run


def _completions_echo(session: Session) -> None:
    probe = session.probe("completions")
    body = {**probe.echo_body, **logprobs_fields("completions", TOP)}
    _, full = session.full("completions", body)
    text = read_full("completions", full)[0].text
    if not text.startswith(probe.echoed):
        fail(f"with echo the answer does not start with the prompt: {text[:80]!r}", session.post("completions", body))
    assert_stream_equals_full(session, "completions", body)


def _chat_echo(session: Session) -> None:
    probe = session.probe("chat")
    exchange = session.post("chat", probe.echo_body)
    if exchange.status != 200:
        ignore(f"chat `echo` (vLLM's extension) is not served: {exchange.status}", exchange)
    choice = read_full("chat", exchange.json() or {}).get(0)
    if choice is None or not choice.text.startswith(probe.echoed):
        ignore("chat `echo` (vLLM's extension) is accepted but does not repeat the last message", exchange)
    assert_stream_equals_full(session, "chat", probe.echo_body)


CHECKS = [
    Check(GROUP, "completions greedy", "a greedy stream joins to the non-stream answer: text, finish_reason, "
          "logprobs (tokens, token_logprobs, top_logprobs, text_offset), usage", _greedy("completions")),
    Check(GROUP, "completions echo", "with echo, the stream joins to the non-stream answer, which starts with "
          "the prompt", _completions_echo),
    Check(GROUP, "completions seeded", "a sampled stream with a seed joins to the non-stream answer with that "
          "seed", _seeded("completions")),
    Check(GROUP, "chat greedy", "a greedy chat stream joins to the non-stream answer: content, finish_reason, "
          "logprobs (content, bytes, top_logprobs), usage", _greedy("chat")),
    Check(GROUP, "chat echo", "with vLLM's chat echo, the stream joins to the non-stream answer", _chat_echo),
    Check(GROUP, "chat seeded", "a sampled chat stream with a seed joins to the non-stream answer with that "
          "seed", _seeded("chat")),
]
