"""The routes of the two other APIs clients speak: Anthropic Messages and OpenAI Responses. Their
framing lives in serving/ (anthropic_messages.py, responses.py); this only wires HTTP to it."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response

from tailrace.api.handling import check_model, check_ready, json_response, parse_body, respond
from tailrace.api.sse import named_sse_stream
from tailrace.engine.client import EngineClient
from tailrace.serving.anthropic_messages import AnthropicError, count_tokens, create_message
from tailrace.serving.context import RequestContext
from tailrace.serving.embeddings import OllamaError
from tailrace.serving.errors import OpenAIError
from tailrace.serving.protocol_anthropic import CountTokensRequest, MessagesRequest
from tailrace.serving.protocol_responses import ResponsesRequest
from tailrace.serving.responses import create_response
from tailrace.serving.responses_store import ResponseStore, StoreLimits

_ANTHROPIC_PATHS = frozenset(f"{prefix}/messages{tail}" for prefix in ("/v1", "") for tail in ("", "/count_tokens"))


def is_anthropic_route(path: str) -> bool:
    """Routes that answer in Anthropic's shape and take its `x-api-key` header."""
    return path in _ANTHROPIC_PATHS


def error_for_route(path: str, err: OpenAIError) -> OpenAIError:
    """The error as the route's API writes it."""
    if path == "/api/embed":
        return OllamaError.of(err)
    return AnthropicError.of(err) if is_anthropic_route(path) else err


def add_extra_routes(router: APIRouter, engine: EngineClient, names: tuple[str, ...],
                     context: Callable[[Request], RequestContext], sampling_defaults: dict[str, float],
                     store_limits: StoreLimits | None = None) -> None:
    """POST /v1/messages and /v1/messages/count_tokens; POST /v1/responses, GET and DELETE
    /v1/responses/{id}, POST /v1/responses/{id}/cancel (each also without /v1). Left out of
    /openapi.json, whose body schemas are the chat and completions ones."""
    _add_messages_routes(router, engine, names, context, sampling_defaults)
    _add_responses_routes(router, engine, names, context, sampling_defaults, ResponseStore(store_limits))


def _add_messages_routes(router: APIRouter, engine: EngineClient, names: tuple[str, ...],
                         context: Callable[[Request], RequestContext], sampling_defaults: dict[str, float]) -> None:
    async def messages(request: Request) -> Response:
        body = await parse_body(request, MessagesRequest)
        check_model(names, body.model)
        check_ready(request, engine)
        return await respond(request, create_message(engine, body, context(request), sampling_defaults),
                                   named_sse_stream)

    async def messages_count_tokens(request: Request) -> Response:
        body = await parse_body(request, CountTokensRequest)
        check_model(names, body.model)
        check_ready(request, engine)
        return json_response(count_tokens(engine, body, context(request)))

    for prefix in ("/v1", ""):
        router.add_api_route(f"{prefix}/messages", messages, methods=["POST"], include_in_schema=False)
        router.add_api_route(f"{prefix}/messages/count_tokens", messages_count_tokens, methods=["POST"],
                             include_in_schema=False)


def _add_responses_routes(router: APIRouter, engine: EngineClient, names: tuple[str, ...],
                          context: Callable[[Request], RequestContext], sampling_defaults: dict[str, float],
                          store: ResponseStore) -> None:
    async def responses(request: Request) -> Response:
        body = await parse_body(request, ResponsesRequest)
        check_model(names, body.model)
        check_ready(request, engine)
        return await respond(request, create_response(engine, body, context(request), store,
                                                            sampling_defaults), named_sse_stream)

    async def get_response(response_id: str) -> Response:
        return json_response(store.get(response_id).response)

    async def delete_response(response_id: str) -> Response:
        store.delete(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    async def cancel_response(response_id: str) -> Response:
        return json_response(store.cancel(response_id))

    for prefix in ("/v1", ""):
        router.add_api_route(f"{prefix}/responses", responses, methods=["POST"], include_in_schema=False)
        router.add_api_route(f"{prefix}/responses/{{response_id}}", get_response, methods=["GET"],
                             include_in_schema=False)
        router.add_api_route(f"{prefix}/responses/{{response_id}}", delete_response, methods=["DELETE"],
                             include_in_schema=False)
        router.add_api_route(f"{prefix}/responses/{{response_id}}/cancel", cancel_response, methods=["POST"],
                             include_in_schema=False)
