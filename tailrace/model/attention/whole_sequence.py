"""Attention within the step, keeping nothing: each sequence runs whole in this step (the
scheduler runs such a prompt whole), its rows attending the rows of the same sequence, every one
for an encoder or those up to their own for a causal model whose cache keeps no K/V (a server that
only pools). Each sequence attends alone, on tensors of its own length, so a row's result does not
depend on what else is in the batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrace.model.attention.kv_cache import AttentionBatch, LayerAttention


def attend_whole(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: AttentionBatch, how: LayerAttention,
                 causal: bool = False) -> torch.Tensor:
    """q [T, heads, D], k and v [T, kv_heads, D] of the step's rows -> [T, heads, D]. With a
    window, a query sees the keys less than `how.window` positions from it: either side, or with
    `causal` back from itself (its own included), as the KV cache's attention sees them."""
    if how.softcap is not None or how.sinks:
        raise RuntimeError("attention within the step takes no soft cap or sinks")
    out = q.new_empty(q.shape)
    groups = q.shape[1] // k.shape[1]
    window = how.window
    for seq in batch.seqs:
        if seq.q_len != seq.kv_len:
            raise RuntimeError("a sequence keeping no K/V must run whole in one step")
        rows = slice(seq.q_start, seq.q_start + seq.q_len)
        # [1, heads, len, D]: four dimensions, which PyTorch's fused CPU kernel takes (three go
        # through its unfused reference, several times slower)
        sq, sk, sv = (t[rows].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        if groups > 1:
            sk, sv = sk.repeat_interleave(groups, 1), sv.repeat_interleave(groups, 1)
        mask = None
        if window is not None and seq.q_len > window:
            at = torch.arange(seq.q_len, device=q.device)
            back = at[:, None] - at[None, :]
            mask = ((back >= 0) & (back < window)) if causal else back.abs() < window
        attended = F.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask, scale=how.scale,
                                                  is_causal=causal and mask is None)
        out[rows] = attended[0].transpose(0, 1)
    return out
