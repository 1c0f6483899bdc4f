"""A Triton kernel for attention over the paged KV cache, for one flat batch of prefill chunks and
decode rows (varlen, GQA, causal aligned lower-right).

One program takes one sequence slot, one tile of its new tokens and one KV head, with every query
head of that head's group: each K/V tile is loaded once for the whole group. The grid is
(sequence slots, query tiles of the longest chunk, KV heads), so a caller that fixes the slot count
and a max_query_len bucket launches the same grid every step (CUDA-graph capturable); slots and
tiles with no query rows exit before touching K/V or the output.

Triton is imported if present: the CPU-only install has none, and `paged_attention` then uses its
PyTorch reference instead.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if TYPE_CHECKING:
    from tailrace.model.attention.kv_cache import PagedAttentionMetadata

_HEAD_DIMS = (32, 64, 128)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK_N = 32  # key positions per tile


def triton_available() -> bool:
    return triton is not None


def paged_attention_triton(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    meta: PagedAttentionMetadata,
    out: torch.Tensor,
    scale: float,
) -> None:
    """q [T, H, D] against k_pages/v_pages [num_blocks * block_size, kvH, D] -> out [T, H, D].

    Rows of `out` that belong to no sequence of `meta` are left as they are.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton, which is not installed")
    _check_shapes(q, k_pages, v_pages, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_pages.shape[1]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q, num_warps = _program_shape(meta.max_query_len, group_pad)
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_pages, v_pages, out,
        meta.query_start_loc, meta.seq_lens, meta.block_tables,
        scale * math.log2(math.e),
        q.stride(0), q.stride(1), k_pages.stride(0), k_pages.stride(1),
        v_pages.stride(0), v_pages.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), meta.block_tables.stride(1),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=_BLOCK_N,
        BLOCK_SIZE=meta.block_size, HEAD_DIM=head_dim,
        # tl.dot rounds float32 inputs to tf32 by default; float32 is the exact path, so keep it exact.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )


def _check_shapes(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dtype in _DTYPES, f"unsupported dtype {q.dtype}"
    assert k_pages.dtype == v_pages.dtype == out.dtype == q.dtype, "q, k, v and out must share a dtype"
    assert q.shape[2] in _HEAD_DIMS, f"head_dim {q.shape[2]} is not one of {_HEAD_DIMS}"
    assert k_pages.shape == v_pages.shape and k_pages.shape[2] == q.shape[2]
    assert q.shape[1] % k_pages.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert out.shape == q.shape
    assert all(t.stride(2) == 1 for t in (q, k_pages, v_pages, out)), "head_dim must be contiguous"


def _program_shape(max_query_len: int, group_pad: int) -> tuple[int, int]:
    """(new tokens per program, warps per program).

    tl.dot needs at least 16 rows: a decode-only step has one token per sequence, so it gets the
    fewest rows; a step with chunks gets more, so each K/V tile serves more queries. With
    _BLOCK_N = 32 these shapes compiled (ptxas, sm_90) without register spills for 16-bit inputs
    up to head_dim 128 and groups up to 16; their speed is not measured yet.
    """
    rows, num_warps = (16, 4) if max_query_len == 1 else (64, 8)
    return max(1, rows // group_pad), num_warps


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr,
        query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
        scale_log2,  # softmax scale * log2(e): the kernel exponentiates with exp2
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
        stride_bt, stride_bb,  # block tables: per sequence, per logical block
        GROUP: tl.constexpr,  # query heads per KV head
        GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two (tile shapes must be)
        BLOCK_Q: tl.constexpr,  # new tokens per program
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,  # tokens per cache block
        HEAD_DIM: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        seq = tl.program_id(0)
        q_tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_tile * BLOCK_Q >= q_len:
            return  # a padding slot, or a tile past this sequence's chunk
        kv_len = tl.load(seq_lens_ptr + seq)
        past = kv_len - q_len

        # Row r of the tile is token r // GROUP_PAD of the tile, query head r % GROUP_PAD of the group.
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        token = q_tile * BLOCK_Q + rows // GROUP_PAD
        head = kv_head * GROUP + rows % GROUP_PAD
        row_valid = (token < q_len) & (rows % GROUP_PAD < GROUP)
        dims = tl.arange(0, HEAD_DIM)
        q_rows = (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_rows, mask=row_valid[:, None], other=0.0)
        # Lower-right causal: a row sees up to its own position. Rows past the chunk see the whole
        # sequence; every row sees position 0, so no row's softmax is over nothing (no NaN).
        last_visible = past + token

        max_score = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        denominator = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM], tl.float32)
        kv_end = tl.minimum(kv_len, past + (q_tile + 1) * BLOCK_Q)
        for tile_start in range(0, kv_end, BLOCK_N):
            positions = tile_start + tl.arange(0, BLOCK_N)
            in_seq = positions < kv_end
            block = tl.load(block_tables_ptr + seq * stride_bt + (positions // BLOCK_SIZE) * stride_bb,
                            mask=in_seq, other=0)
            # int64: one layer's pages can hold more than 2**31 elements
            page_row = block.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
            k = tl.load(k_ptr + page_row[:, None] * stride_kt + kv_head * stride_kh + dims[None, :],
                        mask=in_seq[:, None], other=0.0)
            v = tl.load(v_ptr + page_row[:, None] * stride_vt + kv_head * stride_vh + dims[None, :],
                        mask=in_seq[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = in_seq[None, :] & (positions[None, :] <= last_visible[:, None])
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(max_score, tl.max(scores, 1))
            rescale = tl.exp2(max_score - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            denominator = denominator * rescale + tl.sum(probs, 1)
            acc = acc * rescale[:, None] + tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
            max_score = new_max

        out = acc / denominator[:, None]
        out_rows = (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None])
