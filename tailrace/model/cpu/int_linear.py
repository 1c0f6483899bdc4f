"""int8 and int4 projections through tailrace's kernel (csrc/int_linear.cpp) on CPUs with AVX512-VNNI
or AVX2.

A weight arrives as integer codes with scales (and zero points) per output row or per block of 32
inputs: tailrace's `--quantization int8` / `int4`, or GGUF's blocks as they are (model/quant.py and
model/loading/gguf_quant.py make them), K-quants with their integer scales per 16 or 32 inputs
under a float16 scale per super-block. The codes are packed once here, in the kernel's order, and
are all the model holds of the weight: 1 byte a weight for int8, half a byte for 4-bit codes plus
a bit plane for each bit above 4, and the scales.

Like bf16_linear, the kernel gives each row the same bits whatever the batch or thread count.
"""

from __future__ import annotations

import torch
from torch import nn

from tailrace.model.cpu.bf16_linear import padded, pair_layout
from tailrace.model.cpu.kernels import kernels, target
from tailrace.model.decoder.llama import Module

_LANES = 16
_TILE_VECTORS = 4  # the kernel's outputs per tile are 4 vectors: whole tiles only
TILE_ROWS = _LANES * _TILE_VECTORS
BLOCK = 32  # inputs per activation scale, and per weight group where the scales are grouped


def available() -> bool:
    """The kernels built, and this CPU has the integer dot products they run on: AVX512-VNNI, or
    AVX2's in the x86-64-v3 build (csrc/avx2.h)."""
    return kernels() is not None and (target() == "avx2" or torch.cpu._is_vnni_supported())


def takes(in_features: int) -> bool:
    return in_features % BLOCK == 0


def _vectors(out_features: int) -> int:
    tiles = -(-out_features // (_LANES * _TILE_VECTORS))
    return tiles * _TILE_VECTORS


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 codes -> [NV, K / 2, 32] int8 (bf16_linear's pair layout); [N, K] 4-bit codes
    (uint8, 0..15) -> [NV, K / 8, 64] uint8: run r of vector v holds 4 bytes a lane, byte j of lane
    l the codes of output 16 v + l at inputs 8 r + j (low nibble) and 8 r + 4 + j (high). NV: whole
    tiles."""
    n, k = codes.shape
    if codes.dtype == torch.int8:
        return pair_layout(codes, _vectors(n))
    runs = padded(codes, _vectors(n) * _LANES).view(-1, _LANES, k // 8, 2, 4)
    return (runs[:, :, :, 0] | (runs[:, :, :, 1] << 4)).transpose(1, 2).reshape(-1, k // 8, 4 * _LANES).contiguous()


def pack_high(codes: torch.Tensor, planes: int) -> torch.Tensor:
    """[N, K] codes of 4 + `planes` bits -> their bits 4.. as [NV, K / 8, planes, 2] int64 byte
    masks: mask (k, h) of run r of vector v has bit 4 l + j set where bit 4 + k of the code of output
    16 v + l at input 8 r + 4 h + j is, the byte pack_codes puts that code's low nibble in (of the
    run's low nibbles for h = 0, its high ones for h = 1)."""
    n, k = codes.shape
    runs = padded(codes >> 4, _vectors(n) * _LANES).view(-1, _LANES, k // 8, 2, 4)  # [v, l, r, h, j]
    bits = torch.stack([(runs >> plane) & 1 for plane in range(planes)], dim=3)  # [v, l, r, k, h, j]
    bits = bits.permute(0, 2, 3, 4, 1, 5).reshape(-1, k // 8, planes, 2, 8, 8)  # 64 bits, 4 l + j, as 8 bytes
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.to(torch.uint8) * weights).sum(-1, dtype=torch.uint8).contiguous().view(torch.int64).squeeze(-1)


def pack_scales(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """[N, G] -> [NV / 4, G, 4, 16] in `dtype`: output n at lane n % 16 of vector n // 16, a tile's 4
    vectors side by side group by group (one run a tile reads), zero-padded to whole tiles."""
    rows = padded(values.to(dtype), _vectors(values.shape[0]) * _LANES)
    tiles = rows.view(-1, _TILE_VECTORS, _LANES, values.shape[1])
    return tiles.permute(0, 3, 1, 2).contiguous()


class IntLinear(Module):
    """y = x @ w.T + bias with w = codes * scales (+ zeros), the scales per row or per 32 inputs, or
    GGUF's K-quant super-blocks (quant.IntWeight says how they make w)."""

    # the packed weights, in the order the kernels take them (None where a form has none)
    BUFFERS = ("codes", "high", "scales", "zeros", "sub", "mins")

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 bias: torch.Tensor | None, e2m1: bool = False, sub: torch.Tensor | None = None,
                 mins: torch.Tensor | None = None, width: int = 4) -> None:
        """codes [out, in]: int8, or uint8 below 2^width (with `e2m1`, the index of an E2M1 value,
        held as float4_e2m1fn_x2 pairs: the kernel's mark); scales and zeros [out, 1 or in / 32], or
        per super-block under `sub` and `mins` [out, in / 32 or in / 16] int8."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        packed = pack_codes(codes & 0x0F if width > 4 else codes)
        self.register_buffer("codes", packed.view(torch.float4_e2m1fn_x2) if e2m1 else packed)
        self.register_buffer("high", pack_high(codes, width - 4) if width > 4 else None)
        self.register_buffer("scales", pack_scales(scales))
        self.register_buffer("zeros", None if zeros is None else pack_scales(zeros))
        self.register_buffer("sub", None if sub is None else pack_scales(sub, torch.int8))
        self.register_buffer("mins", None if mins is None else pack_scales(mins, torch.int8))
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self._linear = kernels().int_linear

    @classmethod
    def from_packed(cls, packed: list[torch.Tensor | None], shape: tuple[int, int],
                    bias: torch.Tensor | None) -> IntLinear:
        """The layer over buffers already in the kernel's layout ([codes, high, scales, zeros, sub,
        mins], as the kernels' pack_gguf gives them) for a weight of `shape` (out, in)."""
        layer = cls.__new__(cls)
        Module.__init__(layer)
        layer.out_features, layer.in_features = shape
        for name, buffer in zip(cls.BUFFERS, packed, strict=True):
            layer.register_buffer(name, buffer)
        layer.register_buffer("bias", None if bias is None else bias.detach().float())
        layer._linear = kernels().int_linear
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.codes, self.high, self.scales, self.zeros, self.sub, self.mins, self.bias,
                            self.out_features)


class IntLinearParts(Module):
    """Rows of different forms stacked in one projection (a Q4_K_M file's q and k in Q4_K beside its
    v in Q6_K), each part's IntLinear giving its outputs side by side. Every part but the last
    holds whole tiles of rows (TILE_ROWS), so that the fused forward knows each part's outputs from
    its codes."""

    def __init__(self, parts: list[IntLinear]) -> None:
        super().__init__()
        if any(part.out_features % TILE_ROWS for part in parts[:-1]):
            raise ValueError(f"every part but the last must hold whole tiles of {TILE_ROWS} rows")
        self.parts = nn.ModuleList(parts)
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class IntEmbedding(Module):
    """A lookup read out of integer codes as IntLinear packs them: a tied model's head's, so the
    table is held once, or a GGUF table's own blocks, never dequantized whole (Llama 3.2 1B's in a
    Q4_K_M file, Q6_K: 0.2 GB, where bfloat16 took 0.5). Row n's weights are computed in float32
    as quant.IntWeight.dequantize (and gguf's dequantization) computes them, then rounded to `dtype`
    once, as dequantizing the table at load rounded it."""

    def __init__(self, table: IntLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self.codes, self.dtype, self.rows = table.codes, dtype, table.out_features
        # what DecoderForward.set_outer takes, as IntLinear holds it
        self.buffers_in_order = [getattr(table, name) for name in IntLinear.BUFFERS]
        self.width = table.in_features
        self._rows = kernels().int_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._rows(ids, *self.buffers_in_order, self.rows).to(self.dtype)
