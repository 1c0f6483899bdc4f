"""The HTTP face through FastAPI's TestClient, over a scripted fake engine."""

import asyncio
import logging
import re

import orjson
import pytest
from fastapi.testclient import TestClient

from tailrace.api.app import ServerConfig, build_app, start_draining
from tailrace.engine.client import EngineDeadError
from tailrace.engine.config import EMBEDDED_MODEL
from tailrace.engine.stats import EngineStats
from tailrace.outputs import CompletionOutput, RequestOutput
from tailrace.tokenizer import load_tokenizer

MODEL = "tiny"
KEY = "sk-test-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": MODEL, "prompt": "Hello"}


class FakeEngine:
    """Yields `script` as one delta per piece for every sibling; can fail before piece `fail_at`."""

    def __init__(self, tokenizer, script=("Hello", " world")):
        self.tokenizer = tokenizer
        self.max_model_len = 128
        self.model_path = "/models/fake"
        self.script = script
        self.ready = True
        self.errored = False
        self.fail_with: Exception | None = None
        self.fail_at = 0
        self.engine_stats = EngineStats()
        self.backends = {"device": "cpu", "fused_forward": "yes"}

    @property
    def is_ready(self) -> bool:
        return self.ready

    def stats(self) -> EngineStats:
        return self.engine_stats

    async def add_request(self, request_id, prompt_token_ids, params):
        for j in range(params.n):
            for k, piece in enumerate(self.script):
                if self.fail_with is not None and k == self.fail_at:
                    raise self.fail_with
                last = k == len(self.script) - 1
                delta = CompletionOutput(j, piece, self.tokenizer.encode(piece, add_special_tokens=False),
                                         finish_reason="stop" if last else None)
                yield RequestOutput(request_id, prompt_token_ids, [delta], finished=last and j == params.n - 1)

    async def abort(self, request_id):
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EMBEDDED_MODEL)


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer)


def client_for(engine, **config) -> TestClient:
    return TestClient(build_app(engine, ServerConfig(served_model_name=MODEL, **config)),
                      raise_server_exceptions=False)


@pytest.fixture
def client(engine):
    return client_for(engine)


def assert_openai_error(response, status, code=None, param=None):
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


def sse_events(response) -> list:
    frames = [f for f in response.text.split("\n\n") if f]
    assert all(f.startswith("data: ") and "\n" not in f for f in frames)
    return [f.removeprefix("data: ") for f in frames]


# ---- success paths ----

@pytest.mark.parametrize("path", ["/v1/completions", "/completions"])
def test_completion_non_stream_is_json(client, path):
    response = client.post(path, json=COMPLETION)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["choices"][0]["text"] == "Hello world"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/chat/completions"])
def test_chat_non_stream_is_json(client, path):
    response = client.post(path, json=CHAT)
    assert response.json()["choices"][0]["message"]["content"] == "Hello world"


def test_stream_is_event_stream_with_no_buffering_headers(client):
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert response.headers["content-type"].startswith("text/event-stream")
    assert (response.headers["cache-control"], response.headers["x-accel-buffering"]) == ("no-cache", "no")


def test_stream_frames_chunks_and_ends_with_done(client):
    events = sse_events(client.post("/v1/completions", json={**COMPLETION, "stream": True}))
    assert events[-1] == "[DONE]"
    assert "".join(orjson.loads(e)["choices"][0]["text"] for e in events[:-1]) == "Hello world"


def test_error_mid_stream_is_one_in_band_error_event_then_done(engine, client):
    engine.fail_with, engine.fail_at = RuntimeError("boom at /secret/path"), 1
    response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    events = sse_events(response)
    assert response.status_code == 200
    assert orjson.loads(events[-2])["error"]["type"] == "server_error"
    assert events[-1] == "[DONE]" and "secret" not in response.text


def test_error_before_the_first_chunk_is_a_normal_http_error(engine, client):
    engine.fail_with = EngineDeadError("core died")
    response = client.post("/v1/completions", json={**COMPLETION, "stream": True})
    assert_openai_error(response, 503)


# ---- validation and request errors ----

def test_validation_error_is_400_in_openai_shape_never_422(client):
    response = client.post("/v1/chat/completions", json={**CHAT, "temperature": 3})
    assert_openai_error(response, 400, code="decimal_above_max_value", param="temperature")


def test_missing_messages_is_missing_required_parameter(client):
    response = client.post("/v1/chat/completions", json={"model": MODEL})
    assert_openai_error(response, 400, code="missing_required_parameter", param="messages")


def test_nested_error_param_is_the_top_level_field(client):
    response = client.post("/v1/chat/completions",
                           json={"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})
    assert_openai_error(response, 400, code="invalid_value", param="messages")


def test_framework_validation_error_is_400_with_the_param(engine):
    app = build_app(engine, ServerConfig(served_model_name=MODEL))

    async def probe(count: int) -> dict:
        return {}

    app.add_api_route("/probe", probe)
    response = TestClient(app).get("/probe", params={"count": "many"})
    assert_openai_error(response, 400, code="invalid_type", param="count")


def test_invalid_json_is_400(client):
    response = client.post("/v1/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert_openai_error(response, 400)


def test_non_object_json_is_400(client):
    assert_openai_error(client.post("/v1/completions", json=[1, 2]), 400, code="invalid_type")


def test_unknown_model_is_404_model_not_found(client):
    response = client.post("/v1/completions", json={**COMPLETION, "model": "gpt-9"})
    error = assert_openai_error(response, 404, code="model_not_found", param="model")
    assert error["message"] == "The model `gpt-9` does not exist or you do not have access to it."


def test_unsupported_parameter_is_400_naming_it(client):
    response = client.post("/v1/completions", json={**COMPLETION, "suffix": "!"})
    error = assert_openai_error(response, 400, code="unsupported_parameter", param="suffix")
    assert error["message"] == "suffix is not supported by this server"


def test_unknown_route_is_404_in_openai_shape(client):
    assert_openai_error(client.get("/v1/nowhere"), 404)


def test_wrong_method_is_405_in_openai_shape_with_allow(client):
    response = client.get("/v1/completions")
    assert_openai_error(response, 405)
    assert "POST" in response.headers["allow"]


def test_unexpected_exception_is_500_without_details(engine, client):
    engine.fail_with = RuntimeError("boom at /secret/path")
    response = client.post("/v1/completions", json=COMPLETION)
    error = assert_openai_error(response, 500)
    assert error["type"] == "server_error" and "secret" not in response.text


def test_dead_engine_is_503(engine, client):
    engine.errored = True
    assert_openai_error(client.post("/v1/completions", json=COMPLETION), 503)


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_generation_before_the_engine_is_ready_is_503(engine, client, path, body):
    engine.ready = False
    assert_openai_error(client.post(path, json=body), 503, code="engine_unavailable")


@pytest.mark.parametrize("method,path,body", [("get", "/v1/models", None), ("get", f"/v1/models/{MODEL}", None),
                                              ("post", "/tokenize", {"prompt": "hi"})])
def test_what_describes_the_model_is_503_until_it_has_loaded(engine, client, method, path, body):
    engine.ready = False
    kwargs = {} if body is None else {"json": body}
    assert_openai_error(getattr(client, method)(path, **kwargs), 503, code="engine_unavailable")
    engine.ready = True
    assert getattr(client, method)(path, **kwargs).status_code == 200


def test_models_and_metrics_say_what_runs_the_model(client):
    [card] = client.get("/v1/models").json()["data"]
    assert card["backends"] == {"device": "cpu", "fused_forward": "yes"}
    metrics = client.get("/metrics").text
    assert 'tailrace:backend_info{device="cpu",fused_forward="yes",model_name="' in metrics


def test_unfixable_4xx_says_do_not_retry(client):
    assert client.post("/v1/completions", json={"model": MODEL}).headers["x-should-retry"] == "false"


def test_server_error_leaves_retry_to_the_client(engine, client):
    engine.errored = True
    assert "x-should-retry" not in client.post("/v1/completions", json=COMPLETION).headers


# ---- body limit ----

def test_declared_body_over_limit_is_413(engine):
    client = client_for(engine, max_body_bytes=100)
    response = client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 200})
    assert_openai_error(response, 413)


def test_streamed_body_over_limit_is_413(engine):
    client = client_for(engine, max_body_bytes=100)
    body = orjson.dumps({**COMPLETION, "prompt": "x" * 200})
    response = client.post("/v1/completions", content=iter([body[:60], body[60:]]),
                           headers={"content-type": "application/json"})
    assert "content-length" not in response.request.headers
    assert_openai_error(response, 413)


def test_body_under_limit_is_served(engine):
    assert client_for(engine, max_body_bytes=1000).post("/v1/completions", json=COMPLETION).status_code == 200


# ---- auth ----

def test_no_key_configured_needs_no_auth(client):
    assert client.get("/v1/models").status_code == 200


def test_missing_key_is_401_saying_no_key_was_provided(engine):
    response = client_for(engine, api_key=KEY).post("/v1/completions", json=COMPLETION)
    assert_openai_error(response, 401)
    assert response.json()["error"]["message"].startswith("You didn't provide an API key.")
    assert response.headers["x-should-retry"] == "false"


def test_wrong_key_is_401_invalid_api_key_showing_the_key_masked(engine):
    response = client_for(engine, api_key=KEY).get("/v1/models",
                                                   headers={"authorization": "Bearer sk-wrong-key-1234"})
    assert_openai_error(response, 401, code="invalid_api_key")
    assert response.json()["error"]["message"] == "Incorrect API key provided: sk-****1234."


def test_bearer_with_no_key_counts_as_missing(engine):
    response = client_for(engine, api_key=KEY).get("/v1/models", headers={"authorization": "Bearer "})
    assert response.json()["error"]["code"] is None


@pytest.mark.parametrize(("method", "path"), [("GET", "/version"), ("GET", "/ping"), ("POST", "/ping")])
def test_version_and_ping_need_no_key(engine, method, path):
    assert client_for(engine, api_key=KEY).request(method, path).status_code == 200


def test_right_key_is_served(engine):
    response = client_for(engine, api_key=KEY).post("/v1/completions", json=COMPLETION,
                                                    headers={"authorization": f"Bearer {KEY}"})
    assert response.status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenizer_routes_need_the_key(engine, path):
    assert client_for(engine, api_key=KEY).post(path, json={"prompt": "x"}).status_code == 401


def test_health_is_exempt_from_auth(engine):
    assert client_for(engine, api_key=KEY).get("/health").status_code == 200


def test_metrics_need_the_key_unless_public(engine):
    assert client_for(engine, api_key=KEY).get("/metrics").status_code == 401
    assert client_for(engine, api_key=KEY, metrics_public=True).get("/metrics").status_code == 200


# ---- request ids ----

def test_generated_request_id_on_success(client):
    assert re.fullmatch(r"req-[0-9a-f]{32}", client.get("/v1/models").headers["x-request-id"])


def test_client_request_id_is_echoed(client):
    response = client.post("/v1/completions", json=COMPLETION, headers={"x-request-id": "trace-42"})
    assert response.headers["x-request-id"] == "trace-42"


@pytest.mark.parametrize("call", [
    lambda c: c.post("/v1/completions", json={"model": MODEL}),
    lambda c: c.get("/v1/nowhere"),
])
def test_request_id_on_error_responses(client, call):
    assert call(client).headers["x-request-id"].startswith("req-")


def test_request_id_on_500(engine, client):
    engine.fail_with = RuntimeError("boom")
    assert client.post("/v1/completions", json=COMPLETION).headers["x-request-id"].startswith("req-")


def test_request_id_on_413(engine):
    response = client_for(engine, max_body_bytes=10).post("/v1/completions", json=COMPLETION)
    assert response.headers["x-request-id"].startswith("req-")


# ---- models, health, version, metrics ----

def test_models_lists_the_served_model_with_max_model_len(client):
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [(MODEL, "model", 128)]


def test_model_retrieve_unknown_is_404(client):
    assert_openai_error(client.get("/v1/models/gpt-9"), 404, code="model_not_found")


def test_health_is_200_empty_object_when_ready(client):
    response = client.get("/health")
    assert (response.status_code, response.json()) == (200, {})


def test_health_is_503_in_openai_shape_when_not_ready(engine, client):
    engine.ready = False
    assert_openai_error(client.get("/health"), 503)


@pytest.mark.parametrize("path", ["/health", "/ping"])
def test_health_and_ping_are_503_while_draining(client, path):
    start_draining(client.app)
    assert_openai_error(client.get(path), 503)


def test_new_generation_requests_are_503_while_draining(client):
    start_draining(client.app)
    response = client.post("/v1/completions", json=COMPLETION)
    assert_openai_error(response, 503)
    assert "x-should-retry" not in response.headers


def test_version_reports_the_package_version(client):
    assert client.get("/version").json()["version"] == "0.1.0"


def test_metrics_show_engine_stats_and_served_tokens(engine, client):
    engine.engine_stats = EngineStats(num_running=3)
    client.post("/v1/completions", json=COMPLETION)
    text = client.get("/metrics").text
    assert f'tailrace:num_requests_running{{model_name="{MODEL}"}} 3.0' in text
    assert re.search(r'tailrace:generation_tokens_total\{model_name="tiny"\} [1-9]', text)


# ---- tokenize / detokenize ----

def test_tokenize_detokenize_round_trip(client):
    tokens = client.post("/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"prompt": "Hello world"}


def test_tokenize_reports_count_and_max_model_len(client, tokenizer):
    body = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert body == {"tokens": tokenizer.encode("Hello world"), "count": len(tokenizer.encode("Hello world")),
                    "max_model_len": 128}


def test_tokenize_messages_uses_the_chat_template(client, tokenizer):
    messages = [{"role": "user", "content": "Hi"}]
    body = client.post("/tokenize", json={"messages": messages}).json()
    expected = tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False)
    assert body["tokens"] == expected


def test_tokenize_unknown_model_is_404(client):
    assert_openai_error(client.post("/tokenize", json={"model": "gpt-9", "prompt": "x"}), 404)


def test_detokenize_out_of_vocab_is_400(client, tokenizer):
    response = client.post("/detokenize", json={"tokens": [1, tokenizer.vocab_size]})
    assert_openai_error(response, 400, param="tokens")


# ---- CORS ----

def test_cors_off_by_default(client):
    assert "access-control-allow-origin" not in client.get("/health", headers={"origin": "http://a"}).headers


def test_cors_allows_configured_origin(engine):
    client = client_for(engine, cors_origins=["http://a"])
    response = client.options("/v1/completions", headers={"origin": "http://a",
                                                           "access-control-request-method": "POST"})
    assert response.headers["access-control-allow-origin"] == "http://a"


def test_every_served_name_is_listed_and_accepted_and_responses_carry_the_first(engine):
    client = client_for(engine, other_model_names=["tiny-alias"])
    assert [card["id"] for card in client.get("/v1/models").json()["data"]] == [MODEL, "tiny-alias"]
    assert client.get("/v1/models/tiny-alias").json()["id"] == "tiny-alias"
    response = client.post("/v1/completions", json={**COMPLETION, "model": "tiny-alias"})
    assert response.json()["model"] == MODEL


def test_the_models_sampling_defaults_fill_what_a_request_leaves_unset(engine):
    seen = []
    add_request = engine.add_request

    def recording_add_request(request_id, prompt_token_ids, params):
        seen.append(params)
        return add_request(request_id, prompt_token_ids, params)

    engine.add_request = recording_add_request
    client = client_for(engine, sampling_defaults={"temperature": 0.6, "top_k": 20})
    client.post("/v1/chat/completions", json={**CHAT, "top_k": 5})
    assert (seen[0].temperature, seen[0].top_k) == (0.6, 5)


# ---- strict types, unknown fields ----

def test_stream_yes_is_400_invalid_type_not_a_stream(client):
    response = client.post("/v1/chat/completions", json={**CHAT, "stream": "yes"})
    assert_openai_error(response, 400, code="invalid_type", param="stream")
    assert response.json()["error"]["message"] == ("Invalid type for 'stream': expected a boolean, but got a "
                                                   "string instead.")


def test_unknown_fields_are_served_and_named_in_one_warning(client, caplog):
    with caplog.at_level(logging.WARNING, logger="tailrace.api.handling"):
        response = client.post("/v1/completions", json={**COMPLETION, "frobnicate": 1, "guided_zeta": "x"})
    assert response.status_code == 200
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].endswith("frobnicate, guided_zeta")


# ---- the stats line ----

def test_the_stats_logger_runs_with_the_server_unless_disabled(engine, monkeypatch):
    started = []

    def fake_log_stats(metrics, engine_stats):
        started.append(engine_stats)
        return asyncio.sleep(3600)

    monkeypatch.setattr("tailrace.api.app.log_stats", fake_log_stats)
    with TestClient(build_app(engine, ServerConfig(served_model_name=MODEL))):
        pass
    with TestClient(build_app(engine, ServerConfig(served_model_name=MODEL, log_stats=False))):
        pass
    assert started == [engine.stats]
