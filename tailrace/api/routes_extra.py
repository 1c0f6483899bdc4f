"""The routes of the two other APIs clients speak: Anthropic Messages and OpenAI Responses. Their
framing lives in serving/ (anthropic_messages.py, responses.py); this only wires HTTP to it."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tailrace.api.sse import named_sse_stream
from tailrace.engine.client import EngineClient
from tailrace.serving.anthropic_messages import AnthropicError, count_tokens, create_message
from tailrace.serving.context import RequestContext
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol_anthropic import CountTokensRequest, MessagesRequest

_ANTHROPIC_PATHS = frozenset(f"{prefix}/messages{tail}" for prefix in ("/v1", "") for tail in ("", "/count_tokens"))


def is_anthropic_route(path: str) -> bool:
    """Routes that answer in Anthropic's shape and take its `x-api-key` header."""
    return path in _ANTHROPIC_PATHS


def error_for_route(path: str, err: OpenAIError) -> OpenAIError:
    """The error as the route's API writes it."""
    return AnthropicError.of(err) if is_anthropic_route(path) else err


def add_extra_routes(router: APIRouter, engine: EngineClient, names: tuple[str, ...],
                     context: Callable[[Request], RequestContext], sampling_defaults: dict[str, float]) -> None:
    """POST /v1/messages and /v1/messages/count_tokens (and the same without /v1)."""
    from tailrace.api import app as http  # the caller: loaded by the time it calls this

    async def messages(request: Request) -> Response:
        body = await http._parse(request, MessagesRequest)
        http._check_model(names, body.model)
        http._check_ready(request, engine)
        return await http._respond(request, create_message(engine, body, context(request), sampling_defaults),
                                   named_sse_stream)

    async def messages_count_tokens(request: Request) -> Response:
        body = await http._parse(request, CountTokensRequest)
        http._check_model(names, body.model)
        http._check_ready(request, engine)
        return http._json(count_tokens(engine, body, context(request)))

    # Left out of /openapi.json: its error shape is OpenAI's, and these routes answer in Anthropic's.
    for prefix in ("/v1", ""):
        router.add_api_route(f"{prefix}/messages", messages, methods=["POST"], include_in_schema=False)
        router.add_api_route(f"{prefix}/messages/count_tokens", messages_count_tokens, methods=["POST"],
                             include_in_schema=False)
