"""KVCache: paged writes, the slot slab and causal attention over a flat batch; and the batch
invariance of attention, on the slab and in tailrace's paged CPU kernel."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tailrace.model.attention.kv_cache import AttentionBatch, KVCache, SeqSlice
from tailrace.model.attention.paged import PagedKVCache
from tailrace.model.cpu.kernels import kernels

# tailrace's paged CPU kernel, where it runs (AVX512 and a compiler)
PAGED_NATIVE = [pytest.param("paged", dtype, marks=pytest.mark.skipif(kernels() is None, reason="no tailrace CPU kernels"))
                for dtype in (torch.bfloat16, torch.float32)]
# The slab's bfloat16 matmuls are batch-invariant only where oneDNN runs them on AVX512-BF16 and
# has no AMX to switch to for some shapes (measured: a 270-row prefill cut at 135 differs on a Xeon
# with AMX, and matches with ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16; on an Ice Lake without either,
# two threads split a 514-long reduction differently for 27 rows than for 1,542). The engine takes
# the slab only where tailrace's kernels cannot run, which on such a CPU means a missing compiler.
SLAB_BF16 = pytest.param("slab", torch.bfloat16, marks=pytest.mark.skipif(
    not torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported(),
    reason="oneDNN's bfloat16 matmuls are batch-invariant only on AVX512-BF16 without AMX"))

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 2, 4, 2, 8, 4, 32


def make_cache(max_seqs: int = 8) -> KVCache:
    return KVCache(LAYERS, KV_HEADS, HEAD_DIM, NUM_BLOCKS, BLOCK_SIZE, torch.float32, max_seqs=max_seqs)


def sequential_tables(lengths: list[int]) -> list[list[int]]:
    """Give each sequence its own run of consecutive blocks."""
    tables, next_block = [], 0
    for length in lengths:
        count = -(-length // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + count)))
        next_block += count
    return tables


def make_batch(parts: list[tuple[int, int, int, list[int]]]) -> AttentionBatch:
    """parts: (key, past, q_len, block_table) per sequence, in row order."""
    seqs, slots, row = [], [], 0
    for key, past, q_len, table in parts:
        seqs.append(SeqSlice(key, row, q_len, past + q_len, table))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, past + q_len)]
        row += q_len
    return AttentionBatch(seqs, torch.tensor(slots, dtype=torch.int64))


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Rows q [L, H, D] are the last L positions of keys k/v [S, kvH, D]; causal, GQA by repeat."""
    past = k.shape[0] - q.shape[0]
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, keys) * HEAD_DIM**-0.5
    rows = torch.arange(past, k.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > rows, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), values)


def qkv(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, HEADS, HEAD_DIM, generator=g),
        torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(rows, KV_HEADS, HEAD_DIM, generator=g),
    )


def run_step(cache: KVCache, batch: AttentionBatch, q, k, v) -> list[torch.Tensor]:
    cache.begin(batch)
    return [cache.attend(layer, q, k, v, batch) for layer in range(LAYERS)]


def test_bytes_per_block_counts_k_and_v_for_every_layer():
    assert KVCache.bytes_per_block(3, 2, 8, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2


def test_attend_writes_new_kv_into_pages_at_slot_mapping():
    cache = make_cache()
    table = [5, 2]
    batch = make_batch([(0, 0, 6, table)])
    q, k, v = qkv(6, seed=0)
    run_step(cache, batch, q, k, v)
    slots = [5 * BLOCK_SIZE + i for i in range(4)] + [2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1]
    torch.testing.assert_close(cache.k[1][slots], k)
    torch.testing.assert_close(cache.v[0][slots], v)


def test_prefill_matches_causal_reference():
    cache = make_cache()
    q, k, v = qkv(9, seed=1)
    out = run_step(cache, make_batch([(0, 0, 9, [0, 1, 2])]), q, k, v)
    torch.testing.assert_close(out[0], reference(q, k, v))


def test_chunk_after_cached_tokens_uses_lower_right_causal_mask():
    cache = make_cache()
    table = [0, 1, 2]
    q, k, v = qkv(10, seed=2)
    run_step(cache, make_batch([(0, 0, 6, table)]), q[:6], k[:6], v[:6])
    out = run_step(cache, make_batch([(0, 6, 4, table)]), q[6:], k[6:], v[6:])
    torch.testing.assert_close(out[1], reference(q, k, v)[6:])


def test_decode_rows_of_several_sequences_match_reference():
    cache = make_cache()
    lengths = [3, 7, 5]
    tables = sequential_tables([n + 1 for n in lengths])
    data = [qkv(n + 1, seed=10 + i) for i, n in enumerate(lengths)]
    for key, (n, table, (q, k, v)) in enumerate(zip(lengths, tables, data)):
        run_step(cache, make_batch([(key, 0, n, table)]), q[:n], k[:n], v[:n])
    batch = make_batch([(key, n, 1, table) for key, (n, table) in enumerate(zip(lengths, tables))])
    q_rows, k_rows, v_rows = (torch.cat([d[i][-1:] for d in data]) for i in range(3))
    out = run_step(cache, batch, q_rows, k_rows, v_rows)[0]
    for row, (q, k, v) in enumerate(data):
        torch.testing.assert_close(out[row], reference(q, k, v)[-1])


def test_equal_length_decode_rows_in_slot_order_then_a_prefill_match_reference():
    # Row j decodes in slot j and every context is as long (no scatter, no mask), while a new
    # sequence prefills in the rows after them.
    cache = make_cache()
    tables = sequential_tables([6, 6, 5])
    data = [qkv(n, seed=60 + i) for i, n in enumerate([6, 6, 5])]
    for key in range(2):
        run_step(cache, make_batch([(key, 0, 5, tables[key])]), *(t[:5] for t in data[key]))
    parts = [(0, 5, 1, tables[0]), (1, 5, 1, tables[1]), (2, 0, 5, tables[2])]
    out = run_step(cache, make_batch(parts), *rows_of(data, [(5, 6), (5, 6), (0, 5)]))
    expected = torch.cat([reference(*data[0])[-1:], reference(*data[1])[-1:], reference(*data[2])])
    for layer in range(LAYERS):
        torch.testing.assert_close(out[layer], expected)
    decode_only = make_batch([(0, 6, 1, tables[0] + [10]), (1, 6, 1, tables[1] + [11])])
    extra = [qkv(7, seed=70 + key) for key in range(2)]
    for key in range(2):  # the 7th token of each: the first 6 are the ones already cached
        for part, more in zip(data[key], extra[key]):
            more[:6] = part
    out = run_step(cache, decode_only, *rows_of(extra, [(6, 7), (6, 7)]))[0]
    torch.testing.assert_close(out, torch.cat([reference(*e)[-1:] for e in extra]))


def test_new_sequence_reads_shared_prefix_from_pages():
    cache = make_cache()
    q, k, v = qkv(11, seed=3)
    run_step(cache, make_batch([(0, 0, 8, [0, 1])]), q[:8], k[:8], v[:8])
    out = run_step(cache, make_batch([(1, 8, 3, [0, 1, 2])]), q[8:], k[8:], v[8:])
    torch.testing.assert_close(out[0], reference(q, k, v)[8:])


def test_released_sequence_is_rebuilt_from_pages():
    cache = make_cache()
    table = [3, 4]
    q, k, v = qkv(7, seed=4)
    run_step(cache, make_batch([(0, 0, 6, table)]), q[:6], k[:6], v[:6])
    cache.release(0)
    out = run_step(cache, make_batch([(0, 6, 1, table)]), q[6:], k[6:], v[6:])
    torch.testing.assert_close(out[0], reference(q, k, v)[6:])


def rows_of(data: list[tuple[torch.Tensor, ...]], spans: list[tuple[int, int]]) -> list[torch.Tensor]:
    """q, k, v rows [start, end) of each sequence's data, concatenated in batch order."""
    return [torch.cat([d[i][start:end] for d, (start, end) in zip(data, spans)]) for i in range(3)]


def test_decode_rows_in_another_order_than_their_slots_match_reference():
    cache = make_cache()
    lengths = [9, 2, 6, 4]
    tables = sequential_tables([n + 1 for n in lengths])
    data = [qkv(n + 1, seed=20 + i) for i, n in enumerate(lengths)]
    for key, (n, table, (q, k, v)) in enumerate(zip(lengths, tables, data)):
        run_step(cache, make_batch([(key, 0, n, table)]), q[:n], k[:n], v[:n])
    order = [2, 0, 3, 1]
    batch = make_batch([(key, lengths[key], 1, tables[key]) for key in order])
    q, k, v = rows_of([data[key] for key in order], [(lengths[key], lengths[key] + 1) for key in order])
    out = run_step(cache, batch, q, k, v)
    for row, key in enumerate(order):
        for layer in range(LAYERS):
            torch.testing.assert_close(out[layer][row], reference(*data[key])[-1])


def test_reused_slot_does_not_leak_the_released_sequence():
    cache = make_cache(max_seqs=2)
    old_q, old_k, old_v = qkv(14, seed=30)
    run_step(cache, make_batch([(0, 0, 14, [0, 1, 2, 3])]), old_q, old_k, old_v)
    q, k, v = qkv(5, seed=31)
    run_step(cache, make_batch([(1, 0, 4, [5])]), q[:4], k[:4], v[:4])
    cache.release(0)
    # Key 2 takes the freed slot 0 with a shorter context, read from key 1's pages (a prefix hit).
    out = run_step(cache, make_batch([(2, 4, 1, [5, 6])]), q[4:], k[4:], v[4:])
    torch.testing.assert_close(out[0], reference(q, k, v)[4:])


def test_capacity_growth_within_a_step_keeps_earlier_tokens():
    cache = make_cache()
    capacity = cache.capacity
    short = qkv(capacity, seed=40)
    long = qkv(capacity + 5, seed=41)
    tables = sequential_tables([capacity, capacity + 5])
    run_step(cache, make_batch([(0, 0, capacity - 1, tables[0])]), *(t[:-1] for t in short))
    batch = make_batch([(0, capacity - 1, 1, tables[0]), (1, 0, capacity + 5, tables[1])])
    q, k, v = rows_of([short, long], [(capacity - 1, capacity), (0, capacity + 5)])
    out = run_step(cache, batch, q, k, v)
    assert cache.capacity > capacity
    torch.testing.assert_close(out[1][0], reference(*short)[-1])
    torch.testing.assert_close(out[1][1:], reference(*long))


def test_capacity_shrinks_once_the_long_sequence_is_gone_and_keeps_the_held_tokens():
    cache = make_cache()
    short, long = qkv(8, seed=42), qkv(100, seed=43)
    tables = sequential_tables([8, 100])
    run_step(cache, make_batch([(0, 0, 6, tables[0]), (1, 0, 100, tables[1])]), *rows_of([short, long], [(0, 6), (0, 100)]))
    assert cache.capacity == 128
    cache.release(1)
    out = run_step(cache, make_batch([(0, 6, 1, tables[0])]), *(t[6:7] for t in short))
    assert cache.capacity == 64
    torch.testing.assert_close(out[1][0], reference(*(t[:7] for t in short))[-1])


def test_prefilling_slots_between_decoding_slots_are_not_disturbed():
    cache = make_cache()
    tables = sequential_tables([6, 12, 5, 8])
    data = [qkv(n, seed=50 + i) for i, n in enumerate([6, 12, 5, 8])]
    run_step(cache, make_batch([(0, 0, 5, tables[0])]), *(t[:5] for t in data[0]))
    run_step(cache, make_batch([(1, 0, 7, tables[1])]), *(t[:7] for t in data[1]))
    run_step(cache, make_batch([(2, 0, 4, tables[2])]), *(t[:4] for t in data[2]))
    # Slot 1 continues its prefill and slot 3 starts one while slots 0 and 2 decode.
    parts = [(0, 5, 1, tables[0]), (1, 7, 5, tables[1]), (2, 4, 1, tables[2]), (3, 0, 8, tables[3])]
    spans = [(past, past + q_len) for _, past, q_len, _ in parts]
    out = run_step(cache, make_batch(parts), *rows_of(data, spans))[1]
    expected = [reference(*d)[start:] for d, (start, _) in zip(data, spans)]
    torch.testing.assert_close(out, torch.cat(expected))


def test_slab_holds_the_slots_in_use_not_max_seqs_and_keeps_their_tokens():
    cache = make_cache(max_seqs=8)
    tables = sequential_tables([5, 5, 5])
    data = [qkv(5, seed=60 + i) for i in range(3)]
    run_step(cache, make_batch([(0, 0, 4, tables[0])]), *(t[:4] for t in data[0]))
    assert cache.slab_k.shape[1] == 1
    # Two more sequences arrive while the first decodes: the slab grows to 4 slots, not 8.
    parts = [(0, 4, 1, tables[0]), (1, 0, 5, tables[1]), (2, 0, 5, tables[2])]
    out = run_step(cache, make_batch(parts), *rows_of(data, [(4, 5), (0, 5), (0, 5)]))[1]
    assert cache.slab_k.shape[1] == 4
    torch.testing.assert_close(out, torch.cat([reference(*data[0])[4:], reference(*data[1]), reference(*data[2])]))


def test_more_running_sequences_than_max_seqs_raises():
    cache = make_cache(max_seqs=2)
    with pytest.raises(RuntimeError, match="max_seqs"):
        cache.begin(make_batch([(key, 0, 1, [key]) for key in range(3)]))


def test_attend_without_begin_raises():
    cache = make_cache()
    q, k, v = qkv(2, seed=7)
    with pytest.raises(RuntimeError, match="begin"):
        cache.attend(0, q, k, v, make_batch([(0, 0, 2, [0])]))


@settings(max_examples=30, deadline=None)
@given(
    length=st.integers(2, 600),
    split=st.floats(0.05, 0.95),
    neighbours=st.lists(st.integers(1, 700), min_size=1, max_size=3),
    threads=st.sampled_from([1, 2]),
)
@pytest.mark.parametrize("layout, dtype", [SLAB_BF16, *PAGED_NATIVE])
def test_a_rows_attention_is_bitwise_the_same_however_it_is_batched(layout, dtype, length, split, neighbours, threads):
    """A position's output may depend on its own query and keys only: not on whether it is
    computed in one prefill, in a chunk after cached tokens, by a decode step, next to neighbours
    whose longer contexts pad the batch, or at another thread count. At bfloat16 on CPU any
    difference rounds visibly, which is what made bfloat16 change seeded draws. The slab holds
    it at bfloat16 (batch-invariant matmuls); tailrace's paged kernel at both dtypes."""
    heads, kv_heads, head_dim, block = 9, 3, 64, 16  # SmolLM2-135M's attention
    g = torch.Generator().manual_seed(length)

    def tensors(rows: int) -> tuple[torch.Tensor, ...]:
        return tuple(torch.randn(rows, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads))

    def step(cache: KVCache, parts: list[tuple[int, int, int]], data: dict[int, tuple]) -> torch.Tensor:
        """parts: (key, past, q_len); each key owns blocks [key * 64, key * 64 + 64)."""
        seqs, slots, rows, row = [], [], [], 0
        for key, past, q_len in parts:
            table = list(range(key * 64, key * 64 + 64))
            seqs.append(SeqSlice(key, row, q_len, past + q_len, table))
            slots += [table[p // block] * block + p % block for p in range(past, past + q_len)]
            rows.append(tuple(t[past : past + q_len] for t in data[key]))
            row += q_len
        batch = AttentionBatch(seqs, torch.tensor(slots))
        q, k, v = (torch.cat(parts_) for parts_ in zip(*rows))
        cache.begin(batch)
        return cache.attend(0, q, k, v, batch)

    def new_cache() -> KVCache:
        if layout == "slab":
            return KVCache(1, kv_heads, head_dim, 64 * 4, block, dtype, max_seqs=4)
        return PagedKVCache(1, kv_heads, head_dim, 64 * 4, block, dtype, max_seqs=4, kernel="tailrace")

    data = {0: tensors(length)} | {i + 1: tensors(n) for i, n in enumerate(neighbours)}
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = step(new_cache(), [(0, 0, length)], data)
        torch.set_num_threads(threads)
        cut = max(1, min(length - 1, int(length * split)))
        chunked = new_cache()
        step(chunked, [(0, 0, cut)], data)
        assert torch.equal(step(chunked, [(0, cut, length - cut)], data), whole[cut:])
        decoded = new_cache()
        step(decoded, [(0, 0, length - 1)], data)
        assert torch.equal(step(decoded, [(0, length - 1, 1)], data), whole[-1:])
        batched = new_cache()
        step(batched, [(0, 0, length - 1)] + [(key, 0, n - 1) for key, n in enumerate(neighbours, 1) if n > 1], data)
        decode_all = [(0, length - 1, 1)] + [(key, n - 1, 1) for key, n in enumerate(neighbours, 1) if n > 1]
        assert torch.equal(step(batched, decode_all, data)[:1], whole[-1:])
    finally:
        torch.set_num_threads(previous)
