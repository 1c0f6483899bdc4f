"""Stop strings: the answer ends right before the first one, and a stream never shows a byte of it
(nor of its beginning, while the server was still unsure), with logprobs covering exactly the text."""

from __future__ import annotations

from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.compare import coverage_problem, out_of_step, spells_answer
from tailrace.check.equivalence import assert_stream_equals_full
from tailrace.check.probe import Probe, logprobs_fields
from tailrace.check.results import fail, ignore
from tailrace.check.session import Check, Session
from tailrace.check.wire import read_full, read_stream

GROUP = "stop"
NEVER_STOP = "<tailrace-check: no such text>"


def leaked(streamed: str, expected: str, stop: str) -> str | None:
    """What the stream shows beyond the expected text that belongs to the stop string."""
    if not streamed.startswith(expected) or streamed == expected:
        return None
    extra = streamed[len(expected):]
    return extra if stop.startswith(extra[:len(stop)]) else None


def _cut(session: Session, endpoint: str, body: dict[str, Any], expected: str) -> Exchange:
    """The non-stream answer is `expected` with finish_reason stop, and the stream is the same."""
    exchange, full = session.full(endpoint, body)
    choice = read_full(endpoint, full)[0]
    if choice.text != expected or choice.finish_reason != "stop":
        fail(f"the answer should end right before the stop string {body['stop']!r} with finish_reason stop; it is "
             f"{choice.text[-60:]!r} ({choice.finish_reason})", exchange)
    stream = session.stream(endpoint, body)
    streamed = read_stream(endpoint, stream.chunks()).get(0)
    text = streamed.text if streamed else ""
    stops = body["stop"] if isinstance(body["stop"], list) else [body["stop"]]
    for stop in stops:
        extra = leaked(text, expected, stop)
        if extra is not None and not body.get("include_stop_str_in_output"):
            fail(f"the stream shows {extra!r} of the stop string {stop!r} after the text", stream)
    assert_stream_equals_full(session, endpoint, body)
    return stream


def _stop_body(probe: Probe, stop: Any, **fields: Any) -> dict[str, Any]:
    return {**probe.base, "stop": stop, **fields}


def _across_tokens(endpoint: str):
    def run(session: Session) -> None:
        probe = session.probe(endpoint)
        _cut(session, endpoint, _stop_body(probe, probe.stop), probe.text[:probe.stop_at])
    return run


def later_stop(text: str, after: int) -> str:
    """A piece of `text` first found past `after`, or one never found: a second stop string that
    must lose to the first, listed ahead of it so a server that reads only stop[0] shows."""
    for start in range(after, len(text) - 3):
        piece = text[start:start + 3]
        if piece.strip() == piece and text.find(piece) == start:
            return piece
    return NEVER_STOP


def _multiple(endpoint: str):
    def run(session: Session) -> None:
        probe = session.probe(endpoint)
        stops = [later_stop(probe.text, probe.stop_at + len(probe.stop)), probe.stop]
        _cut(session, endpoint, _stop_body(probe, stops), probe.text[:probe.stop_at])
    return run


def _with_logprobs(endpoint: str):
    def run(session: Session) -> None:
        probe = session.probe(endpoint)
        body = _stop_body(probe, probe.stop, **logprobs_fields(endpoint, 1))
        stream = _cut(session, endpoint, body, probe.text[:probe.stop_at])
        streamed = read_stream(endpoint, stream.chunks())[0]
        if streamed.tokens is None:
            ignore("the server sends no logprobs", stream)
        _, unstopped = session.full(endpoint, {**probe.base, **logprobs_fields(endpoint, 1)})
        free = read_full(endpoint, unstopped)[0]
        if not spells_answer(free.tokens or [], free.text):
            ignore("the server's token strings do not spell its text, so the text they cover is unknown", stream)
        _, full = session.full(endpoint, body)
        for name, choice in (("non-stream", read_full(endpoint, full)[0]), ("stream", streamed)):
            reason = coverage_problem(choice.tokens or [], choice.text, probe.stop)
            if reason is not None:
                fail(f"{name}: {reason}", stream)
        reason = out_of_step(streamed.pieces, probe.stop)
        if reason is not None:
            fail(reason, stream)
    return run


def _include_stop(endpoint: str):
    def run(session: Session) -> None:
        probe = session.probe(endpoint)
        body = _stop_body(probe, probe.stop, include_stop_str_in_output=True)
        exchange = session.post(endpoint, {**body, "stream": False})
        if exchange.status != 200:
            ignore(f"include_stop_str_in_output (vLLM's extension) is refused: {exchange.status}", exchange)
        choice = read_full(endpoint, exchange.json() or {}).get(0)
        if choice is None or not choice.text.endswith(probe.stop):
            ignore("include_stop_str_in_output (vLLM's extension) is accepted but not honoured", exchange)
        _cut(session, endpoint, body, probe.text[:probe.stop_at + len(probe.stop)])
    return run


CHECKS = [
    check
    for endpoint in ("completions", "chat")
    for check in (
        Check(GROUP, f"{endpoint} stop across tokens", "the answer ends right before a stop string that spans "
              "tokens; the stream shows no byte of it, nor of its start", _across_tokens(endpoint)),
        Check(GROUP, f"{endpoint} multiple stops", "with several stop strings the answer ends at the first one "
              "found, streamed or not", _multiple(endpoint)),
        Check(GROUP, f"{endpoint} stop with logprobs", "with a stop string, the logprobs cover exactly the text "
              "sent, in every chunk", _with_logprobs(endpoint)),
        Check(GROUP, f"{endpoint} include_stop_str_in_output", "vLLM's include_stop_str_in_output keeps the "
              "stop string, streamed or not", _include_stop(endpoint)),
    )
]
