"""The engine core's side of the pipe: msgpack frames in, steps, msgpack frames out.

Runs in its own process by default, so JSON and detokenizing in the API process never take
the model's core; `run_core` runs on a thread just as well (in-process mode).
"""

from __future__ import annotations

import logging
import traceback
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

import msgspec

from tailrace.engine.config import EngineConfig
from tailrace.engine.messages import EngineRequest, SeqOutput
from tailrace.engine.stats import EngineStats
from tailrace.engine.stop_signals import ignore_in_child
from tailrace.heap import freeze_startup_objects
from tailrace.logs import configure_logging

if TYPE_CHECKING:  # the core (and PyTorch) load in the core's process only, in run_core
    from tailrace.engine.core import EngineCore

log = logging.getLogger("tailrace.engine")

_RANK_EXIT_S = 1.0  # how long a failed core waits to learn whether a tensor-parallel rank exited


class AddMsg(msgspec.Struct, tag="add"):
    request: EngineRequest


class AbortMsg(msgspec.Struct, tag="abort"):
    request_id: str
    siblings: list[int] | None = None  # None: the whole request


class ShutdownMsg(msgspec.Struct, tag="shutdown"):
    pass


class ReadyMsg(msgspec.Struct, tag="ready"):
    max_model_len: int
    num_blocks: int
    block_size: int
    vocab_size: int
    dtype: str
    device: str  # "cpu" or "cuda": what "auto" became
    stats: EngineStats
    backends: dict[str, str]  # what runs the model, and why not the rest (model/backends.py)
    hidden_size: int  # the length of a pooled vector
    keeps_kv: bool  # False: each prompt runs whole and its blocks only count tokens (ModelRunner.keeps_kv)


class OutputsMsg(msgspec.Struct, tag="out"):
    outputs: list[SeqOutput]
    stats: EngineStats


class RequestErrorMsg(msgspec.Struct, tag="req_error"):
    request_id: str
    message: str
    param: str | None = None  # the request field at fault, when the core knows it


class FatalMsg(msgspec.Struct, tag="fatal"):
    message: str


ToCore = AddMsg | AbortMsg | ShutdownMsg
FromCore = ReadyMsg | OutputsMsg | RequestErrorMsg | FatalMsg

encoder = msgspec.msgpack.Encoder()
to_core_decoder = msgspec.msgpack.Decoder(ToCore)
from_core_decoder = msgspec.msgpack.Decoder(FromCore)


def run_core_process(config: EngineConfig, conn: Connection, log_level: int = logging.INFO) -> None:
    """`run_core` as the core's own process, logging at the API process's level and in its format.
    It ignores the stop signals a supervisor or a terminal sends the whole process group
    (stop_signals), so it keeps serving the streams the API process's drain lets finish, and stops
    when that process says so or goes away."""
    ignore_in_child()
    configure_logging(log_level)
    run_core(config, conn)


def run_core(config: EngineConfig, conn: Connection) -> None:
    from tailrace.engine.core import EngineCore

    try:
        core = EngineCore(config)
    except Exception as exc:  # the client shows the reason; nothing else can run
        conn.send_bytes(encoder.encode(FatalMsg(f"the engine failed to start: {exc}")))
        return
    freeze_startup_objects()
    mc = core.runner.model_config
    dtype = str(core.runner.model.dtype).removeprefix("torch.")
    model = core.runner.model
    conn.send_bytes(encoder.encode(ReadyMsg(core.max_model_len, core.runner.num_blocks, config.block_size,
                                            mc.vocab_size, dtype, core.runner.device.type, core.stats(),
                                            core.runner.backends.record(model), model.embedding_size,
                                            core.runner.keeps_kv)))
    try:
        _loop(core, conn)
    except (EOFError, OSError, BrokenPipeError):
        return  # the client went away
    except Exception as exc:
        log.error("engine core failed:\n%s", traceback.format_exc())
        tp = core.runner.tp  # a rank that died fails a collective here: name it, not the socket error
        reason = (tp.exited_worker(_RANK_EXIT_S) if tp is not None else None) or exc
        try:
            conn.send_bytes(encoder.encode(FatalMsg(f"the engine core failed: {reason}")))
        except OSError:
            pass
    finally:
        core.shutdown()


def _loop(core: EngineCore, conn: Connection) -> None:
    unsent: list[SeqOutput] | None = None  # a step's outputs, held back to go out during the next
    while True:
        step = core.launch() if core.has_work() else None
        # On CUDA the device runs the step now: send the last one's outputs and take in messages
        # meanwhile. On CPU the step has already run, and nothing is ever held back.
        if unsent is not None:
            conn.send_bytes(encoder.encode(OutputsMsg(unsent, core.stats())))
            unsent = None
        outputs, handled, shutdown = _receive(core, conn)
        if shutdown:
            return
        if step is not None:
            outputs.extend(core.collect(step))
        if not (outputs or handled):
            continue
        if step is not None and core.runner.asynchronous and core.has_work():
            unsent = outputs
        else:
            conn.send_bytes(encoder.encode(OutputsMsg(outputs, core.stats())))


def _receive(core: EngineCore, conn: Connection) -> tuple[list[SeqOutput], bool, bool]:
    """Handle the messages that have arrived, waiting for one when the core has nothing to do:
    (the outputs of aborts, whether any message came, whether it was told to shut down)."""
    outputs: list[SeqOutput] = []
    handled = False
    timeout = 0 if core.has_work() else None
    while _poll(core, conn, timeout):
        msg = to_core_decoder.decode(conn.recv_bytes())
        if isinstance(msg, ShutdownMsg):
            return outputs, handled, True
        handled = True
        timeout = 0
        if isinstance(msg, AddMsg):
            try:
                core.add_request(msg.request)
            except ValueError as exc:
                error = RequestErrorMsg(msg.request.request_id, str(exc), getattr(exc, "param", None))
                conn.send_bytes(encoder.encode(error))
        else:
            outputs.extend(core.abort(msg.request_id, msg.siblings))
    return outputs, handled, False


def _poll(core: EngineCore, conn: Connection, timeout: float | None) -> bool:
    """Whether a message is waiting (within timeout). With tensor-parallel workers, a worker's exit
    ends the wait too, and raises: the engine is dead without it."""
    tp = core.runner.tp
    if tp is None:
        return conn.poll(timeout)
    ready = wait([conn, *tp.sentinels], timeout)
    tp.check_alive(ready)
    return conn in ready
