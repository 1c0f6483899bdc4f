"""The state cache: what a linear-attention layer keeps of each running sequence, beside the KV cache.

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps no K/V that grows with the sequence. Per
sequence and layer it keeps a fixed-size state: the last (kernel - 1) inputs of its causal
convolution, in the model's dtype (they are projections, rounded already), and one recurrent
matrix [key_dim, value_dim] per value head, in float32. The attention layers of the same model
keep their K/V in the paged KV cache as any model's do; the two caches are sized and freed
together, sequence by sequence.

Each running sequence owns one live slot, as it owns a slot of the KV cache's slab: taken the
first time a step names it, freed when the engine releases it (finish, abort, preemption). A
sequence that starts at position 0 starts from a zeroed slot.

The prefix cache's share: the state of a prefix cannot be rebuilt from K/V pages, so the cache
also keeps snapshots, each the state at the end of one full KV block, under that block's chained
hash (engine/block_manager.py). A step may capture one per sequence: the state after the last
block boundary its chunk crosses, which the kernels copy out as they pass that token (so a
boundary inside a prefill chunk is kept too). A sequence that starts after a cached prefix (a
prefix-cache hit: the block manager matches only blocks whose snapshot is kept) starts from a
copy of that snapshot. Snapshots are taken back least recently used first; there are as many
as live slots. Live slots and snapshots are rows of the same tensors, so a capture is a copy
within one layer's tensor. Rows never written hold no memory (the zeros are the allocator's
untouched pages).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tailrace.model.attention.kv_cache import AttentionBatch


@dataclass(frozen=True, slots=True)
class StateShape:
    """One Gated DeltaNet layer's state per sequence."""

    conv_channels: int  # the convolved q, k and v channels
    conv_kernel: int
    value_heads: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True, slots=True)
class StateStep:
    """A step's sequences as the state kernels read them: sequence i owns rows [starts[i],
    starts[i + 1]) of the flat batch and state row slots[i]; where captures[i] > 0, the state
    after its first captures[i] rows is copied to row capture_slots[i]."""

    starts: torch.Tensor  # [B + 1] int64
    slots: torch.Tensor  # [B] int64
    captures: torch.Tensor  # [B] int64: rows before the captured boundary, 0 for none
    capture_slots: torch.Tensor  # [B] int64
    # (first row, end row, slot, rows before the captured boundary, its row) per sequence, for Python loops
    bounds: list[tuple[int, int, int, int, int]]


class StateCache:
    def __init__(self, num_layers: int, shape: StateShape, max_seqs: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers = num_layers
        self.shape = shape
        self.max_seqs = max_seqs
        rows = 2 * max_seqs  # live slots, then as many snapshots
        # conv[layer, row]: the last kernel - 1 inputs, oldest first; recurrent[layer, row]: [heads, key, value]
        self.conv = torch.zeros(num_layers, rows, shape.conv_kernel - 1, shape.conv_channels, dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros(num_layers, rows, shape.value_heads, shape.key_dim, shape.value_dim,
                                     dtype=torch.float32, device=device)
        self._slot_of: dict[int, int] = {}
        self._free = list(range(max_seqs))
        self._snapshot_of: OrderedDict[int, int] = OrderedDict()  # block hash -> row, least recently used first
        self._free_snapshots = list(range(max_seqs, rows))
        self.step: StateStep | None = None

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def kept(self, block_hash: int) -> bool:
        """Whether the state at the end of the block with this chained hash is kept."""
        return block_hash in self._snapshot_of

    def begin(self, batch: AttentionBatch) -> None:
        """Give each sequence of the step its slot: zeroed where it starts at position 0, a copy of
        its prefix's snapshot where it starts after one; then a snapshot row for each capture."""
        slots = []
        for seq in batch.seqs:
            past = seq.kv_len - seq.q_len
            slot = self._slot_of.get(seq.key)
            if slot is None:
                if not self._free:
                    raise RuntimeError(f"more than max_seqs={self.max_seqs} sequences hold a state slot")
                source = self._snapshot_of.get(seq.state_key) if past else None
                if past and source is None:
                    raise RuntimeError(f"sequence {seq.key} resumes at position {past} without its recurrent state")
                slot = self._slot_of[seq.key] = heapq.heappop(self._free)
                if source is None:
                    self.conv[:, slot].zero_()
                    self.recurrent[:, slot].zero_()
                else:
                    self._snapshot_of.move_to_end(seq.state_key)
                    self.conv[:, slot] = self.conv[:, source]
                    self.recurrent[:, slot] = self.recurrent[:, source]
            slots.append(slot)
        bounds = []
        for seq, slot in zip(batch.seqs, slots):
            rows, row = 0, 0
            if seq.capture is not None and seq.capture[1] not in self._snapshot_of:
                boundary, block_hash = seq.capture
                rows, row = boundary - (seq.kv_len - seq.q_len), self._snapshot_row(block_hash)
            bounds.append((seq.q_start, seq.q_start + seq.q_len, slot, rows, row))
        starts = [first for first, *_ in bounds] + [bounds[-1][1] if bounds else 0]
        device = self.conv.device

        def column(i: int) -> torch.Tensor:
            return torch.tensor([bound[i] for bound in bounds], dtype=torch.int64, device=device)

        self.step = StateStep(torch.tensor(starts, dtype=torch.int64, device=device), column(2), column(3), column(4),
                              bounds)

    def _snapshot_row(self, block_hash: int) -> int:
        """A row for the snapshot under `block_hash`, the least recently used one's if none is free."""
        if self._free_snapshots:
            row = self._free_snapshots.pop()
        else:
            _, row = self._snapshot_of.popitem(last=False)
        self._snapshot_of[block_hash] = row
        return row

    def release(self, key: int) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            heapq.heappush(self._free, slot)
