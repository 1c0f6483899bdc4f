"""Weight-only quantization: int8 per output channel, int4 in groups of 32, quantized at load.

A quantized weight is an `IntWeight`: integer codes with w = codes * scales + zeros, one scale
per output row (int8) or per row and group of 32 inputs (int4, and GGUF's blocks, which
model/loading/gguf_quant.py reads into the same form without going through float). `linear_for` turns one
into the module that multiplies by it:

- on CPUs with AVX512-VNNI or AVX2, tailrace's kernel (model/cpu/int_linear.py), which takes every form as it
  is, scales in float16;
- elsewhere PyTorch's own kernels, `aten._weight_int8pack_mm` (per-row scales) and
  `aten._weight_int4pack_mm_for_cpu` (groups), with bfloat16 activations and scales. Measured on
  an AVX2 CPU, their float32-activation paths were 10x slower than float32 weights, while with
  bfloat16 activations the LM head of a 49k vocabulary took 6.4 ms (int8) and 5.5 ms (int4)
  against 11.4 ms in float32.

`quantize_model(model, "int8" | "int4")` replaces every projection (and the LM head, tied or not)
this way; norms, the embedding lookup and attention stay in the model's dtype. What it costs in
quality is measured in bench/quality.py, not assumed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tailrace.model.cpu import int_linear
from tailrace.model.decoder.llama import LlamaForCausalLM, Module, replace_projections
from tailrace.model.options import QUANTIZATIONS

INT4_GROUP_SIZE = 32  # GGUF's block size, so its blocks map one to one
# The 16 E2M1 codes' values (MXFP4's, model/loading/mxfp4.py), the sign in bit 3.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The same doubled: whole numbers, which integer kernels multiply exactly.
E2M1_DOUBLED = torch.tensor(FP4_VALUES) * 2
_INT4_OUT_TILE = 16
_ACT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class IntWeight:
    """w = codes * scales + zeros, scales and zeros repeated over each group of inputs; with `e2m1`,
    w = E2M1_DOUBLED[codes] * scales (MXFP4's blocks: scales half their power of two, no zeros).

    With `sub` (GGUF's K-quant blocks), integer scales per sub-block of 32 or 16 inputs under a
    float scale per super-block: w = scales * sub * (codes - offset) + zeros * mins, where offset is 0
    with mins and half the codes' range without (Q6_K's 32, Q3_K's codes kept as q + 8)."""

    codes: torch.Tensor  # [out, in]: int8, or uint8 below 2^width
    scales: torch.Tensor  # [out, groups] float32: groups 1 (per row) or in / INT4_GROUP_SIZE, or per super-block
    zeros: torch.Tensor | None  # like scales, or None for none
    e2m1: bool = False
    sub: torch.Tensor | None = None  # [out, in / 32 or in / 16] int8, or None
    mins: torch.Tensor | None = None  # like sub, or None
    width: int = 4  # bits of the uint8 codes: 4, 5 or 6

    @property
    def bits(self) -> int:
        return 8 if self.codes.dtype == torch.int8 else self.width

    @property
    def offset(self) -> int:
        return 0 if self.mins is not None or self.sub is None else 1 << (self.width - 1)

    def dequantize(self) -> torch.Tensor:
        out_features, in_features = self.codes.shape
        values = E2M1_DOUBLED[self.codes.long()] if self.e2m1 else self.codes.float() - self.offset
        if self.sub is None:
            groups = values.view(out_features, self.scales.shape[1], -1) * self.scales[..., None]
            if self.zeros is not None:
                groups = groups + self.zeros[..., None]
            return groups.view(out_features, in_features)
        per_sub = in_features // self.sub.shape[1]
        def spread(t: torch.Tensor) -> torch.Tensor:  # a super-block's value to each of its sub-blocks
            return t.repeat_interleave(self.sub.shape[1] // t.shape[1], dim=1)
        subs = values.view(out_features, -1, per_sub) * (spread(self.scales) * self.sub.float())[..., None]
        if self.mins is not None:
            subs = subs + (spread(self.zeros) * self.mins.float())[..., None]
        return subs.view(out_features, in_features)

    def grouped(self) -> IntWeight | None:
        """The same weights as codes of at most 8 bits with a float scale (and zero) per row or per
        group of 32, PyTorch's kernels' forms (the scale products then round to their type), or
        None where there is none: E2M1 codes, codes of 5 or 6 bits, scales per 16 inputs, or
        integer scales without mins."""
        if self.e2m1 or self.width > 4:
            return None
        if self.sub is None:
            return self
        if self.sub.shape[1] * INT4_GROUP_SIZE != self.codes.shape[1] or self.mins is None:
            return None
        spread = self.sub.shape[1] // self.scales.shape[1]
        return IntWeight(self.codes, self.scales.repeat_interleave(spread, dim=1) * self.sub.float(),
                         self.zeros.repeat_interleave(spread, dim=1) * self.mins.float())


def _float16_at_least(values: torch.Tensor) -> torch.Tensor:
    """values rounded up to float16 (as float32), at least its smallest normal: a scale that still
    spans its range once stored in the kernel's type."""
    half = values.clamp(min=torch.finfo(torch.float16).tiny).half()
    short = half.float() < values
    return torch.where(short, half.nextafter(torch.tensor(torch.inf, dtype=torch.float16)), half).float()


def quantize_int8(weight: torch.Tensor) -> IntWeight:
    """Symmetric per row: codes in -127..127, the row's largest magnitude at 127."""
    w = weight.detach().float()
    scales = _float16_at_least(w.abs().amax(dim=1, keepdim=True) / 127)
    codes = torch.round(w / scales).clamp(-127, 127).to(torch.int8)
    return IntWeight(codes, scales, None)


def quantize_int4(weight: torch.Tensor) -> IntWeight:
    """Asymmetric (min/max) groups of 32: each group's range maps onto the 16 levels."""
    out_features, in_features = weight.shape
    groups = weight.detach().float().view(out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    zeros = groups.amin(dim=-1).half().float()
    scales = _float16_at_least((groups.amax(dim=-1) - zeros) / 15)
    codes = torch.round((groups - zeros[..., None]) / scales[..., None]).clamp(0, 15).to(torch.uint8)
    return IntWeight(codes.view(out_features, in_features), scales, zeros)


class Int8Linear(Module):
    """PyTorch's int8 kernel: y = x @ (q * scale).T, q int8 [out, in], one scale per output row."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("weight", weight.codes)
        self.register_buffer("scales", weight.scales[:, 0].to(_ACT_DTYPE))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(x.to(_ACT_DTYPE), self.weight, self.scales).to(x.dtype)
        return out if self.bias is None else out + self.bias


class Int4Linear(Module):
    """PyTorch's int4 kernel, which computes w = (q - 8) * scale + zero': zero' = zero + 8 scale."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            weight.codes.to(torch.int32), 1))
        zeros = 8 * weight.scales if weight.zeros is None else weight.zeros + 8 * weight.scales
        # The kernel's layout: [groups, out, (scale, zero)].
        pairs = torch.stack((weight.scales, zeros), dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", pairs.to(_ACT_DTYPE))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(_ACT_DTYPE), self.packed, INT4_GROUP_SIZE, self.scales_and_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias


class SplitInt8Linear(Module):
    """Grouped int8 codes (GGUF's Q8_0) on PyTorch's int4 kernel, which is the grouped one: each code
    split exactly into two 4-bit halves, c + 128 = 16 hi + lo, so w = hi * 16 d + lo * d - 128 d.
    The halves sit side by side in one Int4Linear twice as wide, fed the input twice. Requantizing
    each row to one scale was measured to lose most of what Q8_0 keeps: output error against gguf's
    dequantization 0.78% vs 0.23% on a 1536x576 weight, 2.4% vs 0.23% once every 97th input column
    is 8x larger, as real projections' outlier features are."""

    def __init__(self, weight: IntWeight, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.codes.shape
        unsigned = (weight.codes.to(torch.int16) + 128).to(torch.uint8)
        d = weight.scales
        halves = IntWeight(torch.cat((unsigned >> 4, unsigned & 0x0F), dim=1), torch.cat((16 * d, d), dim=1),
                           torch.cat((torch.zeros_like(d), -128 * d), dim=1))
        self.halves = Int4Linear(halves, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.halves(torch.cat((x, x), dim=-1))


def int4_packable(out_features: int, in_features: int) -> bool:
    """PyTorch's int4 kernel's shapes: whole groups along the input, outputs in tiles of 16."""
    return in_features % INT4_GROUP_SIZE == 0 and out_features % _INT4_OUT_TILE == 0


def takes_grouped(out_features: int, in_features: int) -> bool:
    """Whether linear_for has a kernel here for a weight of this shape with scales per 32 inputs."""
    return (int_linear.available() and int_linear.takes(in_features)) or int4_packable(out_features, in_features)


def linear_for(weight: IntWeight, bias: torch.Tensor | None) -> nn.Module | None:
    """The module multiplying by `weight` here, or None where no kernel takes its shape, or, where
    tailrace's kernel cannot run, PyTorch's take no form of it (IntWeight.grouped says which)."""
    out_features, in_features = weight.codes.shape
    if int_linear.available() and int_linear.takes(in_features):
        return int_linear.IntLinear(weight.codes, weight.scales, weight.zeros, bias, e2m1=weight.e2m1,
                                    sub=weight.sub, mins=weight.mins, width=weight.width)
    weight = weight.grouped()
    if weight is None:
        return None
    if weight.bits == 8 and weight.scales.shape[1] == 1:
        return Int8Linear(weight, bias)
    if not int4_packable(out_features, in_features):
        return None
    return Int4Linear(weight, bias) if weight.bits == 4 else SplitInt8Linear(weight, bias)


def quantize_linear(weight: torch.Tensor, bias: torch.Tensor | None, method: str) -> nn.Module:
    """int4 where a kernel takes the shape, int8 otherwise (which every shape fits)."""
    if method == "int4":
        module = linear_for(quantize_int4(weight), bias) if weight.shape[1] % INT4_GROUP_SIZE == 0 else None
        if module is not None:
            return module
    return linear_for(quantize_int8(weight), bias)  # per-row int8 always has a kernel


def check_quantization(model: LlamaForCausalLM, method: str) -> None:
    if model.dtype not in (torch.float32, _ACT_DTYPE):
        raise ValueError(f"quantization {method!r} needs float32 or bfloat16 compute, not {model.dtype}")
    if method not in QUANTIZATIONS:
        raise ValueError(f"unsupported quantization {method!r}; supported: {', '.join(QUANTIZATIONS)}")


def quantize_model(model: LlamaForCausalLM, method: str) -> LlamaForCausalLM:
    """Every projection and the LM head quantized in place from the loaded float weights."""
    check_quantization(model, method)
    replace_projections(model, lambda weight, bias: quantize_linear(weight, bias, method))
    return model
