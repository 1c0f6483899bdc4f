"""Security defaults of a real server: the key on every route but /health, /ping and /version, loopback
by default, no CORS unless configured, no request field reaching the filesystem, no stack traces in answers."""

from __future__ import annotations

import httpx
import pytest

from harness import MODEL, ServerProcess
from tailrace.cli import build_parser

from .conftest import assert_openai_error

BAD_AUTH = [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Bearer"}, {"Authorization": "Basic abc"},
            {"Authorization": "reliability-key"}, {"Authorization": "Bearer reliability-key-and-more"}]


PUBLIC_PATHS = {"/health", "/ping", "/version"}  # for load balancers and supervisors, as in vLLM


def documented_routes(http: httpx.Client) -> list[tuple[str, str]]:
    spec = http.get("/openapi.json").json()
    routes = [(method.upper(), path.replace("{model}", MODEL)) for path, ops in spec["paths"].items() for method in ops]
    return [*routes, ("GET", "/openapi.json"), ("GET", "/models"), ("POST", "/completions"),
            ("POST", "/chat/completions")]


def test_every_route_but_the_public_ones_needs_the_key(server: ServerProcess, http: httpx.Client):
    routes = documented_routes(http)
    assert len(routes) >= 12
    for method, path in routes:
        for headers in BAD_AUTH:
            response = httpx.request(method, server.url + path, headers=headers, json={})
            if path in PUBLIC_PATHS:
                assert response.status_code == 200
            else:
                missing = headers.get("Authorization") in (None, "Bearer")
                code = assert_openai_error(response, 401)["code"]
                assert code == (None if missing else "invalid_api_key"), (method, path, headers)


def test_the_key_is_accepted_on_every_route(server: ServerProcess, http: httpx.Client):
    for method, path in documented_routes(http):
        assert http.request(method, path, json={}).status_code != 401, (method, path)


def test_server_binds_loopback_by_default():
    assert build_parser().parse_args(["serve"]).host == "127.0.0.1"


def test_cors_is_off_unless_configured(server: ServerProcess):
    preflight = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers
    simple = httpx.get(server.url + "/health", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in simple.headers


@pytest.mark.parametrize("model", ["/etc/passwd", "../../../../etc/passwd", "file:///etc/passwd", "tiny/../.."])
def test_a_model_name_is_never_a_path(http: httpx.Client, model: str):
    for response in (http.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 1}),
                     http.get(f"/v1/models/{model}")):
        assert response.status_code == 404
        assert "root:" not in response.text


def test_error_answers_carry_no_stack_trace(http: httpx.Client):
    answers = [http.post("/v1/completions", content=b"{"), http.post("/v1/completions", json={"prompt": 5}),
               http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}),
               http.get("/nowhere"), http.delete("/v1/completions")]
    for response in answers:
        assert 400 <= response.status_code < 500
        assert "Traceback" not in response.text and 'File "' not in response.text and "tailrace/" not in response.text
