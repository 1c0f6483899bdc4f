"""gpt-oss checkpoints with MXFP4 experts, as OpenAI ships them, written here: a float tensor
quantized to MXFP4 blocks (each 32 values over a power-of-two scale, rounded to the nearest E2M1
value), and a saved checkpoint's experts replaced by their blocks and scales."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailrace.model.loading.mxfp4 import dequantize_mxfp4
from tailrace.model.quant import FP4_VALUES


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., K] (K a multiple of 32) -> blocks [..., K / 32, 16] and scales [..., K / 32], uint8."""
    groups = weight.float().reshape(*weight.shape[:-1], -1, 32)
    largest = groups.abs().amax(dim=-1).clamp(min=2.0**-120)
    exponent = torch.ceil(torch.log2(largest / 6.0)).clamp(-127, 127)
    table = torch.tensor(FP4_VALUES)
    codes = ((groups / torch.exp2(exponent)[..., None])[..., None] - table).abs().argmin(dim=-1).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + 127).to(torch.uint8)


def write_mxfp4_experts(directory: Path, model: torch.nn.Module) -> None:
    """The saved gpt-oss checkpoint in `directory` with every layer's experts as MXFP4 blocks and
    scales (stored [experts, out, in / 32, ...], as released), and `model`'s experts set to what
    they dequantize to, so that it stays the reference."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(tensors.pop(name).transpose(1, 2).contiguous())
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        with torch.no_grad():
            model.get_parameter(name).copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file(tensors, path, metadata={"format": "pt"})
