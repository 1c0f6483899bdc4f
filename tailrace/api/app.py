"""The HTTP face: routes, auth, request ids, body limits, and every error in OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import tailrace
from tailrace.api.handling import check_loaded, check_model, check_ready, json_response, parse_body, respond
from tailrace.api.openapi import json_body, openapi_document
from tailrace.api.routes_extra import add_extra_routes, error_for_route, is_anthropic_route
from tailrace.api.stats_log import log_stats
from tailrace.engine.client import EngineClient, EngineDeadError
from tailrace.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from tailrace.metrics import ServerMetrics
from tailrace.serving.chat import create_chat_completion
from tailrace.serving.choices import check_token_ids
from tailrace.serving.completions import create_completion
from tailrace.serving.context import ChatOptions, RequestContext
from tailrace.serving.embeddings import EmbeddingRequest, OllamaEmbedRequest, create_embeddings, ollama_embed
from tailrace.serving.scores import RerankRequest, ScoreRequest, create_rerank, create_score
from tailrace.serving.limits import Admission, Limits
from tailrace.serving.pooling import Pooling
from tailrace.serving.responses_store import StoreLimits
from tailrace.serving.errors import (OpenAIError, engine_unavailable, from_validation_errors, internal,
                                     invalid_api_key, invalid_request, missing_api_key, payload_too_large)
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tailrace.serving.sampling_defaults import with_sampling_defaults

logger = logging.getLogger(__name__)

_MAX_CLIENT_REQUEST_ID = 256


@dataclass(slots=True)
class ServerConfig:
    served_model_name: str
    api_key: str | None = None  # None: no auth
    max_body_bytes: int = 4 * 1024 * 1024
    metrics_public: bool = False  # True: /metrics needs no key even when api_key is set
    cors_origins: list[str] = field(default_factory=list)  # empty: CORS off
    limits: Limits = field(default_factory=Limits)
    chat: ChatOptions = field(default_factory=ChatOptions)  # tool-call and reasoning parsers
    pooling: Pooling | None = None  # --task embed: how inputs become vectors; None: the model generates
    # More names clients may send (vLLM's `--served-model-name A B`); responses carry the first.
    other_model_names: list[str] = field(default_factory=list)
    sampling_defaults: dict[str, float] = field(default_factory=dict)  # the model's generation_config.json
    log_stats: bool = True  # the periodic stats line (--disable-log-stats turns it off)
    responses_store: StoreLimits = field(default_factory=StoreLimits)  # caps of stored Responses API responses


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    metrics = ServerMetrics(config.served_model_name)
    app = FastAPI(title="tailrace", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=_stats_logging(engine, metrics) if config.log_stats else None)
    app.state.draining = False
    require_key = [Depends(_bearer_check(config.api_key))] if config.api_key else []
    app.include_router(_openai_routes(engine, config, metrics), dependencies=require_key)
    app.include_router(_openapi_route(app, config), dependencies=require_key)
    app.include_router(_status_routes(engine))
    app.include_router(_metrics_route(engine, metrics), dependencies=[] if config.metrics_public else require_key)
    _add_error_handlers(app)
    # Pure ASGI middlewares (no BaseHTTPMiddleware: it buffers and breaks streaming). Last added runs first.
    app.add_middleware(_BodyLimitMiddleware, max_bytes=config.max_body_bytes)
    if config.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=config.cors_origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(_RequestIdMiddleware)
    return app


def start_draining(app: FastAPI) -> None:
    """From now on /health, /ping and new generation requests answer 503, so that load balancers
    take this server out of rotation while the running requests finish."""
    app.state.draining = True


def _stats_logging(engine: EngineClient, metrics: ServerMetrics) -> Callable[[FastAPI], Any]:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(log_stats(metrics, engine.stats))
        try:
            yield
        finally:
            task.cancel()

    return lifespan


# ---- routes ---------------------------------------------------------------------------------------

def _openai_routes(engine: EngineClient, config: ServerConfig, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()
    served = config.served_model_name
    names = (served, *config.other_model_names)
    admission = Admission(config.limits)

    def context(request: Request) -> RequestContext:
        return RequestContext(request_id=request.state.request_id, model_name=served, metrics=metrics,
                              limits=config.limits, admission=admission, chat=config.chat)

    async def completions(request: Request) -> Response:
        body = with_sampling_defaults(await parse_body(request, CompletionRequest), config.sampling_defaults)
        check_model(names, body.model)
        check_ready(request, engine)
        return await respond(request, create_completion(engine, body, context(request)))

    async def chat_completions(request: Request) -> Response:
        body = with_sampling_defaults(await parse_body(request, ChatCompletionRequest), config.sampling_defaults)
        check_model(names, body.model)
        check_ready(request, engine)
        return await respond(request, create_chat_completion(engine, body, context(request)))

    def pooling_route(schema: type[BaseModel], create: Callable[..., Awaitable[dict[str, Any]]]) -> Callable:
        async def route(request: Request) -> Response:
            body = await parse_body(request, schema)
            check_model(names, body.model)
            if config.pooling is None:
                raise invalid_request(f"The model {served} generates text and serves no embeddings: serve an "
                                      "embedding model, or this one with --task embed.", param="model")
            check_ready(request, engine)
            return await respond(request, create(engine, body, context(request), config.pooling))
        return route

    pooling_routes = {"/embeddings": pooling_route(EmbeddingRequest, create_embeddings),
                      "/score": pooling_route(ScoreRequest, create_score),
                      "/rerank": pooling_route(RerankRequest, create_rerank)}
    router.add_api_route("/api/embed", pooling_route(OllamaEmbedRequest, ollama_embed), methods=["POST"],
                         include_in_schema=False)

    async def not_generating(request: Request) -> Response:
        raise invalid_request(f"The model {served} is served for embeddings (--task embed) and generates no text: "
                              "use /v1/embeddings.", param="model")

    generating = config.pooling is None
    for prefix in ("/v1", ""):  # clients set base_url with or without /v1; the spec shows /v1
        documented = prefix == "/v1"
        router.add_api_route(f"{prefix}/completions", completions if generating else not_generating, methods=["POST"],
                             include_in_schema=documented and generating, openapi_extra=json_body(CompletionRequest))
        router.add_api_route(f"{prefix}/chat/completions", chat_completions if generating else not_generating,
                             methods=["POST"], include_in_schema=documented and generating,
                             openapi_extra=json_body(ChatCompletionRequest))
        for path, route in pooling_routes.items():
            router.add_api_route(prefix + path, route, methods=["POST"], include_in_schema=False)
        if not generating:
            for path in ("/messages", "/messages/count_tokens", "/responses"):
                router.add_api_route(prefix + path, not_generating, methods=["POST"], include_in_schema=False)
    # Cohere's v2 client posts here
    router.add_api_route("/v2/rerank", pooling_routes["/rerank"], methods=["POST"], include_in_schema=False)
    _add_model_routes(router, engine, names)
    if generating:
        add_extra_routes(router, engine, names, context, config.sampling_defaults, config.responses_store)
    return router


def _add_model_routes(router: APIRouter, engine: EngineClient, names: tuple[str, ...]) -> None:
    """/v1/models (what is served, its context and what runs it), /tokenize and /detokenize."""
    created = int(time.time())

    def model_card(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "tailrace",
                "root": engine.model_path, "parent": None, "max_model_len": engine.max_model_len,
                "backends": engine.backends}

    async def list_models() -> Response:
        check_loaded(engine)
        return json_response({"object": "list", "data": [model_card(name) for name in names]})

    async def get_model(model: str) -> Response:
        check_loaded(engine)
        check_model(names, model)
        return json_response(model_card(model))

    async def tokenize(request: Request) -> Response:
        body = await parse_body(request, TokenizeRequest)
        check_model(names, body.model)
        check_loaded(engine)
        tokens = _tokenize(engine, body)
        return json_response({"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len})

    async def detokenize(request: Request) -> Response:
        body = await parse_body(request, DetokenizeRequest)
        check_model(names, body.model)
        check_token_ids(body.tokens, engine.tokenizer.vocab_size, "tokens")
        return json_response({"prompt": engine.tokenizer.decode(body.tokens)})

    for prefix in ("/v1", ""):  # clients set base_url with or without /v1; the spec shows /v1
        documented = prefix == "/v1"
        router.add_api_route(f"{prefix}/models", list_models, methods=["GET"], include_in_schema=documented)
        router.add_api_route(f"{prefix}/models/{{model:path}}", get_model, methods=["GET"],
                             include_in_schema=documented)
    router.add_api_route("/tokenize", tokenize, methods=["POST"], openapi_extra=json_body(TokenizeRequest))
    router.add_api_route("/detokenize", detokenize, methods=["POST"], openapi_extra=json_body(DetokenizeRequest))


def _openapi_route(app: FastAPI, config: ServerConfig) -> APIRouter:
    """GET /openapi.json, behind the key like every route but /health: the document is built once."""
    router = APIRouter()
    document: dict[str, Any] = {}

    async def openapi() -> Response:
        if not document:
            document.update(openapi_document(app, config.served_model_name, auth=config.api_key is not None,
                                             public_metrics=config.metrics_public))
        return json_response(document)

    router.add_api_route("/openapi.json", openapi, methods=["GET"], include_in_schema=False)
    return router


def _status_routes(engine: EngineClient) -> APIRouter:
    """/health, /ping (SageMaker's name, GET or POST) and /version answer anyone, as vLLM's do: load
    balancers and supervisors hold no key."""
    router = APIRouter()
    version = tailrace.__version__  # not the installed metadata: a checkout on PYTHONPATH serves too

    async def health(request: Request) -> Response:
        if request.app.state.draining:
            raise engine_unavailable("The server is shutting down.")
        if not engine.is_ready:
            raise engine_unavailable()
        return json_response({})

    async def get_version() -> Response:
        return json_response({"version": version})

    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/ping", health, methods=["GET", "POST"])
    router.add_api_route("/version", get_version, methods=["GET"])
    return router


def _metrics_route(engine: EngineClient, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    async def scrape() -> Response:
        return Response(metrics.render(engine.stats(), engine.backends), media_type=METRICS_CONTENT_TYPE)

    router.add_api_route("/metrics", scrape, methods=["GET"])
    return router


def _tokenize(engine: EngineClient, body: TokenizeRequest) -> list[int]:
    tokenizer = engine.tokenizer
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        return tokenizer.encode(body.prompt, add_special_tokens=add_special)
    try:
        text = tokenizer.apply_chat_template([m.template_dict() for m in body.messages or []],
                                             add_generation_prompt=body.add_generation_prompt,
                                             continue_final_message=body.continue_final_message)
    except ValueError as err:
        raise invalid_request(str(err), param="messages") from err
    return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))


def _bearer_check(api_key: str) -> Callable[[Request], Awaitable[None]]:
    expected = api_key.encode()

    async def require_key(request: Request) -> None:
        sent = request.headers.get("authorization", "").strip()
        if not sent and is_anthropic_route(request.url.path):  # the Anthropic SDK sends its key as x-api-key
            sent = f"Bearer {request.headers.get('x-api-key', '')}".strip()
        scheme, _, token = sent.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else sent
        if not token or token.lower() == "bearer":
            raise missing_api_key()
        # compare_digest: the time taken must not reveal how much of the key matched.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), expected):
            raise invalid_api_key(token)

    return require_key


# ---- errors -----------------------------------------------------------------------------------------

def _error_response(err: OpenAIError) -> Response:
    """The OpenAI error body; a 4xx that retrying cannot fix says so, or the SDK retries it twice."""
    headers = {} if err.retryable else {"x-should-retry": "false"}
    return json_response(err.body(), status=err.status, headers={**headers, **err.headers})


def _add_error_handlers(app: FastAPI) -> None:
    async def on_openai_error(request: Request, err: OpenAIError) -> Response:
        return _error_response(error_for_route(request.url.path, err))

    async def on_validation_error(request: Request, err: RequestValidationError) -> Response:
        # Drop the "body"/"query"/"path" prefix: locations are then relative to the request body.
        errors = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in err.errors()]
        return _error_response(from_validation_errors(errors))

    async def on_http_error(request: Request, err: StarletteHTTPException) -> Response:
        where = f"{request.method} {request.url.path}"
        if err.status_code == 404:
            error = OpenAIError(404, f"Invalid URL ({where}).", code="unknown_url")
        elif err.status_code == 405:
            error = OpenAIError(405, f"Method not allowed ({where}).", code="method_not_allowed")
        else:
            error = OpenAIError(err.status_code, str(err.detail), code=None)
        response = _error_response(error)
        response.headers.update(err.headers or {})
        return response

    async def on_engine_dead(request: Request, err: EngineDeadError) -> Response:
        logger.error("engine core is dead: %s", err)
        return _error_response(engine_unavailable("The engine stopped. Please retry shortly."))

    app.add_exception_handler(OpenAIError, on_openai_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(EngineDeadError, on_engine_dead)


# ---- middleware ----------------------------------------------------------------------------------

class _RequestIdMiddleware:
    """Gives every request a unique id (request.state.request_id), answers with `x-request-id`
    (the client's own when it sent one), and turns any unhandled exception into a plain 500 that
    still carries the id. Tracebacks go to the log, never to the client."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = f"req-{uuid.uuid4().hex}"
        scope.setdefault("state", {})["request_id"] = request_id
        header = (_client_request_id(scope) or request_id).encode()
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (b"x-request-id", header)]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:
            logger.exception("unhandled error in request %s", request_id)
            if started:
                raise
            await _error_response(internal())(scope, receive, send_with_id)


def _client_request_id(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if 0 < len(text) <= _MAX_CLIENT_REQUEST_ID and text.isprintable() and text.isascii():
                return text
    return None


class _BodyLimitMiddleware:
    """413 for a body over the limit: at once when Content-Length says so, and while reading when
    the body (chunked, or lying about its length) grows past it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await _error_response(payload_too_large(self.max_bytes))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the route's body read, so the OpenAIError handler answers it.
                    raise payload_too_large(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
