"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in) dequantized, or as the E2M1 codes
and scales tailrace's integer kernel takes as they are (model/cpu/int_linear.py).

A block is 32 values of 4 bits (FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit) sharing one scale
of 8 bits, a power of two (E8M0: 2^(s - 127)). Hugging Face checkpoints keep a tensor as
`*_blocks` [..., blocks, 16] uint8, two values a byte with the first in the low nibble, and
`*_scales` [..., blocks] uint8.
"""

from __future__ import annotations

import torch

from tailrace.model.quant import FP4_VALUES

_LARGEST_EXPONENT = 143  # a scale of 2^15 once halved (e2m1_codes): float16's largest power of two


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] (uint8) -> float32 [..., G * 32]."""
    _check(blocks, scales)
    values = torch.tensor(FP4_VALUES, dtype=torch.float32)[_codes(blocks).long()]
    values = values.reshape(*scales.shape, 32) * torch.exp2(scales.float() - 127.0)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)


def e2m1_codes(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [..., G, 16] and scales [..., G] -> each value's E2M1 code (uint8 0..15) [..., G * 32]
    and each block's scale halved, float32 [..., G]: the code's value doubled (a whole number)
    times it is the weight (quant.IntWeight with e2m1)."""
    _check(blocks, scales)
    return _codes(blocks), e2m1_scales(scales)


def _codes(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] -> their E2M1 codes in order [..., G * 32]: a byte's low nibble first."""
    return torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-2], -1)


def e2m1_scales(exponents: torch.Tensor) -> torch.Tensor:
    """E8M0 exponents e (uint8) -> 2^(e - 128) in float32, for a kernel that keeps them in float16,
    whose subnormals reach 2^-24: a smaller scale (its weights below 12 x 2^-25 = 3.6e-7) rounds to
    zero there; one past float16's range is refused."""
    if exponents.numel() and int(exponents.max()) > _LARGEST_EXPONENT:
        raise ValueError(f"an MXFP4 block's scale 2^{int(exponents.max()) - 127} is past float16's range")
    return torch.exp2(exponents.float() - 128.0)


def _check(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] must be uint8; got {tuple(blocks.shape)} "
                         f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
