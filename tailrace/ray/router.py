"""The engine deployment's request router (Ray Serve's `request_router_config`): prompts that share a
prefix go to the replica that already holds it, so each replica's prefix cache keeps working.

It runs inside the ingress replica, in the handle that calls the engine deployment, and reads the
prompt's token ids from the `EngineRequest` argument of `EngineReplica.generate`. Loads are Ray's
cached queue lengths (requests running or queued on the replica, as the replicas last reported and
this handle has since sent); an unknown one counts as 0.
"""

from __future__ import annotations

from collections.abc import Hashable

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from tailrace.engine.messages import EngineRequest
from tailrace.ray.prefix import DEFAULT_CAPACITY, DEFAULT_MAX_IMBALANCE, PrefixTable, rank_replicas


class PrefixAwareRouter(RequestRouter):
    """No FIFOMixin: with it, a replica found for one request may be handed to an older one, which
    would undo the prefix match."""

    def initialize_state(self, block_size: int = 16, max_imbalance: int = DEFAULT_MAX_IMBALANCE,
                         capacity: int = DEFAULT_CAPACITY) -> None:
        self._table = PrefixTable(block_size, capacity)
        self._max_imbalance = max_imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_id = {r.replica_id: r for r in candidate_replicas}
        prompt = _prompt_of(pending_request)
        preferred = None if prompt is None else self._table.lookup(prompt)
        loads = {rid: self.replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        held = {rid: self._table.held(rid) for rid in by_id}
        ranks = rank_replicas(preferred, loads, held, self._max_imbalance)
        if prompt is not None and ranks:
            # At once, not only when routed: requests with this prefix that arrive meanwhile follow it.
            self._table.record(prompt, ranks[0][0])
        return [[by_id[rid] for rid in rank] for rank in ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: object) -> None:
        prompt = _prompt_of(pending_request)
        if prompt is not None:  # where it went, which differs from the first choice when that one was full
            self._table.record(prompt, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._table.forget(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        gone: set[Hashable] = set(self._replicas) - {r.replica_id for r in replicas}
        for replica_id in gone:  # scaled down: its cache went with it
            self._table.forget(replica_id)
        super().update_replicas(replicas)


def _prompt_of(pending_request: PendingRequest | None) -> list[int] | None:
    if pending_request is None:
        return None
    for arg in pending_request.args:
        if isinstance(arg, EngineRequest):
            return arg.prompt_token_ids
    return None
