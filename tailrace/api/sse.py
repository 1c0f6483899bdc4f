"""Server-sent-event framing for OpenAI streams: `data: <one-line JSON>` events, then `data: [DONE]`.

No `event:` or `id:` lines: old SDKs mis-wrap named events, and a remembered `id` makes later
blank lines dispatch empty events that fail JSON decoding.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson

from tailrace.serving.errors import OpenAIError, internal

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"


def encode_event(obj: Any) -> bytes:
    # orjson output is always one compact line (it escapes newlines inside strings).
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(err: OpenAIError) -> bytes:
    return encode_event(err.body())


async def sse_stream(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """Frame every chunk, then DONE. An exception after the 200 went out can only be reported
    in-band: one `{"error": ...}` event (the SDK raises APIError on it), then DONE."""
    try:
        try:
            async for chunk in chunks:
                yield encode_event(chunk)
        except OpenAIError as err:
            yield error_event(err)
        except Exception:
            logger.exception("stream failed mid-response")
            yield error_event(internal())
        yield DONE
    finally:
        # A client that goes away closes this generator at a `yield`; closing the source too is
        # what aborts the request in the engine instead of leaving it to the garbage collector.
        await aclose(chunks)


async def aclose(iterator: AsyncIterator[Any]) -> None:
    """Close an async generator (a plain async iterator has nothing to close)."""
    close = getattr(iterator, "aclose", None)
    if close is not None:
        await close()


async def named_sse_stream(events: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    """The framing of Anthropic's and OpenAI Responses' streams: `event: <type>` then its data,
    and no DONE. The serving layer frames its own errors as events, so none arrive here."""
    try:
        async for event in events:
            yield b"event: " + event["type"].encode() + b"\n" + encode_event(event)
    finally:
        await aclose(events)
