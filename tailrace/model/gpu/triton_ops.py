"""A CUDA model's RMSNorm, rotary embedding and SiLU(gate) * up as one Triton kernel each.

In eager PyTorch these take about 20 small kernels a layer (dtype casts, a reduction, a roll), each
a pass over memory. On an H200 they were 1.8 ms of a 5.8 ms batch-1 decode step of the Llama-3.1-8B
shape, and about 40% of the device time of a full batch's prefill and decode (`bash bench/gpu.sh
--profile` shows where the device time goes). Each kernel here reads its inputs once and writes
its output once, with the reference implementation's arithmetic in float32 and its rounding points
(the casts back to the model's dtype where llama.py's modules make them); only the order of the
norm's sum and the hardware's exp and rsqrt may differ, by float32 ulps (tests/test_triton_ops.py).

Used for bfloat16 and float16 models (model/backends.py): a float32 model on CUDA keeps PyTorch's
ops, so the CUDA path's greedy parity with the CPU path (tests/test_gpu.py) is checked on the
reference modules. Imported only where it may run (triton is not part of the CPU install).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tailrace.model.decoder.llama import LlamaForCausalLM, Module, RMSNorm, gelu_tanh_and_mul, replace_elementwise

_SILU_BLOCK = 1024  # output columns per program


def use_triton_ops(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every RMSNorm, rotary embedding and SiLU-and-multiply of the model through the kernels, in place."""
    return replace_elementwise(model, TritonRMSNorm, rotary, {"silu": silu_mul, "gelu_tanh": gelu_tanh_and_mul})


class TritonRMSNorm(Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dimension, as RMSNorm.forward rounds it."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)  # a view for the hidden states; q/k norms (Qwen3) may copy here
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), n, eps, BLOCK=block,
                                           num_warps=min(16, max(1, block // 256)))
    return out.view(x.shape)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary's x * cos + roll(x, D/2) * sin for x [T, H, D] (any strides with the last one
    1) and cos/sin [T, 1, D] float32 -> a new contiguous [T, H, D] of x's dtype."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    if tokens:
        block_h = min(triton.next_power_of_2(heads), max(1, 4096 // dim))
        grid = (tokens, triton.cdiv(heads, block_h))
        _rotary_kernel[grid](x, cos, sin, out, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0), heads,
                             HEAD_DIM=dim, BLOCK_H=block_h, num_warps=4)
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu_and_mul: SiLU of the first half of each row times its second half, [T, 2I] -> [T, I]."""
    tokens, width = gate_up.shape
    half = width // 2
    out = torch.empty((tokens, half), dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        grid = (tokens, triton.cdiv(half, _SILU_BLOCK))
        _silu_mul_kernel[grid](gate_up, out, gate_up.stride(0), half, BLOCK=_SILU_BLOCK, num_warps=4)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    valid = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=valid, other=0.0).to(tl.float32)
    scale = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / n + eps)
    normed = (x * scale).to(out_ptr.dtype.element_ty).to(tl.float32)  # RMSNorm casts back before the weight
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, stride_xt, stride_xh, stride_cos, stride_sin, heads,
                   HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr):
    token = tl.program_id(0)
    head = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_DIM)
    valid = (head < heads)[:, None]
    row = x_ptr + token * stride_xt + head[:, None] * stride_xh
    x = tl.load(row + dims[None, :], mask=valid, other=0.0).to(tl.float32)
    rolled = tl.load(row + ((dims + HEAD_DIM // 2) % HEAD_DIM)[None, :], mask=valid, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + token * stride_cos + dims)[None, :]
    sin = tl.load(sin_ptr + token * stride_sin + dims)[None, :]
    out = out_ptr + (token * heads + head[:, None]) * HEAD_DIM + dims[None, :]
    tl.store(out, (x * cos + rolled * sin).to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _silu_mul_kernel(in_ptr, out_ptr, stride_in, half, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < half
    gate = tl.load(in_ptr + token * stride_in + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + token * stride_in + half + cols, mask=valid, other=0.0).to(tl.float32)
    # F.silu rounds to the model's dtype before the product, as silu_and_mul's two ops do
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + token * half + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=valid)
