"""The engine as the API layer sees it (the part of `EngineClient`'s face that `build_app` and serving
use), in front of the engine replicas of a Ray Serve deployment. Each request is one streaming call
through the deployment's handle, whose request router picks the replica.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable

from ray.exceptions import RayError
from ray.serve.handle import DeploymentHandle

from tailrace.engine.client import EngineDeadError
from tailrace.engine.messages import EngineRequest
from tailrace.engine.stats import EngineStats
from tailrace.outputs import RequestOutput
from tailrace.ray.replica import EngineError, ReplicaStats
from tailrace.sampling_params import SamplingParams
from tailrace.tokenizer import Tokenizer


class RemoteEngine:
    def __init__(self, replicas: DeploymentHandle, model_path: str, tokenizer: Tokenizer) -> None:
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.max_model_len = 0
        self.hidden_size = 0  # known once a replica's model has loaded
        self.backends: dict[str, str] = {}  # the first ready replica's (every replica runs the same config)
        self._replicas = replicas
        self._streams = replicas.options(stream=True)
        self._stats: dict[str, EngineStats] = {}  # the latest each replica sent

    async def launch(self) -> None:
        """Wait for a replica's model to load, and take the context length from it."""
        info = await self._replicas.ready.remote()
        self.max_model_len = info.max_model_len
        self.hidden_size = info.hidden_size
        self.backends = info.backends

    @property
    def is_ready(self) -> bool:
        return self.max_model_len > 0

    @property
    def errored(self) -> bool:
        # Never as a whole: Ray Serve replaces a replica whose core died (EngineReplica.check_health),
        # and that replica's open requests fail on their own (add_request).
        return False

    def stats(self) -> EngineStats:
        return combined_stats(self._stats.values())

    async def add_request(self, request_id: str, prompt_token_ids: list[int],
                          params: SamplingParams) -> AsyncIterator[RequestOutput]:
        stream = self._streams.generate.remote(EngineRequest(request_id, prompt_token_ids, params))
        finished = False
        try:
            async for item in stream:
                if isinstance(item, ReplicaStats):
                    self._stats[item.replica] = item.stats
                elif isinstance(item, EngineError):
                    raise item.error
                else:
                    finished = item.finished
                    yield item
        except RayError as err:  # the replica died or could not be reached; another one takes the retry
            raise EngineDeadError(f"the engine replica failed: {err}") from err
        finally:
            if not finished:
                stream.cancel()  # the replica's generator stops, and its engine aborts the request

    async def abort(self, request_id: str) -> None:
        """Nothing more to do: serving closes the request's stream first, and closing it cancels the
        replica's side (add_request's `finally`)."""


def combined_stats(replicas: Iterable[EngineStats]) -> EngineStats:
    """The replicas' stats as one engine's: counts and blocks add up, KV usage is over all blocks."""
    total = EngineStats()
    for s in replicas:
        total.num_running += s.num_running
        total.num_waiting += s.num_waiting
        total.num_total_blocks += s.num_total_blocks
        total.num_free_blocks += s.num_free_blocks
        total.prefix_cache_queries += s.prefix_cache_queries
        total.prefix_cache_hits += s.prefix_cache_hits
        total.num_preemptions += s.num_preemptions
    if total.num_total_blocks:
        total.kv_usage = 1 - total.num_free_blocks / total.num_total_blocks
    return total
