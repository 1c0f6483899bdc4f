"""Prefix-aware replica choice without Ray in it: a table of which replica took each prompt prefix,
and the ranking that sends a prompt there unless that replica is busy.

Keys are the block manager's chained block hashes (`chain_hash` over full blocks), so a key here
names the same tokens as a cached KV block in the replica's engine. A prompt shorter than one block
has no key and goes to the least-loaded replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from tailrace.engine.block_manager import chain_hash

R = TypeVar("R", bound=Hashable)  # a replica's id: Ray's ReplicaID, or a string in tests

DEFAULT_CAPACITY = 1 << 16  # keys (blocks) remembered; 64k blocks of 16 tokens = 1M prompt tokens
DEFAULT_MAX_IMBALANCE = 8  # queued requests more than the least-loaded replica that make a replica "busy"


def prefix_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hash of each full block of the prompt, first block first."""
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, tuple(token_ids[start:start + block_size]))
        keys.append(parent)
    return keys


class PrefixTable:
    """Which replica last took each prefix. A prompt's keys all move to the replica that takes it,
    since that replica is the one most likely to still hold its blocks. Past `capacity` keys the
    least recently used go first, as blocks do in an engine's cache."""

    def __init__(self, block_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._owner: OrderedDict[int, Hashable] = OrderedDict()
        self._held: dict[Hashable, int] = {}  # replica -> keys it owns

    def lookup(self, token_ids: Sequence[int]) -> Hashable | None:
        """The replica that took the longest known prefix of the prompt, or None."""
        owner = None
        for key in prefix_keys(token_ids, self.block_size):
            if key not in self._owner:
                break
            self._owner.move_to_end(key)
            owner = self._owner[key]
        return owner

    def record(self, token_ids: Sequence[int], replica: Hashable) -> None:
        for key in prefix_keys(token_ids, self.block_size):
            self._set_owner(key, replica)
        while len(self._owner) > self.capacity:
            _, evicted = self._owner.popitem(last=False)
            self._held[evicted] -= 1

    def held(self, replica: Hashable) -> int:
        """How many prefix blocks the replica owns: the tie-break that spreads new prefixes."""
        return self._held.get(replica, 0)

    def forget(self, replica: Hashable) -> None:
        """The replica is gone: its prefixes are nobody's."""
        for key in [k for k, owner in self._owner.items() if owner == replica]:
            del self._owner[key]
        self._held.pop(replica, None)

    def _set_owner(self, key: int, replica: Hashable) -> None:
        previous = self._owner.pop(key, None)
        if previous is not None:
            self._held[previous] -= 1
        self._owner[key] = replica
        self._held[replica] = self._held.get(replica, 0) + 1


def rank_replicas(preferred: R | None, loads: Mapping[R, int], held: Mapping[R, int],
                  max_imbalance: int) -> list[list[R]]:
    """Ray's ranks for one request: the replica holding its prefix alone first, unless its queue is
    longer than the least-loaded replica's by more than `max_imbalance`; then (and for a prefix
    nobody holds) the least-loaded replica, ties going to the one holding the fewest prefix blocks.
    Every other replica is the second rank, which Ray tries when the first refuses (a full queue)."""
    if not loads:
        return []
    least = min(loads, key=lambda r: (loads[r], held.get(r, 0)))
    first = preferred if preferred in loads and loads[preferred] - loads[least] <= max_imbalance else least
    rest = [r for r in loads if r != first]
    return [[first], rest] if rest else [[first]]
