"""MXFP4 (the OCP microscaling format gpt-oss's experts ship in) dequantized.

A block is 32 values of 4 bits (FP4 E2M1: sign, 2 exponent bits, 1 mantissa bit) sharing one scale
of 8 bits, a power of two (E8M0: 2^(s - 127)). Hugging Face checkpoints keep a tensor as
`*_blocks` [..., blocks, 16] uint8, two values a byte with the first in the low nibble, and
`*_scales` [..., blocks] uint8.
"""

from __future__ import annotations

import torch

# The 16 E2M1 codes' values, the sign in bit 3.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] (uint8) -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.shape[-1] != 16 \
            or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks [..., G, 16] and scales [..., G] must be uint8; got {tuple(blocks.shape)} "
                         f"{blocks.dtype} and {tuple(scales.shape)} {scales.dtype}")
    table = torch.tensor(FP4_VALUES, dtype=torch.float32)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    values = values.reshape(*blocks.shape[:-1], 32) * torch.exp2(scales.float() - 127.0)[..., None]
    return values.reshape(*blocks.shape[:-2], -1)
