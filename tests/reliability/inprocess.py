"""The app and a real engine served by uvicorn on a thread of the test process, so that a test can
monkeypatch the serving path (fault injection) and still talk real HTTP to it."""

from __future__ import annotations

import asyncio
import threading

import uvicorn

from harness import API_KEY, MODEL, free_port
from tailrace.api.app import ServerConfig, build_app
from tailrace.engine.client import EngineClient
from tailrace.engine.config import EMBEDDED_MODEL, EngineConfig
from tailrace.serving.limits import Limits
from tailrace.tokenizer import load_tokenizer

START_TIMEOUT_S = 120.0


class InProcessServer:
    def __init__(self, limits: Limits | None = None, **engine_flags: object) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}
        self.limits = limits or Limits()
        self.engine_config = EngineConfig(model=EMBEDDED_MODEL, in_process=True, **engine_flags)
        self._ready = threading.Event()
        self._server: uvicorn.Server | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="in-process-server", daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise RuntimeError(f"the in-process server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
        self._thread.join(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported by __enter__ instead of dying silently on the thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        engine = EngineClient(self.engine_config, load_tokenizer(EMBEDDED_MODEL))
        app = build_app(engine, ServerConfig(served_model_name=MODEL, api_key=API_KEY, limits=self.limits))
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        serving = asyncio.create_task(self._server.serve())
        await engine.launch()
        while not self._server.started:
            await asyncio.sleep(0.01)
        self._ready.set()
        await serving
        await engine.shutdown()
