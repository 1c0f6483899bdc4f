"""Errors in OpenAI's shape and status: `{"error": {"message", "type", "param", "code"}}` with 400
for a bad parameter, 404 for an unknown model, 401 without the key; in a stream, well-formed events."""

from __future__ import annotations

import json
from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.results import fail, ignore, skip
from tailrace.check.session import Check, Session

GROUP = "errors"
UNKNOWN_MODEL = "tailrace-check-no-such-model"


def error_shape_problem(body: Any) -> str | None:
    """None when `body` is `{"error": {message: str, type: str, param: str|null, code: str|null}}`."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return f"the body is not {{\"error\": {{...}}}}: {json.dumps(body)[:200] if body is not None else 'not JSON'}"
    for name, kinds in (("message", (str,)), ("type", (str,)), ("param", (str, type(None))),
                        ("code", (str, type(None)))):
        if name not in error:
            return f"error.{name} is missing: {error}"
        if not isinstance(error[name], kinds):
            return f"error.{name} is {error[name]!r}, not a string{' or null' if len(kinds) > 1 else ''}"
    return None


def expect_error(exchange: Exchange, status: int) -> None:
    if exchange.transport_error:
        fail(f"no answer: {exchange.transport_error}", exchange)
    if exchange.status != status:
        fail(f"answered {exchange.status}, not {status}: {exchange.raw[:200].decode(errors='replace')}", exchange)
    reason = error_shape_problem(exchange.json())
    if reason is not None:
        fail(reason, exchange)


def _chat(session: Session, **fields: Any) -> dict[str, Any]:
    return {"model": session.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def _invalid_value(session: Session) -> None:
    expect_error(session.post("chat", _chat(session, temperature=-1)), 400)


def _missing_field(session: Session) -> None:
    expect_error(session.post("chat", {"model": session.model, "max_tokens": 4}), 400)


def _unknown_model(session: Session) -> None:
    expect_error(session.post("chat", _chat(session, model=UNKNOWN_MODEL)), 404)


def _no_key(session: Session) -> None:
    if not session.client.api_key:
        skip("no --api-key given, so there is no key to leave out")
    exchange = session.post("chat", _chat(session), with_key=False)
    if exchange.status == 200:
        ignore("the server answers without a key: it does not require one", exchange)
    expect_error(exchange, 401)


def _in_stream(session: Session) -> None:
    """A bad streamed request fails before the stream (status and shape) or in-band, well-formed."""
    exchange = session.post("chat", _chat(session, temperature=-1, stream=True))
    if exchange.status != 200:
        expect_error(exchange, 400)
        return
    errors = [chunk for chunk in exchange.chunks() if "error" in chunk]
    if not errors:
        fail("a stream with temperature -1 answered 200 with no error event", exchange)
    reason = error_shape_problem(errors[0])
    if reason is not None:
        fail(f"the in-band error event: {reason}", exchange)


def _in_band_events(session: Session) -> None:
    """Every error event in the streams the run made is well-formed."""
    for _, exchange in session.streams():
        for chunk in exchange.chunks():
            reason = error_shape_problem(chunk) if "error" in chunk else None
            if reason is not None:
                fail(f"an in-band error event: {reason}", exchange)


CHECKS = [
    Check(GROUP, "invalid value", "a parameter out of range (temperature -1) gets 400 in OpenAI's error shape",
          _invalid_value),
    Check(GROUP, "missing field", "a request without `messages` gets 400 in OpenAI's error shape", _missing_field),
    Check(GROUP, "unknown model", "an unknown model gets 404 in OpenAI's error shape", _unknown_model),
    Check(GROUP, "no key", "with a key set, a request without it gets 401 in OpenAI's error shape", _no_key),
    Check(GROUP, "streamed error", "a bad streamed request gets its error before the stream, or as a well-formed "
          "in-band event", _in_stream),
    Check(GROUP, "in-band error events", "any `{\"error\": ...}` event in a stream has message, type, param and "
          "code", _in_band_events),
]
