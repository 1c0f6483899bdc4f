"""SSE framing, read strictly from the bytes of every stream the run made: what a strict client
(the WHATWG event-stream parser, the openai SDK) needs to see each chunk and the end."""

from __future__ import annotations

import json
from collections.abc import Callable

from tailrace.check.client import Exchange
from tailrace.check.results import fail, skip
from tailrace.check.session import Check, Session

GROUP = "framing"
DONE_EVENT = b"data: [DONE]"
SHOWN = 80


def _lines(raw: bytes) -> bytes:
    """CRLF and CR are line endings too; the rules below speak of LF."""
    return raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n")


def events_of(raw: bytes) -> list[bytes]:
    """The blank-line separated events; a last one without its blank line is left in (as the spec's
    parser would drop it, the checks see it as unfinished)."""
    return [event for event in _lines(raw).split(b"\n\n") if event.strip(b"\n")]


def bad_line(raw: bytes) -> str | None:
    for line in _lines(raw).split(b"\n"):
        if line and not line.startswith((b"data: ", b":")):
            return f"a line that is not `data: ...`: {line[:SHOWN]!r}"
    return None


def bad_event(raw: bytes) -> str | None:
    for number, event in enumerate(events_of(raw)):
        data = [line for line in event.split(b"\n") if line.startswith(b"data:")]
        if len(data) > 1:
            return f"event {number} has {len(data)} data lines; one JSON object per event: {event[:SHOWN]!r}"
        payload = data[0][len(b"data: "):] if data else b""
        if data and payload != b"[DONE]":
            try:
                json.loads(payload)
            except ValueError:
                return f"event {number} is not JSON: {payload[:SHOWN]!r}"
    return None


def bad_end(raw: bytes) -> str | None:
    text = _lines(raw)
    if DONE_EVENT not in text:
        return "no `data: [DONE]`: a client cannot tell the end from a cut connection"
    after = text[text.rindex(DONE_EVENT) + len(DONE_EVENT):]
    if after != b"\n\n":
        if after.strip(b"\n"):
            return f"more follows `data: [DONE]`: {after[:SHOWN]!r}"
        return "`data: [DONE]` is not ended by a blank line, so a strict parser never dispatches it"
    if text.index(DONE_EVENT) != text.rindex(DONE_EVENT):
        return "`data: [DONE]` comes more than once"
    return None


def split_read(reads: list[bytes]) -> str | None:
    """Each read the transport handed over ends where an event ends: clients that parse per read
    (many browser and script clients do) break on an event cut in two."""
    received = b""
    for number, read in enumerate(reads):
        received += read
        if read and not _lines(received).endswith(b"\n\n"):
            return f"read {number} ends inside an event: ...{received[-SHOWN:]!r}"
    return None


def _every_stream(problem: Callable[[Exchange], str | None]):
    def run(session: Session) -> None:
        streams = session.every_stream()
        if not streams:
            skip("no stream could be made")
        for exchange in streams:
            reason = problem(exchange)
            if reason is not None:
                fail(reason, exchange)
    return run


def _content_type(exchange: Exchange) -> str | None:
    if not exchange.content_type.startswith("text/event-stream"):
        return f"Content-Type is {exchange.content_type!r}"
    return None


CHECKS = [
    Check(GROUP, "content type", "a stream is served as text/event-stream", _every_stream(_content_type)),
    Check(GROUP, "data lines", "every line is `data: ...` (or a `:` comment); no `event:` or `id:`",
          _every_stream(lambda exchange: bad_line(exchange.raw))),
    Check(GROUP, "one JSON per event", "each blank-line separated event is one `data: ` line of one JSON object",
          _every_stream(lambda exchange: bad_event(exchange.raw))),
    Check(GROUP, "[DONE] last", "`data: [DONE]` ends the stream once, with its blank line, and nothing follows it",
          _every_stream(lambda exchange: bad_end(exchange.raw))),
    Check(GROUP, "whole events per read", "no event is split across the reads a client gets",
          _every_stream(lambda exchange: split_read(exchange.reads))),
]
