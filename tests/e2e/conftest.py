"""One real `tailrace serve` process for the whole e2e session, reached over loopback HTTP.

Import note: tests/ has no __init__.py, so pytest (rootdir-based "prepend" import mode) puts tests/
on sys.path and imports the root conftest as the module `conftest`; this directory is the package
`e2e` (it has an __init__.py), so its conftest is `e2e.conftest` and the two never collide.
"""

from __future__ import annotations

import contextlib
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # before any litellm import: no network here

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from conftest import EMBEDDED, make_tiny_checkpoint

API_KEY = "test-key"
MODEL = "tiny"
MAX_NUM_SEQS = 32
TP_SIZE = 2  # tp_server_url's ranks
# speculative_server_url's: short suffixes and four guesses, so the embedded model guesses often
SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
READY_TIMEOUT_S = 90.0
RAY_READY_TIMEOUT_S = 240.0  # a Ray instance, its Serve controller and proxy, then the replicas
# .ci/run's Ray step sets it: the same tests, against the Ray Serve app with two replicas.
THROUGH_RAY = os.environ.get("TAILRACE_E2E_SERVER") == "ray"
STOP_GRACE_S = 10.0
LOG_TAIL_CHARS = 8000

REPO_ROOT = Path(__file__).resolve().parents[2]
_server_logs: dict[str, Path] = {}  # the running servers' logs, by name, shown with every failed e2e test


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else "(no log)"
    return text[-LOG_TAIL_CHARS:]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The embedded model once it is trained; a tiny random checkpoint until then."""
    if (EMBEDDED / "model.safetensors").exists():
        return str(EMBEDDED)
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("e2e-tiny")))


def serving(args: list[str], log_path: Path, env: dict[str, str] | None = None) -> Iterator[str]:
    """Run `tailrace serve ARGS` on a free port (with `env` added to this environment), yield its URL
    once /health is 200, and stop it when resumed."""
    port = free_port()
    command = [sys.executable, "-m", "tailrace", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                   env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url, log_path)
        yield url
    finally:
        _stop(process)


def ray_serving(settings: dict[str, object], log_path: Path) -> Iterator[str]:
    """`serve run` of the Ray Serve app (tailrace.ray:build SETTINGS, two replicas of one thread) on
    a free port, its own Ray instance with it; yield its URL once /health is 200."""
    port = free_port()
    config = log_path.with_name("serve.yaml")  # JSON is YAML
    config.write_bytes(orjson.dumps({
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": "tailrace", "route_prefix": "/", "import_path": "tailrace.ray:build",
                          "args": {"num_replicas": 2, "threads": 1, **settings}}]}))
    serve_cli = Path(sys.executable).with_name("serve")
    with open(log_path, "wb") as log:
        # Its own session, so that whatever of Ray is left after the grace can be ended as a group.
        process = subprocess.Popen([str(serve_cli), "run", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                   cwd=REPO_ROOT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(process, url, log_path, RAY_READY_TIMEOUT_S)
        yield url
    finally:
        _stop(process, group=True)


@pytest.fixture(scope="session")
def server_url(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`http://127.0.0.1:<port>` of a server that answers /health with 200."""
    log_path = tmp_path_factory.mktemp("e2e-server") / "server.log"
    # tests/check reuses this fixture, which makes a second session server: each has its own name.
    name = f"server ({log_path.parent.name})"
    _server_logs[name] = log_path
    try:
        if THROUGH_RAY:
            yield from ray_serving({"model": model_dir, "api-key": API_KEY, "served-model-name": MODEL,
                                    "max-num-seqs": MAX_NUM_SEQS}, log_path)
        else:
            yield from serving(_serve_args(model_dir), log_path)
    finally:
        del _server_logs[name]


@pytest.fixture(scope="module")
def tp_server_url(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same server with its model split over two tensor-parallel ranks (gloo on this CPU), for the
    modules that run against it too; stopped when the module is done."""
    log_path = tmp_path_factory.mktemp("e2e-tp-server") / "server.log"
    _server_logs["tensor-parallel server"] = log_path
    try:
        with contextlib.closing(serving([*_serve_args(model_dir), "--tensor-parallel-size", str(TP_SIZE)],
                                        log_path)) as server:
            url = next(server)
            if f"tensor parallel: {TP_SIZE} ranks" not in log_path.read_text(errors="replace"):
                pytest.fail(f"the server did not start {TP_SIZE} ranks:\n{log_tail(log_path)}")
            yield url
    finally:
        del _server_logs["tensor-parallel server"]


@pytest.fixture(scope="session")
def speculative_server_url(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The same server guessing tokens by n-gram lookup (SPECULATIVE_CONFIG), for the checks that
    must hold with speculation on; it starts with the first test that asks for it."""
    log_path = tmp_path_factory.mktemp("e2e-speculative-server") / "server.log"
    name = f"speculative server ({log_path.parent.name})"  # tests/check reuses it too: see server_url
    _server_logs[name] = log_path
    try:
        with contextlib.closing(serving([*_serve_args(model_dir), "--speculative-config",
                                         orjson.dumps(SPECULATIVE_CONFIG).decode()], log_path)) as server:
            url = next(server)
            if "speculative decoding: ngram" not in log_path.read_text(errors="replace"):
                pytest.fail(f"the server does not speculate:\n{log_tail(log_path)}")
            yield url
    finally:
        del _server_logs[name]


def _serve_args(model_dir: str) -> list[str]:
    return [model_dir, "--api-key", API_KEY, "--served-model-name", MODEL, "--max-num-seqs", str(MAX_NUM_SEQS)]


def _wait_healthy(process: subprocess.Popen, url: str, log_path: Path, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited with {process.returncode} before /health was 200:\n{log_tail(log_path)}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass  # not listening yet
        time.sleep(0.1)
    pytest.fail(f"/health was not 200 within {timeout_s:.0f} s:\n{log_tail(log_path)}")


def _stop(process: subprocess.Popen, group: bool = False) -> None:
    """SIGTERM, then SIGKILL after the grace: to the process, or to its whole session with `group`."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_GRACE_S * (3 if group else 1))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if group:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    report = yield
    if report.failed:
        for name, log_path in _server_logs.items():
            report.sections.append((f"{name} log (tail)", log_tail(log_path)))
    return report


@pytest.fixture(scope="session")
def api_base(server_url: str) -> str:
    """What clients take as base_url."""
    return f"{server_url}/v1"


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="session")
def http(server_url: str, auth: dict[str, str]) -> Iterator[httpx.Client]:
    """Raw HTTP with the key, for what the SDKs hide (headers, framing, bodies)."""
    with httpx.Client(base_url=server_url, headers=auth, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="session")
def max_model_len(http: httpx.Client) -> int:
    return http.get("/v1/models").json()["data"][0]["max_model_len"]
