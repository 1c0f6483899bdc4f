"""The prefix-aware routing policy (tailrace.ray.prefix): no Ray needed, so it runs in bin/test."""

from __future__ import annotations

from tailrace.engine.block_manager import chain_hash
from tailrace.ray.prefix import PrefixTable, prefix_keys, rank_replicas

SYSTEM = list(range(100, 148))  # three blocks of 16


def test_prefix_keys_are_the_block_managers_chained_hashes_of_full_blocks() -> None:
    tokens = list(range(40))
    first = chain_hash(None, tuple(range(16)))
    assert prefix_keys(tokens, 16) == [first, chain_hash(first, tuple(range(16, 32)))]


def test_a_prompt_shorter_than_a_block_has_no_owner() -> None:
    table = PrefixTable(block_size=16)
    table.record(list(range(10)), "a")
    assert table.lookup(list(range(10))) is None


def test_a_prompt_sharing_a_recorded_prefix_finds_its_replica() -> None:
    table = PrefixTable(block_size=16)
    table.record(SYSTEM + [1, 2, 3], "a")
    assert table.lookup(SYSTEM + [9, 9, 9, 9]) == "a"
    assert table.lookup([7] + SYSTEM) is None


def test_the_longest_known_prefix_decides() -> None:
    table = PrefixTable(block_size=16)
    table.record(SYSTEM[:16], "a")
    table.record(SYSTEM, "b")  # b took the longer prompt last: every block of it is b's now
    assert table.lookup(SYSTEM + [1]) == "b"
    table.record(SYSTEM[:16] + list(range(500, 516)), "a")  # the first block is a's again...
    assert table.lookup(SYSTEM) == "b"  # ...but b's chain matches further


def test_least_recently_used_keys_go_first_past_capacity() -> None:
    table = PrefixTable(block_size=16, capacity=3)
    table.record(SYSTEM, "a")
    table.record(list(range(16)), "b")
    assert table.lookup(SYSTEM) is None  # its first block was the oldest key
    assert table.lookup(list(range(16))) == "b"
    assert table.held("a") == 2 and table.held("b") == 1


def test_a_forgotten_replica_owns_nothing() -> None:
    table = PrefixTable(block_size=16)
    table.record(SYSTEM, "a")
    table.forget("a")
    assert table.lookup(SYSTEM) is None and table.held("a") == 0


def test_the_prefix_owner_goes_first_and_the_others_are_the_fallback() -> None:
    assert rank_replicas("b", {"a": 0, "b": 3, "c": 1}, {}, max_imbalance=8) == [["b"], ["a", "c"]]


def test_a_busy_owner_gives_way_to_the_least_loaded_replica() -> None:
    assert rank_replicas("b", {"a": 2, "b": 11, "c": 1}, {}, max_imbalance=8) == [["c"], ["a", "b"]]


def test_a_new_prefix_goes_to_the_least_loaded_replica_holding_the_fewest_blocks() -> None:
    assert rank_replicas(None, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 0, "c": 2}, max_imbalance=8)[0] == ["b"]


def test_a_departed_owner_is_not_chosen() -> None:
    assert rank_replicas("gone", {"a": 0}, {}, max_imbalance=8) == [["a"]]


def test_no_replicas_no_ranks() -> None:
    assert rank_replicas(None, {}, {}, max_imbalance=8) == []
