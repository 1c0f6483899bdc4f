"""A decoder layer's elementwise steps through tailrace's CPU kernels (csrc/elementwise.cpp).

In eager PyTorch, RMSNorm, the rotary embedding and SiLU(gate) * up take about 20 small ops a
layer (dtype casts, a reduction, a roll), and at one decode row each op's dispatch costs more
than its arithmetic. Each kernel is one call with the reference implementation's rounding
points; bfloat16 results are bitwise the eager ones (tests/test_cpu_ops.py).
"""

from __future__ import annotations

import torch

from tailrace.model.cpu_kernels import kernels
from tailrace.model.cpu_linear import pack_linears, packable
from tailrace.model.llama import MLP, Attention, LlamaForCausalLM, Module, RMSNorm, replace_modules

DTYPES = (torch.float32, torch.bfloat16)


class KernelRMSNorm(Module):
    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.weight = norm.weight
        self.eps = norm.eps
        self._rms_norm = kernels().rms_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._rms_norm(x, self.weight, self.eps)


def usable(model: LlamaForCausalLM, device: torch.device) -> bool:
    """On the CPU, at a dtype the kernels take, with head_dim a multiple of 32 (the rotary kernel's
    runs of 16 lanes never straddle the half-way roll)."""
    return (device.type == "cpu" and model.dtype in DTYPES and model.config.head_dim % 32 == 0
            and kernels() is not None)


def use_cpu_kernels(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Every RMSNorm, rotary embedding and SiLU-and-multiply of the model through the kernels, in place."""
    ops = kernels()
    replace_modules(model, RMSNorm, KernelRMSNorm)
    for module in model.modules():
        if isinstance(module, Attention):
            module.rotate = ops.rotary
        elif isinstance(module, MLP):
            module.act_and_mul = ops.silu_mul
    return model


def prepare(model: LlamaForCausalLM, device: torch.device, quantization: str | None) -> LlamaForCausalLM:
    """What a loaded model gets before it serves, where it helps on this device: projections packed
    (unless quantized), then the elementwise kernels."""
    if quantization is None and packable(model.dtype, device):
        pack_linears(model)
    if usable(model, device):
        use_cpu_kernels(model)
    return model
