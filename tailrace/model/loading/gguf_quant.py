"""GGUF's quantized weights as tailrace's integer projections, from their blocks, without float weights.

Every mapped block type becomes an `IntWeight` whose weights are the block's own, as llama.cpp's
reference dequantization defines them: each block's codes go to the kernel as they are, with
their scales as the file stores them. 32-input blocks carry a float16 scale (and zero) per block:

- Q8_0: w = q * d, q int8                 -> scale d,      no zero
- Q4_0: w = (q - 8) * d, q in 0..15       -> scale d,      zero -8 d
- Q4_1: w = q * d + m                     -> scale d,      zero m
- Q5_0: w = (q - 16) * d, q in 0..31      -> scale d,      zero -16 d (5-bit codes)
- Q5_1: w = q * d + m, q in 0..31         -> scale d,      zero m (5-bit codes)
- MXFP4: w = E2M1(q) * 2^(e - 127)         -> codes q as E2M1 codes (IntWeight.e2m1), scale 2^(e - 128)
  (the codes' values doubled are whole numbers); tailrace's kernel only, PyTorch's have no table

K-quants' super-blocks of 256 keep their integer scales (and mins) per sub-block (IntWeight.sub):

- Q4_K, Q5_K: w = d * sc * q - dmin * m per 32   -> scale d, sub sc, zero -dmin, mins m (4-, 5-bit codes)
- Q6_K: w = d * sc * (q - 32) per 16             -> scale d, sub sc (6-bit codes)
- Q3_K: w = d * (sc - 32) * q, q in -4..3 per 16 -> scale d, sub sc - 32, codes q + 8
- Q2_K: w = d * sc * q - dmin * m per 16         -> scale d, sub sc, zero -dmin, mins m

Every float16 scale reaches the kernel as stored and each product d * sc is exact in float32, so
its products are those of the file's weights. The K-quants need tailrace's kernel; where it cannot
run, PyTorch's 4-bit kernel takes Q4_0, Q4_1 and Q4_K (scale products in bfloat16) and the others
load as float.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import ReaderTensor

from tailrace.model.cpu import int_linear
from tailrace.model.cpu.kernels import kernels

from tailrace.model.decoder import registry

from tailrace.heap import release_freed
from tailrace.model.decoder.config import ModelConfig
from tailrace.model.decoder.llama import LlamaForCausalLM, MoE, in_proj_split, qkv_row_order, qkv_rows
from tailrace.model.loading import gguf, gguf_file
from tailrace.model.loading.gguf_file import GgufFile
from tailrace.model.loading.mxfp4 import e2m1_scales
from tailrace.model.quant import INT4_GROUP_SIZE, IntWeight, linear_for, takes_grouped

logger = logging.getLogger(__name__)

MAPPED_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
# The types tailrace's kernels decode into their layout in one pass (csrc/gguf_blocks.cpp); the
# decoders here give the same fields for the others, and for PyTorch's kernels.
PACKED_IN_ONE_PASS = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The types PyTorch's kernels take too, where tailrace's cannot run.
_PORTABLE_TYPES = (Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0)
_K_SCALE_BYTES = 12  # Q4_K's and Q5_K's 6-bit scales and mins of their 8 sub-blocks
# A layer's projection -> the GGUF tensors whose rows it stacks, in order (a hybrid's Gated DeltaNet
# in_proj: Qwen3.5's b and a apart, or Qwen3-Next's ssm_ba holding both).
_PROJECTION_PARTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("linear_attn", "in_proj"): ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha"),
    ("linear_attn", "out_proj"): ("ssm_out",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
    ("mlp.shared_expert", "gate_up_proj"): ("ffn_gate_shexp", "ffn_up_shexp"),
    ("mlp.shared_expert", "down_proj"): ("ffn_down_shexp",),
    ("moe", "gate_up_proj"): (),  # Gemma 4's experts beside its MLP (_expert_projections)
    ("", "per_layer_input_gate"): ("inp_gate",),  # Gemma 4's per-layer input, the layer's own
    ("", "per_layer_projection"): ("proj",),
}
# A projection -> the GGUF tensors that hold it where a file has not its parts: Phi-3's attn_qkv,
# and its ffn_up holding gate and up; Qwen3-Next's in_proj with b and a in one tensor.
_FUSED_TENSORS = {"qkv_proj": ("attn_qkv",), "gate_up_proj": ("ffn_up",),
                  "in_proj": ("attn_qkv", "attn_gate", "ssm_ba")}


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


def block_projections(model: LlamaForCausalLM, reader: GgufFile) -> list[BlockProjection]:
    """Every projection (and the LM head) whose GGUF tensors share one mapped type: what
    use_gguf_blocks replaces. The loader leaves their float weights unread and untouched (an
    untouched torch.empty tensor holds no memory), so a quantized file larger than its float
    weights would be (Qwen3-30B-A3B's Q4_0, 17 GB against 61 GB in bfloat16) loads in its own size."""
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    orders = {"qkv_proj": _qkv_order(config), "in_proj": None}
    found = []
    for i, layer in enumerate(model.model.layers):
        for (block, name), parts in _PROJECTION_PARTS.items():
            parent = layer
            for attribute in filter(None, block.split(".")):
                parent = getattr(parent, attribute, None)
            if isinstance(parent, MoE):
                if name == "gate_up_proj":
                    found += _expert_projections(parent, f"model.layers.{i}.{block}", i, tensors)
                continue
            if parent is None or getattr(parent, name, None) is None:  # a hybrid's layer has one mixer; an MLP no
                continue  # shared expert; only Gemma 4's layers have per-layer inputs
            order = orders.get(name)
            if name == "qkv_proj":  # Gemma 4's: q alone where a layer reads another's K/V, no v where v is k
                parts = parts[:config.projected_parts(i)]
            if not all(f"blk.{i}.{part}.weight" in tensors for part in parts):
                parts = _FUSED_TENSORS.get(name, ("",))  # Phi-3's, Qwen3-Next's
                order = _grouped_ba_order(config) if name == "in_proj" else order
            if not all(f"blk.{i}.{part}.weight" in tensors for part in parts):
                continue
            found.append(BlockProjection(parent, name, ".".join(filter(None, (f"model.layers.{i}", block, name))),
                                         tuple(tensors[f"blk.{i}.{part}.weight"] for part in parts), order))
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    found.append(BlockProjection(model, "lm_head", "lm_head", (head,)))
    return [p for p in found if _mapped(p.parts) and takes_grouped(
        sum(int(part.shape[1]) for part in p.parts), int(p.parts[0].shape[0]))]


def _qkv_order(config: ModelConfig) -> np.ndarray | None:
    """The fused q/k/v projection's rows as stacked from attn_q, attn_k and attn_v: where q_proj
    holds each head's output gate after its q (Qwen3-Next's), the gates go after v; where part of
    each head rotates, q's and k's dims go in rotary order (llama.rotary_order). None: as stacked."""
    rows = np.arange(qkv_rows(config))
    if config.attention_output_gate:
        heads, dim = config.num_attention_heads, config.head_dim
        per_head = np.arange(heads)[:, None] * 2 * dim + np.arange(dim)  # each head's q rows in attn_q
        kv = np.arange(2 * heads * dim, rows.size)
        rows = np.concatenate((per_head.ravel(), kv, (per_head + dim).ravel()))
    if config.rotary_dim != config.head_dim:
        rows = rows[qkv_row_order(config).numpy()]
    return None if np.array_equal(rows, np.arange(rows.size)) else rows


def _grouped_ba_order(config: ModelConfig) -> np.ndarray:
    """Gated DeltaNet's in_proj rows as stacked from attn_qkv, attn_gate and Qwen3-Next's ssm_ba
    (per q/k head group: its value heads' b, then their a): all b, then all a."""
    first = sum(in_proj_split(config)[:2])  # q/k/v and z
    groups, per = config.linear_key_heads, config.linear_value_heads // config.linear_key_heads
    group_rows = first + np.arange(groups)[:, None] * 2 * per + np.arange(per)
    return np.concatenate((np.arange(first), group_rows.ravel(), (group_rows + per).ravel()))


def _expert_projections(moe: MoE, path: str, layer: int, tensors: dict[str, ReaderTensor]) -> list[BlockProjection]:
    """Each expert's projections from the file's stacked [experts, rows, blocks] tensors (gate and
    up apart, or one tensor of both: Gemma 4's)."""
    stacked = {part: tensors.get(f"blk.{layer}.ffn_{part}_exps.weight") for part in ("gate", "up", "gate_up", "down")}
    gate_up = ("gate_up",) if stacked["gate_up"] is not None else ("gate", "up")
    found = []
    for index, expert in enumerate(moe.experts):
        for name, parts in (("gate_up_proj", gate_up), ("down_proj", ("down",))):
            if all(stacked[part] is not None for part in parts):
                found.append(BlockProjection(expert, name, f"{path}.experts.{index}.{name}",
                                             tuple(stacked[part] for part in parts), expert=index))
    return found


def _mapped(parts: tuple[ReaderTensor, ...]) -> bool:
    """Whether every part has a mapped type: rows are independent in every block format, so stacking
    raw rows of one type is exact, and parts of different types (a Q4_K_M file's Q4_K attn_q and
    attn_k beside its Q6_K attn_v) are IntLinearParts on tailrace's kernel."""
    types = {part.tensor_type for part in parts}
    return all(_mapped_type(t) for t in types) and (len(types) == 1 or int_linear.available())


def _mapped_type(tensor_type: Q) -> bool:
    """A type with a block-for-block mapping here: beyond the portable ones, where tailrace's kernel runs."""
    return tensor_type in MAPPED_TYPES and (tensor_type in _PORTABLE_TYPES or int_linear.available())


def lookup_table(reader: GgufFile, name: str = "token_embd.weight") -> ReaderTensor | None:
    """The embedding table `name` (or Gemma 4's per-layer table, per_layer_token_embd: 2.3G values
    in E2B) where its lookups read its blocks (IntEmbedding) rather than a dequantized copy: a
    mapped type, on tailrace's kernel."""
    table = next((t for t in reader.tensors if t.name == name), None)
    if table is None or not int_linear.available() or not _mapped_type(table.tensor_type) \
            or not int_linear.takes(int(table.shape[0])):
        return None
    return table


def use_gguf_blocks(model: LlamaForCausalLM, reader: GgufFile, projections: list[BlockProjection] | None = None,
                    table: ReaderTensor | None = None, per_layer_table: ReaderTensor | None = None) -> list[str]:
    """The `projections` (by default every one block_projections finds) replaced in place by
    quantized modules built from the file's blocks; the others keep the float weights the loader
    dequantized. Given the `table` (lookup_table's), the lookups read its codes (IntEmbedding):
    the head's where the head is that table tied, else its own; given Gemma 4's
    `per_layer_table`, its lookups read its codes likewise. CPU only (the integer kernels
    are). Returns the replaced projections' paths."""
    rotary_heads = _rotary_heads(reader)
    replaced, head_parts = [], ()
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
            if p.path == "lm_head":
                head_parts = p.parts
    if table is not None:
        tied = head_parts == (table,) and isinstance(model.lm_head, int_linear.IntLinear)
        codes = model.lm_head if tied else stacked_linear([table], {}, None)
        model.model.embed_tokens = int_linear.IntEmbedding(codes, model.dtype)
    if per_layer_table is not None:
        model.model.embed_tokens_per_layer = int_linear.IntEmbedding(stacked_linear([per_layer_table], {}, None),
                                                                     model.dtype)
    release_freed()
    logger.info("%s%s", describe_blocks(reader, replaced, table),
                "" if per_layer_table is None else f"; per-layer input lookups in the {per_layer_table.tensor_type.name} codes")
    return replaced


def describe_blocks(reader: GgufFile, replaced: list[str], table: ReaderTensor | None) -> str:
    """What the loader decided for the file's quantized matrices: which types run as stored, and
    what the others became."""
    served = Counter(t.tensor_type.name for t in reader.tensors if _mapped_type(t.tensor_type) and len(t.shape) >= 2)
    others = Counter(t.tensor_type.name for t in reader.tensors
                     if not _mapped_type(t.tensor_type) and t.tensor_type not in gguf.FLOAT_TYPES and len(t.shape) >= 2)
    text = (f"GGUF blocks served as stored: {len(replaced)} projections from the file's "
            f"{', '.join(f'{n} {name}' for name, n in sorted(served.items())) or 'no'} matrices; embedding lookups "
            f"{'in the ' + table.tensor_type.name + ' codes' if table is not None else 'in a dequantized table'}")
    if others:
        text += (f"; no kernel for {', '.join(f'{n} {name}' for name, n in sorted(others.items()))}: dequantized, "
                 f"then int8 per row")
    return text


def stacked_linear(parts: list[ReaderTensor], rotary_heads: dict[str, int], bias: torch.Tensor | None,
                   row_order: np.ndarray | None = None, expert: int | None = None) -> nn.Module | None:
    """One projection over the parts' rows stacked (then in `row_order`, where given), of one
    `expert`'s rows where the parts stack experts, as long as every part has a mapped type (else
    None) and a kernel takes the shape. Consecutive parts of one type stack into one IntLinear;
    where types differ, those go side by side (IntLinearParts), given no `row_order` across them
    and whole tiles of rows before the last."""
    if not _mapped(tuple(parts)):
        return None
    runs: list[tuple[Q, list[np.ndarray]]] = []
    for part in parts:
        kind = part.name.split(".")[-2]
        raw = np.asarray(part.data) if expert is None else np.asarray(part.data)[expert]
        raw = unpermute_rotary_rows(raw, rotary_heads[kind]) if kind in rotary_heads else raw
        if runs and runs[-1][0] == part.tensor_type:
            runs[-1][1].append(raw)
        else:
            runs.append((part.tensor_type, [raw]))
    if len(runs) > 1 and (row_order is not None or any(
            sum(r.shape[0] for r in rows) % int_linear.TILE_ROWS for _, rows in runs[:-1])):
        return None
    modules, first = [], 0
    for tensor_type, rows in runs:
        raw = rows[0] if len(rows) == 1 else np.concatenate(rows)  # one part: its view of the map, not a copy
        if row_order is not None:
            raw = raw[row_order]
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        part_bias = None if bias is None else bias[first:first + raw.shape[0]]
        modules.append(quantized_linear(tensor_type, raw, (raw.shape[0], raw.shape[1] // type_size * block_size),
                                        part_bias))
        first += raw.shape[0]
    if any(module is None for module in modules):
        return None
    return modules[0] if len(modules) == 1 else int_linear.IntLinearParts(modules)


def _rotary_heads(reader: GgufFile) -> dict[str, int]:
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
    if tensor_type in PACKED_IN_ONE_PASS and int_linear.available() and int_linear.takes(shape[1]):
        with warnings.catch_warnings():  # a read-only view of the file's map, which pack_gguf only reads
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(np.ascontiguousarray(raw, dtype=np.uint8).reshape(shape[0], -1))
        return int_linear.IntLinear.from_packed(kernels().pack_gguf(raw, int(tensor_type), shape[1]), shape, bias)
    return linear_for(decode_blocks(tensor_type, raw, shape), bias)


def decode_blocks(tensor_type: Q, raw: np.ndarray, shape: tuple[int, int]) -> IntWeight:
    """The IntWeight of a weight of a mapped type with `shape` (out, in)."""
    parts = _DECODERS[tensor_type](_blocks(raw, tensor_type))
    rows = shape[0]
    def per_row(values: np.ndarray | None) -> torch.Tensor | None:
        return None if values is None else torch.from_numpy(np.ascontiguousarray(values)).reshape(rows, -1)
    return IntWeight(per_row(parts.codes).reshape(shape), per_row(parts.scales), per_row(parts.zeros),
                     e2m1=tensor_type == Q.MXFP4, sub=per_row(parts.sub), mins=per_row(parts.mins), width=parts.width)


@dataclass(frozen=True, slots=True)
class Decoded:
    """One type's blocks as IntWeight's fields, a row of blocks each: codes [blocks, inputs],
    scales and zeros [blocks, 1 or per group], sub and mins [blocks, sub-blocks]."""
    codes: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None = None
    sub: np.ndarray | None = None
    mins: np.ndarray | None = None
    width: int = 4


def decode_q8_0(blocks: np.ndarray) -> Decoded:
    return Decoded(np.ascontiguousarray(blocks[:, 2:]).view(np.int8), _fp16(blocks, 0))


def decode_q4_0(blocks: np.ndarray) -> Decoded:
    d = _fp16(blocks, 0)
    return Decoded(_nibbles(blocks[:, 2:], 16), d, -8 * d)


def decode_q4_1(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 4:], 16), _fp16(blocks, 0), _fp16(blocks, 2))


def decode_q5_0(blocks: np.ndarray) -> Decoded:
    """ggml's block_q5_0: d, then code j's bit 4 in bit j of a 32-bit word, then Q4_0's nibbles."""
    d = _fp16(blocks, 0)
    return Decoded(_nibbles(blocks[:, 6:], 16) | (_bits(blocks[:, 2:6]) << 4), d, -16 * d, width=5)


def decode_q5_1(blocks: np.ndarray) -> Decoded:
    return Decoded(_nibbles(blocks[:, 8:], 16) | (_bits(blocks[:, 4:8]) << 4), _fp16(blocks, 0), _fp16(blocks, 2),
                   width=5)


def decode_q4_k(blocks: np.ndarray) -> Decoded:
    """d, dmin, the 8 sub-blocks' 6-bit scales and mins, then their nibbles."""
    sc, mn = _q4_k_scales_and_mins(blocks[:, 4:4 + _K_SCALE_BYTES])
    return Decoded(_nibbles(blocks[:, 4 + _K_SCALE_BYTES:], 32), _fp16(blocks, 0), -_fp16(blocks, 2), sc, mn)


def decode_q5_k(blocks: np.ndarray) -> Decoded:
    """Q4_K's fields with 32 bytes of high bits before the nibbles: code j of sub-block i has its
    bit 4 in bit i of byte j."""
    sc, mn = _q4_k_scales_and_mins(blocks[:, 4:4 + _K_SCALE_BYTES])
    high = blocks[:, 4 + _K_SCALE_BYTES:36 + _K_SCALE_BYTES]
    high_bits = (high[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1  # [blocks, sub-block, j]
    codes = _nibbles(blocks[:, 36 + _K_SCALE_BYTES:], 32) | (high_bits.reshape(len(blocks), -1) << 4)
    return Decoded(codes, _fp16(blocks, 0), -_fp16(blocks, 2), sc, mn, width=5)


def decode_q6_k(blocks: np.ndarray) -> Decoded:
    """128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, d. Each half of 128 codes
    takes 64 low bytes (low nibbles first, then high) and 32 high bytes (their bit pairs 0..3 for
    its runs of 32)."""
    low = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8)[None, None, :, None]
    high = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]
    codes = (low & 0x0F).reshape(len(blocks), -1) | ((high & 0x03).reshape(len(blocks), -1) << 4)
    return Decoded(codes, _fp16(blocks, 208), sub=np.ascontiguousarray(blocks[:, 192:208]).view(np.int8), width=6)


def decode_q3_k(blocks: np.ndarray) -> Decoded:
    """32 bytes of high bits (code j of run i: bit i of byte j, set for q >= 0), 64 of 2-bit
    codes (runs of 32 from bits 0..6 of 32 bytes), 12 of 6-bit scales less 32, d. q = low - 4 where
    the high bit is clear; the codes are kept as q + 8, the offset the kernel takes away."""
    low = (blocks[:, 32:96].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    high = (blocks[:, :32].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = low.reshape(len(blocks), -1) + (high.reshape(len(blocks), -1) << 2) + 4
    packed = blocks[:, 96:108]
    low_scales = (packed[:, None, 0:8] >> np.array([0, 4], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 0x0F
    high_scales = (packed[:, None, 8:12] >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, :, None]).reshape(-1, 16) & 3
    sub = (low_scales | (high_scales << 4)).astype(np.int8) - 32
    return Decoded(codes, _fp16(blocks, 108), sub=sub)


def decode_q2_k(blocks: np.ndarray) -> Decoded:
    """16 bytes of scales (low nibble) and mins (high), 64 of 2-bit codes (as Q3_K's), d, dmin."""
    codes = (blocks[:, 16:80].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[None, None, :, None]) & 3
    packed = blocks[:, :16]
    return Decoded(codes.reshape(len(blocks), -1), _fp16(blocks, 80), -_fp16(blocks, 82),
                   (packed & 0x0F).astype(np.int8), (packed >> 4).astype(np.int8))


def decode_mxfp4(blocks: np.ndarray) -> Decoded:
    """ggml's block_mxfp4: an E8M0 exponent, then 16 bytes of E2M1 codes (as Q4_0's nibbles)."""
    return Decoded(_nibbles(blocks[:, 1:], 16), e2m1_scales(torch.from_numpy(blocks[:, 0].copy())).numpy())


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4: sub-blocks 0-3 have 6-bit scales in bytes 0-3 and mins in 4-7;
    4-7 have their low 4 bits in bytes 8-11 (scale low, min high) and their top 2 bits in the top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    low, high, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    sc = np.concatenate((low & 0x3F, (extra & 0x0F) | ((low >> 6) << 4)), axis=1)
    mn = np.concatenate((high & 0x3F, (extra >> 4) | ((high >> 6) << 4)), axis=1)
    return sc.astype(np.int8), mn.astype(np.int8)


def _nibbles(packed: np.ndarray, chunk: int) -> np.ndarray:
    """Each run of `chunk` bytes holds 2 * chunk codes: its low nibbles first, then its high ones."""
    runs = packed.reshape(packed.shape[0], -1, 1, chunk)
    return np.concatenate((runs & 0x0F, runs >> 4), axis=2).reshape(packed.shape[0], -1)


def _bits(words: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian 32-bit word -> its 32 bits, bit j at j."""
    return np.unpackbits(words, axis=1, bitorder="little")


def _fp16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at byte `offset` of every block, as float32 [blocks, 1]."""
    return np.ascontiguousarray(blocks[:, offset:offset + 2]).view(np.float16).astype(np.float32)


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


_DECODERS = {Q.Q8_0: decode_q8_0, Q.Q4_0: decode_q4_0, Q.Q4_1: decode_q4_1, Q.Q5_0: decode_q5_0,
              Q.Q5_1: decode_q5_1, Q.Q2_K: decode_q2_k, Q.Q3_K: decode_q3_k, Q.Q4_K: decode_q4_k,
              Q.Q5_K: decode_q5_k, Q.Q6_K: decode_q6_k, Q.MXFP4: decode_mxfp4}
