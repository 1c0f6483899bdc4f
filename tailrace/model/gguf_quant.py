"""GGUF's quantized weights as tailrace's int4 projections, from their blocks, without float weights.

Q4_0, Q4_1 and Q4_K store 4-bit codes with one scale and one offset per 32 inputs, which is what
`Int4Linear` runs: w = (q - 8) * scale + zero per group of 32. Each block's codes go to the kernel
as they are; only the per-group scale and zero are computed, from the block's fp16 fields:

- Q4_0: w = (q - 8) * d                 -> scale d,      zero 0
- Q4_1: w = q * d + m                   -> scale d,      zero m + 8 d
- Q4_K: w = d * sc * q - dmin * mn      -> scale d * sc, zero 8 d sc - dmin mn (per sub-block of 32)

Q8_0 (w = q * d, int8 q, one d per 32 inputs) does not fit `Int8Linear`, whose scale is per row.
Requantizing each row to its largest block scale was measured against the split below on a
1536x576 weight (std 0.02), 32 bfloat16 rows, output error relative to gguf's dequantization:
0.78% vs 0.23% (Q8_0's own error against the float weight: 0.53%), and 2.4% vs 0.23% once every
97th input column is 8x larger, as real projections' outlier features are. Requantizing would
throw away most of what Q8_0 keeps, so its int8 codes are split exactly into two 4-bit halves:
q + 128 = 16 hi + lo, w = (hi - 8) * 16 d + (lo - 8) * d + 8 d. Both halves sit side by side in one
`Int4Linear` twice as wide, fed the input twice (`SplitInt8Linear`). The price is twice the int4
kernel's work: 12.3 ms against 9.8 ms for a per-row Int8Linear on a 49152x576 head at 1 row.

The kernels keep scales and zeros in bfloat16, so a dequantized weight matches gguf's own
dequantization up to that rounding of each group's scale and zero (fp16 -> bf16: 3 mantissa bits).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, ReaderTensor

from tailrace.model import gguf
from tailrace.model.llama import LlamaForCausalLM, Module
from tailrace.model.quant import INT4_GROUP_SIZE, Int4Linear, int4_packable

# Codes, scales and zeros as `Int4Linear` takes them: q [out, in] in 0..15, the rest [out, in / 32].
Int4Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MAPPED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)
_K_SCALE_BYTES = 12  # Q4_K's 6-bit scales and mins of its 8 sub-blocks
# A layer's projection -> the GGUF tensors whose rows it stacks, in order.
_PROJECTION_PARTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
}


class SplitInt8Linear(Module):
    """A Q8_0 weight as one Int4Linear over [high nibbles | low nibbles], applied to [x | x]."""

    def __init__(self, halves: Int4Linear) -> None:
        super().__init__()
        self.halves = halves
        self.out_features, self.in_features = halves.out_features, halves.in_features // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.halves(torch.cat((x, x), dim=-1))


def use_gguf_blocks(model: LlamaForCausalLM, reader: GGUFReader) -> list[str]:
    """Every projection (and the LM head) whose GGUF tensors share one mapped type, replaced in
    place by its quantized module built from the file's blocks; the others keep the float weights
    the loader dequantized. CPU only (the int4 kernel's). Returns the replaced projections' names."""
    tensors = {t.name: t for t in reader.tensors}
    rotary_heads = _rotary_heads(reader)
    replaced = []
    for i, layer in enumerate(model.model.layers):
        for (block, name), parts in _PROJECTION_PARTS.items():
            parent = getattr(layer, block)
            bias = getattr(parent, name).bias
            module = stacked_linear([tensors[f"blk.{i}.{part}.weight"] for part in parts], rotary_heads,
                                 None if bias is None else bias.detach())
            if module is not None:
                setattr(parent, name, module)
                replaced.append(f"model.layers.{i}.{block}.{name}")
    head = stacked_linear([tensors.get("output.weight", tensors["token_embd.weight"])], rotary_heads, None)
    if head is not None:
        model.lm_head = head
        replaced.append("lm_head")
    return replaced


def stacked_linear(parts: list[ReaderTensor], rotary_heads: dict[str, int],
                bias: torch.Tensor | None) -> Int4Linear | SplitInt8Linear | None:
    """One projection over the parts' rows stacked: rows are independent in every block format, so
    stacking raw rows is exact, as long as the parts share one mapped type (else None). A Q4_K_M
    file's Q6_K attn_v, for one, leaves its fused qkv_proj in float."""
    if len({part.tensor_type for part in parts}) != 1 or parts[0].tensor_type not in MAPPED_TYPES:
        return None
    rows = []
    for part in parts:
        kind = part.name.split(".")[-2]
        raw = np.asarray(part.data)
        rows.append(unpermute_rotary_rows(raw, rotary_heads[kind]) if kind in rotary_heads else raw)
    raw = np.concatenate(rows)
    block_size, type_size = GGML_QUANT_SIZES[parts[0].tensor_type]
    return quantized_linear(parts[0].tensor_type, raw, (raw.shape[0], raw.shape[1] // type_size * block_size), bias)


def _rotary_heads(reader: GGUFReader) -> dict[str, int]:
    """The head counts llama.cpp permuted q and k rows by: only for llama (see gguf.checkpoint_tensors)."""
    arch = gguf.architecture(reader)
    if arch != "llama":
        return {}
    heads = gguf.metadata(reader, f"{arch}.attention.head_count")
    return {"attn_q": heads, "attn_k": gguf.metadata(reader, f"{arch}.attention.head_count_kv", heads)}


def quantized_linear(tensor_type: Q, raw: np.ndarray, shape: tuple[int, int],
                     bias: torch.Tensor | None = None) -> Int4Linear | SplitInt8Linear | None:
    """The projection for a GGUF weight of `shape` (out, in) from its raw bytes; None when its type
    has no block-for-block mapping or its shape does not fit the int4 kernel (load it as float)."""
    if tensor_type not in MAPPED_TYPES or not int4_packable(torch.empty(shape, device="meta")):
        return None
    if tensor_type == Q.Q8_0:
        return SplitInt8Linear(Int4Linear(*decode_q8_0_halves(raw, shape), bias))
    return Int4Linear(*decode_int4(tensor_type, raw, shape), bias)


def decode_int4(tensor_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> Int4Weights:
    """(q, scales, zeros) of a Q4_0, Q4_1 or Q4_K weight with `shape` (out, in)."""
    q, scales, zeros = _INT4_DECODERS[tensor_type](_blocks(raw, tensor_type))
    out_features, in_features = shape
    groups = (out_features, in_features // INT4_GROUP_SIZE)
    return (torch.from_numpy(q).reshape(shape).to(torch.int32),
            torch.from_numpy(scales).reshape(groups), torch.from_numpy(zeros).reshape(groups))


def decode_q8_0_halves(raw: np.ndarray, shape: tuple[int, int]) -> Int4Weights:
    """A Q8_0 weight [out, in] as the int4 weight [out, 2 in] whose halves sum to it (module doc)."""
    blocks = _blocks(raw, Q.Q8_0)
    d = _fp16(blocks, 0)
    codes = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    out_features, in_features = shape
    rows, groups = (out_features, in_features), (out_features, in_features // INT4_GROUP_SIZE)
    high, low = (torch.from_numpy(c).reshape(rows) for c in (codes >> 4, codes & 0x0F))
    d = torch.from_numpy(d).reshape(groups)
    q = torch.cat((high, low), dim=1).to(torch.int32)
    return q, torch.cat((16 * d, d), dim=1), torch.cat((torch.zeros_like(d), 8 * d), dim=1)


def decode_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, np.zeros_like(d)


def decode_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    return _nibbles(blocks[:, 4:], 16), d, m + 8 * d


def decode_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sub-block of 32: [n, 256] codes and [n, 8] scales and zeros."""
    d, dmin = _fp16(blocks, 0)[:, None], _fp16(blocks, 2)[:, None]
    sc, mn = _q4_k_scales_and_mins(blocks[:, 4:4 + _K_SCALE_BYTES])
    scales = d * sc
    return _nibbles(blocks[:, 4 + _K_SCALE_BYTES:], 32), scales, 8 * scales - dmin * mn


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: sub-blocks 0-3 have 6-bit scales in bytes 0-3 and mins in 4-7;
    4-7 have their low 4 bits in bytes 8-11 (scale low, min high) and their top 2 bits in the top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate((low & 0x3F, (extra & 0x0F) | ((low >> 6) << 4)), axis=1)
    mn = np.concatenate((high & 0x3F, (extra >> 4) | ((high >> 6) << 4)), axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _nibbles(packed: np.ndarray, chunk: int) -> np.ndarray:
    """Each run of `chunk` bytes holds 2 * chunk codes: its low nibbles first, then its high ones."""
    runs = packed.reshape(packed.shape[0], -1, 1, chunk)
    return np.concatenate((runs & 0x0F, runs >> 4), axis=2).reshape(packed.shape[0], -1)


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, as float32."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16)[:, 0].astype(np.float32)


def _blocks(raw: np.ndarray, tensor_type: Q) -> np.ndarray:
    type_size = GGML_QUANT_SIZES[tensor_type][1]
    return np.asarray(raw, dtype=np.uint8).reshape(-1, type_size)


def unpermute_rotary_rows(raw: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of llama.cpp's `LlamaModel.permute` on a quantized q/k weight's raw rows: each
    row's blocks hold only that row, so moving whole rows back is exact. Within each head, rows
    (0, 2, 4, ..., 1, 3, 5, ...) go back to (0, 1, 2, ...)."""
    rows = np.asarray(raw).reshape(raw.shape[0], -1)
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).swapaxes(1, 2).reshape(rows.shape)


_INT4_DECODERS = {Q.Q4_0: decode_q4_0, Q.Q4_1: decode_q4_1, Q.Q4_K: decode_q4_k}
