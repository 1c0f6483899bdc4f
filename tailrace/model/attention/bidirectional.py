"""An encoder's attention: every row of a sequence attends every row of the same sequence, the
whole sequence in this step (the scheduler runs an encoder's prompt whole), and nothing is kept.
Each sequence attends alone, on tensors of its own length, so a row's result does not depend on
what else is in the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrace.model.attention.kv_cache import AttentionBatch


def attend_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch,
                 scale: float, window: int | None = None) -> torch.Tensor:
    """q [T, heads, D], k and v [T, kv_heads, D] of the step's rows -> [T, heads, D]; with a
    `window`, a query sees only the keys less than `window` positions from it, either side."""
    out = q.new_empty(q.shape)
    groups = q.shape[1] // k.shape[1]
    for seq in batch.seqs:
        if seq.q_len != seq.kv_len:
            raise RuntimeError("an encoder's sequence must run whole in one step")
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        # [1, heads, len, D]: four dimensions, which PyTorch's fused CPU kernel takes (three go
        # through its unfused reference, several times slower)
        sq, sk, sv = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if groups > 1:
            sk, sv = sk.repeat_interleave(groups, 1), sv.repeat_interleave(groups, 1)
        mask = None
        if window is not None and seq.q_len > window:
            at = torch.arange(seq.q_len, device=q.device)
            mask = (at[:, None] - at[None, :]).abs() < window
        out[rows] = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask, scale=scale)[0].transpose(0, 1)
    return out
