"""Weight-only quantization on PyTorch's own CPU kernels: int8 per output channel, int4 in groups.

`quantize_model(model, "int8" | "int4")` replaces every projection (and the LM head, tied or
not) by a module holding the packed weights; norms, the embedding lookup and attention stay in
the model's dtype. The kernels are `aten._weight_int8pack_mm` and
`aten._weight_int4pack_mm_for_cpu`. Both take their activations in bfloat16: measured on an AVX2
CPU (no AVX512), their float32-activation paths were 10x slower than float32 weights, while with
bfloat16 activations the LM head of a 49k vocabulary took 6.4 ms (int8) and 5.5 ms (int4) against
11.4 ms in float32. The activations are therefore rounded to bfloat16 at each projection's input
and the output returned in the model's dtype; the quality cost of that and of the weights is
measured in bench/quality.py, not assumed.

GGUF files bring their own codes: model/gguf_quant.py builds these modules from Q4_0, Q4_1,
Q4_K and Q8_0 blocks without going through float.
"""

from __future__ import annotations

import torch
from torch import nn

from tailrace.model.llama import LlamaForCausalLM, Module, replace_projections

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP_SIZE = 32  # GGUF's Q4_0 / Q4_1 block size, so those blocks map one to one
_INT4_OUT_TILE = 16
_ACT_DTYPE = torch.bfloat16


class Int8Linear(Module):
    """y = x @ (q * scale).T: q int8 [out, in], one scale per output row."""

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.register_buffer("weight", weight)
        self.register_buffer("scales", scales.to(_ACT_DTYPE))
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        w = weight.float()
        scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(_ACT_DTYPE), self.weight, self.scales).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int4Linear(Module):
    """y = x @ w.T with w = (q - 8) * scale + zero per group of INT4_GROUP_SIZE inputs, q in [0, 15]."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None) -> None:
        """q int32 [out, in] in [0, 15]; scales, zeros [out, in / group] as for `dequantize_int4`."""
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # The kernel's layout: [groups, out, (scale, zero)].
        pairs = torch.stack((scales, zeros), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", pairs.to(_ACT_DTYPE))
        self.bias = bias

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> "Int4Linear":
        """Asymmetric (min/max) groups: every group's range maps onto the 16 levels exactly."""
        out_features, in_features = weight.shape
        groups = weight.float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / 15).clamp(min=1e-12)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, 15)
        return cls(q.view(out_features, in_features).to(torch.int32), scales, low + 8 * scales, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_ACT_DTYPE), self.packed, INT4_GROUP_SIZE, self.scales_and_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The float weights an Int4Linear multiplies by (for tests and quality checks)."""
    out_features, in_features = q.shape
    groups = q.float().view(out_features, -1, INT4_GROUP_SIZE)
    return ((groups - 8) * scales[..., None] + zeros[..., None]).view(out_features, in_features)


def int4_packable(weight: torch.Tensor) -> bool:
    """The int4 kernel's shapes: whole groups along the input, outputs in tiles of 16."""
    out_features, in_features = weight.shape
    return in_features % INT4_GROUP_SIZE == 0 and out_features % _INT4_OUT_TILE == 0


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> nn.Module:
    kind = Int4Linear if method == "int4" and int4_packable(weight) else Int8Linear
    return kind.from_float(weight, bias)


def quantize_model(model: LlamaForCausalLM, method: str) -> LlamaForCausalLM:
    """Every projection and the LM head quantized in place from the loaded float weights. A
    projection the int4 kernel cannot take (see int4_packable) falls back to int8."""
    if model.dtype not in (torch.float32, _ACT_DTYPE):
        raise ValueError(f"quantization {method!r} needs float32 or bfloat16 compute, not {model.dtype}")
    if method not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")
    replace_projections(model, lambda weight, bias: quantize_linear(weight, bias, method))
    return model
