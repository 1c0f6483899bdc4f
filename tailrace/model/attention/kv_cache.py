"""Attention over a block-accounted KV cache, for one flat batch of mixed prefill and decode rows.

The paged tensors `k[layer]`, `v[layer]` ([num_blocks * block_size, kv_heads, head_dim]) are the
source of truth: every step writes the new tokens into them, so blocks can be shared through
the engine's prefix cache. Attention itself reads a slot slab: each running sequence owns one
slot, a contiguous row of K/V per layer, so the decode rows of every sequence attend in one
batched call per layer. Gathering pages into a padded tensor each step measured about 8x slower
on small CPUs, and one call per sequence is dominated by per-call overhead at large batches. A
slot is filled from the pages only when a sequence starts with K/V it did not compute itself (a
prefix-cache hit, or a resume after preemption); after that it grows by appends.

A position's attention must not depend on how it is batched. At float32, SDPA's rows differ
between batch shapes only in MKL's last bit (~1e-7). At bfloat16 CPU SDPA rounds a row
differently by the query block it falls in and by how far the batch pads its keys (half an ulp
of the output), so a prompt chunked differently (a prefix-cache hit, the token budget, a
recompute after preemption) or new neighbours in the batch changed later draws. bfloat16
therefore attends by plain matmuls, as the reference implementation's eager attention does
(scores in bfloat16, softmax in float32, probabilities in bfloat16): oneDNN's bfloat16 matmul
gives every row the same bits whatever the number of rows, batches, padded keys or threads, so
each position's attention is one fixed computation (tests/test_attention.py pins this bitwise).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

_MIN_SLAB_CAPACITY = 16
_CAPACITY_STEP = 64
EXACT_ROWS = 256  # query rows per matmul in a bfloat16 prefill: bounds the scores and keeps most of causality's saving


@dataclass(slots=True)
class SeqSlice:
    key: int  # the engine's sequence id; the cache keeps per-sequence state under it
    q_start: int  # first row of this sequence in the flat batch
    q_len: int  # new tokens this step (prefill chunk length, or 1 for decode)
    kv_len: int  # tokens in the cache after this step (= tokens before + q_len)
    block_table: list[int]  # physical block ids covering positions [0, kv_len)
    # The sequence's Sequence.table_version, which changes whenever block_table does: a cache may
    # keep what it derived from an unchanged table. None: unknown, derive it again.
    table_version: int | None = field(default=None, compare=False)
    # A hybrid's (state_cache.py): the chained hash of the cached block it starts after, whose
    # state it continues; and the block boundary (position, chained hash) whose state to keep.
    state_key: int | None = field(default=None, compare=False)
    capture: tuple[int, int] | None = field(default=None, compare=False)


@dataclass(frozen=True, slots=True)
class LayerAttention:
    """How one layer attends: its scale, and where set the positions a query sees back from itself
    (a sliding window, the query's own included) and the scores' soft cap (cap * tanh(s / cap))."""

    scale: float
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False  # each head's learned logit joins its softmax (the tensor comes with each call)


@dataclass(slots=True)
class AttentionBatch:
    seqs: list[SeqSlice]
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset, for each new token


class SequenceStates(Protocol):
    """What a KV cache carries beside its K/V for a hybrid's other layers (state_cache.StateCache),
    told of each step and each released sequence as the cache is."""

    def begin(self, batch: AttentionBatch) -> None: ...

    def release(self, key: int) -> None: ...


@dataclass(slots=True)
class PagedAttentionMetadata:
    """A step's batch as paged attention reads it (PagedKVCache.begin sends it to the device once)."""

    query_start_loc: torch.Tensor  # [B + 1] int32: sequence i owns rows [loc[i], loc[i + 1]) of q
    seq_lens: torch.Tensor  # [B] int32: K/V length after this step, the new tokens included
    block_tables: torch.Tensor  # [B, max_blocks] int32 (any strides): the physical block of each logical block
    block_size: int
    max_query_len: int  # at least the longest chunk; the Triton grid is sized by it
    num_seqs: int  # B, padding sequences (no query rows, seq_len 0) included


@dataclass(slots=True)
class _Prefill:
    slot: int
    q_start: int
    q_end: int
    kv_len: int
    mask: torch.Tensor | None  # lower-right causal mask; only for a chunk after cached tokens
    blocks: list[tuple[int, int, torch.Tensor]]  # bfloat16 only: (first row, end row, bias [rows, 1, width])


@dataclass(slots=True)
class _Decode:
    rows: torch.Tensor  # [N] rows of the flat batch that decode
    slots: torch.Tensor | None  # [N] their slots; None when the j-th decode row owns slot j
    num_slots: int  # slots 0..num_slots-1 take part in the batched call
    max_len: int  # the longest kv_len among them
    mask: torch.Tensor | None  # [S, 1, 1, max_len]: per slot, the positions its query may see;
    # None when every slot decodes and sees all max_len positions
    bias: torch.Tensor | None  # bfloat16 only: the mask as float32 [S, 1, 1, max_len], 0 or -inf
    rows_are_batch: bool  # the decode rows are the whole flat batch, in order


@dataclass(slots=True)
class _Step:
    """What `begin` prepares once for all layers of one step."""

    batch: AttentionBatch
    slab_index: torch.Tensor  # [T * kvH]: row of each new token's heads in one layer's flat slab
    decode: _Decode | None
    prefills: list[_Prefill]


def plain_attention(how: LayerAttention, head_dim: int) -> bool:
    """Every position seen, at the usual scale, scores uncapped, no sinks."""
    return how.window is None and how.softcap is None and not how.sinks and how.scale == head_dim**-0.5


def new_pages(num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The paged K and V of every cache layout, [layers, num_slots = num_blocks * block_size, kv_heads, head_dim]:
    what `KVCache.bytes_per_block` counts.

    On the CPU each layer holds its KV heads' rows apart, [kv_heads, num_slots, head_dim] seen
    through a transposed view: attention reads one KV head's rows position after position, and
    with the heads interleaved a one-row step's read ran at a third of the rate a KV head's own rows
    read at (2048 positions, 30 layers: 5.1 against about 2.7 ms; `bench/decode_step.py --context
    2048 --prefill 0` shows the one-row step). The CUDA kernel reads through the same strides; its
    cache keeps the first layout."""
    if device.type == "cpu":
        held = (num_layers, num_kv_heads, num_slots, head_dim)
        return (torch.zeros(held, dtype=dtype, device=device).transpose(1, 2),
                torch.zeros(held, dtype=dtype, device=device).transpose(1, 2))
    shape = (num_layers, num_slots, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


class KVCache:
    """Paged K/V (the source of truth) plus the slot slab that attention reads.

    Memory: the pages take `num_blocks * bytes_per_block(...)`. The slab takes
    slots x capacity x 2 (K and V) x num_layers x kv_heads x head_dim x dtype size on top, where
    slots is the most sequences held at once rounded up to a power of two (at most max_seqs) and
    capacity is the longest sequence held plus a quarter, rounded up to 64 (at most
    max_model_len), shrunk back once every sequence held fits in half of it.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        max_seqs: int = 64,
        max_model_len: int | None = None,  # None: as many tokens as the pages hold
        states: SequenceStates | None = None,  # a hybrid's linear-attention states, kept beside the K/V
    ) -> None:
        self.states = states
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.exact_matmuls = dtype == torch.bfloat16  # attend by batch-invariant matmuls, not SDPA
        self.max_seqs = max_seqs
        self.max_model_len = max_model_len or num_blocks * block_size
        self.k, self.v = new_pages(num_layers, num_blocks * block_size, num_kv_heads, head_dim, dtype, self.device)
        # [layers, slots, kv_heads, capacity, head_dim]: a slot's heads are contiguous runs of
        # positions, so both the batched decode and a prefill chunk read plain views. Zeros, not
        # empty: masked positions still enter the score product, and garbage could be NaN.
        self.slab_k = self._new_slab(1, min(_MIN_SLAB_CAPACITY, self.max_model_len))
        self.slab_v = torch.zeros_like(self.slab_k)
        self._index_layers()
        self._slot_of: dict[int, int] = {}
        self._free_slots = list(range(max_seqs))  # a heap: the lowest slot goes first
        self._slot_len = [0] * max_seqs  # positions [0, len) of a slot hold valid K/V
        self._step: _Step | None = None

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """Bytes of paged K and V storage for one block across all layers (the slab not included)."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def capacity(self) -> int:
        return self.slab_k.shape[3]

    @torch.inference_mode()
    def begin(self, batch: AttentionBatch) -> None:
        """Give each sequence a slot holding exactly its cached tokens, and plan the step's attention."""
        if self.states is not None:
            self.states.begin(batch)
        slots = [self._slot_for(seq.key) for seq in batch.seqs]
        self._resize(max((seq.kv_len for seq in batch.seqs), default=0), max(slots, default=-1) + 1)
        row_slots, row_positions, prefills, decoding = [], [], [], []
        for seq, slot in zip(batch.seqs, slots):
            past = seq.kv_len - seq.q_len
            if self._slot_len[slot] < past:
                self._fill_from_pages(slot, seq.block_table, past)
            self._slot_len[slot] = past
            row_slots += [slot] * seq.q_len
            row_positions += range(past, seq.kv_len)
            if seq.q_len == 1:
                decoding.append((seq.q_start, slot, seq.kv_len))
            else:
                blocks = self._exact_blocks(past, seq.q_len) if self.exact_matmuls else []
                mask = None if blocks else self._chunk_mask(past, seq.q_len)
                prefills.append(_Prefill(slot, seq.q_start, seq.q_start + seq.q_len, seq.kv_len, mask, blocks))
        self._step = _Step(
            batch=batch,
            slab_index=self._slab_index(row_slots, row_positions),
            decode=self._plan_decode(decoding, len(row_slots)) if decoding else None,
            prefills=prefills,
        )

    @torch.inference_mode()
    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
        how: LayerAttention | None = None, sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, kvH, D] -> [T, H, D]: store the new K/V, attend causally per sequence.
        The slab attends at head_dim ** -0.5 over every position: `how` may ask for no more (and
        so `sinks` is None)."""
        if (how is not None and not plain_attention(how, self.head_dim)) or k is None:
            raise ValueError(f"the slab KV cache does not take {how} or shared K/V; the paged cache does")
        step = self._step
        if step is None or batch is not step.batch:
            raise RuntimeError("KVCache.begin(batch) must be called with this batch before the forward")
        slab_k, slab_v = self._layers[layer]
        slab_k.view(-1, self.head_dim).index_copy_(0, step.slab_index, k.reshape(-1, self.head_dim))
        slab_v.view(-1, self.head_dim).index_copy_(0, step.slab_index, v.reshape(-1, self.head_dim))
        if layer == self.num_layers - 1:
            self._store_pages(batch.slot_mapping, step.slab_index)
            for seq in batch.seqs:
                self._slot_len[self._slot_of[seq.key]] = seq.kv_len
        decoded = None if step.decode is None else _decode_attention(q, slab_k, slab_v, step.decode)
        if decoded is not None and step.decode.rows_are_batch:
            return decoded
        out = q.new_empty(q.shape)
        if decoded is not None:
            out.index_copy_(0, step.decode.rows, decoded)
        for p in step.prefills:
            rows = slice(p.q_start, p.q_end)
            if p.blocks:
                _exact_prefill(q[rows], slab_k[p.slot], slab_v[p.slot], p.blocks, out[rows])
                continue
            out[rows] = _prefill_attention(q[rows], slab_k[p.slot, :, : p.kv_len], slab_v[p.slot, :, : p.kv_len], p.mask)
        return out

    def narrow(self, batch: AttentionBatch, rows: list[int]) -> AttentionBatch | None:
        """None: the slab attends every row of the step (PagedKVCache.narrow attends some)."""
        return None

    def release(self, key: int) -> None:
        """The sequence finished, was aborted or preempted: free its slot (its pages stay)."""
        if self.states is not None:
            self.states.release(key)
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            self._slot_len[slot] = 0
            heapq.heappush(self._free_slots, slot)

    def _slot_for(self, key: int) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            if not self._free_slots:
                raise RuntimeError(f"more than max_seqs={self.max_seqs} sequences hold a KV cache slot")
            slot = self._slot_of[key] = heapq.heappop(self._free_slots)
        return slot

    def _new_slab(self, num_slots: int, capacity: int) -> torch.Tensor:
        shape = (self.num_layers, num_slots, self.num_kv_heads, capacity, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def _resize(self, kv_len: int, num_slots: int) -> None:
        """When kv_len does not fit, set the capacity to the longest sequence held plus a quarter
        (in steps of _CAPACITY_STEP); double the slot count until num_slots fit; keep the K/V of
        the slots in use. Slots go lowest first, so a server at concurrency c holds about c
        slots, not max_seqs: at 1 sequence of 256 tokens the SmolLM2-135M shape's slab is 15 MB instead of
        755 MB. The capacity shrinks the same way once every sequence held fits in half of it.
        bfloat16 decode reads whole slab rows, so capacity beyond the longest sequence costs
        every step: doubling would waste up to half of that read, a quarter's headroom costs a
        copy of the slab every ~25% of growth instead."""
        if kv_len > self.max_model_len:
            raise ValueError(f"a sequence of {kv_len} tokens is over max_model_len={self.max_model_len}")
        capacity, slots = self.capacity, self.slab_k.shape[1]
        held = max([kv_len] + [self._slot_len[slot] for slot in self._slot_of.values()])
        if kv_len > capacity or (held <= capacity // 2 and capacity > _MIN_SLAB_CAPACITY):
            capacity = max(_MIN_SLAB_CAPACITY, -(-(held + held // 4) // _CAPACITY_STEP) * _CAPACITY_STEP)
        while slots < num_slots:
            slots *= 2
        capacity, slots = min(capacity, self.max_model_len), min(slots, self.max_seqs)
        if capacity == self.capacity and slots == self.slab_k.shape[1]:
            return
        used = min(max(self._slot_of.values(), default=-1) + 1, self.slab_k.shape[1])
        kept = min(capacity, self.capacity)
        old_k, old_v = self.slab_k, self.slab_v
        self.slab_k, self.slab_v = self._new_slab(slots, capacity), self._new_slab(slots, capacity)
        self.slab_k[:, :used, :, :kept] = old_k[:, :used, :, :kept]
        self.slab_v[:, :used, :, :kept] = old_v[:, :used, :, :kept]
        self._index_layers()

    def _index_layers(self) -> None:
        """Each layer's slab as views made once (again when the slab is resized), not per call."""
        self._layers = list(zip(self.slab_k.unbind(0), self.slab_v.unbind(0)))

    def _store_pages(self, slot_mapping: torch.Tensor, slab_index: torch.Tensor) -> None:
        """Copy the step's new K/V of every layer from the slab into the pages at once: two ops
        per tensor a step instead of one per layer (60 fewer small ops a step on 30 layers).
        Nothing reads the pages before the next `begin`."""
        for pages, slab in ((self.k, self.slab_k), (self.v, self.slab_v)):
            new = slab.view(self.num_layers, -1, self.head_dim)[:, slab_index]
            pages.index_copy_(1, slot_mapping, new.view(self.num_layers, -1, self.num_kv_heads, self.head_dim))

    def _fill_from_pages(self, slot: int, block_table: list[int], end: int) -> None:
        start = self._slot_len[slot]
        positions = torch.arange(start, end, device=self.device)
        blocks = self._index(block_table)
        pages = blocks[positions // self.block_size] * self.block_size + positions % self.block_size
        self.slab_k[:, slot, :, start:end] = self.k[:, pages].transpose(1, 2)
        self.slab_v[:, slot, :, start:end] = self.v[:, pages].transpose(1, 2)
        self._slot_len[slot] = end

    def _slab_index(self, row_slots: list[int], row_positions: list[int]) -> torch.Tensor:
        """Rows of a layer's slab viewed as [slots * kv_heads * capacity, head_dim] that the new
        tokens' heads go to, so each layer stores its K (and V) with one index_copy_."""
        heads = torch.arange(self.num_kv_heads, device=self.device)
        slots, positions = self._index(row_slots)[:, None], self._index(row_positions)[:, None]
        return ((slots * self.num_kv_heads + heads) * self.capacity + positions).reshape(-1)

    def _plan_decode(self, decoding: list[tuple[int, int, int]], num_rows: int) -> _Decode:
        """decoding: (row, slot, kv_len) per decoding sequence -> metadata shared by every layer."""
        rows, slots, lengths = zip(*decoding)
        num_slots, max_len = max(slots) + 1, max(lengths)
        if self.exact_matmuls:
            # Whole slab rows: a shorter run of positions is strided, and matmul copies it first.
            max_len = self.capacity
        in_order = slots == tuple(range(len(slots)))
        mask = None
        if not in_order or min(lengths) < max_len:
            # Slots that do not decode this step see position 0 only: their softmax stays finite.
            slot_lengths = [1] * num_slots
            for slot, length in zip(slots, lengths):
                slot_lengths[slot] = length
            positions = torch.arange(max_len, device=self.device)
            mask = (positions[None, :] < self._index(slot_lengths)[:, None])[:, None, None, :]
        bias = None
        if self.exact_matmuls:
            bias = torch.zeros((num_slots, 1, 1, max_len), device=self.device) if mask is None else _additive(mask)
        return _Decode(
            rows=self._index(rows), slots=None if in_order else self._index(slots), num_slots=num_slots,
            max_len=max_len, mask=mask, bias=bias, rows_are_batch=rows == tuple(range(num_rows)),
        )

    def _index(self, values: list[int] | tuple[int, ...]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _exact_blocks(self, past: int, q_len: int) -> list[tuple[int, int, torch.Tensor]]:
        """A bfloat16 chunk's query rows in runs of EXACT_ROWS, each with the additive causal bias
        over the keys up to its last row."""
        blocks = []
        for start in range(0, q_len, EXACT_ROWS):
            end = min(q_len, start + EXACT_ROWS)
            rows = torch.arange(past + start, past + end, device=self.device)
            cols = torch.arange(past + end, device=self.device)
            blocks.append((start, end, _additive(cols[None, :] <= rows[:, None])[:, None]))
        return blocks

    def _chunk_mask(self, past: int, q_len: int) -> torch.Tensor | None:
        # SDPA's is_causal aligns top-left, which is only right when there is no cached prefix.
        if past == 0:
            return None
        rows = torch.arange(past, past + q_len, device=self.device)
        cols = torch.arange(past + q_len, device=self.device)
        return cols[None, :] <= rows[:, None]


def _decode_attention(q: torch.Tensor, slab_k: torch.Tensor, slab_v: torch.Tensor, decode: _Decode) -> torch.Tensor:
    """Every decode row of q [T, H, D] against its slot of slab_k/slab_v, in one call -> [N, H, D]
    in the order of decode.rows.

    The rows are scattered to their slots ([S, H, D], zero for slots that do not decode), and the
    query heads sharing a KV head become that head's G query rows ([S, kvH, G, D]), so GQA needs
    neither expanded K/V nor SDPA's enable_gqa, which measured slower on CPU. When the j-th decode
    row owns slot j (always so for a lone sequence) the scatter and gather are skipped.
    """
    num_slots, max_len = decode.num_slots, decode.max_len
    num_kv_heads, head_dim = slab_k.shape[1], slab_k.shape[3]
    rows_q = q if decode.rows_are_batch else q.index_select(0, decode.rows)
    if decode.slots is None:
        slot_q = rows_q
    else:
        slot_q = q.new_zeros((num_slots, q.shape[1], head_dim)).index_copy_(0, decode.slots, rows_q)
    slot_q = slot_q.reshape(num_slots, num_kv_heads, -1, head_dim)
    keys, values = slab_k[:num_slots, :, :max_len], slab_v[:num_slots, :, :max_len]
    if decode.bias is not None:
        grouped_shape = (num_slots, num_kv_heads, slot_q.shape[2], max_len)
        slot_out = _matmul_attention(slot_q, keys, values, decode.bias, grouped_shape)
    else:
        slot_out = F.scaled_dot_product_attention(slot_q, keys, values, attn_mask=decode.mask)
    slot_out = slot_out.reshape(num_slots, -1, head_dim)  # CUDA's SDPA may return it non-contiguous
    return slot_out if decode.slots is None else slot_out.index_select(0, decode.slots)


def _additive(visible: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the float32 bias _matmul_attention adds: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, float("-inf"))


def _matmul_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, grouped_shape: tuple[int, ...]
) -> torch.Tensor:
    """q [..., M, D] against keys/values [..., W, D] -> [..., M, D]: the reference implementation's
    eager attention in bfloat16, in batch-invariant matmuls. bias (float32, 0 or -inf) broadcasts
    against the scores viewed as grouped_shape."""
    scores = torch.matmul(q, keys.transpose(-1, -2))
    logits = torch.add(bias, scores.view(grouped_shape), alpha=q.shape[-1] ** -0.5)
    return torch.matmul(torch.softmax(logits, -1).to(q.dtype).view(scores.shape), values)


def _exact_prefill(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, blocks: list[tuple[int, int, torch.Tensor]],
    out: torch.Tensor,
) -> None:
    """q [L, H, D] against one slot's keys/values [kvH, capacity, D] into out [L, H, D], block by
    block. The G query heads of a KV head and the block's rows become one matrix of rows x G rows."""
    num_kv_heads, head_dim = keys.shape[0], keys.shape[2]
    for start, end, bias in blocks:
        rows, width = end - start, bias.shape[-1]
        grouped = q[start:end].view(rows, num_kv_heads, -1, head_dim).permute(1, 0, 2, 3)
        group = grouped.shape[2]
        attended = _matmul_attention(
            grouped.reshape(num_kv_heads, rows * group, head_dim), keys[:, :width], values[:, :width],
            bias, (num_kv_heads, rows, group, width),
        )
        out[start:end].view(rows, num_kv_heads, group, head_dim).copy_(
            attended.view(num_kv_heads, rows, group, head_dim).permute(1, 0, 2, 3))


def _prefill_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [L, H, D] against keys/values [kvH, S, D] -> [L, H, D], causal aligned lower-right.

    The inputs get a batch dimension because SDPA runs its fused CPU kernel only on 4-D tensors:
    3-D ones fall back to the unfused math path, ~3x slower at 128 tokens and ~9x at 1,024.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )
    return out[0].transpose(0, 1)
