"""The state cache: what a linear-attention layer keeps of each running sequence, beside the KV cache.

A Gated DeltaNet layer (Qwen3.5, Qwen3-Next) keeps no K/V that grows with the sequence. Per
sequence and layer it keeps a fixed-size state: the last (kernel - 1) inputs of its causal
convolution, in the model's dtype (they are projections, rounded already), and one recurrent
matrix [key_dim, value_dim] per value head, in float32. The attention layers of the same model
keep their K/V in the paged KV cache as any model's do; the two caches are sized and freed
together, sequence by sequence.

Each running sequence owns one slot of the state cache, as it owns a slot of the KV cache's slab:
taken the first time a step names it, freed when the engine releases it (finish, abort,
preemption). A slot is zeroed when its sequence's step starts at position 0. A sequence that
starts later continues the state its slot holds; the state of a prefix cannot be rebuilt from
K/V pages, so the engine serves these models without the prefix cache (engine/core.py), and a
preempted sequence is computed again from its first token.
"""

from __future__ import annotations

import heapq
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

    def bytes_per_sequence(self, layers: int, dtype: torch.dtype) -> int:
        conv = (self.conv_kernel - 1) * self.conv_channels * dtype.itemsize
        return layers * (conv + self.value_heads * self.key_dim * self.value_dim * 4)


@dataclass(frozen=True, slots=True)
class StateStep:
    """A step's sequences as the state kernels read them: sequence i owns rows
    [starts[i], starts[i + 1]) of the flat batch and state slot slots[i]."""

    starts: torch.Tensor  # [B + 1] int64
    slots: torch.Tensor  # [B] int64
    bounds: list[tuple[int, int, int]]  # (first row, end row, slot) per sequence, for Python loops


class StateCache:
    def __init__(self, num_layers: int, shape: StateShape, max_seqs: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_layers = num_layers
        self.shape = shape
        self.max_seqs = max_seqs
        # conv[layer, slot]: the last kernel - 1 inputs, oldest first; recurrent[layer, slot]: [heads, key, value]
        self.conv = torch.zeros(num_layers, max_seqs, shape.conv_kernel - 1, shape.conv_channels, dtype=dtype,
                                device=device)
        self.recurrent = torch.zeros(num_layers, max_seqs, shape.value_heads, shape.key_dim, shape.value_dim,
                                     dtype=torch.float32, device=device)
        self._slot_of: dict[int, int] = {}
        self._free = list(range(max_seqs))
        self.step: StateStep | None = None

    @property
    def nbytes(self) -> int:
        return self.conv.nbytes + self.recurrent.nbytes

    def begin(self, batch: AttentionBatch) -> None:
        """Give each sequence of the step its slot, zeroed where the sequence starts at position 0."""
        bounds = []
        for seq in batch.seqs:
            past = seq.kv_len - seq.q_len
            slot = self._slot_of.get(seq.key)
            if slot is None:
                if past:
                    raise RuntimeError(f"sequence {seq.key} resumes at position {past} without its recurrent state")
                if not self._free:
                    raise RuntimeError(f"more than max_seqs={self.max_seqs} sequences hold a state slot")
                slot = self._slot_of[seq.key] = heapq.heappop(self._free)
            if not past:
                self.conv[:, slot].zero_()
                self.recurrent[:, slot].zero_()
            bounds.append((seq.q_start, seq.q_start + seq.q_len, slot))
        starts = [first for first, _, _ in bounds] + [bounds[-1][1] if bounds else 0]
        device = self.conv.device
        self.step = StateStep(torch.tensor(starts, dtype=torch.int64, device=device),
                              torch.tensor([slot for _, _, slot in bounds], dtype=torch.int64, device=device), bounds)

    def release(self, key: int) -> None:
        slot = self._slot_of.pop(key, None)
        if slot is not None:
            heapq.heappush(self._free, slot)
