"""Paged attention: the PyTorch reference, tailrace's CPU kernel, PagedKVCache against KVCache,
and the Triton kernel."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tailrace.model.attention import triton_paged as triton_attention
from tailrace.model.attention.kv_cache import (AttentionBatch, KVCache, LayerAttention, PagedAttentionMetadata,
                                               SeqSlice, new_pages)
from tailrace.model.attention.paged import PagedKVCache, paged_attention_reference
from tailrace.model.cpu.kernels import kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_HEADS, HEAD_DIM = 2, 32
SCALE = HEAD_DIM**-0.5
PLAIN = LayerAttention(SCALE)
# Sliding windows narrower and wider than a run of 16 positions, not aligned to one, another
# scale, and a soft cap that bites (the scores are about 1 apart).
WINDOWED = [LayerAttention(SCALE, window=5), LayerAttention(0.3, window=21, softcap=1.5),
            LayerAttention(SCALE, softcap=0.8), LayerAttention(SCALE, window=1)]

# (past, q_len) per sequence: decode rows, prefills from zero, chunks after cached tokens that
# cross block boundaries, contexts over one kernel tile of keys, and a padding slot (no rows, no
# K/V) in the middle and at the end.
MIXED = [(13, 1), (0, 21), (0, 0), (37, 6), (50, 1), (0, 1), (5, 9), (100, 3), (130, 1), (0, 0)]
NUM_BLOCKS = 40


def make_meta(specs: list[tuple[int, int]], block_size: int, num_blocks: int, seed: int) -> PagedAttentionMetadata:
    """Each sequence gets blocks drawn at random, so no table is in physical order."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(num_blocks, generator=g).tolist()
    counts = [-(-(past + q_len) // block_size) for past, q_len in specs]
    tables = torch.zeros(len(specs), max(counts), dtype=torch.int32)
    for row, count in enumerate(counts):
        tables[row, :count] = torch.tensor([free.pop() for _ in range(count)])
    q_lens = torch.tensor([q_len for _, q_len in specs])
    loc = torch.zeros(len(specs) + 1, dtype=torch.int32)
    loc[1:] = q_lens.cumsum(0)
    seq_lens = torch.tensor([past + q_len for past, q_len in specs], dtype=torch.int32)
    return PagedAttentionMetadata(loc, seq_lens, tables, block_size, int(q_lens.max()), len(specs))


def random_inputs(specs: list[tuple[int, int]], group: int, num_rows: int, seed: int,
                  head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, ...]:
    """q for every new token, and pages of num_rows random K/V rows."""
    g = torch.Generator().manual_seed(seed)
    num_tokens = sum(q_len for _, q_len in specs)
    q = torch.randn(num_tokens, KV_HEADS * group, head_dim, generator=g)
    k_pages = torch.randn(num_rows, KV_HEADS, head_dim, generator=g)
    v_pages = torch.randn(num_rows, KV_HEADS, head_dim, generator=g)
    return q, k_pages, v_pages


def naive_attention(q, k_pages, v_pages, specs, meta, how: LayerAttention = PLAIN, sinks=None) -> torch.Tensor:
    """Row by row, each query's softmax over exactly the keys it may see (its last how.window
    positions where set), and each head's sink where given: no mask, no SDPA."""
    group, bs = q.shape[1] // k_pages.shape[1], meta.block_size
    out, row = torch.zeros_like(q), 0
    for seq, (past, q_len) in enumerate(specs):
        table = meta.block_tables[seq].tolist()
        rows = [table[p // bs] * bs + p % bs for p in range(past + q_len)]
        keys, values = k_pages[rows].repeat_interleave(group, 1), v_pages[rows].repeat_interleave(group, 1)
        for seen in range(past + 1, past + q_len + 1):
            first = 0 if how.window is None else max(0, seen - how.window)
            scores = torch.einsum("hd,shd->hs", q[row], keys[first:seen]) * how.scale
            if how.softcap is not None:
                scores = (scores / how.softcap).tanh() * how.softcap
            weights = scores.softmax(-1) if sinks is None else torch.cat((scores, sinks[:, None]), 1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hs,shd->hd", weights, values[first:seen])
            row += 1
    return out


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4])
def test_reference_matches_naive_attention_on_a_mixed_batch(group, block_size):
    meta = make_meta(MIXED, block_size, NUM_BLOCKS, seed=group)
    q, k_pages, v_pages = random_inputs(MIXED, group, NUM_BLOCKS * block_size, seed=block_size)
    out = paged_attention_reference(q, k_pages, v_pages, meta, PLAIN)
    torch.testing.assert_close(out, naive_attention(q, k_pages, v_pages, MIXED, meta))


@pytest.mark.parametrize("how", WINDOWED)
def test_reference_takes_windows_scales_and_soft_caps(how):
    meta = make_meta(MIXED, 16, NUM_BLOCKS, seed=3)
    q, k_pages, v_pages = random_inputs(MIXED, 2, NUM_BLOCKS * 16, seed=4)
    out = paged_attention_reference(q, k_pages, v_pages, meta, how)
    torch.testing.assert_close(out, naive_attention(q, k_pages, v_pages, MIXED, meta, how))
    assert not torch.allclose(out, naive_attention(q, k_pages, v_pages, MIXED, meta))


needs_kernels = pytest.mark.skipif(kernels() is None, reason="tailrace's CPU kernels do not run here")


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 3, 4, 11])  # 11: a group of 8 query heads, then one of 3
def test_cpu_kernel_matches_naive_attention_on_a_mixed_batch(group, block_size, dtype, tolerance):
    """Block sizes that hold whole runs of 16 positions and one that does not (a table look-up per
    position); padding sequences with no rows; rows past every sequence stay zero."""
    blocks = NUM_BLOCKS * 32 // block_size
    meta = make_meta(MIXED, block_size, blocks, seed=group)
    q, k_pages, v_pages = random_inputs(MIXED, group, blocks * block_size, seed=block_size)
    extra = torch.randn(3, *q.shape[1:])
    out = kernels().paged_attention(torch.cat([q, extra]).to(dtype), k_pages.to(dtype), v_pages.to(dtype),
                                    meta.query_start_loc, meta.seq_lens, meta.block_tables, block_size,
                                    meta.num_seqs, SCALE)
    expected = naive_attention(q, k_pages.to(dtype).float(), v_pages.to(dtype).float(), MIXED, meta)
    torch.testing.assert_close(out[: q.shape[0]].float(), expected, atol=tolerance, rtol=tolerance)
    assert not out[q.shape[0]:].any()


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("head_dim", [256, 512])  # Gemma's widest: 512 past the worked-out path's arrays
def test_cpu_kernel_takes_the_widest_heads(head_dim, dtype, tolerance):
    meta = make_meta(MIXED, 16, NUM_BLOCKS * 2, seed=head_dim)
    q, k_pages, v_pages = random_inputs(MIXED, 3, NUM_BLOCKS * 32, seed=head_dim, head_dim=head_dim)
    how = LayerAttention(1.0 / head_dim, window=21)
    out = kernels().paged_attention(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), meta.query_start_loc,
                                    meta.seq_lens, meta.block_tables, 16, meta.num_seqs, how.scale, how.window)
    expected = naive_attention(q.to(dtype).float(), k_pages.to(dtype).float(), v_pages.to(dtype).float(), MIXED,
                               meta, how)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("how", WINDOWED)
def test_cpu_kernel_takes_windows_scales_and_soft_caps(how, block_size, dtype, tolerance):
    """A window's first position anywhere in a run of 16 (the runs before it skipped, the positions
    before it in its run masked out)."""
    blocks = NUM_BLOCKS * 32 // block_size
    meta = make_meta(MIXED, block_size, blocks, seed=5)
    q, k_pages, v_pages = random_inputs(MIXED, 3, blocks * block_size, seed=6)
    out = kernels().paged_attention(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), meta.query_start_loc,
                                    meta.seq_lens, meta.block_tables, block_size, meta.num_seqs, how.scale,
                                    how.window or 0, how.softcap or 0.0)
    expected = naive_attention(q.to(dtype).float(), k_pages.to(dtype).float(), v_pages.to(dtype).float(), MIXED, meta,
                               how)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_kernels
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("how", [PLAIN, WINDOWED[0]])
def test_cpu_kernel_takes_attention_sinks(how, dtype, tolerance):
    """A sink joins each head's softmax (gpt-oss): large ones take most of the weight, small ones
    almost none, and the reference over the pages agrees."""
    meta = make_meta(MIXED, 16, NUM_BLOCKS, seed=7)
    q, k_pages, v_pages = random_inputs(MIXED, 3, NUM_BLOCKS * 16, seed=8)
    sinks = torch.tensor([3.0, -2.0, 0.5, 8.0, -30.0, 1.0]).to(dtype)
    out = kernels().paged_attention(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), meta.query_start_loc,
                                    meta.seq_lens, meta.block_tables, 16, meta.num_seqs, how.scale, how.window or 0,
                                    0.0, sinks)
    args = (q.to(dtype).float(), k_pages.to(dtype).float(), v_pages.to(dtype).float(), MIXED, meta, how)
    expected = naive_attention(*args, sinks=sinks.float())
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    assert not torch.allclose(expected, naive_attention(*args), atol=0.1)
    reference = paged_attention_reference(q.to(dtype), k_pages.to(dtype), v_pages.to(dtype), meta, how, sinks)
    torch.testing.assert_close(out.float(), reference.float(), atol=tolerance, rtol=tolerance)
    with pytest.raises(RuntimeError, match="sinks"):
        kernels().paged_attention(q, k_pages, v_pages, meta.query_start_loc, meta.seq_lens, meta.block_tables, 16,
                                  meta.num_seqs, SCALE, 0, 0.0, torch.zeros(5))


@needs_kernels
@pytest.mark.parametrize("head_dim", [48, 64, 128])  # 48: a last chunk of 16 elements, not 32
def test_bfloat16_scores_from_two_fmas_a_pair_are_the_dot_instructions(tmp_path, head_dim):
    """TAILRACE_CPU_BF16_DOT=0 takes the path of CPUs without AVX512-BF16 (in a child process, the
    choice being process-wide): bit for bit what this process computes, vdpbf16ps where the CPU
    has it, and both the naive attention's within bfloat16's rounding."""
    meta = make_meta(MIXED, 16, NUM_BLOCKS, seed=head_dim)
    g = torch.Generator().manual_seed(head_dim)
    rows = sum(q_len for _, q_len in MIXED)
    q = torch.randn(rows, 3 * KV_HEADS, head_dim, generator=g).bfloat16()
    k_pages, v_pages = torch.randn(2, NUM_BLOCKS * 16, KV_HEADS, head_dim, generator=g).bfloat16()
    args = (q, k_pages, v_pages, meta.query_start_loc, meta.seq_lens, meta.block_tables, 16, meta.num_seqs, SCALE)
    torch.save(args, tmp_path / "in.pt")
    child = ("import sys, torch; from tailrace.model.cpu.kernels import kernels; "
             "torch.save(kernels().paged_attention(*torch.load(sys.argv[1])), sys.argv[2])")
    subprocess.run([sys.executable, "-c", child, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                   env={**os.environ, "TAILRACE_CPU_BF16_DOT": "0"}, check=True)
    out = kernels().paged_attention(*args)
    assert torch.equal(torch.load(tmp_path / "out.pt"), out)
    expected = naive_attention(q.float(), k_pages.float(), v_pages.float(), MIXED, meta)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pages_hold_each_kv_heads_rows_together_and_the_kernel_reads_any_strides(dtype):
    """new_pages on the CPU: [layers, slots, kv heads, D] over storage with each KV head's rows
    together; the kernel gives the bits of the interleaved layout on either, through the strides."""
    k_pages, v_pages = new_pages(2, NUM_BLOCKS * 16, KV_HEADS, HEAD_DIM, dtype, torch.device("cpu"))
    assert k_pages.shape == (2, NUM_BLOCKS * 16, KV_HEADS, HEAD_DIM) and v_pages.stride() == k_pages.stride()
    assert k_pages.stride()[1:] == (HEAD_DIM, NUM_BLOCKS * 16 * HEAD_DIM, 1)
    meta = make_meta(MIXED, 16, NUM_BLOCKS, seed=5)
    q, k_rows, v_rows = random_inputs(MIXED, 3, NUM_BLOCKS * 16, seed=5)
    k_pages[1].copy_(k_rows)
    v_pages[1].copy_(v_rows)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, 16, meta.num_seqs, SCALE)
    apart = kernels().paged_attention(q.to(dtype), k_pages[1], v_pages[1], *args)
    together = kernels().paged_attention(q.to(dtype), k_rows.to(dtype), v_rows.to(dtype), *args)
    assert torch.equal(apart, together)
    with pytest.raises(RuntimeError, match="K and V alike"):
        kernels().paged_attention(q.to(dtype), k_pages[1], v_rows.to(dtype), *args)


@needs_kernels
def test_cpu_kernel_refuses_what_it_cannot_compute():
    meta = make_meta([(0, 2)], 16, 4, seed=0)
    q, k_pages, v_pages = random_inputs([(0, 2)], 1, 64, seed=0)
    args = (meta.query_start_loc, meta.seq_lens, meta.block_tables, 16, 1, SCALE)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels().paged_attention(q[..., :24], k_pages[..., :24].contiguous(), v_pages[..., :24].contiguous(), *args)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels().paged_attention(q.bfloat16(), k_pages, v_pages, *args)
    with pytest.raises(RuntimeError, match="bad query_start_loc"):
        kernels().paged_attention(q[:1], k_pages, v_pages, *args)


# PagedKVCache against KVCache: the same AttentionBatch objects through both, step by step.

LAYERS, BLOCK_SIZE = 2, 16
TABLES = {0: [3, 7], 1: [0, 5], 2: [7, 3]}  # key 2 reuses key 0's blocks once key 0 is released


CACHE_ARGS = (LAYERS, KV_HEADS, HEAD_DIM, 16, BLOCK_SIZE, torch.float32)
CPU_KERNEL = "pytorch" if kernels() is None else "tailrace"  # what model/backends.py chooses here


def make_batch(parts: list[tuple[int, int, int]], device: torch.device | str = "cpu") -> AttentionBatch:
    """parts: (key, past, q_len) per sequence, in row order."""
    seqs, slots, row = [], [], 0
    for key, past, q_len in parts:
        table = TABLES[key]
        seqs.append(SeqSlice(key, row, q_len, past + q_len, table))
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(past, past + q_len)]
        row += q_len
    return AttentionBatch(seqs, torch.tensor(slots, dtype=torch.int64, device=device))


def assert_same_step(expected_cache, actual_cache, parts: list[tuple[int, int, int]], seed: int) -> None:
    device = actual_cache.device
    batch = make_batch(parts, device)
    num_tokens = sum(q_len for _, _, q_len in parts)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, 2 * KV_HEADS, HEAD_DIM, generator=g).to(device)
    k, v = torch.randn(2, num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(device)
    expected_cache.begin(batch)
    actual_cache.begin(batch)
    for layer in range(LAYERS):
        expected = expected_cache.attend(layer, q * (layer + 1), k, v, batch)
        actual = actual_cache.attend(layer, q * (layer + 1), k, v, batch)
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def run_against_kv_cache(paged: PagedKVCache) -> None:
    """A prefill, a chunked prefill beside decodes, decodes, a release and a sequence reusing blocks."""
    kv = KVCache(*CACHE_ARGS, device=paged.device, max_seqs=4)
    before_release = [
        [(0, 0, 20)],
        [(0, 20, 1), (1, 0, 12)],
        [(0, 21, 1), (1, 12, 10)],
        *([(0, 22 + i, 1), (1, 22 + i, 1)] for i in range(3)),
    ]
    after_release = [[(1, 25, 1), (2, 0, 18)], *([(1, 26 + i, 1), (2, 18 + i, 1)] for i in range(2))]
    for seed, parts in enumerate(before_release):
        assert_same_step(kv, paged, parts, seed)
    kv.release(0)
    paged.release(0)
    for seed, parts in enumerate(after_release, start=len(before_release)):
        assert_same_step(kv, paged, parts, seed)
    torch.testing.assert_close(paged.k, kv.k)
    torch.testing.assert_close(paged.v, kv.v)


def test_paged_cache_matches_kv_cache_step_by_step():
    """On CPU through tailrace's kernel where it runs, else the PyTorch reference."""
    run_against_kv_cache(PagedKVCache(*CACHE_ARGS, max_seqs=4, kernel=CPU_KERNEL))


@needs_kernels
def test_the_cpu_kernel_runs_what_it_takes_and_refuses_the_rest_by_name():
    assert PagedKVCache(*CACHE_ARGS, kernel="tailrace")._native_attention is not None
    with pytest.raises(ValueError, match="does not run torch.float16 with head_dim 32"):
        PagedKVCache(LAYERS, KV_HEADS, HEAD_DIM, 16, BLOCK_SIZE, torch.float16, kernel="tailrace")
    with pytest.raises(ValueError, match="head_dim 40"):
        PagedKVCache(LAYERS, KV_HEADS, 40, 16, BLOCK_SIZE, torch.float32, kernel="tailrace")
    with pytest.raises(ValueError, match="unknown attention kernel 'flash'"):
        PagedKVCache(*CACHE_ARGS, kernel="flash")


def test_paged_cache_on_the_reference_path_matches_kv_cache():
    cache = PagedKVCache(*CACHE_ARGS, max_seqs=4, kernel="pytorch")
    assert cache._native_attention is None
    run_against_kv_cache(cache)


def test_a_cpu_cache_never_imports_triton():
    """Triton alone is 52 MB of a CPU engine's RSS; only a CUDA cache may import it."""
    code = ("import sys, torch; from tailrace.model.attention.paged import PagedKVCache; "
            "PagedKVCache(2, 2, 32, 4, 16, torch.float32, 'cpu'); print('triton' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


@pytest.mark.parametrize("kernel", sorted({"pytorch", CPU_KERNEL}))
def test_layers_of_their_own_shapes_and_a_layer_reading_anothers_kv(kernel):
    """Gemma 4's: each layer its own pages (layer 1's heads twice as wide, one KV head), and a
    query that attends over a layer's K/V (k and v None) without storing any: what it gets is what
    that layer's own query would."""
    cache = PagedKVCache(2, KV_HEADS, HEAD_DIM, 16, BLOCK_SIZE, torch.float32, max_seqs=2, kernel=kernel,
                         layer_shapes=[(KV_HEADS, HEAD_DIM), (1, 2 * HEAD_DIM)])
    assert [tuple(k.shape) for k in cache.k] == [(256, KV_HEADS, HEAD_DIM), (256, 1, 2 * HEAD_DIM)]
    batch = make_batch([(0, 0, 5), (1, 0, 3)])
    cache.begin(batch)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(8, heads, 2 * HEAD_DIM, generator=g) for heads in (2, 1, 1))
    stored = cache.attend(1, q, k, v, batch)
    assert torch.equal(cache.attend(1, q, None, None, batch), stored)
    assert torch.equal(cache.k[1][batch.slot_mapping], k)


def test_paged_cache_has_the_kv_cache_page_size():
    args = (3, 2, 8, 16, torch.bfloat16)
    assert PagedKVCache.bytes_per_block(*args) == KVCache.bytes_per_block(*args)


def test_smaller_batch_turns_the_remaining_slots_into_padding():
    cache = PagedKVCache(*CACHE_ARGS, max_seqs=4, kernel=CPU_KERNEL)
    cache.begin(make_batch([(0, 0, 5), (1, 0, 3), (2, 0, 4)]))
    cache.begin(make_batch([(1, 3, 2)]))
    meta = cache.metadata
    assert meta.num_seqs == 1 and meta.max_query_len == 2
    assert meta.query_start_loc.tolist() == [0, 2, 2, 2, 2]
    assert meta.seq_lens.tolist() == [5, 0, 0, 0]
    assert meta.block_tables[0, :1].tolist() == TABLES[1][:1]


def test_a_row_table_is_written_again_exactly_when_its_version_or_length_changes():
    cache = PagedKVCache(*CACHE_ARGS, max_seqs=2, kernel=CPU_KERNEL)
    table = [3, 4]

    def row(kv_len: int, version: int | None) -> list[int]:
        cache.begin(AttentionBatch([SeqSlice(7, 0, 1, kv_len, table, version)], torch.tensor([0])))
        return cache.metadata.block_tables[0, : -(-kv_len // BLOCK_SIZE)].tolist()

    assert row(2 * BLOCK_SIZE, version=0) == [3, 4]
    table[:] = [9, 5]  # cleared and refilled in place, as a preempted sequence's is: a new version
    assert row(2 * BLOCK_SIZE, version=1) == [9, 5]
    table.append(6)
    assert row(2 * BLOCK_SIZE + 1, version=2) == [9, 5, 6]
    # The contract, seen from the other side: an unchanged version and length keep the row as written.
    table[0] = 11
    assert row(2 * BLOCK_SIZE + 1, version=2) == [9, 5, 6]
    assert row(2 * BLOCK_SIZE + 1, version=None) == [11, 5, 6]  # unknown: always written


def test_rows_out_of_batch_order_raise():
    cache = PagedKVCache(*CACHE_ARGS, kernel=CPU_KERNEL)
    seqs = [SeqSlice(0, 1, 1, 4, TABLES[0]), SeqSlice(1, 0, 1, 4, TABLES[1])]
    with pytest.raises(ValueError, match="batch order"):
        cache.begin(AttentionBatch(seqs, torch.tensor([0, 1])))


def test_more_sequences_than_max_seqs_raises():
    cache = PagedKVCache(*CACHE_ARGS, max_seqs=2, kernel=CPU_KERNEL)
    with pytest.raises(RuntimeError, match="max_seqs"):
        cache.begin(make_batch([(0, 0, 1), (1, 0, 1), (2, 0, 1)]))


def test_attend_without_begin_raises():
    cache = PagedKVCache(*CACHE_ARGS, kernel=CPU_KERNEL)
    batch = make_batch([(0, 0, 2)])
    q = torch.zeros(2, 2 * KV_HEADS, HEAD_DIM)
    with pytest.raises(RuntimeError, match="begin"):
        cache.attend(0, q, q[:, :KV_HEADS], q[:, :KV_HEADS], batch)


# The Triton kernel: interpreted on CPU tensors here, compiled where there is a GPU.




def on_device(meta: PagedAttentionMetadata, max_query_len: int) -> PagedAttentionMetadata:
    loc, lens, tables = (t.to(DEVICE) for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables))
    return PagedAttentionMetadata(loc, lens, tables, meta.block_size, max_query_len, meta.num_seqs)


# triton's interpreter multiplies bfloat16 tiles wrongly (tl.dot on bf16 gives garbage on CPU).
BF16_NEEDS_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="triton's interpreter mishandles bf16 tl.dot")


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.float32, None), (torch.float16, 2e-2), pytest.param(torch.bfloat16, 2e-2, marks=BF16_NEEDS_GPU)],
    ids=["fp32", "fp16", "bf16"],
)
@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.usefixtures("triton_interpreter")
def test_triton_kernel_matches_reference_and_leaves_other_rows_alone(group, dtype, tolerance):
    meta = make_meta(MIXED, BLOCK_SIZE, NUM_BLOCKS, seed=group)
    inputs = random_inputs(MIXED, group, NUM_BLOCKS * BLOCK_SIZE, seed=group)
    q, k_pages, v_pages = (t.to(DEVICE, dtype) for t in inputs)
    # Rows of no sequence at the end (a padded CUDA-graph batch), and a max_query_len bucket above
    # the longest chunk: the programs with no rows must exit without writing.
    padded_q = torch.cat([q, torch.randn_like(q[:3])])
    out = torch.full_like(padded_q, 7.0)
    triton_attention.paged_attention_triton(padded_q, k_pages, v_pages, on_device(meta, 32), out, SCALE)
    expected = paged_attention_reference(*(t.float().cpu() for t in (q, k_pages, v_pages)), meta, PLAIN)
    torch.testing.assert_close(out[: q.shape[0]].float().cpu(), expected, atol=tolerance, rtol=tolerance)
    assert (out[q.shape[0] :] == 7.0).all()


@pytest.mark.usefixtures("triton_interpreter")
def test_paged_cache_on_the_triton_path_matches_kv_cache():
    run_against_kv_cache(PagedKVCache(*CACHE_ARGS, device=DEVICE, max_seqs=4, kernel="triton"))
