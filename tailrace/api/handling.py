"""What every route does with a request: parse and check its body, refuse it while the model
loads or the server drains, and answer with JSON or an event stream, cancelling the work if the
client goes away first. The routes of every API (app.py, routes_extra.py) share it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from tailrace.api.sse import aclose, sse_stream
from tailrace.engine.client import EngineClient
from tailrace.serving.errors import (engine_unavailable, from_validation_errors, invalid_json, invalid_request,
                                     model_not_found)
from tailrace.serving.protocol import unknown_fields

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def check_model(names: tuple[str, ...], model: str | None) -> None:
    if model is not None and model not in names:
        raise model_not_found(model)


def check_loaded(engine: EngineClient) -> None:
    """What describes the model (its context length, what runs it) is known once it has loaded."""
    if not engine.is_ready:
        raise engine_unavailable("The model is still loading or has stopped. Please retry shortly.")


def check_ready(request: Request, engine: EngineClient) -> None:
    # The server accepts connections while the model loads; until then the engine knows no
    # context length, so generation requests wait for /health to turn 200. While it drains, the
    # SDKs retry the 503, and a load balancer sends the retry to another server.
    if request.app.state.draining:
        raise engine_unavailable("The server is shutting down. Please retry.")
    if not engine.is_ready:
        raise engine_unavailable("The model is still loading or has stopped. Please retry shortly.")


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise invalid_json() from None
    if not isinstance(data, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_type")
    try:
        parsed = model.model_validate(data)
    except ValidationError as err:
        raise from_validation_errors(err.errors(include_url=False)) from None
    ignored = unknown_fields(model, data)
    if ignored:  # accepted, as vLLM does, but never silently
        logger.warning("request %s: ignored fields this server does not know: %s", request.state.request_id,
                       ", ".join(ignored))
    return parsed


async def respond(request: Request, result: Awaitable[dict | AsyncIterator[dict]],
                   framing: Callable[[AsyncIterator[dict]], AsyncIterator[bytes]] = sse_stream) -> Response:
    outcome = await _unless_disconnected(request, result)
    if outcome is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    if isinstance(outcome, dict):
        return json_response(outcome)
    return StreamingResponse(framing(await _first_chunk_now(outcome)), media_type="text/event-stream",
                             headers=_SSE_HEADERS)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client goes away
    first: a non-stream request writes nothing until the end, so nothing else would notice."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _first_chunk_now(chunks: AsyncIterator[dict]) -> AsyncIterator[dict]:
    """Pull the first chunk before the 200 goes out: an error raised that early is then a normal
    HTTP error, which every client reports properly, instead of an in-band stream event."""
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        return chunks
    return _prepend(first, chunks)


async def _prepend(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    try:
        yield first
        async for chunk in rest:
            yield chunk
    finally:
        await aclose(rest)


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json", headers=headers)
