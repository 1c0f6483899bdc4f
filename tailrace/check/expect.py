"""What a request has to answer before a check can look at it: anything else ends the check."""

from __future__ import annotations

from typing import Any

from tailrace.check.client import Exchange
from tailrace.check.results import fail, skip
from tailrace.check.wire import PATHS


def ok_status(exchange: Exchange) -> None:
    if exchange.transport_error:
        fail(f"the request failed: {exchange.transport_error}", exchange)
    if exchange.status != 200:
        fail(f"answered {exchange.status}: {exchange.raw[:300].decode(errors='replace')}", exchange)


def ok_json(exchange: Exchange) -> dict[str, Any]:
    ok_status(exchange)
    body = exchange.json()
    if not isinstance(body, dict):
        fail(f"the answer is not a JSON object: {exchange.raw[:300]!r}", exchange)
    return body


def require_endpoint(exchange: Exchange, endpoint: str) -> None:
    """A server that serves only chat (or only completions) gets its other endpoint's checks skipped."""
    body = exchange.json()
    model_error = isinstance(body, dict) and isinstance(body.get("error"), dict)  # 404 for the model, not the route
    if exchange.status in (404, 405) and not model_error:
        skip(f"the server does not serve {PATHS[endpoint]} ({exchange.status})")
