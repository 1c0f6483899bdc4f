"""The server's OpenAPI document (GET /openapi.json): the real request schemas, so that schema-driven
fuzzers (schemathesis) and client generators see what each route takes.

The routes parse their bodies by hand (errors in OpenAI's shape, nulls as absent), so FastAPI alone
would document no bodies; each route declares its body through `openapi_extra` instead, and the
pydantic schemas are added to the components here.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

import tailrace
from tailrace.serving.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

_REF = "#/components/schemas/{model}"
_BODIES: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, TokenizeRequest, DetokenizeRequest)
_PUBLIC_PATHS = frozenset({"/health", "/ping", "/version"})  # answered without the key
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is `model`."""
    schema = {"$ref": _REF.format(model=model.__name__)}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def openapi_document(app: FastAPI, served_model_name: str, auth: bool, public_metrics: bool) -> dict[str, Any]:
    """The document for `app`: FastAPI's paths, the body schemas, the error shape on every operation,
    `model` restricted to the served name (any other is a 404), and bearer auth where it applies."""
    spec = get_openapi(title="tailrace", version=tailrace.__version__, routes=app.routes)
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for model in _BODIES:
        schema = model.model_json_schema(ref_template=_REF)
        components.update(schema.pop("$defs", {}))
        components[model.__name__] = schema
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        components[name]["properties"]["model"] = {"type": "string", "enum": [served_model_name]}
    components["ErrorResponse"] = _ERROR
    if auth:
        spec["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        spec["security"] = [{"bearer": []}]
    public = _PUBLIC_PATHS | ({"/metrics"} if public_metrics else set())
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape: this server never sends it
        components.pop(name, None)
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            operation["responses"]["default"] = {
                "description": "An error in OpenAI's shape",
                "content": {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}}
            if auth and path in public:
                operation["security"] = []
    return spec
