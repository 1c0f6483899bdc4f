"""The flat batch of one step: token id, position and KV slot of every scheduled token.

They are written once per step into one host buffer laid out [ids | positions | slots] and reach
the device in one copy (pinned and non_blocking on CUDA); on CPU the tensors are views of the
host buffer itself. Python loops over sequences and over the blocks of a chunk, never over its
tokens.

A decode batch can be padded to a CUDA-graph size with padding sequences: each is one token (id
0, position 0) that owns only the scratch block, a block the block manager never hands out, and
attends to its own K/V there. A padded batch is an ordinary batch to attention, and no real
sequence ever reads the scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tailrace.engine.scheduler import ScheduledSeq
from tailrace.model.attention.kv_cache import AttentionBatch, SeqSlice

PADDING_KEY = -1  # the SeqSlice key of padding sequences; no engine sequence has a negative id


@dataclass(slots=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64, padding rows included
    positions: torch.Tensor  # [T] int64
    batch: AttentionBatch  # the scheduled sequences in order, then the padding ones


class StepInputBuilder:
    """Builds each step's StepInputs into buffers allocated once; on CUDA the device buffer keeps
    its address, so the views of a given size are the same tensors every step (what a CUDA graph
    reads). A buffer is rewritten by the next `build`: the caller must be done with the last step
    (on CUDA: its results read back) before building the next."""

    def __init__(self, max_tokens: int, block_size: int, scratch_block: int | None, device: torch.device) -> None:
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.scratch_block = scratch_block  # None: this cache has none, so no padding
        on_cuda = device.type == "cuda"
        self._host = torch.zeros(3 * max_tokens, dtype=torch.int64, pin_memory=on_cuda)
        self._host_np = self._host.numpy()
        self._device = torch.zeros(3 * max_tokens, dtype=torch.int64, device=device) if on_cuda else self._host

    def build(self, scheduled: list[ScheduledSeq], pad_to: int = 0) -> StepInputs:
        """The step's inputs; with pad_to, padding sequences follow until there are pad_to in all."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        slices: list[SeqSlice] = []
        bs = self.block_size
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            end = start + n
            table = seq.block_table
            slices.append(SeqSlice(seq.seq_id, len(ids), n, end, table, seq.table_version, seq.state_key, item.capture))
            if n == 1:  # a decode row, most rows of most steps: no slices or ranges to build
                ids.append(seq.token_at(start))
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
                continue
            ids += seq.token_slice(start, end - len(item.draft))
            ids += item.draft  # guesses to verify follow the known tokens
            positions += range(start, end)
            for block in range(start // bs, -(-end // bs)):
                offset = (table[block] - block) * bs  # slot of position p in this block: p + offset
                slots += range(max(start, block * bs) + offset, min(end, (block + 1) * bs) + offset)
        pad = pad_to - len(slices)
        if pad > 0:
            if self.scratch_block is None:
                raise RuntimeError("padding needs a scratch block, and this KV cache has none")
            table = [self.scratch_block]
            slices += [SeqSlice(PADDING_KEY, len(ids) + j, 1, 1, table) for j in range(pad)]
            ids += [0] * pad
            positions += [0] * pad
            slots += [self.scratch_block * bs] * pad
        return self._send(ids, positions, slots, slices)

    def _send(self, ids: list[int], positions: list[int], slots: list[int], slices: list[SeqSlice]) -> StepInputs:
        t = len(ids)
        if t > self.max_tokens:
            raise ValueError(f"a step of {t} tokens is over the input buffers' {self.max_tokens}")
        host = self._host_np
        host[:t] = ids
        host[t : 2 * t] = positions
        host[2 * t : 3 * t] = slots
        flat = self._device
        if flat is not self._host:
            flat[: 3 * t].copy_(self._host[: 3 * t], non_blocking=True)
        return StepInputs(flat[:t], flat[t : 2 * t], AttentionBatch(slices, flat[2 * t : 3 * t]))
