from tailrace.engine.block_manager import BlockManager
from tailrace.engine.sequence import Sequence
from tailrace.sampling_params import SamplingParams


def make_seq(tokens: list[int], seq_id: int = 0, **params: object) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", 0, tokens, SamplingParams(**params), max_tokens=16)


def computed(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model computed every known token of `seq`."""
    assert bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.register_full_blocks(seq)


def test_allocate_takes_ceil_of_tokens_over_block_size():
    bm = BlockManager(num_blocks=10, block_size=4)
    seq = make_seq(list(range(9)))
    assert bm.allocate(seq, 9)
    assert len(seq.block_table) == 3
    assert bm.num_free_blocks == 7


def test_allocate_fails_without_change_when_short():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq(list(range(12)))
    assert not bm.allocate(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_every_change_of_a_block_table_bumps_its_version_and_nothing_else_does():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(list(range(10)))
    computed(bm, first)
    versions = [first.table_version]
    assert bm.allocate(first, 10)  # no new block needed: no change
    versions.append(first.table_version)
    assert bm.allocate(first, 13)
    versions.append(first.table_version)
    bm.release(first)
    versions.append(first.table_version)
    assert versions[0] > 0 and versions[1] == versions[0] and versions[3] > versions[2] > versions[1]
    again = make_seq(list(range(10)), seq_id=1)
    bm.match_prefix(again)  # the released prefix, taken from the cache
    assert again.block_table and again.table_version > 0


def test_release_returns_every_block():
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq(list(range(10)))
    computed(bm, seq)
    bm.release(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_same_prefix_reuses_full_blocks_and_reports_cached_tokens():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(10)), seq_id=0)
    computed(bm, first)
    second = make_seq(list(range(10)) + [99, 98], seq_id=1)
    bm.match_prefix(second)
    assert second.num_cached_tokens == 8
    assert second.block_table == first.block_table[:2]
    assert bm.blocks[first.block_table[0]].ref_count == 2


def test_prefix_survives_release_until_block_is_reused():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(8)) + [7], seq_id=0)
    computed(bm, first)
    bm.release(first)
    again = make_seq(list(range(8)) + [5], seq_id=1)
    bm.match_prefix(again)
    assert again.num_cached_tokens == 8
    assert bm.num_free_blocks == 14


def test_whole_cached_prompt_still_leaves_a_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq(list(range(8)), seq_id=0)
    computed(bm, first)
    again = make_seq(list(range(8)), seq_id=1)
    bm.match_prefix(again)
    assert again.num_cached_tokens == 4


def test_different_prefix_is_not_reused():
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9], seq_id=0))
    other = make_seq([1, 2, 3, 0, 5, 6, 7, 8, 9], seq_id=1)
    bm.match_prefix(other)
    assert other.num_cached_tokens == 0 and other.block_table == []


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    bm = BlockManager(num_blocks=16, block_size=4)
    computed(bm, make_seq(list(range(9)), seq_id=0))
    wants = make_seq(list(range(9)), seq_id=1, prompt_logprobs=0)
    bm.match_prefix(wants)
    assert wants.num_cached_tokens == 0


def test_reused_free_block_loses_its_hash():
    bm = BlockManager(num_blocks=2, block_size=4)
    first = make_seq([1, 2, 3, 4, 5], seq_id=0)
    computed(bm, first)
    bm.release(first)
    filler = make_seq([9] * 8, seq_id=1)
    assert bm.allocate(filler, 8)
    bm.release(filler)
    again = make_seq([1, 2, 3, 4, 5], seq_id=2)
    bm.match_prefix(again)
    assert again.num_cached_tokens == 0


def test_disabled_prefix_caching_never_matches():
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    computed(bm, make_seq(list(range(9)), seq_id=0))
    again = make_seq(list(range(9)), seq_id=1)
    bm.match_prefix(again)
    assert again.num_cached_tokens == 0


def test_with_states_a_cached_prefix_ends_at_the_last_block_whose_state_is_kept():
    kept: set[int] = set()
    bm = BlockManager(num_blocks=16, block_size=4, state_kept=kept.__contains__)
    first = make_seq(list(range(14)))
    # a chunk of 10 tokens from position 0 reaches boundaries 4 and 8: the state at 8 is the one kept
    boundary, block_hash = bm.state_boundary(first, 10)
    assert boundary == 8
    computed(bm, first)
    assert block_hash == first.block_hashes[1]
    assert bm.state_boundary(first, 1) is None  # 14 -> 15 reaches no boundary
    kept.add(block_hash)
    second = make_seq(list(range(14)) + [99], seq_id=1)
    bm.match_prefix(second)  # blocks 0-2 are cached, but only block 1's end state is kept
    assert second.num_computed_tokens == 8 and second.state_key == block_hash
    third = make_seq(list(range(14)), seq_id=2)
    kept.clear()
    bm.match_prefix(third)
    assert third.num_computed_tokens == 0 and third.state_key is None
