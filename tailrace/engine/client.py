"""The async face of the engine: per-request delta streams over an engine core behind a pipe."""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

from tailrace.engine.config import EngineConfig
from tailrace.engine.messages import EngineRequest
from tailrace.engine.core_process import (
    AbortMsg, AddMsg, FatalMsg, OutputsMsg, ReadyMsg, RequestErrorMsg, ShutdownMsg, encoder,
    from_core_decoder, run_core, run_core_process,
)
from tailrace.engine.output_processor import OutputProcessor
from tailrace.engine.stats import EngineStats
from tailrace.engine.stop_signals import blocked_while_starting
from tailrace.outputs import RequestOutput
from tailrace.sampling_params import SamplingParams
from tailrace.tokenizer import Tokenizer, load_tokenizer

__all__ = ["EngineClient", "EngineDeadError", "EngineStats", "RequestFailedError", "RequestRejectedError"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine core stopped; every open request fails with this."""


class RequestRejectedError(ValueError):
    """The core refused the request as it stands (e.g. it can never fit in the KV cache); `param`
    names the request field at fault, when the core knows it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self):  # Ray ships it between processes: keep the param
        return type(self), (str(self), self.param)


class RequestFailedError(RuntimeError):
    """Processing this one request's output failed; the other requests carry on."""


@dataclass(slots=True)
class Core:
    """A started engine core: the process (or, in process, the thread) and our end of its pipe."""

    worker: multiprocessing.process.BaseProcess | threading.Thread
    conn: Connection

    def stop(self) -> None:
        """Stop a core that no client took over (it is still loading its model: nothing to save)."""
        self.conn.close()
        if isinstance(self.worker, multiprocessing.process.BaseProcess):
            self.worker.kill()
            self.worker.join()
            atexit.unregister(self.worker.kill)


def start_core(config: EngineConfig) -> Core:
    """Start the engine core, which loads the model and then says it is ready; returns at once, so
    the caller can load the tokenizer meanwhile (a GGUF's vocabulary takes seconds to parse)."""
    conn, child = multiprocessing.Pipe()
    if config.in_process:
        worker: multiprocessing.process.BaseProcess | threading.Thread = threading.Thread(
            target=run_core, args=(config, child), daemon=True)
        worker.start()
    else:
        worker = multiprocessing.get_context("spawn").Process(
            target=run_core_process, args=(config, child, logging.getLogger().getEffectiveLevel()),
            daemon=True, name="tailrace-engine-core")
        with blocked_while_starting():
            worker.start()
        child.close()  # so the pipe reports EOF when the core process dies
        # The core ignores SIGTERM, which multiprocessing's exit handler would send it and then
        # wait: a process that exits without shutting the engine down kills it instead (atexit
        # runs the handlers registered last first).
        atexit.register(worker.kill)
    return Core(worker, conn)


class EngineClient:
    """Start with `await EngineClient.start(config)`; one per server. Given a `core` already
    started on the same config (start_core), `launch` waits for that one."""

    def __init__(self, config: EngineConfig, tokenizer: Tokenizer, core: Core | None = None) -> None:
        self.config = config
        self.model_path = config.model_path
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.hidden_size = 0  # known once the model has loaded
        self.info: ReadyMsg | None = None
        self._processor = OutputProcessor(tokenizer)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats = EngineStats()
        self._core = core
        self._conn: Connection | None = None
        self._worker: multiprocessing.process.BaseProcess | threading.Thread | None = None
        self._ready = asyncio.Event()
        self._dead = asyncio.Event()
        self._dead_reason: str | None = None

    @classmethod
    async def start(cls, config: EngineConfig) -> "EngineClient":
        config.validate()
        client = cls(config, load_tokenizer(config.model_path))
        await client.launch()
        return client

    async def launch(self) -> None:
        """Start the core (unless it was given) and wait until its model is loaded; EngineDeadError
        if it cannot start."""
        core = self._core or start_core(self.config)
        self._core = None
        self._worker, self._conn = core.worker, core.conn
        asyncio.get_running_loop().add_reader(self._conn.fileno(), self._on_readable)
        await self._ready.wait()
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    @property
    def backends(self) -> dict[str, str]:
        """What runs the model, and why not the faster paths (model/backends.py); empty until it loads."""
        return {} if self.info is None else self.info.backends

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self._dead_reason is None

    @property
    def errored(self) -> bool:
        return self._dead_reason is not None

    def stats(self) -> EngineStats:
        return self._stats

    async def wait_dead(self) -> str:
        """Wait until the core has stopped (crashed, or shut down); the reason."""
        await self._dead.wait()
        return self._dead_reason

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams) -> AsyncIterator[RequestOutput]:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._processor.add_request(request_id, prompt_token_ids, params)
        finished = False
        try:
            self._send(AddMsg(EngineRequest(request_id, prompt_token_ids, params)))
            while not finished:
                item = await queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)

    async def abort(self, request_id: str) -> None:
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        self._processor.remove(request_id)
        if self._dead_reason is None:
            self._send(AbortMsg(request_id))

    def _send(self, msg: object) -> None:
        """Send to the core; if it is gone, every open request (this one too) gets EngineDeadError."""
        try:
            self._conn.send_bytes(encoder.encode(msg))
        except OSError as exc:
            self._die(f"the engine core is unreachable: {exc}")

    def _on_readable(self) -> None:
        try:
            while self._conn.poll(0):
                self._dispatch(from_core_decoder.decode(self._conn.recv_bytes()))
        except (EOFError, OSError):
            self._die("the engine core process exited")
        except Exception:  # a frame that cannot be handled: better a dead engine than requests that hang
            log.exception("reading from the engine core failed")
            self._die("the engine client failed to read the core's output")

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, OutputsMsg):
            self._stats = msg.stats
            processed = self._processor.process(msg.outputs)
            for delta in processed.deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)
            for request_id, sibling in processed.to_abort:
                self._send(AbortMsg(request_id, [sibling]))
            for request_id in processed.failed:
                self._fail(request_id, RequestFailedError(f"processing the output of request {request_id} failed"))
                self._send(AbortMsg(request_id))
        elif isinstance(msg, RequestErrorMsg):
            self._processor.remove(msg.request_id)
            self._fail(msg.request_id, RequestRejectedError(msg.message, msg.param))
        elif isinstance(msg, ReadyMsg):
            self.info, self._stats = msg, msg.stats
            self.max_model_len = msg.max_model_len
            self.hidden_size = msg.hidden_size
            self._ready.set()
        elif isinstance(msg, FatalMsg):
            self._die(msg.message)

    def _fail(self, request_id: str, error: Exception) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _die(self, reason: str) -> None:
        if self._dead_reason is not None:
            return
        self._dead_reason = reason
        self._dead.set()
        if self._conn is not None:
            asyncio.get_running_loop().remove_reader(self._conn.fileno())
        for queue in self._queues.values():
            queue.put_nowait(EngineDeadError(reason))
        self._ready.set()

    async def shutdown(self) -> None:
        if self._core is not None:  # given and never launched
            self._core.stop()
            self._core = None
        if self._conn is None:
            return
        if self._dead_reason is None:
            self._send(ShutdownMsg())
            self._die("the engine was shut down")
        self._conn.close()
        self._conn = None
        worker = self._worker
        await asyncio.get_running_loop().run_in_executor(None, worker.join, 10)
        if isinstance(worker, multiprocessing.process.BaseProcess):
            if worker.is_alive():
                worker.kill()
            atexit.unregister(worker.kill)
