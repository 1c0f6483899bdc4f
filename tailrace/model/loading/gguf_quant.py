"""GGUF's quantized weights as tailrace's integer projections, from their blocks, without float weights.

Every mapped block type is codes with a scale and an offset per 32 inputs, which is what an
`IntWeight` holds (w = codes * scale + zero per group of 32). Each block's codes go to the kernel
as they are; only the per-group scale and zero are computed, from the block's fp16 fields:

- Q8_0: w = q * d, q int8               -> scale d,      no zero
- Q4_0: w = (q - 8) * d, q in 0..15     -> scale d,      zero -8 d
- Q4_1: w = q * d + m                   -> scale d,      zero m
- Q4_K: w = d * sc * q - dmin * mn      -> scale d * sc, zero -dmin mn (per sub-block of 32)
- MXFP4: w = E2M1(q) * 2^(e - 127)       -> codes q as E2M1 codes (IntWeight.e2m1), scale 2^(e - 128)
  (the codes' values doubled are whole numbers); tailrace's kernel only, PyTorch's have no table

tailrace's kernel (model/cpu/int_linear.py) keeps scales and zeros in float16, so Q8_0, Q4_0 and Q4_1
reach it exactly and Q4_K's products round to float16 (11 significant bits, far inside the 4-bit
codes' error); PyTorch's kernels, where tailrace's cannot run, keep them in bfloat16 (3 bits fewer).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, ReaderTensor

from tailrace.model.cpu import int_linear

from tailrace.model.decoder import registry

from tailrace.heap import release_freed
from tailrace.model.decoder.llama import LlamaForCausalLM, MoE, qkv_row_order
from tailrace.model.loading import gguf, gguf_file
from tailrace.model.loading.mxfp4 import e2m1_scales
from tailrace.model.quant import INT4_GROUP_SIZE, IntWeight, linear_for, takes_grouped

MAPPED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0, Q.MXFP4)
_K_SCALE_BYTES = 12  # Q4_K's 6-bit scales and mins of its 8 sub-blocks
# A layer's projection -> the GGUF tensors whose rows it stacks, in order.
_PROJECTION_PARTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
}
# A projection -> the one GGUF tensor that holds it whole where a file has not its parts: Phi-3's
# attn_qkv, and its ffn_up holding gate and up.
_FUSED_TENSORS = {"qkv_proj": "attn_qkv", "gate_up_proj": "ffn_up"}


@dataclass(frozen=True, slots=True)
class BlockProjection:
    """A projection the file's blocks serve: `parent.name` (`path` in the model), from the rows of
    `parts` stacked (one `expert`'s rows where they stack experts), then in `row_order`."""
    parent: nn.Module
    name: str
    path: str
    parts: tuple[ReaderTensor, ...]
    row_order: np.ndarray | None = None
    expert: int | None = None


def block_projections(model: LlamaForCausalLM, reader: GGUFReader) -> list[BlockProjection]:
    """Every projection (and the LM head) whose GGUF tensors share one mapped type: what
    use_gguf_blocks replaces. The loader leaves their float weights unread and untouched (an
    untouched torch.empty tensor holds no memory), so a quantized file larger than its float
    weights would be (Qwen3-30B-A3B's Q4_0, 17 GB against 61 GB in bfloat16) loads in its own size."""
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    qkv_order = None if config.rotary_dim == config.head_dim else qkv_row_order(config).numpy()
    found = []
    for i, layer in enumerate(model.model.layers):
        for (block, name), parts in _PROJECTION_PARTS.items():
            parent = getattr(layer, block)
            if isinstance(parent, MoE):
                if name == "gate_up_proj":
                    found += _expert_projections(parent, i, tensors)
                continue
            if not all(f"blk.{i}.{part}.weight" in tensors for part in parts):
                parts = (_FUSED_TENSORS[name],)  # Phi-3's
            found.append(BlockProjection(parent, name, f"model.layers.{i}.{block}.{name}",
                                         tuple(tensors[f"blk.{i}.{part}.weight"] for part in parts),
                                         qkv_order if name == "qkv_proj" else None))
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    found.append(BlockProjection(model, "lm_head", "lm_head", (head,)))
    return [p for p in found if _mapped(p.parts) and takes_grouped(
        sum(int(part.shape[1]) for part in p.parts), int(p.parts[0].shape[0]))]


def _expert_projections(moe: MoE, layer: int, tensors: dict[str, ReaderTensor]) -> list[BlockProjection]:
    """Each expert's projections from the file's stacked [experts, rows, blocks] tensors."""
    stacked = {part: tensors.get(f"blk.{layer}.ffn_{part}_exps.weight") for part in ("gate", "up", "down")}
    found = []
    for index, expert in enumerate(moe.experts):
        for name, parts in (("gate_up_proj", ("gate", "up")), ("down_proj", ("down",))):
            if all(stacked[part] is not None for part in parts):
                found.append(BlockProjection(expert, name, f"model.layers.{layer}.mlp.experts.{index}.{name}",
                                             tuple(stacked[part] for part in parts), expert=index))
    return found


def _mapped(parts: tuple[ReaderTensor, ...]) -> bool:
    """Whether the parts share one mapped type: rows are independent in every block format, so
    stacking raw rows is exact. A Q4_K_M file's Q6_K attn_v, for one, leaves its fused qkv_proj
    in float."""
    return len({part.tensor_type for part in parts}) == 1 and _mapped_type(parts[0].tensor_type)


def _mapped_type(tensor_type: Q) -> bool:
    """A type with a block-for-block mapping here: MXFP4's E2M1 codes only where tailrace's kernel runs."""
    return tensor_type in MAPPED_TYPES and (tensor_type != Q.MXFP4 or int_linear.available())


def use_gguf_blocks(model: LlamaForCausalLM, reader: GGUFReader,
                    projections: list[BlockProjection] | None = None) -> list[str]:
    """The `projections` (by default every one block_projections finds) replaced in place by
    quantized modules built from the file's blocks; the others keep the float weights the loader
    dequantized; a tied table stored in Q8_0 is then looked up in the head's codes (IntEmbedding).
    CPU only (the integer kernels are). Returns the replaced projections' paths."""
    rotary_heads = _rotary_heads(reader)
    replaced = []
    layer = None
    for p in block_projections(model, reader) if projections is None else projections:
        if p.path.split(".")[:3] != layer:
            # the last layer's decoding temporaries, which glibc would keep resident: a
            # Qwen3-30B-A3B load otherwise grew 2 GB past its weights
            release_freed()
            layer = p.path.split(".")[:3]
        current = getattr(p.parent, p.name)
        bias = None if current is None or current.bias is None else current.bias.detach()
        module = stacked_linear(list(p.parts), rotary_heads, bias, p.row_order, p.expert)
        if module is not None:
            setattr(p.parent, p.name, module)
            replaced.append(p.path)
            if is_table_head(p):
                model.model.embed_tokens = int_linear.IntEmbedding(module, model.dtype)
    release_freed()
    return replaced


def is_table_head(projection: BlockProjection) -> bool:
    """Whether `projection` is a tied head over a Q8_0 table on tailrace's kernel, an IntLinear
    whose int8 codes then serve the lookups too (IntEmbedding): a code times its block's scale in
    float32 is the value dequantizing the table gives, so the loader need not read the table."""
    table = projection.parts[0]
    return (projection.path == "lm_head" and table.name == "token_embd.weight" and table.tensor_type == Q.Q8_0
            and int_linear.available())


def stacked_linear(parts: list[ReaderTensor], rotary_heads: dict[str, int], bias: torch.Tensor | None,
                   row_order: np.ndarray | None = None, expert: int | None = None) -> nn.Module | None:
    """One projection over the parts' rows stacked (then in `row_order`, where given), of one
    `expert`'s rows where the parts stack experts, as long as the parts share one mapped type (else
    None), and a kernel takes the shape."""
    if not _mapped(tuple(parts)):
        return None
    rows = []
    for part in parts:
        kind = part.name.split(".")[-2]
        raw = np.asarray(part.data) if expert is None else np.asarray(part.data)[expert]
        rows.append(unpermute_rotary_rows(raw, rotary_heads[kind]) if kind in rotary_heads else raw)
    raw = np.concatenate(rows)
    if row_order is not None:
        raw = raw[row_order]
    block_size, type_size = GGML_QUANT_SIZES[parts[0].tensor_type]
    return quantized_linear(parts[0].tensor_type, raw, (raw.shape[0], raw.shape[1] // type_size * block_size), bias)


def _rotary_heads(reader: GGUFReader) -> dict[str, int]:
    """The head counts llama.cpp permuted q and k rows by, for the architectures it permutes (see
    gguf.checkpoint_tensors)."""
    arch = gguf_file.architecture(reader)
    entry = registry.GGUF_ARCHITECTURES.get(arch)
    if entry is None or not entry.gguf_permuted:
        return {}
    heads = gguf_file.metadata(reader, f"{arch}.attention.head_count")
    return {"attn_q": heads, "attn_k": gguf_file.metadata(reader, f"{arch}.attention.head_count_kv", heads)}


def quantized_linear(tensor_type: Q, raw: np.ndarray, shape: tuple[int, int],
                     bias: torch.Tensor | None = None) -> nn.Module | None:
    """The projection for a GGUF weight of `shape` (out, in) from its raw bytes; None when its type
    has no block-for-block mapping or no kernel takes its shape (load it as float)."""
    if not _mapped_type(tensor_type):
        return None
    return linear_for(decode_blocks(tensor_type, raw, shape), bias)


def decode_blocks(tensor_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> IntWeight:
    """The codes, scales and zeros of a Q8_0, Q4_0, Q4_1 or Q4_K weight with `shape` (out, in)."""
    q, scales, zeros = _DECODERS[tensor_type](_blocks(raw, tensor_type))
    out_features, in_features = shape
    groups = (out_features, in_features // INT4_GROUP_SIZE)
    return IntWeight(torch.from_numpy(q).reshape(shape), torch.from_numpy(scales).reshape(groups),
                     None if zeros is None else torch.from_numpy(zeros).reshape(groups), e2m1=tensor_type == Q.MXFP4)


def decode_q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _fp16(blocks, 0), None


def decode_q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _fp16(blocks, 0)
    return _nibbles(blocks[:, 2:], 16), d, -8 * d


def decode_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m = _fp16(blocks, 0), _fp16(blocks, 2)
    return _nibbles(blocks[:, 4:], 16), d, m


def decode_q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per sub-block of 32: [n, 256] codes and [n, 8] scales and zeros."""
    d, dmin = _fp16(blocks, 0)[:, None], _fp16(blocks, 2)[:, None]
    sc, mn = _q4_k_scales_and_mins(blocks[:, 4:4 + _K_SCALE_BYTES])
    return _nibbles(blocks[:, 4 + _K_SCALE_BYTES:], 32), d * sc, -dmin * mn


def decode_mxfp4(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    """ggml's block_mxfp4: an E8M0 exponent, then 16 bytes of E2M1 codes (as Q4_0's nibbles)."""
    return _nibbles(blocks[:, 1:], 16), e2m1_scales(torch.from_numpy(blocks[:, 0].copy())).numpy(), None


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


_DECODERS = {Q.Q8_0: decode_q8_0, Q.Q4_0: decode_q4_0, Q.Q4_1: decode_q4_1, Q.Q4_K: decode_q4_k,
              Q.MXFP4: decode_mxfp4}
