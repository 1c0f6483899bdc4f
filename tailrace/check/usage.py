"""Finish and usage: one finish_reason per choice, in its last chunk; the usage chunk only when
asked, exactly once, after every choice finished, with empty choices and the non-stream totals."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.equivalence import assert_usage_equals_full
from tailrace.check.results import Verdict, fail, ignore, skip
from tailrace.check.session import Check, Session
from tailrace.check.wire import usage_chunks

GROUP = "usage"


def finish_problem(chunks: list[dict[str, Any]]) -> str | None:
    """Each choice has exactly one non-null finish_reason, on the last chunk that carries the choice."""
    finishes: dict[int, list[int]] = {}
    last: dict[int, int] = {}
    for number, chunk in enumerate(chunks):
        for part in chunk.get("choices") or []:
            index = part.get("index", 0)
            last[index] = number
            if part.get("finish_reason") is not None:
                finishes.setdefault(index, []).append(number)
    for index in sorted(last):
        at = finishes.get(index, [])
        if len(at) != 1:
            return f"choice {index} has {len(at)} finish_reasons (chunks {at})"
        if at[0] != last[index]:
            return f"choice {index} finishes in chunk {at[0]} but has a chunk after it ({last[index]})"
    return None


def usage_chunk_problem(chunks: list[dict[str, Any]]) -> str | None:
    """Exactly one usage chunk, after every finish, with `choices: []`."""
    with_usage = usage_chunks(chunks)
    if len(with_usage) != 1:
        return f"{len(with_usage)} chunks carry usage (chunks {with_usage}); exactly one should"
    at = with_usage[0]
    if chunks[at].get("choices") != []:
        return f"the usage chunk ({at}) has choices {chunks[at].get('choices')!r}, not []"
    if at != len(chunks) - 1:
        return f"the usage chunk ({at}) is not the last before [DONE] ({len(chunks) - 1})"
    return None


def _streams(session: Session, include_usage: bool | None) -> list[Exchange]:
    """Every stream made, those with usage asked for, or those without; continuous usage stats is
    a mode of its own."""
    streams = []
    for exchange in session.every_stream(include_usage is not False):
        options = exchange.body.get("stream_options") or {}
        if include_usage is None or (bool(options.get("include_usage")) == include_usage
                                     and not options.get("continuous_usage_stats")):
            streams.append(exchange)
    if not streams:
        skip("no stream could be made")
    return streams


def _every_stream(include_usage: bool | None, problem: Callable[[list[dict[str, Any]]], str | None]):
    def run(session: Session) -> None:
        for exchange in _streams(session, include_usage):
            reason = problem(exchange.chunks())
            if reason is not None:
                fail(reason, exchange)
    return run


def _unasked(chunks: list[dict[str, Any]]) -> str | None:
    with_usage = usage_chunks(chunks)
    return f"chunks {with_usage} carry usage, which was not asked for" if with_usage else None


def _totals(session: Session) -> None:
    for endpoint in ("completions", "chat"):
        try:
            body = session.probe(endpoint).base
        except Verdict:
            continue
        _, full = session.full(endpoint, body)
        assert_usage_equals_full(session.stream(endpoint, body), full)


def _continuous(session: Session) -> None:
    """vLLM's continuous_usage_stats: usage on every chunk, counting up to the final totals."""
    base = session.probe("completions").base
    stream = session.stream("completions", {**base, "stream_options": {"continuous_usage_stats": True}})
    content = [chunk for chunk in stream.chunks() if chunk.get("choices")]
    if not any(chunk.get("usage") for chunk in content[:-1]):  # usage on the last one alone is not per chunk
        ignore("continuous_usage_stats (vLLM's extension) is not served", stream)
    counts = [(chunk.get("usage") or {}).get("completion_tokens") for chunk in content]
    if None in counts or counts != sorted(counts):
        fail(f"completion_tokens per chunk should count up: {counts}", stream)
    _, full = session.full("completions", base)
    if counts[-1] != (full.get("usage") or {}).get("completion_tokens"):
        fail(f"the last chunk counts {counts[-1]} completion tokens, the non-stream answer "
             f"{(full.get('usage') or {}).get('completion_tokens')}", stream)


CHECKS = [
    Check(GROUP, "one finish per choice", "each choice has exactly one finish_reason, in its last chunk",
          _every_stream(None, finish_problem)),
    Check(GROUP, "one usage chunk", "with include_usage, one chunk carries usage: the last, after every finish, "
          "with choices []", _every_stream(True, usage_chunk_problem)),
    Check(GROUP, "usage totals", "the usage chunk's totals are the non-stream answer's", _totals),
    Check(GROUP, "no usage unasked", "without include_usage no chunk carries usage", _every_stream(False, _unasked)),
    Check(GROUP, "continuous usage", "with vLLM's continuous_usage_stats every chunk carries usage, counting up",
          _continuous),
]
