"""bfloat16 and float32 projections on AVX512 and AVX2 CPUs through tailrace's own kernel
(csrc/bf16_linear.cpp): for bfloat16 the dot product where the CPU has AVX512-BF16, two float32
FMAs a pair where it has not; for float32 one FMA a value.

The kernel streams the weights at the memory's rate for one decode row and keeps the property
the engine's exactness needs: a row's bits depend neither on the other rows of the batch nor on
the thread count (each output accumulates its K pairs in order, whatever the tiling).

A tied model's lookups read its packed head (`PackedEmbedding`), so the table is held once at
either dtype: oneDNN's blocked layout, which float32 keeps on CPUs without AVX512 (cpu_linear.py),
cannot be read row by row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tailrace.model.cpu.kernels import kernels
from tailrace.model.decoder.llama import Module

_LANES = 16


def available() -> bool:
    """The kernels are built (this CPU has AVX512 or AVX2, cpu_kernels.target)."""
    return kernels() is not None


def padded(values: torch.Tensor, length: int) -> torch.Tensor:
    """values with zero rows appended up to `length` rows."""
    out = values.new_zeros((length, *values.shape[1:]))
    out[: values.shape[0]] = values
    return out


def pair_layout(values: torch.Tensor, vectors: int) -> torch.Tensor:
    """[N, K] of any dtype -> [vectors, K / 2, 32]: 16 outputs a vector, K in adjacent pairs (lane
    l's pair at 2l, 2l + 1), zero rows padding up to `vectors` vectors. The layout of the bfloat16
    and the int8 kernels' weights, and AMX's VNNI tiles."""
    n, k = values.shape
    rows = padded(values, vectors * _LANES)
    return rows.view(vectors, _LANES, k // 2, 2).transpose(1, 2).contiguous().view(vectors, k // 2, 2 * _LANES)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> bfloat16 [ceil(N / 16), K / 2, 32] (pair_layout)."""
    return pair_layout(weight.to(torch.bfloat16), -(-weight.shape[0] // _LANES))


def pack_float32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> float32 [ceil(N / 16), K / 2, 32]: 16 outputs a vector, each K pair as two runs of
    16 lanes (lane l's even value at l, its odd one at 16 + l)."""
    n, k = weight.shape
    vectors = -(-n // _LANES)
    rows = padded(weight.float(), vectors * _LANES)
    return rows.view(vectors, _LANES, k // 2, 2).permute(0, 2, 3, 1).contiguous().view(vectors, k // 2, 2 * _LANES)


def kernel_takes(weight: torch.Tensor) -> bool:
    """The kernel reads K in pairs."""
    return weight.shape[1] % 2 == 0


class _KernelLinear(Module):
    """A projection through the kernel, its weight packed once by the dtype's `_pack`."""

    _pack: Callable[[torch.Tensor], torch.Tensor]

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.register_buffer("packed", self._pack(weight.detach()))
        # float32 and padded to whole vectors: the kernel adds it before rounding, 16 at a time
        self.register_buffer("bias", None if bias is None else padded(bias.detach().float(), self.packed.shape[0] * _LANES))
        self._linear = kernels().linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.packed, self.bias, self.out_features)


class Bf16Linear(_KernelLinear):
    _pack = staticmethod(pack)


class Float32Linear(_KernelLinear):
    _pack = staticmethod(pack_float32)


def kernel_linear(dtype: torch.dtype) -> type[Bf16Linear] | type[Float32Linear] | None:
    """The kernel's projection for weights and inputs of `dtype`, None for a dtype it does not take."""
    return {torch.bfloat16: Bf16Linear, torch.float32: Float32Linear}.get(dtype)


class PackedEmbedding(Module):
    """A tied model's embedding lookup read out of its packed head, so the table is held once:
    row n of the weight is lane n % 16 of vector n // 16, its K values in pairs (bfloat16: a
    pair's two values side by side; float32: 16 lanes apart)."""

    def __init__(self, head: Bf16Linear | Float32Linear) -> None:
        super().__init__()
        vectors, pairs, _ = head.packed.shape
        self.packed = packed = head.packed
        # [vectors, K / 2, lane, the pair's two values]
        self._lanes = (packed.view(vectors, pairs, _LANES, 2) if packed.dtype == torch.bfloat16
                       else packed.view(vectors, pairs, 2, _LANES).transpose(2, 3))
        self.width = 2 * pairs

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self._lanes[ids // _LANES, :, ids % _LANES, :]  # [..., K / 2, 2]
        return rows.reshape(*ids.shape, self.width)
