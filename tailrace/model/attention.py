"""Attention over a block-accounted KV cache, for one flat batch of mixed prefill and decode rows.

The paged tensors `k[layer]`, `v[layer]` ([num_blocks * block_size, kv_heads, head_dim]) are the
source of truth: every step writes the new tokens into them, so blocks can be shared through
the engine's prefix cache. Attention itself reads a contiguous per-sequence mirror of those
pages, because on small CPUs gathering pages into a padded tensor each decode step measured
about 8x slower than attention over contiguous per-sequence views. A mirror is filled from the
pages only when a sequence starts with K/V it did not compute itself (a prefix-cache hit, or a
resume after preemption); after that it grows by appends.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

_MIN_MIRROR_CAPACITY = 16


@dataclass(slots=True)
class SeqSlice:
    key: int  # the engine's sequence id; the cache keeps per-sequence state under it
    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # new tokens this step (prefill chunk length, or 1 for decode)
    kv_len: int  # tokens in the cache after this step (= tokens before + q_len)
    block_table: list[int]  # physical block ids covering positions [0, kv_len)


@dataclass(slots=True)
class AttentionBatch:
    seqs: list[SeqSlice]
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset, for each new token


@dataclass(slots=True)
class _Mirror:
    kv: torch.Tensor  # [num_layers, 2, kv_heads, capacity, head_dim]
    length: int  # positions [0, length) hold valid K/V


@dataclass(slots=True)
class _SeqStep:
    mirror: _Mirror
    q_start: int
    q_end: int
    past: int
    kv_len: int
    mask: torch.Tensor | None  # lower-right causal mask; only for a prefill chunk after cached tokens


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self._mirrors: dict[int, _Mirror] = {}
        self._batch: AttentionBatch | None = None
        self._steps: list[_SeqStep] = []

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes of paged K and V storage for one block across all layers (mirrors not included)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @torch.inference_mode()
    def begin(self, batch: AttentionBatch) -> None:
        """Prepare each sequence's mirror to hold exactly its cached tokens before this step."""
        steps = []
        for seq in batch.seqs:
            past = seq.kv_len - seq.q_len
            mirror = self._mirror_with_capacity(seq.key, seq.kv_len)
            if mirror.length < past:
                self._fill_from_pages(mirror, seq.block_table, past)
            mirror.length = past
            steps.append(
                _SeqStep(
                    mirror=mirror,
                    q_start=seq.q_start,
                    q_end=seq.q_start + seq.q_len,
                    past=past,
                    kv_len=seq.kv_len,
                    mask=self._chunk_mask(past, seq.q_len),
                )
            )
        self._batch = batch
        self._steps = steps

    @torch.inference_mode()
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, kvH, D] -> [T, H, D]: store the new K/V, attend causally per sequence."""
        if batch is not self._batch:
            raise RuntimeError("KVCache.begin(batch) must be called with this batch before the forward")
        self.k[layer].index_copy_(0, batch.slot_mapping, k)
        self.v[layer].index_copy_(0, batch.slot_mapping, v)
        new_kv = torch.stack((k, v)).transpose(1, 2)  # [2, kvH, T, D]
        out = q.new_empty(q.shape)
        scaled_q = q * q.shape[-1] ** -0.5  # once for all decode rows, not once per sequence
        for step in self._steps:
            kv = step.mirror.kv[layer]
            kv[:, :, step.past : step.kv_len] = new_kv[:, :, step.q_start : step.q_end]
            keys, values = kv[0, :, : step.kv_len], kv[1, :, : step.kv_len]
            if step.q_end - step.q_start == 1:
                _decode_attention(scaled_q[step.q_start], keys, values, out[step.q_start])
            else:
                out[step.q_start : step.q_end] = _prefill_attention(
                    q[step.q_start : step.q_end], keys, values, step.mask
                )
        if layer == self.num_layers - 1:
            for step in self._steps:
                step.mirror.length = step.kv_len
        return out

    def release(self, key: int) -> None:
        """The sequence finished, was aborted or preempted: drop its mirror (its pages stay)."""
        self._mirrors.pop(key, None)

    def _mirror_with_capacity(self, key: int, kv_len: int) -> _Mirror:
        mirror = self._mirrors.get(key)
        if mirror is not None and mirror.kv.shape[3] >= kv_len:
            return mirror
        capacity = _MIN_MIRROR_CAPACITY if mirror is None else mirror.kv.shape[3]
        while capacity < kv_len:
            capacity *= 2
        kv = torch.empty(
            (self.num_layers, 2, self.num_kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device
        )
        length = 0
        if mirror is not None:
            length = mirror.length
            kv[:, :, :, :length] = mirror.kv[:, :, :, :length]
        grown = _Mirror(kv=kv, length=length)
        self._mirrors[key] = grown
        return grown

    def _fill_from_pages(self, mirror: _Mirror, block_table: list[int], end: int) -> None:
        positions = torch.arange(mirror.length, end, device=self.device)
        blocks = torch.tensor(block_table, dtype=torch.int64, device=self.device)
        slots = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        mirror.kv[:, 0, :, mirror.length : end] = self.k[:, slots].transpose(1, 2)
        mirror.kv[:, 1, :, mirror.length : end] = self.v[:, slots].transpose(1, 2)
        mirror.length = end

    def _chunk_mask(self, past: int, q_len: int) -> torch.Tensor | None:
        # SDPA's is_causal aligns top-left, which is only right when there is no cached prefix.
        if past == 0 or q_len == 1:
            return None
        rows = torch.arange(past, past + q_len, device=self.device)
        cols = torch.arange(past + q_len, device=self.device)
        return cols[None, :] <= rows[:, None]


def _decode_attention(scaled_q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> None:
    """One query row [H, D], already scaled, against keys/values [kvH, S, D], written into out [H, D].

    The query heads sharing a KV head are stacked as that head's queries, so GQA needs no
    expanded K/V; explicit bmm + softmax measured faster than SDPA for a single row on CPU.
    """
    num_kv_heads, _, head_dim = keys.shape
    scores = torch.bmm(scaled_q.reshape(num_kv_heads, -1, head_dim), keys.transpose(1, 2))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
    torch.bmm(weights, values, out=out.view(num_kv_heads, -1, head_dim))


def _prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [L, H, D] against keys/values [kvH, S, D] -> [L, H, D], causal aligned lower-right."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys, values, attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return out.transpose(0, 1)
