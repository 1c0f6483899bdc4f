"""Gated DeltaNet's two sequence operations, in PyTorch: the reference the CPU kernels
(csrc/gated_delta.cpp) are checked against, and the path of every other device.

Both run token by token in the recurrent form, for prefill too. The chunked (parallel) form that
GPU implementations use for prefill sums in a different order by where a 64-token chunk starts,
so a token's output would depend on how its prompt was split into steps; the recurrent form
gives each token the same arithmetic however the prompt is split or batched. On a CPU it costs
little: a token's update reads its heads' state (key_dim x value_dim floats each) about four
times, a few percent of the projections' multiply-adds.

Per sequence and value head h, with its q/k head (h // (value_heads / key_heads), or h % key_heads
where the file tiles the value heads):
  q, k = l2norm(q), l2norm(k) (float32, eps 1e-6); q = q / sqrt(key_dim)
  S = S * exp(g)                   decay, g = A * softplus(a + dt_bias) <= 0, A = -exp(A_log)
  delta = (v - S^T k) * beta       the part of v the state does not predict yet, beta = sigmoid(b)
  S = S + k delta^T
  out = S^T q
as transformers' torch_recurrent_gated_delta_rule computes it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tailrace.model.attention.state_cache import StateStep


def causal_conv(x: torch.Tensor, weight: torch.Tensor, states: torch.Tensor, step: StateStep) -> torch.Tensor:
    """Each sequence's rows of x [T, C] (the model's dtype) through its causal depthwise
    convolution (weight [C, kernel]) and SiLU; `states` [rows, kernel - 1, C] holds each slot's
    last inputs, oldest first, and is advanced in place (and the inputs before a captured
    boundary copied to its row). Each output sums its kernel products in float32 from the oldest
    input, rounds to the dtype, and goes through SiLU."""
    kernel = weight.shape[1]
    w = weight.float()
    out = torch.empty_like(x)
    for first, end, slot, captured, row in step.bounds:
        window = torch.cat((states[slot], x[first:end])).float()  # [kernel - 1 + n, C]
        n = end - first
        if captured:
            states[row] = window[captured:captured + kernel - 1].to(states.dtype)
        acc = window[0:n] * w[:, 0]
        for j in range(1, kernel):
            acc = acc + window[j:j + n] * w[:, j]
        out[first:end] = F.silu(acc.to(x.dtype))
        states[slot] = window[n:].to(states.dtype)
    return out


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               decay_rate: torch.Tensor, dt_bias: torch.Tensor, tiled: bool, states: torch.Tensor,
               step: StateStep) -> torch.Tensor:
    """The gated delta rule over each sequence's rows: q, k [T, key_heads, key_dim], v [T,
    value_heads, value_dim], the gates' inputs a, b [T, value_heads] with the decay rate A
    (-exp(A_log), float32) and dt_bias [value_heads]; value head h reads q/k head h % key_heads
    where `tiled`, else h // (value_heads / key_heads); `states` [rows, value_heads, key_dim,
    value_dim] float32, advanced in place (and the state at a captured boundary copied to its
    row). Returns [T, value_heads, value_dim] float32."""
    g = decay_rate * F.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b)
    groups = v.shape[1] // q.shape[1]
    scale = q.shape[-1] ** -0.5
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    for first, end, slot, captured, row in step.bounds:
        s = states[slot]
        for t in range(first, end):
            q_t, k_t = _l2norm(q[t].float()) * scale, _l2norm(k[t].float())
            q_t, k_t = (x.repeat(groups, 1) if tiled else x.repeat_interleave(groups, 0) for x in (q_t, k_t))
            s = s * g[t].exp()[:, None, None]
            remembered = (s * k_t[:, :, None]).sum(1)
            delta = (v[t].float() - remembered) * beta[t].float()[:, None]
            s = s + k_t[:, :, None] * delta[:, None, :]
            out[t] = (s * q_t[:, :, None]).sum(1)
            if t + 1 == first + captured:
                states[row] = s
        states[slot] = s
    return out
