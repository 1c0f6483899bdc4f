"""One engine replica under Ray Serve: its own engine core behind an `EngineClient`, streaming each
request's deltas back to the ingress (`RemoteEngine`).

The replica detokenizes (the `EngineClient`'s output processor), so stop strings cut and abort here,
next to the core, as in `tailrace serve`. What it streams besides the deltas is in the small records
below: the replica's engine stats after each request, and an engine error to raise in the ingress.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from ray import serve

from tailrace.engine.client import EngineClient, EngineDeadError, RequestFailedError, RequestRejectedError
from tailrace.engine.config import EngineConfig
from tailrace.engine.messages import EngineRequest
from tailrace.engine.stats import EngineStats
from tailrace.outputs import RequestOutput
from tailrace.tokenizer import load_tokenizer


@dataclass(slots=True)
class ReplicaInfo:
    max_model_len: int
    backends: dict[str, str]  # what runs the model (model/backends.py's record)
    hidden_size: int  # the length of a pooled vector


@dataclass(slots=True)
class ReplicaStats:
    """The replica's engine stats, sent after a request's last delta: the ingress's /metrics adds up
    the latest of each replica (the prefix-cache counters among them)."""

    replica: str
    stats: EngineStats


@dataclass(slots=True)
class EngineError:
    """Raised again in the ingress, where serving turns it into the API's error (400, 500 or 503)."""

    error: RequestRejectedError | RequestFailedError | EngineDeadError


class EngineReplica:
    async def __init__(self, config: EngineConfig) -> None:
        self._engine = EngineClient(config, load_tokenizer(config.model_path))
        await self._engine.launch()
        self._name = serve.get_replica_context().replica_id.unique_id

    def ready(self) -> ReplicaInfo:
        return ReplicaInfo(self._engine.max_model_len, self._engine.backends, self._engine.hidden_size)

    async def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput | ReplicaStats | EngineError]:
        """The request's deltas. When the ingress stops reading (its client went away), Ray cancels this
        generator, and the EngineClient's stream aborts the request in the core."""
        try:
            async for output in self._engine.add_request(request.request_id, request.prompt_token_ids,
                                                         request.params):
                yield output
        except (RequestRejectedError, RequestFailedError, EngineDeadError) as err:
            yield EngineError(err)
        yield ReplicaStats(self._name, self._engine.stats())

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica, as a supervisor
        restarts `tailrace serve` when its core dies."""
        if self._engine.errored:
            raise RuntimeError(f"the engine core of replica {self._name} stopped")

    async def __del__(self) -> None:
        await self._engine.shutdown()
